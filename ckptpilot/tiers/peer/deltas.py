"""Whether a shard travels as an XOR delta or in full: a sample, an estimate, a rule.

Owns: where a shard is sampled, encoding the sample to estimate the delta's size and the
encoder's speed, and the pure rule that compares the two ways of sending. Must not: send
anything or keep measurements (the client measures the wire and passes its rate in).

Why per shard and from a sample: a delta costs CPU (XOR, byte planes, zstd on the sender, a
fold on the peer) to save bytes on the wire. Whether that pays depends on how much the state
moved (frozen layers XOR to zeros that compress to nothing; one AdamW step changes nearly
every mantissa) and on the link (a slow network makes every byte dear; loopback or a fast
fabric makes the encoder the bottleneck). Encoding :data:`SAMPLE_STRIPES` stripes spread
over the shard measures both the compression ratio and this CPU's encode speed, now, for
about 1 % of the shard's bytes; the rule then picks the faster way for the whole shard.

The rule (:func:`delta_pays`), per shard of ``S`` bytes, with the wire's measured rate ``w``
(bytes/s per shard transfer while a put's shards travel in parallel), the sample's ratio
``r`` (encoded / raw) and encode rate ``e`` shared by the shards encoded at once on the
available cores: a full shard takes ``S / w``; a delta ``S / e + r * S / w``. The delta is
sent only when it is estimated faster. Without a measured wire rate (no full put yet in this
process) the shard goes in full, which also measures the wire.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ckptpilot.codecs.base import Codec
from ckptpilot.tiers.peer.parity import Shard
from ckptpilot.tiers.peer.protocol import Buffer, shard_tensor

SAMPLE_STRIPES = 16
STRIPE_BYTES = 256 << 10
_ALIGN = 8


@dataclass(frozen=True)
class DeltaEstimate:
    """What encoding a sample of one shard's delta measured. ``blob`` is the whole delta
    when the sample was the whole shard (small shards), so it need not be encoded twice."""

    shard_bytes: int
    sample_bytes: int
    encoded_bytes: int
    encode_seconds: float
    blob: list[Buffer] | None = None

    @property
    def ratio(self) -> float:
        return self.encoded_bytes / max(self.sample_bytes, 1)


def sample_ranges(size: int) -> list[tuple[int, int]]:
    """Byte ranges of a shard of ``size`` bytes to encode as its sample: the whole shard when
    it is small, else :data:`SAMPLE_STRIPES` stripes evenly spread (starts 8-byte aligned so
    the float32 view of the sample holds whole elements)."""
    if size <= SAMPLE_STRIPES * STRIPE_BYTES:
        return [(0, size)]
    step = (size - STRIPE_BYTES) // (SAMPLE_STRIPES - 1)
    starts = [(i * step) // _ALIGN * _ALIGN for i in range(SAMPLE_STRIPES)]
    return [(lo, lo + STRIPE_BYTES) for lo in starts]


def gather(shards: Sequence[Shard], ranges: Sequence[tuple[int, int]]) -> np.ndarray:
    """The bytes of ``ranges`` of the XOR of ``shards`` (one shard: its bytes), as one array;
    the XOR of samples is the sample of the XOR, so a parity shard's sample needs no parity."""
    out = shards[0].take(ranges)
    for shard in shards[1:]:
        np.bitwise_xor(out, shard.take(ranges), out=out)
    return out


def estimate(codec: Codec, new: np.ndarray, old: np.ndarray, shard_bytes: int) -> DeltaEstimate:
    """Encode the delta of the sample ``new`` against ``old`` (same ranges of the new and the
    base shard) and time it."""
    start = time.perf_counter()
    blob = codec.encode_parts(shard_tensor(new), base=shard_tensor(old))
    seconds = time.perf_counter() - start
    encoded = sum(memoryview(part).nbytes for part in blob)
    whole = new.size == shard_bytes
    return DeltaEstimate(shard_bytes, new.size, encoded, seconds, blob if whole else None)


def delta_pays(
    est: DeltaEstimate, wire_bytes_per_second: float | None, *, concurrent: int, cores: int
) -> bool:
    """Whether sending ``est``'s shard as a delta is estimated faster than sending it in full
    (see the module docstring); ``concurrent`` shards are encoded at once on ``cores``."""
    if wire_bytes_per_second is None or wire_bytes_per_second <= 0 or est.ratio >= 1:
        return False
    if est.encode_seconds <= 0:
        return True
    encode_rate = est.sample_bytes / est.encode_seconds * min(1.0, cores / max(concurrent, 1))
    full = est.shard_bytes / wire_bytes_per_second
    delta = est.shard_bytes / encode_rate + est.ratio * est.shard_bytes / wire_bytes_per_second
    return delta < full
