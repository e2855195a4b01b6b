"""The recovery order of SPEC §7, as a pure plan."""

from __future__ import annotations

from ckptpilot.validation.recovery import Candidate, plan_recovery


def c(step: int, level: str = "pulse", tier: str = "remote", status: str | None = "valid"
      ) -> Candidate:
    return Candidate(step=step, level=level, tier=tier, name=f"s{step}-{tier}", status=status)


def test_newest_first_faster_tier_first_at_equal_step() -> None:
    plan = plan_recovery([c(10), c(30, tier="remote"), c(30, tier="memory"), c(20)])
    assert [(a.step, a.tier) for a in plan.attempts] == [
        (30, "memory"), (30, "remote"), (20, "remote"), (10, "remote")]


def test_walks_back_five_then_the_newest_organ() -> None:
    cands = [c(s) for s in range(100, 0, -10)] + [c(5, level="organ"), c(1, level="organ")]
    plan = plan_recovery(cands)
    assert [a.step for a in plan.attempts] == [100, 90, 80, 70, 60, 5]


def test_organ_within_the_walk_is_not_repeated() -> None:
    plan = plan_recovery([c(30), c(20, level="organ"), c(10, level="organ")], max_walk=2)
    assert [a.step for a in plan.attempts] == [30, 20, 10]


def test_metadata_status_excludes_and_unknown_is_tried() -> None:
    plan = plan_recovery([c(40, status="corrupted"), c(30, status="pending"),
                          c(20, status=None), c(10, status="expired")])
    assert [a.step for a in plan.attempts] == [20]
    assert [(x.step, why) for x, why in plan.excluded] == [
        (40, "marked corrupted in the metadata store"),
        (30, "marked pending in the metadata store"),
        (10, "marked expired in the metadata store")]


def test_a_requested_step_only() -> None:
    plan = plan_recovery([c(30), c(20), c(20, tier="memory")], step=20)
    assert [(a.step, a.tier) for a in plan.attempts] == [(20, "memory"), (20, "remote")]
