"""Which checkpoints a recovery tries, in which order (SPEC §7). Pure: no I/O.

Inputs are what the tier listing and the metadata store say about each checkpoint; the output
is the ordered list of attempts plus the candidates excluded up front, each with its reason.
The caller (the pilot) verifies each attempt on read and moves to the next on failure.

Order: newest first across tiers (memory → peer → remote at equal step: faster first); at
most ``max_walk`` attempts walking back the chain, then the newest organ not yet tried (an
organ is self-contained, so it still loads when every recent delta chain is broken).
A checkpoint the metadata marks ``corrupted``/``expired``/``pending`` is not attempted; one
the metadata does not know (database lost or stale) is attempted — reading verifies it —
unless the run's lineage record says a restore abandoned it (``abandoned``: why).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ckptpilot.vocab import Level, Status, Tier


@dataclass(frozen=True)
class Candidate:
    """One copy of one step. ``level`` is a plain string when the copy's own manifest
    cannot say (``"unknown"``); ``status`` is None when the metadata store has no row;
    ``abandoned`` says why the copy belongs to a continuation a restore abandoned."""

    step: int
    level: Level | str
    tier: Tier
    name: str
    status: Status | None
    abandoned: str | None = None


@dataclass(frozen=True)
class RecoveryPlan:
    attempts: tuple[Candidate, ...]
    excluded: tuple[tuple[Candidate, str], ...]


def plan_recovery(candidates: Sequence[Candidate], *, max_walk: int = 5,
                  step: int | None = None) -> RecoveryPlan:
    """Order the attempts; with ``step`` only that step is considered (any tier)."""
    excluded: list[tuple[Candidate, str]] = []
    usable: list[Candidate] = []
    for c in candidates:
        if step is not None and c.step != step:
            continue
        if c.abandoned is not None:
            excluded.append((c, c.abandoned))
        elif c.status is not None and c.status != Status.VALID:
            excluded.append((c, f"marked {Status(c.status).value} in the metadata store"))
        else:
            usable.append(c)
    usable.sort(key=lambda c: (-c.step, Tier(c.tier).speed))
    attempts = usable[:max_walk]
    organ = next((c for c in usable[max_walk:] if c.level == Level.ORGAN), None)
    if organ is not None:
        attempts.append(organ)
    return RecoveryPlan(attempts=tuple(attempts), excluded=tuple(excluded))
