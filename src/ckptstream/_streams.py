"""CUDA stream ordering for one transfer: a side stream per device, ordered by events with the
caller's stream. On a CPU-only transfer every method is a no-op."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch


def check_stream(stream: object) -> None:
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")


class Streams:
    def __init__(self, tensors: Iterable[torch.Tensor], stream: torch.cuda.Stream | None) -> None:
        check_stream(stream)
        devices = list(dict.fromkeys(t.device for t in tensors if t.is_cuda))
        self.cuda = bool(devices)
        self._caller: dict[torch.device, torch.cuda.Stream] = {}
        self._side: dict[torch.device, torch.cuda.Stream] = {}
        for device in devices:
            use_given = stream is not None and stream.device == device
            caller = stream if use_given else torch.cuda.current_stream(device)
            assert caller is not None
            side = torch.cuda.Stream(device=device)  # from torch's stream pool: cheap
            side.wait_stream(caller)  # the copies see every kernel queued before the call
            self._caller[device], self._side[device] = caller, side

    def use_side(self) -> contextlib.ExitStack:
        """Make every device's side stream current in this thread (copies to or from a tensor go
        to the current stream of its device), until the returned context exits."""
        stack = contextlib.ExitStack()
        for side in self._side.values():
            stack.enter_context(torch.cuda.stream(side))
        return stack

    def record(self, devices: Iterable[torch.device]) -> list[torch.cuda.Event]:
        """Events marking the copies enqueued so far on the side streams of ``devices``."""
        events = []
        for device in devices:
            event = torch.cuda.Event(blocking=True)  # I/O threads sleep on it instead of spinning a core
            event.record(self._side[device])
            events.append(event)
        return events

    def hand_back(self) -> None:
        """Order the caller's streams after the copies (work queued after a load sees the data)."""
        for device, side in self._side.items():
            self._caller[device].wait_stream(side)

    def synchronize(self) -> None:
        for side in self._side.values():
            side.synchronize()
