"""The GPU checksum kernel: what its first use costs a fresh process (seconds, RSS growth), and
how fast it runs by block shape (threads x 32-bit words per thread) on the large tensors of the
benchmark's training state, each shape checked against the host's CRC.

    python benchmarks/gpucrc_probe.py [SIZE_GIB]   (CUDA; GPUCRC_SHAPES=256x256,512x128)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from ckptstream import _checksum, _gpucrc
from ckptstream.bench.state import StateSpec, build_state

SHAPES = [tuple(int(n) for n in s.split("x")) for s in os.environ.get(
    "GPUCRC_SHAPES", "128x256,256x64,256x256,256x1024,512x128,512x256,1024x64").split(",")]


def use(lanes: int, words: int) -> None:
    """Build the kernel with this block shape from here on."""
    _gpucrc.LANES, _gpucrc.WORDS = lanes, words
    _gpucrc.BLOCK = lanes * words * 4
    _gpucrc.GPU_UP_TO = _gpucrc.BLOCK * _gpucrc._SHIFTS**2
    _gpucrc._kernels.clear()


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 2**10


def first_use() -> None:
    """In a fresh process, CUDA already in use: build, load and self-test the kernel."""
    device = torch.device("cuda", 0)
    torch.zeros(1, device=device)
    rss, start = rss_mib(), time.perf_counter()
    ok = _gpucrc.usable(device)
    print(f"first use: {time.perf_counter() - start:.2f} s, RSS +{rss_mib() - rss:.0f} MiB, usable {ok}", flush=True)


def large_tensors(state: object) -> list[torch.Tensor]:
    """The state's tensors the kernel takes, as flat bytes."""
    out: list[torch.Tensor] = []
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack += item.values()
        elif isinstance(item, (list, tuple)):
            stack += item
        elif isinstance(item, torch.Tensor) and _gpucrc.eligible(b := item.reshape(-1).view(torch.uint8)):
            out.append(b)
    return out


def main() -> None:
    if sys.argv[1:] == ["--first-use"]:
        first_use()
        return
    for _ in range(2):
        subprocess.run([sys.executable, __file__, "--first-use"], check=True)
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 8.0
    flat = large_tensors(build_state(StateSpec(size_bytes=int(gib * 2**30), tensors=0, tensor_kib=0, seed=1), "cuda"))
    total = sum(b.numel() for b in flat)
    check = flat[:3] + flat[-3:]
    expected = [_checksum.crc_of(b.cpu().numpy().tobytes()) for b in check]
    print(f"{len(flat)} tensors, {total / 2**30:.2f} GiB", flush=True)
    for lanes, words in SHAPES:
        use(lanes, words)
        ok = _gpucrc.usable(flat[0].device) and _gpucrc.crcs(check) == expected
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            _gpucrc.crcs(flat)  # waits for the result, as loads do
            best = min(best, time.perf_counter() - start)
        print(f"{lanes:5} threads x {words:4} words: {total / best / 1e9:7.1f} GB/s "
              f"({best * 1e3:.1f} ms){'' if ok else '  WRONG'}", flush=True)


if __name__ == "__main__":
    main()
