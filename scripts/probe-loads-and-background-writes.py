"""Loads and background writes on a GPU machine, in one call: what limits each, mechanism by mechanism.

1. Background writes inside a training loop whose host thread runs ahead of the GPU (10 x
   Linear(8192) fp32 + AdamW, bf16 autocast): the time until a `save_async(mode="device")` is
   durable, against a sync save, with the writer's threads in the training process (as shipped,
   with a shorter GIL switch interval, with fewer larger buffers) and in a second process fed the
   snapshot's CUDA IPC handles.
2. Loads of one file into the GPU, hot and cold: ckptstream.load under several staging shapes;
   bare pipelines of Python threads (pread into pinned buffers, H2D on a stream per thread) in
   several layouts (chunks taken in turn on one descriptor, one descriptor per thread, one
   contiguous range per thread, readahead advised); O_DIRECT; InstantTensor's buffered backend
   and kvikio where their wheels are installed.

Run from the repository root: PYTHONPATH=src python scripts/probe-loads-and-background-writes.py
(PROBE_GIB: the load file's size, default 4; PROBE_LIMIT: seconds, default 420; PROBE_PARTS:
"writes,loads"). Every figure is printed as it is measured.
"""
import os
import sys
import threading
import time

import torch
import torch.multiprocessing as mp

import ckptstream
from ckptstream import Settings
from ckptstream.bench.cache import fadvise_out

MiB, GiB = 1 << 20, 1 << 30
T0 = time.monotonic()
LIMIT = float(os.environ.get("PROBE_LIMIT", "420"))
D = os.environ.get("PROBE_DIR", "/tmp/probe")
PARTS = os.environ.get("PROBE_PARTS", "writes,loads").split(",")
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def say(*a):
    print(f"[{time.monotonic() - T0:6.1f}s]", *a, flush=True)


def left():
    return LIMIT - (time.monotonic() - T0)


def sync():
    if CUDA:
        torch.cuda.synchronize()


# --- 1. background writes in a training loop ------------------------------------------------------

def worker_main(q_in, q_out, d):
    """The writer process: opens the snapshot's tensors from their CUDA IPC handles and saves them."""
    import torch
    import ckptstream
    torch.empty(1, device="cuda")
    ckptstream.save({"x": torch.randn(1 << 22, device="cuda")}, os.path.join(d, "warm.safetensors"))  # pinned pool
    q_out.put("ready")
    while True:
        item = q_in.get()
        if item is None:
            return
        path, snap = item
        t = time.perf_counter()
        try:
            ckptstream.save(snap, path)
            q_out.put(("ok", time.perf_counter() - t))
        except Exception as e:  # noqa: BLE001
            q_out.put(("error", repr(e)))
        del snap, item


def writes():
    layers, width, batch = 10, 8192, int(os.environ.get("PROBE_BATCH", "16384"))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randn(batch, width, device=DEV)

    def step():
        with torch.autocast(DEV, dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    sync()
    t = time.perf_counter()
    for _ in range(10):
        step()
    host = time.perf_counter() - t
    sync()
    plain = (time.perf_counter() - t) / 10
    say(f"loop: {plain * 1e3:.1f} ms per step; the host issued 10 steps in {host:.2f} s")
    state = {}
    for name, p in model.named_parameters():
        st = opt.state[p]
        state[f"w.{name}"], state[f"m.{name}"], state[f"v.{name}"] = p, st["exp_avg"], st["exp_avg_sq"]
    size = sum(t.numel() * t.element_size() for t in state.values())
    path = os.path.join(D, "loop.safetensors")
    sync()
    t = time.perf_counter()
    ckptstream.save(state, path)
    sync_s = time.perf_counter() - t
    say(f"sync save of {size / GiB:.2f} GiB: {sync_s:.2f} s ({size / sync_s / 1e9:.2f} GB/s)")
    t = time.perf_counter()
    ckptstream.save(state, path)
    sync_s = time.perf_counter() - t
    say(f"sync save again: {sync_s:.2f} s")

    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=worker_main, args=(q_in, q_out, D), daemon=True)
    proc.start()

    def in_process(settings=None, interval=None):
        def begin():
            old = sys.getswitchinterval()
            if interval:
                sys.setswitchinterval(interval)
            h = ckptstream.save_async(state, path, mode="device", settings=settings)

            def durable():
                h.result()
                sys.setswitchinterval(old)
                return h.seconds_to_durable
            return h.done, durable
        return begin

    def other_process():
        t0 = time.perf_counter()
        snap = {k: v.detach().clone() for k, v in state.items()}
        ev = torch.cuda.Event()
        ev.record()
        out = {}

        def send():
            ev.synchronize()
            q_in.put((path, snap))
            out["reply"] = q_out.get()
            out["durable"] = time.perf_counter() - t0
            snap.clear()
        th = threading.Thread(target=send, daemon=True)
        th.start()

        def durable():
            th.join()
            return out["durable"] if out["reply"][0] == "ok" else out["reply"]
        return (lambda: not th.is_alive()), durable

    variants = [("save_async device, as shipped", in_process()),
                ("save_async device, switch interval 0.5 ms", in_process(interval=0.0005)),
                ("save_async device, 64 MiB x 4 buffers, 4 threads",
                 in_process(Settings(buffer_size=64 * MiB, num_buffers=4, io_threads=4))),
                ("save in a second process (CUDA IPC)", lambda: other_process())]
    ready = q_out.get(timeout=120)
    say(f"writer process: {ready}")
    steps = 60
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    base = time.perf_counter() - t
    say(f"{steps} plain steps: {base:.2f} s")
    for name, begin in variants:
        if left() < 60:
            say("out of time")
            break
        sync()
        t = time.perf_counter()
        for _ in range(10):
            step()  # the host runs ahead again
        c = time.perf_counter()
        done, durable = begin()
        call = time.perf_counter() - c
        n = 1
        for _ in range(steps - 10):
            step()
            n += 1
        extra = 0
        while not done() and extra < 400:
            step()
            extra += 1
        sync()
        wall = time.perf_counter() - t
        d = durable()
        lost = wall - base * (steps + extra) / steps
        say(f"{name}: durable after {d if isinstance(d, tuple) else f'{d:.2f} s = {d / sync_s:.2f}x sync'}; "
            f"call {call * 1e3:.1f} ms; loop lost {lost:.2f} s over {steps + extra} steps")
    q_in.put(None)
    proc.join(30)
    del state, opt, model, x
    torch.cuda.empty_cache()
    os.unlink(path)


# --- 2. loads -------------------------------------------------------------------------------------

def bare(path, size, threads, chunk, layout, *, advise=False, own_fd=False, direct=False, dst=None):
    """pread into pinned buffers (two per thread), each copied to ``dst`` on the thread's stream.
    layout: "turns" (chunk k to thread k % threads) or "ranges" (thread i reads its own contiguous
    range sequentially)."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    shared = os.open(path, flags)
    fds = [os.open(path, flags) if own_fd else shared for _ in range(threads)]
    if advise:
        for fd in set(fds):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    def aligned():  # O_DIRECT needs page-aligned buffers
        raw = torch.empty(chunk + 4096, dtype=torch.uint8, pin_memory=CUDA)
        at = -raw.data_ptr() % 4096
        return raw[at:at + chunk]
    pins = [[aligned() for _ in range(2)] for _ in range(threads)]
    streams = [torch.cuda.Stream() for _ in range(threads)] if CUDA else [None] * threads
    nblk = size // chunk
    per = -(-nblk // threads)
    errors = []

    def run(i):
        try:
            blocks = range(i, nblk, threads) if layout == "turns" else range(i * per, min(nblk, (i + 1) * per))
            ev = [None, None]
            for j, k in enumerate(blocks):
                s = j % 2
                if ev[s] is not None:
                    ev[s].synchronize()
                p = pins[i][s]
                got = os.preadv(fds[i], [memoryview(p.numpy())], k * chunk)
                assert got == chunk, got
                if CUDA:
                    with torch.cuda.stream(streams[i]):
                        dst[k * chunk:(k + 1) * chunk].copy_(p, non_blocking=True)
                        e = torch.cuda.Event()
                        e.record()
                        ev[s] = e
                else:
                    dst[k * chunk:(k + 1) * chunk].copy_(p)
            if CUDA:
                streams[i].synchronize()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    t = time.perf_counter()
    for x in ts:
        x.start()
    for x in ts:
        x.join()
    dt = time.perf_counter() - t
    for fd in set(fds) | {shared}:
        os.close(fd)
    if errors:
        raise errors[0]
    return nblk * chunk / dt / 1e9


def loads():
    gib = float(os.environ.get("PROBE_GIB", "4"))
    nt = max(1, int(gib * GiB // (64 * MiB)))
    state = {f"t{i:03d}": torch.randn(16 * MiB, device=DEV) for i in range(nt)}
    n = sum(t.numel() * 4 for t in state.values())
    path = os.path.join(D, "ckpt.safetensors")
    sync()
    t = time.perf_counter()
    ckptstream.save(state, path)
    say(f"save {n / GiB:.1f} GiB: {n / (time.perf_counter() - t) / 1e9:.2f} GB/s")
    firsts = {k: state[k].clone() for k in ("t000", f"t{nt - 1:03d}")}
    del state
    size = os.path.getsize(path)
    whole = torch.empty(size // (64 * MiB) * (64 * MiB), dtype=torch.uint8, device=DEV)

    def cold():
        fadvise_out([path])

    def hot():
        with open(path, "rb", buffering=0) as f:
            while f.read(64 * MiB):
                pass

    from ckptstream._engine import engine as engine_mod, read as read_mod
    from ckptstream._storage import files as files_mod
    new_claims, new_reader = read_mod.ReadEngine.claims, files_mod.FileSource.reader

    def ck(settings=None, checksum=True, old=False, device=DEV):
        """old: chunks taken in turn on the one descriptor, as before this change"""
        read_mod.ReadEngine.claims = engine_mod.Engine.claims if old else new_claims
        files_mod.FileSource.reader = (lambda self: self) if old else new_reader
        sync()
        t = time.perf_counter()
        try:
            out = ckptstream.load(path, device=device, settings=settings, checksum=checksum, mmap=False)
        finally:
            read_mod.ReadEngine.claims, files_mod.FileSource.reader = new_claims, new_reader
        sync()
        dt = time.perf_counter() - t
        assert all(torch.equal(out[k].to(v.device), v) for k, v in firsts.items())
        return n / dt / 1e9

    peers = {}
    try:
        from ckptstream.bench.peers import instanttensor_loader
        import instanttensor  # noqa: F401
        it = instanttensor_loader(True)

        def it_load():
            sync()
            t = time.perf_counter()
            out = it(path, None, DEV, 1)
            sync()
            dt = time.perf_counter() - t
            assert all(torch.equal(out[k], v) for k, v in firsts.items())
            return n / dt / 1e9
        peers["instanttensor buffered"] = it_load
    except Exception as e:  # noqa: BLE001
        say("instanttensor: not usable:", repr(e)[:200])
    try:
        os.environ.setdefault("KVIKIO_COMPAT_MODE", "ON")
        os.environ.setdefault("KVIKIO_NTHREADS", "16")
        import kvikio
        say(f"kvikio {kvikio.__version__}: compat mode {kvikio.defaults.is_compat_mode_preferred()}, "
            f"{kvikio.defaults.num_threads()} threads, task {kvikio.defaults.task_size() >> 20} MiB")

        def kv_load():
            sync()
            t = time.perf_counter()
            with kvikio.CuFile(path, "r") as f:
                got = f.pread(whole, whole.numel(), 0).get()
            sync()
            dt = time.perf_counter() - t
            assert got == whole.numel()
            return got / dt / 1e9
        peers["kvikio pread (bytes only)"] = kv_load
    except Exception as e:  # noqa: BLE001
        say("kvikio: not usable:", repr(e)[:300])

    shapes = [(8, 16, 16)]
    bares = [(16, 64, "turns", {}), (16, 16, "turns", {})]
    hot()
    ck()
    say("hot loads into the GPU")
    for name, fn in [("ckptstream default", lambda: ck()), ("ckptstream checksum=False", lambda: ck(checksum=False)),
                     ("ckptstream before (turns, one fd, whole-chunk reads)", lambda: ck(old=True))] + [
            (f"ckptstream {b}MiBx{nb} t{th}", (lambda s: lambda: ck(s))(Settings(buffer_size=b * MiB, num_buffers=nb, io_threads=th)))
            for b, nb, th in shapes] + [
            (f"bare {th}x{c}MiB {lay} {kw}", (lambda a: lambda: bare(path, whole.numel(), a[0], a[1] * MiB, a[2], dst=whole, **a[3]))((th, c, lay, kw)))
            for th, c, lay, kw in bares] + list(peers.items()):
        if left() < 30:
            say("out of time")
            return
        try:
            r = [fn() for _ in range(3)]
            say(f"hot  {name:46s} " + " / ".join(f"{x:5.1f}" for x in r) + " GB/s")
        except Exception as e:  # noqa: BLE001
            say(f"hot  {name}: failed {e!r}"[:300])
    say("cold loads into the GPU (fadvise DONTNEED before each)")
    colds = [("ckptstream default", lambda: ck()),
             ("ckptstream before (turns, one fd)", lambda: ck(old=True)),
             ("ckptstream 8MiBx16 t16", lambda: ck(Settings(buffer_size=8 * MiB, num_buffers=16, io_threads=16))),
             ("ckptstream 16MiBx16 t16", lambda: ck(Settings(buffer_size=16 * MiB, num_buffers=16, io_threads=16))),
             ("ckptstream into CPU memory", lambda: ck(device="cpu")),
             ("ckptstream into CPU memory, before", lambda: ck(device="cpu", old=True))] + [
        (f"bare {th}x{c}MiB {lay} {kw}", (lambda a: lambda: bare(path, whole.numel(), a[0], a[1] * MiB, a[2], dst=whole, **a[3]))((th, c, lay, kw)))
        for th, c, lay, kw in [(8, 16, "turns", {}), (16, 2, "ranges", {"own_fd": True, "advise": True}),
                               (8, 2, "ranges", {"own_fd": True, "advise": True})]] + list(peers.items())
    for name, fn in colds:
        if left() < 20:
            say("out of time")
            return
        try:
            r = []
            for _ in range(3):
                cold()
                r.append(fn())
            say(f"cold {name:46s} " + " / ".join(f"{x:5.2f}" for x in r) + " GB/s")
        except Exception as e:  # noqa: BLE001
            say(f"cold {name}: failed {e!r}"[:300])


if __name__ == "__main__":
    os.makedirs(D, exist_ok=True)
    say(f"torch {torch.__version__}, {torch.cuda.get_device_name() if CUDA else 'no GPU'}, {os.cpu_count()} cores")
    for part, fn in (("loads", loads), ("writes", writes)):
        if part in PARTS:
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                import traceback
                traceback.print_exc()
                say(f"{part} failed: {e!r}")
    say("done")
