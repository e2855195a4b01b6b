"""The adaptive scheduler and its signals (SPEC §4) on synthetic traces; no I/O, no clock."""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterator

import pytest

from ckptpilot.policy import (
    GradSignalPolicy,
    LossSignalPolicy,
    RetentionPolicy,
    SchedulerPolicy,
    SchedulerWeights,
    SystemSignalPolicy,
)
from ckptpilot.scheduler.adaptive import SIGNAL_KEYS, AdaptiveCheckpointScheduler
from ckptpilot.scheduler.decision import CheckpointDecision, Level, RetentionClass, SystemHealth
from ckptpilot.scheduler.signals import GradActivity, Hazard, LossChange

CALM = {"loss": 0.0, "grad": 0.0, "system": 0.0, "hard_errors": 0.0, "non_finite": 0.0}


def signals(**values: float) -> dict[str, float]:
    return {**CALM, **values}


def plateau(steps: int, seed: int = 0) -> Iterator[float]:
    """A loss flat at 1e-4 with ±1 % multiplicative uniform noise."""
    rng = random.Random(seed)
    for _ in range(steps):
        yield 1e-4 * (1.0 + rng.uniform(-0.01, 0.01))


def saved_steps(decisions: list[CheckpointDecision]) -> list[int]:
    return [d.step for d in decisions if d.save]


def run_calm(scheduler: AdaptiveCheckpointScheduler, steps: range) -> list[CheckpointDecision]:
    return [scheduler.decide_from(step, CALM) for step in steps]


# -- loss change ----------------------------------------------------------------------------


def descent(steps: int, decades_per_step: float, noise: float, seed: int = 0) -> list[float]:
    """A loss falling at a constant rate in log10, with multiplicative uniform noise."""
    rng = random.Random(seed)
    return [
        10.0 ** (-decades_per_step * step) * (1.0 + rng.uniform(-noise, noise))
        for step in range(steps)
    ]


def loss_signals(losses: list[float], policy: LossSignalPolicy | None = None) -> list[float]:
    change = LossChange(LossSignalPolicy() if policy is None else policy)
    out = []
    for loss in losses:
        change.update(loss)
        out.append(change.signal)
    return out


@pytest.mark.parametrize("rate", [0.0, 0.001, 0.06])
def test_a_steady_descent_at_any_rate_never_fires(rate: float) -> None:
    # 0.06 decades per step is a fast descent by any absolute measure; 400 steps of it fall
    # 24 decades.
    assert max(loss_signals(descent(400, rate, noise=0.05))) == 0.0


def test_the_loss_signal_is_the_same_at_any_loss_scale() -> None:
    losses = descent(300, 0.002, noise=0.05)
    losses[200] *= 1.5  # a spike of +50 %
    reference = loss_signals(losses)
    for scale in (1e-4, 1e-2, 100.0, 1e4):
        scaled = loss_signals([loss * scale for loss in losses])
        assert scaled == pytest.approx(reference, abs=1e-6)
    assert reference[200] == 1.0


def test_the_loss_signal_grades_with_the_size_of_the_jump() -> None:
    # Noise ±5 %: the slope's MAD sets the scale; larger jumps give larger z, capped at 1.
    graded_values = []
    for jump in [1.0 + 0.02 * k for k in range(51)]:
        losses = descent(200, 0.001, noise=0.05)
        losses[150] *= jump
        graded_values.append(loss_signals(losses)[150])
    assert graded_values[0] == 0.0 and graded_values[-1] == 1.0
    assert graded_values == sorted(graded_values)
    assert any(0.0 < value < 1.0 for value in graded_values)  # graded, not 0/1


def test_a_sudden_drop_and_a_plateau_breaking_fire_too() -> None:
    drop = descent(200, 0.0, noise=0.02)
    drop[150:] = [loss * 0.5 for loss in drop[150:]]  # a learning-rate step, say
    assert loss_signals(drop)[150] == 1.0
    breaking = descent(150, 0.0, noise=0.02) + [
        10.0 ** (-0.02 * step) for step in range(1, 51)
    ]
    assert max(loss_signals(breaking)[150:156]) > 0.5


def test_a_descent_that_stops_fires_the_drift_part_before_any_single_jump_would() -> None:
    rng = random.Random(0)
    losses = descent(120, 0.02, noise=0.05)
    losses += [losses[-1] * (1.0 + rng.uniform(-0.05, 0.05)) for _ in range(60)]
    change = LossChange(LossSignalPolicy())
    zs, drifts, out = [], [], []
    for loss in losses:
        change.update(loss)
        zs.append(change.z)
        drifts.append(change.drift)
        out.append(change.signal)
    assert max(out[:120]) == 0.0
    fired = next(index for index, value in enumerate(out) if value > 0.5)
    assert 120 <= fired <= 126
    # The jump part alone, graded(|z|, 5, 10), would still be under 0.5 there.
    assert max(abs(z) for z in zs[120 : fired + 1]) < 7.5
    assert drifts[fired] > 5.0 * 1.5  # graded(C, 5, 10) > 0.5
    assert max(out[-20:]) == 0.0  # the plateau is the new normal


def test_the_loss_signal_follows_the_robust_z_formula() -> None:
    policy = LossSignalPolicy(
        level_span_steps=3, center_span_steps=4, spread_span_steps=5, z_low=1.0, z_high=3.0,
        slope_threshold=0.0,
    )
    change = LossChange(policy)
    xs = [0.0, 0.01, -0.02, 0.03, 0.0, -0.01, 0.02, 0.0, 0.01, -0.03, 0.02, 0.0, 0.06]
    for x in xs[:-1]:
        change.update(10.0**x)
    level, center, _ = change.estimates
    sigma = change.sigma
    change.update(10.0 ** xs[-1])
    # λ = 1/α − 1 = 1 for a level span of 3: the slope is x − L in decades per step.
    expected_z = ((xs[-1] - level) / 1.0 - center) / sigma
    assert change.z == pytest.approx(expected_z, rel=1e-9)
    assert abs(expected_z) > 1.0  # graded, not a quiet step
    assert change.signal == pytest.approx(
        max(min(1.0, (abs(expected_z) - 1.0) / 2.0), min(1.0, max(0.0, (change.drift - 5.0) / 5.0)))
    )


def test_a_flat_loss_moves_within_slope_threshold_without_firing() -> None:
    # MAD 0 on a perfectly flat loss: rounding-size moves stay under slope_threshold.
    losses = [2.0] * 50 + [2.0 * (1 + 1e-6), 2.0, 2.0 * (1 - 1e-6)] + [2.0] * 10
    assert max(loss_signals(losses)) == 0.0
    assert loss_signals([2.0] * 50 + [3.0])[-1] == 1.0  # a real move after it does


def test_a_negative_loss_is_rejected() -> None:
    with pytest.raises(ValueError, match="loss must be >= 0"):
        LossChange(LossSignalPolicy()).update(-0.5)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_loss_is_the_strongest_signal_and_leaves_the_windows(bad: float) -> None:
    losses = descent(100, 0.002, noise=0.05)
    clean = LossChange(LossSignalPolicy())
    poisoned = LossChange(LossSignalPolicy())
    for index, loss in enumerate(losses):
        clean.update(loss)
        if index in (40, 41, 80):
            assert poisoned.update(bad) is False
        poisoned.update(loss)
        assert (poisoned.z, poisoned.signal) == (clean.z, clean.signal)


def test_a_finite_loss_after_a_nan_in_the_first_steps_clears_the_signal() -> None:
    sched = AdaptiveCheckpointScheduler(SchedulerPolicy())
    assert sched.measure(1, 2.0)["loss"] == 0.0
    assert sched.measure(2, math.nan)["loss"] == 1.0
    assert sched.measure(3, 2.0)["loss"] == 0.0


def test_a_nan_then_no_loss_reading_does_not_pin_the_loss_signal() -> None:
    sched = AdaptiveCheckpointScheduler(SchedulerPolicy())
    assert sched.measure(1, math.nan)["loss"] == 1.0
    assert [sched.measure(s, None)["loss"] for s in range(2, 6)] == [0.0] * 4


def test_a_zero_loss_is_no_reading() -> None:
    """A fully masked batch or a met hinge loss gives exactly 0: not a jump of 30 decades."""
    rng = random.Random(5)
    change = LossChange(LossSignalPolicy())
    fired = 0
    for _ in range(600):
        loss = 0.0 if rng.random() < 0.2 else 0.5 * (1 + 0.05 * rng.gauss(0, 1))
        assert change.update(loss) is True
        fired += change.signal >= 0.5
    assert fired == 0


def test_a_flat_grad_norm_moving_by_rounding_does_not_fire() -> None:
    """MAD 0 (a constant or coarsely rounded norm): a change within the dead band is z = 0."""
    grad = GradActivity(GradSignalPolicy(probe_every=1))
    for _ in range(40):
        grad.update(1.0)
    grad.update(math.nextafter(1.0, 2.0))
    assert (grad.z, grad.signal) == (0.0, 0.0)
    grad.update(2.0)  # a doubling is far outside it
    assert grad.signal == 1.0


def test_a_restore_to_before_a_precursor_keeps_the_hazard_raised() -> None:
    sched = AdaptiveCheckpointScheduler(SchedulerPolicy())
    sched.measure(100, math.nan)
    sched.restart(50)
    assert sched.measure(50, None)["system"] == 1.0
    assert 0.0 < sched.measure(120, None)["system"] < 1.0


# -- gradient activity --------------------------------------------------------------------


def grad_signals(norms: list[float], policy: GradSignalPolicy | None = None) -> list[float]:
    grad = GradActivity(GradSignalPolicy() if policy is None else policy)
    out = []
    for norm in norms:
        grad.update(norm)
        out.append(grad.signal)
    return out


def noisy_norms(count: int, level: float, noise: float, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [level * math.exp(rng.gauss(0.0, noise)) for _ in range(count)]


def test_grad_noise_of_any_size_around_any_level_stays_quiet() -> None:
    for level in (0.003, 0.3, 300.0):
        for noise in (0.01, 0.5):
            assert max(grad_signals(noisy_norms(500, level, noise))) < 0.2


def test_a_grad_outlier_is_graded_between_the_bands() -> None:
    base = noisy_norms(40, 1.0, 0.1)
    grad = GradActivity(GradSignalPolicy())
    for norm in base:
        grad.update(norm)
    center, _ = grad.estimates
    sigma = grad.sigma
    values = []
    for z in (4.0, 7.5, 11.0):
        values.append(grad_signals([*base, 10.0 ** (center + z * sigma)])[-1])
    assert values[0] == 0.0  # under z_low = 5 (and the growth CUSUM stays under 5)
    assert values[1] == pytest.approx(0.5, abs=1e-9)
    assert values[2] == 1.0


def test_a_grad_norm_far_below_its_median_does_not_fire() -> None:
    assert grad_signals([*noisy_norms(40, 1.0, 0.1), 1e-4])[-1] == 0.0


def test_sustained_grad_growth_fires_before_any_probe_leaves_the_band() -> None:
    rng = random.Random(3)
    base = noisy_norms(40, 1.0, 0.1)
    growth = GradActivity(GradSignalPolicy())
    for norm in base:
        growth.update(norm)
    zs = []
    level = 1.0
    while growth.signal <= 0.5:
        level *= 1.06  # +6 % per probe, well inside the noise band each time
        growth.update(level * math.exp(rng.gauss(0.0, 0.02)))
        zs.append(growth.z)
        assert len(zs) < 30
    assert max(zs) < 5.0  # no single probe reached z_low


def test_a_grad_level_shift_becomes_the_new_normal() -> None:
    norms = noisy_norms(60, 1.0, 0.1) + noisy_norms(100, 20.0, 0.1, seed=1)
    out = grad_signals(norms)
    assert out[60] == 1.0
    assert max(out[-40:]) == 0.0


def test_grad_state_is_a_fixed_handful_of_numbers() -> None:
    grad = GradActivity(GradSignalPolicy())
    for norm in noisy_norms(1000, 1.0, 0.1):
        grad.update(norm)
    assert not hasattr(grad, "__dict__")
    state = [getattr(grad, name) for name in type(grad).__slots__]
    assert all(type(value) in (int, float) for value in state)


def test_a_non_finite_or_negative_grad_norm_is_refused() -> None:
    grad = GradActivity(GradSignalPolicy())
    for norm in noisy_norms(20, 1.0, 0.1):
        grad.update(norm)
    before = (grad.z, grad.growth, grad.estimates, grad.signal)
    for bad in (math.nan, math.inf, -math.inf):
        assert grad.update(bad) is False
    assert (grad.z, grad.growth, grad.estimates, grad.signal) == before
    with pytest.raises(ValueError, match="grad_norm must be >= 0"):
        grad.update(-1.0)


# -- hazard -------------------------------------------------------------------------------


def test_hazard_falls_from_one_to_zero_over_its_window_and_restarts() -> None:
    hazard = Hazard(4)
    assert hazard.update(1, False) == 0.0
    assert [hazard.update(step, step == 10) for step in range(10, 16)] == [
        1.0, 0.75, 0.5, 0.25, 0.0, 0.0,
    ]
    assert hazard.update(20, True) == 1.0 and hazard.update(21, False) == 0.75
    assert Hazard(0).update(5, True) == 0.0  # off


def test_a_precursor_raises_the_system_signal_for_the_hazard_window() -> None:
    policy = SchedulerPolicy(system=SystemSignalPolicy(hazard_window_steps=20))
    scheduler = AdaptiveCheckpointScheduler(policy)
    for step in range(1, 60):
        assert scheduler.measure(step, 1.0)["system"] == 0.0
    spike = scheduler.measure(60, 5.0)
    assert spike["loss"] == 1.0 and spike["system"] == 1.0
    after = [scheduler.measure(step, 1.0)["system"] for step in range(61, 82)]
    assert after[0] == pytest.approx(0.95) and after[9] == pytest.approx(0.5)
    assert after[19:] == [0.0, 0.0]
    assert scheduler.measure(82, 1.0, system=SystemHealth(signal=0.3))["system"] == 0.3


def test_a_non_finite_loss_is_a_loss_signal_of_one_and_starts_the_hazard() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    for step in range(1, 50):
        scheduler.measure(step, 1.0)
    measured = scheduler.measure(50, math.nan)
    assert (measured["loss"], measured["system"], measured["non_finite"]) == (1.0, 1.0, 1.0)
    following = scheduler.decide(51, 1.0)
    assert following.signals["loss"] == 0.0
    assert following.signals["system"] == pytest.approx(0.99)
    assert following.interval == 75  # round(100 · (1 − 0.25 · 0.99))


# -- scheduler: intervals -----------------------------------------------------------------


def test_a_loss_that_moves_raises_the_score_but_never_shortens_the_interval() -> None:
    # A sudden drop (or a faster descent, a plateau) warns of no crash: the score shows it,
    # the saves stay on the beat, where uniform failures cost the least.
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    losses = descent(130, 0.06, noise=0.0)
    losses[80:] = [loss * 0.1 for loss in losses[80:]]  # one decade down at step 81
    decisions = [scheduler.decide(step, loss) for step, loss in enumerate(losses, 1)]
    assert decisions[80].signals == {"loss": 1.0, "grad": 0.0, "system": 1.0}  # hazard 1
    assert decisions[80].score == pytest.approx(0.65)
    assert {d.interval for d in decisions} == {100}
    assert saved_steps(decisions) == [100]


def test_plateau_saves_exactly_every_base_interval_for_10000_steps() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    decisions = [scheduler.decide(step, loss) for step, loss in enumerate(plateau(10_000), 1)]
    assert all(d.signals["loss"] == 0.0 for d in decisions)
    assert all(d.interval == 100 for d in decisions)
    assert saved_steps(decisions) == list(range(100, 10_001, 100))
    assert {d.retention_class for d in decisions if d.save} == {RetentionClass.ROUTINE}


SYSTEM_ONLY = SchedulerWeights(loss=0.0, grad=0.0, system=1.0)


def test_interval_is_clamped_at_min_interval() -> None:
    policy = SchedulerPolicy(base_interval=100, min_interval=50, weights=SYSTEM_ONLY)
    scheduler = AdaptiveCheckpointScheduler(policy)
    decision = scheduler.decide_from(1, signals(system=0.99))  # health below the alarm
    assert decision.interval == 50  # 100 · (1 − 0.95) = 5, clamped up


def test_score_reduction_is_capped_at_95_percent() -> None:
    policy = SchedulerPolicy(base_interval=500, min_interval=1, weights=SYSTEM_ONLY)
    scheduler = AdaptiveCheckpointScheduler(policy)
    assert scheduler.decide_from(1, signals(system=0.99)).interval == 25


def test_interval_rounds_half_up() -> None:
    # base 25 · (1 − 0.5) = 12.5 → 13 (Python's round() would give 12).
    weights = SchedulerWeights(loss=0.25, grad=0.5, system=0.25)
    policy = SchedulerPolicy(base_interval=25, min_interval=1, weights=weights)
    scheduler = AdaptiveCheckpointScheduler(policy)
    assert scheduler.decide_from(1, signals(grad=1.0)).interval == 13


@pytest.mark.parametrize(
    ("given", "interval"),
    [
        (signals(loss=1.0, system=1.0), 100),
        (signals(grad=0.4), 86),  # 100 · (1 − 0.35 · 0.4)
        (signals(system=0.4), 90),  # health 0.4: 100 · (1 − 0.25 · 0.4)
        # The hazard the grad raised explains the system signal: no health reading in it.
        (signals(grad=1.0, system=1.0), 65),
    ],
)
def test_only_grad_and_health_shorten_the_interval(given: dict[str, float], interval: int) -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy(trigger_threshold=1.0))
    assert scheduler.decide_from(1, given).interval == interval


def test_the_hazard_a_loss_change_raised_is_not_read_as_health() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy(trigger_threshold=1.0))
    assert scheduler.decide_from(1, signals(loss=1.0, system=1.0)).interval == 100
    assert scheduler.decide_from(2, signals(system=0.99)).interval == 100  # its hazard
    # A health reading above the hazard left is health: at 1.0, an alarm.
    assert scheduler.decide_from(3, signals(system=1.0)).reason.startswith("alarm")


def test_signals_are_clamped_and_nan_counts_as_zero() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    decision = scheduler.decide_from(1, signals(loss=7.0, grad=-3.0, system=math.nan))
    assert decision.signals == {"loss": 1.0, "grad": 0.0, "system": 0.0}
    assert decision.score == pytest.approx(0.4)


# -- scheduler: trigger, levels, emergency ------------------------------------------------


def test_trigger_threshold_saves_now_once_per_rising_edge() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    high = signals(loss=1.0, grad=1.0)  # 0.4 + 0.35 = 0.75 >= 0.7
    assert not any(d.save for d in run_calm(scheduler, range(1, 56)))
    first = scheduler.decide_from(56, high)  # 56 steps since the start: past the refractory 50
    assert first.save and first.reason == "trigger: score 0.75 >= 0.7"
    assert first.interval == 65  # round(100 · (1 − 0.35)): the grad part only
    assert first.retention_class is RetentionClass.IMPORTANT  # 0.75: >= 0.5, < 0.8
    assert scheduler.decide_from(56, high).save is False  # not twice at the same step
    sustained = [scheduler.decide_from(step, high) for step in range(57, 200)]
    assert saved_steps(sustained) == [121, 186]  # the interval in force, not every step
    assert all(d.reason.startswith("interval") for d in sustained if d.save)
    scheduler.decide_from(200, CALM)  # the score falls: the trigger re-arms
    again = scheduler.decide_from(240, high)
    assert again.save and again.reason.startswith("trigger")


def test_a_trigger_within_the_refractory_period_is_passed_over() -> None:
    # Against uniform failures a save soon after another costs nearly as much as a whole one
    # and protects almost nothing; the edge is used up, so no save follows while it lasts.
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    high = signals(loss=1.0, grad=1.0)
    run_calm(scheduler, range(1, 101))  # saved at 100
    early = [scheduler.decide_from(step, high) for step in range(149, 166)]
    assert saved_steps(early) == [165]  # 149 is 49 steps after it: the interval (65) saves
    assert early[0].reason == "not due"
    anytime = AdaptiveCheckpointScheduler(SchedulerPolicy(trigger_refractory_fraction=0.0))
    run_calm(anytime, range(1, 101))
    assert anytime.decide_from(101, high).reason.startswith("trigger")


def test_the_refractory_period_follows_the_young_daly_base() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    scheduler.set_cost_model(save_seconds=2.0, mtbf_seconds=1800.0, step_seconds=2.0)
    assert scheduler.base_interval < 100
    refractory = scheduler.base_interval / 2
    high = signals(loss=1.0, grad=1.0)
    step = math.ceil(refractory)
    run_calm(scheduler, range(1, step))
    assert scheduler.decide_from(step, high).reason.startswith("trigger")


def test_every_tenth_save_is_an_organ() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    saves = [d for d in run_calm(scheduler, range(1, 3001)) if d.save]
    assert len(saves) == 30
    organs = [i for i, d in enumerate(saves, 1) if d.level is Level.ORGAN]
    assert organs == [10, 20, 30]
    assert all(d.level is Level.PULSE for i, d in enumerate(saves, 1) if i not in organs)


def test_emergency_on_new_hard_error_only() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    assert scheduler.decide(1, 1.0, system=SystemHealth(hard_errors=0)).save is False
    emergency = scheduler.decide(2, 1.0, system=SystemHealth(hard_errors=1))
    assert emergency.save and emergency.emergency
    assert emergency.level is Level.ORGAN
    assert emergency.retention_class is RetentionClass.CRITICAL
    assert emergency.reason == "emergency: 1 new hard error(s)"
    same = scheduler.decide(3, 1.0, system=SystemHealth(hard_errors=1))
    assert not same.save and not same.emergency
    no_reading = scheduler.decide(4, 1.0)  # no health reading: the count is unchanged
    assert not no_reading.save and not no_reading.emergency
    again = scheduler.decide(5, 1.0, system=SystemHealth(hard_errors=3))
    assert again.save and again.emergency


def test_first_error_on_one_rank_is_not_hidden_by_older_errors_on_another() -> None:
    ranks = [AdaptiveCheckpointScheduler(SchedulerPolicy()) for _ in range(2)]
    emergencies = []
    for step in range(1, 31):
        # Cumulative counts: rank 0's first error at step 10, rank 1's first at step 20.
        counts = (int(step >= 10), int(step >= 20))
        measured = [
            rank.measure(step, 1.0, system=SystemHealth(hard_errors=count))
            for rank, count in zip(ranks, counts, strict=True)
        ]
        agreed = {key: max(m[key] for m in measured) for key in SIGNAL_KEYS}
        decisions = [rank.decide_from(step, agreed) for rank in ranks]
        assert decisions[0] == decisions[1]
        if decisions[0].emergency:
            emergencies.append(step)
    assert emergencies == [10, 20]


def test_a_restarted_health_probe_is_the_new_reference() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    assert scheduler.decide(1, 1.0, system=SystemHealth(hard_errors=5)).emergency
    assert not scheduler.decide(2, 1.0, system=SystemHealth(hard_errors=0)).emergency
    assert not scheduler.decide(3, 1.0, system=SystemHealth(hard_errors=0)).emergency
    assert scheduler.decide(4, 1.0, system=SystemHealth(hard_errors=1)).emergency


def test_emergency_restarts_the_organ_count_and_interval() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    run_calm(scheduler, range(1, 301))  # pulses at 100, 200, 300
    scheduler.decide_from(350, signals(hard_errors=1.0))
    later = run_calm(scheduler, range(351, 1400))
    saves = [d for d in later if d.save]
    assert [d.step for d in saves[:2]] == [450, 550]
    assert [d.step for d in saves if d.level is Level.ORGAN] == [1350]  # 10th save after


def test_emergency_is_deferred_past_a_step_already_saved() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    run_calm(scheduler, range(1, 101))  # saved at 100
    repeat = scheduler.decide_from(100, signals(hard_errors=1.0))
    assert not repeat.save and "emergency save deferred" in repeat.reason
    assert scheduler.decide_from(101, signals(hard_errors=1.0)).emergency


def test_retention_class_follows_the_score_never_critical_in_a_loss_excursion() -> None:
    retention = RetentionPolicy(critical_score=0.8, important_score=0.5)
    weights = SchedulerWeights(loss=0.1, grad=0.5, system=0.4)
    policy = SchedulerPolicy(trigger_threshold=1.0, weights=weights)
    scheduler = AdaptiveCheckpointScheduler(policy, retention)
    cases = [
        (signals(grad=0.4), RetentionClass.ROUTINE),  # 0.2
        (signals(loss=1.0, grad=0.4, system=0.6), RetentionClass.IMPORTANT),  # 0.54
        (signals(grad=1.0, system=1.0), RetentionClass.CRITICAL),  # 0.9, the loss calm
        # 1.0, but the loss may already be in a spike: a possibly damaged state is not kept
        # forever.
        (signals(loss=1.0, grad=1.0, system=1.0), RetentionClass.IMPORTANT),
        (signals(loss=0.49, grad=1.0, system=1.0), RetentionClass.CRITICAL),  # 0.949
    ]
    step = 0
    for given, expected in cases:
        step += 200
        decision = scheduler.decide_from(step, given)
        assert decision.save
        assert decision.retention_class is expected, given


# -- scheduler: health alarm ----------------------------------------------------------------


def run_health(
    scheduler: AdaptiveCheckpointScheduler, steps: range, throttled: range
) -> list[CheckpointDecision]:
    """A flat loss; the health probe reads 1 (throttling, slow IO) on the ``throttled`` steps."""
    return [
        scheduler.decide(step, 1.0, system=SystemHealth(signal=float(step in throttled)))
        for step in steps
    ]


def test_a_health_alarm_saves_at_once_and_every_min_interval_while_it_lasts() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    decisions = run_health(scheduler, range(1, 200), throttled=range(31, 51))
    saves = [d for d in decisions if d.save]
    assert [d.step for d in saves] == [31, 41, 138]
    assert saves[0].reason == "alarm: health 1.00 >= 1"
    assert saves[1].reason == "interval: 10 steps since last save (interval 10)"
    # After it, the hazard the readings left shortens the interval a while: 100 · (1 − 0.25h),
    # h = 1 − (t − 50) / 100; at step 138 the interval (97) has passed since step 41.
    assert decisions[50].interval == 75  # step 51: h = 0.99
    assert decisions[137].interval == 97
    assert [d.retention_class for d in saves] == [RetentionClass.ROUTINE] * 3


def test_the_alarm_level_is_a_policy_setting() -> None:
    policy = SchedulerPolicy(system=SystemSignalPolicy(alarm_signal=0.5))
    scheduler = AdaptiveCheckpointScheduler(policy)
    run_calm(scheduler, range(1, 20))
    assert scheduler.decide_from(20, signals(system=0.6)).reason == "alarm: health 0.60 >= 0.5"
    assert scheduler.decide_from(21, signals(system=0.6)).interval == 10
    assert not scheduler.decide_from(21, signals(system=0.6)).save
    default = AdaptiveCheckpointScheduler(SchedulerPolicy())
    run_calm(default, range(1, 20))
    assert not default.decide_from(20, signals(system=0.6)).save  # below 1.0: interval 85


def test_a_loss_or_grad_precursor_raises_no_alarm() -> None:
    # Their hazard lifts the system signal to 1 as much as a health reading does.
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy(trigger_threshold=1.0))
    run_calm(scheduler, range(1, 20))
    for step, given in ((20, signals(loss=1.0, system=1.0)), (21, signals(system=0.99)),
                        (40, signals(grad=1.0, system=1.0)), (41, signals(system=0.99))):
        decision = scheduler.decide_from(step, given)
        assert not decision.save and decision.reason == "not due", step


def test_every_rank_takes_the_same_alarm_decision() -> None:
    ranks = [AdaptiveCheckpointScheduler(SchedulerPolicy()) for _ in range(2)]
    saved = []
    for step in range(1, 80):
        health = (SystemHealth(signal=float(30 <= step < 45)), SystemHealth())
        measured = [
            rank.measure(step, 1.0 + 0.01 * (step % 3), system=reading)
            for rank, reading in zip(ranks, health, strict=True)
        ]
        agreed = {key: max(m[key] for m in measured) for key in SIGNAL_KEYS}
        decisions = [rank.decide_from(step, agreed) for rank in ranks]
        assert decisions[0] == decisions[1]
        if decisions[0].save:
            saved.append((step, decisions[0].reason.split(":")[0]))
    assert saved == [(30, "alarm"), (40, "interval")]


# -- scheduler: non-finite values -----------------------------------------------------------


def test_nan_loss_is_reported_and_never_saved() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    run_calm(scheduler, range(1, 100))
    decision = scheduler.decide(100, math.nan)  # the interval is due at this step
    assert decision.non_finite and not decision.save and decision.level is None
    assert decision.reason == "non-finite loss (nan) at step 100"
    after = scheduler.decide(101, 1.0)
    assert after.save and after.reason.startswith("interval")


def test_inf_grad_norm_is_reported() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    decision = scheduler.decide(10, 1.0, grad_norm=math.inf)
    assert decision.non_finite and not decision.save
    assert decision.reason == "non-finite grad norm (inf) at step 10"
    both = scheduler.decide(20, math.nan, grad_norm=-math.inf)
    assert both.reason == "non-finite loss (nan) and grad norm (-inf) at step 20"


def test_non_finite_on_another_rank_blocks_the_save() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    run_calm(scheduler, range(1, 100))
    decision = scheduler.decide_from(100, signals(non_finite=1.0))
    assert not decision.save
    assert decision.reason == "non-finite loss or grad norm on another rank at step 100"


def test_emergency_is_deferred_past_a_non_finite_step() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    held = scheduler.decide(5, math.nan, system=SystemHealth(hard_errors=1))
    assert not held.save and held.reason.endswith("emergency save deferred")
    assert scheduler.decide(6, 1.0).emergency  # the reading is remembered


def descent_with_spikes(step: int) -> tuple[float, float | None]:
    """Slow descent with a fast phase (steps 200-259), grad spikes at 600+610 and at 900."""
    decades = -0.001 * step - 0.08 * min(max(step - 200, 0), 60)
    loss = 10.0 ** (1 + decades) * (1 + 0.01 * math.sin(step))
    grad = None
    if step % 10 == 0:
        grad = 1.0 + 0.01 * math.sin(step / 10)
        if step in {600, 610, 900}:
            grad = 3.0
    return loss, grad


def test_nan_and_inf_do_not_poison_the_trackers() -> None:
    poisoned_steps = {50, 333, 334, 700}
    inf_probe_steps = {400, 910}
    # No hazard: it rightly remembers the NaN steps, which the clean twin never saw.
    policy = SchedulerPolicy(system=SystemSignalPolicy(hazard_window_steps=0))
    with_bad = AdaptiveCheckpointScheduler(policy)
    without = AdaptiveCheckpointScheduler(policy)
    compared = []
    for step in range(1, 1501):
        loss, grad = descent_with_spikes(step)
        if step in poisoned_steps:
            assert with_bad.decide(step, math.nan).non_finite
            continue  # the clean twin never sees this step
        if step in inf_probe_steps:
            assert with_bad.decide(step, loss, grad_norm=math.inf).non_finite
            without.measure(step, loss)  # same finite loss, no probe, no decision
            continue
        compared.append((with_bad.decide(step, loss, grad), without.decide(step, loss, grad)))
    assert all(a == b for a, b in compared)
    assert any(a.signals["grad"] == 1.0 for a, _ in compared)  # the spikes were seen
    assert any(a.signals["loss"] == 1.0 for a, _ in compared)
    assert any(a.save for a, _ in compared)


# -- scheduler: determinism, distribution, bookkeeping -----------------------------------


def mixed_trace() -> Iterator[tuple[int, float, float | None, SystemHealth | None]]:
    for step in range(1, 3001):
        loss, grad = descent_with_spikes(step)
        if step == 1234:
            loss = math.nan
        system = SystemHealth(signal=0.5, hard_errors=1) if step >= 2000 else None
        yield step, loss, grad, system


def test_same_trace_gives_identical_decisions() -> None:
    runs = []
    for _ in range(2):
        scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
        runs.append([scheduler.decide(*inputs) for inputs in mixed_trace()])
    assert runs[0] == runs[1]
    assert any(d.emergency for d in runs[0]) and any(d.non_finite for d in runs[0])


def test_measure_then_decide_from_equals_decide() -> None:
    direct = AdaptiveCheckpointScheduler(SchedulerPolicy())
    split = AdaptiveCheckpointScheduler(SchedulerPolicy())
    for inputs in mixed_trace():
        measured = split.measure(*inputs)
        assert tuple(measured) == SIGNAL_KEYS
        assert split.decide_from(inputs[0], measured) == direct.decide(*inputs)


def test_ranks_agreeing_on_the_max_take_the_same_decisions() -> None:
    ranks = [AdaptiveCheckpointScheduler(SchedulerPolicy()) for _ in range(3)]
    for step in range(1, 1001):
        loss, grad = descent_with_spikes(step)
        measured = [
            rank.measure(step, math.nan if (step, i) == (500, 2) else loss * (1 + 0.001 * i), grad)
            for i, rank in enumerate(ranks)
        ]
        agreed = {key: max(m[key] for m in measured) for key in SIGNAL_KEYS}
        decisions = [rank.decide_from(step, agreed) for rank in ranks]
        assert decisions[0] == decisions[1] == decisions[2] or step == 500
        assert len({(d.save, d.level, d.interval) for d in decisions}) == 1


def test_note_save_restarts_the_interval_and_the_organ_count() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    scheduler.note_save(4321, "organ")
    assert scheduler.last_save_step == 4321
    decisions = run_calm(scheduler, range(4322, 4322 + 1000))
    assert saved_steps(decisions) == list(range(4421, 5322, 100))
    assert [d.step for d in decisions if d.level is Level.ORGAN] == [5321]
    with pytest.raises(ValueError, match="heartbeat"):
        scheduler.note_save(6000, Level.HEARTBEAT)


# -- scheduler: Young/Daly bound ------------------------------------------------------------


def test_cost_model_caps_the_base_interval_by_daly() -> None:
    policy = SchedulerPolicy(base_interval=5000, max_interval=10_000)
    scheduler = AdaptiveCheckpointScheduler(policy)
    delta, mtbf = 300.0, 6 * 3600.0  # 5 min saves, 6 h MTBF, 1 s steps
    ratio = delta / (2 * mtbf)
    tau = math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - delta
    scheduler.set_cost_model(delta, mtbf, 1.0)
    assert scheduler.base_interval == math.floor(tau) == 3402
    decisions = run_calm(scheduler, range(1, 7000))
    assert saved_steps(decisions) == [3402, 6804]
    scheduler.set_cost_model(delta, mtbf, 2.0)
    assert scheduler.base_interval == 1701
    scheduler.set_cost_model(delta, None, 1.0)
    assert scheduler.base_interval == 5000


def test_cost_model_never_raises_the_base_nor_drops_below_min_interval() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    scheduler.set_cost_model(300.0, 6 * 3600.0, 1.0)  # bound 3402 > base 100
    assert scheduler.base_interval == 100
    scheduler.set_cost_model(1.0, 10.0, 1.0)  # bound ⌊3.83⌋ = 3 < min_interval 10
    assert scheduler.base_interval == 10


def test_cost_model_is_ignored_without_young_daly() -> None:
    policy = SchedulerPolicy(base_interval=5000, max_interval=10_000, young_daly=False)
    scheduler = AdaptiveCheckpointScheduler(policy)
    scheduler.set_cost_model(300.0, 6 * 3600.0, 1.0)
    assert scheduler.base_interval == 5000


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, -math.inf, True, "7"])
@pytest.mark.parametrize("name", ["save_seconds", "mtbf_seconds", "step_seconds"])
def test_a_bad_cost_counts_as_unknown_with_one_warning(
    caplog: pytest.LogCaptureFixture, name: str, bad: object
) -> None:
    policy = SchedulerPolicy(base_interval=5000, max_interval=10_000)
    scheduler = AdaptiveCheckpointScheduler(policy)
    good = {"save_seconds": 300.0, "mtbf_seconds": 6 * 3600.0, "step_seconds": 1.0}
    with caplog.at_level(logging.WARNING, logger="ckptpilot"):
        scheduler.set_cost_model(**{**good, name: bad})  # type: ignore[arg-type]
        assert scheduler.base_interval == 5000  # as with None: no cap
        scheduler.set_cost_model(**{**good, name: bad})  # type: ignore[arg-type]
    assert len(caplog.records) == 1
    assert f"{name}={bad!r} is not a positive finite number" in caplog.text
    scheduler.set_cost_model(**good)
    assert scheduler.base_interval == 3402  # a good value brings the cap back
    assert saved_steps(run_calm(scheduler, range(1, 3500))) == [3402]


@pytest.mark.parametrize("young_daly", [False, True])
def test_an_mtbf_of_zero_never_stops_the_run(young_daly: bool) -> None:
    """A ledger whose clock went backwards once gave 0.0, and every restart then raised."""
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy(young_daly=young_daly))
    for step in range(1, 301):
        scheduler.set_cost_model(0.01, 0.0, 0.05)
        decision = scheduler.decide_from(step, CALM)
        assert decision.interval == 100
    assert scheduler.base_interval == 100
    assert saved_steps([scheduler.decide_from(400, CALM)]) == [400]


@pytest.mark.parametrize(
    ("save", "mtbf", "step"), [(1e308, 1e308, 1.0), (1.0, 1e300, 1e-300), (1e-300, 1e-300, 1.0)]
)
def test_extreme_but_valid_costs_never_raise(save: float, mtbf: float, step: float) -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    scheduler.set_cost_model(save, mtbf, step)
    assert scheduler.policy.min_interval <= scheduler.base_interval <= 100


def test_the_scheduler_is_importable_from_the_package_and_keeps_its_contract() -> None:
    import ckptpilot
    import ckptpilot.scheduler

    assert ckptpilot.AdaptiveCheckpointScheduler is AdaptiveCheckpointScheduler
    assert ckptpilot.scheduler.AdaptiveCheckpointScheduler is AdaptiveCheckpointScheduler
    assert "AdaptiveCheckpointScheduler" in ckptpilot.__all__
    decision = ckptpilot.AdaptiveCheckpointScheduler(SchedulerPolicy()).decide(1, 2.5)
    assert isinstance(decision, CheckpointDecision)
    assert (decision.step, decision.save, decision.interval) == (1, False, 100)


def test_decisions_carry_every_field_and_stay_frozen() -> None:
    """The scheduler builds decisions without the dataclass __init__ (per-step cost): each one
    must still hold every field, equal one built the usual way, and refuse assignment."""
    import dataclasses

    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy(base_interval=2, min_interval=1))
    decisions = [scheduler.decide(step, 1.0) for step in range(1, 4)]
    names = {f.name for f in dataclasses.fields(CheckpointDecision)}
    for decision in decisions:
        assert set(vars(decision)) == names
        assert decision == CheckpointDecision(**vars(decision))
        with pytest.raises(dataclasses.FrozenInstanceError):
            decision.save = True  # type: ignore[misc]
    assert [d.save for d in decisions] == [False, True, False]
