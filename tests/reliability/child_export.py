"""Child of test_export_memory.py and test_export_interrupt.py.

    child_export.py memory SRC OUT CAST    peak RSS growth of one export_hf of SRC (CAST: "none" or
                                           "bf16"); prints one JSON line: growth, staging, the
                                           largest tensor's bytes
    child_export.py kill SRC OUT POINT     export_hf that prints "ready" and waits for its kill at
                                           POINT: "stream" (the 2nd shard's data is streaming) or
                                           "publish" (the 1st shard is renamed in, the 2nd is not)
    child_export.py files SRC OUT LIMIT    export_hf of SRC, one tensor a shard, with RLIMIT_NOFILE at
                                           LIMIT descriptors; prints one JSON line: the shards, and the
                                           descriptors open before the export
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import threading
from typing import Any

import ckptstream
from ckptstream import Settings
from ckptstream._export import copy
from ckptstream._storage import files

SETTINGS: dict[str, Any] = {"buffer_size": 4 << 20, "num_buffers": 4, "io_threads": 4}


_said = threading.Lock()


def ready_and_wait() -> None:
    if _said.acquire(blocking=False):  # once: several I/O threads may reach the point together
        print("ready", flush=True)
    threading.Event().wait()  # until the parent's SIGKILL


def kill_at(point: str) -> None:
    calls = {"move": 0, "run": 0, "publish": 0}
    lock = threading.Lock()
    run, move, publish = copy.Copier.run, copy.Copier._move, files.AtomicSink.publish

    def counted_run(self: Any) -> Any:
        calls["run"] += 1
        return run(self)

    def counted_move(self: Any, *args: Any) -> Any:
        with lock:
            stop = point == "stream" and calls["run"] == 2
        if stop:
            ready_and_wait()
        return move(self, *args)

    def counted_publish(self: Any) -> Any:
        calls["publish"] += 1
        if point == "publish" and calls["publish"] == 2:
            ready_and_wait()
        return publish(self)

    copy.Copier.run = counted_run  # type: ignore[method-assign]
    copy.Copier._move = counted_move  # type: ignore[method-assign,assignment]
    files.AtomicSink.publish = counted_publish  # type: ignore[method-assign]


def main() -> int:
    what, src, out, arg = sys.argv[1:5]
    if what == "kill":
        kill_at(arg)
        ckptstream.export_hf(src, out, prefix="model.", max_shard_size="40KB", settings=Settings(buffer_size=8192,
                                                                                                 num_buffers=2))
        print("finished", flush=True)
        return 0
    if what == "files":
        open_before = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (int(arg), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        result = ckptstream.export_hf(src, out, max_shard_size=1, settings=Settings(buffer_size=4096, io_threads=2))
        print(json.dumps({"shards": len(result.files) - 1, "open_before": open_before}))
        return 0
    from ckptstream.bench.measure import PeakRss

    with ckptstream.open(src) as reader:
        largest = max(e.nbytes for e in reader.entries())
    gc.collect()
    with PeakRss() as peak:
        ckptstream.export_hf(src, out, dtype=None if arg == "none" else arg, settings=Settings(**SETTINGS))
        staging = ckptstream.staging_bytes()
    print(json.dumps({"growth": peak.growth, "staging": staging, "largest": largest}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
