"""The memory tier: the newest valid checkpoint, kept in this process's host memory.

Restoring from it costs a memory copy: a run that rolls back in process (a loss spike, a
NaN) needs no storage at all, and the peer tier computes its deltas against it. It holds the
snapshot buffers themselves, no copy: when a save has been validated its buffers move here and
the buffers of the checkpoint they replace go back to the snapshot pool. When the pool has
no free set for a new capture, the capture takes the buffers held here (``take``)
and the tier is empty until that save completes — so the tier never adds host memory beyond
the ``async.max_pending`` snapshot sets. ``max_bytes`` bounds what it keeps. A capture
allocates a new set only while fewer than ``max_pending`` exist, so with saves that finish
before the next one starts the tier keeps the previous snapshot — the base of the peer tier's
deltas — while the next is captured into a second set; under back-pressure (a capture while
every other set is in flight) it gives the held one up and the next peer put is full. While
the writer XORs against the held snapshot it is pinned: a capture then allocates one set
beyond ``max_pending`` instead of overwriting it.

Lost with the process (and the node); SIGKILL-safe recovery needs the peer or remote tier.

Threading: the writer thread calls ``hold``; the training thread ``take`` and
``newest``; a lock guards the entry.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ckptpilot.state import HostBufferPool, Snapshot


@dataclass(frozen=True)
class MemoryEntry:
    snapshot: Snapshot
    level: str

    @property
    def step(self) -> int:
        return self.snapshot.step


class MemoryTier:
    name = "memory"

    def __init__(self, max_bytes: int, pool: HostBufferPool, *, max_sets: int) -> None:
        self.max_bytes = max_bytes
        self._pool = pool
        self._max_sets = max_sets
        self._sets = 0  # buffer sets the captures were told to allocate
        self._entry: MemoryEntry | None = None
        self._pinned = False
        self._lock = threading.Lock()

    def hold(self, snapshot: Snapshot, level: str) -> bool:
        """Keep ``snapshot`` as the newest; the snapshot it replaces goes back to the pool.
        False when it is not kept — then the caller still owns its buffers. A snapshot over
        ``max_bytes`` is not kept, and the older one held is dropped too: the tier must never
        offer a checkpoint older than the newest saved one as the newest."""
        with self._lock:
            held = self._entry
            if held is not None and held.snapshot.step > snapshot.step:
                return False
            kept = snapshot.nbytes <= self.max_bytes
            self._entry = MemoryEntry(snapshot, level) if kept else None
        if held is not None:
            self._pool.give_back(held.snapshot)
        return kept

    def base_for(self, step: int | None, layout: object) -> Snapshot | None:
        """The held snapshot if it is of ``step`` with ``layout``, pinned until ``unpin``: a
        capture meanwhile allocates rather than overwrite it (the writer is reading it)."""
        with self._lock:
            held = self._entry
            if held is None or held.step != step or held.snapshot.layout != layout:
                return None
            self._pinned = True
            return held.snapshot

    def unpin(self) -> None:
        with self._lock:
            self._pinned = False

    def take(self) -> Snapshot | None:
        """Buffers for the next capture: a free pool set; else None (allocate) while fewer
        than ``max_sets`` sets exist or the held set is pinned; else the ones held here."""
        reuse = self._pool.take()
        if reuse is not None:
            return reuse
        with self._lock:
            if self._pinned:
                return None  # one set over max_sets until the base is released
            if self._sets < self._max_sets or self._entry is None:
                self._sets += 1
                return None
            held, self._entry = self._entry, None
        return held.snapshot

    def newest(self) -> MemoryEntry | None:
        with self._lock:
            return self._entry

    def drop_after(self, step: int) -> None:
        """Forget a checkpoint newer than ``step`` (a run restored to an earlier step must not
        come back to the continuation it abandoned)."""
        with self._lock:
            held = self._entry
            if held is None or held.snapshot.step <= step:
                return
            self._entry = None
        self._pool.give_back(held.snapshot)
