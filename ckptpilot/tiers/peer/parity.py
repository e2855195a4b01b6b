"""Striping an image into equal data shards plus one XOR parity shard (SPEC §6).

Owns: the shard size rule, a shard's bytes where they lie (:class:`Shard`: a view of the
image, plus its zero padding past the image's end), the parity, and rebuilding one missing
shard in its place. Must not: send or store anything. It digests the bytes it produces in
the same pass (``digest``), chunk by chunk while they are in the cache, so that no shard is
read twice.

No copies: a data shard is a view of the image (the last one, when the image does not fill
it, is that view and a small array of zeros); the parity is produced :data:`CHUNK_BYTES` at a
time into one reused buffer as it is sent (:func:`parity_chunks`), so a put holds no shard
of its own; a fetch receives every data shard straight into its place in one image, and for
a lost one the parity into that place, where the other data shards are XORed into it.

Shards are a multiple of 8 bytes (at least 8) so that every shard can be viewed as 64-bit
words and delta codecs can view a shard as float32 without a remainder; the true image
length is carried alongside. XOR parity survives the loss of any one shard: each shard is
the XOR of all the others.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from ckptpilot.tiers.peer.digest import Hasher
from ckptpilot.tiers.peer.protocol import Buffer

SHARD_ALIGN = 8
CHUNK_BYTES = 1 << 20
"""XOR, digests and sends work on pieces of this size, each digested while in the cache."""


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


class Shard:
    """One shard's bytes as one or two arrays in shard order: for a data shard, its part of
    the image and, past the image's end, its padding in a small array of its own; for a
    parity computed whole (a delta of it), one array.

    Threading: one thread fills a shard being fetched (``views`` into ``recv_into``);
    :meth:`rebuild_from_parity` runs after every other shard is filled.
    """

    def __init__(self, pieces: Sequence[np.ndarray]) -> None:
        self.pieces = [p for p in pieces if p.size]
        self.size = sum(p.size for p in self.pieces)

    @classmethod
    def of_image(cls, image: np.ndarray, index: int, size: int, *, fill: bool = True) -> Shard:
        """Data shard ``index`` of shards of ``size`` bytes striped over ``image``; its
        padding is zeros (``fill``, to send) or uninitialised (to receive into)."""
        lo = min(index * size, image.size)
        inside = image[lo:min(lo + size, image.size)]
        pad = (np.zeros if fill else np.empty)(size - inside.size, dtype=np.uint8)
        return cls([inside, pad])

    def views(self) -> list[memoryview]:
        """The shard as byte views, in order (writable when the arrays are)."""
        return [memoryview(p) for p in self.pieces]

    def chunks(self) -> Iterator[np.ndarray]:
        """The shard in pieces of at most :data:`CHUNK_BYTES`, in order (views, no copy)."""
        for piece in self.pieces:
            for lo in range(0, piece.size, CHUNK_BYTES):
                yield piece[lo:lo + CHUNK_BYTES]

    def contiguous(self) -> np.ndarray:
        """The shard as one array: the image's view itself when no padding is needed, else
        a joined copy (delta codecs need one array)."""
        return self.pieces[0] if len(self.pieces) == 1 else np.concatenate(self.pieces)

    def span(self, lo: int, hi: int) -> np.ndarray:
        """Shard bytes ``[lo, hi)`` as one array: a view when they lie in one piece (all but
        the few bytes where the image ends and the padding starts), else a joined copy."""
        pieces = self.pieces_of(lo, hi)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def pieces_of(self, lo: int, hi: int) -> list[np.ndarray]:
        """Shard bytes ``[lo, hi)`` as views of its pieces, in order."""
        return [piece for _, piece in self._ranges(lo, hi)]

    def take(self, ranges: Sequence[tuple[int, int]]) -> np.ndarray:
        """The bytes of ``ranges`` (offsets into the shard), joined into one array."""
        return np.concatenate([p for lo, hi in ranges for _, p in self._ranges(lo, hi)])

    def _ranges(self, lo: int, hi: int) -> Iterator[tuple[int, np.ndarray]]:
        """(offset from ``lo``, array) covering shard bytes ``[lo, hi)``."""
        start = 0
        for piece in self.pieces:
            a, b = max(lo, start), min(hi, start + piece.size)
            if a < b:
                yield a - lo, piece[a - start:b - start]
            start += piece.size

    def xor_into(self, out: np.ndarray, lo: int) -> None:
        """``out ^= shard bytes [lo, lo + out.size)``."""
        for off, piece in self._ranges(lo, lo + out.size):
            part = out[off:off + piece.size]
            np.bitwise_xor(part, piece, out=part)

    def copy_into(self, out: np.ndarray, lo: int) -> None:
        """``out = shard bytes [lo, lo + out.size)``."""
        for off, piece in self._ranges(lo, lo + out.size):
            out[off:off + piece.size] = piece

    def rebuild_from_parity(self, others: Sequence[Shard]) -> str:
        """This shard's place holds the parity (received there): XOR the other data shards
        into it, in place, a chunk at a time, which leaves the lost shard; return its digest."""
        _check_sizes([self, *others])
        hasher = Hasher()
        for lo in range(0, self.size, CHUNK_BYTES):
            for off, piece in self._ranges(lo, min(lo + CHUNK_BYTES, self.size)):
                for other in others:
                    other.xor_into(piece, lo + off)
                hasher.update(piece)
        return hasher.hexdigest()


def split(image: Buffer, data_shards: int) -> list[Shard]:
    """The ``data_shards`` shards of ``image``, as views of it (padding: zeros)."""
    flat = as_bytes(image)
    size = shard_size(flat.size, data_shards)
    return [Shard.of_image(flat, i, size) for i in range(data_shards)]


def parity_chunks(data: Sequence[Shard]) -> Iterator[np.ndarray]:
    """The parity of ``data``, :data:`CHUNK_BYTES` at a time, in one reused buffer: each
    chunk is valid until the next is asked for (send it, or copy it, before)."""
    _check_sizes(data)
    size = data[0].size
    buf = np.empty(min(CHUNK_BYTES, size), dtype=np.uint8)
    for lo in range(0, size, CHUNK_BYTES):
        out = buf[:min(CHUNK_BYTES, size - lo)]
        data[0].copy_into(out, lo)
        for shard in data[1:]:
            shard.xor_into(out, lo)
        yield out


def parity_of(data: Sequence[Shard]) -> Shard:
    """The parity of ``data`` as a shard of its own (for a delta of the parity)."""
    out = np.empty(data[0].size, dtype=np.uint8)
    at = 0
    for chunk in parity_chunks(data):
        out[at:at + chunk.size] = chunk
        at += chunk.size
    return Shard([out])


def _check_sizes(shards: Sequence[Shard]) -> None:
    if not shards:
        raise ValueError("XOR parity needs at least one shard")
    sizes = {s.size for s in shards}
    if len(sizes) != 1 or next(iter(sizes)) % SHARD_ALIGN:
        raise ValueError(f"shards must share one size that is a multiple of {SHARD_ALIGN}, got "
                         f"sizes {sorted(sizes)}")
