"""The values the metadata store hands out, and how a row is named and checked.

This module owns :class:`CheckpointRow` and :class:`AuditEntry` (frozen: no SQLAlchemy object
escapes the store), the keys that name a row, the errors about rows, and the checks and
conversions between a table's columns and those values. It runs no statement: the store
(``storage.metadata``) does, and the catalogue (``ckptpilot.catalog``) decides which status
a row moves to.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import sqlalchemy as sa

from ckptpilot.errors import CkptPilotError
from ckptpilot.storage.schema import checkpoints
from ckptpilot.vocab import CheckpointKey, Level, RetentionClass, Status, Tier

__all__ = ["MUTABLE_FIELDS", "AuditEntry", "CheckpointRow", "DuplicateCheckpointError", "RowKey",
           "StatusTransitionError", "as_enum", "check_sha256", "row_of", "where_key"]

_SHA256_RE = re.compile(r"[0-9a-f]{64}")

# Fields a caller may change after insertion. Identity (run, step, rank, tier, level), the
# digest and its chain link, and created_at are fixed at add_pending; removed_at is set only
# by finish_removal.
MUTABLE_FIELDS = frozenset({
    "location", "retention_class", "score", "metric_name", "metric_value", "bytes_raw",
    "bytes_encoded", "codec", "seconds_snapshot", "seconds_write", "seconds_validate",
    "reason", "note",
})


class StatusTransitionError(CkptPilotError, ValueError):
    """A status change that the life cycle forbids (e.g. ``corrupted`` → ``valid``)."""


class DuplicateCheckpointError(CkptPilotError, ValueError):
    """A live (pending or valid) row already holds this (run, step, rank, tier)."""


@dataclass(frozen=True)
class CheckpointRow:
    """One checkpoint of one rank in one tier, as stored.

    Times are seconds since the epoch (``time.time()``); ``removed_at`` is set once the file
    of an expired row is known to be gone. ``prev_sha256`` is the ``sha256`` of the row of
    the same run, rank and tier with the next lower step at insertion time (None for the
    first). ``base_step`` is the step of the checkpoint a delta was encoded against.
    """

    id: int
    run_id: str
    step: int
    rank: int
    level: Level
    tier: Tier
    location: str
    status: Status
    retention_class: RetentionClass
    score: float | None
    metric_name: str | None
    metric_value: float | None
    sha256: str
    prev_sha256: str | None
    base_step: int | None
    bytes_raw: int | None
    bytes_encoded: int | None
    codec: str | None
    seconds_snapshot: float | None
    seconds_write: float | None
    seconds_validate: float | None
    created_at: float
    updated_at: float
    removed_at: float | None
    reason: str
    note: str

    @property
    def key(self) -> CheckpointKey:
        """The natural key ``(run_id, step, rank, tier)``, accepted wherever a row id is."""
        return CheckpointKey(self.run_id, self.step, self.rank, self.tier)


@dataclass(frozen=True)
class AuditEntry:
    """One audited action (manual recovery, prune, pin, repair…); ``details`` is JSON."""

    id: int
    at: float
    action: str
    actor: str
    details: dict[str, Any]


RowKey = int | CheckpointKey | tuple[str, int, int, "Tier | str"]
"""A row id, or the natural key ``(run_id, step, rank, tier)``: a :class:`CheckpointKey` or a
plain tuple whose tier is a :class:`Tier` or its name."""


def as_enum(kind: type[Enum], value: object, field: str) -> Any:
    """``kind(value)``, or a ValueError naming ``field`` and the allowed values."""
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(str(member.value) for member in kind)  # type: ignore[attr-defined]
        raise ValueError(f"{field}: {value!r} is not one of {allowed}") from None


def check_sha256(value: object, field: str) -> str:
    if not isinstance(value, str) or _SHA256_RE.fullmatch(value) is None:
        raise ValueError(f"{field}: expected 64 lowercase hex digits, got {value!r}")
    return value


def row_of(mapping: Mapping[str, Any]) -> CheckpointRow:
    """The row of a ``checkpoints`` result mapping, its words as enums."""
    values = dict(mapping)
    values["level"] = Level(values["level"])
    values["tier"] = Tier(values["tier"])
    values["status"] = Status(values["status"])
    values["retention_class"] = RetentionClass(values["retention_class"])
    return CheckpointRow(**values)


def where_key(key: RowKey) -> sa.ColumnElement[bool]:
    """The ``checkpoints`` condition that selects the row ``key`` names."""
    if isinstance(key, int) and not isinstance(key, bool):
        return checkpoints.c.id == key
    if isinstance(key, tuple) and len(key) == 4:
        run_id, step, rank, tier = key
        return sa.and_(
            checkpoints.c.run_id == run_id, checkpoints.c.step == step,
            checkpoints.c.rank == rank,
            checkpoints.c.tier == as_enum(Tier, tier, "tier").value)
    raise TypeError(f"expected a row id or (run_id, step, rank, tier), got {key!r}")
