"""How a file of an archive is fingerprinted: SHA256 (and XXH3-128) of every fixed-size chunk.

One SHA256 over a whole file is one core's work, strictly in order (bench/RESULTS.md,
stall.py: the write with SHA256 on the fly): it set the pace of every save and every
restore. A file record of manifest version 2 instead holds the SHA256 of each
:data:`CHUNK_BYTES` piece of the file (the last one shorter)::

    {"bytes": 1073741832, "chunk_bytes": 8388608, "sha256_chunks": ["9f86…", …]}

so the pieces are hashed on several threads (hashlib releases the GIL) while the same bytes
are written or read, and a mismatch names the byte range at fault. The guarantee is the same
as a whole-file digest: every byte is covered by exactly one SHA256, the count and order of
the chunks are fixed by the size, and the list itself is covered by the manifest's own
digest. Version-1 records (``{"bytes", "sha256"}``, one digest of the whole file) stay
readable.

Manifest version 3 adds ``"xxh3_128_chunks"``, the XXH3-128 of the same chunks, so that a
restore may check what it reads for far less CPU than SHA256 takes
(``tiers.remote.verify_reads: xxh3``). What each check guarantees:

- ``sha256`` (the default, and what ``validate`` and paranoid validation always use): a
  changed byte is caught whoever changed it; a file forged to match needs a SHA256 second
  preimage.
- ``xxh3``: any accidental change (a flipped bit, a torn or misplaced block, a truncation,
  another file in its place) is caught, a random change going unnoticed with a chance of
  2**-128 per chunk. XXH3 is not cryptographic: someone who can rewrite the tensors file can
  craft bytes with the recorded XXH3 digests, so this check does not stand against a
  deliberate substitution. The digest list itself cannot be changed unseen (the manifest's
  SHA256 covers it, and the catalogue records the manifest's digest).

A record without XXH3 digests (versions 1 and 2) is always checked by SHA256.

Owns the record's keys, the chunk size, and the thread pool the digests run on. Hashes bytes
only: reading and writing files is the tiers' (``tiers.remote``).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import xxhash

from ckptpilot.background import background_pool
from ckptpilot.errors import CheckpointFormatError, IntegrityError

__all__ = [
    "CHUNK_BYTES",
    "READ_DIGESTS",
    "ChunkDigest",
    "ReadDigest",
    "check_chunk",
    "chunk_ranges",
    "hash_pool",
    "is_chunked",
    "read_digest",
]

CHUNK_BYTES = 8 << 20
"""8 MiB: 128 digests (8 KB of manifest) per GB, and pieces small enough that a 64 MiB write
spreads over every hashing thread."""

ReadDigest = Literal["sha256", "xxh3"]
READ_DIGESTS: tuple[ReadDigest, ...] = ("sha256", "xxh3")
_KEYS: dict[str, str] = {"sha256": "sha256_chunks", "xxh3": "xxh3_128_chunks"}
_NAMES: dict[str, str] = {"sha256": "SHA256", "xxh3": "XXH3-128"}


def _hexdigest(digest: str, view: memoryview) -> str:
    if digest == "xxh3":
        return str(xxhash.xxh3_128_hexdigest(view))
    return hashlib.sha256(view).hexdigest()


class _Pools:
    """This process's hashing pools, by kind, and the lock that creates them."""

    def __init__(self) -> None:
        self.by_kind: dict[bool, ThreadPoolExecutor] = {}
        self.lock = threading.Lock()


_POOLS = _Pools()


def _forget_pools_in_a_forked_child() -> None:
    """A forked child has none of its parent's threads: the pools' workers do not exist
    there, and work submitted to them would never run (a save in a child forked after its
    parent hashed would hang). The child builds its own on first use."""
    _POOLS.__init__()  # type: ignore[misc]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_in_a_forked_child)


READ_THREADS = 4
"""Threads that read and hash for a restore or a validation someone waits for, whatever the
number of cores: a local read goes to the disk with ``O_DIRECT`` (``tiers/remote/directio.py``)
and waits for it without a core, so four reads in flight keep the device busy where two cores
would leave it idle between them (bench/RESULTS.md, "restore.py — cold reads with O_DIRECT")."""


def hash_pool(*, background: bool = True) -> ThreadPoolExecutor:
    """The process's hashing threads. ``background`` (a save): at most 4, fewer on smaller
    machines, at background priority, the cores are training's first. Not (a restore, a
    validation someone waits for): :data:`READ_THREADS`, at the caller's priority — training is
    waiting for it, and niced threads on a busy machine would make a restore many times
    slower."""
    pools = _POOLS
    with pools.lock:
        if background not in pools.by_kind:
            pools.by_kind[background] = (
                background_pool(max(1, min(4, os.cpu_count() or 1)), "ckptpilot-hash")
                if background else ThreadPoolExecutor(READ_THREADS, "ckptpilot-read"))
        return pools.by_kind[background]


def is_chunked(rec: Mapping[str, Any]) -> bool:
    """Whether a file record carries chunk digests (version 2) rather than one whole-file
    SHA256 (version 1)."""
    return "sha256_chunks" in rec


def read_digest(rec: Mapping[str, Any], wanted: ReadDigest) -> ReadDigest:
    """The digest a read of a chunked record is checked by: ``wanted`` when the record holds
    it, else SHA256 (a record written before XXH3 digests were kept)."""
    return wanted if _KEYS[wanted] in rec else "sha256"


def chunk_ranges(rec: Mapping[str, Any], where: str, digest: ReadDigest = "sha256"
                 ) -> list[tuple[int, int, str]]:
    """``(begin, end, expected digest)`` of every chunk of a chunked record (``digest``: which
    of its lists), checked for consistency with the file's size before anything is read."""
    size, step, digests = rec.get("bytes"), rec.get("chunk_bytes"), rec.get(_KEYS[digest])
    if (not isinstance(size, int) or not isinstance(step, int) or step <= 0 or size < 0
            or not isinstance(digests, list)):
        raise CheckpointFormatError(f"{where}: malformed chunk digest record")
    if len(digests) != max(1, -(-size // step)):
        raise CheckpointFormatError(
            f"{where}: {len(digests)} chunk digests for {size} bytes in chunks of {step}")
    return [(i * step, min(size, (i + 1) * step), str(d)) for i, d in enumerate(digests)]


def check_chunk(view: memoryview, begin: int, end: int, expected: str, where: str,
                digest: ReadDigest = "sha256") -> None:
    """Raise :class:`IntegrityError` naming the byte range and the digest when ``view`` (the
    bytes of ``[begin, end)``) does not hash to ``expected``."""
    actual = _hexdigest(digest, view)
    if actual != expected:
        raise IntegrityError(f"{where} bytes [{begin}, {end})", expected, actual, _NAMES[digest])


class ChunkDigest:
    """The chunk digests of a byte stream, hashed on :func:`hash_pool` (background) while the
    caller writes the same bytes.

    :meth:`update` returns the futures of the hashing it started; the caller waits for them
    before the buffer it passed may change (a writer: before its ``write`` returns), so each
    chunk's hasher is updated by one thread at a time and in order.
    """

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._hashers: list[_ChunkHashers] = [_ChunkHashers()]
        self._fill = 0  # bytes in the last chunk
        self.size = 0

    def update(self, view: memoryview) -> list[Future[None]]:
        pool = hash_pool()
        futures = []
        while len(view):
            if self._fill == self.chunk_bytes:
                self._hashers.append(_ChunkHashers())
                self._fill = 0
            take = min(len(view), self.chunk_bytes - self._fill)
            futures.append(pool.submit(self._hashers[-1].update, view[:take]))
            self._fill += take
            self.size += take
            view = view[take:]
        return futures

    def record(self) -> dict[str, Any]:
        """The file record (every :meth:`update`'s futures must have been waited for)."""
        return {"bytes": self.size, "chunk_bytes": self.chunk_bytes,
                "sha256_chunks": [h.sha256.hexdigest() for h in self._hashers],
                "xxh3_128_chunks": [h.xxh3.hexdigest() for h in self._hashers]}


class _ChunkHashers:
    """Both digests of one chunk, fed together: one task on the pool, so each chunk's
    hashers are still updated by one thread at a time and in order."""

    def __init__(self) -> None:
        self.sha256 = hashlib.sha256()
        self.xxh3 = xxhash.xxh3_128()

    def update(self, view: memoryview) -> None:
        self.sha256.update(view)
        self.xxh3.update(view)
