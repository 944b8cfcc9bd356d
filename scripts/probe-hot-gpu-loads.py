"""Hot loads into a GPU: ckptstream.load under several staging shapes, and the bare pipeline of
Python threads with small chunks (run from the repository root on a GPU machine:
PYTHONPATH=src python scripts/probe-hot-gpu-loads.py)."""
import os, sys, threading, time
import torch
DEV = "cuda" if torch.cuda.is_available() else "cpu"
import ckptstream
from ckptstream import Settings
MiB = 1 << 20; GiB = 1 << 30
D = os.environ.get("PROBE_DIR", "/tmp/probe2"); os.makedirs(D, exist_ok=True)
NT = int(os.environ.get("PROBE_TENSORS", "64"))
PATH = os.path.join(D, "ckpt.safetensors")
T0 = time.monotonic(); LIMIT = float(os.environ.get("PROBE_LIMIT", "300"))
def say(*a): print(f"[{time.monotonic()-T0:6.1f}s]", *a, flush=True)
state = {f"t{i:03d}": torch.randn(16 * MiB, device=DEV) for i in range(NT)}
N = sum(t.numel() * 4 for t in state.values())
(torch.cuda.synchronize() if DEV == "cuda" else None)
t = time.perf_counter(); ckptstream.save(state, PATH); say(f"save default {N / (time.perf_counter() - t) / 1e9:.2f} GB/s ({N / GiB:.1f} GiB)")
for s in (Settings(buffer_size=8 * MiB, num_buffers=16, io_threads=16), Settings(buffer_size=16 * MiB, num_buffers=16, io_threads=16)):
    t = time.perf_counter(); ckptstream.save(state, PATH, settings=s)
    say(f"save {s.buffer_size >> 20}MiBx{s.num_buffers} t{s.io_threads} {N / (time.perf_counter() - t) / 1e9:.2f} GB/s")
ref = {k: v.clone() for k, v in state.items()}; del state
fd = os.open(PATH, os.O_RDONLY); size = os.fstat(fd).st_size
buf = bytearray(64 * MiB); mv = memoryview(buf)
for off in range(0, size, 64 * MiB): os.preadv(fd, [mv], off)  # into the page cache
os.close(fd)
def load(s, checksum=True):
    (torch.cuda.synchronize() if DEV == "cuda" else None); t = time.perf_counter()
    out = ckptstream.load(PATH, device=DEV, settings=s, checksum=checksum); (torch.cuda.synchronize() if DEV == "cuda" else None)
    dt = time.perf_counter() - t
    assert all(torch.equal(out[k], ref[k]) for k in ("t000", f"t{NT - 1:03d}"))
    del out; return N / dt / 1e9
variants = [("default", None)] + [(f"{b}MiBx{n} t{th}", Settings(buffer_size=b * MiB, num_buffers=n, io_threads=th))
    for b, n, th in ((16, 8, 8), (8, 16, 16), (8, 32, 16), (4, 32, 16), (4, 48, 24), (2, 32, 16), (2, 64, 32), (4, 64, 32), (1, 64, 32))]
load(None)
for name, s in variants:
    if time.monotonic() - T0 > LIMIT: say("time"); break
    try: r = [load(s) for _ in range(3)]
    except Exception as e: say(name, "failed", repr(e)); continue
    say(f"hot load {name:20s} " + " / ".join(f"{x:.1f}" for x in r) + " GB/s")
say(f"hot load default, checksum=False {load(None, False):.1f} / {load(None, False):.1f} GB/s")
# the bare pipeline, small chunks
def pipeline(threads, chunk, nbuf, shared_stream):
    fd = os.open(PATH, os.O_RDONLY)
    dst = torch.empty(size, dtype=torch.uint8, device=DEV)
    pins = [[torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(nbuf)] for _ in range(threads)]
    streams = [torch.cuda.Stream() for _ in range(threads)]; one = torch.cuda.Stream()
    nblk = size // chunk
    def r(i):
        ev = [None] * nbuf
        for j, k in enumerate(range(i, nblk, threads)):
            s = j % nbuf
            if ev[s] is not None: ev[s].synchronize()
            p = pins[i][s]; os.preadv(fd, [memoryview(p.numpy())], k * chunk)
            with torch.cuda.stream(one if shared_stream else streams[i]):
                dst[k * chunk:(k + 1) * chunk].copy_(p, non_blocking=True); e = torch.cuda.Event(); e.record(); ev[s] = e
        torch.cuda.synchronize()
    ts = [threading.Thread(target=r, args=(i,)) for i in range(threads)]
    t = time.perf_counter(); [x.start() for x in ts]; [x.join() for x in ts]; dt = time.perf_counter() - t
    os.close(fd); return nblk * chunk / dt / 1e9
for th, c, nb, sh in () if DEV == "cpu" else ((16, 8, 2, False), (16, 2, 2, False), (24, 2, 2, False), (32, 2, 2, False), (16, 4, 2, False),
                      (16, 2, 4, False), (32, 1, 2, False), (16, 2, 2, True), (12, 4, 3, False)):
    if time.monotonic() - T0 > LIMIT: say("time"); break
    r = [pipeline(th, c * MiB, nb, sh) for _ in range(2)]
    say(f"pipe {th}x{c}MiB x{nb}{' one stream' if sh else ''}: " + " / ".join(f"{x:.1f}" for x in r) + " GB/s")
say("done")
