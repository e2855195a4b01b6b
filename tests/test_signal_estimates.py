"""The signals' streaming estimates and their inlined arithmetic, against their definitions.

``signals.py`` keeps a level, a center and a spread per tracker, updated in place in a few
float operations per step, with the warm-up, the winsorising and the quiet-step shortcuts
written out inline. These tests recompute every z-score from the definitions in the trackers'
docstrings, written plainly (``statistics.fmean`` over the warm-up values, one rule per line),
on seeded random streams with ties, flat stretches, far jumps, zeros and NaNs, for several
spans; and they check what the estimates promise: σ reads like a plain standard deviation,
scaling leaves every z unchanged, and one outlier moves the estimates a bounded amount.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from ckptpilot.policy import GradSignalPolicy, LossSignalPolicy
from ckptpilot.scheduler.signals import SPREAD_CLIP, GradActivity, LossChange

NORMAL = statistics.NormalDist()
CLIPPED_MEAN_ABS = 2.0 * (NORMAL.pdf(0.0) - NORMAL.pdf(SPREAD_CLIP)) + 2.0 * SPREAD_CLIP * (
    1.0 - NORMAL.cdf(SPREAD_CLIP)
)
"""E[min(|Z|, SPREAD_CLIP)] for a standard normal Z, by its integral."""


def stream(rng: random.Random, count: int) -> list[float]:
    """Gaussian noise, values rounded into ties, flat stretches and far jumps, mixed."""
    values: list[float] = []
    while len(values) < count:
        kind = rng.randrange(4)
        run = rng.randint(1, 40)
        if kind == 0:
            values += [rng.gauss(0.0, 1.0) for _ in range(run)]
        elif kind == 1:
            values += [round(rng.uniform(-1.0, 1.0), 1) for _ in range(run)]
        elif kind == 2:
            values += [rng.choice([0.0, 0.5])] * run
        else:
            values += [rng.choice([-1.0, 1.0]) * 10.0 ** rng.uniform(0.0, 6.0)]
    return values[:count]


def reference_loss_z(losses: list[float], policy: LossSignalPolicy) -> list[float]:
    """z after each accepted loss, from ``LossChange``'s docstring (0.0 until judged)."""
    alpha = 2.0 / (policy.level_span_steps + 1)
    lag = 1.0 / alpha - 1.0
    center_rate = 2.0 / (policy.center_span_steps + 1)
    spread_rate = 2.0 / (policy.spread_span_steps + 1)
    floor, z_high = policy.slope_threshold, policy.z_high
    warm_slopes = min(policy.spread_span_steps, 8)
    follow = max(1, policy.level_span_steps // 2)
    xs = [math.log10(v) for v in losses if 0.0 < v < math.inf]
    out: list[float] = []
    slopes: list[float] = []
    level = center = spread = previous = 0.0
    run = 0
    for t, x in enumerate(xs):
        if t < policy.level_span_steps:
            out.append(0.0)
            continue
        if t == policy.level_span_steps:
            level = statistics.fmean(xs[:t])
        slope = (x - level) / lag
        if len(slopes) < warm_slopes:
            slopes.append(slope)
            center = statistics.fmean(slopes)
            changes = [abs(b - a) for a, b in itertools.pairwise(slopes)]
            spread = statistics.fmean(changes) if changes else 0.0
            level += alpha * (x - level)
            previous = slope
            out.append(0.0)
            continue
        deviation = slope - center
        sigma = spread / (math.sqrt(2.0) * CLIPPED_MEAN_ABS)
        clipped = deviation
        restart = False
        if abs(deviation) <= floor:
            z = 0.0
            run = 0
        else:
            z = deviation / sigma if sigma > 0.0 else math.copysign(math.inf, deviation)
            bound = z_high * sigma + floor
            if abs(deviation) > bound:
                clipped = math.copysign(bound, deviation)
                side = 1 if deviation > 0.0 else -1
                run = run + side if run * side > 0 else side  # winsorised in a row, one side
                if abs(run) >= follow:
                    run = 0
                    restart = True
            else:
                run = 0
        # The level moves by α·(x − L) with x winsorised: α·λ·(m + clipped deviation).
        level = x - lag * center if restart else level + alpha * lag * (center + clipped)
        center += center_rate * clipped
        change = abs(slope - previous)
        previous = slope
        cap = SPREAD_CLIP * math.sqrt(2.0) * sigma + floor
        spread += spread_rate * (min(change, cap) - spread)
        out.append(z)
    return out


def reference_grad_z(norms: list[float], policy: GradSignalPolicy) -> list[float]:
    """z after each accepted probe, from ``GradActivity``'s docstring (0.0 until judged)."""
    rate = 2.0 / (policy.span_probes + 1)
    deadband, z_high = policy.deadband_decades, policy.z_high
    warm = min(policy.span_probes, 8)
    ys = [math.log10(g + 1e-30) for g in norms if 0.0 <= g < math.inf]
    out: list[float] = []
    center = spread = 0.0
    for t, y in enumerate(ys):
        if t < warm:
            center = statistics.fmean(ys[: t + 1])
            deviations = [abs(ys[i] - statistics.fmean(ys[:i])) for i in range(1, t + 1)]
            spread = statistics.fmean(deviations) if deviations else 0.0
            out.append(0.0)
            continue
        deviation = y - center
        sigma = spread / CLIPPED_MEAN_ABS
        clipped = deviation
        if abs(deviation) <= deadband:
            z = 0.0
        else:
            z = deviation / sigma if sigma > 0.0 else math.copysign(math.inf, deviation)
            bound = z_high * sigma + deadband
            clipped = max(-bound, min(bound, deviation))
        center += rate * clipped
        spread += rate * (min(abs(deviation), SPREAD_CLIP * sigma + deadband) - spread)
        out.append(z)
    return out


def random_losses(rng: random.Random, count: int) -> list[float]:
    losses = []
    for value in stream(rng, count):
        loss = 10.0 ** (value / 10.0**5 if abs(value) > 10 else value)
        if rng.random() < 0.03:
            loss = rng.choice([0.0, math.nan, math.inf])  # no reading, or kept out of it
        losses.append(loss)
    return losses


@pytest.mark.parametrize(
    ("level", "center", "spread"), [(2, 2, 4), (3, 4, 5), (14, 24, 32), (5, 40, 33)]
)
def test_the_loss_z_follows_its_definition_on_random_losses_with_ties(
    level: int, center: int, spread: int
) -> None:
    rng = random.Random(level * 100 + spread)
    policy = LossSignalPolicy(
        level_span_steps=level, center_span_steps=center, spread_span_steps=spread
    )
    change = LossChange(policy)
    losses = random_losses(rng, 2000)
    zs: list[float] = []
    warm_up_signals: list[float] = []
    for loss in losses:
        judged_before = change.z
        change.update(loss)
        if loss == 0.0 or not math.isfinite(loss):
            assert change.z == judged_before
            continue
        zs.append(change.z)
        if len(zs) <= level + min(spread, 8):
            warm_up_signals.append(change.signal)
    expected = reference_loss_z(losses, policy)
    assert len(zs) == len(expected) > 1900
    assert zs == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert warm_up_signals == [0.0] * (level + min(spread, 8))


@pytest.mark.parametrize("span", [4, 5, 8, 31, 32])
def test_the_grad_z_follows_its_definition_on_random_probes_with_ties(span: int) -> None:
    rng = random.Random(span)
    policy = GradSignalPolicy(span_probes=span)
    grad = GradActivity(policy)
    norms = [
        10.0 ** rng.choice([rng.uniform(-1, 1), round(rng.uniform(-1, 1), 1), 0.0])
        for _ in range(600)
    ]
    zs = []
    for norm in norms:
        grad.update(norm)
        zs.append(grad.z)
    assert zs == pytest.approx(reference_grad_z(norms, policy), rel=1e-9, abs=1e-12)


def test_sigma_reads_like_a_standard_deviation_on_gaussian_noise() -> None:
    rng = random.Random(7)
    grad = GradActivity(GradSignalPolicy(span_probes=400))
    sigmas = []
    for _ in range(4000):
        grad.update(10.0 ** rng.gauss(0.0, 1.0))  # σ = 1 decade: the dead band is negligible
        sigmas.append(grad.sigma)
    assert statistics.fmean(sigmas[1000:]) == pytest.approx(1.0, rel=0.05)


def test_scaling_by_any_constant_leaves_every_z_unchanged() -> None:
    rng = random.Random(3)
    losses = [v for v in random_losses(rng, 1500) if 0.0 < v < math.inf]
    norms = [10.0 ** rng.gauss(0.0, 0.3) for _ in range(500)]

    def zs(scale: float) -> tuple[list[float], list[float]]:
        change, grad = LossChange(LossSignalPolicy()), GradActivity(GradSignalPolicy())
        loss_z, grad_z = [], []
        for loss in losses:
            change.update(loss * scale)
            loss_z.append(change.z)
        for norm in norms:
            grad.update(norm * scale)
            grad_z.append(grad.z)
        return loss_z, grad_z

    reference = zs(1.0)
    for scale in (1e-12, 1e-3, 1e3, 1e12):
        scaled = zs(scale)
        assert scaled[0] == pytest.approx(reference[0], rel=1e-6, abs=1e-6)
        assert scaled[1] == pytest.approx(reference[1], rel=1e-6, abs=1e-6)


def test_one_outlier_moves_the_estimates_a_bounded_amount() -> None:
    rng = random.Random(11)
    for outlier in (1e3, 1e6, 1e300):
        grad = GradActivity(GradSignalPolicy())
        for _ in range(200):
            grad.update(10.0 ** rng.gauss(0.0, 0.1))
        (center, spread), sigma = grad.estimates, grad.sigma
        grad.update(outlier)
        rate = 2.0 / (GradSignalPolicy().span_probes + 1)
        new_center, new_spread = grad.estimates
        assert grad.signal == 1.0
        assert new_center - center <= rate * (10.0 * sigma + 0.02) * (1 + 1e-12)
        # The spread takes in at most SPREAD_CLIP·σ + the dead band.
        assert new_spread <= spread + rate * (SPREAD_CLIP * sigma + 0.02 - spread) + 1e-15

        change = LossChange(LossSignalPolicy())
        for step in range(200):
            change.update(10.0 ** (-0.001 * step + rng.gauss(0.0, 0.02)))
        change.update(outlier)
        assert change.signal == 1.0
        quiet_after = []
        for step in range(201, 206):
            change.update(10.0 ** (-0.001 * step + rng.gauss(0.0, 0.02)))
            quiet_after.append(change.z)
        assert max(abs(z) for z in quiet_after) < 5.0  # the spike left no echo
