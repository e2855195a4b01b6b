"""How a file of an archive is fingerprinted: SHA256 of every fixed-size chunk.

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

Owns the record's keys, the chunk size, and the thread pool the digests run on. Hashes bytes
only: reading and writing files is the tiers' (``tiers.remote``).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ckptpilot.background import background_pool
from ckptpilot.errors import CheckpointFormatError, IntegrityError

__all__ = [
    "CHUNK_BYTES",
    "ChunkDigest",
    "check_chunk",
    "chunk_ranges",
    "hash_pool",
    "is_chunked",
]

CHUNK_BYTES = 8 << 20
"""8 MiB: 128 digests (8 KB of manifest) per GB, and pieces small enough that a 64 MiB write
spreads over every hashing thread."""

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


def hash_pool(*, background: bool = True) -> ThreadPoolExecutor:
    """The process's hashing threads (at most 4, fewer on smaller machines). ``background``
    (a save): at background priority, the cores are training's first. Not (a restore, a
    validation someone waits for): at the caller's priority — training is waiting for it, and
    niced threads on a busy machine would make a restore many times slower."""
    pools = _POOLS
    with pools.lock:
        if background not in pools.by_kind:
            workers = max(1, min(4, os.cpu_count() or 1))
            pools.by_kind[background] = (background_pool(workers, "ckptpilot-hash")
                                         if background
                                         else ThreadPoolExecutor(workers, "ckptpilot-read"))
        return pools.by_kind[background]


def is_chunked(rec: Mapping[str, Any]) -> bool:
    """Whether a file record carries chunk digests (version 2) rather than one whole-file
    SHA256 (version 1)."""
    return "sha256_chunks" in rec


def chunk_ranges(rec: Mapping[str, Any], where: str) -> list[tuple[int, int, str]]:
    """``(begin, end, sha256)`` of every chunk of a version-2 record, checked for
    consistency with the file's size before anything is read."""
    size, step, digests = rec.get("bytes"), rec.get("chunk_bytes"), rec.get("sha256_chunks")
    if (not isinstance(size, int) or not isinstance(step, int) or step <= 0 or size < 0
            or not isinstance(digests, list)):
        raise CheckpointFormatError(f"{where}: malformed chunk digest record")
    if len(digests) != max(1, -(-size // step)):
        raise CheckpointFormatError(
            f"{where}: {len(digests)} chunk digests for {size} bytes in chunks of {step}")
    return [(i * step, min(size, (i + 1) * step), str(d)) for i, d in enumerate(digests)]


def check_chunk(view: memoryview, begin: int, end: int, expected: str, where: str) -> None:
    """Raise :class:`IntegrityError` naming the byte range when ``view`` (the bytes of
    ``[begin, end)``) does not hash to ``expected``."""
    actual = hashlib.sha256(view).hexdigest()
    if actual != expected:
        raise IntegrityError(f"{where} bytes [{begin}, {end})", expected, actual)


class ChunkDigest:
    """The chunk digests of a byte stream, hashed on :func:`hash_pool` (background) while the
    caller writes the same bytes.

    :meth:`update` returns the futures of the hashing it started; the caller waits for them
    before the buffer it passed may change (a writer: before its ``write`` returns), so each
    chunk's hasher is updated by one thread at a time and in order.
    """

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._hashers: list[Any] = [hashlib.sha256()]
        self._fill = 0  # bytes in the last chunk
        self.size = 0

    def update(self, view: memoryview) -> list[Future[None]]:
        pool = hash_pool()
        futures = []
        while len(view):
            if self._fill == self.chunk_bytes:
                self._hashers.append(hashlib.sha256())
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
                "sha256_chunks": [h.hexdigest() for h in self._hashers]}
