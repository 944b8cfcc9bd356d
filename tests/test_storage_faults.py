"""Failures of the storage under a save or a load, injected by the in-memory storage: a write
that fails at any step of a save, a publish that fails, a process that dies mid-save (and the
upload it leaves, removed by the next save), a read that fails or finds the object cut short.
Each reaches the caller as itself, leaves the previous checkpoint as it was, and leaves no
thread or staging buffer behind."""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any

import pytest
import torch

import ckptstream
from ckptstream import CorruptCheckpointError, Settings, TruncatedFileError
from tests.helpers import Resources, assert_same_state, poisoned_like
from tests.memstore import Crash, MemStorage

PATH = "mem://test/ckpt.safetensors"
SMALL: dict[str, Any] = {"buffer_size": 4096, "num_buffers": 2, "io_threads": 2}  # many chunks


def make_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(9000, generator=g), "b": torch.randn(50, 40, generator=g).t(),
            "c": torch.randint(0, 100, (7,), generator=g, dtype=torch.int16), "step": seed}


@pytest.fixture
def old(mem: MemStorage) -> bytes:
    """A checkpoint to save over (its bytes); the engine warmed up."""
    ckptstream.save(make_state(1), PATH, settings=Settings(**SMALL))
    ckptstream.load(PATH, settings=Settings(**SMALL))
    return mem.objects[PATH]


def writes_of_a_save(mem: MemStorage) -> int:
    """How many writes a save of ``make_state`` makes (the header, the chunks, the header again)."""
    before = mem.calls["write"]
    ckptstream.save(make_state(2), "mem://test/probe.safetensors", settings=Settings(**SMALL))
    mem.remove("mem://test/probe.safetensors")
    return mem.calls["write"] - before


def enospc(name: str) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device (injected)", name)


def interrupt(name: str) -> KeyboardInterrupt:
    return KeyboardInterrupt()


@pytest.mark.parametrize("error", [enospc, interrupt], ids=["ENOSPC", "KeyboardInterrupt"])
@pytest.mark.parametrize("where", ["header", "first_chunk", "middle_chunk", "checksum_header"])
def test_a_failed_write_keeps_the_old_object(mem: MemStorage, old: bytes, where: str,
                                             error: Callable[[str], BaseException]) -> None:
    writes, resources = writes_of_a_save(mem), Resources.snapshot()
    assert writes >= 8
    k = {"header": 1, "first_chunk": 2, "middle_chunk": writes // 2, "checksum_header": writes}[where]
    mem.faults.fail_write, mem.faults.error = mem.calls["write"] + k, error
    with pytest.raises(type(error(PATH))) as info:
        ckptstream.save(make_state(3), PATH, settings=Settings(**SMALL))
    if isinstance(info.value, OSError):
        assert info.value.filename == PATH
    assert mem.objects[PATH] == old
    assert mem.pending == {}  # the unfinished object is dropped
    resources.assert_released()
    ckptstream.save(make_state(3), PATH, settings=Settings(**SMALL))  # and the next save works
    assert_same_state(ckptstream.load(PATH), make_state(3))


def test_a_failed_publish_keeps_the_old_object(mem: MemStorage, old: bytes) -> None:
    mem.faults.fail_publish = True
    with pytest.raises(OSError, match="injected"):
        ckptstream.save(make_state(3), PATH, settings=Settings(**SMALL))
    assert mem.objects[PATH] == old
    assert mem.pending == {}
    assert mem.calls["write"] > 0


@pytest.mark.parametrize("at", [("write", 1), ("write", 5), ("publish", 1)], ids=["header", "chunk", "publish"])
def test_a_crash_mid_save_leaves_the_old_object_and_an_upload_the_next_save_removes(
        mem: MemStorage, old: bytes, at: tuple[str, int]) -> None:
    step, n = at
    mem.faults.crash = ("write", mem.calls["write"] + n) if step == "write" else ("publish", mem.calls["publish"] + n)
    resources = Resources.snapshot()
    with pytest.raises(Crash):
        ckptstream.save(make_state(3), PATH, settings=Settings(**SMALL))
    resources.assert_released()
    mem.restart()  # what the crash left: the old object, and the dead writer's pending upload
    assert mem.objects[PATH] == old
    assert [s.name for s in mem.pending.values()] == [PATH]
    assert_same_state(ckptstream.load(PATH), make_state(1))
    ckptstream.save(make_state(4), PATH, settings=Settings(**SMALL))
    assert mem.pending == {}
    assert_same_state(ckptstream.load(PATH), make_state(4))


READERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "load": lambda state: ckptstream.load(PATH, settings=Settings(**SMALL)),
    "verify": lambda state: ckptstream.verify(PATH, settings=Settings(**SMALL)),
    "load_into": lambda state: ckptstream.load_into(state, PATH, settings=Settings(**SMALL)),
    "read": lambda state: ckptstream.open(PATH, settings=Settings(**SMALL)).read("a"),
}


@pytest.mark.parametrize("nth", [1, 2, 9], ids=["header", "first_chunk", "later_chunk"])
@pytest.mark.parametrize("reader", list(READERS))
def test_a_failed_read_reaches_the_caller_and_leaks_nothing(mem: MemStorage, old: bytes, reader: str,
                                                            nth: int) -> None:
    targets = {k: poisoned_like(v) if isinstance(v, torch.Tensor) else v for k, v in make_state(1).items()}
    resources = Resources.snapshot()
    mem.faults.fail_read = mem.calls["read"] + nth
    with pytest.raises(OSError, match="injected") as info:
        READERS[reader](targets)
    assert info.value.filename == PATH
    resources.assert_released()
    mem.faults.fail_read = None
    assert_same_state(ckptstream.load(PATH), make_state(1))  # the object itself is fine


@pytest.mark.parametrize("reader", ["load", "load_into"])
def test_an_object_cut_short_under_the_reader_is_named(mem: MemStorage, old: bytes, reader: str) -> None:
    """Its header promises more bytes than the reads then find (an object replaced in place
    under an open reader): a TruncatedFileError naming the URL, before any checksum says less."""
    targets = {k: poisoned_like(v) if isinstance(v, torch.Tensor) else v for k, v in make_state(1).items()}
    mem.faults.reads_end_at = len(old) - 5000
    with pytest.raises(TruncatedFileError, match="is too short") as info:
        READERS[reader](targets)
    assert PATH in str(info.value)
    assert isinstance(info.value, EOFError)


def test_a_flipped_byte_is_caught(mem: MemStorage, old: bytes) -> None:
    with ckptstream.open(PATH) as reader:
        e = reader.entry("c")
    mem.flip(PATH, e.offset + 3)
    targets = {k: poisoned_like(v) if isinstance(v, torch.Tensor) else v for k, v in make_state(1).items()}
    with pytest.raises(CorruptCheckpointError, match=r"'c' fails its CRC-32C check"):
        ckptstream.load_into(targets, PATH)
    with pytest.raises(CorruptCheckpointError, match=PATH):
        ckptstream.load(PATH)
