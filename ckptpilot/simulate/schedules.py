"""When a simulated job saves: the checkpoint policies the simulator compares.

This module owns :class:`Schedule`, a cyclic list of (seconds of training until the next
save, level) that the event loop plays from the start and again from every restore, and the
three ways of building one: :func:`fixed_schedule`, :func:`young_daly_schedule` and
:func:`adaptive_schedule` (the real :class:`AdaptiveCheckpointScheduler` replayed on a
recorded loss and gradient-norm trace). Pure: the trace arrives as data; nothing here reads
a file or a clock.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ckptpilot.policy import SchedulerPolicy
from ckptpilot.scheduler import AdaptiveCheckpointScheduler
from ckptpilot.scheduler.interval import daly_interval

__all__ = [
    "SaveLevel",
    "Schedule",
    "adaptive_schedule",
    "fixed_schedule",
    "young_daly_schedule",
]


class SaveLevel(str, enum.Enum):
    """A pulse goes to the peer tier, an organ to the remote tier (SPEC §2)."""

    PULSE = "pulse"
    ORGAN = "organ"


@dataclass(frozen=True)
class Schedule:
    """Seconds of training between saves and each save's level, played cyclically.

    Without a peer tier every save is an organ (nothing else would survive a node loss).
    """

    name: str
    gaps_seconds: tuple[float, ...]
    levels: tuple[SaveLevel, ...]

    def __post_init__(self) -> None:
        if not self.gaps_seconds or len(self.gaps_seconds) != len(self.levels):
            raise ValueError(f"schedule {self.name}: needs as many gaps as levels, at least one")
        if min(self.gaps_seconds) <= 0:
            raise ValueError(f"schedule {self.name}: every gap must be positive")

    def play(self) -> Iterator[tuple[float, SaveLevel]]:
        """From a start or a restore: (seconds of training until the next save, level)."""
        while True:
            yield from zip(self.gaps_seconds, self.levels, strict=True)

    @property
    def mean_interval_seconds(self) -> float:
        return sum(self.gaps_seconds) / len(self.gaps_seconds)


def _levels(count: int, organ_every: int, peer: bool) -> tuple[SaveLevel, ...]:
    if not peer:
        return (SaveLevel.ORGAN,) * count
    return tuple(SaveLevel.ORGAN if (i + 1) % organ_every == 0 else SaveLevel.PULSE
                 for i in range(count))


def fixed_schedule(interval_seconds: float, *, peer: bool, organ_every: int = 10,
                   name: str = "fixed") -> Schedule:
    """A save every ``interval_seconds`` of training; every ``organ_every``-th an organ."""
    count = organ_every if peer else 1
    return Schedule(name, (interval_seconds,) * count, _levels(count, organ_every, peer))


def young_daly_schedule(save_seconds: float, mtbf_seconds: float, *, peer: bool,
                        organ_every: int = 10, name: str = "young_daly") -> Schedule:
    """Daly's optimum for a save cost ``save_seconds`` and the job's MTBF, at a fixed beat."""
    return fixed_schedule(daly_interval(save_seconds, mtbf_seconds), peer=peer,
                          organ_every=organ_every, name=name)


def _ping_pong(values: Sequence[float]) -> list[float]:
    """The trace forward, then backward: played in a loop, it has no jump at the seam."""
    return list(values) + list(values[-2:0:-1])


def adaptive_schedule(losses: Sequence[float], grad_norms: Sequence[float], *,
                      step_seconds: float, save_seconds: float, mtbf_seconds: float,
                      peer: bool, policy: SchedulerPolicy | None = None,
                      min_saves: int = 40, name: str = "adaptive") -> Schedule:
    """The saves the adaptive scheduler decides on a recorded trace, as a cyclic schedule.

    The scheduler gets the job's cost model (``set_cost_model``: the stall, the MTBF, the
    step time), so its Young/Daly cap applies as in a real run; the trace is played back and
    forth until ``min_saves`` saves were decided (at least four passes), and the gaps between
    them become the schedule. Without a peer tier every save is an organ.
    """
    if len(losses) < 2 or len(losses) != len(grad_norms):
        raise ValueError("a trace needs at least two steps and a grad norm per loss")
    scheduler = AdaptiveCheckpointScheduler(policy or SchedulerPolicy())
    scheduler.set_cost_model(save_seconds, mtbf_seconds, step_seconds)
    save_steps: list[int] = [0]
    levels: list[SaveLevel] = []
    horizon = 4 * len(losses)
    loss_cycle, grad_cycle = _ping_pong(losses), _ping_pong(grad_norms)
    step = 0
    while step < horizon or len(levels) < min_saves:
        i = step % len(loss_cycle)
        step += 1
        decision = scheduler.decide(step, loss_cycle[i], grad_cycle[i])
        if decision.save and decision.level is not None:
            save_steps.append(step)
            levels.append(SaveLevel(decision.level.value))
        if step > 1000 * len(losses):
            raise ValueError(f"schedule {name}: the scheduler saved fewer than {min_saves} "
                             f"times in {step} steps")
    gaps = tuple((b - a) * step_seconds for a, b in itertools.pairwise(save_steps))
    if not peer:
        levels = [SaveLevel.ORGAN] * len(levels)
    return Schedule(name, gaps, tuple(levels))
