"""CheckpointManager: numbered checkpoints in one directory, saved in the background, a step
counted only once complete and durable, the newest few kept (see ``directory`` for the files and
``ranks`` for several processes)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

from .._checkpoint.load import load as load_file
from .._checkpoint.load_into import load_into as load_into_file
from .._checkpoint.reader import Device
from .._checkpoint.save_async import AsyncMode, SaveHandle, begin, check_options
from .._errors import ChecksumsMissingError, StateMismatchError, ThreadStartError
from .._settings import Settings, check_settings, current_settings
from .._storage import storage_for
from . import directory as _directory
from . import reports
from .directory import StepCheck, check_step, check_steps
from .ranks import FileRanks, GroupRanks, Ranks

__all__ = ["CheckpointManager", "StepCheck", "check_step", "check_steps"]

log = logging.getLogger("ckptstream")


def _ranks(directory: str, rank: int | None, world_size: int | None, timeout: float) -> Ranks:
    try:
        import torch.distributed as dist

        grouped = dist.is_available() and dist.is_initialized()
    except ImportError:
        grouped = False
    if grouped:
        storage_for(directory).make_folders(directory)  # the ranks' locks and clean-up write there now
        found = GroupRanks(directory, timeout)
        if (rank, world_size) != (None, None) and (rank, world_size) != (found.rank, found.world_size):
            found.close()
            raise ValueError(f"rank={rank}, world_size={world_size} disagree with the process group "
                             f"(rank {found.rank} of {found.world_size}); leave them out")
        return found
    if world_size is None or world_size == 1:
        if rank not in (None, 0):
            raise ValueError(f"rank={rank} needs world_size > {rank}")
        return Ranks(directory, timeout)
    if not isinstance(world_size, int) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, world_size={world_size}), got {rank!r}")
    storage_for(directory).make_folders(directory)
    return FileRanks(directory, timeout, rank, world_size)


def _is_step(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CheckpointManager:
    """Numbered checkpoints in ``directory``: background saves, complete-only listing, keep-K.

    Args:
        directory: created by the first save if missing (a manager that only reads creates
            nothing; with several ranks, making the manager creates it). Layout
            (docs/training.md): ``step-000000001200/`` per step with this process's
            ``state.safetensors`` (or ``rank-00003-of-00008.safetensors`` per rank) and a
            ``DONE`` marker, published last, once every rank's file is durable.
        keep: how many complete checkpoints to keep (the newest); None keeps all. Older ones
            are deleted only once a newer one is complete and durable.
        mode: ``save_async``'s mode for every save ("device", "lazy", "host").
        max_in_flight: ``save_async``'s backpressure knob.
        checksum: store per-tensor checksums (and check them when loading).
        rank, world_size: for several processes without ``torch.distributed``: each process
            passes its own rank. With a process group they come from it (and making the manager
            is then a collective call: every rank makes it at the same point of its program,
            before training starts).
        timeout: seconds a rank waits for the others to finish a step (then the step fails with
            ``CheckpointTimeoutError``).
        settings: the ``Settings`` of every transfer of this manager, its saves and loads (a
            complete value); None: those in force at each call (see ``ckptstream.settings``).

    Every method takes the state first and the step second, as ``ckptstream.save(state,
    path)`` and ``ckptstream.load_into(state, path)`` take the state and then where it goes:
    ``save(state, step)``, ``load_into(state, step)``, ``load(step)``.

    A crash at any point leaves ``latest_step()`` on the previous complete step; leftovers of
    interrupted saves are ignored and removed later. Use it as a context manager, or call
    ``close()``: both wait for the saves in flight (in a forked child: for none of them, it owns
    none).

    One manager writes as a rank of a directory at a time: the first ``save`` (with several
    ranks: making the manager, which cleans up then) takes the rank's lock, held until
    ``close()``; another writer gets ``DirectoryLockedError``. (On an object store, which has
    no lock that a dead holder releases, the newest writer takes over, and the one it replaced
    gets ``DirectoryLockedError`` at its next save or DONE.) Reading needs no lock.

    Example:
        >>> with ckptstream.CheckpointManager("ckpts", keep=3) as ckpts:
        ...     if ckpts.latest_step() is not None:
        ...         loaded = ckpts.load_into({"model": model.state_dict(), "optim": opt.state_dict()})
        ...         opt.load_state_dict(loaded["optim"])
        ...     for step in range(start, steps):
        ...         train_step()
        ...         if step % 1000 == 0:
        ...             ckpts.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, step)
    """

    def __init__(self, directory: str | os.PathLike[str], *, keep: int | None = 3, mode: AsyncMode | str = "device",
                 max_in_flight: int = 1, checksum: bool = True, rank: int | None = None,
                 world_size: int | None = None, timeout: float = 1800.0,
                 settings: Settings | None = None) -> None:
        mode = check_options(mode, max_in_flight)
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
            raise ValueError(f"keep must be an integer >= 1 or None (keep all), got {keep!r}")
        self._storage = storage_for(directory)
        self.directory = self._storage.absolute(os.fspath(directory))
        self.keep, self.mode, self.max_in_flight, self.checksum = keep, mode, max_in_flight, checksum
        self._given = check_settings(settings, "CheckpointManager")
        self._settings()  # bad settings raise now, not at the first save
        self._ranks = _ranks(self.directory, rank, world_size, timeout)
        self.rank, self.world_size = self._ranks.rank, self._ranks.world_size
        self._handles: list[SaveHandle] = []
        self._helpers: list[threading.Thread] = []
        self._last: int | None = None
        self._closed = False
        self._pid = os.getpid()  # a forked child owns none of this manager's saves
        self._kept: set[str] = set()  # step folders kept for others' files, said once

    # --- listing --------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The complete checkpoints' steps, ascending."""
        return _directory.complete_steps(self.directory)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def path(self, step: int | None = None, rank: int | None = None) -> str:
        """The file of ``rank`` (default: this process's) in the complete checkpoint ``step``
        (default: the newest).

        Raises:
            FileNotFoundError: no such complete checkpoint.
            StateMismatchError: it was saved by another number of processes.
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(2, "no complete checkpoint in the directory", self.directory)
        folder = _directory.step_dir(self.directory, step)
        done = _directory.read_done(folder)
        if done is None:
            raise FileNotFoundError(2, f"step {step} is not a complete checkpoint (complete: {self.steps()})", folder)
        if rank is None and done["world_size"] != self.world_size:
            raise StateMismatchError(f"{folder} was saved by {done['world_size']} process(es); this manager is "
                                     f"rank {self.rank} of {self.world_size}: pass rank= to read a given rank's file")
        return self._storage.join(folder, _directory.file_name(self.rank if rank is None else rank, done["world_size"]))

    # --- saving ---------------------------------------------------------------------------

    def save(self, state: Any, step: int, *, blocking: bool = False,
             metadata: dict[str, str] | None = None) -> SaveHandle:
        """Save ``state`` as checkpoint ``step`` in the background (``save_async``); with
        ``blocking`` return once it is complete. Every rank saves the same steps.

        The handle's ``result()`` returns once the step is complete (every rank's file durable,
        then the DONE marker), and raises why not otherwise; older checkpoints beyond ``keep``
        are deleted after that.

        Raises:
            ValueError: ``step`` is not after the newest complete checkpoint and every earlier
                save of this manager (see ``delete`` to roll back), or over 999999999999.
            DirectoryLockedError: another manager writes the directory as this rank.
            as ``save_async``.
        """
        self._check_writer()
        if not _is_step(step) or not 0 <= step <= _directory.LARGEST_STEP:
            raise ValueError(f"step must be an integer in [0, {_directory.LARGEST_STEP}], got {step!r}")
        self._storage.make_folders(self.directory)  # made by the first save: a reader changes nothing
        self._ranks.lock()
        self._ranks.check_lock()  # an object store's: another manager may have taken over the rank
        latest = max((s for s in (self._last, self.latest_step()) if s is not None), default=None)
        if latest is not None and step <= latest:
            raise ValueError(f"step {step} is not after step {latest}, the newest checkpoint of {self.directory}: "
                             f"steps must increase (delete({latest}) and the others after {step} to roll back)")
        if self._last is None:  # this process writes here from now on: its leftovers would mislead
            _directory.remove_own_leftovers(self.directory, self.rank, self.world_size)
        folder = _directory.make_step_dir(self.directory, step)
        path = self._storage.join(folder, _directory.file_name(self.rank, self.world_size))
        previous = self._handles[-1] if self._handles else None
        then = functools.partial(self._complete, step, previous)
        try:
            handle = begin(state, path, mode=self.mode, metadata=metadata, checksum=self.checksum, progress=False,
                           max_in_flight=self.max_in_flight, cfg=self._settings(), step=step, then=then)
        except BaseException as e:
            if self._ranks.collective:  # the other ranks wait for this one's outcome: send it
                helper = threading.Thread(target=self._report_failure, args=(then, e), daemon=True,
                                          name=f"ckptstream-manager-{step}")
                told = f"that the save of step {step} in {self.directory} failed" if self.world_size > 1 else None
                with contextlib.suppress(ThreadStartError):  # then the other ranks time out on this step
                    reports.start(helper, told, f"the thread that reports step {step}'s failure to the other ranks")
                    self._helpers.append(helper)
            raise
        self._last = step
        self._handles = [h for h in self._handles if not h.done()] + [handle]
        if blocking:
            handle.result()
        return handle

    @staticmethod
    def _report_failure(then: Any, error: BaseException) -> None:
        with contextlib.suppress(BaseException):  # the save already raised this in the caller
            then(error)

    def _complete(self, step: int, previous: SaveHandle | None, error: BaseException | None) -> None:
        """In the save's worker: agree with the other ranks, publish DONE, prune (in step order)."""
        if previous is not None:
            previous._done.wait()
        self._ranks.complete(step, error, functools.partial(self._publish, step))

    def _publish(self, step: int) -> None:
        self._ranks.check_lock()  # the last look before the step counts
        _directory.write_done(self.directory, step, self.world_size)
        try:
            self._prune(step)
        except OSError as e:  # the checkpoint is complete: a failed clean-up must not say otherwise
            log.warning(f"could not remove old checkpoints in {self.directory}: {e}")

    def _prune(self, newest: int) -> None:
        checks = {c.step: c for c in check_steps(self.directory) if c.step is not None}
        complete = [s for s, c in checks.items() if c.complete]
        doomed = complete[: -self.keep] if self.keep is not None else []
        # older incomplete steps: nobody writes them any more, every rank has finished ``newest``
        doomed += [s for s, c in checks.items() if s < newest and not c.complete]
        for s in sorted(doomed):
            check = checks[s]
            if s == newest:
                continue
            kept = self._remove(check.folder) if check.own or not check.foreign else check.foreign
            if kept and check.folder not in self._kept:  # said once per manager
                self._say_kept(check.folder, kept)

    def _remove(self, folder: str) -> tuple[str, ...]:
        """Delete a step's files (DONE first); what is left in its folder then."""
        return _directory.remove_step(self.directory, folder)

    def _say_kept(self, folder: str, kept: tuple[str, ...]) -> None:
        self._kept.add(folder)
        log.warning(f"kept the folder {folder}: it holds files the manager did not write ({', '.join(kept[:5])}"
                    f"{', ...' if len(kept) > 5 else ''}); the manager's own files there are deleted, and the folder "
                    "is an incomplete step, never listed, that the manager never removes")

    def delete(self, step: int) -> None:
        """Delete checkpoint ``step`` (its DONE marker first, durably: a crash midway leaves an
        incomplete step, which is ignored). Call it on one rank, with no save in flight. Only
        the files the manager writes are removed: a folder that also holds others' files stays
        (logged as a warning), an incomplete step from then on.

        Raises:
            FileNotFoundError: no folder of that step.
            DirectoryLockedError: another manager writes the directory as this rank.
        """
        self._check_writer()
        self._ranks.lock()
        self._ranks.check_lock()
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= _directory.LARGEST_STEP:
            raise FileNotFoundError(2, f"no checkpoint of step {step!r}", self.directory)
        folder = _directory.step_dir(self.directory, step)
        if self._storage.kind(folder) != "folder":  # a link is none of the manager's
            raise FileNotFoundError(2, "no such checkpoint", folder)
        kept = self._remove(folder)
        if kept:
            self._say_kept(folder, kept)
        self._last = None  # steps after the newest complete one may be saved again

    def wait(self) -> None:
        """Wait for this manager's saves in flight; raise the first error nobody collected. In a
        forked child: none (the parent's saves are its own; their threads are not in the child)."""
        if self._forked():
            self._handles, self._helpers = [], []
            return
        first: BaseException | None = None
        for handle in self._handles:
            reported = handle._reported
            try:
                handle.result()
            except BaseException as e:
                if not reported:
                    first = first or e
        self._handles = []
        for helper in self._helpers:
            helper.join()
        self._helpers = []
        if first is not None:
            raise first

    # --- loading --------------------------------------------------------------------------

    def load(self, step: int | None = None, *, device: Device = "cpu", checksum: bool = True, progress: bool = False,
             mmap: bool | None = None, settings: Settings | None = None) -> Any:
        """``ckptstream.load`` of this process's file of checkpoint ``step`` (default: the newest);
        ``settings`` (default: the manager's) as for ``ckptstream.load``. With ``checksum`` (and
        the manager's), a file that stores no checksums is refused (ChecksumsMissingError)."""
        cfg = self._settings(settings, "CheckpointManager.load")
        path = self.path(step)
        with self._own_file(path):
            return load_file(path, device=device, checksum=checksum, progress=progress, mmap=mmap,
                             require_checksums=checksum and self.checksum, settings=cfg)

    def load_into(self, state: Any, step: int | None = None, *, strict: bool = True, device: Device | None = "auto",
                  checksum: bool = True, progress: bool = False, settings: Settings | None = None) -> Any:
        """``ckptstream.load_into`` from this process's file of checkpoint ``step`` (default: the
        newest). A freshly built optimizer works: its moments, which its ``state_dict()`` lacks,
        are created on ``device`` (see ``load_into``); pass the result's part to
        ``optimizer.load_state_dict``. ``settings`` (default: the manager's) as for
        ``ckptstream.load_into``; a file without checksums is refused as by ``load``."""
        cfg = self._settings(settings, "CheckpointManager.load_into")
        path = self.path(step)
        with self._own_file(path):
            return load_into_file(state, path, strict=strict, device=device, checksum=checksum, progress=progress,
                                  require_checksums=checksum and self.checksum, settings=cfg)

    @contextlib.contextmanager
    def _own_file(self, path: str) -> Iterator[None]:
        """Say why a step's file must hold checksums: the manager wrote it, with them."""
        try:
            yield
        except ChecksumsMissingError as e:
            raise ChecksumsMissingError(
                f"{path}: holds no checksums, though its step is complete (its DONE marker counts the file the "
                "manager wrote) and this manager stores them (checksum=True): a tool rewrote its header without "
                "ckptstream's __metadata__, or a manager with checksum=False saved it; restore the step from a copy, "
                "or load it with checksum=False to read it unchecked") from e

    def _settings(self, settings: object = None, where: str = "") -> Settings:
        """The settings of one transfer: the call's, else the manager's, else those in force."""
        given = check_settings(settings, where)
        if given is not None:
            return given
        return self._given if self._given is not None else current_settings()

    # --- life -----------------------------------------------------------------------------

    def _forked(self) -> bool:
        return os.getpid() != self._pid

    def _check_writer(self) -> None:
        if self._closed:
            raise RuntimeError(f"the CheckpointManager of {self.directory} is closed")
        if self._forked():
            raise RuntimeError(f"this CheckpointManager of {self.directory} belongs to process {self._pid}, which "
                               f"forked this one ({os.getpid()}): a forked process owns none of its saves and "
                               "cannot save with it (reading is fine)")

    def close(self) -> None:
        """Wait for the saves in flight (raising the first error nobody collected) and release
        what the manager holds (its lock, its process group); safe to call twice. In a forked
        child it waits for nothing and leaves the parent's lock and group alone."""
        if self._closed:
            return
        self._closed = True
        if self._forked():
            self.wait()
            self._ranks.forget()
            return
        try:
            self.wait()
        finally:
            self._ranks.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        if kind is None:
            self.close()
            return
        try:  # an exception is already on its way: report a save's error without masking it
            self.close()
        except BaseException as e:
            log.warning(f"while leaving the CheckpointManager of {self.directory} on {kind.__name__}: "
                        f"a save failed: {type(e).__name__}: {e}")

    def __repr__(self) -> str:
        return f"CheckpointManager({self.directory!r}, keep={self.keep}, mode='{self.mode}', rank={self.rank} of " \
               f"{self.world_size})"
