"""The scheduler's signals on real recorded training traces (``tests/fixtures/traces/``).

The traces come from ``bench/record_traces.py`` (real CPU runs, nothing injected): ``demo``
(the demo's transformer), ``cnn`` (a small CNN on generated images) and ``high_lr`` (the same
CNN with a learning rate too high, whose loss spikes by itself). Steady phases are the steps
after the first fast descent; spike onsets are found from the data, never hard-coded as loss
values. Defaults only: one policy must fit every trace and every scale.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from ckptpilot.policy import GradSignalPolicy, LossSignalPolicy, SchedulerPolicy
from ckptpilot.scheduler.adaptive import AdaptiveCheckpointScheduler
from ckptpilot.scheduler.decision import RetentionClass
from ckptpilot.scheduler.signals import GradActivity, LossChange

TRACES = Path(__file__).parent / "fixtures" / "traces"

STEADY = {"demo": (60, 300), "cnn": (100, 400)}
"""First and last step of each trace's steady phase (after its first fast descent)."""


def load(name: str) -> tuple[list[float], list[float]]:
    with open(TRACES / f"{name}.csv", newline="") as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    assert [int(row["step"]) for row in rows] == list(range(1, len(rows) + 1))
    return [float(row["loss"]) for row in rows], [float(row["grad_norm"]) for row in rows]


def signals(
    losses: list[float], norms: list[float], probe_every: int = 1
) -> tuple[list[float], list[float]]:
    """Per step (index = step − 1): the loss and grad signal after that step."""
    change = LossChange(LossSignalPolicy())
    grad = GradActivity(GradSignalPolicy())
    loss_out, grad_out = [], []
    for step, (loss, norm) in enumerate(zip(losses, norms, strict=True), 1):
        change.update(loss)
        if step % probe_every == 0:
            grad.update(norm)
        loss_out.append(change.signal)
        grad_out.append(grad.signal)
    return loss_out, grad_out


def spike_onsets(losses: list[float], last_step: int) -> list[int]:
    """Steps whose loss is over 1.5x the largest of the 5 before, the run's first spikes."""
    return [
        step
        for step in range(6, last_step + 1)
        if losses[step - 1] > 1.5 * max(losses[step - 6 : step - 1])
        and not losses[step - 2] > 1.5 * max(losses[max(0, step - 7) : step - 2])
    ]


@pytest.mark.parametrize("name", sorted(STEADY))
@pytest.mark.parametrize("loss_scale", [0.01, 1.0, 100.0])
@pytest.mark.parametrize("grad_scale", [1.0, 1000.0])
@pytest.mark.parametrize("probe_every", [1, 10])
def test_signals_stay_low_on_a_steady_descent_at_any_scale(
    name: str, loss_scale: float, grad_scale: float, probe_every: int
) -> None:
    losses, norms = load(name)
    loss_signal, grad_signal = signals(
        [loss * loss_scale for loss in losses], [norm * grad_scale for norm in norms], probe_every
    )
    first, last = STEADY[name]
    assert max(loss_signal[first - 1 : last]) < 0.2
    assert max(grad_signal[first - 1 : last]) < 0.2


@pytest.mark.parametrize("name", sorted(STEADY))
def test_scaling_a_trace_leaves_every_signal_unchanged(name: str) -> None:
    losses, norms = load(name)
    reference = signals(losses, norms)
    for loss_scale, grad_scale in ((0.01, 1000.0), (100.0, 0.001)):
        scaled = signals([x * loss_scale for x in losses], [g * grad_scale for g in norms])
        assert scaled[0] == pytest.approx(reference[0], abs=1e-6)
        assert scaled[1] == pytest.approx(reference[1], abs=1e-6)


def test_the_demo_notices_its_fast_descent_ending() -> None:
    # The demo: 5.75 to 2.5 in 40 steps, then a plateau. The fall itself has no
    # history to stand out from; its end is a change of regime, and the drift part sees it.
    # The score shows it; the saves stay on the beat: a loss that moves warns of no crash.
    losses, norms = load("demo")
    loss_signal, _ = signals(losses, norms, probe_every=10)
    assert max(loss_signal[:20]) == 0.0
    assert max(loss_signal[20:50]) > 0.5
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy(base_interval=40))
    decisions = [
        scheduler.decide(step, loss, norm if step % 10 == 0 else None)
        for step, (loss, norm) in enumerate(zip(losses, norms, strict=True), 1)
    ]
    assert [d.step for d in decisions if d.save] == list(range(40, len(losses) + 1, 40))
    assert sum(d.score > 0 for d in decisions) > len(decisions) // 4


@pytest.mark.parametrize("loss_scale", [0.01, 1.0, 100.0])
def test_the_loss_signal_rises_above_half_within_two_steps_of_each_spike(
    loss_scale: float,
) -> None:
    losses, norms = load("high_lr")
    onsets = spike_onsets(losses, last_step=120)
    assert len(onsets) == 2  # the run's two self-made divergences
    loss_signal, _ = signals([loss * loss_scale for loss in losses], norms)
    for onset in onsets:
        assert max(loss_signal[onset - 1 : onset + 2]) > 0.5, onset


def test_grad_growth_fires_before_the_first_loss_spike() -> None:
    losses, norms = load("high_lr")
    first = spike_onsets(losses, last_step=120)[0]
    _, grad_signal = signals(losses, norms)
    rising = next(step for step, value in enumerate(grad_signal, 1) if value > 0.5)
    assert first - 8 <= rising <= first


def test_the_scheduler_saves_right_before_the_first_spike_and_keeps_the_beat() -> None:
    losses, norms = load("high_lr")
    first = spike_onsets(losses, last_step=120)[0]
    # base 50 for a 400-step trace; the refractory period is then 25 steps.
    policy = SchedulerPolicy(base_interval=50, grad=GradSignalPolicy(probe_every=1))
    scheduler = AdaptiveCheckpointScheduler(policy)
    decisions = [
        scheduler.decide(step, loss, norm)
        for step, (loss, norm) in enumerate(zip(losses, norms, strict=True), 1)
    ]
    saves = [d for d in decisions if d.save]
    # The grad norm runs away before the loss does: a trigger within the 8 steps up to the
    # spike, kept as important (the newest state before the divergence).
    trigger = saves[0]
    assert first - 8 <= trigger.step < first and trigger.reason.startswith("trigger")
    assert trigger.retention_class is RetentionClass.IMPORTANT
    # One save off the beat, then every base_interval again.
    assert [d.step for d in saves[1:]] == list(range(trigger.step + 50, len(losses) + 1, 50))
