"""One comparison: every policy, with and without the peer tier, on one job size and MTBF.

This module owns :class:`StudySpec` (what a comparison holds fixed), :func:`policies` (the
schedules it compares, built from the costs of that size) and :func:`compare`, which runs
each policy on the same seeds (common random numbers: every policy meets the same failure
times, so their difference is not noise between draws) and averages the outcomes into
:class:`Row`. Pure, like the model: the trace and profile arrive as data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from ckptpilot.policy import SchedulerPolicy
from ckptpilot.simulate.costs import ClusterSpec, CostProfile, TierCosts, tier_costs
from ckptpilot.simulate.failures import FailureModel
from ckptpilot.simulate.model import Outcome, simulate
from ckptpilot.simulate.schedules import (
    Schedule,
    adaptive_schedule,
    fixed_schedule,
    young_daly_schedule,
)

__all__ = ["POLICY_NAMES", "Row", "StudySpec", "compare", "policies"]

POLICY_NAMES = ("fixed", "young_daly", "adaptive")


class StudySpec(BaseModel):
    """What every policy of one comparison shares."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    step_seconds: float = Field(2.0, gt=0)
    horizon_seconds: float = Field(7 * 86400.0, gt=0)
    seeds: int = Field(3, ge=1)
    max_pending: int = Field(2, ge=1)


@dataclass(frozen=True)
class Row:
    """Means over the seeds of one policy on one job size and MTBF."""

    policy: str
    peer: bool
    gpus: int
    mtbf_seconds: float
    interval_seconds: float
    ettr: float
    overhead_fraction: float
    lost_fraction: float
    recovery_seconds: float
    lost_gpu_hours_per_day: dict[str, float]
    restores: dict[str, float]

    @property
    def label(self) -> str:
        return f"{self.policy}{' + peers' if self.peer else ''}"


def policies(costs: TierCosts, mtbf_seconds: float, *, peer: bool, step_seconds: float,
             trace: tuple[Sequence[float], Sequence[float]],
             scheduler: SchedulerPolicy | None = None) -> list[Schedule]:
    """The schedules compared: the policy's fixed base interval, Daly's optimum for the time
    to durable of the tier saved to, and the adaptive scheduler replayed on ``trace``."""
    policy = scheduler or SchedulerPolicy()
    durable = costs.peer_durable_seconds if peer else costs.remote_durable_seconds
    stall = costs.pulse_stall_seconds if peer else costs.organ_stall_seconds
    return [
        fixed_schedule(policy.base_interval * step_seconds, peer=peer,
                       organ_every=policy.organ_every, name="fixed"),
        young_daly_schedule(durable, mtbf_seconds, peer=peer, organ_every=policy.organ_every),
        adaptive_schedule(trace[0], trace[1], step_seconds=step_seconds, save_seconds=stall,
                          mtbf_seconds=mtbf_seconds, peer=peer, policy=policy),
    ]


def _mean_row(schedule: Schedule, peer: bool, costs: TierCosts, mtbf: float,
              outcomes: list[Outcome]) -> Row:
    n = len(outcomes)
    days = outcomes[0].wall_seconds / 86400
    causes = sorted({c for o in outcomes for c in o.lost_gpu_hours_by_cause()})
    restores = sorted({s for o in outcomes for s in o.restores})
    return Row(
        policy=schedule.name,
        peer=peer,
        gpus=costs.gpus,
        mtbf_seconds=mtbf,
        interval_seconds=schedule.mean_interval_seconds,
        ettr=sum(o.ettr for o in outcomes) / n,
        overhead_fraction=sum(o.overhead_seconds / o.wall_seconds for o in outcomes) / n,
        lost_fraction=sum(o.lost_seconds / o.wall_seconds for o in outcomes) / n,
        recovery_seconds=sum(o.mean_recovery_seconds for o in outcomes) / n,
        lost_gpu_hours_per_day={c: sum(o.lost_gpu_hours_by_cause().get(c, 0.0)
                                       for o in outcomes) / n / days for c in causes},
        restores={s: sum(o.restores[s] for o in outcomes) / n for s in restores},
    )


def compare(profile: CostProfile, cluster: ClusterSpec, gpus: int, failures: FailureModel,
            trace: tuple[Sequence[float], Sequence[float]], spec: StudySpec, *,
            peer_options: Sequence[bool] = (False, True),
            scheduler: SchedulerPolicy | None = None) -> list[Row]:
    """Every policy × peer option on ``gpus`` GPUs; a peer option the job is too small for
    (fewer nodes than a parity group) is left out."""
    costs = tier_costs(profile, cluster, gpus)
    rows = []
    for peer in peer_options:
        if peer and costs.nodes < costs.group_size:
            continue
        for schedule in policies(costs, failures.mtbf_seconds, peer=peer,
                                 step_seconds=spec.step_seconds, trace=trace,
                                 scheduler=scheduler):
            outcomes = [simulate(costs, schedule, failures, horizon_seconds=spec.horizon_seconds,
                                 peer=peer, seed=seed, max_pending=spec.max_pending)
                        for seed in range(spec.seeds)]
            rows.append(_mean_row(schedule, peer, costs, failures.mtbf_seconds, outcomes))
    return rows
