"""The memory tier: the newest valid checkpoint, kept in this process's host memory.

Restoring from it costs a memory copy: a run that rolls back in process (a loss spike, a
NaN) needs no storage at all, and the peer tier computes its deltas against it. It holds the
snapshot buffers themselves, no copy: when a save has been validated its buffers move here and
the buffers of the checkpoint they replace go back to the snapshot pool
(:class:`~ckptpilot.capture.state.HostBufferPool`), which owns every buffer set and may take
the held one back for a capture (:meth:`MemoryTier.reclaim`) — so the tier never adds host memory
beyond the ``async.max_pending`` snapshot sets. ``max_bytes`` bounds what it keeps.

Lost with the process (and the node); SIGKILL-safe recovery needs the peer or remote tier.

It implements :class:`~ckptpilot.tiers.base.CheckpointTier` (``put``/``get``/``steps``/
``discard``/``close``): ``hold`` and ``put`` keep the arena itself with its XXH3-128 digest
(taken on the writer thread, which holds it; the training thread's stall is the capture
alone), so a ``get`` detects a held buffer that was written to after it was kept (a pool bug
reusing it, a stray write). XXH3, not SHA256: the bytes never leave this process, so the
digest guards against accidents, not forgers, and it costs a fraction of a SHA256 pass.

Threading: the writer thread calls ``hold`` / ``put``; the training thread ``newest`` and,
through the pool, ``reclaim``; a lock guards the entry and is never held while calling the
pool.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from ckptpilot.capture.state import HostBufferPool, Snapshot
from ckptpilot.errors import IntegrityError, NoCheckpointError
from ckptpilot.tiers.base import CheckpointImage, PutReceipt, TierCapabilities
from ckptpilot.tiers.peer.digest import digest_of
from ckptpilot.vocab import Level, RetentionClass, Tier


@dataclass(frozen=True)
class MemoryEntry:
    """The held snapshot and the XXH3-128 ``digest`` of its arena, taken when it was kept
    (None: a snapshot without an arena)."""

    snapshot: Snapshot
    level: str
    reason: str = ""
    retention_class: str = RetentionClass.ROUTINE.value
    score: float | None = None
    digest: str | None = None

    @property
    def step(self) -> int:
        return self.snapshot.step


class MemoryTier:
    name = "memory"
    kind = Tier.MEMORY
    capabilities = TierCapabilities(durable=False, survives_node_loss=False,
                                    folds_deltas=False, speed=Tier.MEMORY.speed,
                                    keeps_older=False)

    def __init__(self, max_bytes: int, pool: HostBufferPool) -> None:
        self.max_bytes = max_bytes
        self._pool = pool
        self._entry: MemoryEntry | None = None
        self._lock = threading.Lock()
        pool.lend(self.reclaim)

    def hold(self, snapshot: Snapshot, level: str) -> bool:
        """Keep ``snapshot`` as the newest; the snapshot it replaces goes back to the pool.
        False when it is not kept — then the caller still owns its buffers. A snapshot over
        ``max_bytes`` is not kept, and the older one held is dropped too: the tier must never
        offer a checkpoint older than the newest saved one as the newest. Digests the arena
        (on the caller's thread: the writer's)."""
        digest = None if snapshot.arena is None else digest_of(snapshot.arena.numpy())
        return self._keep(MemoryEntry(snapshot, level, digest=digest))

    def _keep(self, entry: MemoryEntry) -> bool:
        with self._lock:
            held = self._entry
            if held is not None and held.snapshot.step > entry.step:
                return False
            kept = entry.snapshot.nbytes <= self.max_bytes
            self._entry = entry if kept else None
        # The same arena put again is still held: returning it to the pool would let the
        # next capture overwrite it.
        if held is not None and held.snapshot.arena is not entry.snapshot.arena:
            self._pool.give_back(held.snapshot)
        return kept

    def put(self, image: CheckpointImage, base: CheckpointImage | None = None) -> PutReceipt:
        """Hold ``image``'s arena itself (no copy; ``base`` is ignored). Not kept
        (``kept=False``) when it is over ``max_bytes`` — the older image is dropped then — or
        older than the one held."""
        snapshot = image.snapshot()
        digest = digest_of(image.arena.numpy())
        kept = self._keep(MemoryEntry(snapshot, image.level.value, image.reason,
                                      image.retention_class.value, image.score, digest))
        return PutReceipt(image.step, f"memory:step {image.step}",
                          image.nbytes if kept else 0, kept=kept)

    def get(self, step: int) -> CheckpointImage:
        """A copy of the held image (its buffers go back to the snapshot pool later), checked
        against the digest taken when it was kept."""
        with self._lock:
            held = self._entry
            if held is None or held.step != step:
                raise NoCheckpointError(
                    f"memory:step {step}: not held (the memory tier holds "
                    f"{'nothing' if held is None else f'step {held.step}'}); restore it from "
                    "the peer or remote tier")
            snap = held.snapshot
            got = CheckpointImage.copied(
                step, snap.meta, snap.tensors, level=Level(held.level), reason=held.reason,
                retention_class=RetentionClass(held.retention_class), score=held.score)
            got = replace(got, source=f"memory:step {step}", bytes_read=got.nbytes)
        if held.digest is not None:
            actual = digest_of(got.arena.numpy())
            if actual != held.digest:
                raise IntegrityError(f"memory:step {step} (the held arena changed after it "
                                     "was kept)", held.digest, actual)
        return got

    def steps(self) -> list[int]:
        with self._lock:
            return [] if self._entry is None else [self._entry.step]

    def discard(self, step: int) -> None:
        with self._lock:
            held = self._entry
            if held is None or held.step != step:
                return
            self._entry = None
        self._pool.give_back(held.snapshot)

    def close(self) -> None:
        """Forget the held image (its buffers go back to the pool); idempotent."""
        with self._lock:
            held, self._entry = self._entry, None
        if held is not None:
            self._pool.give_back(held.snapshot)

    def base_for(self, step: int | None, layout: object) -> Snapshot | None:
        """The held snapshot if it is of ``step`` with ``layout`` (a delta base); the caller
        pins it in the pool first, so that no capture takes it while it is read."""
        with self._lock:
            held = self._entry
            if held is None or held.step != step or held.snapshot.layout != layout:
                return None
            return held.snapshot

    def reclaim(self) -> Snapshot | None:
        """Give the held snapshot's buffers up for a capture (the pool calls this when it
        may allocate no more); the tier is empty until the next save is kept."""
        with self._lock:
            held, self._entry = self._entry, None
        return None if held is None else held.snapshot

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
