"""nvCOMP's codecs on the GPU, on real training state: ratio and throughput per kind of tensor,
and whether nvCOMP's Zstd frames (RAW bitstream) are standard zstd frames both ways.

Trains the GPT-like model of bench/compression.py on the GPU (PROBE_MIB of state, PROBE_STEPS
AdamW steps), then per kind (bf16 weights, fp32 master weights, exp_avg, exp_avg_sq): each
tensor's bytes cut into independent chunks (PROBE_CHUNK_KIB, a list), each byte-grouped on the
GPU ("grouped") or not ("plain"), compressed as one batch by each codec, decompressed and compared
byte for byte. Throughput = uncompressed bytes / time of one batch call (after a warm call),
grouping excluded. Interop: nvCOMP Zstd frames decoded by the zstandard package on the CPU, and
zstandard's frames decoded by nvCOMP, both compared exactly. The order-0 entropy of the planes
is the bound of an entropy coder on them (as in docs/compression.md).

    PYTHONPATH=src python scripts/probe-gpu-compression.py   (needs nvidia-nvcomp-cu1x, zstandard)
"""
import os
import signal
import time

import torch

from ckptstream._compress import grouping
from ckptstream.bench.compression import DTYPES, KINDS, entropy_bound, train

MiB = 1 << 20
T0 = time.monotonic()
SIZE = int(float(os.environ.get("PROBE_MIB", "2048")) * MiB)
STEPS = int(os.environ.get("PROBE_STEPS", "400"))
CHUNKS_KIB = [int(k) for k in os.environ.get("PROBE_CHUNK_KIB", "64,1024").split(",")]
signal.alarm(int(os.environ.get("PROBE_DEADLINE", "240")))  # the whole probe, then SIGALRM ends it


def say(*a):
    print(f"[{time.monotonic() - T0:6.1f}s]", *a, flush=True)


def layout(tensors, chunk, width, grouped):
    """One device buffer of chunks at stride ``chunk`` (a tensor's last one shorter), grouped or
    not, and their offsets and sizes."""
    spans = []
    for t in tensors.values():
        b = grouping.tensor_bytes(t)
        spans += [b[lo:hi] for lo, hi in grouping.chunk_bounds(b.numel(), chunk, width)]
    buf = torch.zeros(len(spans) * chunk, dtype=torch.uint8, device="cuda")
    for i, s in enumerate(spans):
        buf[i * chunk : i * chunk + s.numel()] = grouping.group(s, width) if grouped and width > 1 else s
    return buf, [i * chunk for i in range(len(spans))], [s.numel() for s in spans]


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


def codec_runs(nv, buf, offsets, sizes, name, algorithm, chunk, **opts):
    stream = torch.cuda.current_stream().cuda_stream
    codec = nv.Codec(algorithm=algorithm, bitstream_kind=nv.BitstreamKind.RAW, uncomp_chunk_size=chunk,
                     cuda_stream=stream, **opts)
    src = nv.as_arrays(buf, offsets, sizes, stream)
    comp = codec.encode(src)
    torch.cuda.synchronize()
    seconds_c, comp = timed(lambda: codec.encode(src))
    packed = sum(comp.buffer_sizes)
    back = torch.full_like(buf, 0xA5)  # poisoned: every byte must be written by the decode
    out = nv.as_arrays(back, offsets, sizes, stream)
    codec.decode(comp, out=out)
    seconds_d, _ = timed(lambda: codec.decode(comp, out=out))
    same = all(torch.equal(back[o : o + n], buf[o : o + n]) for o, n in zip(offsets, sizes, strict=True))
    raw = sum(sizes)
    say(f"    {name:<26} ratio {packed / raw:.3f}  compress {raw / seconds_c / 1e9:6.1f} GB/s  "
        f"decompress {raw / seconds_d / 1e9:6.1f} GB/s  bytes back exact: {same}")
    return codec, comp


def interop(nv, codec, comp, buf, offsets, sizes, chunk):
    import zstandard

    n = min(64, len(sizes))
    frames = [torch.from_dlpack(comp[i]).cpu().numpy().tobytes() for i in range(n)]
    plain = [buf[offsets[i] : offsets[i] + sizes[i]].cpu().numpy().tobytes() for i in range(n)]
    unzstd = zstandard.ZstdDecompressor()
    ok = sum(unzstd.decompress(f, max_output_size=len(p)) == p for f, p in zip(frames, plain, strict=True))
    say(f"    nvCOMP Zstd frames decoded by zstandard {zstandard.__version__}: {ok}/{n} exact "
        f"(first frame starts {frames[0][:4].hex()}, the zstd magic is 28b52ffd)")
    mine = [zstandard.ZstdCompressor(level=3, write_content_size=True).compress(p) for p in plain]
    stride = max(len(f) for f in mine)
    stride += -stride % 256
    dev = torch.zeros(n * stride, dtype=torch.uint8)
    for i, f in enumerate(mine):
        dev[i * stride : i * stride + len(f)] = torch.frombuffer(bytearray(f), dtype=torch.uint8)
    dev = dev.cuda()
    back = torch.full((n * chunk,), 0xA5, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    codec.decode(nv.as_arrays(dev, [i * stride for i in range(n)], [len(f) for f in mine], stream),
                 out=nv.as_arrays(back, [i * chunk for i in range(n)], sizes[:n], stream))
    torch.cuda.synchronize()
    ok = sum(back[i * chunk : i * chunk + sizes[i]].cpu().numpy().tobytes() == plain[i] for i in range(n))
    ratio = sum(map(len, mine)) / sum(sizes[:n])
    say(f"    zstandard level-3 frames decoded by nvCOMP Zstd: {ok}/{n} exact (their ratio {ratio:.3f})")


def main():
    import nvidia.nvcomp as nv

    say(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, nvcomp {nv.__version__}")
    trained = train(SIZE, STEPS, batch=8, seq=256, device="cuda", progress=say)
    say(f"trained {STEPS} steps of a {SIZE / MiB:.0f} MiB state (d_model, layers, vocab = {trained.dims}) in "
        f"{trained.seconds:.0f} s: loss {trained.losses[0]:.2f} -> {sum(trained.losses[-20:]) / 20:.2f}")
    for kind in KINDS:
        tensors = trained.state[kind]
        width = grouping.value_width(DTYPES[kind])
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        bound = entropy_bound([s for t in tensors.values() for s in grouping.tensor_bytes(t).split(MiB)
                               if s.numel() % width == 0], width)
        say(f"{kind} ({DTYPES[kind]}, {nbytes / MiB:.0f} MiB): order-0 entropy of the planes {bound:.3f}")
        for chunk in CHUNKS_KIB:
            chunk *= 1024
            say(f"  chunks of {chunk // 1024} KiB")
            for grouped in (True, False):
                buf, offsets, sizes = layout(tensors, chunk, width, grouped)
                label = "grouped" if grouped else "plain"
                runs = [("Zstd", {}), ("ANS", {"data_type": "|u1"}), ("GDeflate", {"algorithm_type": 0}),
                        ("GDeflate", {"algorithm_type": 1}), ("LZ4", {})]
                if not grouped:
                    runs = [("Zstd", {}), ("ANS", {"data_type": {2: "<f2", 4: "<f4"}[width]}),
                            ("Bitcomp", {"data_type": "|u1"})]
                for algorithm, opts in runs:
                    name = f"{algorithm}{opts.get('algorithm_type', '')} {label}"
                    if "data_type" in opts:
                        name += f" {opts['data_type']}"
                    try:
                        codec, comp = codec_runs(nv, buf, offsets, sizes, name, algorithm, chunk, **opts)
                    except Exception as e:  # a codec that refuses this input: say so, go on
                        say(f"    {name:<26} failed: {type(e).__name__}: {e}")
                        continue
                    if algorithm == "Zstd" and grouped:
                        try:
                            interop(nv, codec, comp, buf, offsets, sizes, chunk)
                        except Exception as e:
                            say(f"    interop failed: {type(e).__name__}: {e}")
                del buf
                torch.cuda.empty_cache()
    say("done")


if __name__ == "__main__":
    main()
