"""When to save: the adaptive scheduler, its signals and the interval bound (SPEC §4).

Pure code only: every module here takes its inputs as data (losses, gradient norms, a
:class:`SystemHealth` reading, save costs, the MTBF) and returns decisions, with no file,
clock, thread or driver. ``decision.py`` holds the data exchanged, ``signals.py`` the
training-dynamics signals, ``interval.py`` the Young/Daly bound, ``spike.py`` the loss-spike
detector and ``adaptive.py`` the scheduler combining them. What measures or persists lives
outside: the health probes in ``ckptpilot.probes``, the heartbeat ring and the failure ledger
(whence the MTBF) in ``ckptpilot.storage``.

Only the scheduler and the decision it returns are re-exported here.
"""

from ckptpilot.scheduler.adaptive import SIGNAL_KEYS, AdaptiveCheckpointScheduler
from ckptpilot.scheduler.decision import CheckpointDecision, Level, RetentionClass, SystemHealth

__all__ = [
    "SIGNAL_KEYS",
    "AdaptiveCheckpointScheduler",
    "CheckpointDecision",
    "Level",
    "RetentionClass",
    "SystemHealth",
]
