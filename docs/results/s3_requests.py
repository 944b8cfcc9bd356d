"""The requests ckptstream sends to an S3 store for a save, a load and a manager's steps of the
benchmark's default state (0.25 GiB GPT-like, 928 tensors; default settings: 16 MiB parts),
counted on the client's own events. Run against any store that the standard AWS variables
reach, with a bucket ``bench``, from the repository's root:

    AWS_ENDPOINT_URL=... AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... AWS_REGION=us-east-1 \
        PYTHONPATH=src python docs/results/s3_requests.py > docs/results/s3-requests.txt
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable
from typing import Any

import torch

import ckptstream
from ckptstream._storage import s3client
from ckptstream.bench.options import add_arguments, resolve_options
from ckptstream.bench.state import build_state

BASE = "s3://bench/requests"


def main() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    opts = resolve_options(parser.parse_args(["--dir", BASE, "--device", "cpu"]))
    state = build_state(opts.spec, "cpu")
    sent: collections.Counter[str] = collections.Counter()
    s3client.client().meta.events.register(
        "before-send.s3", lambda event_name, **kw: sent.update([event_name.rsplit(".", 1)[1]]))

    def count(what: str, fn: Callable[[], Any]) -> None:
        sent.clear()
        fn()
        print(f"{what}: {sum(sent.values())} {dict(sorted(sent.items()))}")

    def read_one() -> None:
        with ckptstream.open(url) as reader:
            reader.read(sorted(reader.keys())[0])

    url = f"{BASE}/state.safetensors"
    count("save 256 MiB (new key)", lambda: ckptstream.save(state, url))
    count("save 256 MiB (over it)", lambda: ckptstream.save(state, url))
    count("load", lambda: ckptstream.load(url))
    count("load_into", lambda: ckptstream.load_into(state, url))
    count("open + read one small tensor", read_one)
    count("small save (4 KiB)", lambda: ckptstream.save({"w": torch.randn(1024)}, f"{BASE}/small.safetensors"))
    with ckptstream.CheckpointManager(f"{BASE}/run", keep=2) as manager:
        for step in (1, 2):
            count(f"manager step {step} (keep=2, nothing to prune)",
                  lambda step=step: manager.save(step, state, blocking=True))
        count("manager step 3 (keep=2, prunes step 1)", lambda: manager.save(3, state, blocking=True))
        count("manager steps()", manager.steps)
        count("manager load() (the latest)", manager.load)
        for step in manager.steps():
            manager.delete(step)
    for name in ("state.safetensors", "small.safetensors"):
        s3client.client().delete_object(Bucket="bench", Key=f"requests/{name}")


if __name__ == "__main__":
    main()
