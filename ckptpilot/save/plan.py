"""The plan of one save: which tiers take it, in which order, with which fallback.

This module owns :class:`SavePlan` and :func:`plan_save`, built purely from what the save is
for (a :class:`~ckptpilot.catalog.SaveIntent`) and the policy, in the spirit of DCP's
plan/execute split: the writer executes a plan and decides nothing about placement itself, so
the placement rules are readable, and testable, in one place.

Rules: with the peer tier on, a pulse goes to the peers only (a pulse the peers cannot take
goes to the remote tier instead: nothing is dropped) and an organ to the peers and the remote
tier; without it, everything goes to the remote tier. A pulse on the remote tier goes through
the codecs (when they pay at the tier's bandwidth) and is fsynced only with
``levels.pulse.fsync``; an organ is written plain and always fsynced. A save that
verifies stays in the memory tier, when it is on, as the next restore's fastest source and the
base of the next peer deltas.

It must not do I/O. Threading: any.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptpilot.catalog import SaveIntent
from ckptpilot.policy import Policy
from ckptpilot.vocab import Level, Tier

__all__ = ["SavePlan", "plan_save"]


@dataclass(frozen=True)
class SavePlan:
    """``tiers`` in write order; ``fallback`` takes the save when none of them could;
    ``codecs``: encode through the codec selector on the remote tier; ``fsync``: make the
    remote tier's files durable before publication."""

    intent: SaveIntent
    tiers: tuple[Tier, ...]
    fallback: Tier | None
    codecs: bool
    keep_in_memory: bool
    fsync: bool = True


def plan_save(intent: SaveIntent, policy: Policy, *, rank_local: bool = True) -> SavePlan:
    """The plan for ``intent`` under ``policy`` (see the module docstring for the rules).
    ``rank_local``: whether one rank's tiers (memory, peer) can hold this run's state; a
    state no rank holds alone (a sharded one: every rank's part makes one DCP checkpoint)
    goes to the remote tier only, whatever the policy enables."""
    pulse = intent.level == Level.PULSE.value
    tiers: tuple[Tier, ...] = (Tier.REMOTE,)
    fallback = None
    if policy.tiers.peer.enabled and rank_local:
        tiers = (Tier.PEER,) if pulse else (Tier.PEER, Tier.REMOTE)
        fallback = Tier.REMOTE if pulse else None
    return SavePlan(intent=intent, tiers=tiers, fallback=fallback, codecs=pulse,
                    keep_in_memory=policy.tiers.memory.enabled and rank_local,
                    fsync=not pulse or policy.levels.pulse.fsync)
