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
every other set is in flight) it gives the held one up and the next peer put is full.

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
        self._lock = threading.Lock()

    def hold(self, snapshot: Snapshot, level: str) -> bool:
        """Keep ``snapshot`` (which the caller gives up) as the newest; False when it is over
        ``max_bytes`` (then its buffers go back to the pool and the tier keeps what it had).
        An older snapshot than the one held is returned to the pool too."""
        with self._lock:
            held = self._entry
            if snapshot.nbytes > self.max_bytes or (held is not None
                                                    and held.snapshot.step > snapshot.step):
                self._pool.give_back(snapshot)
                return False
            self._entry = MemoryEntry(snapshot, level)
        if held is not None:
            self._pool.give_back(held.snapshot)
        return True

    def take(self) -> Snapshot | None:
        """Buffers for the next capture: a free pool set; else None (allocate) while fewer
        than ``max_sets`` sets exist; else the ones held here."""
        reuse = self._pool.take()
        if reuse is not None:
            return reuse
        with self._lock:
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
