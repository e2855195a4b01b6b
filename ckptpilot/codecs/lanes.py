"""Element byte lanes: splitting elements into lanes and joining lanes back into elements.

Owns: the two kernels under every byte-plane codec, :func:`split` (element words to the
contiguous arrays of some of their lanes) and :func:`join` (lanes that tile the element back to
element words), the optional sign rotation of ``expplane`` (:func:`rotate_sign`), and the
:class:`Workspace` of temporaries they reuse. Must not: decide which lanes exist (the codecs'
plans do), code anything or allocate per block.

A lane is the bytes ``[lo, lo + width)`` of every element (``width`` in 1, 2, 4, 8, aligned:
``lo % width == 0``), held as one little-endian ``width``-byte word per element. Moving lanes
is interleaving, which NumPy has no vectorised kernel for: its byte-strided copies run element
by element. So both kernels are made of whole-word operations that NumPy does vectorise:
casts between unsigned widths (zero-extending up, truncating down), shifts and ORs.

- :func:`split` takes lane ``[lo, lo + width)`` as the words shifted right by ``8 lo`` and
  truncated to ``width`` bytes by the cast into the destination.
- :func:`join` builds each aligned half of a word from its own halves, recursively, then the
  word as ``high << (4 width) | low``: zero-extend the high half into the destination, shift it,
  zero-extend the low half into a temporary, OR. Each step works on the narrowest words that
  hold it (a 4-byte element whose top two lanes are single bytes pairs them as 2-byte words
  first, half the bytes of a 4-byte pass). The passes for a lane layout are compiled once
  (:class:`_JoinProgram`), so a block costs its passes and little Python.

Both walk the elements in blocks of ``BLOCK_BYTES`` so that a block's words and temporaries
stay in the core's cache across the several passes: the passes then cost cache bandwidth, not
memory bandwidth, while blocks much smaller pay more in per-call overhead than they save
(bench/RESULTS.md, codecs.py).

Sign rotation: the top 16 bits of a float element are its sign, its exponent (or the top of
it) and mantissa bits. Rotating them left by one bit moves the sign to the bottom of that
16-bit word, so the top byte holds exponent bits only (all eight of bfloat16's and float32's),
whose few distinct values entropy-code well, and the sign joins the noise-like mantissa bits
below (:func:`rotate_sign`; :func:`join` rotates back).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

BLOCK_BYTES = 1 << 20
"""Bytes of elements per block (per pass, one block's words and temporaries are reused)."""

Lane = tuple[int, int, np.ndarray]
"""``(lo, width, words)``: a lane's position in the element and its ``<u{width}`` words."""


def words(flat: np.ndarray, width: int) -> np.ndarray:
    """The uint8 array ``flat`` viewed as little-endian ``width``-byte words."""
    return flat.view(f"<u{width}")


def block_elements(itemsize: int) -> int:
    """Elements per block for elements of ``itemsize`` bytes."""
    return max(1, BLOCK_BYTES // itemsize)


class Workspace:
    """Temporaries for one thread's blocks, made once and reused by every block.

    Not thread-safe: each worker makes its own. ``get(slot, width, n)`` returns the first ``n``
    words of the slot's buffer, growing it when a longer one is asked for.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, int], np.ndarray] = {}

    def get(self, slot: str, width: int, n: int) -> np.ndarray:
        buffer = self._buffers.get((slot, width))
        if buffer is None or buffer.size < n:
            buffer = np.empty(n, f"<u{width}")
            self._buffers[(slot, width)] = buffer
        return buffer[:n]


def rotate_sign(elements: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """``out`` = the words ``elements`` (2, 4 or 8 bytes) with their top 16 bits rotated left
    by one bit; ``scratch`` is a temporary like ``out``.

    As arithmetic: ``x + (x & top) + (sign << p)`` modulo the word, where ``top`` masks the top
    16 bits and ``p`` is their lowest bit: adding the top field to itself shifts it left within
    the word (the sign falls off the end) and the sign comes back in at ``p``.
    """
    kind = elements.dtype.type
    bits = 8 * elements.dtype.itemsize
    low_bit = bits - 16
    np.bitwise_and(elements, kind(0xFFFF << low_bit), out=out)
    np.add(out, elements, out=out)
    np.right_shift(elements, kind(15), out=scratch)  # the sign bit lands on bit p
    np.bitwise_and(scratch, kind(1 << low_bit), out=scratch)
    np.bitwise_or(out, scratch, out=out)
    return out


def split(
    data: np.ndarray,
    itemsize: int,
    lanes: Sequence[tuple[int, int, np.ndarray]],
    work: Workspace,
    xor_with: np.ndarray | None = None,
    rotated: bool = False,
) -> None:
    """Fill each ``(lo, width, out)`` of ``lanes`` with that lane of the elements of ``data``.

    ``data`` is a uint8 array of whole elements; each ``out`` holds one ``<u{width}`` word per
    element. With ``xor_with`` (an array like ``data``) the lanes of ``data XOR xor_with`` are
    taken, block by block; with ``rotated`` those of the sign-rotated words (after the XOR).
    """
    n = data.size // itemsize
    step = block_elements(itemsize)
    elements = words(data, itemsize)
    base = None if xor_with is None else words(xor_with, itemsize)
    size = min(n, step)
    delta = None if base is None else work.get("split-xor", itemsize, size)
    turned = work.get("split-rotated", itemsize, size) if rotated else None
    shifted = work.get("split-shift", itemsize, size)
    shifts = [elements.dtype.type(8 * lo) for lo, _, _ in lanes]
    for start in range(0, n, step):
        stop = min(n, start + step)
        k = stop - start
        block = elements[start:stop]
        if base is not None and delta is not None:
            block = np.bitwise_xor(block, base[start:stop], out=delta[:k])
        if turned is not None:
            block = rotate_sign(block, turned[:k], shifted[:k])
        for (lo, _, out), shift in zip(lanes, shifts, strict=True):
            if lo == 0:
                np.copyto(out[start:stop], block, casting="unsafe")
            else:
                part = np.right_shift(block, shift, out=shifted[:k])
                np.copyto(out[start:stop], part, casting="unsafe")


def join(
    out: np.ndarray,
    itemsize: int,
    lanes: Sequence[Lane],
    work: Workspace,
    xor_with: np.ndarray | None = None,
    rotated: bool = False,
) -> None:
    """``out`` (a uint8 array of whole elements) from ``lanes``, which tile the element in order
    of ``lo``; rotated back when the lanes are of sign-rotated words (``rotated``, elements of
    2 bytes or more), then XOR-ed with ``xor_with`` (an array like ``out``) when it is given."""
    n = out.size // itemsize
    step = block_elements(itemsize)
    program = _join_program(tuple((lo, width) for lo, width, _ in lanes), itemsize, rotated)
    temps = [work.get(f"join{i}", width, min(n, step)) for i, width in enumerate(program.temps)]
    dest_words = words(out, itemsize)
    base = None if xor_with is None else words(xor_with, itemsize)
    for start in range(0, n, step):
        stop = min(n, start + step)
        regs = [lane[start:stop] for _, _, lane in lanes]
        regs += [temp[: stop - start] for temp in temps]
        regs.append(dest_words[start:stop])
        for op, out_reg, a, b, value in program.steps:
            op(regs[a], regs[b] if value is None else value, out=regs[out_reg])
        if base is not None:
            np.bitwise_xor(regs[-1], base[start:stop], out=regs[-1])


def _cast(a: np.ndarray, _: object, out: np.ndarray) -> None:
    np.copyto(out, a, casting="unsafe")


@dataclass(frozen=True)
class _JoinProgram:
    """The passes that join one block. ``steps`` are ``(op, out, a, b, value)``: register
    ``out`` = ``op(register a, register b)``, or ``op(register a, value)`` when ``value`` is
    not None (``_cast`` copies register ``a``, zero-extending or truncating). Registers are
    numbered lanes first, then the temporaries (``temps``: their widths); the destination
    block is the last register (-1)."""

    temps: tuple[int, ...]
    steps: tuple[tuple[Any, int, int, int, Any], ...]


@functools.lru_cache(maxsize=256)
def _join_program(
    layout: tuple[tuple[int, int], ...], itemsize: int, rotated: bool
) -> _JoinProgram:
    """Compile the join of lanes at ``layout`` (``(lo, width)`` each) for ``itemsize``-byte
    elements, rotating the top 16 bits back (``rotated``) where they are a word of their own,
    else on the whole element at the end."""
    if rotated and itemsize < 2:
        raise ValueError(f"only elements of 2 bytes or more are sign-rotated, not {itemsize}")
    temps: list[int] = []
    steps: list[tuple[Any, int, int, int, Any]] = []
    top = itemsize - 2  # where the rotated 16 bits start
    rotated_apart = False  # whether the top 16 bits were rotated back as a word of their own

    def temp(width: int) -> int:
        temps.append(width)
        return len(layout) + len(temps) - 1

    def word(width: int, value: int) -> Any:
        return np.dtype(f"<u{width}").type(value)

    def build(lo: int, width: int, into: int | None) -> int:
        nonlocal rotated_apart
        turn = rotated and (lo, width) == (top, 2)
        if (lo, width) in layout:
            reg = layout.index((lo, width))
            if into is None and not turn:
                return reg
            into = temp(width) if into is None else into  # a lane is read-only
            steps.append((_cast, into, reg, 0, None))
        else:
            half = width // 2
            high = build(lo + half, half, None)
            low = build(lo, half, None)
            into = temp(width) if into is None else into
            low_wide = temp(width)
            steps.extend([
                (_cast, into, high, 0, None),
                (np.left_shift, into, into, 0, word(width, 8 * half)),
                (_cast, low_wide, low, 0, None),
                (np.bitwise_or, into, into, low_wide, None),
            ])
        if turn:  # the 16-bit word right by one bit
            carry = temp(2)
            steps.extend([
                (np.left_shift, carry, into, 0, word(2, 15)),
                (np.right_shift, into, into, 0, word(2, 1)),
                (np.bitwise_or, into, into, carry, None),
            ])
            rotated_apart = True
        return into

    build(0, itemsize, -1)  # the destination is the last register
    if rotated and not rotated_apart:  # a lane spans the top 16 bits: rotate whole elements
        bits = 8 * itemsize
        sign, field = 1 << (bits - 1), (0xFFFF << (bits - 16)) & ((1 << bits) - 1)
        rest, back = temp(itemsize), temp(itemsize)
        steps.extend([
            (np.right_shift, rest, -1, 0, word(itemsize, 1)),  # the field, back down one bit
            (np.bitwise_and, rest, rest, 0, word(itemsize, field ^ sign)),
            (np.left_shift, back, -1, 0, word(itemsize, 15)),  # the sign, from its bottom
            (np.bitwise_and, back, back, 0, word(itemsize, sign)),
            (np.bitwise_and, -1, -1, 0, word(itemsize, ~field & ((1 << bits) - 1))),
            (np.bitwise_or, -1, -1, rest, None),
            (np.bitwise_or, -1, -1, back, None),
        ])
    return _JoinProgram(tuple(temps), tuple(steps))
