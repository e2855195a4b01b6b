"""When to save: the adaptive scheduler, its signals and the health probes (SPEC §4).

Only the scheduler and the decision it returns are re-exported here; the probes, the ledger
and the heartbeat are reached through their own modules.
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
