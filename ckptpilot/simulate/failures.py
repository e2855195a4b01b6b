"""When a simulated job fails and how: the failure model and the failures it draws.

This module owns :class:`FailureModel` (a rate, a distribution of the gaps between failures
and the mix of failure kinds) and :class:`Failure` (one drawn event). Drawing is seeded and
pure: the same model and ``random.Random`` seed give the same failures. It knows nothing of
checkpoints or costs.

The job's failures form one renewal process: exponential gaps (a Poisson process, the sum of
independent per-node processes), or Weibull gaps of the same mean, shape < 1 clustering
failures as fitted to HPC logs. Rates come either as a job MTBF or as failures per GPU-hour,
the job's MTBF being 1 / (rate · G).
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "LLAMA3_FAILURES_PER_GPU_HOUR",
    "Failure",
    "FailureKind",
    "FailureModel",
    "mtbf_seconds_for",
]

LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16384)
"""Meta's Llama 3 pre-training: 419 unexpected interruptions in a 54-day snapshot on 16,384
H100 GPUs ("The Llama 3 Herd of Models", arXiv:2407.21783): one per
~50,700 GPU-hours, a job MTBF of ~3.1 hours at that size."""


class FailureKind(str, enum.Enum):
    """What a failure takes away (docs/operations/simulate.md, "Failure kinds")."""

    NODE_LOSS = "node_loss"
    """A node and its memory are gone (GPU, memory, board, power): its peer shards too."""
    PROCESS_CRASH = "process_crash"
    """Training processes die (software bug, a Python error); peer daemons and nodes live."""
    PREEMPTION = "preemption"
    """A scheduler takes a node back after a notice: an emergency save may fit in it."""
    HANG = "hang"
    """A collective never returns; noticed only after the detection timeout."""


@dataclass(frozen=True)
class Failure:
    """One failure: wall time since the job started, its kind, the nodes it takes."""

    at_seconds: float
    kind: FailureKind
    nodes: tuple[int, ...] = ()


class FailureModel(BaseModel):
    """Rate, gap distribution and kind mix of a job's failures.

    The default mix is an assumption (docs/operations/simulate.md): most unexpected
    interruptions of large jobs are hardware (a node is drained), some are software crashes,
    a few are hangs, and planned preemptions come on top.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mtbf_seconds: float = Field(gt=0, allow_inf_nan=False)
    distribution: str = Field("exponential", pattern="^(exponential|weibull)$")
    weibull_shape: float = Field(0.7, gt=0)
    mix: dict[FailureKind, float] = Field(default_factory=lambda: {
        FailureKind.NODE_LOSS: 0.6, FailureKind.PROCESS_CRASH: 0.2,
        FailureKind.HANG: 0.1, FailureKind.PREEMPTION: 0.1})
    second_node_fraction: float = Field(0.05, ge=0, le=1)
    """Of node losses, the share that takes a second node at once (a switch, a PDU)."""

    @model_validator(mode="after")
    def _mix_sums_to_one(self) -> FailureModel:
        total = sum(self.mix.values())
        if any(v < 0 for v in self.mix.values()) or not math.isclose(total, 1.0, abs_tol=1e-6):
            raise ValueError(f"mix: shares must be >= 0 and sum to 1, got {total:g}")
        return self

    def gap_seconds(self, rng: random.Random) -> float:
        """Seconds from one failure (or the start) to the next."""
        if self.distribution == "exponential":
            return rng.expovariate(1.0 / self.mtbf_seconds)
        scale = self.mtbf_seconds / math.gamma(1.0 + 1.0 / self.weibull_shape)
        return rng.weibullvariate(scale, self.weibull_shape)

    def draw(self, at_seconds: float, nodes: int, rng: random.Random) -> Failure:
        """The failure at ``at_seconds`` on a job of ``nodes`` nodes: kind, then nodes."""
        kinds = list(self.mix)
        kind = rng.choices(kinds, weights=[self.mix[k] for k in kinds])[0]
        if kind is FailureKind.PROCESS_CRASH or kind is FailureKind.HANG:
            return Failure(at_seconds, kind)
        first = rng.randrange(nodes)
        lost = (first,)
        if kind is FailureKind.NODE_LOSS and nodes > 1 and rng.random() < self.second_node_fraction:
            second = rng.randrange(nodes - 1)
            lost = (first, second + (second >= first))
        return Failure(at_seconds, kind, lost)


def mtbf_seconds_for(failures_per_gpu_hour: float, gpus: int) -> float:
    """The job MTBF of ``gpus`` GPUs that fail independently at the given rate."""
    if failures_per_gpu_hour <= 0 or gpus < 1:
        raise ValueError("the failure rate must be positive and gpus >= 1")
    return 3600.0 / (failures_per_gpu_hour * gpus)
