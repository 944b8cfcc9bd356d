"""Where the read engine loses against a bare copy loop on a hot load into one GPU: the engine
as it is (its readers' ranges in the native loop, hotloop.c), and with one change at a time
(the Python loop; no checksums; destinations given by ``load_into`` instead of allocated),
beside a bare loop (each thread its contiguous range, whole-chunk ``os.preadv`` into its
pinned buffer, ``cudaMemcpyAsync`` by address per tensor part on its own stream, events
through ctypes) and InstantTensor's buffered backend, all in turns in one process. Run from the
repository root on a GPU machine (after ``python setup.py build_ext --inplace``):
PYTHONPATH=src python scripts/probe-hot-gpu-variants.py; PROBE_GIB sets the state's size."""
import contextlib, ctypes, json, os, statistics, struct, threading, time
import torch
import ckptstream
from ckptstream._engine import cudart
from ckptstream._storage import files
from ckptstream.bench.ceilings import Probe, pipeline_read
from ckptstream.bench.state import StateSpec, build_state, flat_tensors

MiB, GiB = 1 << 20, 1 << 30
T0, LIMIT = time.monotonic(), float(os.environ.get("PROBE_LIMIT", "150"))
ROUNDS = int(os.environ.get("PROBE_ROUNDS", "4"))
D = os.environ.get("PROBE_DIR", "/tmp/probe-variants"); os.makedirs(D, exist_ok=True)
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
with open(PATH, "rb") as f:
    while f.read(64 * MiB):
        pass  # into the page cache
    f.seek(0)
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
base = 8 + n
say(f"saved {N / GiB:.2f} GiB in {len(ref)} tensors")


@contextlib.contextmanager
def patched(request_reads=False, python_loop=False):
    """request_reads: the hot readers read in calls of READ_REQUEST, as the cold ones do;
    python_loop: the engine's Python loop, as where the native one (hotloop.c) is not built."""
    from ckptstream._engine import hotloop
    saved, library = files.FileSource.reader, hotloop.LIBRARY
    if request_reads:
        files.FileSource.reader = lambda self, resident=False: saved(self)
    if python_loop:
        hotloop.LIBRARY = None
    try:
        yield
    finally:
        files.FileSource.reader, hotloop.LIBRARY = saved, library


def engine(checksum=True, into=None, **patch):
    with patched(**patch):
        torch.cuda.synchronize(); t = time.perf_counter()
        if into is None:
            out = ckptstream.load(PATH, device="cuda", checksum=checksum)
        else:
            ckptstream.load_into(into, PATH, checksum=checksum)
            out = into
        torch.cuda.synchronize(); dt = time.perf_counter() - t
    return N / dt / 1e9, out


# --- the bare loop --------------------------------------------------------------------------
rt = cudart.runtime()
vp = ctypes.c_void_p
rt.cudaEventRecord.argtypes = [vp, vp]
rt.cudaEventSynchronize.argtypes = [vp]
rt.cudaEventCreateWithFlags.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
rt.cudaStreamSynchronize.argtypes = [vp]
rt.cudaMemcpyAsync.argtypes = [vp, vp, ctypes.c_size_t, ctypes.c_int, vp]
spans = sorted((v["data_offsets"][0] + base, v["data_offsets"][1] - v["data_offsets"][0], k)
               for k, v in header.items() if k != "__metadata__")
begin, end = spans[0][0], spans[-1][0] + spans[-1][1]


def bare(threads=16, nbuf=1, block=8 * MiB):
    dsts = {k: torch.empty(m, dtype=torch.uint8, device="cuda") for _, m, k in spans}
    chunks, off = [], begin
    while off < end:
        k = min(block, end - off)
        copies = [(dsts[name].data_ptr() + max(o, off) - o, max(o, off) - off, min(o + m, off + k) - max(o, off))
                  for o, m, name in spans if max(o, off) < min(o + m, off + k)]
        chunks.append((off, k, copies))
        off += k
    per = -(-len(chunks) // threads)
    plans = [chunks[i * per : (i + 1) * per] for i in range(threads)]
    pins = [[torch.empty(block, dtype=torch.uint8, pin_memory=True) for _ in range(nbuf)] for _ in range(threads)]
    sts = [torch.cuda.Stream() for _ in range(threads)]
    evs = []
    for _ in range(threads):
        row = []
        for _ in range(nbuf):
            e = vp(); rt.cudaEventCreateWithFlags(ctypes.byref(e), 3); row.append(e)
        evs.append(row)
    fd = os.open(PATH, os.O_RDONLY)
    torch.cuda.synchronize()

    def work(t):
        views = [memoryview(p.numpy()).cast("B") for p in pins[t]]
        ptrs, h, used = [p.data_ptr() for p in pins[t]], vp(sts[t].cuda_stream), [False] * nbuf
        torch.cuda.set_device(0)
        for i, (off, k, copies) in enumerate(plans[t]):
            b = i % nbuf
            if used[b]:
                rt.cudaEventSynchronize(evs[t][b])
            got = 0
            while got < k:
                got += os.preadv(fd, [views[b][got:k]], off + got)
            for ptr, at, m in copies:
                rt.cudaMemcpyAsync(ptr, ptrs[b] + at, m, 1, h)
            rt.cudaEventRecord(evs[t][b], h)
            used[b] = True
        rt.cudaStreamSynchronize(h)

    t0 = time.perf_counter()
    ths = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    os.close(fd)
    return N / dt / 1e9, dsts


def check(out, name):
    got = flat_tensors(out)
    bad = [k for k, v in ref.items() if not torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))]
    if bad:
        say(f"{name}: BYTES DIFFER in {len(bad)} tensors, e.g. {bad[0]}")



def main():
    global into
    into = ckptstream.load(PATH, device="cuda")
    for t in flat_tensors(into).values():
        t.zero_()  # poisoned: the warm round's comparison shows load_into filled them
    variants = {
        "engine default (native loop)": lambda: engine(),
        "engine, Python loop": lambda: engine(python_loop=True),
        "engine default, checksum=False": lambda: engine(checksum=False),
        "engine, Python loop, checksum=False": lambda: engine(checksum=False, python_loop=True),
        "engine load_into (no allocation)": lambda: engine(into=into),
        "bare 16 x 1 x 8 MiB": lambda: bare(16, 1, 8 * MiB),
    }
    try:
        import instanttensor  # noqa: F401
        from ckptstream.bench.peers import instanttensor_loader
        it = instanttensor_loader(True)

        def it_load():
            torch.cuda.synchronize(); t = time.perf_counter()
            out = it(PATH, None, "cuda", 1)
            torch.cuda.synchronize()
            return N / (time.perf_counter() - t) / 1e9, out
        variants["instanttensor buffered"] = it_load
    except Exception as e:  # noqa: BLE001
        say("instanttensor not usable:", repr(e)[:200])
    size = os.path.getsize(PATH)
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    variants["bench pipeline ceiling 16 x 2 x 16 MiB"] = lambda: (size / pipeline_read(PATH, size, Probe("pinned", 16, 16 * MiB), "cuda", dst) / 1e9, None)

    for name, fn in variants.items():  # warm, and the bytes compared once
        try:
            _, out = fn()
            if out is not None and name.startswith(("engine", "bare", "instant")):
                check(out, name)
            del out
        except Exception as e:  # noqa: BLE001
            say(f"{name}: failed {e!r}"[:300])
    got = {name: [] for name in variants}
    say(f"hot loads of {N / GiB:.2f} GiB into the GPU, GB/s, {ROUNDS} rounds in turns")
    for r in range(ROUNDS):
        if time.monotonic() - T0 > LIMIT:
            say("time"); break
        for name, fn in variants.items():
            try:
                rate, out = fn()
                del out
                got[name].append(rate)
            except Exception as e:  # noqa: BLE001
                say(f"{name}: failed {e!r}"[:300])
        say(f"round {r + 1}: " + ", ".join(f"{xs[-1]:.1f}" for xs in got.values() if xs))
    for name, xs in got.items():
        if xs:
            say(f"  {name:42s} median {statistics.median(xs):5.1f}  (" + " / ".join(f"{x:.1f}" for x in xs) + ")")
    from ckptstream._engine import gpucrc
    flats = [t.reshape(-1).view(torch.uint8) for t in flat_tensors(into).values()]
    flats = [f for f in flats if gpucrc.eligible(f)]
    rates = []
    for _ in range(3):  # the device checksum kernel alone, over the tensors it takes
        torch.cuda.synchronize(); t = time.perf_counter()
        gpucrc.crcs(flats)
        rates.append(sum(f.numel() for f in flats) / (time.perf_counter() - t) / 1e9)
    say(f"device CRC-32C kernel alone, {len(flats)} tensors: " + " / ".join(f"{r:.0f}" for r in rates) + " GB/s")
    say("done")


if __name__ == "__main__":
    main()
