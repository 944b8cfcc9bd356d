"""When the requests of a read go out: the object-store benchmark's raw download in place (a HEAD,
then 16 MiB ranged GETs, 8 in flight) beside ``ckptstream.load_into`` of the same bytes (the
benchmark's default state, 0.25 GiB, 928 tensors), in turn, 4 pairs, timed on the client's own
request events. Each object is read once before the pairs (neither pays a store's first read of
a new object). Run against any store that the standard AWS variables reach, with a bucket
``bench``, from the repository's root:

    AWS_ENDPOINT_URL=... AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... AWS_REGION=us-east-1 \
        PYTHONPATH=src python docs/results/s3_read_timeline.py > docs/results/s3-read-timeline.txt
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import ckptstream
from ckptstream._storage import s3client
from ckptstream.bench.objectstore import RawClient
from ckptstream.bench.options import add_arguments, resolve_options
from ckptstream.bench.state import build_state, empty_like_state, state_nbytes


def main() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    opts = resolve_options(parser.parse_args(["--dir", "s3://bench/timeline", "--device", "cpu"]))
    state = build_state(opts.spec, "cpu")
    into = empty_like_state(state, resident=True)
    nbytes = state_nbytes(state)
    url = "s3://bench/timeline/state.safetensors"
    ckptstream.save(state, url)
    raw = RawClient(16 << 20, 8)
    raw.upload("bench", "timeline/raw", memoryview(bytearray(os.urandom(nbytes))))
    buf = memoryview(bytearray(nbytes))
    events: list[tuple[str, float]] = []
    for client in (raw.s3, s3client.client()):
        client.meta.events.register("before-send.s3", lambda **kw: events.append(("send", time.perf_counter())))
        client.meta.events.register("after-call.s3", lambda **kw: events.append(("answered", time.perf_counter())))
    raw.download("bench", "timeline/raw", buf)
    ckptstream.load_into(into, url)

    def show(name: str, fn: Callable[[], Any]) -> None:
        events.clear()
        start = time.perf_counter()
        fn()
        end = time.perf_counter()
        sends = [t - start for what, t in events if what == "send"]
        print(f"{name}: {1e3 * (end - start):.0f} ms in all; requests sent at {1e3 * sends[0]:.0f}, "
              f"{1e3 * sends[1]:.0f}, ... {1e3 * sends[-1]:.0f} ms ({len(sends)}); last answer's headers at "
              f"{1e3 * (max(t for _, t in events) - start):.0f} ms")

    for _ in range(4):
        show("download in place (raw client)", lambda: raw.download("bench", "timeline/raw", buf))
        show("load_into", lambda: ckptstream.load_into(into, url))
    for key in ("timeline/raw", "timeline/state.safetensors"):
        raw.s3.delete_object(Bucket="bench", Key=key)


if __name__ == "__main__":
    main()
