"""Boxes of stored tensors: ``read_slices`` with offsets and lengths for some dimensions only, and
``get_slice`` indexing with negative and clipped bounds, compared with what torch's own indexing
gives for many random shapes; reads into a destination of another dtype are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptstream
from tests.helpers import assert_bytes_equal, is_poisoned, poisoned_like, random_tensor

SHAPES = [(40, 33), (7,), (5, 4, 3), (3, 1, 6, 2), (0, 5), (6, 0, 2), (1,), (9, 11)]
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]
SLOW_ENOUGH = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(22)
    tensors = {f"t{i}": random_tensor(shape, DTYPES[i % len(DTYPES)]) for i, shape in enumerate(SHAPES)}
    path = tmp_path_factory.mktemp("slices") / "ckpt.safetensors"
    ckptstream.save(tensors, path)
    return path, tensors


def test_offsets_without_lengths_box_to_the_end_of_each_dimension(stored: Any) -> None:
    path, tensors = stored
    w = tensors["t0"]  # (40, 33)
    with ckptstream.open(path) as reader:
        rows = reader.read_slices([("t0", [5], None, "cpu")])[0]
        assert rows.shape == (35, 33)
        assert_bytes_equal(rows, w[5:])
        assert_bytes_equal(reader.read_slices([("t0", [5, 30], None, "cpu")])[0], w[5:, 30:])
        assert_bytes_equal(reader.read_slices([("t0", [5, 30], [2], "cpu")])[0], w[5:7, 30:])
        assert_bytes_equal(reader.read_slices([("t0", [], None, "cpu")])[0], w)
        with pytest.raises(IndexError, match=r"t0: dimension 0 of size 40 has no elements 41\.\.40"):
            reader.read_slices([("t0", [41], None, "cpu")])[0]


@st.composite
def boxes(draw: st.DrawFn) -> tuple[str, list[int], list[int] | None]:
    """A tensor, offsets for its first k dimensions, and lengths for the first j <= k of them
    (or None): the rest of each dimension from its offset."""
    key = f"t{draw(st.integers(0, len(SHAPES) - 1))}"
    shape = SHAPES[int(key[1:])]
    k = draw(st.integers(0, len(shape)))
    offsets = [draw(st.integers(0, shape[d])) for d in range(k)]
    if draw(st.booleans()):
        return key, offsets, None
    j = draw(st.integers(0, k))
    return key, offsets, [draw(st.integers(0, shape[d] - offsets[d])) for d in range(j)]


@SLOW_ENOUGH
@given(box=boxes())
def test_read_slice_gives_what_torch_indexing_gives(stored: Any, box: tuple[str, list[int], list[int] | None]) -> None:
    path, tensors = stored
    key, offsets, lengths = box
    t = tensors[key]
    given_lengths = lengths or []
    index = tuple(slice(o, o + given_lengths[d]) if d < len(given_lengths) else slice(o, None)
                  for d, o in enumerate(offsets))
    expected = t[index]
    with ckptstream.open(path) as reader:
        got = reader.read_slices([(key, offsets, lengths, "cpu")])[0]
    assert got.shape == expected.shape, (t.shape, offsets, lengths)
    assert_bytes_equal(got, expected)


@st.composite
def indices(draw: st.DrawFn) -> tuple[str, tuple[Any, ...]]:
    """A tensor and an index of ints and step-1 slices, bounds negative and past the ends too."""
    key = f"t{draw(st.integers(0, len(SHAPES) - 1))}"
    shape = SHAPES[int(key[1:])]
    index: list[Any] = []
    for size in shape[: draw(st.integers(0, len(shape)))]:
        bound = st.none() | st.integers(-size - 3, size + 3)
        if size and draw(st.booleans()):
            index.append(draw(st.integers(-size, size - 1)))
        else:
            index.append(slice(draw(bound), draw(bound), draw(st.sampled_from([None, 1]))))
    return key, tuple(index)


@SLOW_ENOUGH
@given(case=indices())
def test_get_slice_gives_what_torch_indexing_gives(stored: Any, case: tuple[str, tuple[Any, ...]]) -> None:
    path, tensors = stored
    key, index = case
    expected = tensors[key][index]
    with ckptstream.open(path) as reader:
        got = reader.get_slice(key)[index]
    assert got.shape == expected.shape, (tensors[key].shape, index)
    assert_bytes_equal(got, expected)


@pytest.mark.parametrize("index", [
    (slice(-5, None),), (slice(2, -3),), (slice(-3, -1), slice(-30, None)), (slice(30, 5),), (-1, slice(-4, -2)),
    (slice(-100, 100), -33), (slice(None, -38),),
], ids=["last_five", "two_to_minus_three", "negative_both", "empty", "negative_int", "clipped",
        "first_two"])  # fmt: skip
def test_negative_bounds(stored: Any, index: tuple[Any, ...]) -> None:
    path, tensors = stored
    with ckptstream.open(path) as reader:
        got = reader.get_slice("t0")[index]
    assert got.shape == tensors["t0"][index].shape
    assert_bytes_equal(got, tensors["t0"][index])


@pytest.mark.parametrize(("index", "error", "message"), [
    (slice(None, None, -1), IndexError,
     r"t0: only slices of step 1 can be read, got slice\(None, None, -1\) \(step -1\)"),
    ((slice(5, 1, -2),), IndexError, r"t0: only slices of step 1 .*step -2.*flip\(\)"),
    ((slice(None), slice(None, None, 2)), IndexError, r"t0: only slices of step 1 .*step 2"),
    (-41, IndexError, r"t0: index -41 is out of range for dimension 0 of size 40"),
    (True, TypeError, r"t0: index with ints and slices, got bool"),
    ((Ellipsis, 1), TypeError, r"t0: index with ints and slices, got ellipsis"),
], ids=["reversed", "step_minus_two", "step_two", "int_before_start", "bool", "ellipsis"])  # fmt: skip
def test_what_get_slice_refuses_is_said_clearly(stored: Any, index: Any, error: type[Exception], message: str) -> None:
    path, _ = stored
    with ckptstream.open(path) as reader, pytest.raises(error, match=message):
        reader.get_slice("t0")[index]


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float16, torch.uint8],
                         ids=["wider", "same_size_int", "narrower", "bytes"])
def test_reading_into_another_dtype_is_refused_not_reinterpreted(stored: Any, dtype: torch.dtype) -> None:
    """The stored bits are never reinterpreted (int32 has float32's size: its bytes would fit)
    nor converted; the destination is left untouched."""
    path, _ = stored
    dst = poisoned_like(torch.empty(40, 33, dtype=dtype))
    part = poisoned_like(torch.empty(5, 33, dtype=dtype))
    with ckptstream.open(path) as reader:
        with pytest.raises(ckptstream.StateMismatchError,
                           match=rf"t0 is torch\.float32 \[40, 33\] in the file; the destination is {dtype} "
                                 r"\[40, 33\]; read\(\) it and convert with \.to\(\)"):
            reader.read_into("t0", dst)
        with pytest.raises(ckptstream.StateMismatchError, match=rf"the destination is {dtype} \[5, 33\]"):
            reader.read_slices([("t0", [3], [5], part)])[0]
    assert is_poisoned(dst)
    assert is_poisoned(part)
