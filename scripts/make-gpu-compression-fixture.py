"""Writes tests/data/gpu-zstd-chunks.json on a GPU machine: small tensors compressed chunk by
chunk on the GPU by nvCOMP's Zstd (ckptstream._compress.gpu), with their bytes, so that the
CPU-only test suite decodes chunks a GPU wrote (tests/test_compress_gpu.py).

    PYTHONPATH=src python scripts/make-gpu-compression-fixture.py OUT.json
"""
import base64
import json
import sys

import torch

from ckptstream._compress import gpu, grouping

CHUNK = 2048  # small, so that each tensor spans several chunks and the file stays small


def weights(count, dtype, gen):
    return (torch.randn(count, generator=gen) * 0.02).to(dtype)


def main(path):
    import nvidia.nvcomp as nv

    gen = torch.Generator().manual_seed(33)
    tensors = {
        "model.w": weights(3001, torch.bfloat16, gen).reshape(3001),
        "master.w": weights(1001, torch.float32, gen),
        "exp_avg_sq.w": weights(777, torch.float32, gen).square_(),
        "cplx": weights(154, torch.float32, gen).view(torch.complex64),
        "noise": torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=gen),
        "half.one": weights(1, torch.float16, gen),
    }
    out = []
    for name, t in tensors.items():
        width = grouping.value_width(t.dtype)
        made = gpu.encode(t.cuda(), CHUNK, width)
        out.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                    "width": width, "chunk_bytes": CHUNK,
                    "bytes": base64.b64encode(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).decode(),
                    "chunks": [{"raw": c.raw, "size": c.size, "crc": c.crc, "data": base64.b64encode(c.data).decode()}
                               for c in made]})
        print(name, [("raw" if c.raw else len(c.data)) for c in made])
    doc = {"written_by": f"nvCOMP {nv.__version__} Zstd (RAW bitstream) on {torch.cuda.get_device_name()}, "
                         f"torch {torch.__version__}", "tensors": out}
    with open(path, "w") as f:
        json.dump(doc, f, indent=0)


if __name__ == "__main__":
    main(sys.argv[1])
