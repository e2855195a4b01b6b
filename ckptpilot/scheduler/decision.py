"""Plain data exchanged between the health probes, the scheduler and the pilot.

Frozen dataclasses only: no behaviour, no I/O, so every producer and consumer can be tested
with values built by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Level(str, Enum):
    """What a checkpoint contains (SPEC §2); the int value is the TensorBoard level."""

    HEARTBEAT = "heartbeat"
    PULSE = "pulse"
    ORGAN = "organ"

    @property
    def rank(self) -> int:
        return {"heartbeat": 0, "pulse": 1, "organ": 2}[self.value]


class RetentionClass(str, Enum):
    CRITICAL = "critical"
    IMPORTANT = "important"
    ROUTINE = "routine"
    MILESTONE = "milestone"


@dataclass(frozen=True)
class SystemHealth:
    """One reading of the health probes, handed to the scheduler.

    ``signal`` is the system signal in [0, 1]. ``hard_errors`` counts hard GPU errors seen so
    far (ECC, XID, retired/remapped pages): the scheduler compares it with the previous
    reading and an increase triggers an emergency organ save. ``gpu_available`` is False when
    NVML is absent (signal then comes from IO alone). ``details`` is free-form, for logs.
    """

    signal: float = 0.0
    hard_errors: int = 0
    gpu_available: bool = False
    io_latency_ms: float | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointDecision:
    """The scheduler's answer for one step (SPEC §4).

    ``save`` says whether a pulse or organ is due now; ``level`` is set only when ``save``.
    ``interval`` is the interval in steps in force after this step; ``signals`` maps
    ``loss``/``grad``/``system`` to their values in [0, 1]; ``reason`` is a short
    human-readable phrase naming what drove the decision (``interval``, ``trigger``,
    ``emergency``, ``non-finite loss`` …). ``spike_onset`` is set (by the pilot) at the step
    where a loss spike starting at that step was confirmed; ``rollback_to`` when the pilot
    then rolled the run back to that step (training continues from ``rollback_to + 1``).
    """

    step: int
    save: bool
    level: Level | None
    interval: int
    score: float
    signals: dict[str, float]
    retention_class: RetentionClass
    reason: str
    emergency: bool = False
    non_finite: bool = False
    spike_onset: int | None = None
    rollback_to: int | None = None
