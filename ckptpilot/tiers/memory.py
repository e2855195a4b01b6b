"""The memory tier: the newest valid checkpoint, kept in this process's host memory.

Restoring from it costs a memory copy: a run that rolls back in process (a loss spike, a
NaN) needs no storage at all, and the peer tier computes its deltas against it. It holds the
snapshot buffers themselves, no copy: when a save has been validated its buffers move here and
the buffers of the checkpoint they replace go back to the snapshot pool
(:class:`~ckptpilot.capture.state.HostBufferPool`), which owns every buffer set and may take
the held one back for a capture (:meth:`MemoryTier.reclaim`) — so the tier never adds host memory
beyond the ``async.max_pending`` snapshot sets. ``max_bytes`` bounds what it keeps.

Lost with the process (and the node); SIGKILL-safe recovery needs the peer or remote tier.

It implements :class:`~ckptpilot.tiers.base.CheckpointTier`: ``stage`` takes the arena's
XXH3-128 digest (on the writer thread, which holds it; the training thread's stall is the
capture alone) and ``publish`` keeps the arena itself, the one path the pilot and the
conformance suite take, so an ``open`` detects a held buffer that was written to after it
was kept (a pool bug reusing it, a stray write). XXH3, not SHA256: the bytes never leave
this process, so the digest guards against accidents, not forgers, and it costs a fraction
of a SHA256 pass.

Threading: the writer thread calls ``stage`` / ``publish``; the training thread ``newest`` and,
through the pool, ``reclaim``; a lock guards the entry and is never held while calling the
pool.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from ckptpilot.capture.state import HostBufferPool, Snapshot
from ckptpilot.errors import IntegrityError, NoCheckpointError
from ckptpilot.tiers.base import (
    PLAIN,
    Check,
    CheckpointImage,
    Layout,
    OpenedImage,
    PutReceipt,
    Staged,
    StageOptions,
    TierCapabilities,
    put_in_two_phases,
)
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
    where = "the memory tier"
    failures: tuple[type[BaseException], ...] = (IntegrityError, NoCheckpointError)
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

    def stage(self, image: CheckpointImage, base: CheckpointImage | None = None, *,
              options: StageOptions = PLAIN) -> Staged:
        """Digest the arena (``base`` and ``options`` do not apply: nothing is encoded or
        written); nothing is held until :meth:`publish`."""
        image.tensors()  # an arena that disagrees with its layout is refused here
        digest = digest_of(image.arena.numpy())
        return Staged(image.step, self.kind, f"memory:step {image.step}", digest, image.nbytes,
                      image.nbytes, "raw", 0.0, image)

    def validate(self, staged: Staged) -> Check:
        """Nothing left the process: the digest taken at stage is checked on every open."""
        return Check(True, "held in process")

    def publish(self, staged: Staged) -> PutReceipt:
        """Hold the image's arena itself (no copy), as the newest; the snapshot it replaces
        goes back to the pool. Not kept (``kept=False``, and the caller still owns the
        buffers) when it is over ``max_bytes`` — the older image is dropped then: the tier
        must never offer a checkpoint older than the newest saved one as the newest — or
        older than the one held."""
        image = staged.image
        kept = self._keep(MemoryEntry(image.snapshot(), image.level.value, image.reason,
                                      image.retention_class.value, image.score, staged.digest))
        return PutReceipt(image.step, staged.location, image.nbytes if kept else 0, kept=kept,
                          digest=staged.digest)

    def abort(self, staged: Staged, why: str) -> str | None:
        """Nothing was held: nothing to set aside."""
        return None

    def put(self, image: CheckpointImage, base: CheckpointImage | None = None) -> PutReceipt:
        return put_in_two_phases(self, image, base)

    def open(self, step: int, *, expect: str | None = None,
             at: str | None = None) -> OpenedImage:
        """:meth:`get`, checked against ``expect`` too when given (the digest of the put)."""
        image = self.get(step)
        if expect is not None:
            actual = digest_of(image.arena.numpy())
            if actual != expect:
                raise IntegrityError(f"memory:step {step} (not the image the caller put)",
                                     expect, actual)
        return OpenedImage.of(image)

    def locate(self, step: int) -> str:
        return f"memory:step {step}"

    def set_aside(self, step: int, why: str) -> str | None:
        """Nothing to keep for inspection in memory: the next put replaces the held step."""
        return None

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

    def base_for(self, step: int | None, layout: Layout) -> CheckpointImage | None:
        """The held image, no copy, if it is of ``step`` with ``layout`` (a delta base); the
        caller pins it in the pool first, so that no capture takes it while it is read."""
        with self._lock:
            held = self._entry
            if (held is None or held.step != step or held.snapshot.layout != layout
                    or held.snapshot.arena is None):
                return None
            return CheckpointImage.of(held.snapshot, level=held.level)

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
