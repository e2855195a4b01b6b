"""Lane kernels (``ckptpilot.codecs.lanes``): split then join gives the elements back, bit for
bit, for every aligned lane layout, with and without a base and the sign rotation, across
block boundaries; the rotation is the one its docstring states."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from ckptpilot.codecs import lanes

FAST = settings(max_examples=150, deadline=None)


@st.composite
def layouts(draw: st.DrawFn, itemsize: int) -> list[tuple[int, int]]:
    """A random tiling of the element by aligned words, low bytes first."""
    layout, lo = [], 0
    while lo < itemsize:
        widths = [w for w in (1, 2, 4, 8) if lo % w == 0 and lo + w <= itemsize]
        width = draw(st.sampled_from(widths))
        layout.append((lo, width))
        lo += width
    return layout


@FAST
@given(data=st.data(), itemsize=st.sampled_from([1, 2, 4, 8]), n=st.integers(0, 300),
       block=st.sampled_from([1, 8, 40, 1 << 20]), with_base=st.booleans(),
       rotated=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_split_then_join_gives_the_elements_back(
    data: st.DataObject, itemsize: int, n: int, block: int, with_base: bool, rotated: bool,
    seed: int,
) -> None:
    rotated = rotated and itemsize >= 2
    layout = data.draw(layouts(itemsize))
    rng = np.random.default_rng(seed)
    flat = rng.integers(0, 256, n * itemsize, dtype=np.uint8)
    base = rng.integers(0, 256, n * itemsize, dtype=np.uint8) if with_base else None
    saved, lanes.BLOCK_BYTES = lanes.BLOCK_BYTES, block
    try:
        parts = [(lo, width, np.empty(n, f"<u{width}")) for lo, width in layout]
        lanes.split(flat, itemsize, parts, lanes.Workspace(), base, rotated)
        out = np.empty_like(flat)
        lanes.join(out, itemsize, parts, lanes.Workspace(), base, rotated)
    finally:
        lanes.BLOCK_BYTES = saved
    assert np.array_equal(out, flat)
    words = lanes.words(flat if base is None else flat ^ base, itemsize)
    if rotated:
        words = rotated_by_formula(words, itemsize)
    for lo, width, part in parts:  # each lane holds its bytes of the (rotated) elements
        expected = words.view(np.uint8).reshape(n, itemsize)[:, lo : lo + width]
        assert np.array_equal(part.view(np.uint8).reshape(n, width), expected)


def rotated_by_formula(words: np.ndarray, itemsize: int) -> np.ndarray:
    """The top 16 bits of each element rotated left by one bit, field by field in Python."""
    bits = 8 * itemsize
    out = []
    for x in words.tolist():
        top, rest = x >> (bits - 16), x & ((1 << (bits - 16)) - 1)
        top = ((top << 1) | (top >> 15)) & 0xFFFF
        out.append(top << (bits - 16) | rest)
    return np.array(out, dtype=words.dtype)


@pytest.mark.parametrize("dtype", ["<u2", "<u4", "<u8"])
def test_rotation_puts_the_exponent_on_top_and_the_sign_below(dtype: str) -> None:
    kind = np.dtype(dtype)
    bits = 8 * kind.itemsize
    sign = 1 << (bits - 1)
    values = np.array([0, sign, sign | 0x7F << (bits - 9), (1 << bits) - 1, 0x1234], dtype=kind)
    out = lanes.rotate_sign(values, np.empty_like(values), np.empty_like(values))
    assert out.tolist() == rotated_by_formula(values, kind.itemsize).tolist()
    assert out[1] == 1 << (bits - 16)  # -0.0: the sign alone, at the bottom of the top field


def test_a_join_program_is_compiled_once_per_layout_and_reused() -> None:
    lanes._join_program.cache_clear()
    parts = [(0, 2, np.zeros(10, "<u2")), (2, 1, np.zeros(10, "<u1")),
             (3, 1, np.zeros(10, "<u1"))]
    for _ in range(3):
        lanes.join(np.empty(40, np.uint8), 4, parts, lanes.Workspace())
    info = lanes._join_program.cache_info()
    assert (info.misses, info.hits) == (1, 2)


def test_sign_rotation_of_one_byte_elements_is_refused() -> None:
    with pytest.raises(ValueError, match="2 bytes or more"):
        lanes.join(np.empty(4, np.uint8), 1, [(0, 1, np.zeros(4, "<u1"))], lanes.Workspace(),
                   rotated=True)


@pytest.mark.parametrize(("itemsize", "layout"), [
    (4, [(0, 4)]), (8, [(0, 8)]), (8, [(0, 4), (4, 4)]),  # a lane spans the rotated 16 bits
    (4, [(0, 2), (2, 2)]), (2, [(0, 2)]),  # the rotated 16 bits are one read-only lane
    (4, [(0, 2), (2, 1), (3, 1)]), (8, [(0, 4), (4, 2), (6, 1), (7, 1)]),  # assembled
])
def test_every_way_of_rotating_back_round_trips(itemsize: int, layout: list[tuple[int, int]]
                                                ) -> None:
    rng = np.random.default_rng(itemsize)
    n = 1000
    flat = rng.integers(0, 256, n * itemsize, dtype=np.uint8)
    base = rng.integers(0, 256, n * itemsize, dtype=np.uint8)
    for against in (None, base):
        parts = [(lo, width, np.empty(n, f"<u{width}")) for lo, width in layout]
        lanes.split(flat, itemsize, parts, lanes.Workspace(), against, rotated=True)
        out = np.empty_like(flat)
        lanes.join(out, itemsize, parts, lanes.Workspace(), against, rotated=True)
        assert np.array_equal(out, flat)
