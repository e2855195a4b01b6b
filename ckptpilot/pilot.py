"""CheckpointPilot: the one object a training loop talks to.

A facade over the parts of a checkpointing run (README "Layout"): per step, ``observe``
(training thread) measures the signals and the adaptive scheduler decides
(``scheduler/``; in a distributed run the ranks agree through ``agreement``) → a save copies
the complete state into host memory (``state.capture``, the only cost training pays) → the
writer (``writer``) executes the save's plan (``saveplan``) on its background thread, tier by
tier, recording each step in the catalog (``catalog``). ``restore`` runs the path backwards
(``restorer``); a confirmed loss spike goes to the rollback guard (``rollback``). Heartbeats
(level 0) are written every ``levels.heartbeat.every`` steps into a memory-mapped ring,
flushed by their own thread.

Threading and lifecycle:

1. construct on the training thread (registers a post-step hook on the optimizer, starts the
   health-probe, telemetry and heartbeat-flush threads);
2. ``restore()`` once, before the loop;
3. per step, ``observe()`` after ``optimizer.step()``, ``lr_scheduler.step()`` and after the
   data cursor moved — that is the step boundary at which every part of the state belongs to
   the same step;
4. ``close()`` (or leave the ``with`` block): waits for every pending save, surfaces errors,
   records a clean end in the failure ledger.

Only the writer thread touches checkpoint storage while training runs. An exception in the
writer is raised on the training thread at the next ``observe``/``save``/``close`` as
``CheckpointWriteError``; it is never swallowed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ckptpilot.agreement import RankAgreement
from ckptpilot.catalog import RECOVER_PIN, Catalog, SaveIntent
from ckptpilot.codecs.selector import CodecSelector
from ckptpilot.lifecycle import RecoveryReport, RunLifecycle
from ckptpilot.policy import Policy, load_policy
from ckptpilot.probes.gpu import GpuHealthProvider
from ckptpilot.probes.monitor import FROM_POLICY, HealthMonitor
from ckptpilot.restorer import PEER_FORMAT, Read, Restorer, SkippedCheckpoint
from ckptpilot.rollback import RollbackGuard
from ckptpilot.rundir import RunLease, run_identity
from ckptpilot.saveplan import plan_save
from ckptpilot.scheduler.adaptive import AdaptiveCheckpointScheduler
from ckptpilot.scheduler.decision import CheckpointDecision
from ckptpilot.state import HostBufferPool, Stateful, TrainingComponents, apply, capture
from ckptpilot.steps import StepDecider, write_heartbeat
from ckptpilot.storage.heartbeat import HeartbeatWriter, read_latest
from ckptpilot.storage.ledger import FailureLedger, Rollback
from ckptpilot.storage.metadata import MetadataStore
from ckptpilot.telemetry import Telemetry
from ckptpilot.tiers.memory import MemoryTier
from ckptpilot.tiers.peer import PeerTier
from ckptpilot.tiers.remote import RemoteTier
from ckptpilot.validation.postwrite import PostWriteValidator
from ckptpilot.vocab import Level, RecoverySource
from ckptpilot.writer import CheckpointWriter, SaveRecord

__all__ = ["PEER_FORMAT", "RECOVER_PIN", "CheckpointPilot", "RecoveryReport",
           "RecoverySource", "SaveRecord", "SkippedCheckpoint"]

log = logging.getLogger("ckptpilot")


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class CheckpointPilot:
    """Keeps a training run resumable: decides when to save, saves off-thread, restores.

    ``extras`` is a dict the caller may fill with JSON-able values (or tensors); it is saved
    with every checkpoint and replaced by the stored one on ``restore()``. ``gpu_health``
    replaces the NVML provider of the health probes (another accelerator's telemetry).
    """

    def __init__(self, policy: Policy | str | os.PathLike[str] | None = None, *,
                 model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 lr_scheduler: Stateful | None = None, scaler: Stateful | None = None,
                 data_state: Stateful | None = None, run_dir: str | os.PathLike[str] | None = None,
                 rank: int | None = None, world_size: int | None = None,
                 gpu_health: GpuHealthProvider | None = FROM_POLICY) -> None:
        if isinstance(policy, Policy):
            self.policy = policy.with_run_dir(run_dir) if run_dir is not None else policy
        else:
            self.policy = load_policy(policy, run_dir=run_dir)
        self.run_dir = Path(self.policy.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        dist_rank, dist_world = _dist_rank_world()
        self.rank = dist_rank if rank is None else rank
        self.world_size = dist_world if world_size is None else world_size
        self.components = TrainingComponents(model=model, optimizer=optimizer,
                                             lr_scheduler=lr_scheduler, scaler=scaler,
                                             data_state=data_state)
        self._closed = True  # until _open() finished: close() then has nothing to undo
        # First, before any file of the run is touched: a second pilot for this rank refuses.
        self._lease = RunLease(self.run_dir, self.rank)
        try:
            self._open(optimizer=optimizer, gpu_health=gpu_health)
        except BaseException:
            try:
                self._teardown().close()
            except Exception:
                log.exception("while stopping what a pilot that failed to start had started")
            raise

    def _open(self, *, optimizer: torch.optim.Optimizer | None,
              gpu_health: GpuHealthProvider | None) -> None:
        policy = self.policy
        self.remote = RemoteTier(policy.tiers.remote.url)
        self.run_id = run_identity(self.run_dir)
        self.store = MetadataStore(self.run_dir / "metadata.sqlite")
        # A directory whose rows are keyed by its folder's name (no run id yet) is re-keyed.
        self.store.adopt_run_id(self.run_dir.name, self.run_id)
        catalog = Catalog(self.store, self.run_id, self.rank, self.run_dir)
        self._validator = PostWriteValidator(policy.validation)
        self.scheduler = AdaptiveCheckpointScheduler(policy.scheduler, policy.retention)
        self.extras: dict[str, Any] = {}
        self.step = 0
        self.epoch: int | None = None
        self.last_loss: float | None = None
        self.last_decision: CheckpointDecision | None = None
        self.last_recovery: RecoveryReport | None = None

        max_pending = policy.async_.max_pending
        self._pool = HostBufferPool(max_pending)
        mem = policy.tiers.memory
        self.memory = (MemoryTier(mem.max_bytes, self._pool, max_sets=max_pending)
                       if mem.enabled else None)
        peer = policy.tiers.peer
        self.peers = (PeerTier.from_policy(
            peer, run_id=f"{self.run_dir.name}-{self.run_id}.rank{self.rank:05d}")
            if peer.enabled else None)
        codecs = policy.codecs
        pulse_codecs = CodecSelector(
            {"weights": codecs.weights, "optimizer": codecs.optimizer, "other": codecs.other},
            bandwidth_bytes_per_s=policy.tiers.remote.bandwidth, level=codecs.zstd_level,
            prefix_bits=codecs.prefix_bits, threads=codecs.threads)
        obs = policy.observability
        self._telemetry = Telemetry(self.run_dir, rank=self.rank, tensorboard=obs.tensorboard,
                                    decision_log=obs.decision_log)
        self._writer = CheckpointWriter(
            catalog=catalog, remote=self.remote, peers=self.peers, memory=self.memory,
            pool=self._pool, validator=self._validator, pulse_codecs=pulse_codecs,
            telemetry=self._telemetry, max_pending=max_pending)
        hb_path = self.run_dir / f"heartbeat_rank_{self.rank:05d}.ring"
        previous_heartbeat = read_latest(hb_path)
        self._heartbeat = HeartbeatWriter(hb_path)
        ledger = FailureLedger(self.run_dir / f"ledger_rank_{self.rank:05d}.jsonl")
        self._lifecycle = RunLifecycle(ledger, previous_heartbeat)
        self._rollback = RollbackGuard(policy.rollback, rank=self.rank, ledger=ledger,
                                       catalog=catalog, writer=self._writer,
                                       data_state=self.components.data_state)
        self._health: HealthMonitor | None = None
        if policy.scheduler.weights.system > 0:
            self._health = HealthMonitor(self.run_dir, policy.scheduler.system,
                                         provider=gpu_health)
            self._health.start()
        self._agreement = (RankAgreement(self.rank, self.world_size)
                           if self.world_size > 1 and torch.distributed.is_available()
                           and torch.distributed.is_initialized() else None)
        self._restorer = Restorer(catalog, self.remote, self.peers, self.memory,
                                  self._agreement)
        self._catalog = catalog
        self._steps = StepDecider(policy, self.scheduler, health=self._health,
                                  agreement=self._agreement, rollback=self._rollback)
        self._last_save_step: int | None = None
        self._base_step = 0
        self._optimizer_steps = 0
        self._observed = False
        self._closed = False
        self._hook = (optimizer.register_step_post_hook(self._after_optimizer_step)
                      if optimizer is not None else None)

    @property
    def saves(self) -> list[SaveRecord]:
        """The saves this process completed, oldest first."""
        return self._writer.saves

    @property
    def rollbacks(self) -> tuple[Rollback, ...]:
        """The instability rollbacks this rank of the run has made, oldest first (from the
        failure ledger: they survive a restart)."""
        return tuple(self._rollback.history)

    @property
    def last_grad_norm(self) -> float | None:
        """Global L2 norm of the gradients at the last probe (every ``grad.probe_every``)."""
        return self._steps.last_grad_norm

    # -- training thread -------------------------------------------------------------------

    def observe(self, loss: Any = None, *, step: int | None = None, epoch: int | None = None,
                grad_norm: Any = None) -> CheckpointDecision:
        """Mark a step boundary; returns the scheduler's decision for this step.

        ``step`` defaults to one more than the previous step (the pilot counts completed
        iterations; after ``restore()`` it continues from the restored step). ``loss`` may be
        a float or a one-element tensor (read with ``float()``, which synchronises a GPU).
        ``grad_norm``: the global gradient norm when the loop computes it anyway (e.g. the
        return value of ``clip_grad_norm_``); once given, the optimizer hook stops computing
        its own probe and this value is used every ``grad.probe_every`` steps.
        """
        self._check_open()
        self._writer.raise_errors()
        if grad_norm is not None:
            self._steps.caller_grad_norm(grad_norm, self._optimizer_steps)
        if step is None:
            step = self.step + 1 if self._observed else self._base_step + 1
        self._observed = True
        self.step = step
        if epoch is not None:
            self.epoch = epoch
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().item()
        self.last_loss = None if loss is None else float(loss)
        self._steps.tick()
        decision = self._decide()
        if step % self.policy.levels.heartbeat.every == 0:
            self._write_heartbeat()
        if self._steps.spike is not None:
            decision = self._rollback.on_spike(decision, self.step, *self._steps.spike,
                                               restore_before=self._restore_before)
            if decision.rollback_to is not None and self._agreement is not None:
                # The reduction started at this step may carry the same spike from a rank
                # that confirmed it a step later: every rank drops it, and starts afresh.
                self._agreement.drop()
        self._finish(decision)
        return decision

    def save(self, level: str = "organ", reason: str = "manual") -> bool:
        """Force a save of the current step; False if this step is already saved."""
        self._check_open()
        self._writer.raise_errors()
        lvl = Level(level)
        if lvl is Level.HEARTBEAT:
            raise ValueError("a heartbeat is written every step; force a 'pulse' or 'organ'")
        if not self._save(SaveIntent(lvl.value, reason, "important")):
            return False
        self.scheduler.note_save(self.step, lvl)
        return True

    def report_metric(self, name: str, value: float) -> None:
        """Attach a metric (e.g. a validation loss) to the checkpoint of the current step.

        Best-N retention (``retention.best``) ranks checkpoints by it, so the state it was
        measured on must exist: if the current step has no checkpoint yet, a pulse is saved.
        """
        self._check_open()
        self._writer.raise_errors()
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"metric {name!r} at step {self.step}: {value} is not finite")
        if self._save(SaveIntent("pulse", f"metric {name} reported", "important",
                                 metric=(name, value))):
            self.scheduler.note_save(self.step, Level.PULSE)
            return
        self._writer.run_after(self.step, "metric update", self._catalog.set_metric,
                               self.step, name, value)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any,
                              kwargs: Any) -> None:
        self._optimizer_steps += 1
        self._steps.probe(optimizer, self._optimizer_steps)
        # Without observe() the hook is the step boundary. The first optimizer step cannot
        # tell the two modes apart, so hook-time decisions start at the second one.
        if not self._observed:
            self.step = self._base_step + self._optimizer_steps
            if self._optimizer_steps >= 2:
                self._finish(self._decide())

    def _finish(self, decision: CheckpointDecision) -> None:
        self.last_decision = decision
        self._telemetry.decision(decision)
        if decision.save and decision.level is not None:
            self._save(SaveIntent(decision.level.value, decision.reason,
                                  decision.retention_class.value, decision.score))

    def _decide(self) -> CheckpointDecision:
        self._lifecycle.start(self._base_step)
        return self._steps.decide(self.step, self.last_loss)

    def _write_heartbeat(self) -> None:
        write_heartbeat(self._heartbeat, self.components, self.step, self._current_epoch(),
                        self.last_loss)

    def _save(self, intent: SaveIntent) -> bool:
        if self._last_save_step == self.step:
            return False
        t0 = time.perf_counter()
        self._writer.acquire_slot()
        try:
            snapshot = capture(self.components, step=self.step, epoch=self._current_epoch(),
                               extras=self.extras, rank=self.rank, world_size=self.world_size,
                               pool=self.memory or self._pool)
        except BaseException:
            self._writer.release_slot()
            raise
        stall = time.perf_counter() - t0
        self._steps.note_stall(stall)
        self._writer.submit(snapshot, plan_save(intent, self.policy), stall)
        self._last_save_step = self.step
        return True

    def _current_epoch(self) -> int | None:
        if self.epoch is not None:
            return self.epoch
        epoch = getattr(self.components.data_state, "epoch", None)
        return epoch if isinstance(epoch, int) else None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this CheckpointPilot is closed")

    # -- recovery --------------------------------------------------------------------------

    def restore(self, step: int | None = None) -> int:
        """Load the newest checkpoint that verifies (or exactly ``step``, or the step pinned
        by ``ckptpilot recover``); returns the step to resume from, 0 when the run has no
        checkpoint yet.

        From the fastest tier that holds it (memory → peer → remote), re-verified on read,
        walking back past what cannot be read (``last_recovery.skipped`` says why); raises
        ``NoCheckpointError`` when checkpoints exist (or are recorded) but none loads, never
        a silent restart from scratch; ``StateError`` when the state does not fit the live
        objects. Every rank of a distributed run restores the same step, or every rank
        raises. See :mod:`ckptpilot.restorer` for the order (SPEC §7). A dead previous run's
        interruption goes into the failure ledger; restoring the step an instability
        rollback returned to skips its batches again.
        """
        self._check_open()
        restored = self._restore(step)
        assert restored is not None
        return restored

    def _restore_before(self, step: int) -> int | None:
        """A rollback's restore: the newest step below ``step``, no pin, no ledger lifecycle
        records; None, with nothing changed, when no such step loads."""
        return self._restore(None, before=step)

    def _restore(self, step: int | None, before: int | None = None) -> int | None:
        t0 = time.perf_counter()
        restored = self._restorer.restore(step, self._apply, before=before,
                                          prepare=self.flush)
        if restored is None:
            return None
        read = restored.read
        self._after_restore(restored.step, None if read is None else read.level)
        if read is None:
            self.last_recovery = self._recovered(RecoverySource.NONE, 0, None, t0, None,
                                                 restored.skipped)
            return 0
        self.last_recovery = self._recovered(read.source, restored.step, read.level.value,
                                             t0, read.location, restored.skipped,
                                             read.bytes_read, lifecycle=before is None)
        if before is None:
            self._rollback.skip_again_after(restored.step)
        log.info("restored step %d from %s in %.2f s", restored.step, read.location,
                 self.last_recovery.seconds)
        return restored.step

    def _apply(self, read: Read) -> None:
        restored_extras = apply(self.components, read.meta, read.get_tensor)
        self.extras.clear()
        self.extras.update(restored_extras)
        self.epoch = read.meta.get("epoch")

    def _after_restore(self, step: int, level: Level | None) -> None:
        if self.memory is not None:
            self.memory.drop_after(step)
        self._catalog.abandon_after(step)
        self.scheduler.restart(step)
        self.step = self._base_step = step
        self._optimizer_steps = 0
        self._last_save_step = step
        if level is not None:
            self.scheduler.note_save(step, level)

    def _recovered(self, *args: Any, **kwargs: Any) -> RecoveryReport:
        report = self._lifecycle.recovered(*args, **kwargs)
        self._steps.mtbf_seconds = self._lifecycle.mtbf_seconds()
        return report

    # -- lifecycle -------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait for every pending save; raises the first background error."""
        self._writer.flush()

    def close(self) -> None:
        """Wait for every pending save, then stop every thread and release the run (the
        lease last); every step runs even when an earlier one raised, and the first error
        is raised after them."""
        if self._closed:
            return
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
        with self._teardown():
            self.flush()

    def _teardown(self) -> contextlib.ExitStack:
        """The stops and releases of a pilot, in order, as one stack whose every callback
        runs; safe on a pilot whose construction failed part-way."""
        stack = contextlib.ExitStack()
        stack.callback(self._lease.release)

        def then(name: str, method: str) -> None:
            part = getattr(self, name, None)
            if part is not None:
                stack.callback(getattr(part, method))

        then("store", "close")
        if getattr(self, "_lifecycle", None) is not None:
            stack.callback(lambda: self._lifecycle.end(self.step))
        then("peers", "close")
        then("_validator", "close")
        then("_telemetry", "close")
        then("_health", "stop")
        then("_heartbeat", "close")
        then("_agreement", "drop")
        then("_writer", "shutdown")
        return stack

    def __enter__(self) -> CheckpointPilot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> Mapping[str, Any]:
        """Totals over the saves this process completed."""
        stalls = [r.stall_seconds for r in self.saves]
        return {
            "saves": len(self.saves),
            "bytes": sum(r.bytes for r in self.saves),
            "median_stall_seconds": statistics.median(stalls) if stalls else None,
            "non_finite_steps": self._steps.non_finite_steps,
            "interval": self.last_decision.interval if self.last_decision else None,
            "base_interval": self.scheduler.base_interval,
            "step_seconds": self._steps.step_seconds,
            "mtbf_seconds": self._steps.mtbf_seconds,
        }
