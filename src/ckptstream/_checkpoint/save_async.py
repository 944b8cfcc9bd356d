"""save_async: a checkpoint written in the background while training goes on.

In the caller's thread, at the call: the state is flattened and its header encoded (Python
leaves are captured by value then), the tensors are captured as the mode says, and the CUDA
ordering point of what the engine will read is marked. A worker thread then streams them
through the write engine and publishes the file exactly as ``save`` does.

    "device"  device tensors are copied into new device memory on the current stream (ordered
              after the work queued before the call, and before the work queued after it), CPU
              tensors into new host memory; staged at once.
    "lazy"    device tensors (and CPU tensors over BY_VALUE_BYTES) stream from the live memory;
              staged once the engine has copied out their last byte.
    "host"    every tensor is copied into (pinned) host memory, device tensors on a side stream
              that first waits on the current one (``capture``); the caller's stream does not
              wait behind the copies: the process's guard (``guard``) orders an optimizer's
              update and a training-mode forward that updates a saved buffer after them, and
              ``wait_staged()`` orders the caller's current streams; staged once they are done.

A process holds at most ``max_in_flight`` saves (the next call waits: backpressure). Saves of
one file publish in call order: a save whose file is ready before that of an earlier save of the
same path waits for it to end, so the path ends with the newest call's state. A worker's error
is raised by ``result()``; one nobody collected is raised at the next call, and a process that
exits with saves in flight waits for them at shutdown and says so on stderr.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from .._engine import control
from .._errors import CheckpointNotSavedError, SnapshotFallbackWarning
from .._settings import Settings, per_call
from .._storage import storage_for
from . import exiting
from .capture import BY_VALUE_BYTES, MODES, AsyncMode, Captured, capture
from .guard import HostCopies
from .save import plan_checkpoint, write_checkpoint

__all__ = ["BY_VALUE_BYTES", "MODES", "AsyncMode", "SaveHandle", "begin", "in_flight", "save_async"]

Completion = Callable[[BaseException | None], None]



class SaveHandle:
    """A save running in the background; see ``ckptstream.save_async``.

    Attributes:
        path: the absolute path the checkpoint is published at (symbolic links resolved).
        mode: the mode in effect ("lazy" where "device" fell back for lack of GPU memory).
        step: the step, for saves of a ``CheckpointManager`` (else None).
    """

    def __init__(self, path: str, mode: AsyncMode, step: int | None = None) -> None:
        self.path, self.mode, self.step = path, mode, step
        self._staged, self._done = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        self._reported = False  # result() has raised the error
        self._thread: threading.Thread | None = None
        self._called = time.monotonic()
        self._staged_at: float | None = None
        self._durable_at: float | None = None
        self._earlier: SaveHandle | None = None  # the save of the same file called before, in flight
        self._copies: HostCopies | None = None  # "host": the copies into host memory, on side streams

    def wait_staged(self, timeout: float | None = None) -> None:
        """Make the state safe to change from here on (the next ``optimizer.step()``).

        "lazy": waits until the save has copied the state out. "device": returns at once. "host":
        returns at once, once the current stream of each device the state is on waits for the
        copies into host memory: work queued on it from now on (an in-place update) runs after
        they have read the state. Work on another stream must wait on this one first, as for any
        CUDA work. A failed save also counts as staged: its error is raised by ``result()`` (or
        the next ``save_async``).

        Raises:
            TimeoutError: ``timeout`` seconds passed first (the save goes on).
        """
        copies = self._copies
        if copies is not None and not self._staged.is_set():
            copies.order()
            return
        if not self._staged.wait(timeout):
            raise TimeoutError(f"the background save of {self.path} was not staged within {timeout} s")

    def staged(self) -> bool:
        """Whether the save no longer reads the state: "device" at once, "host" once its copies
        into host memory are done, "lazy" once it has copied the state out."""
        return self._staged.is_set()

    def done(self) -> bool:
        """Whether the save has ended (published, or failed)."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> str:
        """Wait until the checkpoint is durable (published and fsynced) and return its path.

        A newer save of the same path publishes after this one, so the path may hold a newer
        state by the time this returns. A Ctrl-C (KeyboardInterrupt) while this waits leaves
        the save running: a later ``result()`` returns when it is durable.

        Raises:
            the worker's exception, when the save failed (the file was then not published:
                the old file at the path, if any, is untouched);
            TimeoutError: ``timeout`` seconds passed first (the save goes on).
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"the background save of {self.path} did not finish within {timeout} s")
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()  # it ends right after setting done: no thread is left behind
        _collected(self)
        if self._error is not None:
            self._reported = True
            raise self._error
        return self.path

    @property
    def seconds_to_staged(self) -> float | None:
        """Seconds from the call until the state was no longer read (None until then)."""
        return None if self._staged_at is None else self._staged_at - self._called

    @property
    def seconds_to_durable(self) -> float | None:
        """Seconds from the call until the checkpoint was durable (None until then, or if it failed)."""
        return None if self._durable_at is None else self._durable_at - self._called

    def __repr__(self) -> str:
        state = ("failed" if self._error is not None else "durable") if self.done() else (
            "staged" if self.staged() else "staging")
        return f"<SaveHandle {self.path!r} mode={self.mode} {state}>"

    # --- from the worker ------------------------------------------------------------------

    def _mark_staged(self) -> None:
        if not self._staged.is_set():
            self._staged_at = time.monotonic()
            self._staged.set()

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        if error is None:
            self._durable_at = time.monotonic()
        self._mark_staged()
        _finished(self)
        self._done.set()


# --- the process's saves ----------------------------------------------------------------------

_cond = threading.Condition()
_in_flight: list[SaveHandle] = []
_uncollected: list[SaveHandle] = []  # failed, and nobody has seen the error yet
_owner = os.getpid()
_hooked = False
_exit_hook_of_threading = False  # the exit hook runs before the atexit hooks (not among them)
_names = itertools.count()


def _reserve(handle: SaveHandle, max_in_flight: int) -> None:
    """Wait until fewer than ``max_in_flight`` saves are in flight, raise an uncollected error
    of an earlier save, and count ``handle`` in."""
    global _hooked, _exit_hook_of_threading
    with _cond:
        while len(_in_flight) >= max_in_flight:
            _cond.wait()
        failed = list(_uncollected)
        _uncollected.clear()
        if not failed:
            handle._earlier = next((h for h in reversed(_in_flight) if h.path == handle.path), None)
            _in_flight.append(handle)
        if not _hooked:
            _hooked = True
            _exit_hook_of_threading = exiting.register(_at_exit)
    if failed:
        first = failed[0]
        also = f" (and {len(failed) - 1} more: {[h.path for h in failed[1:]]})" if len(failed) > 1 else ""
        raise CheckpointNotSavedError(
            f"the background save of {first.path} failed and was not published{also}: "
            f"{type(first._error).__name__}: {first._error}; this save of {handle.path} was not started. "
            "Call result() on a save's handle to see its outcome when it ends") from first._error


def _unreserve(handle: SaveHandle) -> None:
    with _cond:
        if handle in _in_flight:
            _in_flight.remove(handle)
        _cond.notify_all()


def _finished(handle: SaveHandle) -> None:
    with _cond:
        if handle in _in_flight:
            _in_flight.remove(handle)
        if handle._error is not None:
            _uncollected.append(handle)
        _cond.notify_all()


def _collected(handle: SaveHandle) -> None:
    with _cond:
        if handle in _uncollected:
            _uncollected.remove(handle)


def _publish_after_earlier(handle: SaveHandle) -> None:
    """Wait until the save of the same file called before this one has ended (published or
    failed): the newer state is renamed over the older, never the other way round."""
    earlier, handle._earlier = handle._earlier, None
    if earlier is not None:
        earlier._done.wait()


def in_flight() -> list[SaveHandle]:
    """The saves of this process that have not ended yet, oldest first."""
    with _cond:
        return list(_in_flight)


def _forget_after_fork() -> None:
    """A forked child (a DataLoader worker) owns none of its parent's saves."""
    global _cond, _in_flight, _uncollected, _owner
    _cond, _in_flight, _uncollected, _owner = threading.Condition(), [], [], os.getpid()


os.register_at_fork(after_in_child=_forget_after_fork)


def _at_exit() -> None:
    """Wait for the saves still in flight (saying so), and report every failed save whose error
    nobody collected: a checkpoint is never lost without a word."""
    if os.getpid() != _owner:
        return
    try:  # a Ctrl-C anywhere in here (also while a line is written) abandons what is left
        for handle in in_flight():
            exiting.say(f"waiting for the background save of {handle.path} to finish before exiting "
                        "(Ctrl-C abandons it)")
            # in slices: a Ctrl-C that the kernel hands to another thread only sets a flag, which
            # this thread sees when it returns to Python, never while it sleeps in one long wait
            while not handle._done.wait(0.1):
                pass
            if handle._error is None:
                exiting.say(f"{handle.path} is saved")
    except KeyboardInterrupt:
        for left in in_flight():
            exiting.say(f"abandoned the background save of {left.path}: it was NOT published "
                        "(its temp file is removed by a later save of that path)")
        exiting.end_interrupted(_exit_hook_of_threading)
        return
    with _cond:
        failed = list(_uncollected)
        _uncollected.clear()
    for handle in failed:
        exiting.say(f"the background save of {handle.path} FAILED and was NOT published: "
                    f"{type(handle._error).__name__}: {handle._error}")


# --- starting a save --------------------------------------------------------------------------


def _work(handle: SaveHandle, job: list[Any], cfg: Settings, progress: bool, then: Completion | None) -> None:
    error: BaseException | None = None
    plan: Any = None
    captured: Any = None
    try:
        plan, captured = job
        job.clear()  # from here on the snapshot lives only in these locals
        captured.copied()
        if captured.copies is not None:  # "host": the copies have read the state
            handle._mark_staged()

        def staged() -> None:  # the file is written, not yet published
            handle._mark_staged()
            _publish_after_earlier(handle)

        write_checkpoint(plan, handle.path, cfg, progress=progress, after=captured.after, staged=staged)
    except BaseException as e:
        error = e
        _clear_frames(e)  # a kept error must not keep the snapshot alive
    finally:
        if captured is not None:
            captured.finish()  # nothing reads the state any more: the guard lets go, the snapshot memory is kept
        plan = captured = None  # the snapshot's memory goes back before the completion runs
        handle._mark_staged()
        handle._earlier = None  # a failed save keeps no chain of older handles alive
    if then is not None:
        try:
            then(error)
        except BaseException as e:
            error = e
    handle._finish(error)


def check_options(mode: AsyncMode | str, max_in_flight: int) -> AsyncMode:
    """The mode, once both options are checked."""
    parsed = AsyncMode.parse(mode)
    if not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or max_in_flight < 1:
        raise ValueError(f"max_in_flight must be an integer >= 1, got {max_in_flight!r}")
    return parsed


def begin(state: Any, path: str | os.PathLike[str], *, mode: AsyncMode | str, metadata: Mapping[str, str] | None,
          checksum: bool, progress: bool, max_in_flight: int, cfg: Settings, step: int | None = None,
          then: Completion | None = None, stacklevel: int = 3) -> SaveHandle:
    """Start a background save (``save_async``, and the manager's saves, whose ``then`` runs in
    the worker once the file is published or failed: its exception becomes the save's)."""
    mode = check_options(mode, max_in_flight)
    target = storage_for(path).check_target(os.fsdecode(path))
    plan = plan_checkpoint(state, metadata, checksum)  # bad input raises here; leaves captured now
    handle = SaveHandle(target, mode, step)
    _reserve(handle, max_in_flight)
    captured: Captured | None = None
    try:
        captured = capture(plan.tensors, mode, kept_memory=True)
        if captured.fallback:
            warnings.warn(SnapshotFallbackWarning(captured.fallback), stacklevel=stacklevel)
        handle.mode = captured.mode
        handle._copies = captured.copies
        if captured.staged and captured.copies is None:
            handle._mark_staged()
        job = [plan.with_tensors(captured.tensors), captured]
        del plan
        thread = threading.Thread(target=_work, args=(handle, job, cfg, progress, then),
                                  name=f"ckptstream-save-{next(_names)}", daemon=True)
        handle._thread = thread
        control.start(thread, f"the background save of {target}")
        captured = None  # the worker ends it
    except BaseException:
        _unreserve(handle)
        if captured is not None:  # no worker will: its copies done, the guard and the snapshot memory let go
            captured.copied()
            captured.finish()
        raise
    if handle.mode != mode:  # the device snapshot did not fit: the live tensors are read now
        handle.wait_staged()
    return handle


def save_async(state: Any, path: str | os.PathLike[str], *, mode: AsyncMode | str = "device",
               metadata: Mapping[str, str] | None = None, checksum: bool = True, progress: bool = False,
               max_in_flight: int = 1, settings: Settings | None = None) -> SaveHandle:
    """Save a training state in the background; returns at once with a ``SaveHandle``.

    The file is published exactly as ``save`` publishes it (a temp beside ``path``, fsynced,
    renamed over it, the directory fsynced): until then the old file stays untouched. Non-tensor
    leaves and CPU tensors (a CPU optimizer's ``step``, RNG states) are captured by value at the
    call, so a checkpoint never mixes steps.

    Args:
        state, path, metadata, checksum, progress: as for ``save``.
        mode: what is read in the background (docs/training.md says which to pick):
            "device": device tensors are copied into spare GPU memory (device-to-device, queued
                on the current stream: after the work queued before the call, before the work
                queued after it), CPU tensors into host memory. The state may change as soon as
                the call returns. Without enough free GPU memory, a ``SnapshotFallbackWarning``
                is issued and the save streams from the live tensors, returning once they are
                copied out (turn the warning into an error to refuse that stall).
            "lazy": no copy: the bytes stream from the live tensors (CPU tensors of up to 1 MiB
                are captured by value). Call ``handle.wait_staged()`` before changing the state
                (before ``optimizer.step()``).
            "host": every tensor is copied into host memory (pinned on a GPU machine). The
                device-to-host copies run on a side stream, after the work queued on the
                current stream before the call, and beside the work queued after it: the next
                forward and backward pass (which only read the state) do not wait for them. An
                optimizer's update (``optimizer.step()``, after its closure) and the forward of
                a module in training mode that holds a saved buffer (BatchNorm's running
                statistics) are ordered after the copies by the process's hooks, on the GPU
                (the host does not wait). Any other in-place change of a saved tensor (a
                hand-written ``p.data.add_()``) must come after ``handle.wait_staged()``, which
                orders the current stream after the copies and returns at once. A loop may call
                it just before ``optimizer.step()`` as in "lazy" mode: the update then waits on
                the GPU for what is left of the copies, as it does with the hook alone. The
                host memory is kept for the next "host" save of the same size
                (``warm_host_snapshot``, ``release_host_snapshot``; docs/training.md).
        max_in_flight: at most this many saves of this process run at once, this one included;
            when they do, the call first waits for the oldest to end (backpressure). Saves of
            one path publish in call order: the path ends with the newest call's state (a save
            whose file is ready first waits for the earlier save of the path to end).
        settings: the ``Settings`` of this save (a complete value, e.g.
            ``ckptstream.Settings(buffer_size=64 << 20)``); None: those in force at the call (see
            ``ckptstream.settings``).

    Returns:
        A SaveHandle: ``wait_staged()``, ``result()`` (durable, or the worker's exception),
        ``done()``.

    Raises:
        UnsupportedTypeError, TypeError, ValueError: bad input, before anything starts.
        FileNotFoundError: the directory of ``path`` does not exist.
        CheckpointNotSavedError: an earlier background save failed and nobody called its
            ``result()``: its error, instead of starting this save.

    A process that exits with saves in flight waits for them, saying so on stderr (a Ctrl-C
    there abandons them, which is also said, and ends the process as an interrupted Python
    ends: exit status 130 in a shell); the error of a failed save nobody collected is printed
    at exit.

    Example:
        >>> handle = ckptstream.save_async(state, "ckpt.safetensors")   # mode="device"
        >>> loss_fn(model(inputs), targets).backward()                 # training goes on
        >>> handle.result()                                             # durable now
    """
    cfg = per_call("save_async", settings, {})
    return begin(state, path, mode=mode, metadata=metadata, checksum=checksum, progress=progress,
                 max_in_flight=max_in_flight, cfg=cfg)


def _clear_frames(error: BaseException | None) -> None:
    """Drop the locals of every frame in the tracebacks of ``error`` and of the errors it was
    raised from (an error that adds to another's message holds the frames below it there)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
