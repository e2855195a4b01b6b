"""ckptpilot: adaptive, tiered, validated checkpointing for long PyTorch training runs.

Public names only; everything else is reachable through its subpackage. The errors are
imported with the package; the other names on first use (PEP 562), so that a process that
needs only a torch-free module — the load-test worker in its default mode — does not import
the pilot and torch with the package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from ckptpilot.pilot import CheckpointPilot, RecoveryReport, RecoverySource, SaveRecord
    from ckptpilot.policy import Policy, default_policy_path, load_policy
    from ckptpilot.sampler import ResumableSampler
    from ckptpilot.scheduler import AdaptiveCheckpointScheduler

_LAZY = {
    "AdaptiveCheckpointScheduler": "ckptpilot.scheduler",
    "CheckpointPilot": "ckptpilot.pilot",
    "Policy": "ckptpilot.policy",
    "RecoveryReport": "ckptpilot.pilot",
    "RecoverySource": "ckptpilot.pilot",
    "ResumableSampler": "ckptpilot.sampler",
    "SaveRecord": "ckptpilot.pilot",
    "default_policy_path": "ckptpilot.policy",
    "load_policy": "ckptpilot.policy",
}

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptpilot' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
