"""The ``prefix_index`` codec for optimizer moments: the seed's prefix table, done vectorised.

Owns: the prefix table (distinct top-P-bit prefixes of each 32- or 16-bit word), the index
stream (fixed width or zstd), the low-bit stream and the fallback to ``byteplane``. Must not:
loop over elements in Python, or keep tables between calls.

Each word's top ``P`` bits (``prefix_bits``; 16-bit words use ``min(P, 15)``) are replaced by
an index into the table of distinct prefixes, most frequent first, and the ``W - P`` low bits
are kept exactly. ``entropy=False`` is the seed's method: fixed-width indexes of
``ceil(log2(#distinct))`` bits. ``entropy=True`` (the default) zstd-codes the index stream as
bytes (uint16 indexes as a low-byte and a high-byte plane) and comes close to its entropy.
Values are cut into ``groups`` independent, byte-aligned groups coded on worker threads.
The low bits are bit-packed (``bitpack``): on Adam-like moments they are noise, which no
entropy coder shrinks, so packing is as small as byte-plane coding them and cheaper
(bench/RESULTS.md, "Figures formerly quoted in code").

Header params: ``{"mode": "table", "word_bits": 32|16, "prefix_bits": P, "entropy": bool,
"distinct": d, "group": values per group (a multiple of 8)}``. Sections: the table (``d``
prefixes as little-endian words of the element size), then for each group its index parts
(entropy: one zstd frame of uint8 indexes, or two of the uint16 indexes' low and high bytes;
fixed: the ``bitpack`` parts of width ``ceil(log2 d)``) and its low-bit parts (the ``bitpack``
parts of width ``W - P``). When the table does not pay (other element sizes, an empty tensor,
more than 65536 distinct prefixes, or a result no smaller than raw) the blob holds
``{"mode": "byteplane", "reason": ...}`` plus the ``byteplane`` params and sections.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ckptpilot.codecs.base import (
    FramedCodec,
    check_bool,
    check_int,
    lane,
    parallel_map,
    resolve_threads,
    tensor_bytes,
)
from ckptpilot.codecs.bitpack import pack, part_sizes, unpack_into
from ckptpilot.codecs.blob import Frame, Section
from ckptpilot.codecs.byteplane import decode_planes, encode_planes
from ckptpilot.codecs.entropy import check_payload, compressor, decompress_into
from ckptpilot.codecs.registry import register_codec
from ckptpilot.errors import CheckpointFormatError

MAX_DISTINCT = 1 << 16
MIN_GROUP = 1 << 16
_DENSE_PREFIX_BITS = 16


def _index_dtype(distinct: int) -> type[np.unsignedinteger[Any]]:
    return np.uint8 if distinct <= 256 else np.uint16


@register_codec
class PrefixIndexCodec(FramedCodec):
    """Prefix table + index + low bits; see the module docstring for the parameters."""

    codec_id = "prefix_index"

    def __init__(
        self,
        *,
        prefix_bits: int = 12,
        entropy: bool = True,
        groups: int = 8,
        level: int = 1,
        threads: int = 0,
    ) -> None:
        self.prefix_bits = check_int(self.codec_id, "prefix_bits", prefix_bits, 1, 31)
        self.entropy = check_bool(self.codec_id, "entropy", entropy)
        self.groups = check_int(self.codec_id, "groups", groups, 1)
        self.level = check_int(self.codec_id, "level", level, 1, 22)
        self.threads = check_int(self.codec_id, "threads", threads, 0)

    @property
    def config(self) -> dict[str, Any]:
        return {
            "id": self.codec_id,
            "prefix_bits": self.prefix_bits,
            "entropy": self.entropy,
            "groups": self.groups,
            "level": self.level,
            "threads": self.threads,
        }

    def _encode(
        self, tensor: torch.Tensor, base: torch.Tensor | None
    ) -> tuple[dict[str, Any], list[Section]]:
        flat, itemsize = tensor_bytes(tensor), tensor.dtype.itemsize
        threads = resolve_threads(self.threads)
        if itemsize not in (2, 4) or flat.size == 0:
            return self._fallback(flat, itemsize, threads, "not 16/32-bit words or empty")
        encoded = self._encode_table(flat, itemsize, threads)
        if encoded is None:
            return self._fallback(flat, itemsize, threads, f"over {MAX_DISTINCT} prefixes")
        if sum(len(section.data) for section in encoded[1]) >= flat.size:
            return self._fallback(flat, itemsize, threads, "table does not pay off")
        return encoded

    def _fallback(
        self, flat: np.ndarray, itemsize: int, threads: int, reason: str
    ) -> tuple[dict[str, Any], list[Section]]:
        params, sections = encode_planes(flat, itemsize, self.level, threads)
        return {"mode": "byteplane", "reason": reason, **params}, sections

    def _encode_table(
        self, flat: np.ndarray, itemsize: int, threads: int
    ) -> tuple[dict[str, Any], list[Section]] | None:
        word_bits = 8 * itemsize
        prefix_bits = min(self.prefix_bits, word_bits - 1)
        shift = word_bits - prefix_bits
        n = flat.size // itemsize
        n_groups = min(self.groups, -(-n // MIN_GROUP))
        share = -(-n // n_groups)
        group = -(-share // 8) * 8  # whole bytes of packed bits in every group
        starts = range(0, n, group)
        words = flat.view(f"<u{itemsize}")
        dense = prefix_bits <= _DENSE_PREFIX_BITS

        def prefixes(start: int) -> tuple[np.ndarray, np.ndarray | None]:
            stop = min(n, start + group)
            if itemsize == 4 and dense:  # the top half-word alone: a 2-byte strided copy
                top = lane(flat[4 * start : 4 * stop], 4, 2, 2) >> np.uint16(16 - prefix_bits)
            else:
                top = words[start:stop] >> words.dtype.type(shift)
            counts = np.bincount(top, minlength=1 << prefix_bits) if dense else None
            return top, counts

        tops = parallel_map(prefixes, starts, threads)
        if dense:
            counts = np.sum([c for _, c in tops], axis=0)
            table = np.flatnonzero(counts)
            freq = counts[table]
        else:
            table, freq = np.unique(np.concatenate([t for t, _ in tops]), return_counts=True)
        distinct = len(table)
        if distinct > MAX_DISTINCT:
            return None
        order = np.argsort(-freq, kind="stable")
        index_dtype = _index_dtype(distinct)
        rank = np.empty(distinct, index_dtype)
        rank[order] = np.arange(distinct, dtype=index_dtype)
        lookup = np.zeros(1 << prefix_bits, index_dtype) if dense else None
        if lookup is not None:
            lookup[table] = rank
        index_bits = (distinct - 1).bit_length()

        def encode_group(item: tuple[int, tuple[np.ndarray, np.ndarray | None]]) -> list[Section]:
            start, (top, _) = item
            stop = min(n, start + group)
            index = lookup[top] if lookup is not None else rank[np.searchsorted(table, top)]
            if self.entropy:
                zc = compressor(self.level)
                if index.itemsize == 1:
                    parts: list[Any] = [zc.compress(index)]
                else:
                    pairs = index.view(np.uint8).reshape(-1, 2)
                    parts = [zc.compress(np.ascontiguousarray(pairs[:, b])) for b in (0, 1)]
            else:
                parts = pack(index.view(np.uint8), index.itemsize, index_bits)
            parts += pack(flat[itemsize * start : itemsize * stop], itemsize, shift)
            return [Section.of(part) for part in parts]

        per_group = parallel_map(encode_group, list(zip(starts, tops, strict=True)), threads)
        params = {
            "mode": "table",
            "word_bits": word_bits,
            "prefix_bits": prefix_bits,
            "entropy": self.entropy,
            "distinct": distinct,
            "group": group,
        }
        table_section = Section.of(table[order].astype(f"<u{itemsize}"))
        return params, [table_section, *(s for sections in per_group for s in sections)]

    def _decode(self, frame: Frame, base: torch.Tensor | None) -> np.ndarray:
        threads = resolve_threads(self.threads)
        mode = frame.param("mode", str)
        if mode == "byteplane":
            return decode_planes(frame, threads)
        if mode != "table":
            raise CheckpointFormatError(f"prefix_index blob: unknown mode {mode!r}")
        itemsize, n = frame.itemsize, frame.numel
        word_bits = frame.param("word_bits", int, lo=8 * itemsize, hi=8 * itemsize)
        prefix_bits = frame.param("prefix_bits", int, lo=1, hi=word_bits - 1)
        entropy = frame.param("entropy", bool)
        distinct = frame.param("distinct", int, lo=1, hi=MAX_DISTINCT)
        group = frame.param("group", int, lo=8)
        if group % 8 or itemsize not in (2, 4):
            raise CheckpointFormatError("prefix_index blob: bad group size or element size")
        shift = word_bits - prefix_bits
        index_dtype = _index_dtype(distinct)
        index_bits = (distinct - 1).bit_length()
        if entropy:
            n_index = 1 if distinct <= 256 else 2
        else:
            n_index = len(part_sizes(index_bits, np.dtype(index_dtype).itemsize, 0))
        n_low = len(part_sizes(shift, itemsize, 0))
        n_groups = -(-n // group)
        frame.expect_sections(1 + n_groups * (n_index + n_low))  # first: it bounds the list
        parts = [(distinct * itemsize, False)]
        for start in range(0, n, group):
            rows = min(n, start + group) - start
            if entropy:
                parts += [(rows, True)] * n_index
            else:
                parts += [(size, False) for size in part_sizes(
                    index_bits, np.dtype(index_dtype).itemsize, rows)]
            parts += [(size, False) for size in part_sizes(shift, itemsize, rows)]
        check_payload(frame, parts)
        table = np.frombuffer(frame.section(0), f"<u{itemsize}")
        if table.max() >= 1 << prefix_bits:
            raise CheckpointFormatError("prefix_index blob: table entry out of range")
        shifted = table.astype(f"<u{itemsize}") << np.dtype(f"<u{itemsize}").type(shift)
        out = np.empty(frame.nbytes, np.uint8)
        words = out.view(f"<u{itemsize}")

        def decode_group(g: int) -> None:
            start, stop = g * group, min(n, (g + 1) * group)
            first = 1 + g * (n_index + n_low)
            index = (np.empty if entropy else np.zeros)(stop - start, index_dtype)
            if entropy and index.itemsize == 1:
                decompress_into(frame.section(first), index, f"prefix_index group {g}")
            elif entropy:
                for b in (0, 1):
                    plane = np.empty(stop - start, np.uint8)
                    decompress_into(frame.section(first + b), plane, f"prefix_index group {g}")
                    index.view(np.uint8)[b::2] = plane
            else:
                packed = [frame.section(first + i) for i in range(n_index)]
                unpack_into(packed, index.view(np.uint8), index.itemsize, index_bits)
            if index.size and int(index.max()) >= distinct:
                raise CheckpointFormatError(f"prefix_index blob: index out of range in group {g}")
            np.take(shifted, index, out=words[start:stop], mode="clip")
            low = [frame.section(first + n_index + i) for i in range(n_low)]
            unpack_into(low, out[itemsize * start : itemsize * stop], itemsize, shift)

        parallel_map(decode_group, range(n_groups), threads)
        return out
