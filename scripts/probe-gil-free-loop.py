"""Whether a per-chunk loop that keeps the interpreter lock only between calls moves a hot load
into a GPU faster than the same loop through torch calls: each I/O thread reads its contiguous
range of the file (in the page cache) chunk by chunk into its pinned buffers (os.preadv) and
copies each chunk to the device with cudaMemcpyAsync on a stream of its own, through ctypes
(which gives the lock up for the call), or through torch's non-blocking copy_ (which holds it
for the dispatch). Into one flat device tensor, and into one device tensor per tensor of the
file (the copies a load makes). Run from the repository root on a GPU machine:
PYTHONPATH=src python scripts/probe-gil-free-loop.py; PROBE_GIB sets the state's size."""
import ctypes, json, os, re, struct, threading, time
import torch
import ckptstream
from ckptstream.bench.state import StateSpec, build_state

MiB, GiB = 1 << 20, 1 << 30
T0, LIMIT = time.monotonic(), float(os.environ.get("PROBE_LIMIT", "240"))
D = os.environ.get("PROBE_DIR", "/tmp/probe-gil-free"); os.makedirs(D, exist_ok=True)
PATH = os.path.join(D, "gpt.safetensors")


def say(*a):
    print(f"[{time.monotonic() - T0:6.1f}s]", *a, flush=True)


def load_cudart():
    torch.cuda.init(); torch.empty(1, device="cuda")
    with open("/proc/self/maps") as f:
        for line in f:
            m = re.search(r"(/\S*libcudart\.so[.\d]*)\s*$", line)
            if m:
                return ctypes.CDLL(m.group(1)), m.group(1)
    raise RuntimeError("libcudart is not mapped in this process")


rt, rt_path = load_cudart()
vp, sz = ctypes.c_void_p, ctypes.c_size_t
rt.cudaMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
rt.cudaEventRecord.argtypes = [vp, vp]
rt.cudaEventSynchronize.argtypes = [vp]
rt.cudaEventCreateWithFlags.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
rt.cudaStreamSynchronize.argtypes = [vp]
say("cudart:", rt_path)


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} returned {rc}")


def new_event():
    ev = vp()
    check(rt.cudaEventCreateWithFlags(ctypes.byref(ev), 1 | 2), "cudaEventCreateWithFlags")  # blocking, no timing
    return ev


spec = StateSpec(size_bytes=int(float(os.environ.get("PROBE_GIB", "8")) * GiB))
say(spec.summary())
state = build_state(spec, "cuda")
torch.cuda.synchronize()
ckptstream.save(state, PATH)
del state
size = os.path.getsize(PATH)
with open(PATH, "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
base = 8 + n
tensors = sorted((v["data_offsets"][0] + base, v["data_offsets"][1] - v["data_offsets"][0])
                 for k, v in header.items() if k != "__metadata__")
begin, end = tensors[0][0], tensors[-1][0] + tensors[-1][1]
N = end - begin
fd = os.open(PATH, os.O_RDONLY); mv = memoryview(bytearray(64 * MiB))
for off in range(0, size, 64 * MiB):
    os.preadv(fd, [mv], off)  # into the page cache
say(f"saved {N / GiB:.2f} GiB in {len(tensors)} tensors")

# the reference: the data region, read once through a plain pageable copy
ref = torch.empty(N, dtype=torch.uint8, device="cuda")
host = torch.empty(256 * MiB, dtype=torch.uint8)
hv = memoryview(host.numpy()).cast("B")
for off in range(0, N, 256 * MiB):
    k = os.preadv(fd, [hv[: min(256 * MiB, N - off)]], begin + off)
    ref[off : off + k].copy_(host[:k])
torch.cuda.synchronize()


def chunk_plan(threads, block, per_tensor, dsts):
    """Per thread: its chunks, each (file offset, length, [(dst pointer, offset in chunk, n)])."""
    chunks, off = [], begin
    while off < end:
        k = min(block, end - off)
        copies = []
        if per_tensor:
            for (t_off, t_n), dst in zip(tensors, dsts):
                lo, hi = max(t_off, off), min(t_off + t_n, off + k)
                if lo < hi:
                    copies.append((dst.data_ptr() + lo - t_off, lo - off, hi - lo))
        else:
            copies.append((dsts[0].data_ptr() + off - begin, 0, k))
        chunks.append((off, k, copies))
        off += k
    per = -(-len(chunks) // threads)
    return [chunks[i * per : (i + 1) * per] for i in range(threads)]


def run(threads, nbuf, block, per_tensor, how):
    dsts = ([torch.empty(n, dtype=torch.uint8, device="cuda") for _, n in tensors] if per_tensor
            else [torch.empty(N, dtype=torch.uint8, device="cuda")])
    plans = chunk_plan(threads, block, per_tensor, dsts)
    pins = [[torch.empty(block, dtype=torch.uint8, pin_memory=True) for _ in range(nbuf)] for _ in range(threads)]
    streams = [torch.cuda.Stream() for _ in range(threads)]
    events = [[new_event() for _ in range(nbuf)] for _ in range(threads)]
    torch.cuda.synchronize()
    errors = []

    def work(t):
        try:
            own, views = pins[t], [memoryview(p.numpy()).cast("B") for p in pins[t]]
            ptrs, evs, s = [p.data_ptr() for p in own], events[t], streams[t]
            handle, used = vp(s.cuda_stream), [False] * nbuf
            torch.cuda.set_device(0)
            for i, (off, k, copies) in enumerate(plans[t]):
                b = i % nbuf
                if used[b]:
                    if how == "ctypes":
                        check(rt.cudaEventSynchronize(evs[b]), "cudaEventSynchronize")
                    else:
                        tev[t][b].synchronize()
                got = 0
                while got < k:
                    got += os.preadv(fd, [views[b][got:k]], off + got)
                if how == "ctypes":
                    for ptr, at, m in copies:
                        check(rt.cudaMemcpyAsync(ptr, ptrs[b] + at, m, 1, handle), "cudaMemcpyAsync")
                    check(rt.cudaEventRecord(evs[b], handle), "cudaEventRecord")
                else:
                    with torch.cuda.stream(s):
                        for (ptr, at, m), dst in zip(copies, dst_views[t][i]):
                            dst.copy_(own[b][at : at + m], non_blocking=True)
                        tev[t][b] = s.record_event()
                used[b] = True
            if how == "ctypes":
                check(rt.cudaStreamSynchronize(handle), "cudaStreamSynchronize")
            else:
                s.synchronize()
        except BaseException as e:
            errors.append(e)

    # torch's loop slices its destinations ahead (the engine makes these views once per load)
    tev = [[None] * nbuf for _ in range(threads)]
    dst_views = None
    if how == "torch":
        by_ptr = {}
        for d in dsts:
            by_ptr[d.data_ptr()] = d
        starts = sorted(by_ptr)
        import bisect
        def view_of(ptr, m):
            j = bisect.bisect_right(starts, ptr) - 1
            d = by_ptr[starts[j]]
            lo = ptr - starts[j]
            return d[lo : lo + m]
        dst_views = [[[view_of(ptr, m) for ptr, _, m in copies] for _, _, copies in plan] for plan in plans]
    start = time.perf_counter()
    ths = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    torch.cuda.synchronize()
    dt = time.perf_counter() - start
    if errors:
        raise errors[0]
    if per_tensor:
        ok = all(torch.equal(d, ref[o - begin : o - begin + n]) for (o, n), d in zip(tensors, dsts))
    else:
        ok = torch.equal(dsts[0], ref)
    del dsts, pins
    return N / dt / 1e9, ok


def variant(threads, nbuf, block, per_tensor, how):
    if time.monotonic() - T0 > LIMIT:
        say("time"); return
    name = f"{how:6s} {'per-tensor' if per_tensor else 'flat':10s} {threads:2d} thr x {nbuf} x {block >> 20:2d} MiB"
    try:
        run(threads, nbuf, block, per_tensor, how)  # warm
        rs = [run(threads, nbuf, block, per_tensor, how) for _ in range(3)]
        say(f"{name}: " + " / ".join(f"{r:.1f}" for r, _ in rs) + " GB/s" + ("" if all(ok for _, ok in rs) else " BYTES DIFFER"))
    except Exception as e:
        say(name, "failed:", repr(e))


def engine(name, settings=None, checksum=True):
    if time.monotonic() - T0 > LIMIT:
        say("time"); return
    rates = []
    for i in range(4):
        torch.cuda.synchronize(); t = time.perf_counter()
        out = ckptstream.load(PATH, device="cuda", settings=settings, checksum=checksum)
        torch.cuda.synchronize(); dt = time.perf_counter() - t
        del out
        if i:
            rates.append(N / dt / 1e9)
    say(f"ckptstream.load {name}: " + " / ".join(f"{r:.1f}" for r in rates) + " GB/s")


engine("default")
for args in [(16, 2, 16 * MiB), (16, 2, 8 * MiB), (16, 1, 8 * MiB), (16, 2, 4 * MiB), (8, 2, 16 * MiB)]:
    variant(*args, False, "torch")
for args in [(16, 2, 16 * MiB), (16, 2, 8 * MiB), (16, 1, 8 * MiB), (16, 2, 4 * MiB), (16, 4, 2 * MiB),
             (8, 2, 16 * MiB), (12, 2, 8 * MiB), (24, 1, 4 * MiB), (32, 1, 4 * MiB)]:
    variant(*args, False, "ctypes")
for args in [(16, 2, 8 * MiB), (16, 1, 8 * MiB), (16, 2, 4 * MiB), (24, 1, 4 * MiB)]:
    variant(*args, True, "ctypes")
for args in [(16, 2, 8 * MiB), (16, 2, 4 * MiB)]:
    variant(*args, True, "torch")
engine("16 thr x 2 x 16 MiB", ckptstream.Settings(io_threads=16, num_buffers=32, buffer_size=16 * MiB))
say("done")
