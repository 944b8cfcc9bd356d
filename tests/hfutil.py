"""Helpers of the export tests: a tiny GPT-2 (transformers' own classes, nothing downloaded),
its logits, and the checks every exported folder must pass."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import torch

import ckptstream

VOCAB, CTX = 96, 16


def tiny_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=CTX, bos_token_id=0,
                      eos_token_id=0)


def tiny_gpt2(seed: int = 1234) -> Any:
    """A GPT-2 of random weights (lm_head tied to the token embedding), in eval mode."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(tiny_config()).eval()
    with torch.no_grad():  # layer norms away from their all-ones init: no two tensors alike
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def trained_state(model: Any) -> dict[str, Any]:
    """A training state of ``model``: weights, AdamW state after one step, the step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    model.train()
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, CTX), generator=torch.Generator().manual_seed(11))


def logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens()).logits


def reload(folder: Path, dtype: torch.dtype | None = None) -> Any:
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dtype is None:
            return GPT2LMHeadModel.from_pretrained(folder).eval()
        return GPT2LMHeadModel.from_pretrained(folder, dtype=dtype).eval()


def check_folder(folder: Path, *, shards: int | None = None) -> dict[str, Any]:
    """The folder is what transformers writes: one model.safetensors, or shards whose index names
    every tensor once and sums their bytes; every file passes ckptstream.verify and declares
    format "pt". Returns {name: tensor} of all its tensors."""
    from safetensors import safe_open

    files = sorted(p.name for p in folder.iterdir() if p.name.endswith(".safetensors"))
    index_path = folder / "model.safetensors.index.json"
    assert not [p.name for p in folder.iterdir() if ".ckptstream-tmp-" in p.name]
    if len(files) == 1 and files[0] == "model.safetensors":
        assert not index_path.exists()
        index = None
    else:
        index = json.loads(index_path.read_text())
        assert set(index) == {"metadata", "weight_map"}
        assert set(index["metadata"]) == {"total_size"}
        count = len(files)
        assert files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    if shards is not None:
        assert len(files) == shards, files
    tensors: dict[str, Any] = {}
    total = 0
    for name in files:
        ckptstream.verify(folder / name)
        with safe_open(str(folder / name), "pt") as f:
            assert f.metadata()["format"] == "pt"
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                assert key not in tensors, f"{key} twice"
                tensors[key] = f.get_tensor(key)
                total += tensors[key].numel() * tensors[key].element_size()
                if index is not None:
                    assert index["weight_map"][key] == name
    if index is not None:
        assert set(index["weight_map"]) == set(tensors)
        assert index["metadata"]["total_size"] == total
        text = index_path.read_text()
        assert text == json.dumps(index, indent=2, sort_keys=True) + "\n"
    return tensors


def assert_reloads(folder: Path, model: Any) -> None:
    """``from_pretrained(folder)`` gives bit-equal logits, with the head tied to the embedding."""
    loaded = reload(folder)
    assert torch.equal(logits(loaded), logits(model))
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
