"""Plain data exchanged between the health probes, the scheduler and the pilot.

Frozen dataclasses only: no behaviour, no I/O, so every producer and consumer can be tested
with values built by hand. ``Level`` and ``RetentionClass`` belong to ``ckptpilot.vocab`` and
are re-exported here for the scheduler's callers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptpilot.vocab import Level, RetentionClass

__all__ = ["CheckpointDecision", "Level", "RetentionClass", "SystemHealth"]


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
    ``loss``, ``grad``, the policy's extra signals and ``system`` to the values in [0, 1] the
    decision used; ``reason`` is a short
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
