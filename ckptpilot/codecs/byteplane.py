"""The ``byteplane`` codec: split elements into byte planes, zstd only the planes that pay.

Owns: the plane split, the per-plane raw/zstd decision, and the chunked, multi-threaded plane
coding that ``xor_delta`` and ``prefix_index`` reuse (:func:`encode_planes`,
:func:`decode_planes`). Must not: interpret the bytes (deltas and indexes are the callers'
business) or touch devices (it works on host NumPy views).

Float mantissa bytes are noise; the sign/exponent byte carries the redundancy (issue 5). So the
decision is made per plane on a sample (16 stripes spread over the tensor, 16 Ki elements in
all): a plane is zstd-coded when the sample shrinks by more than ``MIN_PLANE_RATIO``, else it
is copied. Neighbouring raw planes are kept together as aligned little-endian words of 2, 4 or
8 bytes, so copying them costs one strided copy instead of one per byte.

Header params: ``{"chunk": C, "segments": [[lo, width, mode], ...]}``. The element bytes
``[lo, lo + width)`` form a segment; ``mode`` is ``"zstd"`` (width 1, one byte plane) or
``"raw"`` (width 1, 2, 4 or 8 with ``lo % width == 0``); segments tile the element in order.
Elements are cut into chunks of C elements; sections are chunk-major: for each chunk, for each
segment, either the chunk's segment words (raw) or one zstd frame of its plane bytes. Chunks
are coded and decoded independently, in parallel, while they are hot in the cache.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ckptpilot.codecs.base import (
    LevelThreadsCodec,
    lane,
    parallel_map,
    resolve_threads,
    tensor_bytes,
    word_runs,
)
from ckptpilot.codecs.blob import Frame, Section
from ckptpilot.codecs.entropy import compressor, decompress_into
from ckptpilot.codecs.registry import register_codec
from ckptpilot.errors import CheckpointFormatError

CHUNK_BYTES = 4 << 20
SAMPLE_ELEMENTS = 1 << 14
SAMPLE_STRIPES = 16
MIN_PLANE_RATIO = 1.05
RAW, ZSTD = "raw", "zstd"

Segment = tuple[int, int, str]


def _sample(matrix: np.ndarray) -> np.ndarray:
    rows = len(matrix)
    if rows <= SAMPLE_ELEMENTS:
        return matrix
    stripe = SAMPLE_ELEMENTS // SAMPLE_STRIPES
    starts = np.linspace(0, rows - stripe, SAMPLE_STRIPES).astype(np.int64)
    return np.concatenate([matrix[s : s + stripe] for s in starts])


def plan_segments(sample: np.ndarray, level: int) -> list[Segment]:
    """Decide per byte plane of the ``(rows, itemsize)`` sample, then group the raw planes."""
    itemsize = sample.shape[1]
    zc = compressor(level)
    packs = []
    for plane in range(itemsize):
        data = np.ascontiguousarray(sample[:, plane])
        packs.append(data.size > 0 and data.size > MIN_PLANE_RATIO * len(zc.compress(data)))
    segments: list[Segment] = []
    lo = 0
    while lo < itemsize:
        if packs[lo]:
            segments.append((lo, 1, ZSTD))
            lo += 1
            continue
        hi = next((p for p in range(lo, itemsize) if packs[p]), itemsize)
        segments.extend((start, width, RAW) for start, width in word_runs(lo, hi, itemsize))
        lo = hi
    return segments


def encode_planes(
    flat: np.ndarray, itemsize: int, level: int, threads: int, xor_with: np.ndarray | None = None
) -> tuple[dict[str, Any], list[Section]]:
    """Header params and sections for the uint8 array ``flat`` of ``itemsize``-byte elements.

    With ``xor_with`` (an array like ``flat``) the planes of ``flat XOR xor_with`` are coded;
    each chunk is XOR-ed just before it is split, while it is in the cache.
    """
    n = flat.size // itemsize
    sample = _sample(flat.reshape(n, itemsize))
    if xor_with is not None:
        sample = sample ^ _sample(xor_with.reshape(n, itemsize))
    segments = plan_segments(sample, level)
    chunk = max(1, CHUNK_BYTES // itemsize)
    # A lane that is the whole element is already contiguous; the others are gathered into
    # one (huge-page backed) buffer each, chunk by chunk, by the workers.
    buffers = [None if width == itemsize else np.empty(n, f"<u{width}") for _, width, _ in segments]

    def encode_chunk(start: int) -> list[Section]:
        stop = min(n, start + chunk)
        data = flat[start * itemsize : stop * itemsize]
        if xor_with is not None:
            data = np.bitwise_xor(data, xor_with[start * itemsize : stop * itemsize])
        zc = compressor(level)
        out = []
        for (lo, width, mode), buffer in zip(segments, buffers, strict=True):
            part = lane(data, itemsize, lo, width)
            if buffer is not None:
                np.copyto(buffer[start:stop], part)
                part = buffer[start:stop]
            out.append(Section.of(zc.compress(part) if mode == ZSTD else part))
        return out

    per_chunk = parallel_map(encode_chunk, range(0, n, chunk), threads)
    params = {"chunk": chunk, "segments": [list(s) for s in segments]}
    return params, [section for sections in per_chunk for section in sections]


def decode_planes(frame: Frame, threads: int, xor_with: np.ndarray | None = None) -> np.ndarray:
    """Rebuild the raw bytes from a frame written by :func:`encode_planes` (XOR-ed with
    ``xor_with`` chunk by chunk, while in the cache, when it is given)."""
    itemsize, n = frame.itemsize, frame.numel
    chunk = frame.param("chunk", int, lo=1)
    segments = _check_segments(frame, frame.param("segments", list), itemsize)
    n_chunks = -(-n // chunk)
    frame.expect_sections(n_chunks * len(segments))
    out = np.empty(frame.nbytes, np.uint8)
    targets = [lane(out, itemsize, lo, width) for lo, width, _ in segments]
    # zstd planes are decompressed into one contiguous scratch plane each, then scattered.
    planes = [
        np.empty(n, np.uint8) if mode == ZSTD and width != itemsize else None
        for _, width, mode in segments
    ]

    def decode_chunk(index: int) -> None:
        start = index * chunk
        stop = min(n, start + chunk)
        for s, ((_, width, mode), target, plane) in enumerate(
            zip(segments, targets, planes, strict=True)
        ):
            number = index * len(segments) + s
            data = frame.section(number)
            part = target[start:stop]
            if mode == ZSTD:
                dest = part if plane is None else plane[start:stop]
                decompress_into(data, dest, f"{frame.codec} blob, section {number}")
                if plane is not None:
                    part[...] = dest
            elif len(data) == (stop - start) * width:
                part[...] = np.frombuffer(data, target.dtype)
            else:
                raise CheckpointFormatError(
                    f"{frame.codec} blob: raw section {number} has {len(data)} bytes, "
                    f"expected {(stop - start) * width}"
                )
        if xor_with is not None:
            span = slice(start * itemsize, stop * itemsize)
            np.bitwise_xor(out[span], xor_with[span], out=out[span])

    parallel_map(decode_chunk, range(n_chunks), threads)
    return out


def _check_segments(frame: Frame, raw: list[Any], itemsize: int) -> list[Segment]:
    segments: list[Segment] = []
    expect = 0
    for item in raw:
        ok = isinstance(item, list) and len(item) == 3
        if ok:
            lo, width, mode = item
            ok = (
                lo == expect
                and width in (1, 2, 4, 8)
                and lo % width == 0
                and itemsize % width == 0
                and (mode == RAW or (mode == ZSTD and width == 1))
            )
        if not ok:
            raise CheckpointFormatError(f"{frame.codec} blob: bad plane segment {item!r}")
        segments.append((lo, width, mode))
        expect = lo + width
    if expect != itemsize:
        raise CheckpointFormatError(f"{frame.codec} blob: plane segments do not cover the element")
    return segments


@register_codec
class BytePlaneCodec(LevelThreadsCodec):
    """Byte planes; zstd at ``level`` (1 = the plane profile) on the planes that compress.

    ``threads`` (0 = all cores) code chunks of big tensors in parallel.
    """

    codec_id = "byteplane"

    def _encode(
        self, tensor: torch.Tensor, base: torch.Tensor | None
    ) -> tuple[dict[str, Any], list[Section]]:
        flat = tensor_bytes(tensor)
        return encode_planes(flat, tensor.dtype.itemsize, self.level, resolve_threads(self.threads))

    def _decode(self, frame: Frame, base: torch.Tensor | None) -> np.ndarray:
        return decode_planes(frame, resolve_threads(self.threads))
