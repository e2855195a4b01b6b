"""The signals' sorted windows and the per-step arithmetic inlined for speed, against brute force.

``signals.py`` keeps each window sorted by bisection, finds the MAD by walking from the last
step's answer, and inlines the median, the pushes and the CUSUMs into the trackers. These tests
recompute every statistic from its definition (``statistics.median`` of the raw values) on
seeded random streams with ties, flat stretches, far jumps, zeros and NaNs, for window sizes
odd and even, filling and full.
"""

from __future__ import annotations

import math
import random
import statistics
from bisect import bisect_left, insort

import pytest

from ckptpilot.policy import LossSignalPolicy
from ckptpilot.scheduler.signals import LOSS_EPSILON, LossChange, _Window


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


def push(window: _Window, value: float) -> None:
    """The push the trackers inline (``_Window``'s docstring)."""
    if len(window.ring) == window.size:
        del window.ordered[bisect_left(window.ordered, window.ring[0])]
    window.ring.append(value)
    insort(window.ordered, value)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8, 31, 32, 33])
def test_the_window_mad_is_the_median_of_the_deviations_at_every_step(size: int) -> None:
    rng = random.Random(size)
    window = _Window(size)
    for value in stream(rng, 3000):
        push(window, value)
        ordered = window.ordered
        assert ordered == sorted(window.ring)
        middle = statistics.median(window.ring)
        assert 0.5 * (ordered[(len(ordered) - 1) >> 1] + ordered[len(ordered) >> 1]) == middle
        expected = statistics.median(abs(v - middle) for v in window.ring)
        assert window.mad(middle) == expected


@pytest.mark.parametrize("size", [4, 7, 32])
def test_the_mad_walk_finds_the_same_run_from_any_starting_rank(size: int) -> None:
    """The walk's start is only a hint from the last step: any stale one gives the same MAD."""
    rng = random.Random(100 + size)
    window = _Window(size)
    for value in stream(rng, 400):
        push(window, value)
        middle = statistics.median(window.ring)
        expected = statistics.median(abs(v - middle) for v in window.ring)
        for start in (0, 1, len(window.ordered) // 2, len(window.ordered), 10**6):
            window._start = start
            assert window.mad(middle) == expected


def brute_force_z(xs: list[float], window: int, history: int, floor: float) -> list[float]:
    """z after each accepted log-loss, from SPEC §4.1's definition (0.0 until judged)."""
    slopes: list[float] = []
    out: list[float] = []
    for t, x in enumerate(xs):
        if t < window:
            out.append(0.0)
            continue
        slopes.append((x - statistics.median(xs[t - window : t])) / ((window + 1) / 2))
        judged = slopes[-1 - history : -1]
        if len(judged) < min(history, 8):
            out.append(0.0)
            continue
        middle = statistics.median(judged)
        deviation = slopes[-1] - middle
        mad = statistics.median(abs(s - middle) for s in judged)
        if abs(deviation) <= floor:
            out.append(0.0)
        elif mad == 0.0:
            out.append(math.copysign(math.inf, deviation))
        else:
            out.append(deviation / (1.4826 * mad))
    return out


@pytest.mark.parametrize(("window", "history"), [(2, 4), (3, 5), (8, 32), (5, 33)])
def test_the_loss_z_follows_its_definition_on_random_losses_with_ties(
    window: int, history: int
) -> None:
    rng = random.Random(window * 100 + history)
    policy = LossSignalPolicy(window=window, history=history)
    change = LossChange(policy)
    xs: list[float] = []
    zs: list[float] = []
    warm_up_signals: list[float] = []
    for value in stream(rng, 2000):
        loss = 10.0 ** (value / 10.0**5 if abs(value) > 10 else value)
        if rng.random() < 0.03:
            loss = rng.choice([0.0, math.nan, math.inf])  # no reading, or kept out of it
        judged_before = change.z
        change.update(loss)
        if loss == 0.0 or not math.isfinite(loss):
            assert change.z == judged_before
            continue
        xs.append(math.log10(loss + LOSS_EPSILON))
        zs.append(change.z)
        if len(xs) <= window + min(history, 8):
            warm_up_signals.append(change.signal)
    expected = brute_force_z(xs, window, history, policy.slope_threshold)
    assert len(zs) == len(expected) > 1900
    assert zs == pytest.approx(expected, rel=1e-12)
    assert warm_up_signals == [0.0] * (window + min(history, 8))
