"""The container: a whole training state (tensors + JSON metadata) as one pickle-free stream.

Owns: the layout of a state on disk or on the wire, the streaming writer (encoding tensor i on
a worker thread while tensor i-1 is written) and the verifying reader. Must not: choose codecs
(the caller's ``codec_for`` does), know paths, tiers or durability (it gets a file object;
fsync and atomic publication are the tier's job), or unpickle anything.

Layout, format version 1 (integers little-endian)::

    file header, 16 bytes: magic b"CKPTCONT", version (u16) = 1, flags (u16) = 0,
                           crc32 of the 12 bytes before
    tensor blobs, back to back, in index order (codec blobs: see ``ckptpilot.codecs.blob``)
    meta section: the non-tensor state as UTF-8 JSON
    index: UTF-8 JSON {"format": "ckptpilot-container", "version": 1,
           "meta": {"offset", "length", "sha256"},
           "tensors": [{"name", "dtype", "shape", "codec", "params", "raw_bytes",
                        "encoded_bytes", "sha256" (of the raw bytes), "offset"}, ...]}
    trailer, 32 bytes: magic b"CKPTTAIL", index offset (u64), index length (u64),
                       crc32 of the index (u32), crc32 of the 28 trailer bytes before (u32)

The index is written last, so a stream cut short has no valid trailer and is rejected as a
whole. Encoding works on batches (one tensor, or consecutive small ones up to 4 MiB) with at
most two in flight, so the writer's memory stays bounded by the largest tensor (or 4 MiB), not
by the state; the reader returns the whole state, so it holds that. Reading needs a seekable
file; it checks the trailer, index and each blob's checksums, the header of every
blob against its index entry, and the SHA256 of every decoded tensor, and returns nothing
unless everything holds.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

import numpy as np
import torch

from ckptpilot.codecs.base import Codec, tensor_bytes
from ckptpilot.codecs.blob import DTYPE_NAMES, DTYPES, Buffer, read_header
from ckptpilot.codecs.registry import decode_blob
from ckptpilot.errors import CheckpointFormatError, IntegrityError
from ckptpilot.format.container_index import (
    FORMAT,
    FORMAT_VERSION,
    HEADER,
    HEADER_MAGIC,
    TRAILER,
    TRAILER_MAGIC,
    read_exactly,
    read_layout,
    sealed,
)

_IN_FLIGHT = 2
# Tensors go to the worker threads in batches of about this many bytes, and only a tensor of
# at least _OVERLAP_BYTES has its SHA256 on a thread of its own: a thread hand-off costs tens
# of microseconds, more than encoding or hashing a small tensor (states hold many of those).
_BATCH_BYTES = 4 << 20
_OVERLAP_BYTES = 1 << 20

CodecFor = Callable[[str, torch.Tensor], tuple[Codec, torch.Tensor | None]]
"""``codec_for(name, tensor) -> (codec, base)``: how to encode each tensor (base may be None)."""

_T = TypeVar("_T")
_R = TypeVar("_R")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's index entry; ``codec``/``params`` are the blob's (``auto`` resolved)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    codec: str
    params: dict[str, Any]
    raw_bytes: int
    encoded_bytes: int
    sha256: str
    offset: int

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": DTYPE_NAMES[self.dtype],
            "shape": list(self.shape),
            "codec": self.codec,
            "params": self.params,
            "raw_bytes": self.raw_bytes,
            "encoded_bytes": self.encoded_bytes,
            "sha256": self.sha256,
            "offset": self.offset,
        }


@dataclass(frozen=True)
class ContainerIndex:
    """The index of a container: its tensors in file order and where the meta section lies."""

    tensors: tuple[TensorEntry, ...]
    meta_offset: int
    meta_length: int
    meta_sha256: str

    @property
    def raw_bytes(self) -> int:
        return sum(entry.raw_bytes for entry in self.tensors)

    @property
    def encoded_bytes(self) -> int:
        return sum(entry.encoded_bytes for entry in self.tensors)


def write_container(
    fileobj: BinaryIO,
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    codec_for: CodecFor,
) -> ContainerIndex:
    """Encode and write a training state to ``fileobj`` (only ``write`` is needed).

    Tensors are encoded one at a time on a worker thread, overlapping the write of the
    previous one; each tensor's SHA256 runs on another thread, overlapping its encode.
    ``meta`` must be JSON-serialisable (tuples come back as lists, keys as strings). Returns
    the index that was written.
    """
    try:
        meta_bytes = json.dumps(dict(meta), allow_nan=True).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"container meta is not JSON-serialisable: {exc}") from exc
    out = _Writer(fileobj)
    out.write(sealed(HEADER.pack(HEADER_MAGIC, FORMAT_VERSION, 0)))
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptpilot-sha256") as hasher:

        def encode(item: tuple[str, torch.Tensor]) -> tuple[str, list[Buffer], str]:
            name, tensor = item
            if not isinstance(name, str):
                raise TypeError(f"tensor names must be strings, got {name!r}")
            small = tensor.numel() * tensor.element_size() < _OVERLAP_BYTES
            digest = None if small else hasher.submit(_sha256, tensor)
            codec, base = codec_for(name, tensor)
            try:
                parts = codec.encode_parts(tensor, base)
            except ValueError as exc:
                raise ValueError(f"tensor {name!r}: {exc}") from exc
            return name, parts, _sha256(tensor) if digest is None else digest.result()

        def encode_batch(batch: list[tuple[str, torch.Tensor]]
                         ) -> list[tuple[str, list[Buffer], str]]:
            return [encode(item) for item in batch]

        entries = tuple(_write_blob(out, *item)
                        for done in _pipelined(encode_batch, _batched(
                            tensors.items(), lambda kv: kv[1].numel() * kv[1].element_size()))
                        for item in done)
    meta_offset = out.offset
    out.write(meta_bytes)
    index = ContainerIndex(
        entries, meta_offset, len(meta_bytes), hashlib.sha256(meta_bytes).hexdigest()
    )
    index_bytes = json.dumps(
        {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "meta": {"offset": meta_offset, "length": len(meta_bytes), "sha256": index.meta_sha256},
            "tensors": [entry.to_json() for entry in entries],
        }
    ).encode()
    index_offset = out.offset
    out.write(index_bytes)
    crc = zlib.crc32(index_bytes)
    out.write(sealed(TRAILER.pack(TRAILER_MAGIC, index_offset, len(index_bytes), crc)))
    return index


def _write_blob(out: _Writer, name: str, parts: list[Buffer], digest: str) -> TensorEntry:
    head = read_header(parts[0])
    offset = out.offset
    for part in parts:
        out.write(part)
    return TensorEntry(
        name=name,
        dtype=head.dtype,
        shape=head.shape,
        codec=head.codec,
        params=head.params,
        raw_bytes=head.nbytes,
        encoded_bytes=out.offset - offset,
        sha256=digest,
        offset=offset,
    )


def _sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(tensor)).hexdigest()


def read_index(fileobj: BinaryIO) -> ContainerIndex:
    """Read and check the header, trailer and index of a container (a seekable file)."""
    layout = read_layout(fileobj)
    # The torch-free entry with its dtype name resolved: the same fields, in the same order.
    entries = tuple(TensorEntry(**{**vars(e), "dtype": DTYPES[e.dtype]})
                    for e in layout.entries)
    return ContainerIndex(entries, layout.meta_offset, layout.meta_length, layout.meta_sha256)


def read_container(
    fileobj: BinaryIO,
    bases: Mapping[str, torch.Tensor] | None = None,
    *,
    threads: int = 0,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read, decode and verify a whole container: ``(tensors by name, meta)``.

    ``bases`` maps names to the base tensors of delta-coded entries. Blob i+1 is read while
    blob i is decoded on a worker thread (``threads`` workers inside each decode, 0 = all
    cores). Any damage raises :class:`CheckpointFormatError` naming the tensor, ``meta``,
    ``index`` or ``trailer``; nothing is returned half-loaded.
    """
    index = read_index(fileobj)
    meta_bytes = read_exactly(fileobj, index.meta_offset, index.meta_length, "meta")
    if hashlib.sha256(meta_bytes).hexdigest() != index.meta_sha256:
        raise IntegrityError("meta", index.meta_sha256, hashlib.sha256(meta_bytes).hexdigest())
    try:
        meta = json.loads(meta_bytes)
    except (ValueError, RecursionError) as exc:
        raise CheckpointFormatError(f"container meta is not valid JSON: {exc}") from exc
    if not isinstance(meta, dict):
        raise CheckpointFormatError("container meta is not a JSON object")

    def read(entry: TensorEntry) -> tuple[TensorEntry, np.ndarray]:
        return entry, _read_at(fileobj, entry.offset, entry.encoded_bytes, f"tensor {entry.name!r}")

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptpilot-sha256") as hasher:

        def decode(item: tuple[TensorEntry, np.ndarray]) -> tuple[TensorEntry, torch.Tensor, str]:
            entry, blob = item
            tensor = _decode_entry(entry, blob, bases, threads)
            if entry.raw_bytes < _OVERLAP_BYTES:
                return entry, tensor, _sha256(tensor)
            return entry, tensor, hasher.submit(_sha256, tensor)  # overlaps the next decode

        def decode_batch(batch: list[tuple[TensorEntry, np.ndarray]]
                         ) -> list[tuple[TensorEntry, torch.Tensor, Any]]:
            return [decode(item) for item in batch]

        blobs = _batched((read(entry) for entry in index.tensors), lambda eb: eb[0].raw_bytes)
        decoded = [item for done in _pipelined(decode_batch, blobs) for item in done]
        for entry, _, digest in decoded:
            found = digest if isinstance(digest, str) else digest.result()
            if found != entry.sha256:
                raise IntegrityError(f"tensor {entry.name!r}", entry.sha256, found)
    return {entry.name: tensor for entry, tensor, _ in decoded}, meta


def _decode_entry(
    entry: TensorEntry, blob: np.ndarray, bases: Mapping[str, torch.Tensor] | None, threads: int
) -> torch.Tensor:
    where = f"tensor {entry.name!r}"
    base = None if bases is None else bases.get(entry.name)
    try:
        head = read_header(blob)
        found = (head.codec, head.dtype, head.shape)
        if found != (entry.codec, entry.dtype, entry.shape):
            raise CheckpointFormatError(f"blob header {found} does not match the index entry")
        tensor = decode_blob(blob, base, threads=threads)
    except CheckpointFormatError as exc:
        raise CheckpointFormatError(f"{where}: {exc}") from exc
    except ValueError as exc:
        hint = " (pass its base in bases=)" if base is None and entry.codec == "xor_delta" else ""
        raise ValueError(f"{where}: {exc}{hint}") from exc
    return tensor


def _read_at(fileobj: BinaryIO, offset: int, length: int, what: str) -> np.ndarray:
    """``length`` bytes at ``offset`` into a fresh (huge-page backed) array."""
    fileobj.seek(offset)
    out = np.empty(length, np.uint8)
    view = memoryview(out)
    filled = 0
    while filled < length:
        got = fileobj.readinto(view[filled:])
        if not got:
            raise CheckpointFormatError(f"container truncated in {what}")
        filled += got
    return out


class _Writer:
    """Tracks the offset; loops over short writes of raw (unbuffered) streams."""

    def __init__(self, fileobj: BinaryIO) -> None:
        self._file = fileobj
        self.offset = 0

    def write(self, data: Buffer) -> None:
        view = memoryview(data)
        view = view if view.format == "B" and view.ndim == 1 else view.cast("B")
        while view:
            written = self._file.write(view)
            if written is None:
                raise OSError("the container stream is non-blocking and not ready for writing")
            view = view[written:]
            self.offset += written


def _batched(items: Iterable[_T], nbytes: Callable[[_T], int]) -> Iterator[list[_T]]:
    """Consecutive items in lists of about ``_BATCH_BYTES`` (as ``nbytes`` counts them)."""
    batch: list[_T] = []
    size = 0
    for item in items:
        batch.append(item)
        size += nbytes(item)
        if size >= _BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _pipelined(fn: Callable[[_T], _R], items: Iterable[_T]) -> Iterable[_R]:
    """``fn`` over ``items`` on one worker thread, at most ``_IN_FLIGHT`` results ahead."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptpilot-container") as pool:
        pending: deque[Future[_R]] = deque()
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= _IN_FLIGHT:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
