"""The ``ckptstream`` command: inspect / verify checkpoint files, run the benchmark."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptstream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from . import bench

    bench.add_arguments(sub.add_parser("bench", help="measure ckptstream against the disk, PCIe and its peers"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from . import bench

        return bench.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
