"""Two questions on a GPU machine, in one call, the variants taking turns round by round (so that
the disk's and the host's drift falls on all alike); every figure printed as it is measured.

1. Hot loads into the GPU: the engine's one side stream per device, shared by the I/O threads
   (a thread refilling its buffer waits for every copy the others queued before its own),
   against side streams of each thread's own (``PerThreadStreams``, tried and not adopted:
   docs/benchmarks.md), next to bare Python pipelines and InstantTensor's buffered backend in
   the same process. (The run in docs/results/probe-side-streams-writer-h200.txt had the
   variant in the engine: its labels "now" and "before" read "tried" and "the engine" here.)
2. Background writes inside a training loop whose host thread runs ahead of the GPU (10 x
   Linear(8192) fp32 + AdamW, bf16 autocast, 7.5 GiB of state): the time until
   `save_async(mode="device")` is durable against a sync save of the same state taken in the same
   round, and the same save written by a second process fed the snapshot's CUDA IPC handles.
   ("lost" counts the steps still queued when the save ends alike for both: not the stall,
   which `ckptstream bench --training` measures.)

PYTHONPATH=src python scripts/probe-side-streams-and-writer.py   (PROBE_GIB, PROBE_ROUNDS,
PROBE_LIMIT seconds, PROBE_PARTS "loads,writes")
"""
import contextlib
import importlib.util
import os
import statistics
import sys
import threading
import time

import torch
import torch.multiprocessing as mp

import ckptstream
from ckptstream import Settings
from ckptstream._engine import streams as streams_mod

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("probe_lw", os.path.join(HERE, "probe-loads-and-background-writes.py"))
lw = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lw)  # bare(), worker_main(), say(), sync()
say, sync, MiB, GiB = lw.say, lw.sync, lw.MiB, lw.GiB
T0 = time.monotonic()
LIMIT = float(os.environ.get("PROBE_LIMIT", "300"))
ROUNDS = int(os.environ.get("PROBE_ROUNDS", "4"))
PARTS = os.environ.get("PROBE_PARTS", "loads,writes").split(",")
D = os.environ.get("PROBE_DIR", "/tmp/probe")
DEV = "cuda"


def worker_main(q_in, q_out, d):
    """The writer process: opens the snapshot's tensors from their CUDA IPC handles and saves them
    (defined here: a spawned process imports its target from the main script)."""
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
        try:
            ckptstream.save(snap, path)
            q_out.put(("ok",))
        except Exception as e:  # noqa: BLE001
            q_out.put(("error", repr(e)))
        del snap, item


def left():
    return LIMIT - (time.monotonic() - T0)


class PerThreadStreams(streams_mod.Streams):
    """The variant tried: side streams of each I/O thread's own (each waits only for its own
    copies), the device checksums on a stream that waits for all of them."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self._sides, self._lock, self._local = [], threading.Lock(), threading.local()

    def begin(self):
        pass  # each thread makes its own in copying()

    def copying(self):
        # outside the I/O threads (the load's device checksums): after every thread's copies
        after_all = not threading.current_thread().name.startswith("ckptstream-")
        with self._lock:
            earlier = list(self._sides) if after_all else []
            side = {d: streams_mod.DEVICES.new_stream(d) for d in self._ready}
            self._sides.append(side)
        for d, s in side.items():
            s.wait_event(self._ready[d])
            for other in earlier:
                s.wait_stream(other[d])
        self._local.side = side
        stack = contextlib.ExitStack()
        for s in side.values():
            stack.enter_context(streams_mod.DEVICES.use(s))
        stack.enter_context(torch.no_grad())
        return stack

    def record(self, devices):
        events = []
        for d in devices:
            event = streams_mod.DEVICES.event()
            event.record(self._local.side[d])
            events.append(event)
        return events

    def hand_back(self):
        for side in self._sides:
            for d, s in side.items():
                self._caller[d].wait_stream(s)

    def synchronize(self):
        for side in self._sides:
            for s in side.values():
                s.synchronize()


def medians(got):
    for name, xs in got.items():
        if xs:
            say(f"  {name:48s} median {statistics.median(xs):6.2f}  (" + " / ".join(f"{x:.2f}" for x in xs) + ")")


def loads():
    nt = int(float(os.environ.get("PROBE_GIB", "4")) * 16)
    state = {f"t{i:03d}": torch.randn(16 * MiB, device=DEV) for i in range(nt)}
    n = nt * 64 * MiB
    path = os.path.join(D, "ckpt.safetensors")
    ckptstream.save(state, path)
    firsts = {k: state[k].clone() for k in ("t000", f"t{nt - 1:03d}")}
    del state
    whole = torch.empty(os.path.getsize(path) // (64 * MiB) * (64 * MiB), dtype=torch.uint8, device=DEV)
    shared, per_thread = streams_mod.make, PerThreadStreams

    def ck(streams, settings=None, checksum=True):
        streams_mod.make = streams
        try:
            sync()
            t = time.perf_counter()
            out = ckptstream.load(path, device=DEV, settings=settings, checksum=checksum)
            sync()
            dt = time.perf_counter() - t
        finally:
            streams_mod.make = shared
        assert all(torch.equal(out[k], v) for k, v in firsts.items())
        return n / dt / 1e9

    two_each = Settings(buffer_size=8 * MiB, num_buffers=16, io_threads=8)
    variants = [("ckptstream, own side streams (tried)", lambda: ck(per_thread)),
                ("ckptstream, one shared side stream (the engine)", lambda: ck(shared)),
                ("ckptstream, own streams, checksum=False", lambda: ck(per_thread, checksum=False)),
                ("ckptstream, own streams, 16x8MiB, 8 threads", lambda: ck(per_thread, two_each)),
                ("ckptstream, shared stream, 16x8MiB, 8 threads", lambda: ck(shared, two_each)),
                ("bare 8x16MiB, 2 buffers + a stream per thread",
                 lambda: lw.bare(path, whole.numel(), 8, 16 * MiB, "turns", dst=whole)),
                ("bare 16x64MiB, 2 buffers + a stream per thread",
                 lambda: lw.bare(path, whole.numel(), 16, 64 * MiB, "turns", dst=whole))]
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
        variants.append(("instanttensor buffered (same process)", it_load))
    except Exception as e:  # noqa: BLE001
        say("instanttensor: not usable:", repr(e)[:200])
    lw.bare(path, whole.numel(), 16, 64 * MiB, "turns", dst=whole)  # the file into the page cache
    for _, fn in variants:
        fn()  # warm: pinned pools, streams, the peer's buffers
    got = {name: [] for name, _ in variants}
    say(f"hot loads of {n / GiB:.1f} GiB into the GPU, GB/s, {ROUNDS} rounds")
    for r in range(ROUNDS):
        for name, fn in variants:
            if left() < 150 and "writes" in PARTS or left() < 20:
                break
            try:
                got[name].append(fn())
            except Exception as e:  # noqa: BLE001
                say(f"{name}: failed {e!r}"[:300])
        say(f"round {r + 1}: " + ", ".join(f"{xs[-1]:.1f}" for xs in got.values() if xs))
    medians(got)
    del whole
    os.unlink(path)
    torch.cuda.empty_cache()


def writes():
    layers, width, batch = 10, 8192, 16384
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
    state = {}
    for name, p in model.named_parameters():
        st = opt.state[p]
        state[f"w.{name}"], state[f"m.{name}"], state[f"v.{name}"] = p, st["exp_avg"], st["exp_avg_sq"]
    size = sum(t.numel() * t.element_size() for t in state.values())
    path = os.path.join(D, "loop.safetensors")
    ckptstream.save(state, path)  # warm the pool
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=worker_main, args=(q_in, q_out, D), daemon=True)
    proc.start()
    say(f"writer process: {q_out.get(timeout=120)}")
    t = time.perf_counter()
    for _ in range(30):
        step()
    sync()
    base = (time.perf_counter() - t) / 30
    say(f"loop: {base * 1e3:.1f} ms per step; {size / GiB:.2f} GiB of state")

    def sync_save():
        sync()
        t = time.perf_counter()
        ckptstream.save(state, path)
        return time.perf_counter() - t

    def in_process():
        h = ckptstream.save_async(state, path, mode="device")
        return h.done, lambda: (h.result(), h.seconds_to_durable)[1]

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
            if out["reply"][0] != "ok":
                raise RuntimeError(out["reply"])
            return out["durable"]
        return (lambda: not th.is_alive()), durable

    def in_loop(begin):
        sync()
        for _ in range(10):
            step()  # the host runs ahead again
        t = time.perf_counter()
        done, durable = begin()
        steps = 0
        while not done() and steps < 400:
            step()
            steps += 1
        sync()
        wall = time.perf_counter() - t
        return durable(), wall - base * steps

    got = {"sync save s": [], "save_async device: durable s": [], "  / that round's sync": [],
           "  lost s": [], "second process (CUDA IPC): durable s": [], "  / that round's sync ": [],
           "  lost s ": []}
    for r in range(max(2, ROUNDS - 1)):
        if left() < 45:
            say("out of time")
            break
        s = sync_save()
        got["sync save s"].append(s)
        d, lost = in_loop(in_process)
        got["save_async device: durable s"].append(d)
        got["  / that round's sync"].append(d / s)
        got["  lost s"].append(lost)
        d2, lost2 = in_loop(other_process)
        got["second process (CUDA IPC): durable s"].append(d2)
        got["  / that round's sync "].append(d2 / s)
        got["  lost s "].append(lost2)
        say(f"round {r + 1}: sync {s:.2f} s; save_async durable {d:.2f} s ({d / s:.2f}x), lost {lost:.2f} s; "
            f"second process {d2:.2f} s ({d2 / s:.2f}x), lost {lost2:.2f} s")
    medians(got)
    q_in.put(None)
    proc.join(30)
    os.unlink(path)


if __name__ == "__main__":
    os.makedirs(D, exist_ok=True)
    say(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {os.cpu_count()} cores")
    for part, fn in (("loads", loads), ("writes", writes)):
        if part in PARTS:
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                import traceback
                traceback.print_exc()
                say(f"{part} failed: {e!r}")
    say("done")
    sys.stdout.flush()
    os._exit(0)  # a stuck peer thread or writer process must not hold the call
