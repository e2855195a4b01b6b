"""The codec container's frame (file header, trailer, index), read and checked without torch.

Owns: the frame's byte layout and its checks (magics, crc32s, where every blob and the meta
section lie, that each entry's size matches its shape and dtype). Must not: decode blobs or
hash tensors — ``ckptpilot.codecs.container`` does, with torch, and documents the whole
layout. It imports no torch so that the load-test worker's default mode, which reads only
headers, indexes and JSON, runs without it (``validation.loadcheck``).
"""

from __future__ import annotations

import io
import json
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

from ckptpilot.errors import CheckpointFormatError

FORMAT = "ckptpilot-container"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sHH")  # magic, version, flags; then its crc32
TRAILER = struct.Struct("<8sQQI")  # magic, index offset, length, crc32; then its crc32
CRC = struct.Struct("<I")
HEADER_MAGIC = b"CKPTCONT"
TRAILER_MAGIC = b"CKPTTAIL"
HEADER_SIZE = HEADER.size + CRC.size
TRAILER_SIZE = TRAILER.size + CRC.size

MAX_NDIM = 64
"""The most dimensions a tensor may have (NumPy's limit)."""
MAX_TENSOR_BYTES = 1 << 48
"""The largest tensor a blob may describe (256 TiB): far beyond any real tensor, small enough
that sizes stay exact in 64-bit arithmetic."""

ITEM_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8,
    "complex128": 16, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8,
    "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
"""Bytes per element of every dtype name a blob may carry (``codecs.blob.DTYPES`` maps the
same names to torch dtypes; a test keeps the two in step)."""

SAFETENSORS_NAMES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "uint16": "U16", "uint32": "U32", "uint64": "U64", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
"""The safetensors name of each dtype name a checkpoint can store: layouts are compared in
these names, whatever the file kind (``tiers.remote.archive.safetensors_dtype`` for torch
dtypes)."""

_T = TypeVar("_T")


@dataclass(frozen=True)
class IndexEntry:
    """One tensor's index entry as the file says it (``dtype`` is its name)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    codec: str
    params: dict[str, Any]
    raw_bytes: int
    encoded_bytes: int
    sha256: str
    offset: int


@dataclass(frozen=True)
class IndexLayout:
    """A container's index, checked: its entries in file order and where the meta lies."""

    entries: tuple[IndexEntry, ...]
    meta_offset: int
    meta_length: int
    meta_sha256: str


def sealed(fields: bytes) -> bytes:
    """``fields`` followed by their crc32 (the file header and the trailer)."""
    return fields + CRC.pack(zlib.crc32(fields))


def shape_nbytes(shape: object, item_bytes: int, what: str) -> int:
    """The byte size of a tensor of ``shape`` (a list of ints from a header) with elements of
    ``item_bytes``; :class:`CheckpointFormatError` naming ``what`` unless the shape is a list
    of at most :data:`MAX_NDIM` non-negative ints describing at most :data:`MAX_TENSOR_BYTES`."""
    if (
        not isinstance(shape, list | tuple)
        or len(shape) > MAX_NDIM
        or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_TENSOR_BYTES
            for d in shape
        )
    ):
        raise CheckpointFormatError(
            f"{what} has a bad shape {shape!r:.200} (expected at most {MAX_NDIM} "
            "non-negative integers)"
        )
    nbytes = math.prod(shape) * item_bytes
    if nbytes > MAX_TENSOR_BYTES:
        raise CheckpointFormatError(
            f"{what} describes a tensor of {nbytes} bytes (shape {list(shape)}), "
            f"more than the {MAX_TENSOR_BYTES} a checkpoint tensor may have"
        )
    return nbytes


def read_layout(fileobj: BinaryIO) -> IndexLayout:
    """Read and check the header, trailer and index of a container (a seekable file)."""
    size = fileobj.seek(0, io.SEEK_END)
    if size < HEADER_SIZE + TRAILER_SIZE:
        raise CheckpointFormatError(f"container truncated: {size} bytes, no room for a trailer")
    header = read_exactly(fileobj, 0, HEADER_SIZE, "header")
    magic, version, flags = HEADER.unpack_from(header)
    if magic != HEADER_MAGIC:
        raise CheckpointFormatError("not a ckptpilot container (bad magic in the header)")
    if sealed(header[: HEADER.size]) != header:
        raise CheckpointFormatError("container header checksum mismatch")
    if version != FORMAT_VERSION or flags:
        raise CheckpointFormatError(
            f"container format version {version} (flags {flags}) is not supported; this "
            f"ckptpilot reads version {FORMAT_VERSION}: upgrade ckptpilot"
        )
    trailer = read_exactly(fileobj, size - TRAILER_SIZE, TRAILER_SIZE, "trailer")
    magic, index_offset, index_length, index_crc = TRAILER.unpack_from(trailer)
    if magic != TRAILER_MAGIC or sealed(trailer[: TRAILER.size]) != trailer:
        raise CheckpointFormatError(
            "container trailer missing or corrupt (the write did not finish, or the file was "
            "truncated or damaged)"
        )
    if index_offset + index_length != size - TRAILER_SIZE or index_offset < HEADER_SIZE:
        raise CheckpointFormatError("container trailer points outside the file")
    index_bytes = read_exactly(fileobj, index_offset, index_length, "index")
    if zlib.crc32(index_bytes) != index_crc:
        raise CheckpointFormatError("container index checksum mismatch")
    try:
        return _parse_index(json.loads(index_bytes), index_offset)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        raise CheckpointFormatError(f"container index is malformed: {exc}") from exc


def read_exactly(fileobj: BinaryIO, offset: int, length: int, what: str) -> bytes:
    """``length`` bytes at ``offset``; a short file is the format error naming ``what``."""
    fileobj.seek(offset)
    parts: list[bytes] = []
    left = length
    while left:
        got = fileobj.read(left)
        if not got:
            raise CheckpointFormatError(f"container truncated in {what}")
        parts.append(got)
        left -= len(got)
    return b"".join(parts)


def _parse_index(data: dict[str, Any], index_offset: int) -> IndexLayout:
    if data.get("format") != FORMAT or data.get("version") != FORMAT_VERSION:
        raise ValueError(f"format {data.get('format')!r} version {data.get('version')!r}")
    entries, names = [], set()
    offset = HEADER_SIZE
    for item in data["tensors"]:
        name, dtype_name = _typed(item["name"], str), _typed(item["dtype"], str)
        if dtype_name not in ITEM_BYTES:
            raise ValueError(f"entry {name!r} has an unknown dtype {dtype_name!r}")
        nbytes = shape_nbytes(item["shape"], ITEM_BYTES[dtype_name], f"entry {name!r}")
        entry = IndexEntry(
            name=name,
            dtype=dtype_name,
            shape=tuple(item["shape"]),
            codec=_typed(item["codec"], str),
            params=_typed(item["params"], dict),
            raw_bytes=_typed(item["raw_bytes"], int),
            encoded_bytes=_typed(item["encoded_bytes"], int),
            sha256=_typed(item["sha256"], str),
            offset=_typed(item["offset"], int),
        )
        if entry.name in names or entry.offset != offset or entry.encoded_bytes < 0:
            raise ValueError(f"entry {entry.name!r} is duplicated or misplaced")
        if entry.raw_bytes != nbytes:
            raise ValueError(f"entry {entry.name!r} says raw_bytes {entry.raw_bytes}, but its "
                             f"shape {list(entry.shape)} of {dtype_name} has {nbytes}")
        names.add(entry.name)
        entries.append(entry)
        offset += entry.encoded_bytes
    meta = data["meta"]
    length = _typed(meta["length"], int)
    if _typed(meta["offset"], int) != offset or length < 0 or offset + length != index_offset:
        raise ValueError("the meta section is misplaced")
    return IndexLayout(tuple(entries), offset, length, _typed(meta["sha256"], str))


def _typed(value: Any, kind: type[_T]) -> _T:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"expected {kind.__name__}, got {value!r}")
    return value
