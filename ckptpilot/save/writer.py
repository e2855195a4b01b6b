"""The writer: a captured snapshot to verified, recorded bytes on its tiers, off the training
thread.

This module owns :class:`CheckpointWriter` and :class:`SaveRecord`. One background thread
waits for a snapshot's device copies (``Snapshot.fence``: nothing reads it before), then
executes its :class:`~ckptpilot.save.plan.SavePlan` in one loop over the tiers it names, each
one a :class:`~ckptpilot.tiers.base.CheckpointTier` the assembly built, through the same
two phases: stage → record ``pending`` → validate → publish and record ``valid`` (or abort,
which sets the bytes aside, and record ``corrupted``, with an alert: the previous valid
checkpoint stays the recovery point). What differs between tiers comes from their
capabilities, never their names: a durable tier's save first makes room in the disk budget;
a tier that folds deltas gets the keeper's image of its previous step as the base; a tier
that keeps no older image supersedes their rows once it commits; a tier that is not durable
may fail a save, which then goes to the plan's fallback (the durable tier's failure is the
run's error); a :class:`~ckptpilot.tiers.base.Collective` tier (the sharded tier: one DCP
checkpoint of every rank) is refused by every rank when the first rank's disk budget
refuses it, given up by every rank when one fails before its put, and records its
``pending`` row from inside its stage (``StageOptions.written``). A valid save then stays
in the keeper (the memory tier, through the same protocol) or its buffers go back to the
pool. Back-pressure: at most ``async.max_pending`` snapshots exist at once
(:meth:`acquire_slot` waits for one).

An exception in a job is kept and raised on the training thread by :meth:`raise_errors` as
``CheckpointWriteError`` naming the step and the tier it happened in; it is never swallowed.
Other work that must run after the saves queued before it (a metric on a row, a rollback's
protection) goes through :meth:`run_after`.

It must not decide what to save or where (the scheduler and the plan did), nor name a
concrete tier (``tests/test_layout.py``). Threading: the training thread calls the public
methods; everything else runs on the writer thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from ckptpilot.background import background_pool, lift, settle, urgent
from ckptpilot.capture.state import HostBufferPool, Snapshot
from ckptpilot.catalog import Catalog
from ckptpilot.errors import CheckpointWriteError, CkptPilotError
from ckptpilot.retention.auto import AutoPruner, DiskBudgetError
from ckptpilot.save.plan import SavePlan
from ckptpilot.telemetry import Telemetry
from ckptpilot.tiers.base import (
    BaseKeeper,
    CheckpointImage,
    CheckpointTier,
    Collective,
    Staged,
    StageOptions,
)
from ckptpilot.vocab import CheckpointKey, Level, RetentionClass, Status, Tier

__all__ = ["CheckpointWriter", "SaveRecord"]

log = logging.getLogger("ckptpilot")

PATIENCE_SECONDS = 1.0
"""The least time a save may wait for idle cores before it is lifted (``_rescue``)."""


@dataclass(frozen=True)
class SaveRecord:
    """One published checkpoint. ``stall_seconds`` is what the training thread paid for it
    (back-pressure wait + snapshot copy); ``persist_seconds`` ran in the background."""

    step: int
    level: Level
    reason: str
    retention_class: RetentionClass
    stall_seconds: float
    persist_seconds: float
    validate_seconds: float
    bytes: int
    location: str
    status: Status  # valid, or corrupted when post-write validation refused it
    bytes_raw: int = 0  # the snapshot's tensor bytes before the codecs
    write_seconds: float = 0.0  # encode + write + fsync (peers: the put), before validation
    tier: Tier = Tier.REMOTE  # where it went (peer: the peers; an organ also to the remote)


@dataclass(eq=False)
class _Job:
    """One job queued on the writer thread, in submission order. ``tier`` is the tier the
    writer is writing to at the moment: the writer thread sets it before each tier's write
    and the training thread reads it once ``future`` is done, so a failure names the tier it
    happened in. None while the job touches no tier (metadata rows only)."""

    step: int
    what: str
    future: Future[Any] = field(init=False)
    tier: Tier | None = None
    queued: float = field(default_factory=time.monotonic)


class CheckpointWriter:
    """Executes save plans on one background thread; see the module docstring."""

    def __init__(self, *, catalog: Catalog, tiers: Mapping[Tier, CheckpointTier],
                 keeper: CheckpointTier | None, pool: HostBufferPool, telemetry: Telemetry,
                 max_pending: int, pruner: AutoPruner | None = None) -> None:
        """``tiers``: the tier of each kind a plan may name; ``keeper``: the tier a valid
        save stays in when its plan says so (the memory tier; None when it is off), which
        also lends the delta bases."""
        self._catalog = catalog
        self._pruner = pruner
        self._rank = catalog.rank
        self._tiers = dict(tiers)
        self._keeper = keeper
        self._pool = pool
        self._telemetry = telemetry
        self._slots = threading.BoundedSemaphore(max_pending)
        self._executor = background_pool(1, "ckptpilot-writer")
        self._jobs: deque[_Job] = deque()
        self._taken: dict[Tier, int] = {}  # the newest step each tier took from us
        self.saves: list[SaveRecord] = []
        self._lifted: _Job | None = None  # the save lifted off idle priority (see _rescue)

    # -- training thread -------------------------------------------------------------------

    def acquire_slot(self) -> None:
        """Wait for room for one more snapshot (back-pressure); :meth:`submit` or
        :meth:`release_slot` gives it back."""
        if not self._slots.acquire(blocking=False):
            with urgent():  # training now waits for the saves: they may not starve
                self._slots.acquire()

    def release_slot(self) -> None:
        self._slots.release()

    def capture_and_submit(self, take: Callable[[], Snapshot], plan: SavePlan) -> float:
        """Wait for a slot, take the snapshot (``take``) and queue its save; returns the
        stall the training thread paid (the wait and the copy)."""
        t0 = time.perf_counter()
        self.acquire_slot()
        try:
            snapshot = take()
        except BaseException:
            self.release_slot()
            raise
        stall = time.perf_counter() - t0
        self.submit(snapshot, plan, stall)
        return stall

    def submit(self, snapshot: Snapshot, plan: SavePlan, stall: float) -> None:
        """Queue the save of ``snapshot`` (its slot already acquired), tagged with the
        continuation it belongs to (``storage.lineage``: none before the first restore)."""
        if self._catalog.branch:
            snapshot.meta["branch"] = self._catalog.branch
        job = _Job(snapshot.step, "save")
        job.future = self._executor.submit(self._persist, snapshot, plan, stall, job)
        self._jobs.append(job)

    def run_after(self, step: int, what: str, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the writer thread after every job queued before it."""
        job = _Job(step, what)
        job.future = self._executor.submit(fn, *args)
        self._jobs.append(job)

    def raise_errors(self) -> None:
        """Raise the first error of a finished job as ``CheckpointWriteError``; lift a save
        that has waited too long for idle cores (:meth:`_rescue`)."""
        self._rescue()
        while self._jobs and self._jobs[0].future.done():
            job = self._jobs.popleft()
            error = job.future.exception()
            if error is not None:
                raise CheckpointWriteError(
                    f"background {job.what} of step {job.step}{self._tier_words(job.tier)} "
                    f"failed: {error}") from error

    def _rescue(self) -> None:
        """Background threads run at idle priority (``ckptpilot.background``): on cores that
        training (or anything else) keeps busy, a save could wait indefinitely, and the
        newest recovery point fall behind. A save queued longer than
        :meth:`_patience_seconds` ago is lifted to ``nice 10`` until it is done."""
        if self._lifted is not None:
            if not self._lifted.future.done():
                return
            self._lifted = None
            settle()
        oldest = next((job for job in self._jobs
                       if job.what == "save" and not job.future.done()), None)
        if oldest is not None and time.monotonic() - oldest.queued > self._patience_seconds():
            log.info("the save of step %d has waited %.1f s for idle cores: it now runs at "
                     "nice 10", oldest.step, time.monotonic() - oldest.queued)
            self._lifted = oldest
            lift()

    def _patience_seconds(self) -> float:
        """How long a save may take at idle priority: twice the quickest of the last saves
        (what a save costs when it is not starved), and never less than :data:`PATIENCE_SECONDS`."""
        recent = [r.persist_seconds for r in self.saves[-5:]]
        return max(PATIENCE_SECONDS, 2 * min(recent, default=0.0))

    def flush(self) -> None:
        """Wait for every queued job; raises the first background error."""
        with urgent():
            for job in list(self._jobs):
                job.future.exception()
        self.raise_errors()

    def wait(self, timeout_seconds: float) -> bool:
        """Wait up to ``timeout_seconds`` for every queued job; True when all are done. Their
        errors stay for :meth:`raise_errors` (a preemption's deadline must not wait longer)."""
        pending = [job.future for job in self._jobs]
        with urgent():  # a preemption's grace period: the saves may not wait for idle cores
            return not futures.wait(pending, timeout=timeout_seconds).not_done

    def shutdown(self) -> None:
        self._executor.shutdown()
        if self._lifted is not None:
            self._lifted = None
            settle()

    def _tier_words(self, kind: Tier | None) -> str:
        if kind is None:
            return ""
        keeper = self._keeper
        tier = keeper if keeper is not None and keeper.kind is kind else self._tiers.get(kind)
        return f" to {tier.where}" if tier is not None else f" to the {kind.value} tier"

    # -- writer thread ---------------------------------------------------------------------

    def _persist(self, snapshot: Snapshot, plan: SavePlan, stall: float,
                 job: _Job) -> SaveRecord | None:
        """Write one save to the tiers of its plan; a valid snapshot's buffers then stay in
        the memory tier (the base of the next peer deltas). Its device copies are waited for
        before anything reads it; buffers whose copies may still run are never reused."""
        kept, waited = False, snapshot.fence is None
        try:
            if snapshot.fence is not None:
                snapshot.fence.wait()
                waited = True
            intent = plan.intent
            image = CheckpointImage.of(snapshot, level=intent.level, reason=intent.reason,
                                       retention_class=intent.retention_class,
                                       score=intent.score)
            record, refused = None, False
            fallback = [] if plan.fallback is None else [plan.fallback]
            for i, kind in enumerate([*plan.tiers, *fallback]):
                if i == len(plan.tiers) and (record is not None or refused):
                    break  # the fallback is for a plan no tier took
                job.tier = kind
                try:
                    record = self._write(kind, image, plan, stall) or record
                except DiskBudgetError as e:
                    self.refuse(snapshot.step, snapshot.nbytes, e)
                    refused = True
            job.tier = None
            if record is None:
                assert refused, f"no tier took step {snapshot.step}: {plan}"
                return None
            self.saves.append(record)
            self._telemetry.save(snapshot.step, {
                "checkpoint/save_seconds": record.persist_seconds,
                "checkpoint/stall_seconds": stall,
                "checkpoint/validate_seconds": record.validate_seconds,
                "checkpoint/bytes": float(record.bytes),
                "checkpoint/ratio": snapshot.nbytes / max(record.bytes, 1),
            })
            if (record.status is Status.VALID
                    and self._tiers[record.tier].capabilities.durable):
                self.retain()
            if (record.status is Status.VALID and plan.keep_in_memory
                    and self._keeper is not None):
                job.tier = self._keeper.kind
                kept = self._keeper.put(image).kept
            return record
        except Exception:
            log.exception("background save of step %d failed", snapshot.step)
            raise
        finally:
            if waited and not kept:  # a failed wait leaves buffers a copy may still write
                self._pool.give_back(snapshot)
            self._slots.release()

    def refuse(self, step: int, nbytes: int, error: DiskBudgetError) -> None:
        """A save the disk budget has no room for: said loudly, recorded, and training goes
        on (nothing of it was written)."""
        log.error("ALERT: step %d was not saved: %s. Training goes on; the previous valid "
                  "checkpoint stays the recovery point.", step, error)
        self._telemetry.save(step, {"checkpoint/refused_bytes": float(nbytes)})
        self._catalog.store.audit("save-refused", {"step": step, "rank": self._rank,
                                                   "reason": str(error)})

    def make_room(self, step: int, nbytes: int) -> DiskBudgetError | None:
        """(writer thread) Prune what the disk budget needs before ``nbytes`` of step ``step``
        (this rank's part) are written; the refusal when even that is not enough. Only the
        rank that decides retention (rank 0) has a pruner: None on the others."""
        if self._pruner is None or not self._pruner.budgeted:
            return None
        try:
            self._pruner.make_room(step, nbytes)
        except DiskBudgetError as e:
            return e
        return None

    def retain(self) -> None:
        """(writer thread) Retention after a published save (``retention.auto``); a failure
        is logged and retried by the next one: a checkpoint kept too long is no loss."""
        if self._pruner is None or not self._pruner.auto:
            return
        try:
            self._pruner.prune()
        except (OSError, CkptPilotError, SQLAlchemyError) as e:
            log.warning("retention after the save failed (the next save retries): %s", e)

    def _write(self, kind: Tier, image: CheckpointImage, plan: SavePlan,
               stall: float) -> SaveRecord | None:
        """One tier's save: stage → record ``pending`` → validate → publish and record
        ``valid``, or abort and record ``corrupted``. None when a tier that is not durable
        could not take it (its row ``corrupted``, the plan's fallback next); a durable tier's
        failure propagates (the run's error)."""
        tier = self._tiers.get(kind)
        if tier is None:
            raise ValueError(f"a save plan cannot write to the {kind.value} tier: this pilot "
                             f"has {sorted(t.value for t in self._tiers)}")
        t0 = time.perf_counter()
        if tier.capabilities.durable:
            refusal = self._room_for(tier, image)
            if refusal is not None:
                raise refusal
        self._retire(tier, kind, image)
        keeper = self._keeper
        base = None
        if tier.capabilities.folds_deltas and isinstance(keeper, BaseKeeper):
            self._pool.pin()  # before looking: no capture may take the base while it is read
            base = keeper.base_for(self._taken.get(kind), image.layout)
            if base is None:
                self._pool.unpin()
        try:
            return self._two_phases(tier, image, base, plan, stall, t0)
        finally:
            if base is not None:
                self._pool.unpin()

    def _room_for(self, tier: CheckpointTier, image: CheckpointImage) -> DiskBudgetError | None:
        """(writer thread) The disk budget's refusal of ``image`` on a durable tier, or None.
        A :class:`~ckptpilot.tiers.base.Collective` tier's save is refused on every rank when
        the first rank refuses it: an error checking the budget is a refusal there (raised
        before the others learn the answer, it would leave them waiting for ever)."""
        collective = isinstance(tier, Collective)
        try:
            refusal = self.make_room(image.step, image.nbytes)
        except (OSError, CkptPilotError, SQLAlchemyError) as e:
            if not collective:
                raise
            refusal = DiskBudgetError(f"step {image.step}: the disk budget could not be "
                                      f"checked: {e}")
        if collective and tier.first_rank_refuses(refusal is not None) and refusal is None:
            refusal = DiskBudgetError(f"step {image.step}: rank 0 found no room for it under "
                                      "the disk budget (rank 0's log says why)")
        return refusal

    def _retire(self, tier: CheckpointTier, kind: Tier, image: CheckpointImage) -> None:
        """(writer thread) Set aside this rank's copy of the step from an abandoned
        continuation (``Catalog.retire``), before staging: on an object store the staging is
        the checkpoint's own name. A :class:`~ckptpilot.tiers.base.Collective` tier's save
        is given up on every rank when any rank fails here (raised before the others learn
        it, it would leave them waiting for ever in the save's collectives)."""
        catalog, collective = self._catalog, isinstance(tier, Collective)
        error: Exception | None = None
        try:
            catalog.retire(catalog.key(image.step, kind),
                           lambda: tier.set_aside(image.step, "superseded"))
        except Exception as e:
            if not collective:
                raise
            error = e
        if collective and tier.any_rank_fails(error is not None):
            raise error or RuntimeError(
                f"step {image.step}: another rank could not set aside its copy from an "
                "abandoned continuation (its log says why); no rank saves the step")

    def _two_phases(self, tier: CheckpointTier, image: CheckpointImage,
                    base: CheckpointImage | None, plan: SavePlan, stall: float,
                    t0: float) -> SaveRecord | None:
        intent, catalog, step, kind = plan.intent, self._catalog, image.step, tier.kind
        keys: list[CheckpointKey] = []

        def pending(staged: Staged) -> None:
            keys.append(catalog.record_pending(
                step, kind, intent, location=staged.location, sha256=staged.digest,
                bytes_raw=staged.bytes_raw, bytes_encoded=staged.bytes_stored,
                codec=staged.codec, seconds_snapshot=stall,
                seconds_write=staged.write_seconds))

        staged = tier.stage(image, base, options=StageOptions(
            codecs=plan.codecs, fsync=plan.fsync, written=pending))
        if not keys:  # the tier wrote at its own pace: the row follows the stage
            pending(staged)
        key = keys[0]
        check = tier.validate(staged)
        if not check.ok:
            location = tier.abort(staged, check.reason) or staged.location
            catalog.moves.condemn(key, check.reason, location=location,
                                  seconds_validate=check.seconds)
            log.error("ALERT: the checkpoint of step %d failed validation and is kept as "
                      "%s: %s. The previous valid checkpoint stays the recovery point.",
                      step, location, check.reason)
            return self._record(image, plan, stall, t0, Status.CORRUPTED, kind, location,
                                staged.bytes_stored or 0, staged.write_seconds or 0.0,
                                check.seconds or 0.0)
        # The durable tier is the last resort: its failure is the run's error, not a fallback.
        survivable = () if tier.capabilities.durable else tier.failures
        try:
            receipt = tier.publish(staged)
        except survivable as e:
            catalog.moves.condemn(key, f"{kind.value} put failed: {e}")
            log.warning("%s could not take the %s of step %d (%s)%s", tier.where, intent.level,
                        step, e, f"; writing it to the {plan.fallback.value} tier instead"
                        if plan.fallback is not None else "")
            return None
        self._taken[kind] = step
        if not tier.capabilities.keeps_older:  # the tier dropped the older ones on this commit
            catalog.supersede_older(kind, step, f"superseded on {tier.where} by step {step}")
        # The row's digest is the receipt's: a restore proves the stored copy against it,
        # never against what the tier says (the peers: the digests this process sent).
        catalog.moves.publish(key, location=receipt.location, sha256=receipt.digest,
                              bytes_encoded=receipt.bytes_stored, codec=receipt.codec,
                              seconds_write=receipt.write_seconds,
                              seconds_validate=check.seconds)
        return self._record(image, plan, stall, t0, Status.VALID, kind, receipt.location,
                            receipt.bytes_stored, receipt.write_seconds, check.seconds or 0.0,
                            delta=receipt.delta, where=tier.where)

    def _record(self, image: CheckpointImage, plan: SavePlan, stall: float, t0: float,
                status: Status, kind: Tier, location: str, nbytes: int, write_seconds: float,
                validate_seconds: float, *, delta: bool = False, where: str = "") -> SaveRecord:
        intent = plan.intent
        seconds = time.perf_counter() - t0
        log.info("saved %s step %d%s: %.1f MB%s (%.1f MB raw), stall %.1f ms, persisted in "
                 "%.2f s (write %.2f s, validation %.2f s), %s (%s)", intent.level,
                 image.step, f" to {where}" if where else "", nbytes / 1e6,
                 " with deltas" if delta else "", image.nbytes / 1e6, stall * 1e3, seconds,
                 write_seconds, validate_seconds, status.value, intent.reason)
        return SaveRecord(step=image.step, level=Level(intent.level), reason=intent.reason,
                          retention_class=RetentionClass(intent.retention_class),
                          stall_seconds=stall, persist_seconds=seconds,
                          validate_seconds=validate_seconds, bytes=nbytes, location=location,
                          status=status, bytes_raw=image.nbytes, write_seconds=write_seconds,
                          tier=kind)
