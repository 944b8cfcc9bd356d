"""Child of the sink's memory test: writes an object of MIB MiB to the S3 URL in argv[1] as the
write engine does (8 threads, each refilling its own 16 MiB staging buffer chunk after chunk in
file order and writing it to the sink), and prints one JSON line: the peak RSS growth from just
before the first write to after the publish, the staging bytes, and the object's CRC-32C."""

from __future__ import annotations

import json
import mmap
import sys
import threading

import torch

from ckptstream import _checksum
from ckptstream._settings import DirectIO
from ckptstream._storage.s3 import S3Storage
from ckptstream.bench.measure import PeakRss

MiB = 1 << 20
PART, THREADS, HEADER = 16 * MiB, 8, 8192

if __name__ == "__main__":
    url, total = sys.argv[1], int(sys.argv[2]) * MiB
    sink = S3Storage().create(url)  # the client is made and the bucket looked at before the measure
    maps = [mmap.mmap(-1, PART) for _ in range(THREADS)]
    buffers = [(memoryview(m), torch.frombuffer(m, dtype=torch.uint8)) for m in maps]
    for _, b in buffers:
        b.fill_(1)  # resident, as pooled staging buffers are
    header = torch.randint(0, 256, (HEADER,), dtype=torch.uint8).numpy().tobytes()
    chunks = [(lo, min(total, lo + PART) if lo else PART) for lo in range(0, total, PART)]
    chunks[0] = (HEADER, PART)
    crcs: dict[int, tuple[int, int]] = {}
    claim, lock = iter(chunks), threading.Lock()

    def run(buf: tuple[memoryview, torch.Tensor]) -> None:
        while True:
            with lock:
                chunk = next(claim, None)
            if chunk is None:
                return
            lo, hi = chunk
            torch.randint(0, 256, (hi - lo,), dtype=torch.uint8, generator=torch.Generator().manual_seed(lo),
                          out=buf[1][: hi - lo])  # the device copy's stand-in: new bytes in the same buffer
            view = buf[0][: hi - lo]
            crcs[lo] = (_checksum.crc_of(view), hi - lo)
            sink.write_at(view, lo)

    with PeakRss() as peak:
        sink.write_at(memoryview(bytes(HEADER)), 0)
        sink.grid(PART, DirectIO.AUTO)
        threads = [threading.Thread(target=run, args=(b,)) for b in buffers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sink.write_at(memoryview(header), 0)
        sink.publish()
    crc = _checksum.crc_of(header)
    for lo in sorted(crcs):
        crc = _checksum.combine(crc, *crcs[lo])
    print(json.dumps({"growth": peak.growth, "staging": THREADS * PART, "crc": crc,
                      "chunks": len(crcs)}))
