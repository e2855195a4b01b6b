"""The hang watchdog: a rank that stops making step progress is ended, so that its launcher
restarts the job (docs/operations/preemption-and-hangs.md).

A collective that never returns (an NCCL or gloo hang, a dead or stopped peer rank) stalls
training with no error, often for the collective's own timeout of tens of minutes or forever.
This module owns :func:`hang_bound_seconds` (pure: the bound from the step times) and
:class:`HangWatchdog`, a thread that sees no step boundary for longer than the bound, logs
where the rank is stuck (the phase the pilot last entered and the newest heartbeat), makes the
heartbeats durable, gives the saves in flight a bounded time to become durable, records a
``stop`` with cause ``hang`` in the failure ledger (a failure for the MTBF), and ends the
process with ``ExitStatus.HANG`` through ``os._exit``: the training thread is stuck, so no
exception could reach it, and interpreter shutdown would wait for it.

It must not judge the pilot's own waits (restore, a save's back-pressure, flush, close, a
preemption's grace period): the pilot suspends it around them, and the step clock restarts
when the wait ends. Before the first step boundary it is not armed (start-up, restore and the
first step's compilation take as long as they take).

Threading: :meth:`HangWatchdog.beat`, :meth:`~HangWatchdog.left_boundary`,
:meth:`~HangWatchdog.suspended` and :meth:`~HangWatchdog.close` on the training thread; the
watchdog's own daemon thread does the rest.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ckptpilot.lifecycle import RunLifecycle, hard_exit
from ckptpilot.policy import WatchdogPolicy
from ckptpilot.storage.heartbeat import HeartbeatWriter, read_latest
from ckptpilot.vocab import ExitStatus, StopCause

__all__ = ["HangWatchdog", "hang_bound_seconds"]

log = logging.getLogger("ckptpilot")

_STEP_SAMPLES = 64  # the median of the newest step times: a slow phase of the run moves it
_MAX_POLL_SECONDS = 1.0


def hang_bound_seconds(step_seconds: Sequence[float], options: WatchdogPolicy) -> float:
    """Seconds without a step boundary after which the rank counts as hung:
    ``max(min_seconds, step_time_multiple × median(step_seconds))``, ``min_seconds`` while no
    step time is known."""
    if not step_seconds:
        return options.min_seconds
    return max(options.min_seconds, options.step_time_multiple * statistics.median(step_seconds))


class HangWatchdog:
    """Watches one rank's step boundaries; see the module docstring.

    Lifecycle: construct (starts the thread when ``options.enabled``) → :meth:`beat` at every
    step boundary (the first one arms it) and :meth:`left_boundary` when the boundary's work
    is done → :meth:`suspended` around the pilot's own waits → :meth:`close`. ``drain(seconds)``
    waits for the saves in flight and says whether all finished (the writer's ``wait``);
    ``exit`` ends the process (tests pass a recorder; it must not return normally in
    production).
    """

    def __init__(self, options: WatchdogPolicy, *, rank: int, heartbeat: HeartbeatWriter,
                 heartbeat_path: Path, lifecycle: RunLifecycle,
                 drain: Callable[[float], bool] | None = None,
                 exit: Callable[[int], object] = hard_exit) -> None:
        self._options = options
        self._drain = drain
        self._rank = rank
        self._heartbeat = heartbeat
        self._heartbeat_path = heartbeat_path
        self._lifecycle = lifecycle
        self._exit = exit
        self._lock = threading.Lock()
        self._steps: deque[float] = deque(maxlen=_STEP_SAMPLES)
        self._last: float | None = None  # monotonic time of the newest beat (or resume)
        self._sample_next = False  # whether the next beat's interval is a step time
        self._step = 0
        self._in_boundary = False
        self._suspended = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if options.enabled:
            self._thread = threading.Thread(target=self._run, name="ckptpilot-watchdog",
                                            daemon=True)
            self._thread.start()

    @property
    def phase(self) -> str:
        """Where the training thread is, in words, as of its newest report."""
        with self._lock:
            return self._phase()

    def _phase(self) -> str:
        if self._last is None:
            return "start-up (no step boundary yet)"
        if self._in_boundary:
            return (f"the step boundary of step {self._step} (observe(): the checkpoint "
                    "decision and the agreement with the other ranks)")
        return (f"training step {self._step + 1} (forward, backward, optimizer step and their "
                "collectives; or the loop's own work between two observe() calls)")

    def beat(self, step: int) -> None:
        """A step boundary was reached (training thread)."""
        now = time.monotonic()
        with self._lock:
            if self._last is not None and self._sample_next:
                self._steps.append(now - self._last)
            self._last, self._sample_next = now, True
            self._step, self._in_boundary = step, True

    def left_boundary(self) -> None:
        """The boundary's work is done; the next step's training begins (training thread)."""
        with self._lock:
            self._in_boundary = False

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Not judged inside: one of the pilot's own waits. The step clock restarts after."""
        with self._lock:
            self._suspended += 1
        try:
            yield
        finally:
            with self._lock:
                self._suspended -= 1
                if self._suspended == 0 and self._last is not None:
                    self._last, self._sample_next = time.monotonic(), False

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        poll = min(_MAX_POLL_SECONDS, self._options.min_seconds / 10)
        while not self._stop.wait(poll):
            with self._lock:
                if self._last is None or self._suspended:
                    continue
                idle = time.monotonic() - self._last
                bound = hang_bound_seconds(self._steps, self._options)
                median = statistics.median(self._steps) if self._steps else None
                step, phase = self._step, self._phase()
            if idle > bound:
                self._fire(step, phase, idle, bound, median)
                return

    def _fire(self, step: int, phase: str, idle: float, bound: float,
              median: float | None) -> None:
        newest = read_latest(self._heartbeat_path)
        seen = ("no heartbeat" if newest is None or newest.step is None else
                f"its newest heartbeat is of step {newest.step}, "
                f"{max(0.0, time.time() - newest.wall_time):.1f} s old")
        rule = (f"max(watchdog.min_seconds={self._options.min_seconds:g}, "
                f"watchdog.step_time_multiple={self._options.step_time_multiple:g} x the median "
                "step time " + ("unknown" if median is None else f"{median:.3f} s") + ")")
        reason = (f"no step progress for {idle:.1f} s (bound {bound:.1f} s = {rule}); stuck in "
                  f"{phase}; {seen}")
        log.critical("HANG: rank %d: %s. Exiting with status %d (ExitStatus.HANG) so that the "
                     "launcher restarts the job", self._rank, reason, ExitStatus.HANG)
        try:
            self._heartbeat.flush()
        except OSError as e:
            log.error("HANG: the heartbeats could not be made durable: %s", e)
        if self._drain is not None and not self._drain(self._options.drain_seconds):
            log.error("HANG: saves still in flight after watchdog.drain_seconds=%g s are "
                      "abandoned; the restart resumes from the newest one that is valid",
                      self._options.drain_seconds)
        try:
            self._lifecycle.stopped(step, StopCause.HANG, reason)
        except Exception:  # the exit must happen whatever the ledger does
            log.exception("HANG: the failure ledger could not record the hang")
        self._exit(ExitStatus.HANG)
