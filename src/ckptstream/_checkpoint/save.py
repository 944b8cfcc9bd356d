"""save: a whole training state to one safetensors file, atomically.

flatten the state -> tensor table and header (checksums as placeholders) -> a sink of the
target's storage (a local file: a temp beside the target) -> the header, then the tensors
streamed through the write engine -> the header again with the checksums -> publish (a local
file: fsync, rename over the target, fsync the directory).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from .. import _gc
from .._engine import Mark, Piece, WriteEngine, interrupts_deferred
from .._engine.control import raise_if_interrupted
from .._errors import UnsupportedTypeError
from .._format import header as _header
from .._format.flatten import flatten
from .._format.header import TensorInfo
from .._progress import progress_bar
from .._settings import LegacySaveKeywords, Settings, per_call
from .._storage import storage_for

if TYPE_CHECKING:
    from typing_extensions import Unpack


@dataclasses.dataclass
class CheckpointPlan:
    """What a save writes: the header (with placeholder checksums) and the tensors, in file order."""

    header: bytes
    infos: list[TensorInfo]
    tensors: list[torch.Tensor]
    checksum: bool

    def with_tensors(self, tensors: list[torch.Tensor]) -> CheckpointPlan:
        """The same file from other tensors of the same dtypes and shapes (a snapshot)."""
        return dataclasses.replace(self, tensors=tensors)


def plan_checkpoint(state: Any, metadata: Mapping[str, str] | None, checksum: bool) -> CheckpointPlan:
    """Flatten ``state`` and encode its header; raises before any file is touched."""
    user = _header.check_user_metadata(metadata)
    with _gc.paused():
        try:
            flat = flatten(state)
            structure = json.dumps(flat.tree, separators=(",", ":"))
        except RecursionError as e:
            raise UnsupportedTypeError("the state is nested too deeply to be stored, or contains itself") from e
        by_name = {r.name: r.tensor for r in flat.records}
        infos = _header.data_offsets([(r.name, r.tensor.dtype, tuple(r.tensor.shape)) for r in flat.records])
        header = _header.encode(infos, user, structure, checksums=checksum)
    return CheckpointPlan(header, infos, [by_name[i.name] for i in infos], checksum)


class Outcome:
    """What a save has done, for a KeyboardInterrupt that ends it: ``published`` is set (inside
    the save's deferred-interrupt scope) as soon as the publish returns; ``told`` holds the
    interrupt's two messages, made before the save begins."""

    def __init__(self, name: str) -> None:
        self.published = False
        self.told = (f"the save was interrupted; nothing was published: {name} is as it was",
                     f"the save was interrupted; the checkpoint at {name} was published: the new file is "
                     "in place, complete")


def write_checkpoint(plan: CheckpointPlan, path: str | os.PathLike[str], cfg: Settings, *, progress: bool = False,
                     stream: torch.cuda.Stream | None = None, after: Mark | None = None,
                     staged: Callable[[], None] | None = None, outcome: Outcome | None = None) -> list[int]:
    """Write ``plan`` to a sink of ``path`` (a path or URL) and publish it atomically; returns
    each tensor's CRC-32C in file order (empty without checksums). The one writer of checkpoint
    files: ``save``, ``save_async``, the manager and ``ckptstream.dcp``'s rank files. The copies
    follow the caller's CUDA work (``stream``, or a ``mark`` taken earlier, see the engine).
    ``staged`` is called once every byte of the tensors is out of them (before the header's
    checksums and the publication): a background save lets its caller change the tensors from
    then on. ``outcome.published`` is set once the file is published."""
    name = os.fsdecode(path)
    try:
        return _write(plan, name, cfg, progress, stream, after, staged, outcome)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        size = len(plan.header) + (plan.infos[-1].end if plan.infos else 0)
        raise OSError(e.errno, f"{e.strerror}; the checkpoint {name} needs {size} bytes ({size / 2**20:.1f} MiB) "
                      "on its file system (where it replaces a file, beside that file until it is published): free "
                      "that much space there, or save elsewhere", e.filename) from e


def _write(plan: CheckpointPlan, name: str, cfg: Settings, progress: bool, stream: torch.cuda.Stream | None,
           after: Mark | None, staged: Callable[[], None] | None, outcome: Outcome | None) -> list[int]:
    with interrupts_deferred():
        with storage_for(name).create(name) as sink:
            sink.write_at(memoryview(plan.header), 0)
            raise_if_interrupted()  # a Ctrl-C while the temp was being opened: stop before streaming
            start = len(plan.header)
            with _gc.paused():
                # all of each tensor's bytes (Piece.of, with the size the table already holds)
                pieces = [Piece(t, start + i.begin, 0, i.end - i.begin)
                          for t, i in zip(plan.tensors, plan.infos, strict=True)]
            total = plan.infos[-1].end if plan.infos else 0  # the tensors lie back to back
            with progress_bar(progress, total, f"save {os.path.basename(name)}") as bar:
                with _gc.paused():
                    engine = WriteEngine(sink, pieces, cfg, checksum=plan.checksum, progress=bar,
                                         stream=stream, after=after)
                crcs = engine.run()
            if staged is not None:
                staged()
            if plan.checksum:  # the same length: written over the placeholders
                sink.write_at(memoryview(_header.fill(plan.header, crcs)), 0)
            raise_if_interrupted()  # a Ctrl-C until here leaves the old file in place
        if outcome is not None:  # still deferred: no interrupt lands between the publish and this
            outcome.published = True
    return crcs


NOT_STARTED = "the save was interrupted before it began; nothing was published"


def save(state: Any, path: str | os.PathLike[str], *, metadata: Mapping[str, str] | None = None,
         checksum: bool = True, progress: bool = False, settings: Settings | None = None,
         **legacy: Unpack[LegacySaveKeywords]) -> None:
    """Save a training state to one safetensors file, atomically.

    Args:
        state: nested dict / OrderedDict / list / tuple with tensors (any device, any dtype
            that safetensors names: not complex128 or complex32, see docs/format.md),
            None, bool, int, float and str leaves (``model.state_dict()``,
            ``optimizer.state_dict()``, step, RNG states, ...). A flat ``{str: Tensor}`` keeps
            its keys as the tensor names, so safetensors readers see exactly those tensors.
        path: the file to create or replace (a local path, or the URL of a registered
            storage). Until the new file is complete and durable the old one stays untouched; a
            reader sees the old or the new file, never a mix.
        metadata: extra ``str -> str`` pairs for the header's ``__metadata__``.
        checksum: store a CRC-32C of every tensor (checked by ``load`` and ``verify``).
        progress: show a progress bar on stderr.
        settings: the ``Settings`` of this call (a complete value, e.g.
            ``ckptstream.Settings(buffer_size=64 << 20)``); None: those in force (see
            ``ckptstream.settings``). 0.1.0's per-call ``buffer_size``,
            ``num_buffers`` and ``direct_io`` are deprecated in its favour.

    Raises:
        UnsupportedTypeError: a value that cannot be stored (named by its key path), before
            any file is created.
        TypeError, ValueError: metadata that is not ``str -> str`` or uses the reserved
            ``ckptstream.`` prefix; a header over safetensors' 100 MB limit (before any file).
        OSError: from the OS (a full disk, a missing directory), with the path.
        KeyboardInterrupt: a Ctrl-C (SIGINT with Python's default handler) during the save.
            Its ``published`` attribute says what it left: True, the new checkpoint is at
            ``path``, complete (the interrupt came once the publish had begun); False, nothing
            was published and ``path`` is as it was (no temp file is left). Its message says
            the same; its ``path`` attribute is the ``path`` given.

    Example:
        >>> ckptstream.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 7}, "ckpt.safetensors")
    """
    # no call before the try, and none in the handler: a call is where the interpreter raises
    # a pending interrupt (the first Ctrl-C's, or a second one's while the first is handled)
    outcome = None
    try:
        outcome = Outcome(os.fsdecode(path))
        cfg = per_call("save", settings, legacy)
        write_checkpoint(plan_checkpoint(state, metadata, checksum), path, cfg, progress=progress, outcome=outcome)
    except KeyboardInterrupt as e:
        # the same exception (Python reports it, and exits, as Ctrl-C's), told what it left
        e.path = path  # type: ignore[attr-defined]
        e.published = outcome is not None and outcome.published  # type: ignore[attr-defined]
        e.args = (outcome.told[outcome.published] if outcome is not None else NOT_STARTED,)
        raise
