"""The per-step path of the pilot: what each step measures, and the scheduler's decision.

This module owns :class:`StepDecider`: the gradient-norm probe (every ``grad.probe_every``
optimizer steps, or the norm the loop hands over), the step time, the stall of recent saves,
the health reading, the spike detector's verdict on the loss, and — single-process — the
scheduler's ``measure`` → ``decide_from``, or — distributed — the decision from the signals
the ranks agreed over the previous step while this step's reduction starts; in both, whether a
preemption notice is due (a rank's notice travels with its signals, so every rank honours it at
the same step). It also writes the heartbeat record of a step.

Everything here runs on the training thread at every step, so it stays small: a few
microseconds of Python beside a training step (``bench/scheduler.py`` measures it). It must
not save or restore anything: the pilot acts on the decision.
"""

from __future__ import annotations

import logging
import statistics
import time
import zlib
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ckptpilot.agreement import RankAgreement
from ckptpilot.capture.state import TrainingComponents
from ckptpilot.guards.rollback import RollbackGuard
from ckptpilot.policy import Policy
from ckptpilot.probes.monitor import HealthMonitor
from ckptpilot.scheduler.adaptive import AdaptiveCheckpointScheduler
from ckptpilot.scheduler.decision import CheckpointDecision
from ckptpilot.storage.heartbeat import HeartbeatWriter

__all__ = ["StepDecider", "write_heartbeat"]

log = logging.getLogger("ckptpilot")

_STEP_TIME_ALPHA = 0.05


class StepDecider:
    """Per-step measurements and decisions of one rank; see the module docstring."""

    def __init__(self, policy: Policy, scheduler: AdaptiveCheckpointScheduler, *,
                 health: HealthMonitor | None, agreement: RankAgreement | None,
                 rollback: RollbackGuard, notice: Callable[[], bool] = lambda: False) -> None:
        self._probe_every = policy.scheduler.grad.probe_every
        self._scheduler = scheduler
        self._health = health
        self._agreement = agreement
        self._rollback = rollback
        self._grad_norm: torch.Tensor | None = None
        self._grad_probe_pending = False
        self._caller_grad_norm = False
        self._stalls: deque[float] = deque(maxlen=16)
        self._save_cost: float | None = None  # median of the recent stalls, per save
        self._last_observe: float | None = None
        self.step_seconds: float | None = None
        self.mtbf_seconds: float | None = None
        self.non_finite_steps = 0
        self.spike: tuple[int, str] | None = None  # (onset, reason) agreed at this step
        self._notice = notice
        self.preempt = False  # a preemption notice (agreed over the ranks) is due at this step

    @property
    def last_grad_norm(self) -> float | None:
        return None if self._grad_norm is None else float(self._grad_norm)

    def caller_grad_norm(self, grad_norm: Any, optimizer_steps: int) -> None:
        """The loop's own grad norm (e.g. ``clip_grad_norm_``'s): from now on the hook stops
        probing, and this value is the probe every ``probe_every`` steps."""
        self._caller_grad_norm = True
        if optimizer_steps % self._probe_every == 0:
            self._grad_norm = (grad_norm.detach() if isinstance(grad_norm, torch.Tensor)
                               else torch.tensor(float(grad_norm)))
            self._grad_probe_pending = True

    def probe(self, optimizer: torch.optim.Optimizer, optimizer_steps: int) -> None:
        """After an optimizer step: the global grad norm, every ``probe_every`` steps."""
        if self._caller_grad_norm or optimizer_steps % self._probe_every:
            return
        grads = [p.grad for g in optimizer.param_groups for p in g["params"]
                 if p.grad is not None]
        self._grad_norm = torch.nn.utils.get_total_norm(grads) if grads else None
        self._grad_probe_pending = self._grad_norm is not None

    def tick(self) -> None:
        """A step boundary: the step time (an EWMA) feeds the Young/Daly bound."""
        now = time.perf_counter()
        if self._last_observe is not None:
            dt = now - self._last_observe
            self.step_seconds = dt if self.step_seconds is None else (
                _STEP_TIME_ALPHA * dt + (1 - _STEP_TIME_ALPHA) * self.step_seconds)
        self._last_observe = now

    def note_stall(self, stall: float) -> None:
        """What a save cost the training thread: the save cost of the Young/Daly bound."""
        self._stalls.append(stall)
        self._save_cost = statistics.median(self._stalls)

    def decide(self, step: int, loss: float | None) -> CheckpointDecision:
        """The decision for ``step``; a spike confirmed (or agreed) at it is in :attr:`spike`."""
        grad = None
        if self._grad_probe_pending:
            grad = float(self._grad_norm)  # type: ignore[arg-type]
            self._grad_probe_pending = False
        system = self._health.snapshot() if self._health is not None else None
        costs = {"save_seconds": self._save_cost,
                 "mtbf_seconds": self.mtbf_seconds, "step_seconds": self.step_seconds}
        spike = self._rollback.update(step, loss)
        scheduler = self._scheduler
        if self._agreement is not None:
            # Decide from the signals agreed over the previous step, then measure this one
            # and start its reduction: measuring after deciding lets an emergency decision
            # reset the hard-error reference before the next reduction carries it again.
            layout = scheduler.layout
            signals, agreed_costs, self.spike = self._agreement.take(layout)
            self.preempt = self._agreement.notice
            scheduler.set_cost_model(**agreed_costs)
            decision = scheduler.decide_from(step, signals)
            self._agreement.start(layout, scheduler.measure(step, loss, grad, system), costs,
                                  spike, self._notice())
        else:
            self.preempt = self._notice()
            local = scheduler.measure(step, loss, grad, system)
            scheduler.set_cost_model(**costs)
            decision = scheduler.decide_from(step, local)
            self.spike = None if spike is None else (spike.onset, spike.reason)
        if decision.non_finite:
            self.non_finite_steps += 1
            if self.non_finite_steps == 1 or self.non_finite_steps % 100 == 0:
                log.warning("%s (%d non-finite steps so far); no checkpoint is taken of it",
                            decision.reason, self.non_finite_steps)
        return decision


def write_heartbeat(heartbeat: HeartbeatWriter, components: TrainingComponents, step: int,
                    epoch: int | None, loss: float | None) -> None:
    """One heartbeat record: where the run is, cheaply (it is written every few steps)."""
    c = components
    record: dict[str, Any] = {"step": step, "epoch": epoch, "loss": loss}
    if c.data_state is not None:
        record["cursor"] = c.data_state.state_dict()
    if c.optimizer is not None:
        record["lr"] = [float(g["lr"]) for g in c.optimizer.param_groups]
    if c.lr_scheduler is not None:
        record["lr_scheduler_step"] = getattr(c.lr_scheduler, "last_epoch", None)
    if c.scaler is not None:
        record["scaler"] = c.scaler.state_dict()
    # A fingerprint of the torch RNG (dropout masks) tells whether a replay from the last
    # checkpoint follows the same path; the python/numpy states are several times slower to
    # read (bench/RESULTS.md, scheduler.py) and live in full in every pulse and organ.
    record["torch_rng_crc32"] = zlib.crc32(torch.get_rng_state().numpy())
    heartbeat.write(record)
