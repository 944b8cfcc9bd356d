"""Where a checkpoint load's time goes: cold reads buffered vs O_DIRECT, hot reads by staging
settings with checksums on/off, and the pure read+checksum rate (``verify``, no device copies).

    python benchmarks/load_probe.py DIR [SIZE_GIB]   (CUDA, root for drop_caches; PROBE_COLD=0
                                                      skips the cold loads; PROBE_CONFIGS sets
                                                      the hot loads' staging settings)

Hot loads with checksums run as the package does them (large tensors checksummed on the GPU)
and all on the host, taking turns with the loads without checksums.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

import ckptstream
from ckptstream import _gpucrc
from ckptstream._buffers import POOL
from ckptstream.bench.state import StateSpec, build_state, empty_like_state

DEVICE = os.environ.get("PROBE_DEVICE", "cuda")
# threads x buffers x MiB per buffer, e.g. PROBE_CONFIGS=8x8x16,16x16x8
CONFIGS = [tuple(int(n) for n in c.split("x")) for c in os.environ.get("PROBE_CONFIGS", "8x8x16,12x12x16,16x16x8").split(",")]


GPU_FROM = _gpucrc.GPU_FROM
VARIANTS = [  # name, verify, tensors from this size checksummed on the GPU
    ("verify=True (large tensors on the GPU)", True, GPU_FROM),
    ("verify=True (all on the host)", True, 1 << 62),
    ("verify=False", False, GPU_FROM),
]


def drop_caches() -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        print("(page cache not dropped: not root)")


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    directory, gib = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 4.0
    state = build_state(StateSpec(size_bytes=int(gib * 2**30), tensors=0, tensor_kib=0, seed=1), DEVICE)
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    target = empty_like_state(state, DEVICE, resident=True)
    path = os.path.join(directory, "probe.safetensors")
    ckptstream.save(state, path)
    rate = lambda s: f"{nbytes / s / 1e9:6.2f} GB/s"  # noqa: E731
    print(f"state {nbytes / 2**30:.2f} GiB, {len(list(_tensors(state)))} tensors", flush=True)
    for rnd in range(2 if os.environ.get("PROBE_COLD", "1") != "0" else 0):
        for name, kw in (("buffered", {"direct_io": False}), ("O_DIRECT", {"direct_io": True})):
            for cfg in ({}, {"buffer_size": 16 << 20}):
                with ckptstream.settings(**kw, **cfg):
                    drop_caches()
                    s = timed(lambda: ckptstream.load_into(target, path))
                print(f"cold {rnd} {name:9} {cfg or 'defaults'}: {rate(s)}", flush=True)
    ckptstream.load_into(target, path)  # page cache warm from here on
    for threads, buffers, size in CONFIGS:
        with ckptstream.settings(io_threads=threads, num_buffers=buffers, buffer_size=size << 20):
            times: dict[str, list[float]] = {name: [] for name, _, _ in VARIANTS}
            for _ in range(5):  # the variants take turns: the machine's drift hits all alike
                for name, verify, _gpucrc.GPU_FROM in VARIANTS:
                    times[name].append(timed(lambda v=verify: ckptstream.load_into(target, path, verify=v)))
            _gpucrc.GPU_FROM = GPU_FROM
            for name, _, _ in VARIANTS:
                print(f"hot load_into {threads} thr {buffers} x {size} MiB {name}: median "
                      f"{rate(statistics.median(times[name]))}, best {rate(min(times[name]))}", flush=True)
            best = min(timed(lambda: ckptstream.verify(path)) for _ in range(3))
            print(f"hot verify (read + crc, no device) {threads} thr {buffers} x {size} MiB: {rate(best)}", flush=True)
            POOL.release_all()
    if _gpucrc.usable(torch.device(DEVICE)):
        flat = [b for b in (t.reshape(-1).view(torch.uint8) for t in _tensors(target)) if _gpucrc.eligible(b)]
        best = min(timed(lambda: _gpucrc.crcs(flat)) for _ in range(3))
        print(f"GPU checksum of the {len(flat)} large tensors, one launch: "
              f"{sum(b.numel() for b in flat) / best / 1e9:6.2f} GB/s", flush=True)
    big = torch.empty(os.path.getsize(path) // 4, device=DEVICE)
    for threads in (8, 16):
        with ckptstream.settings(io_threads=threads, num_buffers=threads):
            best = min(timed(lambda: ckptstream.file_to_device(path, big)) for _ in range(3))
        print(f"hot file_to_device one tensor, {threads} thr: {rate(best)}", flush=True)
    os.unlink(path)


def _tensors(state):  # type: ignore[no-untyped-def]
    from ckptstream._structure import walk

    return (v for _, v in walk(state) if isinstance(v, torch.Tensor))


if __name__ == "__main__":
    main()
