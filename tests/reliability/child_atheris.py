"""atheris harness: coverage-guided fuzzing of the header parser and the readers.

    argv: CASE_FILE [libFuzzer options and corpus directories, e.g. -runs=3000 SEED_DIR]

Any exception other than CkptStreamError, an allocation beyond the file's size or a call over
a second fails the check in fuzzutil.check_file, which atheris reports as a crash (exit != 0).
"""

from __future__ import annotations

import sys

import atheris
import torch  # noqa: F401  (imported first: not instrumented)

with atheris.instrument_imports():
    import ckptstream  # noqa: F401  (its modules are instrumented for coverage)
from tests.reliability.fuzzutil import check_file, frame

CASE = sys.argv[1]


def one_input(data: bytes) -> None:
    # half the inputs get a well-formed length prefix, so they reach the JSON and the structure
    body = frame(data[1:]) if data[:1] == b"{" else data
    with open(CASE, "wb") as f:
        f.write(body)
    check_file(CASE)


if __name__ == "__main__":
    atheris.Setup([sys.argv[0], *sys.argv[2:]], one_input)
    atheris.Fuzz()
