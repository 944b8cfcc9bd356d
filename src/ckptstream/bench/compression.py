"""How well real training state compresses losslessly on the CPU, per kind of tensor.

Trains a GPT-like model (the names and shapes of ``state.gpt_shapes``; tied LM head, causal
attention, pre-norm blocks) on the CPU with AdamW for a few hundred steps, on text: a word-level
corpus made from the Python sources of the installed torch package (real text, so the gradients,
and with them the weights and moments, carry the structure training gives them; random tensors
would be nearly incompressible and flatter nothing). The state is then as a mixed-precision run
holds it: fp32 master weights, their bf16 copy (the model's weights), AdamW's ``exp_avg`` and
``exp_avg_sq``.

Per kind of tensor and per codec (zstd levels 1 and 3, lz4, each on the plain bytes and on the
byte-grouped planes; zipnn where installed): each tensor's bytes are cut into independent chunks
of ``--chunk-kib`` (as a save pipeline would compress them), and reported are

    ratio     stored bytes / uncompressed bytes (a chunk that does not shrink by 3% counts as stored as is)
    codec     compressed bytes / uncompressed bytes, without that fallback
    comp      compression throughput, uncompressed MB/s, one thread (byte-grouping included)
    decomp    decompression throughput, uncompressed MB/s, one thread (ungrouping included)

and, per kind, the order-0 byte entropy of each chunk's byte planes: the bound of a Huffman or
ANS coder of the planes.

Every chunk is decompressed and compared with the original bytes.

    python -m ckptstream.bench.compression --size-mib 8 --steps 300 --json docs/results/compression-cpu-8mib.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import pathlib
import platform
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from .._compress import grouping
from .._compress.codecs import Codec, codec
from .state import N_CTX, gpt_dims, gpt_shapes

MiB = 1 << 20
KINDS = ("model", "master", "exp_avg", "exp_avg_sq")
DTYPES = {"model": torch.bfloat16, "master": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32}
CODECS = ("zstd-1", "zstd-3", "lz4")
KEEP_BELOW = 0.97  # a chunk is stored compressed only when it shrinks by at least 3%
_clock = time.perf_counter


# --- the corpus -------------------------------------------------------------------------------


def corpus(vocab: int, max_bytes: int) -> torch.Tensor:
    """Word-level token ids of the installed torch package's Python sources (sorted paths, so the
    same torch gives the same corpus): the ``vocab - 1`` most frequent words, the rest one id."""
    root = pathlib.Path(torch.__file__).parent
    text, size = [], 0
    for path in sorted(root.rglob("*.py")):
        data = path.read_text(encoding="utf-8", errors="replace")
        text.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    words = re.findall(r"\w+|[^\w\s]", "".join(text))
    common = [w for w, _ in collections.Counter(words).most_common(vocab - 1)]
    ids = {w: i + 1 for i, w in enumerate(common)}
    return torch.tensor([ids.get(w, 0) for w in words], dtype=torch.int64)


# --- the model --------------------------------------------------------------------------------


def init_params(size_bytes: int, seed: int) -> dict[str, torch.Tensor]:
    """fp32 parameters with the names and shapes of ``gpt_shapes``: GPT-2's initialisation."""
    gen = torch.Generator().manual_seed(seed)
    _, layers, _ = gpt_dims(size_bytes)
    params = {}
    for name, shape in gpt_shapes(size_bytes).items():
        if len(shape) == 1:
            p = torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
        else:
            std = 0.02 / math.sqrt(2 * layers) if name.endswith("c_proj.weight") else 0.02
            p = torch.randn(shape, generator=gen) * std
        params[name] = p.requires_grad_()
    return params


def forward(p: dict[str, torch.Tensor], idx: torch.Tensor, layers: int, pos0: int = 0) -> torch.Tensor:
    """Logits of a pre-norm GPT-2 block stack (the LM head is the token embedding, tied), for
    windows that sit at position ``pos0`` of the context."""
    b, t = idx.shape
    d = p["wte.weight"].shape[1]
    heads = max(1, d // 64)
    x = p["wte.weight"][idx] + p["wpe.weight"][pos0 : pos0 + t]
    for i in range(layers):
        h = f"h.{i}."
        y = F.layer_norm(x, (d,), p[h + "ln_1.weight"], p[h + "ln_1.bias"])
        q, k, v = F.linear(y, p[h + "attn.c_attn.weight"], p[h + "attn.c_attn.bias"]).split(d, dim=2)
        q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + F.linear(y, p[h + "attn.c_proj.weight"], p[h + "attn.c_proj.bias"])
        y = F.layer_norm(x, (d,), p[h + "ln_2.weight"], p[h + "ln_2.bias"])
        y = F.gelu(F.linear(y, p[h + "mlp.c_fc.weight"], p[h + "mlp.c_fc.bias"]))
        x = x + F.linear(y, p[h + "mlp.c_proj.weight"], p[h + "mlp.c_proj.bias"])
    x = F.layer_norm(x, (d,), p["ln_f.weight"], p["ln_f.bias"])
    return F.linear(x, p["wte.weight"])


@dataclasses.dataclass
class Trained:
    state: dict[str, dict[str, torch.Tensor]]  # kind -> name -> tensor
    losses: list[float]
    seconds: float
    dims: tuple[int, int, int]


def train(size_bytes: int, steps: int, *, batch: int = 2, seq: int = 128, lr: float = 1e-3,
          seed: int = 0, corpus_bytes: int = 4 * MiB, progress: Callable[[str], None] | None = None,
          device: str = "cpu") -> Trained:
    """The state after ``steps`` AdamW steps (warmup then cosine decay, weight decay 0.1 on the
    matrices, gradients clipped at 1), as a bf16 mixed-precision run would hold it.

    Windows of ``seq`` tokens (short, for a CPU) at a random position of the ``N_CTX`` context,
    so that every row of the position embedding trains, as in a run with full-length sequences.
    ``device``: where the model trains (the same initial state and batches on any device)."""
    torch.manual_seed(seed)
    dims = gpt_dims(size_bytes)
    _, layers, vocab = dims
    tokens = corpus(vocab, corpus_bytes).to(device)
    params = {n: p.detach().to(device).requires_grad_() for n, p in init_params(size_bytes, seed).items()}
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = max(1, steps // 10)
    def schedule(s: int) -> float:  # linear warmup, then cosine decay to a tenth
        if s < warmup:
            return (s + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    gen = torch.Generator().manual_seed(seed)
    losses, start = [], _clock()
    for _ in range(steps):
        at = torch.randint(len(tokens) - seq - 1, (batch,), generator=gen)
        x = torch.stack([tokens[i : i + seq] for i in at.tolist()])
        y = torch.stack([tokens[i + 1 : i + seq + 1] for i in at.tolist()])
        pos0 = int(torch.randint(N_CTX - seq + 1, (), generator=gen))
        loss = F.cross_entropy(forward(params, x, layers, pos0).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
        if progress is not None and len(losses) % 50 == 0:
            progress(f"step {len(losses)}/{steps}: loss {losses[-1]:.2f}, {_clock() - start:.0f} s")
    seconds = _clock() - start
    with torch.no_grad():
        master = {n: p.detach() for n, p in params.items()}
        state = {"model": {n: p.to(torch.bfloat16) for n, p in master.items()}, "master": master,
                 "exp_avg": {n: opt.state[p]["exp_avg"] for n, p in params.items()},
                 "exp_avg_sq": {n: opt.state[p]["exp_avg_sq"] for n, p in params.items()}}
    return Trained(state, losses, seconds, dims)


# --- the measurement --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Method:
    """A codec on the plain bytes or on the byte-grouped planes of each chunk."""

    name: str
    compress: Callable[[torch.Tensor], bytes]  # one chunk's uint8 bytes -> frame
    decompress: Callable[[bytes, int], torch.Tensor]  # frame, size -> the chunk's uint8 bytes


def _methods(width: int, with_zipnn: bool) -> Iterator[Method]:
    for name in CODECS:
        c = codec(name)

        def plain(b: torch.Tensor, c: Codec = c) -> bytes:
            return c.compress(b.numpy())

        def unplain(f: bytes, n: int, c: Codec = c) -> torch.Tensor:
            return torch.frombuffer(bytearray(c.decompress(f, n)), dtype=torch.uint8)

        def grouped(b: torch.Tensor, c: Codec = c) -> bytes:
            return c.compress(grouping.group(b, width).numpy())

        def ungrouped(f: bytes, n: int, c: Codec = c) -> torch.Tensor:
            return grouping.ungroup(torch.frombuffer(bytearray(c.decompress(f, n)), dtype=torch.uint8), width)

        yield Method(name, plain, unplain)
        yield Method(f"{name}+grouped", grouped, ungrouped)
    if with_zipnn:
        yield _zipnn_method(width)


def _import_zipnn() -> Any:
    with warnings.catch_warnings():  # zipnn's import touches torch.jit.script, deprecated in torch
        warnings.simplefilter("ignore", DeprecationWarning)
        import zipnn  # type: ignore[import-not-found]  # optional: measured where installed
    return zipnn


def _zipnn_method(width: int) -> Method:
    zipnn = _import_zipnn()

    dtype = {2: "bfloat16", 4: "float32"}[width]
    z = zipnn.ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)

    def compress(b: torch.Tensor) -> bytes:
        return bytes(z.compress(b.numpy().tobytes()))

    def decompress(f: bytes, n: int) -> torch.Tensor:
        return torch.frombuffer(bytearray(z.decompress(f)), dtype=torch.uint8)

    return Method("zipnn", compress, decompress)


def zipnn_available() -> bool:
    try:
        _import_zipnn()
    except ImportError:
        return False
    return True


def chunks(tensors: dict[str, torch.Tensor], chunk_bytes: int) -> list[torch.Tensor]:
    """Each tensor's bytes cut into independent chunks (the last of each tensor shorter)."""
    out: list[torch.Tensor] = []
    for t in tensors.values():
        b = grouping.tensor_bytes(t)
        out.extend(b[i : i + chunk_bytes] for i in range(0, b.numel(), chunk_bytes))
    return out


def measure(parts: list[torch.Tensor], method: Method) -> dict[str, Any]:
    raw = sum(p.numel() for p in parts)
    packed = stored = kept_raw = 0
    comp_s = decomp_s = 0.0
    for part in parts:
        t0 = _clock()
        frame = method.compress(part)
        t1 = _clock()
        back = method.decompress(frame, part.numel())
        decomp_s += _clock() - t1
        comp_s += t1 - t0
        if not torch.equal(back, part):
            raise AssertionError(f"{method.name} did not give back the bytes it compressed")
        packed += len(frame)
        if len(frame) <= KEEP_BELOW * part.numel():
            stored += len(frame)
        else:
            stored, kept_raw = stored + part.numel(), kept_raw + 1
    return {"ratio": stored / raw, "codec_ratio": packed / raw, "raw_chunks": kept_raw, "chunks": len(parts),
            "compress_MBps": raw / comp_s / 1e6, "decompress_MBps": raw / decomp_s / 1e6}


def entropy_bound(parts: list[torch.Tensor], width: int) -> float:
    """The stored bytes over the uncompressed of an ideal order-0 coder of each byte plane of each
    chunk (the byte entropy of the plane): what Huffman or ANS on the planes approach, at best."""
    bits = 0.0
    for part in parts:
        for plane in grouping.group(part, width).view(width, -1):
            p = torch.bincount(plane, minlength=256).double() / plane.numel()
            p = p[p > 0]
            bits += float(-(p * p.log2()).sum()) * plane.numel()
    return bits / 8 / sum(p.numel() for p in parts)


def run(size_bytes: int = 24 * MiB, steps: int = 300, *, chunk_kib: int = 1024, seed: int = 0,
        sweep_kib: tuple[int, ...] = (64, 256, 4096), progress: Callable[[str], None] = print,
        save_state: str | None = None) -> dict[str, Any]:
    trained = train(size_bytes, steps, seed=seed, progress=progress)
    if save_state:  # the trained state itself, to measure other codecs on later
        torch.save(dataclasses.asdict(trained), save_state)
    progress(f"trained {steps} steps in {trained.seconds:.0f} s: loss {trained.losses[0]:.2f} -> "
             f"{sum(trained.losses[-20:]) / len(trained.losses[-20:]):.2f} (mean of the last 20)")
    with_zipnn = zipnn_available()
    kinds: dict[str, Any] = {}
    for kind in KINDS:
        tensors = trained.state[kind]
        width = grouping.value_width(DTYPES[kind])
        parts = chunks(tensors, chunk_kib * 1024)
        rows = {}
        for method in _methods(width, with_zipnn):
            rows[method.name] = measure(parts, method)
            progress(f"{kind:<11} {method.name:<16} ratio {rows[method.name]['ratio']:.3f}")
        sweep = {}
        best = next(m for m in _methods(width, False) if m.name == "zstd-1+grouped")
        for kib in sweep_kib:
            sweep[str(kib)] = measure(chunks(tensors, kib * 1024), best)["ratio"]
        kinds[kind] = {"dtype": str(DTYPES[kind]).removeprefix("torch."), "tensors": len(tensors),
                       "bytes": sum(p.numel() for p in parts), "methods": rows,
                       "entropy_bound_grouped": entropy_bound(parts, width),
                       "zstd-1+grouped_ratio_by_chunk_kib": sweep}
    d, layers, vocab = trained.dims
    return {"kind": "compression", "steps": steps, "size_bytes": size_bytes, "chunk_kib": chunk_kib, "seed": seed,
            "model": {"d_model": d, "layers": layers, "vocab": vocab, "n_ctx": N_CTX},
            "train_seconds": trained.seconds, "loss_first": trained.losses[0],
            "loss_last20": sum(trained.losses[-20:]) / len(trained.losses[-20:]),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "packages": _versions(), "kinds": kinds}


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in ("zstandard", "lz4", "zipnn"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def render(result: dict[str, Any]) -> str:
    m = result["model"]
    lines = [f"GPT-like state: d_model {m['d_model']}, {m['layers']} layers, vocab {m['vocab']}; "
             f"{result['steps']} AdamW steps, loss {result['loss_first']:.2f} -> {result['loss_last20']:.2f}; "
             f"chunks of {result['chunk_kib']} KiB",
             f"{'kind':<11} {'method':<16} {'ratio':>6} {'codec':>6} {'comp MB/s':>10} {'decomp MB/s':>12}"]
    for kind, row in result["kinds"].items():
        for name, r in row["methods"].items():
            lines.append(f"{kind:<11} {name:<16} {r['ratio']:>6.3f} {r['codec_ratio']:>6.3f} "
                         f"{r['compress_MBps']:>10.0f} {r['decompress_MBps']:>12.0f}")
        sweep = ", ".join(f"{k} KiB {v:.3f}" for k, v in row["zstd-1+grouped_ratio_by_chunk_kib"].items())
        lines.append(f"{kind:<11} zstd-1+grouped by chunk size: {sweep}")
        lines.append(f"{kind:<11} order-0 entropy of the byte planes: {row['entropy_bound_grouped']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ckptstream.bench.compression", description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=float, default=24, help="training state size (all four kinds), MiB")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--chunk-kib", type=int, default=1024, help="independent compression chunk, KiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--save-state", help="also torch.save the trained state here")
    args = ap.parse_args(argv)
    result = run(int(args.size_mib * MiB), args.steps, chunk_kib=args.chunk_kib, seed=args.seed,
                 progress=lambda s: print(s, file=sys.stderr, flush=True), save_state=args.save_state)
    print(render(result))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
