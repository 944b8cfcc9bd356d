"""Hot loads of the benchmark's GPT-like state into a GPU through the read engine, its copies
queued by address without the interpreter lock (``_engine/cudart.py``) or through torch, under
the default staging (128 MiB: 16 readers x 8 MiB on 16 cores) and larger ones, beside the
benchmark's hot pipeline ceiling and the machine's copy rates (run from the repository root on a
GPU machine: PYTHONPATH=src python scripts/probe-hot-gpu-engine.py; PROBE_GIB sets the size;
one run: docs/results/probe-hot-gpu-engine-h200.txt)."""
import os, time
import torch
import ckptstream
from ckptstream import Settings
from ckptstream._engine import streams
from ckptstream.bench.ceilings import Probe, copy_rates, host_copy_rate, pipeline_read
from ckptstream.bench.state import StateSpec, build_state, flat_tensors

MiB, GiB = 1 << 20, 1 << 30
T0, LIMIT = time.monotonic(), float(os.environ.get("PROBE_LIMIT", "120"))
D = os.environ.get("PROBE_DIR", "/tmp/probe-engine"); os.makedirs(D, exist_ok=True)
PATH = os.path.join(D, "gpt.safetensors")


def say(*a):
    print(f"[{time.monotonic() - T0:6.1f}s]", *a, flush=True)


spec = StateSpec(size_bytes=int(float(os.environ.get("PROBE_GIB", "8")) * GiB))
say(spec.summary())
state = build_state(spec, "cuda")
torch.cuda.synchronize()
ckptstream.save(state, PATH)
ref = flat_tensors(state)
N = sum(t.numel() * t.element_size() for t in ref.values())
del state
size = os.path.getsize(PATH)
with open(PATH, "rb") as f:
    while f.read(64 * MiB):
        pass  # into the page cache
say(f"saved {N / GiB:.2f} GiB, file {size / GiB:.2f} GiB")


class TorchCopies:
    """The engine's copies through torch (as where the CUDA runtime is not found)."""

    def __enter__(self):
        self.saved = streams.DEVICES.copies_by_address, streams.DEVICES.copier
        streams.DEVICES.copies_by_address = lambda: False
        streams.DEVICES.copier = lambda stream: None

    def __exit__(self, *exc):
        streams.DEVICES.copies_by_address, streams.DEVICES.copier = self.saved


def load(s, checksum=True, check=False):
    torch.cuda.synchronize(); t = time.perf_counter()
    out = ckptstream.load(PATH, device="cuda", settings=s, checksum=checksum)
    torch.cuda.synchronize(); dt = time.perf_counter() - t
    if check:
        got = flat_tensors(out)
        assert all(torch.equal(got[k], v) for k, v in ref.items()), "differs"
    del out
    return N / dt / 1e9


def variant(name, s=None, checksum=True, torch_copies=False):
    if time.monotonic() - T0 > LIMIT:
        say("time"); return
    try:
        if torch_copies:
            with TorchCopies():
                load(s, checksum, check=True)
                rates = [load(s, checksum) for _ in range(3)]
        else:
            load(s, checksum, check=True)
            rates = [load(s, checksum) for _ in range(3)]
        say(f"{name:52s} " + " / ".join(f"{r:.1f}" for r in rates) + " GB/s")
    except Exception as e:
        say(name, "failed", repr(e))


def settings(threads, count, block):
    return Settings(io_threads=threads, hot_io_threads=threads, num_buffers=count, buffer_size=block)


variant("default (copies by address)")
variant("default, checksum=False", checksum=False)
variant("default, copies through torch (8 readers x 16 MiB)", torch_copies=True)
variant("8 readers x 16 MiB x 8, by address", settings(8, 8, 16 * MiB))
variant("16 readers x 2 x 4 MiB, by address", settings(16, 32, 4 * MiB))
variant("16 readers x 1 x 8 MiB (the default's), by address", settings(16, 16, 8 * MiB))
variant("16 readers x 2 x 8 MiB (256 MiB), by address", settings(16, 32, 8 * MiB))
variant("16 readers x 2 x 16 MiB (512 MiB), by address", settings(16, 32, 16 * MiB))
variant("16 readers x 2 x 16 MiB (512 MiB), through torch", settings(16, 32, 16 * MiB), torch_copies=True)
dst = torch.empty(size, dtype=torch.uint8, device="cuda")
for threads, block in ((16, 16 * MiB), (8, 16 * MiB)):
    rates = [size / pipeline_read(PATH, size, Probe("pinned", threads, block), "cuda", dst) / 1e9 for _ in range(3)]
    say(f"bench's hot pipeline ceiling probe, {threads} thr x 2 x {block >> 20} MiB: "
        + " / ".join(f"{r:.1f}" for r in rates) + " GB/s")
del dst
say(f"host memory copy {host_copy_rate(1 << 30):.1f} GB/s; pinned copies " +
    ", ".join(f"{k} {v:.1f}" for k, v in copy_rates("cuda", 1 << 30).items()) + " GB/s")
say("done")
