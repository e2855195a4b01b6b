"""Instability rollback: what the pilot does when a loss spike is confirmed
(docs/concepts/rollback.md).

This module owns :class:`RollbackGuard`: it feeds each step's loss to the
:class:`~ckptpilot.scheduler.spike.SpikeDetector` and, for each confirmed spike, protects the
newest save before it from pruning (``critical``) with the run-up before it (``important``)
and — with ``rollback.enabled`` — restores that save, skips the configured batches, and
records the rollback in the failure ledger. Large runs restart from such events by hand
(PaLM went back ~100 steps before a spike and skipped the batches around it).

It must not read checkpoints itself: restoring is the restorer's, through the pilot's
``restore_before`` callable, so a rollback walks the same tiers with the same verification as
any restore. Threading: the training thread; the protection runs on the writer thread, after
the saves queued before it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from ckptpilot.capture.state import Stateful
from ckptpilot.catalog import Catalog
from ckptpilot.errors import PolicyError, RollbackLimitError
from ckptpilot.policy import RollbackPolicy
from ckptpilot.save.writer import CheckpointWriter
from ckptpilot.scheduler.decision import CheckpointDecision
from ckptpilot.scheduler.spike import Spike, SpikeDetector
from ckptpilot.storage.ledger import FailureLedger, Rollback

__all__ = ["RollbackGuard", "check_rollback_setup"]

log = logging.getLogger("ckptpilot")


def check_rollback_setup(policy: RollbackPolicy, data_state: Stateful | None) -> None:
    """Rollback skips batches through the data state: refuse, before training, a setup
    where that cannot happen rather than fail at the first spike."""
    if not policy.enabled or policy.skip_batches == 0:
        return
    if data_state is None or not callable(getattr(data_state, "skip_batches", None)):
        what = "no data_state" if data_state is None else f"a {type(data_state).__name__}"
        raise PolicyError(
            "rollback.skip_batches",
            f"rollback is enabled and skips batches, but the pilot has {what}, without "
            "skip_batches(n); pass data_state=ResumableSampler(..., batch_size=B) (or a "
            "data state with skip_batches), or set rollback.skip_batches: 0")
    if getattr(data_state, "batch_size", 0) is None:
        raise PolicyError(
            "rollback.skip_batches",
            "rollback is enabled and skips batches, but the data_state sampler has no "
            "batch size; build it as ResumableSampler(..., batch_size=B)")


class RollbackGuard:
    """Spike detection and the rollbacks of one rank; see the module docstring."""

    def __init__(self, policy: RollbackPolicy, *, rank: int, ledger: FailureLedger,
                 catalog: Catalog, writer: CheckpointWriter,
                 data_state: Stateful | None) -> None:
        check_rollback_setup(policy, data_state)
        self._policy = policy
        self._rank = rank
        self._ledger = ledger
        self._catalog = catalog
        self._writer = writer
        self._data_state = data_state
        self._spikes = SpikeDetector(policy)
        self._protected_onset: int | None = None
        self.history: list[Rollback] = ledger.rollbacks()

    def update(self, step: int, loss: float | None) -> Spike | None:
        """Feed one step's loss; the spike it confirms, if any."""
        return None if loss is None else self._spikes.update(step, loss)

    def on_spike(self, decision: CheckpointDecision, step: int, onset: int, reason: str,
                 restore_before: Callable[[int], int | None]) -> CheckpointDecision:
        """A confirmed loss spike at ``step``: keep the newest save before it, and roll back
        to it when rollback is enabled (the decision then saves nothing: the live state is
        damaged). ``restore_before(s)`` restores the newest step below ``s`` (None: none
        loads, nothing changed).

        "Before it" means before step ``onset − 1``: the loss of step t is computed with the
        weights of checkpoint t − 1, so the onset's high loss already indicts the state saved
        at the step before it; the checkpoint of ``onset − 2`` produced a normal loss.
        """
        suspect = onset - 1
        if self._protected_onset != onset:
            self._protected_onset = onset
            self._writer.run_after(step, "rollback protection", self._catalog.protect_before,
                                   suspect, self._policy.baseline_window)
        if not self._policy.enabled:
            log.warning("loss spike at step %d: %s; the newest checkpoint before step %d is "
                        "kept for good as critical (rollback is off)", step, reason, suspect)
            return replace(decision, spike_onset=onset)
        target = self._rollback(step, onset, reason, restore_before)
        if target is None:
            return replace(decision, spike_onset=onset,
                           reason=f"{decision.reason}; spike since step {onset} not rolled "
                                  f"back: no checkpoint before step {suspect} loads")
        return replace(decision, save=False, level=None, spike_onset=onset, rollback_to=target,
                       reason=f"rollback to step {target}: {reason}")

    def _rollback(self, detected: int, onset: int, reason: str,
                  restore_before: Callable[[int], int | None]) -> int | None:
        """Restore the newest checkpoint before ``onset − 1``, skip the configured batches
        and record it; None (nothing changed) when none loads."""
        policy = self._policy
        # A resume after a rollback skips its batches again (see skip_again_after), so it
        # never meets the same spike twice: every recorded rollback counts.
        count = 1 + sum(event.step > detected - policy.window_steps for event in self.history)
        if count > policy.max_rollbacks:
            raise RollbackLimitError(
                f"rank {self._rank}: loss spike at step {detected} ({reason}) would be "
                f"rollback {count} within {policy.window_steps} steps "
                f"(rollback.max_rollbacks = {policy.max_rollbacks}): the instability keeps "
                "coming back; lower the learning rate or inspect the data, then resume "
                "(`ckptpilot ls` shows the checkpoints before the spikes)")
        target = restore_before(onset - 1)
        if target is None:
            log.warning("loss spike at step %d (%s): no checkpoint before step %d loads; "
                        "training goes on without a rollback", detected, reason, onset - 1)
            return None
        skip = (detected - target) if policy.skip_batches is None else policy.skip_batches
        if skip:
            self._data_state.skip_batches(skip)  # type: ignore[union-attr]
        self.history.append(self._ledger.record_rollback(
            step=detected, onset=onset, to_step=target, skipped_batches=skip, reason=reason))
        self._spikes.forget_excursion()
        log.warning("rolled back from step %d to step %d (%s); skipped %d batches", detected,
                    target, reason, skip)
        return target

    def skip_again_after(self, step: int) -> None:
        """After restoring the step a rollback returned to, skip the batches it skipped (the
        checkpoint's data cursor predates the skip)."""
        for event in reversed(self.history):
            if event.to_step == step:
                if event.skipped_batches and self._data_state is not None:
                    self._data_state.skip_batches(event.skipped_batches)  # type: ignore[attr-defined]
                    log.info("step %d is where the rollback of step %d returned to: skipped "
                             "its %d batches again", step, event.step, event.skipped_batches)
                return
