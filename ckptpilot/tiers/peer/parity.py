"""Striping an image into equal data shards plus one XOR parity shard (SPEC §6).

Owns: the shard size rule, split, parity, rebuilding one missing shard, and joining shards
back into the image. Must not: hash, send or store anything.

Shards are a multiple of 8 bytes (at least 8) so that every shard can be viewed as 64-bit
words (the XOR runs on words, and delta codecs can view a shard as float32 without a
remainder); the last shards are zero padded and the true image length is carried alongside.
XOR parity survives the loss of any one shard: each shard is the XOR of all the others.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ckptpilot.tiers.peer.protocol import Buffer

SHARD_ALIGN = 8


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


def xor_of(shards: Sequence[np.ndarray]) -> np.ndarray:
    """The bytewise XOR of equal-size shards, as a fresh array (word-wise, vectorised)."""
    if not shards:
        raise ValueError("xor_of needs at least one shard")
    sizes = {s.size for s in shards}
    if len(sizes) != 1 or next(iter(sizes)) % SHARD_ALIGN:
        raise ValueError(f"shards must share one size that is a multiple of {SHARD_ALIGN}, got "
                         f"sizes {sorted(sizes)}")
    out = np.array(shards[0], dtype=np.uint8, copy=True)
    words = out.view(np.uint64)
    for shard in shards[1:]:
        np.bitwise_xor(words, _words(shard), out=words)
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


def join(shards: Sequence[np.ndarray], image_len: int) -> bytearray:
    """The image: the shards concatenated and cut to ``image_len`` bytes (one copy)."""
    size = shards[0].size if shards else 0
    if image_len > size * len(shards):
        raise ValueError(f"{len(shards)} shards of {size} bytes cannot hold {image_len} bytes")
    image = bytearray(image_len)
    out = np.frombuffer(image, dtype=np.uint8)
    for i, shard in enumerate(shards):
        lo = i * size
        if lo >= image_len:
            break
        hi = min(lo + size, image_len)
        out[lo:hi] = shard[:hi - lo]
    return image


def _words(shard: np.ndarray) -> np.ndarray:
    """A uint64 view of a shard; copies only when the buffer is not 8-byte aligned."""
    if shard.ctypes.data % 8:
        shard = shard.copy()
    return shard.view(np.uint64)
