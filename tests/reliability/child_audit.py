"""Loads trusted and hostile files under an audit hook and prints, as JSON, every audited event
that would mean code ran from a file: unpickling, exec/eval/compile, marshal, new processes.

    argv: DIRECTORY (holding the files to load; every *.safetensors in it is tried)

Everything is loaded once before the hook is installed, so that imports the readers do on
first use (which exec module code) are not counted.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import ckptstream

WATCHED = ("pickle.", "exec", "compile", "marshal.", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
           "subprocess.Popen", "ctypes.dlopen", "builtins.input")  # fmt: skip


def load_everything(directory: str) -> list[str]:
    outcomes = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(directory, name)
        for call in (ckptstream.load, ckptstream.verify, ckptstream.read_metadata,
                     lambda p: ckptstream.load_into({}, p, strict=False)):  # fmt: skip
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    call(path)
                outcomes.append(f"{name}: ok")
            except ckptstream.CkptStreamError as e:
                outcomes.append(f"{name}: {type(e).__name__}")
    return outcomes


def main() -> None:
    directory = sys.argv[1]
    first = load_everything(directory)
    events: list[str] = []

    def hook(event: str, args: tuple[object, ...]) -> None:
        if event.startswith(WATCHED):
            events.append(f"{event} {args!r:.200}")

    sys.addaudithook(hook)
    second = load_everything(directory)
    print(json.dumps({"events": events, "outcomes": second, "same_outcomes": first == second}))


if __name__ == "__main__":
    main()
