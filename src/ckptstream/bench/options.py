"""The command line of ``ckptstream bench`` and the resolved options of one run."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from typing import Any

import ckptstream
from ckptstream.errors import BenchError as BenchError  # the benchmark modules raise it from here

from .cache import Cold
from .formats import GiB, MiB
from .state import StateSpec
from .systems import DEFAULT, DEFAULT_RANKS, SYSTEMS

DEFAULT_SIZE_GIB = 0.25  # small enough for `make demo` on a laptop without a GPU
QUICK_SIZE_GIB = 1 / 128
QUICK_HOT_RUNS = 3  # hot loads per variant with --quick: a smoke test's figures, not a median to quote
LARGE = 2 * GiB  # from here on one run per figure by default: a large state's runs take minutes each
SWEEP_SIZE_GIB = 1.0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _ints(text: str) -> list[int]:
    values = [_positive(v) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``ckptstream bench`` (see docs/benchmarks.md)."""
    add = parser.add_argument
    add("--device", choices=("auto", "cpu", "cuda"), default="auto",
        help="where the state lives (auto: cuda when present)")
    add("--size-gib", type=float,
        help=f"GPT-like state per process (default {DEFAULT_SIZE_GIB}; --quick {QUICK_SIZE_GIB * 1024:g} MiB; "
             f"--sweep {SWEEP_SIZE_GIB:g})")
    add("--tensors", type=int, default=0, metavar="N", help="instead: N small fp32 tensors of --tensor-kib each")
    add("--tensor-kib", type=int, default=1, metavar="K", help="size of each of the --tensors (default 1 KiB)")
    add("--repeat", type=int,
        help="runs per figure; the median is reported (default 3; 1 for states over 2 GiB and for --sweep; "
             "with --training: checkpoints per system, default 2)")
    add("--dir", default=".", help="file system to measure: a temporary folder is made (and removed) there; or "
        "s3://bucket/prefix: save and load beside the S3 client's own upload and download (pip install "
        "'ckptstream[s3]'; the endpoint and keys from the standard AWS variables)")
    add("--systems", nargs="+", metavar="NAME",
        help=f"systems to run, of {sorted(SYSTEMS)} (default {' '.join(DEFAULT)}; with --ranks also dcp-stream)")
    add("--variants", nargs="+", metavar="LABEL",
        help="only these load variants of the systems run, by their row label (e.g. ckptstream; default: all)")
    add("--json", metavar="FILE", help="write every figure and the machine's description as JSON")
    add("--plot", metavar="FILE.png", help="draw a bar chart (needs matplotlib: pip install 'ckptstream[bench]')")
    add("--quick", action="store_true",
        help=f"tiny state, one run, one thread count, {QUICK_HOT_RUNS} hot loads per variant, for CI: the loads take "
             "seconds, but each system runs in a process of its own that imports torch (DCP: and its own modules), "
             "so a run takes a minute or more on a busy 2-core machine")
    add("--ranks", "--nproc-per-node", type=int, default=1, metavar="N",
        help="N processes saving and loading at once, one GPU each (gloo on the CPU)")
    add("--cold", choices=[c.value for c in Cold], default="auto",
        help="how loads are made cold (auto: drop_caches as root, else fadvise; none: warm loads)")
    add("--threads", type=_ints,
        help="thread counts of the raw disk ceilings' sweep (default 1,4,16,64; 1,4 below 8 cores)")
    add("--hot-threads", type=_ints,
        help="thread counts of the page-cache read ceiling (default 1,4,8,16, up to the core count)")
    add("--seed", type=int, default=0, help="seed of the random state")
    add("--hot-runs", type=_positive, metavar="N",
        help=f"hot loads per load variant, the median reported (default 9, --quick {QUICK_HOT_RUNS}; spread over the "
             "--repeat runs)")
    staging = parser.add_argument_group(
        "ckptstream's settings in this run (default: the library's, or CKPTSTREAM_* variables)")
    staging.add_argument("--buffer-mib", type=_positive, metavar="M", help="MiB per staging buffer (buffer_size)")
    staging.add_argument("--num-buffers", type=_positive, metavar="N", help="staging buffers (num_buffers)")
    staging.add_argument("--io-threads", type=_positive, metavar="T", help="I/O threads (io_threads)")
    training = parser.add_argument_group("what a training loop feels (--training): the stall of each way to save")
    training.add_argument("--training", action="store_true",
                          help="a GPT-like training loop sized to --size-gib: per save_async mode and peer, the time "
                               "the loop is blocked, its slowdown while a save is in flight, extra GPU memory, "
                               "peak RSS, time until durable")
    training.add_argument("--training-systems", nargs="+", metavar="NAME",
                          help="of sync, device, lazy, host, manager.device, torch.save+thread, dcp.async_save, "
                               "dcp.async_save+pinned (the default: these), nvrx.async_save "
                               "(nvidia-resiliency-ext, when named)")
    training.add_argument("--training-steps", type=_positive, metavar="N",
                          help="steps timed with and without one checkpoint, per system (default: enough "
                               "for the state written at 0.4 GB/s, from the first system's step time)")
    parser.add_argument("--export", action="store_true",
                        help="export_hf of a saved GPT-like state against a plain save of the same bytes, run pairs "
                             "alternating (--repeat pairs, default 5)")
    sweep = parser.add_argument_group("buffer sweep (--sweep): one large tensor through device_to_file/file_to_device")
    sweep.add_argument("--sweep", action="store_true",
                       help="sweep buffer size x count x I/O threads over one tensor of --size-gib")
    sweep.add_argument("--sweep-buffer-mib", type=_ints, default=[4, 8, 16, 32, 64],
                       help="buffer sizes in MiB (default 4,8,16,32,64)")
    sweep.add_argument("--sweep-num-buffers", type=_ints, default=[2, 4, 8], help="buffer counts (default 2,4,8)")
    sweep.add_argument("--sweep-io-threads", type=_ints, default=[1, 2, 4, 8],
                       help="I/O threads, up to the buffer count (default 1,2,4,8)")
    sweep.add_argument("--sweep-direct-io", choices=("auto", "on", "both"), default="auto",
                       help="loads with buffered reads (auto, the default), O_DIRECT reads (on), or both")


@dataclasses.dataclass(frozen=True)
class Options:
    device: str
    spec: StateSpec
    repeat: int
    dir: str
    systems: tuple[str, ...]
    json: str | None
    plot: str | None
    quick: bool
    ranks: int
    cold: Cold
    threads: tuple[int, ...]
    hot_threads: tuple[int, ...]
    sweep: bool
    sweep_axes: dict[str, list[int] | str]  # the values of each staging setting the sweep combines
    staging: dict[str, Any]  # ckptstream settings given on the command line (ints)
    training: bool = False
    training_systems: tuple[str, ...] | None = None
    training_steps: int | None = None
    hot_runs: int | None = None  # None: the worker's default
    variants: tuple[str, ...] = ()  # load variants to run, by label; () for all
    export: bool = False

    @property
    def total_bytes(self) -> int:
        return self.spec.nbytes() * self.ranks


def default_threads() -> list[int]:
    """1 to 64 threads (queue depth) for the disk ceilings: a virtual or networked disk may want
    many requests in flight; on a small machine more threads than a few only add minutes."""
    cores = os.cpu_count() or 1
    return [1, 4, 16, 64] if cores >= 8 else [1, 4]


def _device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA device is visible to torch (torch.cuda.is_available() is False)")
    return requested


def _systems(given: list[str] | None, ranks: int) -> tuple[str, ...]:
    if not given:
        return DEFAULT_RANKS if ranks > 1 else DEFAULT
    names = [n.strip() for item in given for n in item.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise BenchError(f"unknown system(s) {unknown}; known: {sorted(SYSTEMS)}")
    return tuple(dict.fromkeys(names))


def _variants(given: list[str] | None, systems: tuple[str, ...]) -> tuple[str, ...]:
    """The load variants asked for; each must be one of the chosen systems', and each system keeps one."""
    if not given:
        return ()
    labels = {name: [v.label for v in SYSTEMS[name].variants] for name in systems}
    unknown = sorted(set(given) - {label for found in labels.values() for label in found})
    if unknown:
        raise BenchError(f"--variants: unknown load variant(s) {unknown} of the systems {list(systems)}; known: "
                         f"{[label for found in labels.values() for label in found]}")
    empty = [name for name, found in labels.items() if not set(found) & set(given)]
    if empty:
        raise BenchError(f"--variants leaves {empty} without a load to run: name one of each system's "
                         f"({ {name: labels[name] for name in empty} })")
    return tuple(dict.fromkeys(given))


def _staging(args: argparse.Namespace) -> dict[str, Any]:
    """The ckptstream settings given on the command line, checked by ckptstream.Settings itself."""
    given = {"buffer_size": args.buffer_mib and args.buffer_mib * MiB, "num_buffers": args.num_buffers,
             "io_threads": args.io_threads}
    staging = {name: value for name, value in given.items() if value}
    try:
        with ckptstream.settings(**staging):  # checked as the run will apply them
            pass
    except (TypeError, ValueError) as e:
        raise BenchError(f"--buffer-mib / --num-buffers / --io-threads: {e}") from e
    return staging


def _repeat(args: argparse.Namespace, spec: StateSpec) -> int:
    """--repeat, or its default for the run asked for."""
    if args.training:
        return args.repeat or 2  # checkpoints per system, each with its own run without one
    if getattr(args, "export", False):
        return args.repeat or 5  # run pairs: the disk is noisy, the ratio wants several
    # one run per figure where runs are long: big states, and the sweep's dozens of configurations
    return args.repeat or (1 if args.quick or args.sweep or spec.nbytes() * args.ranks > LARGE else 3)


def resolve_options(args: argparse.Namespace) -> Options:
    """Options with every default filled in; raises BenchError for impossible requests."""
    size_gib = args.size_gib
    if size_gib is None:
        size_gib = QUICK_SIZE_GIB if args.quick else SWEEP_SIZE_GIB if args.sweep else DEFAULT_SIZE_GIB
    if size_gib <= 0:
        raise BenchError(f"--size-gib must be > 0, got {size_gib}")
    if args.tensors < 0 or args.tensor_kib < 1:
        raise BenchError("--tensors must be >= 0 and --tensor-kib >= 1")
    try:
        spec = StateSpec(int(size_gib * GiB), args.tensors, args.tensor_kib, args.seed)
    except ValueError as e:
        raise BenchError(str(e)) from e
    if args.ranks < 1:
        raise BenchError(f"--ranks must be >= 1, got {args.ranks}")
    device = _device(args.device)
    if device == "cuda" and args.ranks > 1:
        import torch

        if torch.cuda.device_count() < args.ranks:
            raise BenchError(f"--ranks {args.ranks} needs one GPU per rank; {torch.cuda.device_count()} visible")
    repeat = _repeat(args, spec)
    if repeat < 1:
        raise BenchError(f"--repeat must be >= 1, got {repeat}")
    url = args.dir.lower().startswith("s3://")  # an object store: see bench/objectstore.py
    if not url and not os.path.isdir(args.dir):
        raise BenchError(f"--dir {args.dir!r} is not a directory")
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # say so now, not after the run
        raise BenchError("--plot needs matplotlib, which is not installed: pip install 'ckptstream[bench]'")
    threads = args.threads or ([1] if args.quick else default_threads())
    # the page cache scales with threads further than a disk does
    hot = args.hot_threads or ([1] if args.quick else [t for t in (1, 4, 8, 16) if t <= (os.cpu_count() or 1)])
    axes: dict[str, list[int] | str] = {
        "buffer_mib": args.sweep_buffer_mib, "num_buffers": args.sweep_num_buffers,
        "io_threads": args.sweep_io_threads, "direct_io": args.sweep_direct_io,
    }
    systems = _systems(args.systems, args.ranks)
    return Options(device, spec, repeat, args.dir if url else os.path.abspath(args.dir), systems, args.json,
                   args.plot, args.quick, args.ranks, Cold(args.cold), tuple(threads), tuple(hot), args.sweep, axes,
                   _staging(args), args.training, tuple(args.training_systems) if args.training_systems else None,
                   args.training_steps, args.hot_runs or (QUICK_HOT_RUNS if args.quick else None),
                   _variants(args.variants, systems),
                   getattr(args, "export", False))
