"""Whether a shard travels as a delta, and as which kind: a sample, estimates, a rule.

Owns: the ``blocks`` encoding (both sides: :func:`blocks_payload`, :func:`fold_blocks`),
sampling a shard, estimating how long each way of sending it takes, and the pure rule that
picks one. Must not: send anything or keep measurements (the client measures the wire and
passes its rate in).

Two delta encodings (the DELTA frame's ``encoding``):

- ``blocks``: a bitmap of the shard's :data:`BLOCK_BYTES` blocks that differ from the base,
  then the new bytes of those blocks. Finding them is a compare at memory speed, the payload
  is views of the image (nothing encoded, nothing copied), and the peer's fold is a copy of
  its base with the blocks written over it. It pays wherever whole blocks did not change:
  frozen layers, embeddings of unseen tokens, the optimizer state of parameters without
  gradients.
- ``xor_delta``: the ``ckptpilot.codecs`` XOR + byte planes + zstd of the whole shard. It also
  shrinks blocks that changed a little (the sign/exponent bytes of slowly moving weights),
  at the codec's speed: it pays on a slow link.

Why per shard and from a sample: a delta trades CPU for bytes on the wire, and whether that
pays depends on how much of the shard moved and on the link. Blocks spread over the shard
(:func:`sample_ranges`) are compared (and, when some changed, encoded) to measure the changed
fraction ``f``, the codec's ratio ``r`` and this CPU's compare and encode rates ``c`` and
``e``, now, for 1-2 % of a large shard's bytes.

The rule (:func:`choose`), per shard of ``S`` bytes, with the wire's measured rate ``w``
(bytes/s per shard transfer while a put's shards travel in parallel) and the rates shared by
the shards handled at once on the available cores: a full shard takes ``S / w``; ``blocks``
``S / c + f * S / w``; ``xor_delta`` ``S / e + r * S / w``. A delta is sent only when it is
estimated at least ``1 / DELTA_MARGIN`` times faster than the full shard: a mistaken delta
costs CPU on both sides (the peer's fold is not in the estimate), a mistaken full shard only
bytes. Without a measured wire rate (no full put yet in this process) the shard goes in full,
which measures the wire. ``deltas: always`` takes the kind of delta that sends fewer bytes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ckptpilot.tiers.peer.digest import Hasher
from ckptpilot.tiers.peer.parity import CHUNK_BYTES, Shard, parity_chunks
from ckptpilot.tiers.peer.protocol import BLOCKS, XOR_DELTA, Buffer, shard_tensor

if TYPE_CHECKING:
    from ckptpilot.codecs.base import Codec

BLOCK_BYTES = 64 << 10
SAMPLE_BLOCKS = 64
MIN_SAMPLE_BLOCKS = 8
SAMPLE_SHARE = 64
"""A shard of ``n`` blocks is sampled in ``n // SAMPLE_SHARE`` blocks (at least
:data:`MIN_SAMPLE_BLOCKS`, at most :data:`SAMPLE_BLOCKS`) for the compare, and in
:data:`XOR_SAMPLE_BLOCKS` of those for the codec: the estimate costs a few percent of sending
the shard at most."""
XOR_SAMPLE_BLOCKS = 8
DELTA_MARGIN = 0.8


@dataclass(frozen=True)
class Estimate:
    """What a shard's sample measured: ``sample_bytes`` compared (of every source shard) in
    ``compare_seconds``, ``xor_sample_bytes`` encoded in ``encode_seconds``. ``xor_*`` are
    None when the codec was not tried (no sampled block changed: nothing can beat ``blocks``
    then). ``xor_blob`` is the whole ``xor_delta`` payload when the sample was the whole
    shard, so it is not encoded twice."""

    shard_bytes: int
    sample_bytes: int
    changed_fraction: float
    compare_seconds: float
    xor_ratio: float | None = None
    encode_seconds: float | None = None
    xor_sample_bytes: int = 0
    xor_blob: list[Buffer] | None = None


def sample_ranges(size: int) -> list[tuple[int, int]]:
    """The blocks of a shard of ``size`` bytes to sample, as byte ranges: all of them when
    it has at most :data:`MIN_SAMPLE_BLOCKS`, else that many or more (see
    :data:`SAMPLE_SHARE`) evenly spread, the first and the last among them."""
    n_blocks = -(-size // BLOCK_BYTES)
    k = min(n_blocks, SAMPLE_BLOCKS, max(MIN_SAMPLE_BLOCKS, n_blocks // SAMPLE_SHARE))
    picks = [i * (n_blocks - 1) // (k - 1) for i in range(k)] if k > 1 else [0]
    return [(b * BLOCK_BYTES, min((b + 1) * BLOCK_BYTES, size)) for b in picks]


def gather(shards: Sequence[Shard], ranges: Sequence[tuple[int, int]]) -> np.ndarray:
    """The bytes of ``ranges`` of the XOR of ``shards`` (one shard: its bytes), as one array;
    the XOR of samples is the sample of the XOR, so a parity shard's sample needs no parity."""
    out = shards[0].take(ranges)
    for shard in shards[1:]:
        np.bitwise_xor(out, shard.take(ranges), out=out)
    return out


def changed_blocks(new: Shard, old: Shard) -> np.ndarray:
    """One bool per :data:`BLOCK_BYTES` block of the shards: whether it differs."""
    size = new.size
    out = np.empty(-(-size // BLOCK_BYTES), dtype=bool)
    for lo in range(0, size, CHUNK_BYTES):
        hi = min(lo + CHUNK_BYTES, size)
        out[lo // BLOCK_BYTES:-(-hi // BLOCK_BYTES)] = _differ(new.span(lo, hi),
                                                                old.span(lo, hi))
    return out


def blocks_payload(new: Shard, changed: np.ndarray) -> tuple[bytes, list[np.ndarray]]:
    """The ``blocks`` payload after the meta: the bitmap (bit ``i % 8`` of byte ``i // 8`` is
    block ``i``), then the new bytes of the changed blocks as views of ``new``, runs of
    neighbouring blocks joined into one view."""
    bitmap = np.packbits(changed, bitorder="little").tobytes()
    views: list[np.ndarray] = []
    for first, stop in _runs(changed):
        views += new.pieces_of(first * BLOCK_BYTES, min(stop * BLOCK_BYTES, new.size))
    return bitmap, views


def estimate(
    codec: Codec, new: Sequence[Shard], old: Sequence[Shard], ranges: Sequence[tuple[int, int]]
) -> Estimate:
    """Sample the shard that is the XOR of ``new`` against the XOR of ``old`` (one shard each
    for a data shard; the data shards for the parity) at ``ranges``: compare the blocks where
    they lie (a parity block can change only where a data shard's did), then, when some
    changed, encode :data:`XOR_SAMPLE_BLOCKS` of them with ``codec``. The compare's speed is
    timed on whole chunks of every source, as :func:`changed_blocks` compares them."""
    size = new[0].size
    changed = np.zeros(len(ranges), dtype=bool)
    for k, (lo, hi) in enumerate(ranges):
        changed[k] = any(_differ(a.span(lo, hi), b.span(lo, hi)).any()
                         for a, b in zip(new, old, strict=True))
    fraction = float(changed.mean())
    timed = min(size, CHUNK_BYTES)
    start = time.perf_counter()
    for a, b in zip(new, old, strict=True):
        _differ(a.span(0, timed), b.span(0, timed))
    compare = time.perf_counter() - start
    if not changed.any():
        return Estimate(size, timed, fraction, compare)
    picks = ranges[::-(-len(ranges) // XOR_SAMPLE_BLOCKS)]
    new_x, old_x = gather(new, picks), gather(old, picks)
    start = time.perf_counter()
    blob = codec.encode_parts(shard_tensor(new_x), base=shard_tensor(old_x))
    seconds = time.perf_counter() - start
    encoded = sum(memoryview(part).nbytes for part in blob)
    return Estimate(size, timed, fraction, compare, encoded / max(new_x.size, 1), seconds,
                    new_x.size, blob if new_x.size == size else None)


def choose(
    est: Estimate, wire_bytes_per_second: float | None, *, concurrent: int, cores: int,
    forced: bool = False,
) -> str | None:
    """The encoding to send ``est``'s shard with (:data:`~protocol.BLOCKS` or
    :data:`~protocol.XOR_DELTA`), or None for the full shard (see the module docstring);
    ``concurrent`` shards are compared and encoded at once on ``cores``. ``forced``
    (``deltas: always``, a user who wants the fewest bytes on the wire) picks the kind of
    delta estimated to send fewer bytes, ``blocks`` on a tie, whatever it costs."""
    if forced:
        return XOR_DELTA if est.xor_ratio is not None and est.xor_ratio < \
            est.changed_fraction else BLOCKS
    wire = wire_bytes_per_second
    if wire is None or wire <= 0:
        return None
    share = min(1.0, cores / max(concurrent, 1))
    size = est.shard_bytes
    full = size / wire
    times = {BLOCKS: size / _rate(est.sample_bytes, est.compare_seconds, share)
             + est.changed_fraction * full}
    if est.xor_ratio is not None and est.encode_seconds is not None:
        times[XOR_DELTA] = (size / _rate(est.xor_sample_bytes, est.encode_seconds, share)
                            + est.xor_ratio * full)
    best = min(times, key=lambda kind: times[kind])
    return best if times[best] <= DELTA_MARGIN * full else None


def _rate(nbytes: int, seconds: float, share: float) -> float:
    return max(nbytes, 1) / max(seconds, 1e-9) * share


def _differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One bool per :data:`BLOCK_BYTES` block (the last may be short) of two equal arrays
    whose start is block-aligned: whether it differs. Compared as 64-bit words where the
    arrays allow it (aligned, whole words), else as bytes."""
    words = a.size % 8 == 0 and a.ctypes.data % 8 == 0 and b.ctypes.data % 8 == 0
    if words:
        a, b = a.view(np.uint64), b.view(np.uint64)
    per_block = BLOCK_BYTES // a.itemsize
    diff = np.not_equal(a, b)
    full = diff.size // per_block * per_block
    out = diff[:full].reshape(-1, per_block).any(axis=1)
    if full < diff.size:
        out = np.append(out, diff[full:].any())
    return out


def fold_blocks(base: np.ndarray, payload: np.ndarray, block_bytes: int) -> np.ndarray:
    """The peer's side of ``blocks``: a fresh copy of ``base`` with the changed blocks of
    ``payload`` (bitmap, then their bytes) written over it; ``ValueError`` naming the fault
    when the payload does not fit the shard (the fold then fails, the base stays)."""
    size = base.size
    n_blocks = -(-size // block_bytes)
    n_bitmap = -(-n_blocks // 8)
    bits = np.unpackbits(payload[:n_bitmap], bitorder="little")
    if bits[n_blocks:].any():
        raise ValueError(f"blocks delta: its bitmap marks blocks past the shard's {n_blocks}")
    changed = bits[:n_blocks].astype(bool)
    runs = _runs(changed)
    carried = sum(min(stop * block_bytes, size) - first * block_bytes for first, stop in runs)
    if payload.size - n_bitmap != carried:
        raise ValueError(f"blocks delta: its bitmap marks {carried} bytes of changed blocks, "
                         f"it carries {payload.size - n_bitmap}")
    out = np.empty(size, dtype=np.uint8)
    np.copyto(out, base)
    at = n_bitmap
    for first, stop in runs:
        lo, hi = first * block_bytes, min(stop * block_bytes, size)
        out[lo:hi] = payload[at:at + hi - lo]
        at += hi - lo
    return out


def _runs(changed: np.ndarray) -> list[tuple[int, int]]:
    """(first, stop) block indices of each run of changed blocks."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], changed.view(np.int8), [0]))))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def parity_blocks_payload(
    data: Sequence[Shard], changed: np.ndarray
) -> tuple[str, bytes, list[np.ndarray]]:
    """The new parity's digest and its ``blocks`` payload for the blocks ``changed`` (the
    union of the data shards' changed blocks: the parity cannot change elsewhere), from one
    pass that streams the parity (:func:`parity_chunks`), digests it and keeps the changed
    blocks' bytes, one array per run of them."""
    hasher = Hasher()
    runs = [(first * BLOCK_BYTES, min(stop * BLOCK_BYTES, data[0].size))
            for first, stop in _runs(changed)]
    kept = [np.empty(hi - lo, dtype=np.uint8) for lo, hi in runs]
    at, r = 0, 0
    for chunk in parity_chunks(data):
        hasher.update(chunk)
        end = at + chunk.size
        while r < len(runs) and runs[r][0] < end:
            lo, hi = max(runs[r][0], at), min(runs[r][1], end)
            kept[r][lo - runs[r][0]:hi - runs[r][0]] = chunk[lo - at:hi - at]
            if runs[r][1] > end:
                break
            r += 1
        at = end
    return hasher.hexdigest(), np.packbits(changed, bitorder="little").tobytes(), kept
