"""The ``byteplane`` codec: split elements into byte planes, zstd only the planes that pay.

Owns: the plane split, the per-plane raw/zstd decision, and the chunked, multi-threaded plane
coding that ``xor_delta`` and ``prefix_index`` reuse (:func:`encode_planes`,
:func:`decode_planes`). Must not: interpret the bytes (deltas and indexes are the callers'
business) or touch devices (it works on host NumPy views).

Float mantissa bytes are noise; the sign/exponent byte carries the redundancy (issue 5). So the
decision is made per plane on a sample (16 stripes spread over the tensor, 16 Ki elements in
all): a plane is zstd-coded (literals or match profile, see ``entropy``) when the sample shrinks
by more than ``min_plane_ratio``, else it is copied. Neighbouring raw planes are kept together
as aligned little-endian words of 2, 4 or 8 bytes, so splitting them off costs one pass instead
of one per byte; splitting and joining are whole-word passes over cache-sized blocks (``lanes``).

Header params: ``{"chunk": C, "segments": [[lo, width, mode], ...]}``. The element bytes
``[lo, lo + width)`` form a segment; ``mode`` is ``"zstd"`` (width 1, one byte plane) or
``"raw"`` (width 1, 2, 4 or 8 with ``lo % width == 0``); segments tile the element in order.
Elements are cut into chunks of C elements; sections are chunk-major: for each chunk, for each
segment, either the chunk's segment words (raw) or one zstd frame of its plane bytes. Chunks
are coded and decoded independently, in parallel, while they are hot in the cache.
``expplane`` adds ``"rotated"`` to these params (``encode_planes``' ``rotate``).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from ckptpilot.codecs.base import (
    CodecParamError,
    LevelThreadsCodec,
    check_positive,
    parallel_map,
    resolve_threads,
    tensor_bytes,
    word_runs,
)
from ckptpilot.codecs.blob import Frame, Section
from ckptpilot.codecs.entropy import (
    Compressor,
    check_payload,
    compressor,
    decompress_into,
    literal_compressor,
)
from ckptpilot.codecs.lanes import Workspace, join, rotate_sign, split, words
from ckptpilot.codecs.registry import register_codec
from ckptpilot.errors import CheckpointFormatError

CHUNK_BYTES = 4 << 20
SAMPLE_ELEMENTS = 1 << 14
SAMPLE_STRIPES = 16
MIN_PLANE_RATIO = 1.2
MATCH_GAIN = 1.25
PLANE_BYTES_PER_S = 1.2e9
"""Encode speed of a plane byte with the literals profile on one core, taken from near the low
end of that profile's column in the per-plane table of bench/RESULTS.md (codecs.py)."""
RAW, ZSTD = "raw", "zstd"

Segment = tuple[int, int, str]
Plan = tuple[int, int, str, int | None]  # a segment and the index of its coder


def _sample(matrix: np.ndarray) -> np.ndarray:
    rows = len(matrix)
    if rows <= SAMPLE_ELEMENTS:
        return matrix
    stripe = SAMPLE_ELEMENTS // SAMPLE_STRIPES
    starts = np.linspace(0, rows - stripe, SAMPLE_STRIPES).astype(np.int64)
    return np.concatenate([matrix[s : s + stripe] for s in starts])


def _plane_coders(level: int) -> list[Compressor]:
    """The coders a plane may get: literals then matches (level 1), else zstd at ``level``."""
    return [literal_compressor(), compressor(1)] if level == 1 else [compressor(level)]


def paying_plane_ratio(bandwidth_bytes_per_s: float) -> float:
    """The smallest plane ratio worth coding for a tier of this bandwidth.

    Coding a plane of B bytes to ratio r saves B (1 - 1/r) / bandwidth of transfer and costs
    B / ``PLANE_BYTES_PER_S`` (the literals profile) of encoding: it pays when
    r > 1 / (1 - bandwidth / PLANE_BYTES_PER_S). Planes that take the match profile cost more
    than this assumes (it is the slower one: bench/RESULTS.md, codecs.py, per-plane table);
    they are the compressible ones (ratio ≫ 1.2), which pay anyway.
    Capped at ``MIN_PLANE_RATIO``: an exponent plane (ratio 2-7) is always worth its time next
    to the rest of the tensor, and whether coding pays at all is ``auto``'s whole-tensor
    decision; floored at 1.01.
    """
    if bandwidth_bytes_per_s >= PLANE_BYTES_PER_S:
        return MIN_PLANE_RATIO
    return min(MIN_PLANE_RATIO, max(1.01, 1 / (1 - bandwidth_bytes_per_s / PLANE_BYTES_PER_S)))


def pick_coder(nbytes: int, sizes: list[int], min_ratio: float) -> int | None:
    """Which coder (an index into ``sizes``, literals first) a plane of ``nbytes`` sample bytes
    gets, given the sizes the coders shrank it to; ``None``: none pays, copy it raw."""
    pays = [nbytes > min_ratio * size for size in sizes]
    if not any(pays):
        return None
    if len(sizes) > 1 and pays[1] and (not pays[0] or sizes[1] * MATCH_GAIN < sizes[0]):
        return 1
    return 0


def plan_segments(sample: np.ndarray, level: int, min_ratio: float) -> list[Plan]:
    """Decide per byte plane of the ``(rows, itemsize)`` sample, then group the raw planes.

    A plane is coded when a coder shrinks the sample by more than ``min_ratio``: the literals
    profile when it does, unless matches shrink the plane ``MATCH_GAIN`` times more (they cost
    two to three times the time: runs of zeros in deltas of frozen tensors, counters).
    """
    itemsize = sample.shape[1]
    coders = _plane_coders(level)
    picks: list[int | None] = []
    for plane in range(itemsize):
        data = np.ascontiguousarray(sample[:, plane])
        sizes = [len(coder.compress(data)) for coder in coders] if data.size else []
        picks.append(pick_coder(data.size, sizes, min_ratio))
    plans: list[Plan] = []
    lo = 0
    while lo < itemsize:
        pick = picks[lo]
        if pick is not None:
            plans.append((lo, 1, ZSTD, pick))
            lo += 1
            continue
        hi = next((p for p in range(lo, itemsize) if picks[p] is not None), itemsize)
        plans.extend((start, width, RAW, None) for start, width in word_runs(lo, hi, itemsize))
        lo = hi
    return plans


def encode_planes(
    flat: np.ndarray,
    itemsize: int,
    level: int,
    threads: int,
    xor_with: np.ndarray | None = None,
    min_ratio: float = MIN_PLANE_RATIO,
    rotate: bool | None = None,
) -> tuple[dict[str, Any], list[Section]]:
    """Header params and sections for the uint8 array ``flat`` of ``itemsize``-byte elements.

    With ``xor_with`` (an array like ``flat``) the planes of ``flat XOR xor_with`` are coded;
    the XOR is taken block by block as the lanes are split (``lanes.split``). With ``rotate``
    (2-byte elements or wider) those of the sign-rotated elements (``lanes.rotate_sign``),
    unless no plane of them pays, and the params say which (``"rotated"``); with ``None``
    (the default) the params have no ``"rotated"``.
    """
    n = flat.size // itemsize
    sample = _sample(flat.reshape(n, itemsize))
    if xor_with is not None:
        sample = sample ^ _sample(xor_with.reshape(n, itemsize))
    rotated = False
    if rotate:
        sample_words = words(np.ascontiguousarray(sample).reshape(-1), itemsize)
        turned = rotate_sign(sample_words, np.empty_like(sample_words),
                             np.empty_like(sample_words))
        plans = plan_segments(turned.view(np.uint8).reshape(-1, itemsize), level, min_ratio)
        rotated = any(mode == ZSTD for _, _, mode, _ in plans)
    if not rotated:
        plans = plan_segments(sample, level, min_ratio)
    chunk = max(1, CHUNK_BYTES // itemsize)
    # Raw lanes become sections, so each gets one (huge-page backed) buffer for the whole
    # tensor, filled chunk by chunk by the workers; a lane that is the whole element is
    # already contiguous (without a base). Coded planes only pass through per-chunk scratch.
    whole = xor_with is None and [plan[1:3] for plan in plans] == [(itemsize, RAW)]
    buffers = [
        np.empty(n, f"<u{width}") if mode == RAW and not whole else None
        for _, width, mode, _ in plans
    ]

    local = threading.local()  # a Workspace per worker thread, reused by its chunks

    def encode_chunk(start: int) -> list[Section]:
        stop = min(n, start + chunk)
        span = slice(start * itemsize, stop * itemsize)
        if whole:
            return [Section.of(flat[span])]
        work = _workspace(local)
        outs = [
            buffer[start:stop] if buffer is not None else work.get(f"plane{lo}", 1, stop - start)
            for (lo, _, _, _), buffer in zip(plans, buffers, strict=True)
        ]
        base = None if xor_with is None else xor_with[span]
        lanes = [(lo, width, out) for (lo, width, _, _), out in zip(plans, outs, strict=True)]
        split(flat[span], itemsize, lanes, work, base, rotated)
        coders = _plane_coders(level)
        return [
            Section.of(out if mode == RAW else coders[pick].compress(out))
            for (_, _, mode, pick), out in zip(plans, outs, strict=True)
        ]

    per_chunk = parallel_map(encode_chunk, range(0, n, chunk), threads)
    params: dict[str, Any] = {
        "chunk": chunk, "segments": [[lo, width, mode] for lo, width, mode, _ in plans]
    }
    if rotate is not None:
        params["rotated"] = rotated
    return params, [section for sections in per_chunk for section in sections]


def decode_planes(
    frame: Frame, threads: int, xor_with: np.ndarray | None = None, rotated: bool = False
) -> np.ndarray:
    """Rebuild the raw bytes from a frame written by :func:`encode_planes` (rotated back when
    its planes are of sign-rotated elements, ``rotated``; then XOR-ed with ``xor_with`` block
    by block, while in the cache, when it is given)."""
    itemsize, n = frame.itemsize, frame.numel
    chunk = frame.param("chunk", int, lo=1)
    segments = _check_segments(frame, frame.param("segments", list), itemsize)
    n_chunks = -(-n // chunk)
    frame.expect_sections(n_chunks * len(segments))  # first: it bounds the list below
    check_payload(frame, [
        ((min(n, start + chunk) - start) * width, mode == ZSTD)
        for start in range(0, n, chunk)
        for _, width, mode in segments
    ])
    out = np.empty(frame.nbytes, np.uint8)
    local = threading.local()  # a Workspace per worker thread, reused by its chunks

    def decode_chunk(index: int) -> None:
        start = index * chunk
        stop = min(n, start + chunk)
        span = out[start * itemsize : stop * itemsize]
        base = None if xor_with is None else xor_with[start * itemsize : stop * itemsize]
        work = _workspace(local)
        lanes = []
        for s, (lo, width, mode) in enumerate(segments):
            number = index * len(segments) + s
            data = frame.section(number)
            if mode == RAW:  # its size was checked before anything was allocated
                lanes.append((lo, width, np.frombuffer(data, f"<u{width}")))
                continue
            # A zstd plane that is the whole (one-byte) element needs no join without a base.
            dest = span if width == itemsize and base is None else work.get(
                f"plane{lo}", 1, stop - start)
            decompress_into(data, dest, f"{frame.codec} blob, section {number}")
            lanes.append((lo, width, dest))
        if len(lanes) == 1 and lanes[0][2] is span:
            return
        join(span, itemsize, lanes, work, base, rotated)

    parallel_map(decode_chunk, range(n_chunks), threads)
    return out


def _workspace(local: threading.local) -> Workspace:
    work = getattr(local, "work", None)
    if work is None:
        work = local.work = Workspace()
    return work


def _check_segments(frame: Frame, raw: list[Any], itemsize: int) -> list[Segment]:
    segments: list[Segment] = []
    expect = 0
    for item in raw:
        ok = (
            isinstance(item, list)
            and len(item) == 3
            and all(type(v) is int for v in item[:2])  # not bool, not float
        )
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


class PlaneCodec(LevelThreadsCodec):
    """A byte-plane codec: ``level`` and ``threads`` as for zstd, plus ``min_plane_ratio``.

    ``min_plane_ratio`` (>= 1): a plane is coded only when its sample shrinks by more than this.
    The default (1.2) codes the sign/exponent planes (ratio 2-7 on trained tensors) and leaves
    the mantissa-like planes of deltas (1.09-1.12) raw: coding those slows encode and decode far
    more than the few percent of bytes they save is worth on a fast tier (bench/RESULTS.md,
    codecs.py: the ``xor_delta`` rows against ``xor_delta@50MB/s``). Only slow tiers gain, and
    for them :func:`paying_plane_ratio` gives the threshold, which ``auto`` and the pulse writer
    use to lower it; the peer tier keeps the default.
    """

    def __init__(
        self, *, level: int = 1, threads: int = 0, min_plane_ratio: float = MIN_PLANE_RATIO
    ) -> None:
        super().__init__(level=level, threads=threads)
        ratio = check_positive(self.codec_id, "min_plane_ratio", min_plane_ratio)
        if ratio < 1:
            raise CodecParamError(
                f"{self.codec_id}: min_plane_ratio must be >= 1, got {min_plane_ratio!r}"
            )
        self.min_plane_ratio = ratio

    @property
    def config(self) -> dict[str, Any]:
        return {**super().config, "min_plane_ratio": self.min_plane_ratio}


@register_codec
class BytePlaneCodec(PlaneCodec):
    """Byte planes; zstd (see :class:`PlaneCodec`) on the planes that pay, the rest copied.

    ``threads`` (0 = all cores) code chunks of big tensors in parallel.
    """

    codec_id = "byteplane"

    def _encode(
        self, tensor: torch.Tensor, base: torch.Tensor | None
    ) -> tuple[dict[str, Any], list[Section]]:
        flat = tensor_bytes(tensor)
        threads = resolve_threads(self.threads)
        return encode_planes(
            flat, tensor.dtype.itemsize, self.level, threads, min_ratio=self.min_plane_ratio
        )

    def _decode(self, frame: Frame, base: torch.Tensor | None) -> np.ndarray:
        return decode_planes(frame, resolve_threads(self.threads))
