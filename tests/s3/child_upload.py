"""Child of the kill test: starts writing an object to the S3 URL in argv[1] (through the
storage interface, from the standard AWS variables), says so on stdout once data parts are up,
then waits to be killed."""

from __future__ import annotations

import os
import sys

from ckptstream._settings import DirectIO
from ckptstream._storage.s3 import S3Storage

MiB = 1 << 20

if __name__ == "__main__":
    sink = S3Storage().create(sys.argv[1])
    data = os.urandom(24 * MiB)
    sink.write_at(memoryview(bytes(4096)), 0)
    grid = sink.grid(8 * MiB, DirectIO.AUTO)
    sink.write_at(memoryview(data)[4096:grid], 4096)
    sink.write_at(memoryview(data)[grid : 2 * grid], grid)
    print("parts up", flush=True)
    sys.stdin.read()  # until killed
