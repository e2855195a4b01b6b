"""Which checkpoints a recovery tries, in which order (SPEC §7). Pure: no I/O.

Inputs are what the tier listing and the metadata store say about each checkpoint; the output
is the ordered list of attempts plus the candidates excluded up front, each with its reason.
The caller (the pilot) verifies each attempt on read and moves to the next on failure.

Order: newest first across tiers (memory → peer → remote at equal step: faster first); at
most ``max_walk`` attempts walking back the chain, then the newest organ not yet tried (an
organ is self-contained, so it still loads when every recent delta chain is broken).
A checkpoint the metadata marks ``corrupted``/``expired``/``pending`` is not attempted; one
the metadata does not know (database lost or stale) is attempted — reading verifies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

TIER_SPEED = {"memory": 0, "peer": 1, "remote": 2}


@dataclass(frozen=True)
class Candidate:
    step: int
    level: str
    tier: str
    name: str
    status: str | None  # from the metadata store; None when the store has no row


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
        if c.status not in (None, "valid"):
            excluded.append((c, f"marked {c.status} in the metadata store"))
        else:
            usable.append(c)
    usable.sort(key=lambda c: (-c.step, TIER_SPEED.get(c.tier, 99)))
    attempts = usable[:max_walk]
    organ = next((c for c in usable[max_walk:] if c.level == "organ"), None)
    if organ is not None:
        attempts.append(organ)
    return RecoveryPlan(attempts=tuple(attempts), excluded=tuple(excluded))
