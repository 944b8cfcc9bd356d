"""Child of the API tests on s3:// URLs. ``kill URL``: starts ``ckptstream.save`` of a 48 MiB
state to URL, says "parts up" on stdout once two data parts are uploaded, then holds the upload
there until it is killed. ``memory URL MIB``: saves a state of MIB MiB of 16 MiB tensors to URL
and prints one JSON line: the peak RSS growth over the RSS before the save (the state made and
the client started first), and the staging that the save held."""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

import torch

import ckptstream
from ckptstream._storage import storage_for
from ckptstream.bench.measure import PeakRss

MiB = 1 << 20


def state(mib: int) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.randn(16 * MiB // 4) for i in range(mib // 16)}


if __name__ == "__main__":
    op, url = sys.argv[1], sys.argv[2]
    if op == "kill":
        uploaded: list[int] = []
        hold = threading.Event()

        def after_part(**kwargs: Any) -> None:
            uploaded.append(1)
            if len(uploaded) == 2:
                print("parts up", flush=True)
            if len(uploaded) >= 2:
                hold.wait()  # never set: the save stays here until the process is killed

        storage_for(url).client().boto.meta.events.register("after-call.s3.UploadPart", after_part)  # type: ignore[attr-defined]
        ckptstream.save(state(48), url)
    else:
        s = state(int(sys.argv[3]))
        storage_for(url).check_target(url)  # the client made and the bucket looked at before the measure
        with ckptstream.settings(buffer_size=16 * MiB, num_buffers=8, io_threads=8), PeakRss() as peak:
            ckptstream.save(s, url)
        print(json.dumps({"growth": peak.growth, "staging": ckptstream.staging_bytes()}))
