"""The tokenizer and the text that torchtitan's llama3 debug config reads, made on the spot: a
word-level tokenizer over a few words (torchtitan's own test assets are not in its wheel)."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "cats", "sleep", "on",
         "warm", "mats", "and", "birds", "sing", "in", "tall", "green", "trees", "by", "river", "under", "grey")


def make_assets(folder: Path) -> tuple[Path, Path]:
    """(tokenizer folder, data folder) under ``folder``, the same bytes every time."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer_dir, data_dir = folder / "tokenizer", folder / "text"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *sorted(set(WORDS))])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    chooser = random.Random(0)
    lines = [json.dumps({"text": " ".join(chooser.choice(WORDS) for _ in range(chooser.randint(20, 90)))})
             for _ in range(300)]
    (data_dir / "data.json").write_text("\n".join(lines) + "\n")
    return tokenizer_dir, data_dir
