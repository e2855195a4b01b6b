"""``ckptpilot simulate``: what a checkpointing policy does at 1,000-16,000 GPUs.

A discrete-event model of a job of G GPUs that checkpoints, fails and recovers, driven by
costs measured on a real run and scaled by stated formulas (docs/operations/simulate.md).
``costs.py`` holds the measured profile and its scaling, ``failures.py`` the failure model,
``schedules.py`` the policies compared (fixed, Young-Daly, the adaptive scheduler replayed on a
recorded trace), ``model.py`` the event loop and its accounting, ``study.py`` one comparison,
``render.py`` the table and plots, ``command.py`` the subcommand. Everything but
``command.py`` and ``render.py`` is pure: no file, clock or process.
"""

from ckptpilot.simulate.costs import ClusterSpec, CostProfile, ProfileError, TierCosts
from ckptpilot.simulate.failures import Failure, FailureKind, FailureModel
from ckptpilot.simulate.model import Outcome, ettr_ceiling, peer_restore_kind, simulate
from ckptpilot.simulate.schedules import Schedule
from ckptpilot.simulate.study import Row, StudySpec, compare

__all__ = [
    "ClusterSpec",
    "CostProfile",
    "Failure",
    "FailureKind",
    "FailureModel",
    "Outcome",
    "ProfileError",
    "Row",
    "Schedule",
    "StudySpec",
    "TierCosts",
    "compare",
    "ettr_ceiling",
    "peer_restore_kind",
    "simulate",
]
