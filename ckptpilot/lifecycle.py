"""The run's lifecycle in its failure ledger: starts, interruptions, clean ends, and the
report of a restore.

This module owns :class:`RunLifecycle` and :class:`RecoveryReport`. When the previous process
of a run died, the restore that follows records the interruption (from the dead process's
newest heartbeat: the step it reached, when, after how long up) and the steps it lost; the
ledger's MTBF then feeds the scheduler's Young/Daly bound. A run the pilot ends itself (a
preemption notice, a hang) records a ``stop`` instead of its clean end, and its restart no
interruption. A rollback's restore is not a lifecycle event and records nothing here.

It must not restore anything. Threading: the training thread; :meth:`RunLifecycle.stopped`
also from the hang watchdog's thread while the training thread is stuck.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import NoReturn

from ckptpilot.restorer import SkippedCheckpoint
from ckptpilot.storage.heartbeat import HeartbeatRecord
from ckptpilot.storage.ledger import FailureLedger
from ckptpilot.vocab import ExitStatus, RecoverySource, StopCause

__all__ = ["RecoveryReport", "RunLifecycle", "hard_exit"]


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

    def stopped(self, step: int, cause: StopCause, reason: str,
                uptime_seconds: float | None = None) -> None:
        """The pilot ends the run at ``step`` for ``cause``: a ``stop`` record takes the place
        of the clean end (:meth:`end` then records nothing)."""
        self._ledger.record_stop(step=step, cause=cause.value, reason=reason,
                                 uptime_seconds=uptime_seconds)
        self.started = False

    def mtbf_seconds(self) -> float | None:
        return self._ledger.mtbf_seconds()

    def end(self, step: int) -> None:
        """A clean end (``close``), recorded only for a run that started."""
        if self.started:
            self._ledger.record_run_end(step)


def hard_exit(status: int) -> NoReturn:
    """End the process now with ``status`` (an :class:`ExitStatus`), the log flushed first.

    ``os._exit``, not ``sys.exit``: the caller is a thread beside a stuck training thread, or
    a preemption whose grace period ran out while the writer thread still writes; interpreter
    shutdown would wait for those threads. What they leave half-written is what a kill
    leaves, which every format here survives."""
    for handler in logging.getLogger().handlers + logging.getLogger("ckptpilot").handlers:
        with contextlib.suppress(Exception):  # nothing is left to report it to
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(int(ExitStatus(status)))
