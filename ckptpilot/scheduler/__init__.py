"""When to save: the adaptive scheduler, its signals and the interval bound (SPEC §4).

Pure code only: every module here takes its inputs as data (losses, gradient norms, a
:class:`SystemHealth` reading, save costs, the MTBF) and returns decisions, with no file,
clock, thread or driver. ``decision.py`` holds the data exchanged, ``signal.py`` the
:class:`Signal` protocol and the registry that builds a run's signals from its policy (a new
signal is a module and a policy entry), ``signals.py`` the built-in training-dynamics signals,
``interval.py`` the Young/Daly bound, ``spike.py`` the loss-spike detector and ``adaptive.py``
the scheduler combining them. What measures or persists lives outside: the health probes in
``ckptpilot.probes``, the heartbeat ring and the failure ledger (whence the MTBF) in
``ckptpilot.storage``.

Only the scheduler, the decision it returns and the signal protocol are re-exported here.
"""

from ckptpilot.scheduler.adaptive import SIGNAL_KEYS, AdaptiveCheckpointScheduler
from ckptpilot.scheduler.decision import CheckpointDecision, Level, RetentionClass, SystemHealth
from ckptpilot.scheduler.signal import Signal

__all__ = [
    "SIGNAL_KEYS",
    "AdaptiveCheckpointScheduler",
    "CheckpointDecision",
    "Level",
    "RetentionClass",
    "Signal",
    "SystemHealth",
]
