"""Background work yields the CPU to training.

Everything a save does after the stall — encoding, hashing, writing, the load test — runs
while the training thread (and, on a GPU box, the data loader) wants the same cores. Those
threads and the load-test worker therefore run at ``nice`` :data:`BACKGROUND_NICE`: when the
cores are busy the scheduler gives training ~9 of every 10 slices, and on idle cores the
background work runs at full speed. Linux applies a thread's nice value to that thread alone
(and to the threads it starts), so the training thread keeps its own priority.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["BACKGROUND_NICE", "background_pool", "lower_priority"]

BACKGROUND_NICE = 10

log = logging.getLogger("ckptpilot")


def lower_priority() -> None:
    """Lower the calling thread's priority to :data:`BACKGROUND_NICE` (never raise it); a
    platform without per-thread priorities keeps the default."""
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        if current < BACKGROUND_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
    except (OSError, AttributeError) as e:  # not Linux, or a sandbox refusing it
        log.debug("background threads keep the default priority: %s", e)


def background_pool(max_workers: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads run at :data:`BACKGROUND_NICE`."""
    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name,
                              initializer=lower_priority)
