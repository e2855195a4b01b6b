"""The adaptive scheduler and its signals (SPEC §4) on synthetic traces; no I/O, no clock."""

from __future__ import annotations

import logging
import math
import random
import statistics
from collections.abc import Iterator

import pytest

from ckptpilot.policy import (
    GradSignalPolicy,
    LossSignalPolicy,
    RetentionPolicy,
    SchedulerPolicy,
    SchedulerWeights,
)
from ckptpilot.scheduler.adaptive import SIGNAL_KEYS, AdaptiveCheckpointScheduler
from ckptpilot.scheduler.decision import CheckpointDecision, Level, RetentionClass, SystemHealth
from ckptpilot.scheduler.signals import GradActivity, LossTrend

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


# -- loss trend ---------------------------------------------------------------------------


def test_loss_trend_follows_the_ewma_formula_on_log10_loss() -> None:
    trend = LossTrend(LossSignalPolicy())
    losses = [10.0, 1.0, 0.1, 0.01]
    expected_slope = 0.0
    previous = None
    for loss in losses:
        assert trend.update(loss)
        x = math.log10(loss + 1e-8)
        if previous is not None:
            expected_slope = 0.2 * (x - previous) + 0.8 * expected_slope
        previous = x
        assert trend.slope == pytest.approx(expected_slope, rel=1e-12)


def test_loss_trend_fires_only_after_three_consecutive_steep_steps() -> None:
    trend = LossTrend(LossSignalPolicy())
    fired = []
    for t in range(12):
        trend.update(10.0 ** (-0.1 * t))  # one decade every 10 steps
        fired.append(trend.signal)
    # Slopes: 0, -0.02, -0.036, -0.0488, -0.059 (first above 0.05 in magnitude), ...
    first_steep = next(i for i in range(12) if abs(-0.1 * (1 - 0.8**i)) > 0.05)
    assert first_steep == 4
    assert fired[: first_steep + 2] == [0.0] * (first_steep + 2)
    assert fired[first_steep + 2 :] == [1.0] * (12 - first_steep - 2)


def test_loss_trend_signal_drops_as_soon_as_the_slope_flattens() -> None:
    trend = LossTrend(LossSignalPolicy())
    for t in range(30):
        trend.update(10.0 ** (-0.1 * t))
    assert trend.signal == 1.0
    while abs(trend.slope) > 0.05:
        trend.update(1e-3)
    assert trend.signal == 0.0


def test_loss_plateau_with_one_percent_noise_never_fires() -> None:
    trend = LossTrend(LossSignalPolicy())
    max_slope = 0.0
    for loss in plateau(10_000):
        trend.update(loss)
        assert trend.signal == 0.0
        max_slope = max(max_slope, abs(trend.slope))
    assert max_slope < 0.005  # log10(1.01) ≈ 0.0043 bounds each step, the EWMA damps it


def test_loss_plateau_worst_case_alternating_wiggle_never_fires() -> None:
    trend = LossTrend(LossSignalPolicy())
    for t in range(10_000):
        trend.update(1e-4 * (1.01 if t % 2 else 0.99))
        assert trend.signal == 0.0


def test_loss_trend_rejects_a_negative_loss() -> None:
    with pytest.raises(ValueError, match="loss must be >= 0"):
        LossTrend(LossSignalPolicy()).update(-0.5)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_loss_trend_refuses_non_finite_without_touching_state(bad: float) -> None:
    trend = LossTrend(LossSignalPolicy())
    for t in range(8):
        trend.update(10.0 ** (-0.1 * t))
    before = (trend.slope, trend.signal)
    assert trend.update(bad) is False
    assert (trend.slope, trend.signal) == before


# -- gradient activity --------------------------------------------------------------------


def noisy_norms(count: int, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    return [1.0 + rng.gauss(0.0, 0.01) for _ in range(count)]


@pytest.mark.parametrize("probes", [3, 7, 50, 51, 77, 100, 1234])
def test_grad_window_moments_match_the_last_window_probes(probes: int) -> None:
    grad = GradActivity(GradSignalPolicy())
    values = [v * (1 + (i % 7)) for i, v in enumerate(noisy_norms(probes))]
    for value in values:
        grad.update(value)
    window = values[-50:]
    assert grad.probes == len(window)
    assert grad.mean == pytest.approx(statistics.fmean(window), rel=1e-12)
    assert grad.std == pytest.approx(statistics.pstdev(window), rel=1e-9)


def test_grad_window_memory_is_fixed() -> None:
    grad = GradActivity(GradSignalPolicy(window=8))
    for value in noisy_norms(1000):
        grad.update(value)
    assert len(grad._ring) == 8
    assert grad.probes == 8


def test_single_grad_spike_does_not_fire_two_consecutive_do() -> None:
    grad = GradActivity(GradSignalPolicy())
    for value in noisy_norms(60):
        grad.update(value)
    grad.update(2.0)  # one spike
    assert grad.signal == 0.0
    for value in noisy_norms(5, seed=2):
        grad.update(value)
        assert grad.signal == 0.0
    grad.update(2.0)
    assert grad.signal == 0.0  # first outlier probe of a pair
    grad.update(2.0)
    assert grad.signal == 1.0  # second consecutive outlier probe
    grad.update(1.0)
    assert grad.signal == 0.0


def test_grad_probe_is_judged_against_the_window_before_it() -> None:
    # Against the window [1, 1, 1, 1, 1] (σ = 0), 3 is an outlier; had it been added first,
    # μ = 4/3, σ ≈ 0.75 and |3 − μ| ≈ 1.67 < 3σ ≈ 2.24 would not be.
    grad = GradActivity(GradSignalPolicy(consecutive=1))
    for _ in range(5):
        grad.update(1.0)
    grad.update(3.0)
    assert grad.signal == 1.0


def test_grad_needs_five_probes_before_judging() -> None:
    grad = GradActivity(GradSignalPolicy(consecutive=1))
    for value in (1.0, 1.0, 1.0, 1.0, 100.0):
        grad.update(value)
        assert grad.signal == 0.0


def test_grad_outlier_also_needs_min_relative_change() -> None:
    # σ is tiny, so 1.05 is far outside μ ± 3σ, but only 5 % from μ (< min_rel_change 10 %).
    grad = GradActivity(GradSignalPolicy(consecutive=1))
    for value in noisy_norms(50, seed=3):
        grad.update(1.0 + (value - 1.0) * 0.01)
    grad.update(1.05)
    assert grad.signal == 0.0
    grad.update(1.2)
    assert grad.signal == 1.0


def test_grad_level_shift_becomes_the_new_normal() -> None:
    grad = GradActivity(GradSignalPolicy())
    for value in noisy_norms(50):
        grad.update(value)
    history = []
    for value in noisy_norms(40, seed=9):
        grad.update(value + 1.0)  # the norm doubles and stays there
        history.append(grad.signal)
    assert history[1] == 1.0
    assert history[-10:] == [0.0] * 10


def test_grad_refuses_non_finite_without_touching_state() -> None:
    grad = GradActivity(GradSignalPolicy())
    for value in noisy_norms(20):
        grad.update(value)
    before = (grad.mean, grad.std, grad.probes, grad.signal)
    assert grad.update(math.inf) is False
    assert grad.update(math.nan) is False
    assert (grad.mean, grad.std, grad.probes, grad.signal) == before


# -- scheduler: intervals -----------------------------------------------------------------


def test_fast_descent_shortens_the_interval_to_base_times_0_6() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    # 0.06 decade per step: the EWMA slope passes 0.05 at step 10, the signal fires at 12.
    decisions = [scheduler.decide(step, 100 * 10.0 ** (-0.06 * step)) for step in range(1, 131)]
    assert [d.signals["loss"] for d in decisions[:11]] == [0.0] * 11
    steep = decisions[11:]
    assert all(d.signals["loss"] == 1.0 for d in steep)
    assert all(d.score == pytest.approx(0.4) for d in steep)
    assert {d.interval for d in steep} == {60}  # round(100 · (1 − 0.4))
    assert decisions[0].interval == 100
    assert saved_steps(decisions) == [60, 120]


def test_plateau_saves_exactly_every_base_interval_for_10000_steps() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    decisions = [scheduler.decide(step, loss) for step, loss in enumerate(plateau(10_000), 1)]
    assert all(d.signals["loss"] == 0.0 for d in decisions)
    assert all(d.interval == 100 for d in decisions)
    assert saved_steps(decisions) == list(range(100, 10_001, 100))
    assert {d.retention_class for d in decisions if d.save} == {RetentionClass.ROUTINE}


def test_interval_is_clamped_at_min_interval() -> None:
    policy = SchedulerPolicy(base_interval=100, min_interval=50)
    scheduler = AdaptiveCheckpointScheduler(policy)
    decision = scheduler.decide_from(1, signals(loss=1.0, grad=1.0, system=1.0))
    assert decision.score == pytest.approx(1.0)
    assert decision.interval == 50  # 100 · (1 − 0.95) = 5, clamped up


def test_score_reduction_is_capped_at_95_percent() -> None:
    policy = SchedulerPolicy(base_interval=500, min_interval=1)
    scheduler = AdaptiveCheckpointScheduler(policy)
    assert scheduler.decide_from(1, signals(loss=1.0, grad=1.0, system=1.0)).interval == 25


def test_interval_rounds_half_up() -> None:
    # base 25 · (1 − 0.5) = 12.5 → 13 (Python's round() would give 12).
    weights = SchedulerWeights(loss=0.5, grad=0.25, system=0.25)
    policy = SchedulerPolicy(base_interval=25, min_interval=1, weights=weights)
    scheduler = AdaptiveCheckpointScheduler(policy)
    assert scheduler.decide_from(1, signals(loss=1.0)).interval == 13


def test_signals_are_clamped_and_nan_counts_as_zero() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    decision = scheduler.decide_from(1, signals(loss=7.0, grad=-3.0, system=math.nan))
    assert decision.signals == {"loss": 1.0, "grad": 0.0, "system": 0.0}
    assert decision.score == pytest.approx(0.4)


# -- scheduler: trigger, levels, emergency ------------------------------------------------


def test_trigger_threshold_saves_now_once_per_rising_edge() -> None:
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy())
    high = signals(loss=1.0, grad=1.0)  # 0.4 + 0.35 = 0.75 >= 0.7
    assert not any(d.save for d in run_calm(scheduler, range(1, 6)))
    first = scheduler.decide_from(6, high)
    assert first.save and first.reason.startswith("trigger")
    assert first.interval == 25  # round(100 · 0.25)
    assert first.retention_class is RetentionClass.IMPORTANT  # 0.75: >= 0.5, < 0.8
    assert scheduler.decide_from(6, high).save is False  # not twice at the same step
    sustained = [scheduler.decide_from(step, high) for step in range(7, 60)]
    assert saved_steps(sustained) == [31, 56]  # the shortened interval, not every step
    assert all(d.reason.startswith("interval") for d in sustained if d.save)
    scheduler.decide_from(60, CALM)  # the score falls: the trigger re-arms
    again = scheduler.decide_from(61, high)
    assert again.save and again.reason.startswith("trigger")


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


def test_retention_class_follows_the_score() -> None:
    retention = RetentionPolicy(critical_score=0.8, important_score=0.5)
    scheduler = AdaptiveCheckpointScheduler(SchedulerPolicy(trigger_threshold=1.0), retention)
    cases = [
        (signals(grad=1.0), RetentionClass.ROUTINE),  # 0.35
        (signals(loss=1.0, system=1.0), RetentionClass.IMPORTANT),  # 0.65
        (signals(loss=1.0, grad=1.0, system=1.0), RetentionClass.CRITICAL),  # 1.0
    ]
    step = 0
    for given, expected in cases:
        step += 200
        decision = scheduler.decide_from(step, given)
        assert decision.save
        assert decision.retention_class is expected


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
    with_bad = AdaptiveCheckpointScheduler(SchedulerPolicy())
    without = AdaptiveCheckpointScheduler(SchedulerPolicy())
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
