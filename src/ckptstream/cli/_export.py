"""``ckptstream export-hf``: a checkpoint's model as a Hugging Face folder (``ckptstream.export_hf``)."""

from __future__ import annotations

import argparse
import inspect
import sys

import ckptstream

HELP = "write a checkpoint's model as a Hugging Face folder (safetensors shards and index) that from_pretrained loads"

EPILOG = ("Tied tensors (the same tensor under two names) are written once, as transformers writes them. The "
          "files stream through ckptstream's staging buffers; nothing in OUT changes until every new file is durable, "
          "and the index (or the single model.safetensors) is renamed in last. Exit status: 0 "
          "written; 1 the source fails its checksums or does not hold what its metadata says; 2 bad arguments or "
          "input.")

DEFAULT_MAX_SHARD_SIZE = inspect.signature(ckptstream.export_hf).parameters["max_shard_size"].default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    add = parser.add_argument
    add("src", help="a checkpoint file, a CheckpointManager directory (its newest complete step) or step folder, or a "
                    "DCP checkpoint's folder (StreamWriter or FileSystemWriter)")
    add("out", help="the folder to write (created if missing; other files in it stay)")
    add("--prefix", help="export only the tensors under this prefix, without it (e.g. 'model.' for "
                         "{'model': ..., 'optim': ...}); without --prefix the source must be a model's flat "
                         "state_dict, and --prefix '' exports every tensor")
    add("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, metavar="SIZE",
        help=f"bytes per shard, e.g. 5GB, 500MB, 2GiB (default {DEFAULT_MAX_SHARD_SIZE})")
    add("--dtype", choices=("bf16", "fp16", "fp32"), help="cast floating-point tensors (integers and bools stay)")
    add("--config", metavar="config.json", help="copy this config.json into the folder")
    add("--quiet", action="store_true", help="no progress bar, no summary")


def run(args: argparse.Namespace) -> int:
    """``ckptstream export-hf``: 0 written, 1 a corrupt source, 2 bad arguments or input."""
    try:
        result = ckptstream.export_hf(args.src, args.out, prefix=args.prefix, max_shard_size=args.max_shard_size,
                                      dtype=args.dtype, config=args.config, progress=not args.quiet)
    except (ckptstream.CkptStreamError, OSError, ValueError) as e:
        print(f"ckptstream export-hf: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, ckptstream.CorruptCheckpointError) else 2
    if not args.quiet:
        print(f"exported {result.tensors} tensors ({result.total_size} bytes) of the {result.source} to "
              f"{result.folder}: {', '.join(result.files)}")
        for name, kept in result.tied.items():
            print(f"  {name}: tied to {kept}, stored once")
    return 0
