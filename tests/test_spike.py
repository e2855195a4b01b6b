"""SpikeDetector: confirms a spike after `patience` high steps, reports its onset, is scale-free."""

from __future__ import annotations

import math

import pytest

from ckptpilot.policy import RollbackPolicy
from ckptpilot.scheduler.spike import SpikeDetector


def _feed(detector: SpikeDetector, losses: list[float], start: int = 1) -> list[tuple[int, int]]:
    events = []
    for step, loss in enumerate(losses, start):
        spike = detector.update(step, loss)
        if spike is not None:
            events.append((spike.onset, spike.step))
    return events


def _calm(n: int, scale: float = 1.0) -> list[float]:
    """A noisy, slowly falling loss."""
    return [scale * (3.0 - 0.002 * i) * (1.0 + 0.05 * math.sin(1.7 * i)) for i in range(n)]


@pytest.mark.parametrize("scale", [0.01, 1.0, 100.0])
def test_confirms_after_patience_with_the_first_high_step_as_onset(scale: float) -> None:
    detector = SpikeDetector(RollbackPolicy(spike_factor=2.0, baseline_window=20, patience=3))
    losses = _calm(40, scale) + [6.5 * scale] * 5 + _calm(10, scale)
    assert _feed(detector, losses) == [(41, 43)]


def test_a_high_step_shorter_than_patience_is_no_spike_and_keeps_out_of_the_baseline() -> None:
    detector = SpikeDetector(RollbackPolicy(spike_factor=2.0, baseline_window=10, patience=3))
    losses = [*_calm(20), 9.0, 9.0, *_calm(5)]
    assert _feed(detector, losses) == []
    assert detector.baseline is not None and detector.baseline < 3.2


def test_non_finite_is_a_spike_at_once_with_the_running_excursion_as_onset() -> None:
    detector = SpikeDetector(RollbackPolicy(spike_factor=2.0, baseline_window=10, patience=5))
    assert _feed(detector, [*_calm(20), 7.0, 8.0, math.nan]) == [(21, 23)]
    fresh = SpikeDetector(RollbackPolicy())
    spike = fresh.update(1, math.inf)
    assert spike is not None and (spike.onset, spike.step) == (1, 1) and math.isnan(spike.baseline)


def test_nothing_is_judged_before_the_baseline_fills_and_zero_is_no_reading() -> None:
    detector = SpikeDetector(RollbackPolicy(spike_factor=2.0, baseline_window=50, patience=1))
    assert _feed(detector, [1.0] * 7 + [100.0]) == []  # 7 losses: below the 8 needed
    detector = SpikeDetector(RollbackPolicy(spike_factor=2.0, baseline_window=50, patience=1))
    assert _feed(detector, [1.0] * 8 + [0.0, 2.5]) == [(10, 10)]


def test_a_confirmed_level_shift_becomes_the_baseline_without_a_rollback() -> None:
    detector = SpikeDetector(RollbackPolicy(spike_factor=2.0, baseline_window=10, patience=2))
    events = _feed(detector, [1.0] * 10 + [5.0] * 30 + [5.0, 5.1])
    assert events == [(11, 12)]  # reported once; then 5.0 is the normal level
    assert detector.baseline == pytest.approx(5.0, rel=0.05)


def test_forget_excursion_judges_the_rerun_afresh() -> None:
    detector = SpikeDetector(RollbackPolicy(spike_factor=2.0, baseline_window=10, patience=2))
    assert _feed(detector, [1.0] * 10 + [5.0, 5.0]) == [(11, 12)]
    detector.forget_excursion()
    assert _feed(detector, [5.0, 5.0], start=11) == [(11, 12)]


def test_negative_loss_is_refused_naming_the_step() -> None:
    with pytest.raises(ValueError, match="step 4"):
        SpikeDetector(RollbackPolicy()).update(4, -1.0)
