"""The words every layer shares: checkpoint levels, tiers, row statuses, retention classes,
recovery sources, the checkpoint key, why a run was stopped and the exit statuses it then
ends with.

The ground floor of the package: it imports nothing from ckptpilot, so the metadata store,
the planners, the tiers and the pilot all speak the same enums without depending on one
another. Every enum is a ``str`` enum whose values are the words written to disk (metadata
rows, manifests, decision logs), so a member equals its stored string and those formats do
not change. Behaviour lives elsewhere; this module holds names and their fixed order only.
"""

from __future__ import annotations

from enum import Enum, IntEnum
from typing import NamedTuple

__all__ = ["CheckpointKey", "ExitStatus", "Level", "RecoverySource", "RetentionClass", "Status",
           "StopCause", "Tier"]


class Level(str, Enum):
    """What a checkpoint contains (SPEC §2): a heartbeat (step record only), a pulse (the
    full state, through the codecs) or an organ (the full state, self-contained)."""

    HEARTBEAT = "heartbeat"
    PULSE = "pulse"
    ORGAN = "organ"

    @property
    def rank(self) -> int:
        """0, 1, 2 from heartbeat to organ: the level plotted in TensorBoard."""
        return _LEVEL_RANK[self.value]


_LEVEL_RANK = {"heartbeat": 0, "pulse": 1, "organ": 2}


class RetentionClass(str, Enum):
    """How hard retention keeps a checkpoint (SPEC §6); ``critical`` and ``milestone`` are
    never pruned."""

    CRITICAL = "critical"
    IMPORTANT = "important"
    ROUTINE = "routine"
    MILESTONE = "milestone"


class Tier(str, Enum):
    """Where a checkpoint lives (SPEC §2). Members compare by speed, fastest first
    (``Tier.MEMORY < Tier.PEER < Tier.REMOTE``): recovery reads a step from the fastest tier
    that holds it. A plain string compares as the tier it names."""

    MEMORY = "memory"
    PEER = "peer"
    REMOTE = "remote"

    @property
    def speed(self) -> int:
        """0 for the fastest tier, counting up as tiers get slower."""
        return _TIER_SPEED[self.value]

    def __lt__(self, other: object) -> bool:
        return self.speed < _speed(other)

    def __le__(self, other: object) -> bool:
        return self.speed <= _speed(other)

    def __gt__(self, other: object) -> bool:
        return self.speed > _speed(other)

    def __ge__(self, other: object) -> bool:
        return self.speed >= _speed(other)


_TIER_SPEED = {"memory": 0, "peer": 1, "remote": 2}


def _speed(other: object) -> int:
    if not isinstance(other, str):
        raise TypeError(f"a Tier compares with a Tier or a tier name, not {other!r}")
    return Tier(other).speed


class Status(str, Enum):
    """Life cycle of a checkpoint row; ``catalog`` owns the allowed moves."""

    PENDING = "pending"
    VALID = "valid"
    CORRUPTED = "corrupted"
    EXPIRED = "expired"


class RecoverySource(str, Enum):
    """Where ``restore()`` found the state it loaded; ``none`` when the run had none."""

    MEMORY = "memory"
    PEER = "peer"
    REMOTE = "remote"
    NONE = "none"


class CheckpointKey(NamedTuple):
    """The natural key of one checkpoint row: one rank's copy of one step in one tier."""

    run_id: str
    step: int
    rank: int
    tier: Tier


class StopCause(str, Enum):
    """Why the pilot itself ended a run (the ``cause`` of a ledger ``stop`` record): a
    preemption notice is no failure, a hang is one (it counts in the MTBF)."""

    PREEMPTION = "preemption"
    HANG = "hang"


class ExitStatus(IntEnum):
    """The process exit statuses the pilot ends a run with (docs/operations/
    preemption-and-hangs.md). Outside 1-2 (errors), 126-165 (shells and signals) and the
    values of ``sysexits.h`` below 75, so a launcher can tell them from a crash."""

    PREEMPTED = 75  # notice honoured: the emergency organ is durable and valid
    PREEMPTED_UNSAVED = 76  # notice honoured, but the organ was not valid within the grace
    HANG = 77  # no step progress within the watchdog's bound
