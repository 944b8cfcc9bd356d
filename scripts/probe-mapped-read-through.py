"""The default CPU load (mapped, checksums verified) of a 256 MiB GPT-like state read through,
beside safetensors' load_file read the same way, in one process that alternates them (wall and
CPU time, medians); then what its parts cost: the CRC-32C of the mapped bytes on one thread, and
asking the page cache about every page against the sample the load asks about.
Run from the repository root: python scripts/probe-mapped-read-through.py [REPS] [small]
(docs/benchmarks.md, "The verified mapped load read through"); with "small", the file's pages are
first dropped from the page cache and read back one 4 KiB page at a time (readahead off), so that
the cache holds it in 4 KiB folios rather than the large ones a sequential read leaves. The file
goes to $MRT_DIR (default /tmp/mrt)."""
import gc, os, resource, statistics, sys, time
import ckptstream
from ckptstream._checkpoint import mapped
from ckptstream._storage.mapping import Mapping
from ckptstream.bench.measure import touch
from ckptstream.bench.state import StateSpec, build_state
from safetensors.torch import load_file

D = os.environ.get("MRT_DIR", "/tmp/mrt"); os.makedirs(D, exist_ok=True)
path = os.path.join(D, "s256.safetensors")
if not os.path.exists(path):
    ckptstream.save(build_state(StateSpec(size_bytes=256 << 20), "cpu"), path)
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 25
if "small" in sys.argv[2:]:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    for at in range(0, os.fstat(fd).st_size, 4096):
        os.pread(fd, 1, at)
    os.close(fd)
loads = {"safetensors": lambda: load_file(path), "ckptstream": lambda: ckptstream.load(path),
         "ckptstream checksum=False": lambda: ckptstream.load(path, checksum=False)}
cpu_s = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
wall, cpu = {k: [] for k in loads}, {k: [] for k in loads}
for f in loads.values():
    touch(f())  # the file hot, the imports done
for _ in range(reps):
    for k, f in loads.items():
        gc.collect(); c, t = cpu_s(), time.perf_counter()
        out = f(); touch(out)
        wall[k].append(time.perf_counter() - t); cpu[k].append(cpu_s() - c); del out
st = statistics.median(wall["safetensors"])
for k in loads:
    w = statistics.median(wall[k])
    print(f"{k:26s} wall {w * 1e3:6.1f} ms ({w / st:.2f}x safetensors)  cpu {statistics.median(cpu[k]) * 1e3:6.1f} ms")
if not hasattr(Mapping, "resident"):  # a tree from before the sampled page cache question
    sys.exit(0)
fd = os.open(path, os.O_RDONLY)
n = os.fstat(fd).st_size // 4096 * 4096
m = Mapping(fd, 0, n, path)
m.prefetch(0, n)
view = memoryview(m.buffer).cast("B")
t = time.perf_counter(); [mapped._checksum.crc_of(view[i:i + mapped.TASK]) for i in range(0, n, mapped.TASK)]
print(f"CRC-32C of {n >> 20} MiB, one thread, mapped: {(time.perf_counter() - t) * 1e3:.1f} ms")
t = time.perf_counter(); every = all(m._in_cache(i, min(i + mapped.TASK, n)) for i in range(0, n, mapped.TASK))
print(f"page cache asked of every page, by task: {(time.perf_counter() - t) * 1e3:.2f} ms ({every})")
t = time.perf_counter(); sampled = all(m.resident(i, min(i + mapped.TASK, n)) for i in range(0, n, mapped.TASK))
print(f"page cache asked of 2 x 64 KiB a task (the load's sample): {(time.perf_counter() - t) * 1e3:.2f} ms ({sampled})")
del view, m
os.close(fd)
print("load average", os.getloadavg())
