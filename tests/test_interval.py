"""The Young/Daly interval bounds: published vectors, units, the δ ≥ 2M regime, bad input."""

from __future__ import annotations

import math

import pytest

from ckptpilot.scheduler.interval import daly_interval, young_interval

HOUR = 3600.0


@pytest.mark.parametrize(
    ("mtbf_minutes", "daly_minutes", "young_minutes"),
    [(24 * 60, 116.7, 120.0), (6 * 60, 56.7, 60.0), (15, 9.14, 12.2)],
)
def test_daly_and_young_vectors_for_five_minute_saves(
    mtbf_minutes: float, daly_minutes: float, young_minutes: float
) -> None:
    assert daly_interval(5.0, mtbf_minutes) == pytest.approx(daly_minutes, abs=0.05)
    assert young_interval(5.0, mtbf_minutes) == pytest.approx(young_minutes, abs=0.05)


def test_intervals_are_unit_agnostic() -> None:
    in_seconds = daly_interval(300.0, 6 * HOUR)
    assert in_seconds / 60 == pytest.approx(daly_interval(5.0, 360.0), rel=1e-12)


@pytest.mark.parametrize(("delta", "mtbf"), [(10.0, 5.0), (10.0, 4.0), (2.0, 1.0)])
def test_daly_is_the_mtbf_once_a_save_costs_twice_the_mtbf(delta: float, mtbf: float) -> None:
    assert daly_interval(delta, mtbf) == mtbf


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_intervals_reject_invalid_inputs(bad: float) -> None:
    with pytest.raises(ValueError, match="delta"):
        daly_interval(bad, 10.0)
    with pytest.raises(ValueError, match="mtbf"):
        young_interval(1.0, bad)
