"""Exact fixed-width bit packing of the low bits of integer elements, vectorised with NumPy.

Owns: the packed layout used by ``prefix_index`` (fixed-width indexes and low bits). Must not:
choose widths or know what the bits mean.

Layout of the low ``width`` bits of ``count`` elements (``k = width // 8``, ``h = width % 8``):
first the ``k`` whole low bytes of each element, as aligned little-endian words (one part per
word run, e.g. width 20 of 32-bit elements: bytes 0-1 as ``<u2``); then the remaining ``h``
bits, split into fields of 4, 2 and 1 bits (the binary digits of ``h``, most significant
field first), one part per field width ``b``: ``8 // b`` fields per byte, most significant
first, padded to whole blocks of 8 elements (``b`` bytes per block). Every element costs
exactly ``width`` bits, plus the padding of one 8-element block per part. Fields of 1, 2 and 4
bits pack with byte arithmetic; 3, 5, 6 or 7-bit fields would straddle bytes and need 64-bit
word arithmetic, several times slower (bench/RESULTS.md, "Figures formerly quoted in code").
"""

from __future__ import annotations

import numpy as np

from ckptpilot.codecs.base import lane, word_runs


def part_sizes(width: int, itemsize: int, count: int) -> list[int]:
    """Byte size of each part :func:`pack` returns for ``count`` elements."""
    sizes = [count * w for _, w in word_runs(0, width // 8, itemsize)]
    blocks = -(-count // 8)
    return sizes + [blocks * bits for bits, _ in _fields(width % 8)]


def pack(flat: np.ndarray, itemsize: int, width: int) -> list[np.ndarray]:
    """The low ``width`` bits of each ``itemsize``-byte element of the uint8 array ``flat``."""
    whole = width // 8
    parts = [
        np.ascontiguousarray(lane(flat, itemsize, lo, w)) for lo, w in word_runs(0, whole, itemsize)
    ]
    fields = _fields(width % 8)
    if fields:
        byte = np.ascontiguousarray(lane(flat, itemsize, whole, 1))
        parts += [
            _pack_field((byte >> np.uint8(shift)) & np.uint8((1 << bits) - 1), bits)
            for bits, shift in fields
        ]
    return parts


def unpack_into(parts: list[memoryview], out: np.ndarray, itemsize: int, width: int) -> None:
    """Write packed low bits into the elements of the uint8 array ``out``.

    Whole bytes are assigned; the last ``width % 8`` bits are OR-ed into their byte, whose
    low bits must therefore be zero (its high bits may already hold other data).
    """
    whole = width // 8
    count = out.size // itemsize
    runs = word_runs(0, whole, itemsize)
    for (lo, w), part in zip(runs, parts, strict=False):
        lane(out, itemsize, lo, w)[...] = np.frombuffer(part, f"<u{w}")
    fields = _fields(width % 8)
    if fields:
        byte = lane(out, itemsize, whole, 1)
        for (bits, shift), part in zip(fields, parts[len(runs) :], strict=True):
            byte |= _unpack_field(np.frombuffer(part, np.uint8), bits, count) << np.uint8(shift)


def _fields(bits: int) -> list[tuple[int, int]]:
    """(field width, shift) for the binary digits of ``bits``, most significant first."""
    fields = []
    for width in (4, 2, 1):
        if bits & width:
            bits -= width
            fields.append((width, bits))
    return fields


def _pack_field(values: np.ndarray, bits: int) -> np.ndarray:
    if bits == 1:
        return np.packbits(values, axis=None)  # same layout, native speed
    per_byte = 8 // bits
    padded = np.zeros(-(-values.size // 8) * 8, np.uint8)
    padded[: values.size] = values
    out = np.zeros(padded.size // per_byte, np.uint8)
    for j in range(per_byte):
        out |= padded[j::per_byte] << np.uint8(bits * (per_byte - 1 - j))
    return out


def _unpack_field(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    if bits == 1:
        return np.unpackbits(packed, count=count)
    per_byte = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    values = np.empty(packed.size * per_byte, np.uint8)
    for j in range(per_byte):
        values[j::per_byte] = (packed >> np.uint8(bits * (per_byte - 1 - j))) & mask
    return values[:count]
