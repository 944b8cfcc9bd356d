"""The storage seam's contract, on every storage of tests/storages.py (the local file system, the
in-memory storage, S3, GCS, Azure Blob Storage): which storage a path or URL names, sinks
(nothing visible before ``publish``, ``abandon`` leaves the old object, parts written in any
order make the object whole), sources (reads stop at the end), the namespace
operations the manager needs, the grid a sink asks the engine to plan on, and the local sink's
O_DIRECT split."""

from __future__ import annotations

import errno
import mmap
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import ckptstream
from ckptstream import DirectIO, UnsupportedStorageError
from ckptstream._storage import Entry, LockHeldError, Sink, Storage, dispatch, fileio, register, storage_for
from ckptstream._storage.local import LOCAL
from tests.helpers import KiB, MiB, assert_bytes_equal, direct_io_supported, random_bytes, random_tensor
from tests.memstore import MemSink, MemStorage
from tests.storages import Place

# --- which storage ---------------------------------------------------------------------------------


def test_paths_are_local_and_urls_go_to_their_scheme(tmp_path: Path, mem: MemStorage) -> None:
    for path in (str(tmp_path / "x"), tmp_path / "x", os.fsencode(tmp_path / "x"), "relative/a://b", "x"):
        assert storage_for(path) is LOCAL
    assert storage_for("mem://space/x") is mem
    assert storage_for("MEM://space/x") is mem  # schemes are case-insensitive


@pytest.mark.parametrize("url", ["hdfs://bucket/ckpt.safetensors", "ftp://b/x", "weird+scheme://x"])
def test_an_unknown_scheme_is_a_clear_typed_error(url: str, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedStorageError, match="no storage for") as info:
        storage_for(url)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, ckptstream.CkptStreamError)
    assert url in str(info.value)
    assert "local path" in str(info.value)
    with pytest.raises(UnsupportedStorageError, match=re.escape(url.split(":")[0])):
        ckptstream.save({"w": random_tensor(3)}, url)
    with pytest.raises(UnsupportedStorageError):
        ckptstream.load(url)


@pytest.fixture
def builtin(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Callable[[], Storage]]]:
    """The table of built-in schemes, for the test."""
    monkeypatch.setattr(dispatch, "BUILTIN", {})
    monkeypatch.setattr(dispatch, "EXTRAS", {})
    yield dispatch.BUILTIN
    for scheme in ("lazy", "absent"):
        register(scheme, None)


def test_a_builtin_scheme_makes_its_storage_on_first_use(builtin: dict[str, Callable[[], Storage]]) -> None:
    made: list[MemStorage] = []

    def lazy() -> Storage:  # where an implementation imports its module and client library
        made.append(MemStorage())
        return made[-1]

    def absent() -> Storage:
        raise ModuleNotFoundError("No module named 'some_client'")

    builtin["lazy"], builtin["absent"] = lazy, absent
    dispatch.EXTRAS["absent"] = "absent"
    assert made == []
    assert storage_for("lazy://bucket/a") is made[0]
    assert storage_for("lazy://bucket/b") is made[0]  # one storage per scheme
    assert len(made) == 1
    with pytest.raises(UnsupportedStorageError, match=r"pip install 'ckptstream\[absent\]'"):
        storage_for("absent://bucket/a")
    with pytest.raises(UnsupportedStorageError, match="lazy://"):  # the known schemes are named
        storage_for("other://bucket/a")


def test_register_checks_the_scheme() -> None:
    with pytest.raises(ValueError, match="not a URL scheme"):
        register("9bad", MemStorage)
    with pytest.raises(ValueError, match="not a URL scheme"):
        register("a/b", MemStorage)


# --- the contract, on every storage (tests/storages.py) -----------------------------------------------


def test_folders_entries_sizes_and_removal(place: Place) -> None:
    s, root = place.storage, place.root
    step = s.join(root, "step-1")
    s.make_folders(s.join(step, "inner"))
    s.make_folders(step)  # nothing where it exists
    s.write_small(s.join(step, "b.bin"), b"bee")
    s.write_small(s.join(step, "a.bin"), b"")
    assert s.exists(step)
    assert s.exists(s.join(step, "b.bin"))
    assert not s.exists(s.join(step, "c.bin"))
    inner = [Entry("inner", "folder")] if place.empty_folders else []  # an object store's: a prefix, none yet
    assert s.list_folder(step) == [Entry("a.bin", "file"), Entry("b.bin", "file"), *inner]
    assert (s.size(s.join(step, "a.bin")), s.size(s.join(step, "b.bin"))) == (0, 3)
    with pytest.raises(FileNotFoundError):
        s.size(s.join(step, "c.bin"))
    if place.empty_folders:
        with pytest.raises(FileNotFoundError):
            s.list_folder(s.join(root, "nothing"))
    else:  # a prefix nothing lies under lists empty
        assert s.list_folder(s.join(root, "nothing")) == []
    s.remove(s.join(step, "a.bin"))
    with pytest.raises(FileNotFoundError):
        s.remove(s.join(step, "a.bin"))
    s.remove(s.join(step, "a.bin"), missing_ok=True)
    s.sync_folder(step)
    s.remove_tree(step)
    assert not s.exists(step)
    s.remove_tree(step)  # nothing where there is none
    assert s.list_folder(root) == []


def test_listings_hold_every_entry(place: Place) -> None:
    """Every name of a folder of many, each once, in order (an object store's listing comes in
    pages: the S3 target's are of two names)."""
    s, root = place.storage, place.root
    names = [f"n{i:02d}" for i in range(7)]
    folder = s.join(root, "many")
    for name in names[5:]:
        s.make_folders(s.join(folder, name))
    for name in names[:5]:
        s.write_small(s.join(folder, name), name.encode())
    for name in names[5:]:
        s.write_small(s.join(folder, name, "x"), b"x")
    assert s.list_folder(folder) == [Entry(n, "file") for n in names[:5]] + [Entry(n, "folder") for n in names[5:]]
    assert sorted(place.names()) == [f"many/{n}" for n in names[:5]] + [f"many/{n}/x" for n in names[5:]]
    s.remove_tree(folder)
    assert (s.list_folder(root), place.names()) == ([], [])


def test_small_objects_are_bounded(place: Place) -> None:
    s, root = place.storage, place.root
    path = s.join(root, "DONE")
    data = random_bytes(1000).numpy().tobytes()
    s.write_small(path, data)
    assert s.read_small(path, limit=1000) == data
    assert place.read_bytes(path) == data
    with pytest.raises(OSError, match="more than") as info:
        s.read_small(path, limit=999)
    assert info.value.errno == errno.EFBIG
    with pytest.raises(FileNotFoundError):
        s.read_small(s.join(root, "absent"), limit=10)
    s.write_small(path, b"second")  # replaced, atomically
    assert s.read_small(path, limit=1000) == b"second"


def test_a_sink_is_visible_only_once_published(place: Place) -> None:
    s, root = place.storage, place.root
    path = s.join(root, "ckpt.bin")
    s.write_small(path, b"old")
    with s.create(path) as sink:
        sink.write_at(memoryview(b"world"), 6)  # any order
        sink.write_at(memoryview(b"hello "), 0)
        assert s.read_small(path, 100) == b"old"
    assert s.read_small(path, 100) == b"hello world"
    sink.publish()  # again: nothing
    sink.abandon()  # after publish: nothing
    assert s.read_small(path, 100) == b"hello world"

    def fails_in_the_block() -> None:
        with s.create(path) as sink:
            sink.write_at(memoryview(b"new"), 0)
            raise RuntimeError("in the block")

    with pytest.raises(RuntimeError, match="in the block"):
        fails_in_the_block()
    assert s.read_small(path, 100) == b"hello world"  # abandoned: the old one stays

    sink = s.create(path)
    sink.write_at(memoryview(b"dropped"), 0)
    sink.abandon()
    sink.abandon()  # twice: nothing
    with pytest.raises(ValueError, match="abandoned"):
        sink.publish()
    assert s.read_small(path, 100) == b"hello world"
    assert [e.name for e in s.list_folder(root)] == ["ckpt.bin"]  # nothing else left
    assert s.unfinished(root) == []
    assert place.names() == ["ckpt.bin"]


def begun(place: Place, path: str) -> Sink:
    """A sink of ``path`` that has written far enough to leave something behind (an object
    store's upload begins after the head it keeps back)."""
    sink = place.storage.create(path)
    sink.grid(5 * MiB, DirectIO.AUTO)  # S3's least part
    sink.write_at(memoryview(b"unfinished"), place.begun_at)
    return sink


def test_an_abandoned_or_published_sink_leaves_nothing_behind(place: Place) -> None:
    """Past the head: an upload begun, its parts up; publish or abandon, nothing is left of it."""
    s, root = place.storage, place.root
    data = random_bytes(place.begun_at + 1000).numpy().tobytes()
    sink = begun(place, s.join(root, "dropped.bin"))
    assert s.unfinished(root) == ["dropped.bin"]
    sink.abandon()
    with s.create(s.join(root, "kept.bin")) as kept:
        kept.grid(5 * MiB, DirectIO.AUTO)
        kept.write_at(memoryview(data)[place.begun_at :], place.begun_at)
        kept.write_at(memoryview(data)[: place.begun_at], 0)
        assert s.unfinished(root) == ["kept.bin"]
        assert not s.exists(s.join(root, "kept.bin"))
    assert (s.unfinished(root), place.names()) == ([], ["kept.bin"])
    assert place.read_bytes(s.join(root, "kept.bin")) == data


def test_a_write_of_many_parts_reads_back_whole(place: Place) -> None:
    """Three parts written last first (I/O threads finish in any order), the head last, as the
    engine writes them: published, the object is the bytes in order, and nothing is left of
    them, nor of a dead writer's upload of the name (removed by ``create``, or discarded by the
    commit)."""
    s = place.storage
    path = s.join(place.root, "whole.bin")
    cut = (place.begun_at // (5 * MiB) + 1) * 5 * MiB  # where the part after the first upload's ends
    data = random_bytes(cut + 1000).numpy().tobytes()
    place.leave_dead_writer(path)
    with s.create(path) as sink:
        sink.grid(5 * MiB, DirectIO.AUTO)
        for lo, hi in ((cut, len(data)), (place.begun_at, cut), (0, place.begun_at)):
            sink.write_at(memoryview(data)[lo:hi], lo)
    assert place.read_bytes(path) == data
    assert (s.size(path), s.unfinished(place.root), place.names()) == (len(data), [], ["whole.bin"])


def test_a_source_reads_until_its_end(place: Place) -> None:
    s, root = place.storage, place.root
    path, data = s.join(root, "data.bin"), random_bytes(10_000).numpy().tobytes()
    s.write_small(path, data)
    with s.open(path) as source:
        assert source.size() == len(data)
        buf = bytearray(4000)
        assert source.read_into(memoryview(buf), 100) == 4000
        assert bytes(buf) == data[100:4100]
        assert source.read_into(memoryview(buf), 8000) == 2000  # the end
        assert bytes(buf[:2000]) == data[8000:]
        assert source.read_into(memoryview(buf), 20_000) == 0
        parts = [bytearray(n) for n in (10, 0, 3000, 7000)]
        assert source.readv_into([memoryview(p) for p in parts], 1) == 9999
        assert b"".join(parts)[:9999] == data[1:]
    source.close()  # twice: nothing
    with pytest.raises(FileNotFoundError):
        s.open(s.join(root, "absent.bin"))
    with pytest.raises(IsADirectoryError):
        s.open(root)
    with pytest.raises(IsADirectoryError):
        s.check_target(root)


def test_leftovers_of_dead_writers_are_removed(place: Place) -> None:
    """A killed writer's unfinished object (a local temp, a pending upload) is removed by the
    next ``create`` of its name; a live writer's only where asked for all."""
    s, root = place.storage, place.root
    path = s.join(root, "ckpt.bin")
    live = begun(place, path)
    place.leave_dead_writer(path)
    assert s.unfinished(root) == ["ckpt.bin"]  # named though no file of the name exists
    assert len(s.remove_temps(path)) == 1  # the dead one only
    with s.create(path) as sink:
        sink.write_at(memoryview(b"next"), 0)
    assert s.remove_temps(path) == []
    assert s.unfinished(root) == ["ckpt.bin"]  # the live one's
    live.abandon()
    assert s.unfinished(root) == []
    assert s.read_small(path, 100) == b"next"
    assert place.names() == ["ckpt.bin"]


def test_a_live_writers_leftovers_go_when_asked_for_all(place: Place) -> None:
    """``remove_temps(stale_only=False)`` removes what every unfinished write of the name left,
    a live writer's too (the manager's removal of an incomplete step folder relies on it)."""
    s, root = place.storage, place.root
    path = s.join(root, "ckpt.bin")
    live = begun(place, path)
    assert s.remove_temps(path) == []
    assert len(s.remove_temps(path, stale_only=False)) == 1
    assert s.unfinished(root) == []
    live.abandon()
    assert place.names() == []


def test_kinds_and_the_removal_of_an_empty_folder(place: Place) -> None:
    """What the manager asks of its step folders: the kind of a name, and a folder removed only
    once empty (an entry left in it stays, with the folder)."""
    s, root = place.storage, place.root
    folder, file = s.join(root, "step"), s.join(root, "step", "a.bin")
    assert (s.kind(folder), s.kind(file)) == (None, None)
    s.make_folders(folder)
    assert s.kind(folder) == ("folder" if place.empty_folders else None)
    s.write_small(file, b"a")
    assert (s.kind(root), s.kind(folder), s.kind(file)) == ("folder", "folder", "file")
    with pytest.raises(OSError, match=re.escape(folder)) as info:  # naming the folder
        s.remove_folder(folder)
    assert info.value.errno == errno.ENOTEMPTY
    assert s.read_small(file, 10) == b"a"
    s.remove(file)
    s.remove_folder(folder)
    assert (s.kind(folder), s.list_folder(root)) == (None, [])
    s.remove_folder(folder)  # nothing where there is none


def test_a_writer_lock_refuses_every_other_writer_until_closed(place: Place) -> None:
    """A lock refuses a second writer; an object store's record is taken over by it instead,
    and the first writer learns so at its next ``check`` (the seam allows either)."""
    s, root = place.storage, place.root
    path = s.join(root, ".lock-rank-00000")
    first = s.lock(path, b'{"pid": 1}')
    if not place.lock_refuses:
        second = s.lock(path, b'{"pid": 2}')
        second.check()
        for _ in range(2):  # told again: the record stays the second writer's
            with pytest.raises(LockHeldError) as info:
                first.check()
            assert info.value.holder == b'{"pid": 2}'
            assert isinstance(info.value, OSError)
            assert path in str(info.value)
        first.close()  # not its record any more: left as it is
        assert place.read_bytes(path) == b'{"pid": 2}'
        second.close()
        assert not s.exists(path)
        return
    for _ in range(2):  # refused again: the refusal leaves the lock held
        with pytest.raises(LockHeldError) as info:
            s.lock(path, b'{"pid": 2}')
        assert info.value.holder == b'{"pid": 1}'
        assert isinstance(info.value, OSError)
        assert path in str(info.value)
    first.close()
    first.close()  # twice: nothing
    second = s.lock(path, b'{"pid": 2}')
    with pytest.raises(LockHeldError) as info:
        s.lock(path, b"")
    assert info.value.holder == b'{"pid": 2}'
    second.close()
    s.lock(path, b"").close()


def test_unfinished_writes_are_no_entries(place: Place, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What an unfinished write left (a local temp, a pending upload) is never listed as an
    entry: ``unfinished`` names the target it was for. ``absolute`` anchors a local path and
    keeps a URL as it is."""
    s, root = place.storage, place.root
    s.write_small(s.join(root, "done.bin"), b"done")
    sink = begun(place, s.join(root, "ckpt.bin"))
    assert s.list_folder(root) == [Entry("done.bin", "file")]
    assert s.unfinished(root) == ["ckpt.bin"]
    sink.abandon()
    assert s.unfinished(root) == []
    if s is LOCAL:
        monkeypatch.chdir(tmp_path)
        assert s.absolute("rel/a") == str(tmp_path / "rel" / "a")
    assert s.absolute(root) == root


# --- the local file system ---------------------------------------------------------------------


def test_local_entries_of_other_kinds_are_not_followed(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    os.symlink(tmp_path / "dir", tmp_path / "link")
    assert LOCAL.list_folder(str(tmp_path)) == [Entry("dir", "folder"), Entry("fifo", "other"),
                                                  Entry("link", "other")]
    assert [LOCAL.kind(str(tmp_path / n)) for n in ("dir", "fifo", "link")] == ["folder", "other", "other"]


@pytest.mark.timeout(60)  # a read that waited for the FIFO's writer would hang until then
def test_a_small_read_of_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "DONE")
    with pytest.raises(OSError, match="FIFO"):
        LOCAL.read_small(str(tmp_path / "DONE"), 100)
    with pytest.raises(OSError, match="FIFO"):
        LOCAL.open(str(tmp_path / "DONE"))


def test_memory_unaligned_with_its_offsets_is_written_buffered_under_o_direct(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """With O_DIRECT on, a write of read-only or unaligned memory (a header in a bytes object)
    goes through the buffered descriptor, while staging memory lying on the grid goes through
    the O_DIRECT twin: neither fails (direct_io='on' would raise on an unaligned O_DIRECT
    write) nor turns O_DIRECT off for the rest of the file."""
    if not direct_io_supported(tmp_path):
        pytest.skip("the file system of tmp_path refuses O_DIRECT")
    path = tmp_path / "t.bin"
    data = random_bytes(7 * 4096).numpy().tobytes()
    staging = mmap.mmap(-1, 4 * 4096)  # page-aligned, as the staging buffers are
    writes: list[tuple[int, int, int]] = []
    real = fileio.pwrite_all

    def spy(fd: int, view: memoryview, offset: int, where: str) -> None:
        writes.append((fd, offset, len(view)))
        real(fd, view, offset, where)

    with LOCAL.create(str(path)) as sink:
        assert sink.grid(4 * 4096, DirectIO.ON) == 4096
        direct_fd = sink._direct_fd
        assert direct_fd is not None
        monkeypatch.setattr(fileio, "pwrite_all", spy)
        sink.write_at(memoryview(data)[: 2 * 4096], 0)  # read-only memory: buffered
        unaligned = bytearray(4096 + 100 + 1)
        unaligned[1:] = data[2 * 4096 : 3 * 4096 + 100]
        sink.write_at(memoryview(unaligned)[1:], 2 * 4096)  # writable, but off the grid: buffered
        staging[100:] = data[3 * 4096 + 100 :]  # byte 0 of the buffer stands for offset 3 * 4096
        sink.write_at(memoryview(staging)[100:], 3 * 4096 + 100)  # its aligned middle goes direct
        assert not sink._direct_writes_refused
        monkeypatch.undo()
    assert [w for w in writes if w[0] == direct_fd] == [(direct_fd, 4 * 4096, 3 * 4096)]
    assert [w[1:] for w in writes if w[0] != direct_fd] == [(0, 2 * 4096), (2 * 4096, 4096 + 100),
                                                            (3 * 4096 + 100, 4096 - 100), (7 * 4096, 0)]
    assert path.read_bytes() == data

    with LOCAL.open(str(path)) as source:  # reads alike: whole blocks into staging memory go direct
        assert source.grid(4 * 4096, DirectIO.ON) == 4096
        header = bytearray(2 * 4096 + 1)  # from byte 1: off the grid
        assert source.read_into(memoryview(header)[1:], 0) == 2 * 4096
        assert source.read_into(memoryview(staging), 3 * 4096) == 4 * 4096
        assert source._direct_fd is not None
    assert bytes(header[1:]) == data[: 2 * 4096]
    assert staging[:] == data[3 * 4096 :]
    staging.close()


# --- the grid: what an object store's multipart upload relies on ----------------------------------------


@pytest.mark.parametrize("part", [64 * KiB, 192 * KiB])
def test_writes_lie_on_the_grid_a_sink_asks_for(mem: MemStorage, part: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A storage that uploads parts of a fixed size asks for that grid: with buffers of a
    multiple of it, every write the engine makes starts on a part's boundary (the first, after
    the header, ends on one) and ends on one, or at the end of the data."""
    mem.grid = part
    state = {"a": random_tensor(300_001), "b": random_tensor((333, 77), torch.float16).t(), "c": random_tensor(5)}
    path = "mem://test/grid.safetensors"
    sinks: list[MemSink] = []
    create = mem.create

    def keep(p: str) -> MemSink:
        sinks.append(create(p))
        return sinks[-1]

    monkeypatch.setattr(mem, "create", keep)
    ckptstream.save(state, path, settings=ckptstream.Settings(buffer_size=2 * part, num_buffers=3, io_threads=3))
    (sink,) = sinks
    size = len(mem.objects[path])
    header = [w for w in sink.writes if w[0] == 0]
    data = sorted(w for w in sink.writes if w[0] != 0)
    assert len(header) == 2  # the header, then again with its checksums
    assert data[0][0] == header[0][1]  # the data start right after the header
    assert len(data) == -(-size // (2 * part))  # one write per buffer's window
    for offset, length in data:
        assert offset == data[0][0] or offset % part == 0, (offset, length)
        assert (offset + length) % part == 0 or offset + length == size, (offset, length)
    loaded = ckptstream.load(path, settings=ckptstream.Settings(buffer_size=2 * part))
    for k, t in state.items():
        assert_bytes_equal(loaded[k], t)


def test_a_storage_without_mapping_refuses_mmap_loads(mem: MemStorage) -> None:
    ckptstream.save({"w": random_tensor(100)}, "mem://test/m.safetensors")
    with pytest.raises(UnsupportedStorageError, match="mmap=True") as info:
        ckptstream.load("mem://test/m.safetensors", mmap=True)
    assert "mem://test/m.safetensors" in str(info.value)
