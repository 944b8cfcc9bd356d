"""Benchmark states: a GPT-like training state (bf16 weights, fp32 master weights, AdamW moments)
with a transformer's mix of tensor sizes, or many small tensors; random data from a seed."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from .formats import GiB, KiB

State = dict[str, Any]
# bf16 weight + fp32 master + fp32 exp_avg + fp32 exp_avg_sq
BYTES_PER_PARAM = 2 + 4 + 4 + 4
N_CTX = 1024
VOCAB = 50304  # GPT-2's vocabulary padded to a multiple of 64
WIDTHS = (64, 128, 256, 512, 768, 1024, 1536, 2048, 2560, 4096, 5120, 8192)
MIN_LAYERS = 8


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """What state each benchmark process builds: GPT-like of ``size_bytes`` when ``tensors`` is 0,
    else ``tensors`` fp32 tensors of ``tensor_kib`` KiB each."""

    size_bytes: int = 0
    tensors: int = 0
    tensor_kib: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tensors < 0 or self.tensor_kib < 0 or self.size_bytes < 0:
            raise ValueError(f"state sizes must be >= 0, got {self}")
        if self.tensors and not self.tensor_kib:
            raise ValueError("--tensors N needs --tensor-kib K (the size of each tensor)")
        if not self.tensors and self.size_bytes < 64 * KiB:
            raise ValueError(f"a GPT-like state needs at least 64 KiB, got {self.size_bytes} bytes")

    @property
    def kind(self) -> str:
        return "small" if self.tensors else "gpt"

    def nbytes(self) -> int:
        """Exact bytes of the tensors that ``build_state`` makes (without building them)."""
        if self.tensors:
            return self.tensors * self.tensor_kib * KiB
        d, layers, vocab = gpt_dims(self.size_bytes)  # what gpt_shapes lists, without listing it
        return BYTES_PER_PARAM * ((vocab + N_CTX + 2) * d + layers * (12 * d * d + 13 * d))

    def summary(self) -> str:
        """One line for progress and reports: the kind of state, its shape and size."""
        if self.tensors:
            return f"{self.tensors} x {self.tensor_kib} KiB fp32 tensors"
        d, layers, vocab = gpt_dims(self.size_bytes)
        count = 4 * (4 + 12 * layers)
        return (f"GPT-like state (d_model {d}, {layers} layers, vocab {vocab}), "
                f"{self.nbytes() / GiB:.2f} GiB in {count} tensors")


def gpt_dims(size_bytes: int) -> tuple[int, int, int]:
    """(d_model, layers, vocab) of a GPT whose training state is about ``size_bytes``.

    The widest d_model that still leaves room for MIN_LAYERS blocks, so that an 8 GiB state has
    hundreds of tensors; the embedding takes at most ~20% of the parameters, as in real models.
    """
    params = size_bytes // BYTES_PER_PARAM
    d = WIDTHS[0]
    for w in WIDTHS:
        if 12 * w * w * MIN_LAYERS <= params:
            d = w
    vocab = max(64, min(VOCAB, (params // 5 // d) // 64 * 64))
    per_layer = 12 * d * d + 13 * d
    layers = max(1, round((params - (vocab + N_CTX + 2) * d) / per_layer))
    return d, layers, vocab


def gpt_shapes(size_bytes: int) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes, GPT-2 style (the LM head is tied to the token embedding)."""
    d, layers, vocab = gpt_dims(size_bytes)
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (vocab, d), "wpe.weight": (N_CTX, d)}
    for i in range(layers):
        p = f"h.{i}."
        shapes.update({
            p + "ln_1.weight": (d,), p + "ln_1.bias": (d,),
            p + "attn.c_attn.weight": (3 * d, d), p + "attn.c_attn.bias": (3 * d,),
            p + "attn.c_proj.weight": (d, d), p + "attn.c_proj.bias": (d,),
            p + "ln_2.weight": (d,), p + "ln_2.bias": (d,),
            p + "mlp.c_fc.weight": (4 * d, d), p + "mlp.c_fc.bias": (4 * d,),
            p + "mlp.c_proj.weight": (d, 4 * d), p + "mlp.c_proj.bias": (d,),
        })
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
    return shapes


def build_state(spec: StateSpec, device: str | torch.device) -> State:
    """The state on ``device``, random from ``spec.seed`` (never zeros, so nothing compresses or
    hides behind sparse files). Generated on the device itself: fast on a GPU."""
    gen = torch.Generator(device=device)
    gen.manual_seed(spec.seed)

    def randn(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    with torch.no_grad():
        if spec.tensors:
            n = spec.tensor_kib * KiB // 4
            small = {f"t{i:06d}": randn((n,)) for i in range(spec.tensors)}
            return {"model": small, "step": 1000 + spec.seed}
        model, master, exp_avg, exp_avg_sq = {}, {}, {}, {}
        for name, shape in gpt_shapes(spec.size_bytes).items():
            w = randn(shape).mul_(0.02)
            if name.endswith("weight") and len(shape) == 1:
                w.add_(1.0)  # layer-norm gains sit around 1
            master[name] = w
            model[name] = w.to(torch.bfloat16)
            exp_avg[name] = randn(shape).mul_(1e-3)
            exp_avg_sq[name] = randn(shape).square_().mul_(1e-6)  # second moments are positive
    return {"model": model, "master": master, "optim": {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq},
            "step": 1000 + spec.seed}


def iter_tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted name, tensor) of every tensor leaf, in the state's order."""
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from iter_tensors(value, f"{prefix}.{key}" if prefix else str(key))


def flat_tensors(state: Any) -> dict[str, torch.Tensor]:
    """{dotted name: tensor} of the state's tensors: the flat dict safetensors saves."""
    return dict(iter_tensors(state))


def state_nbytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(state))


def empty_like_state(state: Any, device: str | torch.device | None = None, *, resident: bool = False) -> Any:
    """The same structure with uninitialised tensors (what a load allocates). ``resident`` fills
    them, so their pages are in memory already, as a live model's are when loaded into in place."""
    if isinstance(state, torch.Tensor):
        t = torch.empty_like(state, device=device)
        return t.fill_(1) if resident else t
    if isinstance(state, dict):
        return {k: empty_like_state(v, device, resident=resident) for k, v in state.items()}
    return type(state)() if isinstance(state, (int, float)) else state


def assert_same(expected: State, got: Any, what: str) -> None:
    """Raise when a loaded state differs from the saved one (a benchmark of a wrong load is void)."""
    want, have = flat_tensors(expected), flat_tensors(got)
    if want.keys() != have.keys():
        missing, extra = sorted(want.keys() - have.keys())[:3], sorted(have.keys() - want.keys())[:3]
        raise AssertionError(f"{what}: loaded tensor names differ (missing {missing}, unexpected {extra})")
    for name, t in want.items():
        other = have[name]
        if other.dtype != t.dtype or other.shape != t.shape:
            raise AssertionError(f"{what}: {name} is {other.dtype}{tuple(other.shape)}, "
                                 f"saved {t.dtype}{tuple(t.shape)}")
        if not torch.equal(other.to(t.device), t):
            raise AssertionError(f"{what}: the data of {name} differs from what was saved")
