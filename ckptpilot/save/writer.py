"""The writer: a captured snapshot to verified, recorded bytes on its tiers, off the training
thread.

This module owns :class:`CheckpointWriter` and :class:`SaveRecord`. One background thread
waits for a snapshot's device copies (``Snapshot.fence``: nothing reads it before), then
executes its :class:`~ckptpilot.save.plan.SavePlan` in one straight line per tier: encode →
record ``pending`` → put → verify → publish and record ``valid`` (or set aside and record
``corrupted``, with an alert: the previous valid checkpoint stays the recovery point); then
the snapshot's buffers stay in the memory tier or go back to the pool. Back-pressure: at most
``async.max_pending`` snapshots exist at once (:meth:`acquire_slot` waits for one).

An exception in a job is kept and raised on the training thread by :meth:`raise_errors` as
``CheckpointWriteError`` naming the step and the tier it happened in; it is never swallowed.
Other work that must run after the saves queued before it (a metric on a row, a rollback's
protection) goes through :meth:`run_after`.

It must not decide what to save or where: the scheduler and the plan did. Threading: the
training thread calls the public methods; everything else runs on the writer thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from ckptpilot.background import background_pool, lift, settle, urgent
from ckptpilot.capture.state import HostBufferPool, Snapshot
from ckptpilot.catalog import Catalog
from ckptpilot.codecs.selector import CodecSelector
from ckptpilot.errors import CheckpointWriteError, CkptPilotError
from ckptpilot.format.image import ImageMeta
from ckptpilot.retention.auto import AutoPruner, DiskBudgetError
from ckptpilot.save.plan import SavePlan
from ckptpilot.telemetry import Telemetry
from ckptpilot.tiers.memory import MemoryTier
from ckptpilot.tiers.peer import PEER_ERRORS, PeerTier
from ckptpilot.tiers.peer.client import FULL, stripe_record
from ckptpilot.tiers.remote.archive import (
    StagedArchive,
    checkpoint_name,
    model_layout,
    publish_organ,
    stage_organ,
)
from ckptpilot.tiers.remote.store import RemoteTier
from ckptpilot.validation.postwrite import PostWriteValidator
from ckptpilot.vocab import Level, RetentionClass, Status, Tier

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


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_MALLOC_TRIM = _load_malloc_trim()


def _trim_heap() -> None:
    """Give the heap that encoding freed back to the system: glibc keeps the freed memory of
    its worker-thread arenas, so without a trim every pulse leaves the process larger by a
    good part of the state. Runs on the writer thread, never on the training thread."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _codec_summary(staged: StagedArchive) -> str:
    """``raw`` for safetensors; else how many tensors each codec took, e.g.
    ``byteplane:12,raw:30``."""
    if staged.index is None:
        return "raw"
    counts = Counter(entry.codec for entry in staged.index.tensors)
    return ",".join(f"{codec}:{n}" for codec, n in sorted(counts.items()))


def _peer_codec(encodings: tuple[str, ...]) -> str:
    """The row's codec for a peer put: its shards' delta encodings (``blocks``,
    ``xor_delta``, joined by ``+``), ``raw`` when every shard travelled whole."""
    deltas = sorted({e for e in encodings if e != FULL})
    return "+".join(deltas) if deltas else "raw"


class CheckpointWriter:
    """Executes save plans on one background thread; see the module docstring."""

    def __init__(self, *, catalog: Catalog, remote: RemoteTier, peers: PeerTier | None,
                 memory: MemoryTier | None, pool: HostBufferPool,
                 validator: PostWriteValidator, pulse_codecs: CodecSelector,
                 telemetry: Telemetry, max_pending: int,
                 pruner: AutoPruner | None = None) -> None:
        self._catalog = catalog
        self._pruner = pruner
        self._rank = catalog.rank
        self._remote = remote
        self._peers = peers
        self._memory = memory
        self._pool = pool
        self._validator = validator
        self._pulse_codecs = pulse_codecs
        self._telemetry = telemetry
        self._slots = threading.BoundedSemaphore(max_pending)
        self._executor = background_pool(1, "ckptpilot-writer")
        self._jobs: deque[_Job] = deque()
        self._peer_step: int | None = None  # the newest checkpoint the peers took from us
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

    def _tier_words(self, tier: Tier | None) -> str:
        if tier is Tier.REMOTE:
            return f" to the remote tier {self._remote.url}"
        if tier is Tier.PEER and self._peers is not None:
            return f" to the peer tier ({', '.join(self._peers.endpoints)})"
        return "" if tier is None else f" to the {tier.value} tier"

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
            record, refused = None, False
            fallback = [] if plan.fallback is None else [plan.fallback]
            for i, tier in enumerate([*plan.tiers, *fallback]):
                if i == len(plan.tiers) and (record is not None or refused):
                    break  # the fallback is for a plan no tier took
                job.tier = tier
                try:
                    record = self._write(tier, snapshot, plan, stall) or record
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
            if record.status is Status.VALID and record.tier is Tier.REMOTE:
                self.retain()
            if (record.status is Status.VALID and plan.keep_in_memory
                    and self._memory is not None):
                job.tier = Tier.MEMORY
                kept = self._memory.hold(snapshot, plan.intent.level)
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
        """(writer thread) Retention after a published save (``retention.auto``; also called
        by the sharded path after its DCP saves); a failure is logged and retried by the next
        one: a checkpoint kept too long is no loss."""
        if self._pruner is None or not self._pruner.auto:
            return
        try:
            self._pruner.prune()
        except (OSError, CkptPilotError, SQLAlchemyError) as e:
            log.warning("retention after the save failed (the next save retries): %s", e)

    def _write(self, tier: Tier, snapshot: Snapshot, plan: SavePlan,
               stall: float) -> SaveRecord | None:
        if tier is Tier.PEER:
            return self._to_peers(snapshot, plan, stall)
        if tier is Tier.REMOTE:
            return self._to_remote(snapshot, plan, stall)
        raise ValueError(f"a save plan cannot write to the {tier.value} tier")

    def _to_peers(self, snapshot: Snapshot, plan: SavePlan, stall: float) -> SaveRecord | None:
        """Put the snapshot's arena on the peers; a shard travels as a delta against the
        memory tier's snapshot (when the peers hold that one) where ``tiers.peer.delta``
        and the sampled estimate say it is faster. Validation is the XXH3-128 stripe
        (``tiers/peer/digest.py`` says what it guarantees): every shard's digest, computed as
        it is sent, is checked by its peer on receipt and after each fold, and again by the
        client on fetch; the row keeps their ``stripe_record`` (``pending`` with the meta's
        SHA256 alone, the whole record once the put returns), which a restore checks the
        fetched copy against; the layout comes from the live state itself. Folds run after
        the put returns, so the row is valid before they finish: a fold that fails makes this
        checkpoint unfetchable and recovery falls back to the next tier. None when the peers
        could not take it."""
        assert self._peers is not None and snapshot.arena is not None
        intent = plan.intent
        t0 = time.perf_counter()
        meta = ImageMeta(step=snapshot.step, rank=self._rank, level=Level(intent.level),
                         reason=intent.reason,
                         retention_class=RetentionClass(intent.retention_class),
                         score=intent.score, created_unix=time.time(),
                         layout=tuple(snapshot.layout), state=snapshot.meta).encode()
        self._pool.pin()  # before looking: no capture may take the base while it is read
        held = (self._memory.base_for(self._peer_step, snapshot.layout)
                if self._memory is not None else None)
        if held is None or held.arena is None:
            self._pool.unpin()
            return self._put_to_peers(snapshot, plan, stall, t0, meta, None)
        try:
            return self._put_to_peers(snapshot, plan, stall, t0, meta,
                                      (held.step, held.arena.numpy()))
        finally:
            self._pool.unpin()

    def _put_to_peers(self, snapshot: Snapshot, plan: SavePlan, stall: float, t0: float,
                      meta: bytes, base: tuple[int, Any] | None) -> SaveRecord | None:
        assert self._peers is not None and snapshot.arena is not None
        intent, catalog = plan.intent, self._catalog
        catalog.retire(catalog.key(snapshot.step, Tier.PEER), lambda: None)
        key = catalog.record_pending(
            snapshot.step, Tier.PEER, intent, location=f"peer:{self._peers.run_id}/"
            f"{snapshot.step}", sha256=hashlib.sha256(meta).hexdigest(),
            bytes_raw=snapshot.nbytes, codec="raw", seconds_snapshot=stall)
        try:
            result = self._peers.put(snapshot.step, snapshot.arena.numpy(), meta, base=base)
        except PEER_ERRORS as e:
            catalog.moves.condemn(key, f"peer put failed: {e}")
            log.warning("the peer tier could not take the %s of step %d (%s)%s", intent.level,
                        snapshot.step, e, "; writing it to the remote tier instead"
                        if plan.fallback is not None else "")
            return None
        self._peer_step = snapshot.step
        # The peers dropped the older ones on this commit: they keep one state per run.
        catalog.supersede_older(Tier.PEER, snapshot.step,
                                f"superseded on the peers by step {snapshot.step}")
        location = f"peer:{self._peers.run_id}/{snapshot.step}@{','.join(result.endpoints)}"
        # The row's digest covers the meta and the digests this process computed as it sent:
        # a restore proves the peers' copy against it, never against what the peers say.
        catalog.moves.publish(key, location=location,
                              sha256=stripe_record(meta, result.stripe),
                              bytes_encoded=result.bytes_sent,
                              codec=_peer_codec(result.encodings),
                              seconds_write=result.seconds)
        seconds = time.perf_counter() - t0
        log.info("saved %s step %d to %d peers: %.1f MB sent (%d delta, %d full shards) for "
                 "%.1f MB, stall %.1f ms, %.2f s (%s)", intent.level, snapshot.step,
                 len(result.endpoints), result.bytes_sent / 1e6, result.delta_shards,
                 result.full_shards, snapshot.nbytes / 1e6, stall * 1e3, seconds,
                 intent.reason)
        return SaveRecord(step=snapshot.step, level=Level(intent.level), reason=intent.reason,
                          retention_class=RetentionClass(intent.retention_class),
                          stall_seconds=stall, persist_seconds=seconds, validate_seconds=0.0,
                          bytes=result.bytes_sent, location=location, status=Status.VALID,
                          bytes_raw=snapshot.nbytes, write_seconds=result.seconds,
                          tier=Tier.PEER)

    def _to_remote(self, snapshot: Snapshot, plan: SavePlan, stall: float) -> SaveRecord:
        """Stage → record ``pending`` → validate → publish and mark ``valid`` (or set aside
        and mark ``corrupted``).

        An organ is written as safetensors; a pulse through the codecs (``codecs`` policy),
        self-contained (see ``tiers.remote.archive``) — or as safetensors too when the codecs would
        save less transfer time at this tier's bandwidth than the container's extra hash pass
        costs."""
        intent, catalog, remote = plan.intent, self._catalog, self._remote
        t0 = time.perf_counter()
        refusal = self.make_room(snapshot.step, snapshot.nbytes)
        if refusal is not None:
            raise refusal
        name = checkpoint_name(snapshot.step, self._rank)
        # Before staging: on an object store the staging is the checkpoint's own name.
        catalog.retire(catalog.key(snapshot.step, Tier.REMOTE), lambda: (
            remote.path(remote.set_aside(name, "superseded")) if remote.exists(name) else None))
        codec_for = None
        if plan.codecs:
            self._pulse_codecs.new_save()
            if not self._pulse_codecs.plain_pays(snapshot.tensors):
                codec_for = self._pulse_codecs.codec_for
        staged = stage_organ(remote, snapshot, level=intent.level, reason=intent.reason,
                             retention_class=intent.retention_class, score=intent.score,
                             codec_for=codec_for, fsync=plan.fsync)
        write_seconds = time.perf_counter() - t0
        if codec_for is not None:
            _trim_heap()
        key = catalog.record_pending(
            snapshot.step, Tier.REMOTE, intent, location=remote.path(staged.staging),
            sha256=staged.manifest["self_sha256"], bytes_raw=snapshot.nbytes,
            bytes_encoded=staged.bytes, codec=_codec_summary(staged), seconds_snapshot=stall,
            seconds_write=write_seconds)
        check = self._validator.validate(remote, staged.staging, staged.manifest,
                                         model_layout(snapshot))
        if check.ok:
            publish_organ(remote, staged)
            location, status = remote.path(name), Status.VALID
            catalog.moves.publish(key, location=location, seconds_validate=check.seconds)
        else:
            location = remote.path(remote.set_aside(staged.staging, "corrupted", label=name))
            status = Status.CORRUPTED
            catalog.moves.condemn(key, check.reason, location=location,
                                  seconds_validate=check.seconds)
            log.error("ALERT: the checkpoint of step %d failed validation and is kept as "
                      "%s: %s. The previous valid checkpoint stays the recovery point.",
                      snapshot.step, location, check.reason)
        seconds = time.perf_counter() - t0
        log.info("saved %s step %d: %.1f MB (%.1f MB raw), stall %.1f ms, persisted in "
                 "%.2f s (write %.2f s, validation %.2f s), %s (%s)", intent.level,
                 snapshot.step, staged.bytes / 1e6, snapshot.nbytes / 1e6, stall * 1e3,
                 seconds, write_seconds, check.seconds, status.value, intent.reason)
        return SaveRecord(step=snapshot.step, level=Level(intent.level), reason=intent.reason,
                          retention_class=RetentionClass(intent.retention_class),
                          stall_seconds=stall, persist_seconds=seconds,
                          validate_seconds=check.seconds, bytes=staged.bytes,
                          location=location, status=status, bytes_raw=snapshot.nbytes,
                          write_seconds=write_seconds, tier=Tier.REMOTE)
