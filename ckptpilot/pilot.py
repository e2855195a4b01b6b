"""CheckpointPilot: the one object a training loop talks to.

A facade over the parts of a checkpointing run (docs/reference/layout.md): per step,
``observe`` (training thread) measures the signals and the adaptive scheduler decides
(``scheduler/``; in a distributed run the ranks agree through ``agreement``) → a save copies
the complete state into host memory (``capture/``, the only cost training pays) → the
writer (``save/writer``) executes the save's plan (``save/plan``) on its background thread, tier by
tier, recording each step in the catalog (``catalog``). ``restore`` runs the path backwards
(``restorer``); a confirmed loss spike goes to the rollback guard (``rollback``). Heartbeats
(level 0) are written every ``levels.heartbeat.every`` steps into a memory-mapped ring,
flushed by their own thread.

Threading and lifecycle:

1. construct on the training thread (hooks the optimizer's step, and for a CUDA model the
   forward: ``devicecopy``; starts the health-probe, telemetry, heartbeat-flush and hang
   ``watchdog`` threads; on the main thread, installs the ``preemption`` signal handlers);
2. ``restore()`` once, before the loop;
3. per step, ``observe()`` after ``optimizer.step()``, ``lr_scheduler.step()`` and after the
   data cursor moved — that is the step boundary at which every part of the state belongs to
   the same step, and where a preemption notice ends the run (``SystemExit(75)``);
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

from ckptpilot.agreement import process_rank_world
from ckptpilot.assembly import open_parts
from ckptpilot.capture.state import Stateful, TrainingComponents, unwrap_optimizer
from ckptpilot.catalog import SaveIntent
from ckptpilot.lifecycle import RecoveryReport
from ckptpilot.policy import Policy, load_policy
from ckptpilot.probes.gpu import GpuHealthProvider
from ckptpilot.probes.monitor import FROM_POLICY
from ckptpilot.restorer import Read, SkippedCheckpoint
from ckptpilot.rundir import RunLease
from ckptpilot.save.writer import SaveRecord
from ckptpilot.scheduler.decision import CheckpointDecision
from ckptpilot.steps import write_heartbeat
from ckptpilot.storage.ledger import Rollback
from ckptpilot.vocab import Level, RecoverySource

__all__ = ["CheckpointPilot", "RecoveryReport", "RecoverySource", "SaveRecord",
           "SkippedCheckpoint"]

log = logging.getLogger("ckptpilot")


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
        if optimizer is not None:
            optimizer = unwrap_optimizer(optimizer)
        dist_rank, dist_world = process_rank_world()
        self.rank = dist_rank if rank is None else rank
        self.world_size = dist_world if world_size is None else world_size
        self.components = TrainingComponents(model=model, optimizer=optimizer,
                                             lr_scheduler=lr_scheduler, scaler=scaler,
                                             data_state=data_state)
        # First, before any file of the run is touched: a second pilot for this rank refuses.
        self._lease = RunLease(self.run_dir, self.rank)
        self._closed = True  # until every part started: close() then has nothing to undo
        self._stops = contextlib.ExitStack()  # every part's stop in order, the lease last
        self._stops.callback(self._lease.release)
        self.step = self._base_step = self._optimizer_steps = 0
        try:
            parts = open_parts(self.policy, self.components, rank=self.rank,
                               world_size=self.world_size, gpu_health=gpu_health,
                               stops=self._stops, step_now=lambda: self.step)
            self.run_id, self.remote, self.store = parts.run_id, parts.remote, parts.store
            self.memory, self.peers, self.scheduler = parts.memory, parts.peers, parts.scheduler
            self._catalog, self._writer = parts.catalog, parts.writer
            self._telemetry, self._heartbeat, self._health = (parts.telemetry, parts.heartbeat,
                                                              parts.health)
            self._lifecycle, self._rollback, self._agreement = (parts.lifecycle, parts.rollback,
                                                                parts.agreement)
            self._restorer, self._steps, self._state = parts.restorer, parts.steps, parts.state
            self._preemption, self._watchdog = parts.preemption, parts.watchdog
            self._hook = (optimizer.register_step_post_hook(self._after_optimizer_step)
                          if optimizer is not None else None)
        except BaseException:
            try:
                self._stops.close()
            except Exception:
                log.exception("while stopping what a pilot that failed to start had started")
            raise
        self.extras: dict[str, Any] = {}
        self.epoch: int | None = None
        self.last_loss: float | None = None
        self.last_decision: CheckpointDecision | None = None
        self.last_recovery: RecoveryReport | None = None
        self._last_save_step: int | None = None
        self._observed = False
        self._closed = False

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
        if self._steps.preempt:  # an organ of this step, then SystemExit(75) (``preemption``)
            with self._watchdog.suspended():
                self._preemption.honour(self.step, lambda: self._save(SaveIntent(
                    Level.ORGAN.value, "preemption notice", "important")), self.close)
        self.last_decision = decision
        self._telemetry.decision(decision)
        if decision.save and decision.level is not None:
            self._save(SaveIntent(decision.level.value, decision.reason,
                                  decision.retention_class.value, decision.score))
        self._watchdog.left_boundary()

    def _decide(self) -> CheckpointDecision:
        if not self._lifecycle.started:  # tested inline: this runs at every step
            self._lifecycle.start(self._base_step)
        self._watchdog.beat(self.step)
        return self._steps.decide(self.step, self.last_loss)

    def _write_heartbeat(self) -> None:
        write_heartbeat(self._heartbeat, self.components, self.step, self._current_epoch(),
                        self.last_loss)

    def _save(self, intent: SaveIntent) -> bool:
        if self._last_save_step == self.step:
            return False
        with self._watchdog.suspended():  # back-pressure: a wait on our own writer
            stall = self._writer.capture_and_submit(lambda: self._state.capture(
                step=self.step, epoch=self._current_epoch(), extras=self.extras),
                self._state.plan(intent))
        self._steps.note_stall(stall)
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
        with self._watchdog.suspended():
            restored = self._restore(step)
        assert restored is not None
        return restored

    def _restore_before(self, step: int) -> int | None:
        """A rollback's restore: the newest step below ``step``, no pin, no ledger lifecycle
        records; None, with nothing changed, when no such step loads."""
        return self._restore(None, before=step)

    def _restore(self, step: int | None, before: int | None = None) -> int | None:
        t0 = time.perf_counter()
        restored = self._restorer.restore(step, self._apply, before=before, prepare=self.flush)
        if restored is None:
            return None
        read, lifecycle = restored.read, before is None  # a rollback is no interruption
        self._after_restore(restored.step, None if read is None else read.level)
        if read is None:
            report = self._lifecycle.recovered(RecoverySource.NONE, 0, None, t0, None,
                                               restored.skipped)
        else:
            report = self._lifecycle.recovered(
                read.source, restored.step, read.level.value, t0, read.location,
                restored.skipped, read.bytes_read, lifecycle=lifecycle)
        self.last_recovery = report
        if lifecycle:
            self._steps.mtbf_seconds = self._lifecycle.mtbf_seconds()
        if read is None:
            return 0
        if lifecycle:
            self._rollback.skip_again_after(restored.step)
        if restored.pin is not None:
            self._catalog.consume_pin(restored.pin.step, restored.pin.force)
        log.info("restored step %d from %s in %.2f s", restored.step, read.location,
                 report.seconds)
        return restored.step

    def _apply(self, read: Read) -> None:
        restored_extras = self._state.apply(self.components, read.meta, read.get_tensor)
        self.extras.clear()
        self.extras.update(restored_extras)
        self.epoch = read.meta.get("epoch")

    def _after_restore(self, step: int, level: Level | None) -> None:
        if self.memory is not None:
            self.memory.drop_after(step)
        self._catalog.abandon_after(step, fork=level is not None)
        self.scheduler.restart(step)
        self.step = self._base_step = step
        self._optimizer_steps = 0
        self._last_save_step = step
        if level is not None:
            self.scheduler.note_save(step, level)

    # -- lifecycle -------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait for every pending save; raises the first background error."""
        with self._watchdog.suspended():
            self._writer.flush()

    def close(self, save: bool = True) -> None:
        """Save the last observed step (unless ``save=False`` or it is saved already), wait
        for every pending save, then stop every thread and release the run (the lease last);
        every step runs even when an earlier one raised, and the first error is raised
        after them. The final save makes a finished run restore to its end, 0 steps lost."""
        if self._closed:
            return
        self._watchdog.close()  # a final save's wait is no hang
        if save and self.step > self._base_step:
            try:
                self._writer.raise_errors()
                self._save(SaveIntent(Level.ORGAN.value, "final step at close", "important"))
            except BaseException:
                self._close()
                raise
        self._close()

    def _close(self) -> None:
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
        with self._stops:
            self.flush()

    def __enter__(self) -> CheckpointPilot:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # A step that raised may have left the state half-updated: only a clean exit saves.
        self.close(save=exc_type is None)

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
