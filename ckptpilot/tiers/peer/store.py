"""The peer daemon's memory: held shards, their accounting, eviction, leases and commits.

Owns: which shards a daemon holds (keyed by run, checkpoint, shard index), how many bytes
they and the transfers in progress take, least-recently-used eviction inside the memory
limit, per-run leases, and dropping checkpoints superseded by a committed one. Must not:
touch sockets or decode anything (the daemon folds deltas and hands the result in).

Memory accounting: a transfer first *reserves* its bytes (PUT: meta + shard; DELTA: meta +
the encoded delta + the shard it folds into), evicting least-recently-used checkpoints until
it fits; a reservation that cannot fit fails, so the daemon never holds more than
``mem_limit`` bytes of shard data (a few header-sized buffers aside). When a fold finishes,
the delta's bytes are released and the entry keeps meta + shard.

Never evicted: the newest committed checkpoint of each run, a checkpoint still folding, a
checkpoint that a pending fold reads as its base, and the checkpoint being written.

Commit: ``commit(run, c, stripe)`` marks c's shards committed and keeps the save's stripe
(every shard's digest) with them; a shard of c held here whose digest is not the stripe's
at its index is a leftover of another put of c (one that failed half-way) and is dropped. As
soon as every shard of c held here has folded correctly (immediately when there is nothing
to fold, or nothing of c here at all) the run's older checkpoints are dropped. Until then the
base stays, so a save that fails half-way never leaves this daemon with nothing.

Threading: every method may be called from any thread; one lock guards all state. The
``ready`` event of an entry is set once its bytes are final (at once for PUT, after the
fold for DELTA); readers wait on it outside the lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

Key = tuple[str, int, int]
"""(run_id, ckpt_id, shard_index)."""

SHARD_FIELDS = ("shard_count", "data_shards", "kind", "image_len", "shard_size",
                "meta_digest")
"""Header fields a shard keeps and returns on GET, with its ``digest`` (from the PUT's
trailer or the DELTA's header) and, once committed, the save's ``stripe``."""
_LIST_FIELDS = ("shard_count", "data_shards", "kind", "image_len", "shard_size")
"""The subset LIST returns (small, so a LIST reply of hundreds of shards fits a header)."""


@dataclass(eq=False)
class Entry:
    """One held shard. ``data`` is None while folding and after a failed fold."""

    key: Key
    info: dict[str, Any]
    meta: bytes
    data: np.ndarray | None
    nbytes: int
    base: Entry | None = None
    error: str | None = None
    committed: bool = False
    last_used: float = 0.0
    pins: int = 0
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def state(self) -> str:
        if not self.ready.is_set():
            return "folding"
        return "failed" if self.error is not None else "ready"


class ShardStore:
    """Shards held in RAM within ``mem_limit`` bytes (see the module docstring)."""

    def __init__(self, mem_limit: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if mem_limit < 1:
            raise ValueError(f"mem_limit must be >= 1 byte, got {mem_limit}")
        self.mem_limit = mem_limit
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[Key, Entry] = {}
        self._used = 0
        self._reserved = 0
        self._leases: dict[str, float] = {}
        self._pending_commits: dict[str, int] = {}

    # ------------------------------------------------------------------------- accounting

    @property
    def mem_used(self) -> int:
        """Bytes held plus bytes reserved by transfers in progress."""
        with self._lock:
            return self._used + self._reserved

    @property
    def n_runs(self) -> int:
        with self._lock:
            return len({k[0] for k in self._entries})

    def reserve(self, nbytes: int, *, writing: tuple[str, int]) -> bool:
        """Reserve ``nbytes`` for a transfer of checkpoint ``writing`` = (run, ckpt),
        evicting least-recently-used checkpoints as needed; False if it cannot fit."""
        with self._lock:
            while self._used + self._reserved + nbytes > self.mem_limit:
                victim = self._lru_victim(writing)
                if victim is None:
                    return False
                freed = self._remove_unit(*victim)
                log.info("evicted run %s checkpoint %d (%d bytes, least recently used) to make "
                         "room for %d bytes", victim[0], victim[1], freed, nbytes)
            self._reserved += nbytes
            return True

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            self._reserved -= nbytes

    def _lru_victim(self, writing: tuple[str, int]) -> tuple[str, int] | None:
        newest_committed: dict[str, int] = {}
        for (run, ckpt, _), e in self._entries.items():
            if e.committed and ckpt > newest_committed.get(run, -1):
                newest_committed[run] = ckpt
        units: dict[tuple[str, int], float] = {}
        pinned = {writing}
        for (run, ckpt, _), e in self._entries.items():
            units[(run, ckpt)] = max(units.get((run, ckpt), -1.0), e.last_used)
            if e.pins or not e.ready.is_set():
                pinned.add((run, ckpt))
        candidates = [(used, unit) for unit, used in units.items()
                      if unit not in pinned and newest_committed.get(unit[0]) != unit[1]]
        return min(candidates)[1] if candidates else None

    def _remove_unit(self, run: str, ckpt: int) -> int:
        freed = 0
        for key in [k for k in self._entries if k[0] == run and k[1] == ckpt]:
            freed += self._remove(key)
        return freed

    def _remove(self, key: Key) -> int:
        entry = self._entries.pop(key)
        self._used -= entry.nbytes
        if entry.base is not None:  # still folding: the fold will find its entry gone
            entry.base.pins -= 1
            entry.base = None
        return entry.nbytes

    # ---------------------------------------------------------------------------- writing

    def add(self, entry: Entry, *, reserved: int, lease_seconds: float) -> None:
        """Hold a finished shard (PUT), turning its reservation into held bytes."""
        entry.ready.set()
        self._insert(entry, reserved, lease_seconds)

    def base_of(self, run: str, base_id: int, shard_index: int) -> Entry | None:
        """The shard a delta would fold into, if held and not failed."""
        with self._lock:
            entry = self._entries.get((run, base_id, shard_index))
            return None if entry is None or entry.error is not None else entry

    def begin_fold(
        self, entry: Entry, base: Entry, *, reserved: int, lease_seconds: float
    ) -> bool:
        """Hold a shard whose bytes a fold will produce from ``base``; False (reservation
        released) if the base went away meanwhile."""
        with self._lock:
            if self._entries.get(base.key) is not base or base.error is not None:
                self._reserved -= reserved
                return False
            base.pins += 1
            entry.base = base
        self._insert(entry, reserved, lease_seconds)
        return True

    def finish_fold(self, entry: Entry, data: np.ndarray | None, error: str | None) -> None:
        """Record a fold's result: the shard bytes, or why it failed (the shard is then
        useless and only listed as failed). The delta's bytes are released either way."""
        with self._lock:
            held = self._entries.get(entry.key) is entry
            nbytes = len(entry.meta) + (data.size if data is not None else 0)
            if held:
                self._used += nbytes - entry.nbytes
            entry.nbytes = nbytes
            entry.data, entry.error = data, error
            if entry.base is not None:
                entry.base.pins -= 1
                entry.base = None
            entry.ready.set()
            run = entry.key[0]
            if held and self._pending_commits.get(run) == entry.key[1]:
                self._supersede(run, entry.key[1])

    def _insert(self, entry: Entry, reserved: int, lease_seconds: float) -> None:
        with self._lock:
            if entry.key in self._entries:
                self._remove(entry.key)
            entry.last_used = self._clock()
            self._entries[entry.key] = entry
            self._reserved -= reserved
            self._used += entry.nbytes
            self._renew(entry.key[0], lease_seconds)

    # ----------------------------------------------------------------------------- commits

    def commit(self, run: str, ckpt: int, lease_seconds: float, stripe: list[str]) -> int:
        """Mark ``ckpt`` committed (complete across peers) with its ``stripe``; returns how
        many of its shards are held here. Older checkpoints of the run are dropped once it
        has folded."""
        with self._lock:
            mine = []
            for k, e in list(self._entries.items()):
                if k[0] != run or k[1] != ckpt:
                    continue
                if len(stripe) != e.info["shard_count"] or stripe[k[2]] != e.info["digest"]:
                    log.warning("run %s checkpoint %d shard %d is not the one committed (another "
                                "put of it): dropped", *k)
                    self._remove(k)
                    continue
                e.committed = True
                e.info["stripe"] = list(stripe)
                mine.append(e)
            self._renew(run, lease_seconds)
            if ckpt >= self._pending_commits.get(run, -1):
                self._pending_commits[run] = ckpt
                self._supersede(run, ckpt)
            return len(mine)

    def _supersede(self, run: str, ckpt: int) -> None:
        mine = [e for k, e in self._entries.items() if k[0] == run and k[1] == ckpt]
        if any(e.state != "ready" for e in mine):
            return  # wait for the folds; a failed one keeps the older state
        older = {k[1] for k, e in self._entries.items()
                 if k[0] == run and k[1] < ckpt and not e.pins}
        for old in sorted(older):
            freed = self._remove_unit(run, old)
            log.debug("run %s checkpoint %d superseded by committed %d: freed %d bytes",
                      run, old, ckpt, freed)
        self._pending_commits.pop(run, None)

    # ----------------------------------------------------------------------------- reading

    def get(self, key: Key) -> Entry | None:
        """The entry (possibly still folding; wait on ``ready``), marked as used now."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.last_used = self._clock()
            return entry

    def listing(self, run: str) -> list[dict[str, Any]]:
        """What is held for ``run``: one dict per shard, for the LIST reply."""
        with self._lock:
            entries = [e for k, e in self._entries.items() if k[0] == run]
            return [{"ckpt_id": e.key[1], "shard_index": e.key[2], "committed": e.committed,
                     "state": e.state, **{f: e.info[f] for f in _LIST_FIELDS}}
                    for e in sorted(entries, key=lambda e: e.key)]

    # ------------------------------------------------------------------------------ leases

    def renew(self, run: str, lease_seconds: float) -> bool:
        """Extend the run's lease; True if anything of the run is held here."""
        with self._lock:
            self._renew(run, lease_seconds)
            return any(k[0] == run for k in self._entries)

    def _renew(self, run: str, lease_seconds: float) -> None:
        self._leases[run] = max(self._leases.get(run, 0.0), self._clock() + lease_seconds)

    def expire(self) -> list[tuple[str, int]]:
        """Free every run whose lease has run out; returns (run, bytes freed) per run."""
        now = self._clock()
        out = []
        with self._lock:
            for run, until in list(self._leases.items()):
                if until <= now:
                    del self._leases[run]
                    out.append((run, self._drop(run)))
        return out

    def drop(self, run: str) -> int:
        """Free everything of ``run``; returns the bytes freed."""
        with self._lock:
            self._leases.pop(run, None)
            return self._drop(run)

    def _drop(self, run: str) -> int:
        self._pending_commits.pop(run, None)
        return sum(self._remove(k) for k in [k for k in self._entries if k[0] == run])
