"""The self-describing blob every codec writes: header, section table, checksums (SPEC §5).

Owns: the blob layout, building it (:func:`build_blob`) and parsing it strictly
(:func:`read_header`, :func:`parse_blob`), and the dtype names written into blobs. Must not:
know any codec's payload or do I/O.

Layout, format version 2 (all integers little-endian)::

    offset        size   field
    0             4      magic b"CKPB"
    4             2      format version (u16) = 2
    6             4      J = length of the JSON header (u32)
    10            J      JSON header, UTF-8, sorted keys: {"codec": id, "dtype": name,
                         "shape": [..], "nbytes": raw byte count, "params": {what decode needs}}
    10+J          4      S = number of payload sections (u32)
    14+J          16*S   per section: length (u64), XXH3-64 of its bytes (u64)
    14+J+16*S     4      crc32 of every header byte before this field
    18+J+16*S     ...    the S sections back to back; the blob ends exactly after the last one

Version 1 (still read) differs only in the section table: 12 bytes per section, length (u64)
and crc32 (u32). The header checksum covers the magic, version, JSON and the section table,
and each section carries its own checksum, so any flipped bit or truncation is detected before
a tensor is built. Codecs split their payload into several sections (per chunk, per plane) so
that checksums are computed and verified by worker threads next to the data they belong to.
XXH3 rather than crc32: a section checksum must cost a small fraction of the encode time, and
crc32 costs a sizeable share of byteplane's (bench/RESULTS.md, "Figures formerly quoted in
code"). Not a cryptographic hash: the container adds a SHA256 per tensor.

Checksums catch accidents, not a hostile or buggy writer: a header can be forged with valid
checksums. So nothing a header says is trusted for an allocation: shapes are capped
(``format.container_index.MAX_NDIM`` dimensions and ``MAX_TENSOR_BYTES``), and codecs call
:meth:`Frame.check_sections` before allocating the tensor, which ties its size to the payload
bytes actually present (exactly for stored sections, within :data:`MAX_EXPANSION` for
zstd-coded ones, whose frames must also record that size: ``entropy.check_payload``).
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import torch
import xxhash

from ckptpilot.errors import CheckpointFormatError
from ckptpilot.format.container_index import shape_nbytes

MAGIC = b"CKPB"
FORMAT_VERSION = 2
_FIXED = struct.Struct("<4sHI")
_COUNT = struct.Struct("<I")
_ENTRIES = {1: struct.Struct("<QI"), 2: struct.Struct("<QQ")}  # length, checksum
_CHECKSUMS: dict[int, Callable[[Buffer], int]] = {1: zlib.crc32, 2: xxhash.xxh3_64_intdigest}
_CRC = struct.Struct("<I")

MAX_EXPANSION = 1 << 15
"""How many bytes one byte of zstd-coded payload can decode to at most: a zstd block decodes
to at most 128 KiB and takes at least 4 bytes (an RLE block)."""

Buffer: TypeAlias = bytes | bytearray | memoryview
"""What ``encode_parts`` returns and ``decode`` accepts: any contiguous bytes-like object."""

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint64": torch.uint64,
    "uint32": torch.uint32,
    "uint16": torch.uint16,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class Section:
    """One payload section and the checksum of its bytes, computed where the bytes were made."""

    data: Buffer
    checksum: int

    @classmethod
    def of(cls, data: np.ndarray | bytes) -> Section:
        """A section over ``data`` (a contiguous array is viewed as bytes, not copied)."""
        view = memoryview(data.reshape(-1).view(np.uint8) if isinstance(data, np.ndarray) else data)
        return cls(view, _CHECKSUMS[FORMAT_VERSION](view))


@dataclass(frozen=True)
class Frame:
    """A parsed blob: header fields plus checked access to the payload sections."""

    codec: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    params: dict[str, Any]
    _blob: memoryview
    _table: tuple[tuple[int, int, int], ...]  # (offset, length, checksum) per section
    _checksum: Callable[[Buffer], int]

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def n_sections(self) -> int:
        return len(self._table)

    def section(self, index: int) -> memoryview:
        """Return section ``index`` after checking its checksum (call once per section)."""
        offset, length, checksum = self._table[index]
        data = self._blob[offset : offset + length]
        if self._checksum(data) != checksum:
            raise CheckpointFormatError(f"{self.codec} blob: checksum mismatch in section {index}")
        return data

    def unverified_section(self, index: int) -> memoryview:
        """Section ``index`` without checking its checksum: only for reading the size it
        claims, to refuse a forged one before allocating (:meth:`section` checks it later)."""
        offset, length, _ = self._table[index]
        return self._blob[offset : offset + length]

    def expect_sections(self, count: int) -> None:
        """Raise unless the blob has exactly ``count`` sections."""
        if self.n_sections != count:
            raise CheckpointFormatError(
                f"{self.codec} blob: expected {count} payload sections, found {self.n_sections}"
            )

    def check_sections(self, parts: Sequence[tuple[int, bool]]) -> None:
        """Raise unless there is one section per ``(nbytes, coded)`` part and each can hold
        its ``nbytes`` of the tensor: a stored section is exactly that long, a zstd-coded one
        at least ``nbytes / MAX_EXPANSION``.

        Codecs call it before they allocate the tensor, so that a forged header (with valid
        checksums) cannot make them allocate more than the payload can fill.
        """
        self.expect_sections(len(parts))
        for index, ((nbytes, coded), (_, length, _)) in enumerate(
            zip(parts, self._table, strict=True)
        ):
            if (length * MAX_EXPANSION < nbytes) if coded else (length != nbytes):
                kind = "zstd-coded" if coded else "stored"
                raise CheckpointFormatError(
                    f"{self.codec} blob: section {index} has {length} bytes, which cannot be "
                    f"the {kind} form of {nbytes} bytes of the {self.dtype} tensor of shape "
                    f"{list(self.shape)} its header describes"
                )

    def param(self, name: str, kind: type, lo: int | None = None, hi: int | None = None) -> Any:
        """A header parameter of type ``kind`` (ints optionally within [lo, hi]), or raise."""
        value = self.params.get(name)
        if kind is int and isinstance(value, bool):
            value = None
        if not isinstance(value, kind) or (
            kind is int and ((lo is not None and value < lo) or (hi is not None and value > hi))
        ):
            raise CheckpointFormatError(f"{self.codec} blob: bad header parameter {name}={value!r}")
        return value


def build_blob(
    codec: str,
    dtype: torch.dtype,
    shape: Sequence[int],
    params: dict[str, Any],
    sections: Sequence[Section],
) -> list[Buffer]:
    """The blob as a list of buffers (header first); ``b"".join`` of it is the blob."""
    header = {
        "codec": codec,
        "dtype": DTYPE_NAMES[dtype],
        "shape": list(shape),
        "nbytes": math.prod(shape) * dtype.itemsize,
        "params": params,
    }
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    head = bytearray(_FIXED.pack(MAGIC, FORMAT_VERSION, len(text)))
    head += text
    head += _COUNT.pack(len(sections))
    entry = _ENTRIES[FORMAT_VERSION]
    for section in sections:
        head += entry.pack(len(section.data), section.checksum)
    head += _CRC.pack(zlib.crc32(head))
    return [bytes(head), *(s.data for s in sections if len(s.data))]


@dataclass(frozen=True)
class BlobHeader:
    """What a blob's header says; ``blob_bytes`` is the size of the whole blob it describes."""

    codec: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    params: dict[str, Any]
    header_bytes: int
    sections: tuple[tuple[int, int], ...]  # (length, checksum) per section
    version: int = FORMAT_VERSION

    @property
    def blob_bytes(self) -> int:
        return self.header_bytes + sum(length for length, _ in self.sections)


def read_header(blob: Buffer) -> BlobHeader:
    """Parse and check a blob's header; ``blob`` may be just the header or the whole blob.

    Raises :class:`CheckpointFormatError` on a wrong magic, a header cut short, a header
    checksum mismatch, an unsupported format version or a malformed header.
    """
    view = _bytes_view(blob)
    size = len(view)
    if size < _FIXED.size or bytes(view[:4]) != MAGIC:
        raise CheckpointFormatError("not a ckptpilot codec blob (bad magic or too short)")
    _, version, json_len = _FIXED.unpack_from(view)
    count_at = _FIXED.size + json_len
    if count_at + _COUNT.size > size:
        raise CheckpointFormatError(f"codec blob truncated in its header ({size} bytes)")
    (count,) = _COUNT.unpack_from(view, count_at)
    entry = _ENTRIES.get(version)
    if entry is None:
        raise CheckpointFormatError(
            f"codec blob format version {version} is not supported (this ckptpilot reads "
            f"versions {', '.join(map(str, _ENTRIES))}); upgrade ckptpilot"
        )
    crc_at = count_at + _COUNT.size + count * entry.size
    if crc_at + _CRC.size > size:
        raise CheckpointFormatError(f"codec blob truncated in its header ({size} bytes)")
    (header_crc,) = _CRC.unpack_from(view, crc_at)
    if zlib.crc32(view[:crc_at]) != header_crc:
        raise CheckpointFormatError("codec blob header checksum mismatch (corrupted header)")
    codec, dtype, shape, nbytes, params = _parse_header(bytes(view[_FIXED.size : count_at]))
    sections = tuple(
        entry.unpack_from(view, count_at + _COUNT.size + i * entry.size) for i in range(count)
    )
    return BlobHeader(codec, dtype, shape, nbytes, params, crc_at + _CRC.size, sections, version)


def parse_blob(blob: Buffer) -> Frame:
    """Parse and check a whole blob's header and layout; sections are checked when read.

    Raises :class:`CheckpointFormatError` as :func:`read_header` does, and when the blob is
    truncated or followed by trailing bytes.
    """
    view = _bytes_view(blob)
    head = read_header(view)
    if head.blob_bytes != len(view):
        state = "truncated" if head.blob_bytes > len(view) else "followed by trailing bytes"
        raise CheckpointFormatError(
            f"{head.codec} blob is {state}: its header describes {head.blob_bytes} bytes, "
            f"got {len(view)}"
        )
    table = []
    offset = head.header_bytes
    for length, checksum in head.sections:
        table.append((offset, length, checksum))
        offset += length
    return Frame(head.codec, head.dtype, head.shape, head.nbytes, head.params, view,
                 tuple(table), _CHECKSUMS[head.version])


def _bytes_view(blob: Buffer) -> memoryview:
    view = memoryview(blob)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def tensor_nbytes(shape: object, dtype: torch.dtype, what: str) -> int:
    """The byte size of a tensor of ``shape`` (a list of ints from a header) and ``dtype``;
    :class:`CheckpointFormatError` naming ``what`` unless the shape is a list of at most
    ``MAX_NDIM`` non-negative ints describing at most ``MAX_TENSOR_BYTES`` bytes."""
    return shape_nbytes(shape, dtype.itemsize, what)


def _parse_header(text: bytes) -> tuple[str, torch.dtype, tuple[int, ...], int, dict[str, Any]]:
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, a number too long
        raise CheckpointFormatError(f"codec blob header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointFormatError("codec blob header is not a JSON object")
    codec, dtype_name = header.get("codec"), header.get("dtype")
    shape, nbytes, params = header.get("shape"), header.get("nbytes"), header.get("params")
    if (
        not isinstance(codec, str)
        or not isinstance(dtype_name, str)
        or dtype_name not in DTYPES
        or not isinstance(params, dict)
    ):
        raise CheckpointFormatError(f"codec blob header is malformed: {header!r:.200}")
    dtype = DTYPES[dtype_name]
    expected = tensor_nbytes(shape, dtype, "codec blob header")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes != expected:
        raise CheckpointFormatError(
            f"codec blob header: nbytes {nbytes!r:.40} does not match shape {shape} of "
            f"{dtype_name}"
        )
    return codec, dtype, tuple(shape), nbytes, params
