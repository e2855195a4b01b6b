"""The run's lifecycle in its failure ledger: starts, interruptions, clean ends, and the
report of a restore.

This module owns :class:`RunLifecycle` and :class:`RecoveryReport`. When the previous process
of a run died, the restore that follows records the interruption (from the dead process's
newest heartbeat: the step it reached, when, after how long up) and the steps it lost; the
ledger's MTBF then feeds the scheduler's Young/Daly bound. A rollback's restore is not a
lifecycle event and records nothing here.

It must not restore anything. Threading: the training thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ckptpilot.restorer import SkippedCheckpoint
from ckptpilot.storage.heartbeat import HeartbeatRecord
from ckptpilot.storage.ledger import FailureLedger
from ckptpilot.vocab import RecoverySource

__all__ = ["RecoveryReport", "RunLifecycle"]


@dataclass(frozen=True)
class RecoveryReport:
    """What ``restore()`` did. ``steps_lost`` compares the dead run's newest heartbeat with the
    recovered step (None when no heartbeat of an earlier run exists); ``bytes_read`` counts
    what was read from the source (for the memory tier: copied) to restore it."""

    source: RecoverySource
    step: int
    level: str | None
    seconds: float
    steps_lost: int | None
    location: str | None
    skipped: tuple[SkippedCheckpoint, ...] = ()
    bytes_read: int = 0


class RunLifecycle:
    """Start, recovery and end records of one rank's process in the failure ledger."""

    def __init__(self, ledger: FailureLedger, previous_heartbeat: HeartbeatRecord | None) -> None:
        self._ledger = ledger
        self._previous = previous_heartbeat
        self.started = False

    def start(self, step: int) -> None:
        """Training began at ``step`` without a restore: record the start once."""
        if not self.started:
            self._ledger.record_run_start(step)
            self.started = True

    def recovered(self, source: RecoverySource, step: int, level: str | None, t0: float,
                  location: str | None, skipped: tuple[SkippedCheckpoint, ...],
                  bytes_read: int = 0, *, lifecycle: bool = True) -> RecoveryReport:
        """The report of a restore that began at ``t0`` (``perf_counter``); with
        ``lifecycle`` (not a rollback) the ledger also gets the dead run's interruption, if
        there was one, and this run's start."""
        seconds = time.perf_counter() - t0
        steps_lost = None
        if lifecycle:
            hb = self._previous
            if hb is not None and hb.step is not None:
                steps_lost = max(0, hb.step - step)
                if self._ledger.last_kind() == "run_start":
                    self._ledger.record_interruption(
                        failed_at=hb.wall_time, last_step=hb.step, recovered_step=step,
                        source=source.value, recovery_seconds=seconds,
                        uptime_seconds=hb.uptime_seconds)
            self._ledger.record_run_start(step)
            self.started = True
        return RecoveryReport(source=source, step=step, level=level, seconds=seconds,
                              steps_lost=steps_lost, location=location, skipped=skipped,
                              bytes_read=bytes_read)

    def mtbf_seconds(self) -> float | None:
        return self._ledger.mtbf_seconds()

    def end(self, step: int) -> None:
        """A clean end (``close``), recorded only for a run that started."""
        if self.started:
            self._ledger.record_run_end(step)
