"""What an export to a Hugging Face folder writes: the output tensors, each put together from
boxes of a source's bytes, the shards that transformers would cut them into, and the folder's
names.

A box is a run of bytes in one source file holding, row-major, a box of an output tensor's
elements (its origin and sizes per dimension): a whole tensor of a checkpoint file, or one
saved chunk of a DCP checkpoint's DTensor. The shards follow ``huggingface_hub``'s
``split_torch_state_dict_into_shards`` (which ``save_pretrained`` calls): tensors in the
state's order, a new shard where the next tensor would take the current one past the limit, a
tensor larger than the limit in a shard of its own; one shard is ``model.safetensors``,
several are ``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import torch

from .._errors import ExportError

SAFE_WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
DEFAULT_MAX_SHARD_SIZE = "5GB"
HF_METADATA = {"format": "pt"}  # what transformers writes in every shard's __metadata__ (and checks on load)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}



@dataclasses.dataclass(frozen=True)
class Box:
    """Bytes ``offset``.. of the file ``source``: the elements of the box at ``origin`` of
    ``sizes`` of a tensor, row-major; ``crc`` is the CRC-32C stored for exactly these bytes
    (None: none stored). ``what`` names it in messages."""

    source: str
    offset: int
    origin: tuple[int, ...]
    sizes: tuple[int, ...]
    crc: int | None
    what: str

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclasses.dataclass
class OutTensor:
    """One tensor of the exported folder: ``name`` (the prefix stripped), of ``shape``, read
    as ``dtype`` from its ``boxes`` and written as ``out_dtype``; ``key`` is its name in the
    source."""

    name: str
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    boxes: list[Box]
    out_dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Its bytes as written."""
        return self.numel * self.out_dtype.itemsize

    @property
    def cast(self) -> bool:
        return self.out_dtype != self.dtype


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in DTYPES.values()):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ExportError(f"dtype {dtype!r}: an export casts floating-point tensors to bf16, fp16 or fp32 "
                      f"(also spelled {sorted(set(DTYPES) - {'bf16', 'fp16', 'fp32'})}); leave it out to keep "
                      "the stored dtypes")


def parse_size(size: int | str) -> int:
    """Bytes from an int or "5GB", "500MB", "2GiB" (units as transformers takes them: KB, MB,
    GB, TB are powers of 10; KiB, MiB, GiB, TiB powers of 2)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = _SIZE.fullmatch(size) if isinstance(size, str) else None
        if m is None or m.group(2).upper() not in _UNITS:
            raise ExportError(f"max_shard_size {size!r}: give bytes as an int or a size such as '5GB', '500MB' or "
                              "'2GiB' (KB, MB, GB, TB: powers of 10; KiB, MiB, GiB, TiB: powers of 2)")
        value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value < 1:
        raise ExportError(f"max_shard_size {size!r}: must be at least 1 byte")
    return value


def cast_to(dtype: torch.dtype, target: torch.dtype | None, key: str) -> torch.dtype:
    """The dtype a tensor stored as ``dtype`` is written as: ``target`` for floating-point
    tensors, its own for integers, bools and complex numbers."""
    if target is None or dtype == target or not dtype.is_floating_point:
        return dtype
    try:
        torch.empty(1, dtype=dtype).to(target)
    except (RuntimeError, TypeError) as e:
        raise ExportError(f"{key}: torch cannot cast {dtype} to {target} ({e}); export without a dtype") from e
    return target


def split(tensors: list[OutTensor], max_shard_size: int) -> list[list[OutTensor]]:
    """The shards of ``tensors`` (in the state's order), as ``huggingface_hub`` cuts them."""
    shards: list[list[OutTensor]] = []
    current: list[OutTensor] = []
    size = 0
    for t in tensors:
        if t.nbytes > max_shard_size:  # a shard of its own, placed before the one being filled
            shards.append([t])
            continue
        if size + t.nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current:
        shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SAFE_WEIGHTS]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def index_json(shards: list[list[OutTensor]], names: list[str]) -> bytes:
    """``model.safetensors.index.json`` as ``save_pretrained`` writes it."""
    weight_map = {t.name: name for shard, name in zip(shards, names, strict=True) for t in shard}
    total = sum(t.nbytes for shard in shards for t in shard)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def check_model_state(top: dict[str, bool], source: str) -> None:
    """Without a prefix, the source must be a model's flat state (``{name: tensor}``, as
    ``state_dict()`` returns): ``top`` maps its top-level keys to whether each is a tensor.
    Exporting a training state whole would write its optimizer's moments, its RNG state and
    the rest as weights of the model, which transformers loads without a word."""
    others = [k for k, is_tensor in top.items() if not is_tensor]
    if not others:
        return
    keys = ", ".join(repr(k) for k in list(top)[:8]) + (" ..." if len(top) > 8 else "")
    hint = "model" if "model" in others else others[0]
    raise ExportError(f"{source}: holds more than a model's flat state of tensors: its top-level entries are {keys}, "
                      f"and {others[0]!r} is not a tensor, so exporting it all would write optimizer state and other "
                      f"entries as weights of the model. Pass prefix={hint + '.'!r} (--prefix {hint}.) to export the "
                      "tensors under it, or prefix='' (--prefix '') to export every tensor on purpose")


def strip_prefix(keys: list[str], prefix: str | None, source: str) -> dict[str, str]:
    """{key: exported name} of the keys under ``prefix`` (all, without one), in order."""
    picked = {k: k[len(prefix) :] for k in keys if k.startswith(prefix)} if prefix else {k: k for k in keys}
    if not picked:
        shown = ", ".join(repr(k) for k in keys[:6]) + (" ..." if len(keys) > 6 else "")
        raise ExportError(f"{source}: no tensor's name starts with the prefix {prefix!r}; its tensors are "
                          f"{shown or 'none'}" + (" (pass the prefix with its trailing dot, e.g. 'model.')"
                                                  if prefix else ""))
    bad = [k for k, name in picked.items() if not name or name == "__metadata__" or name.startswith(".")]
    if bad:
        raise ExportError(f"{source}: the tensor {bad[0]!r} has no name left once the prefix {prefix!r} is "
                          "stripped, or one that starts with a dot (or the name safetensors reserves); choose a "
                          "prefix that ends where the names begin, dot included ('model.')")
    return picked
