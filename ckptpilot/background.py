"""Background work yields the CPU to training, until training waits for it.

Everything a save does after the stall — encoding, hashing, writing, the load test — runs
while the training thread (and, on a GPU box, the data loader) wants the same cores. Those
threads run at ``nice`` :data:`BACKGROUND_NICE` (the scheduler gives training ~9 of every 10
slices on busy cores), or, where the policy asks for it (``async.background_priority: idle``,
:func:`use_idle_priority`), under ``SCHED_IDLE``: the kernel then gives them a core only when
nothing else wants it, so a save costs training no time slice at all. Linux applies a
thread's policy to that thread alone (and to the threads it starts), so the training thread
keeps its own.

Idle priority can starve: on cores that training keeps busy, a save would never finish. It
only matters once training waits for the save — back-pressure (``async.max_pending``
snapshots in flight), a flush before close, a preemption's emergency save — and from that
moment starving it costs training time instead of saving it; or once a save has taken so long
that the newest recovery point is falling behind (the writer's patience). Then :func:`urgent`
(or :func:`lift` … :func:`settle`) moves every idle thread of the process to ``SCHED_OTHER``
at ``nice`` :data:`BACKGROUND_NICE` for as long as the wait lasts. The load-test worker
process, whose wait is bounded by its own timeout, runs at ``nice`` :data:`BACKGROUND_NICE`.

Where idle priority is asked for but ``SCHED_IDLE`` is refused, or a thread could not be taken
back out of it (not Linux, a sandbox, an unprivileged process without ``RLIMIT_NICE``),
background threads fall back to that nice value and :func:`urgent` has nothing to do; a thread
already at that nice value or lower priority is left as it is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

__all__ = ["BACKGROUND_NICE", "background_pool", "lift", "lower_priority", "settle", "urgent",
           "use_idle_priority"]

BACKGROUND_NICE = 10

log = logging.getLogger("ckptpilot")

_IDLE = getattr(os, "SCHED_IDLE", None)
_OTHER = getattr(os, "SCHED_OTHER", None)


class _Urgency:
    """How many waits are on, and which threads :func:`urgent` moved off idle priority."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.moved: list[int] = []
        self.idle_allowed: bool | None = None  # see _idle_allowed
        self.idle_wanted = False  # the policy's async.background_priority is idle


_urgency = _Urgency()


def lower_priority() -> None:
    """Run the calling thread at background priority (see the module docstring); never
    raises its priority."""
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        if current >= BACKGROUND_NICE:
            return
        with _urgency.lock:
            if _urgency.idle_wanted and _urgency.depth == 0 and _idle_allowed(tid):
                os.sched_setscheduler(tid, _IDLE, os.sched_param(0))  # type: ignore[arg-type]
                return
            os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
    except (OSError, AttributeError) as e:  # not Linux, or a sandbox refusing it
        log.debug("background threads keep the default priority: %s", e)


def use_idle_priority(on: bool) -> None:
    """Whether background threads started from now on run under ``SCHED_IDLE`` (the policy's
    ``async.background_priority``); threads already running keep theirs."""
    with _urgency.lock:
        _urgency.idle_wanted = on


def _idle_allowed(tid: int) -> bool:
    """Whether this process may put a thread under ``SCHED_IDLE`` and take it back out (an
    unprivileged process needs ``RLIMIT_NICE`` for the way back): tried once on ``tid``, which
    is left at ``nice`` :data:`BACKGROUND_NICE`. Without the way back, :func:`urgent` could not
    rescue a starving save, so background threads are only niced."""
    if _urgency.idle_allowed is None:
        try:
            if _IDLE is None or _OTHER is None:
                raise OSError("no SCHED_IDLE on this platform")
            os.sched_setscheduler(tid, _IDLE, os.sched_param(0))
            os.sched_setscheduler(tid, _OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
            _urgency.idle_allowed = True
        except OSError as e:
            log.debug("background threads run niced, not at idle priority: %s", e)
            _urgency.idle_allowed = False
    return _urgency.idle_allowed


def lift() -> None:
    """Training now waits for background work: run it at ``nice`` :data:`BACKGROUND_NICE`
    instead of idle priority until the matching :func:`settle` (lifts nest)."""
    with _urgency.lock:
        _urgency.depth += 1
        if _urgency.depth == 1:
            _urgency.moved = _leave_idle()


def settle() -> None:
    """The end of a :func:`lift`: after the last one, the lifted threads go back to idle."""
    with _urgency.lock:
        _urgency.depth -= 1
        if _urgency.depth == 0:
            for tid in _urgency.moved:
                with contextlib.suppress(OSError):  # the thread ended meanwhile
                    os.sched_setscheduler(tid, _IDLE, os.sched_param(0))  # type: ignore[arg-type]
            _urgency.moved = []


@contextlib.contextmanager
def urgent() -> Iterator[None]:
    """:func:`lift` for the duration of a wait."""
    lift()
    try:
        yield
    finally:
        settle()


def _leave_idle() -> list[int]:
    """Move every idle thread of this process (only background threads are idle) to
    ``SCHED_OTHER`` at ``nice`` :data:`BACKGROUND_NICE`; returns their ids."""
    if _IDLE is None or _OTHER is None or not os.path.isdir("/proc/self/task"):
        return []
    moved = []
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            if os.sched_getscheduler(tid) != _IDLE:
                continue
            os.sched_setscheduler(tid, _OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
        except OSError:  # the thread ended meanwhile
            continue
        moved.append(tid)
    return moved


def background_pool(max_workers: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads run at background priority."""
    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name,
                              initializer=lower_priority)
