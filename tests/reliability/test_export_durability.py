"""Durability of an export over an earlier one, shown on the real calls it makes (recorded as
test_manager_durability records a manager's): every new file is written as a temp and fsynced
before any name in OUT changes; then only names change, and replayed in their order the folder
is at every point the earlier export or the new one for transformers (a ``model.safetensors``,
or an index whose shards are all there), never a mix of the two. Where the new shards take the
names of the earlier ones, the earlier index goes first, durably, and only renames lie between
it and the new index; the earlier names left over are removed, and the folder fsynced, before
the export returns."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import ckptstream
from ckptstream import Settings
from ckptstream._storage import publish
from tests.reliability.test_manager_durability import ManagerTrace, check_file_published

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


def model_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"layer.{i}.weight": torch.randn(3001, generator=g) for i in range(12)}  # 12004 bytes each


def weights(folder: Path) -> dict[str, list[str]]:
    """The export's last name -> the files it needs (itself, or the index and its shards)."""
    if (folder / SINGLE).exists():
        return {SINGLE: [SINGLE]}
    shards = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
    return {INDEX: [INDEX, *shards]}


def looks_complete(present: dict[str, str], needs: dict[str, dict[str, list[str]]]) -> str | None:
    """What transformers would load from names -> which export wrote them: "old", "new", "mix"
    (an index whose shards are all there, some of the other export), None (nothing complete)."""
    for last in (SINGLE, INDEX):  # transformers takes model.safetensors before an index
        if last in present:
            tag = present[last]
            files = needs[tag][last]
            if not all(f in present for f in files):
                return None
            return tag if all(present[f] == tag for f in files) else "mix"
    return None


@pytest.mark.parametrize(("earlier", "new"), [("30KB", "50KB"), ("30KB", "30KB"), ("1MB", "30KB"),
                                              ("30KB", "1MB"), ("1MB", "1MB")])
def test_every_new_file_is_durable_before_a_name_changes_and_no_mix_looks_complete(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, earlier: str, new: str) -> None:
    src = tmp_path / "state.safetensors"
    ckptstream.save(model_state(), src)
    out = tmp_path / "hf"
    ckptstream.export_hf(src, out, max_shard_size=earlier)
    (out / "tokenizer.json").write_text("{}")
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "gpt2"}')
    folder = os.path.realpath(out)
    old = {p.name: "old" for p in out.iterdir() if p.name != "tokenizer.json"}
    needs = {"old": weights(out)}
    trace = ManagerTrace(monkeypatch)
    result = ckptstream.export_hf(src, out, max_shard_size=new, config=config,
                                  settings=Settings(buffer_size=8192, num_buffers=2, io_threads=2))
    monkeypatch.undo()
    needs["new"] = weights(out)
    events = trace.events
    renames = [check_file_published(trace, os.path.join(folder, name)) for name in result.files]
    temps = {events[i][1] for i in renames}
    unlinks = trace.all(lambda e: e[0] == "unlink" and os.path.dirname(e[1]) == folder
                        and publish.TEMP_MARK not in e[1])
    changes = sorted(renames + unlinks)
    durable = max(trace.all(lambda e: e[0] == "sync" and e[1] in temps))
    assert durable < changes[0], "a name in OUT changes before every new file is durable"
    temp_writes = trace.all(lambda e: e[0] in ("write", "truncate") and e[1] in temps)
    assert max(temp_writes) < changes[0]
    assert renames[-1] == max(renames), "the weights' last name is not renamed in last"

    present, seen = dict(old), []
    for i in changes:  # replay the names' changes
        event = events[i]
        name = os.path.basename(event[2] if event[0] == "rename" else event[1])
        if event[0] == "rename":
            present[name] = "new"
        else:
            del present[name]
        seen.append((i, name, looks_complete(present, needs)))
    assert all(state != "mix" for _, _, state in seen), seen
    assert seen[-1][2] == "new"
    assert set(present) == set(result.files), present
    same_names = any(f in needs["old"].get(INDEX, []) for f in result.files if f.startswith("model-"))
    if same_names:  # the earlier index goes first, durably, then only renames until the new index
        shard_renames = [r for r, f in zip(renames, result.files, strict=True) if f.startswith("model-")]
        assert events[unlinks[0]] == ("unlink", os.path.join(folder, INDEX)), events[unlinks[0]]
        synced = [i for i in trace.all(lambda e: e == ("sync", folder)) if i > unlinks[0]]
        assert synced, "the folder is not fsynced after the earlier index is removed"
        assert synced[0] < min(shard_renames), "a shard is renamed in before the index's removal is durable"
        assert any(state is None for _, _, state in seen)
    else:  # the folder loads, as one export or the other, at every point
        assert all(state in ("old", "new") for _, _, state in seen), seen
    if unlinks:
        assert [i for i in trace.all(lambda e: e == ("sync", folder)) if i > max(unlinks)], \
            "the folder is not fsynced after the earlier export's last name is removed"
    assert (out / "tokenizer.json").read_text() == "{}"
    assert not [p for p in out.iterdir() if publish.TEMP_MARK in p.name]
    for name in result.files:
        if name.endswith(".safetensors"):
            ckptstream.verify(out / name)


def test_a_sealed_sink_holds_no_descriptor_and_is_published_or_abandoned_later(tmp_path: Path) -> None:
    from ckptstream._storage import storage_for

    path = tmp_path / "f.bin"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    storage = storage_for(str(path))
    data = [os.urandom(5000), os.urandom(7000)]
    for publish_it, payload in zip((False, True), data, strict=True):
        before = set(os.listdir("/proc/self/fd"))
        sink = storage.create(str(path))
        sink.write_at(memoryview(payload), 0)
        sink.seal()
        assert set(os.listdir("/proc/self/fd")) <= before, "the sealed sink still holds a descriptor"
        with pytest.raises(OSError, match="Bad file descriptor"):
            sink.write_at(memoryview(b"late"), 0)  # closed: never into a file that reused the number
        assert path.read_bytes() == b"old"
        if publish_it:
            sink.publish()
            assert path.read_bytes() == payload
            assert os.stat(path).st_mode & 0o777 == 0o640
        else:
            sink.abandon()
            assert path.read_bytes() == b"old"
        assert sorted(os.listdir(tmp_path)) == ["f.bin"]
