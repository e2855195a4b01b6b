"""Striping an image into equal data shards plus one XOR parity shard (SPEC §6).

Owns: the shard size rule, split, parity, rebuilding one missing shard, and where a fetched
shard's bytes go (:class:`ShardPlace`). Must not: send or store anything. It digests the
bytes it produces or passes over (``digest``) in the same pass, chunk by chunk while they
are in the cache, so that no shard is read twice.

Shards are a multiple of 8 bytes (at least 8) so that every shard can be viewed as 64-bit
words and delta codecs can view a shard as float32 without a remainder; the last shards are
zero padded and the true image length is carried alongside. XOR parity survives the loss of
any one shard: each shard is the XOR of all the others.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from ckptpilot.tiers.peer.digest import Hasher
from ckptpilot.tiers.peer.protocol import Buffer

SHARD_ALIGN = 8
CHUNK_BYTES = 1 << 20
"""XOR and digest work on pieces of this size, so each piece is hashed while in the cache."""


def shard_size(image_len: int, data_shards: int) -> int:
    """Bytes per shard: ceil(image_len / data_shards) rounded up to a multiple of 8, >= 8."""
    if data_shards < 1:
        raise ValueError(f"data_shards must be >= 1, got {data_shards}")
    if image_len < 0:
        raise ValueError(f"image_len must be >= 0, got {image_len}")
    per_shard = -(-image_len // data_shards)
    return max(SHARD_ALIGN, -(-per_shard // SHARD_ALIGN) * SHARD_ALIGN)


def as_bytes(image: Buffer) -> np.ndarray:
    """A flat uint8 view of any bytes-like object (no copy; read-only if the source is)."""
    return np.frombuffer(memoryview(image).cast("B"), dtype=np.uint8)


def split(image: Buffer, data_shards: int) -> list[np.ndarray]:
    """``data_shards`` uint8 arrays of :func:`shard_size` bytes each.

    Shards that lie wholly inside the image are views of it (no copy, read-only when the
    image is); only the shards that reach past its end are copied and zero padded.
    """
    flat = as_bytes(image)
    size = shard_size(flat.size, data_shards)
    shards = []
    for i in range(data_shards):
        lo = i * size
        if lo + size <= flat.size:
            shards.append(flat[lo:lo + size])
        else:
            shard = np.zeros(size, dtype=np.uint8)
            tail = flat[lo:lo + size]
            shard[:tail.size] = tail
            shards.append(shard)
    return shards


def parity_and_digests(data: Sequence[np.ndarray], parity: np.ndarray | None) -> list[str]:
    """The digests of the data shards and, when ``parity`` is given, fill it with their XOR
    and digest it too (last in the list): one pass over the data, chunk by chunk."""
    _check_sizes([*data, *([] if parity is None else [parity])])
    hashers = [Hasher() for _ in range(len(data) + (parity is not None))]
    size = data[0].size
    for lo in range(0, size, CHUNK_BYTES):
        hi = min(lo + CHUNK_BYTES, size)
        pieces = [shard[lo:hi] for shard in data]
        for hasher, piece in zip(hashers, pieces, strict=False):
            hasher.update(piece)
        if parity is not None:
            out = parity[lo:hi]
            _xor_into(out, pieces)
            hashers[-1].update(out)
    return [h.hexdigest() for h in hashers]


def xor_of(shards: Sequence[np.ndarray]) -> np.ndarray:
    """The bytewise XOR of equal-size shards, as a fresh array."""
    _check_sizes(shards)
    out = np.empty(shards[0].size, dtype=np.uint8)
    for lo in range(0, out.size, CHUNK_BYTES):
        hi = lo + CHUNK_BYTES
        _xor_into(out[lo:hi], [s[lo:hi] for s in shards])
    return out


def parity(shards: Sequence[np.ndarray]) -> np.ndarray:
    """The XOR parity shard of the data shards."""
    return xor_of(shards)


def rebuild(shards: Sequence[np.ndarray | None], parity_shard: np.ndarray) -> np.ndarray:
    """The one data shard that is None, rebuilt from the others and the parity."""
    missing = [i for i, s in enumerate(shards) if s is None]
    if len(missing) != 1:
        raise ValueError(f"XOR parity rebuilds exactly one missing shard; missing: {missing}")
    return xor_of([parity_shard, *(s for s in shards if s is not None)])


class ShardPlace:
    """Where one fetched shard's bytes go: for a data shard, its part of the image and, past
    the image's end, the padding in a small array of its own (so the image is received in
    place, never joined); for the parity, one scratch array.

    Threading: one thread fills a place (``views`` into ``recv_into``); :meth:`rebuild` runs
    after every other place is filled.
    """

    def __init__(self, pieces: Sequence[np.ndarray]) -> None:
        self.pieces = [p for p in pieces if p.size]
        self.size = sum(p.size for p in self.pieces)

    @classmethod
    def in_image(cls, image: np.ndarray, index: int, size: int) -> ShardPlace:
        """Data shard ``index`` of shards of ``size`` bytes striped over ``image``."""
        lo = min(index * size, image.size)
        inside = image[lo:min(lo + size, image.size)]
        return cls([inside, np.empty(size - inside.size, dtype=np.uint8)])

    @classmethod
    def scratch(cls, size: int) -> ShardPlace:
        return cls([np.empty(size, dtype=np.uint8)])

    def views(self) -> list[memoryview]:
        """The place as writable byte views, in shard order."""
        return [memoryview(p) for p in self.pieces]

    def _ranges(self, lo: int, hi: int) -> Iterator[tuple[int, np.ndarray]]:
        """(offset from ``lo``, array) covering shard bytes ``[lo, hi)``."""
        start = 0
        for piece in self.pieces:
            a, b = max(lo, start), min(hi, start + piece.size)
            if a < b:
                yield a - lo, piece[a - start:b - start]
            start += piece.size

    def rebuild(self, parity_place: ShardPlace, others: Sequence[ShardPlace]) -> str:
        """Fill this place with ``parity XOR others`` and return the result's digest."""
        _check_sizes_of([self, parity_place, *others])
        hasher = Hasher()
        acc = np.empty(min(CHUNK_BYTES, self.size), dtype=np.uint8)
        for lo in range(0, self.size, CHUNK_BYTES):
            hi = min(lo + CHUNK_BYTES, self.size)
            buf = acc[:hi - lo]
            for off, piece in parity_place._ranges(lo, hi):
                buf[off:off + piece.size] = piece
            for other in others:
                for off, piece in other._ranges(lo, hi):
                    part = buf[off:off + piece.size]
                    np.bitwise_xor(part, piece, out=part)
            hasher.update(buf)
            for off, piece in self._ranges(lo, hi):
                piece[:] = buf[off:off + piece.size]
        return hasher.hexdigest()


def _xor_into(out: np.ndarray, pieces: Sequence[np.ndarray]) -> None:
    """``out = XOR of pieces`` (NumPy releases the GIL for the loop)."""
    np.copyto(out, pieces[0])
    for piece in pieces[1:]:
        np.bitwise_xor(out, piece, out=out)


def _check_sizes(shards: Sequence[np.ndarray]) -> None:
    if not shards:
        raise ValueError("XOR parity needs at least one shard")
    sizes = {s.size for s in shards}
    if len(sizes) != 1 or next(iter(sizes)) % SHARD_ALIGN:
        raise ValueError(f"shards must share one size that is a multiple of {SHARD_ALIGN}, got "
                         f"sizes {sorted(sizes)}")


def _check_sizes_of(places: Sequence[ShardPlace]) -> None:
    sizes = {p.size for p in places}
    if len(sizes) != 1:
        raise ValueError(f"shards must share one size, got sizes {sorted(sizes)}")
