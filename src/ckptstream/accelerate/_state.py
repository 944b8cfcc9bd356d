"""What ``Accelerator.save_state`` saves, as one plain ckptstream state, and back.

Accelerate writes each part to a file of its own (``model.safetensors``, ``optimizer.bin``,
``scheduler.bin``, ``sampler.bin``, ``dl_state_dict.bin``, ``scaler.pt``,
``random_states_<rank>.pkl``, ``custom_checkpoint_<i>.pkl``); here the same parts are the keys
of one tree. The RNG states become tensors and plain numbers: Python's ``random`` state (a tuple
of 625 ints) as an int64 tensor, numpy's (a tuple around a uint32 array) as an int64 tensor and
its scalars, torch's as the uint8 tensors torch gives.

Loading checks the whole tree against the accelerator before changing anything (``check``), so
that a mismatch (another model, a changed optimizer param group) raises with nothing overwritten;
``apply`` then loads every part.
"""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import torch
from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

from .._errors import StateMismatchError

try:
    from accelerate.utils import get_torch_accelerator_backend
except ImportError:  # Accelerate before 1.16

    def get_torch_accelerator_backend() -> tuple[str | None, Any]:
        """The accelerator whose generators Accelerate saves, and its torch module."""
        for name in ("cuda", "xpu", "npu", "mlu", "musa"):
            module = getattr(torch, name, None)
            if module is not None and module.is_available():
                return name, module
        if torch.backends.mps.is_available():
            return "mps", torch.mps
        return None, None

__all__ = ["SHARED", "apply", "check", "rng_state", "set_rng_state", "shared_state"]

SHARED = ("models", "optimizers", "schedulers", "dataloaders", "scaler", "custom")  # written once (main process)


# --- saving ---------------------------------------------------------------------------------------


def shared_state(accelerator: Any, weights: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The parts Accelerate writes on the main process, in the order it writes them."""
    return {
        "models": list(weights),
        "optimizers": [opt.state_dict() for opt in accelerator._optimizers],
        "schedulers": [sched.state_dict() for sched in accelerator._schedulers],
        "dataloaders": [_dataloader_state(dl) for dl in accelerator._dataloaders],
        "scaler": None if accelerator.scaler is None else accelerator.scaler.state_dict(),
        "custom": [obj.state_dict() for obj in accelerator._custom_objects],
    }


def _dataloader_state(dataloader: Any) -> dict[str, Any]:
    """Accelerate's two cases: the seedable sampler of an ``IterableDatasetShard`` (its seed and
    epoch are its whole state: it reseeds its generator from them at each ``__iter__``) and a
    torchdata ``StatefulDataLoader``'s ``state_dict``."""
    state: dict[str, Any] = {}
    sampler = _seedable_sampler(dataloader)
    if sampler is not None:
        state["sampler"] = {"initial_seed": int(sampler.initial_seed), "epoch": int(sampler.epoch)}
    if getattr(dataloader, "use_stateful_dataloader", False):
        state["state_dict"] = dataloader.state_dict()
    return state


def _seedable_sampler(dataloader: Any) -> Any:
    if isinstance(getattr(dataloader, "dataset", None), IterableDatasetShard):
        sampler = dataloader.get_sampler()
        if isinstance(sampler, SeedableRandomSampler):
            return sampler
    return None


def rng_state(step: int) -> dict[str, Any]:
    """This process's RNG states and the accelerator's step (``random_states_<rank>.pkl``)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    state: dict[str, Any] = {
        "step": int(step),
        "random": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    device_type, module = get_torch_accelerator_backend()
    if device_type is not None:  # Accelerate's key for the device generators
        state["device"] = {"type": device_type, "states": _device_states(device_type, module)}
    return state


def _device_states(device_type: str, module: Any) -> list[torch.Tensor]:
    if module is torch.accelerator or device_type == "mps":
        return [torch.get_device_module(device_type).get_rng_state()]
    return list(module.get_rng_state_all())


def set_rng_state(state: dict[str, Any]) -> None:
    r, n = state["random"], state["numpy"]
    random.setstate((r["version"], tuple(r["state"].tolist()), r["gauss"]))
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    device = state.get("device")
    device_type, module = get_torch_accelerator_backend()
    if device is None or device_type != device["type"]:
        return  # as Accelerate: saved without (or with another) device, the device generators stay
    if module is torch.accelerator or device_type == "mps":
        torch.get_device_module(device_type).set_rng_state(device["states"][0])
    else:
        module.set_rng_state_all(device["states"])


# --- loading --------------------------------------------------------------------------------------


def check(accelerator: Any, models: list[torch.nn.Module], shared: dict[str, Any], strict: bool,
          where: str) -> None:
    """Raise StateMismatchError, naming the part and key, where ``shared`` (from the file) does not
    fit the accelerator: before anything is loaded."""
    counts = {"models": len(models), "optimizers": len(accelerator._optimizers),
              "schedulers": len(accelerator._schedulers), "dataloaders": len(accelerator._dataloaders),
              "custom": len(accelerator._custom_objects)}
    for part, expected in counts.items():
        found = len(shared[part])
        if found != expected:
            what = "objects registered with register_for_checkpointing" if part == "custom" else part
            raise StateMismatchError(f"{where}: the checkpoint holds {found} {part}, the accelerator has {expected} "
                                     f"{what}: load it into an accelerator prepared (and registered) as the one "
                                     "that saved it")
    if (shared["scaler"] is None) != (accelerator.scaler is None):
        raise StateMismatchError(f"{where}: the checkpoint {'has no' if shared['scaler'] is None else 'has a'} "
                                 "GradScaler state and the accelerator "
                                 f"{'has a' if accelerator.scaler is not None else 'has no'} GradScaler")
    for i, (model, weights) in enumerate(zip(models, shared["models"], strict=True)):
        _check_model(model.state_dict(), weights, f"{where}: models[{i}]", strict)
    for i, opt in enumerate(accelerator._optimizers):
        _check_optimizer(opt.state_dict(), shared["optimizers"][i], f"{where}: optimizers[{i}]")


def _check_model(current: dict[str, Any], saved: dict[str, Any], where: str, strict: bool) -> None:
    if strict:
        missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
        if missing or unexpected:
            raise StateMismatchError(f"{where}: keys missing from the checkpoint {missing[:8]}, keys the model does "
                                     f"not have {unexpected[:8]} (load_state(strict=False) skips them)")
    for key in sorted(set(current) & set(saved)):
        have, got = current[key], saved[key]
        if isinstance(have, torch.Tensor) and isinstance(got, torch.Tensor) and have.shape != got.shape:
            raise StateMismatchError(f"{where}[{key!r}]: the checkpoint's tensor has shape {tuple(got.shape)}, the "
                                     f"model's {tuple(have.shape)}")


def _check_optimizer(current: dict[str, Any], saved: Any, where: str) -> None:
    groups, saved_groups = current["param_groups"], saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(saved_groups, list) or len(saved_groups) != len(groups):
        found = len(saved_groups) if isinstance(saved_groups, list) else None
        raise StateMismatchError(f"{where}['param_groups']: the checkpoint holds {found} parameter groups, the "
                                 f"optimizer {len(groups)}")
    for g, (have, got) in enumerate(zip(groups, saved_groups, strict=True)):
        key = f"{where}['param_groups'][{g}]"
        if len(got.get("params", ())) != len(have["params"]):
            raise StateMismatchError(f"{key}['params']: the checkpoint's group holds {len(got.get('params', ()))} "
                                     f"parameters, the optimizer's {len(have['params'])}: the optimizer was built "
                                     "with other parameter groups than the one that saved")
        missing, unexpected = sorted(set(have) - set(got)), sorted(set(got) - set(have))
        if missing or unexpected:
            raise StateMismatchError(f"{key}: options missing from the checkpoint {missing}, options the optimizer "
                                     f"does not have {unexpected}: another optimizer class or torch release saved it")


def apply(accelerator: Any, models: list[torch.nn.Module], shared: dict[str, Any],
          load_kwargs: dict[str, Any]) -> None:
    """Load every part into the accelerator's objects (``check`` has passed)."""
    for model, weights in zip(models, shared["models"], strict=True):
        model.load_state_dict(weights, **load_kwargs)
    for opt, state in zip(accelerator._optimizers, shared["optimizers"], strict=True):
        opt.load_state_dict(state)
    for sched, state in zip(accelerator._schedulers, shared["schedulers"], strict=True):
        sched.load_state_dict(state)
    for dataloader, state in zip(accelerator._dataloaders, shared["dataloaders"], strict=True):
        sampler = _seedable_sampler(dataloader)
        if sampler is not None and "sampler" in state:
            sampler.initial_seed, sampler.epoch = state["sampler"]["initial_seed"], state["sampler"]["epoch"]
        if getattr(dataloader, "use_stateful_dataloader", False) and "state_dict" in state:
            dataloader.load_state_dict(state["state_dict"])
    if accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(shared["scaler"])
    for obj, state in zip(accelerator._custom_objects, shared["custom"], strict=True):
        obj.load_state_dict(state)
