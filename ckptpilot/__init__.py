"""ckptpilot: adaptive, tiered, validated checkpointing for long PyTorch training runs.

Public names only; everything else is reachable through its subpackage.
"""

from ckptpilot.errors import (
    CheckpointFormatError,
    CheckpointWriteError,
    CkptPilotError,
    IntegrityError,
    NoCheckpointError,
    PolicyError,
    RollbackLimitError,
    RunDirBusyError,
    StateError,
)
from ckptpilot.pilot import CheckpointPilot, RecoveryReport, RecoverySource, SaveRecord
from ckptpilot.policy import Policy, default_policy_path, load_policy
from ckptpilot.sampler import ResumableSampler
from ckptpilot.scheduler import AdaptiveCheckpointScheduler

__all__ = [
    "AdaptiveCheckpointScheduler",
    "CheckpointFormatError",
    "CheckpointPilot",
    "CheckpointWriteError",
    "CkptPilotError",
    "IntegrityError",
    "NoCheckpointError",
    "Policy",
    "PolicyError",
    "RecoveryReport",
    "RecoverySource",
    "ResumableSampler",
    "RollbackLimitError",
    "RunDirBusyError",
    "SaveRecord",
    "StateError",
    "default_policy_path",
    "load_policy",
]
__version__ = "0.1.0"
