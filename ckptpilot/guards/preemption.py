"""Preemption notices: a signal turned into an emergency organ at the next step boundary, and
an exit with a documented status (docs/operations/preemption-and-hangs.md).

This module owns :class:`PreemptionGuard`. Kubernetes evictions and spot reclaims send SIGTERM
and, a grace period later, SIGKILL; Slurm sends a chosen signal (``--signal``) before the time
limit. The guard's handler only records the notice (which signal, when on the monotonic
clock): a signal handler may run between any two bytecodes of the training thread, in the
middle of an optimizer step, so nothing that reads or writes the training state can happen
there. The pilot asks :attr:`PreemptionGuard.pending` at each step boundary (in a distributed
run the ranks agree on it first, ``agreement``, so that all of them save the same step) and
then calls :meth:`PreemptionGuard.honour`: save an organ (the level that is self-contained and
goes to the remote tier), wait for every queued save — one already in flight included — until
``grace_seconds`` after the notice, and check that the organ's row is valid on the remote tier.
The ledger gets a ``stop`` record with cause ``preemption``, which is no failure for the MTBF.

It must not decide what to save: the pilot hands it the save of the step, and its ``close``.
It ends the process: ``SystemExit(75)`` (``ExitStatus.PREEMPTED``) raised after a clean close
once the organ is valid, else ``os._exit(76)`` (``PREEMPTED_UNSAVED``) at once, without waiting
for the writer thread: the platform's SIGKILL is near, and the heartbeats are in the page cache
already (``storage/heartbeat.py``).

Threading: construct, :meth:`honour` and :meth:`close` on the training thread. Handlers are
installed only when that thread is the main thread (Python allows no other); a previous
Python-level handler of the same signal is called after the notice is recorded (chained), and
:meth:`close` puts every previous handler back unless someone replaced ours meanwhile.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, NamedTuple, NoReturn

from ckptpilot.catalog import Catalog
from ckptpilot.lifecycle import RunLifecycle, hard_exit
from ckptpilot.policy import PreemptionPolicy
from ckptpilot.save.writer import CheckpointWriter
from ckptpilot.vocab import ExitStatus, Status, StopCause, Tier

__all__ = ["Notice", "PreemptionGuard"]

log = logging.getLogger("ckptpilot")


class Notice(NamedTuple):
    """A preemption notice: the signal, and when it arrived (``time.monotonic()``)."""

    signum: int
    monotonic: float

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class PreemptionGuard:
    """The preemption handling of one rank's pilot; see the module docstring."""

    def __init__(self, options: PreemptionPolicy, *, rank: int, catalog: Catalog,
                 writer: CheckpointWriter, lifecycle: RunLifecycle) -> None:
        self._options = options
        self._rank = rank
        self._catalog = catalog
        self._writer = writer
        self._lifecycle = lifecycle
        self._notice: Notice | None = None
        self._previous: dict[signal.Signals, Any] = {}
        if not options.enabled:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption notices are not handled: this CheckpointPilot was built on "
                        "thread %r, and only the main thread may install signal handlers "
                        "(build it on the main thread, or set preemption.enabled: false)",
                        threading.current_thread().name)
            return
        for name in options.signals:
            signum = signal.Signals[name]
            self._previous[signum] = signal.signal(signum, self._on_signal)

    @property
    def pending(self) -> bool:
        """Whether a notice arrived and was not honoured yet (any thread may ask)."""
        return self._notice is not None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only records the notice: see the module docstring for why nothing else happens here.
        if self._notice is None:
            self._notice = Notice(signum, time.monotonic())
        previous = self._previous.get(signal.Signals(signum))
        if callable(previous):
            previous(signum, frame)

    def honour(self, step: int, save: Callable[[], object],
               close: Callable[..., object]) -> NoReturn:
        """Save step ``step`` as an organ (``save``), wait for it until the grace period ends,
        record the stop and end the process (see the module docstring; ``close(save=False)``
        before the ``SystemExit``). Without a notice of its own (another rank got it), the
        grace period counts from now."""
        notice = self._notice or Notice(signal.SIGTERM, time.monotonic())
        source = (notice.name if self._notice is not None
                  else "a preemption notice on another rank")
        grace = self._options.grace_seconds
        deadline = notice.monotonic + grace
        log.warning("PREEMPTION: rank %d got %s; saving an emergency organ of step %d "
                    "(%.1f s of the %.1f s grace period left)", self._rank, source, step,
                    max(0.0, deadline - time.monotonic()), grace)
        problem = None
        try:
            save()
            if not self._writer.wait(max(0.0, deadline - time.monotonic())):
                problem = f"still being written when the grace_seconds={grace:g} ran out"
            elif not self._valid_remote(step):
                problem = "it did not verify on the remote tier (see the errors above)"
        except Exception as e:  # the process exits next: the reason goes to the log and ledger
            log.exception("PREEMPTION: the emergency save of step %d failed", step)
            problem = f"the save failed: {type(e).__name__}: {e}"
        if problem is None:
            reason = f"{source}: the emergency organ of step {step} is durable and valid"
            self._lifecycle.stopped(step, StopCause.PREEMPTION, reason)
            log.warning("PREEMPTION: rank %d: %s, %.1f s after the notice; exiting with status "
                        "%d (ExitStatus.PREEMPTED): the restart resumes from step %d",
                        self._rank, reason, time.monotonic() - notice.monotonic,
                        ExitStatus.PREEMPTED, step)
            try:
                close(save=False)
            except Exception:  # an older save's error: the organ that matters is valid
                log.exception("PREEMPTION: closing the pilot after the emergency organ failed")
            raise SystemExit(ExitStatus.PREEMPTED)
        point = self._newest_valid_remote(below=step)
        keeps = ("no checkpoint is valid on the remote tier (the peer tier may hold one)"
                 if point is None
                 else f"the previous valid checkpoint, step {point}, stays the recovery point")
        reason = (f"{source}: the emergency organ of step {step} is NOT durable ({problem}); "
                  f"{keeps}")
        self._lifecycle.stopped(step, StopCause.PREEMPTION, reason)
        log.error("PREEMPTION: rank %d: %s; exiting with status %d "
                  "(ExitStatus.PREEMPTED_UNSAVED)", self._rank, reason,
                  ExitStatus.PREEMPTED_UNSAVED)
        hard_exit(ExitStatus.PREEMPTED_UNSAVED)

    def _valid_remote(self, step: int) -> bool:
        row = self._catalog.newest_rows_by_step(Tier.REMOTE).get(step)
        return row is not None and row.status is Status.VALID

    def _newest_valid_remote(self, below: int) -> int | None:
        steps = [s for s, row in self._catalog.newest_rows_by_step(Tier.REMOTE).items()
                 if s < below and row.status is Status.VALID]
        return max(steps, default=None)

    def close(self) -> None:
        """Put the previous handlers back (a handler someone installed after ours stays)."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            # None: a handler installed from C, which Python cannot put back.
            if handler is not None and signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, handler)
