"""The metadata store: one SQLite row per checkpoint per rank per tier, plus an audit trail.

This module owns :class:`MetadataStore`, the one object through which the package reads and
writes the metadata database (SPEC §7): adding a checkpoint's row, changing it in one
transaction as the catalogue directs, the hash chain between rows, the queries, and the audit
log. Its parts live beside it: ``storage.database`` (the file, its connections, locking and
errors, with the storage decisions that protect them), ``storage.schema`` (the tables and
their migrations), ``storage.rows`` (the frozen values handed out, the keys, the errors
about rows). It never touches checkpoint bytes, never decides what to keep
(``ckptpilot.retention`` does), which status a row moves to (``ckptpilot.catalog`` does), or
which checkpoint to load (the restorer does). Callers get frozen :class:`CheckpointRow` /
:class:`AuditEntry` values; no SQLAlchemy object or session escapes this module.

Storage decisions:

- **SQLAlchemy Core, not the ORM.** The API returns frozen dataclasses and every method is
  one short transaction; an ORM session's identity map and lazy state would have to be
  converted away at every return and would tempt callers to hold sessions across threads.

The rest (WAL, synchronous=FULL, BEGIN IMMEDIATE, polled write lock, read-only stores, clear
errors) are in ``storage.database``; migrations without Alembic in ``storage.schema``.
Threading and processes are as ``storage.database`` says: a store may be shared by the
threads of one process, and drops connections it inherited across ``fork``.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ckptpilot.errors import NoCheckpointError
from ckptpilot.storage.database import (
    BUSY_TIMEOUT_SECONDS,
    Database,
    MetadataAccessError,
    MetadataBusyError,
    MetadataCorruptError,
    MetadataSchemaError,
)
from ckptpilot.storage.rows import (
    MUTABLE_FIELDS,
    AuditEntry,
    CheckpointRow,
    DuplicateCheckpointError,
    RowKey,
    StatusTransitionError,
    as_enum,
    check_sha256,
    row_of,
    where_key,
)
from ckptpilot.storage.schema import SCHEMA_VERSION, audit, checkpoints, recorded_version, upgrade
from ckptpilot.vocab import Level, RetentionClass, Status, Tier

__all__ = [
    "SCHEMA_VERSION",
    "AuditEntry",
    "CheckpointRow",
    "DuplicateCheckpointError",
    "MetadataAccessError",
    "MetadataBusyError",
    "MetadataCorruptError",
    "MetadataSchemaError",
    "MetadataStore",
    "RowKey",
    "Status",
    "StatusTransitionError",
    "Tier",
]



def _default_actor() -> str:
    return f"pid {os.getpid()}@{socket.gethostname()}"


class MetadataStore:
    """The checkpoint metadata database of one run directory.

    Life cycle: ``MetadataStore(path)`` creates or upgrades the file and returns ready to
    use; any thread may then call the methods; ``close()`` (or leaving a ``with`` block)
    releases the connections, after which every call raises ``RuntimeError``.

    Row life cycle: the save pipeline calls :meth:`add_pending` once the checkpoint's digest
    is known; every later change of status goes through the catalogue (``catalog.Moves``),
    which hands :meth:`mark`, :meth:`compare_and_mark` and :meth:`finish_removal` the moves
    its named operation allows — the store applies them, the catalogue owns them. Rows are
    never deleted, so the hash chain and the audit log stay verifiable; the only exception
    is a key reused after a corrupted or expired row (see :meth:`add_pending`).

    ``read_only=True`` opens an existing file for reading only and creates no file beside it
    (see "Read-only stores" in ``storage.database``); every write method then raises
    :class:`MetadataAccessError`, and a file of an older schema version is refused, as
    upgrading it would be a write.

    Raises :class:`MetadataSchemaError` when the file is of a newer schema version, is not a
    ckptpilot database, or cannot be put in WAL mode; :class:`MetadataCorruptError` and
    :class:`MetadataAccessError` (from here and from every method) as ``storage.database``
    describes.
    """

    def __init__(self, path: str | os.PathLike[str], *,
                 busy_timeout_seconds: float = BUSY_TIMEOUT_SECONDS,
                 read_only: bool = False) -> None:
        self._db = Database(path, busy_timeout_seconds=busy_timeout_seconds,
                            read_only=read_only)
        self._path = self._db.path
        try:
            upgrade(self._db)
        except BaseException:
            self._db.close()
            raise

    @property
    def path(self) -> Path:
        return self._path

    @property
    def read_only(self) -> bool:
        return self._db.read_only

    @property
    def schema_version(self) -> int:
        """The schema version of the file, as recorded in its ``schema_version`` table."""
        return recorded_version(self._db)

    def close(self) -> None:
        """Release every pooled connection; idempotent."""
        self._db.close()

    def __enter__(self) -> MetadataStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- rows -----------------------------------------------------------------------------------

    def _fetch(self, conn: Connection, key: RowKey) -> CheckpointRow | None:
        found = conn.execute(sa.select(checkpoints).where(where_key(key))).mappings()
        first = found.first()
        return row_of(first) if first is not None else None

    def _fetch_or_raise(self, conn: Connection, key: RowKey) -> CheckpointRow:
        row = self._fetch(conn, key)
        if row is None:
            raise NoCheckpointError(f"{self._path}: no checkpoint row {key!r}")
        return row

    def add_pending(
        self, *, run_id: str, step: int, rank: int, level: Level | str, tier: Tier | str,
        location: str, sha256: str, retention_class: RetentionClass | str,
        score: float | None = None, base_step: int | None = None,
        metric_name: str | None = None, metric_value: float | None = None,
        bytes_raw: int | None = None, bytes_encoded: int | None = None,
        codec: str | None = None, seconds_snapshot: float | None = None,
        seconds_write: float | None = None, reason: str = "", note: str = "",
    ) -> CheckpointRow:
        """Record a checkpoint whose bytes are written or being written, not yet validated.

        ``sha256`` is the digest of the checkpoint as computed before it is written (SPEC §7);
        it is required here because the next row's ``prev_sha256`` is taken from it.
        ``prev_sha256`` is filled from the row of the same run, rank and tier with the next
        lower step. A key held by a ``corrupted`` or ``expired`` row (a step saved again after
        resuming from an earlier checkpoint) is reused: the old row is deleted in the same
        transaction and the replacement is audited. A key held by a ``pending`` or ``valid``
        row raises :class:`DuplicateCheckpointError` — a crashed process's pending rows must
        first be marked ``corrupted``.
        """
        level = as_enum(Level, level, "level")
        tier = as_enum(Tier, tier, "tier")
        retention_class = as_enum(RetentionClass, retention_class, "retention_class")
        check_sha256(sha256, "sha256")
        for name, value in (("step", step), ("rank", rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
        if base_step is not None and not 0 <= base_step < step:
            raise ValueError(
                f"base_step: {base_step} must be an earlier step than the delta's ({step})")
        now = time.time()
        c = checkpoints.c
        with self._db.write() as conn:
            existing = self._fetch(conn, (run_id, step, rank, tier))
            if existing is not None:
                if existing.status in (Status.PENDING, Status.VALID):
                    raise DuplicateCheckpointError(
                        f"{self._path}: run {run_id!r} step {step} rank {rank} tier "
                        f"{tier.value} already has a {existing.status.value} row "
                        f"(id {existing.id}); condemn it first (catalog.Moves.condemn) if its "
                        "writer died")
                conn.execute(sa.delete(checkpoints).where(c.id == existing.id))
                self._insert_audit(conn, "replace", {
                    "replaced_id": existing.id, "run_id": run_id, "step": step, "rank": rank,
                    "tier": tier.value, "status": existing.status.value,
                    "sha256": existing.sha256}, None)
            prev_sha256 = conn.execute(
                sa.select(c.sha256)
                .where(c.run_id == run_id, c.rank == rank, c.tier == tier.value,
                       c.step < step)
                .order_by(c.step.desc()).limit(1)).scalar()
            row_id = conn.execute(sa.insert(checkpoints).values(
                run_id=run_id, step=step, rank=rank, level=level.value, tier=tier.value,
                location=location, status=Status.PENDING.value,
                retention_class=retention_class.value, score=score, metric_name=metric_name,
                metric_value=metric_value, sha256=sha256, prev_sha256=prev_sha256,
                base_step=base_step, bytes_raw=bytes_raw, bytes_encoded=bytes_encoded,
                codec=codec, seconds_snapshot=seconds_snapshot, seconds_write=seconds_write,
                seconds_validate=None, created_at=now, updated_at=now, removed_at=None,
                reason=reason, note=note,
            )).inserted_primary_key[0]
            return self._fetch_or_raise(conn, row_id)

    def _check_move(self, row: CheckpointRow, moves: Mapping[Status, Status],
                    operation: str) -> Status:
        """The status ``operation`` leads ``row`` to; :class:`StatusTransitionError` naming
        the row, its status and the operation's moves when it does not apply to that status."""
        target = moves.get(row.status)
        if target is not None:
            return target
        takes = ", ".join(f"{a.value} (status unchanged)" if a is b else f"{a.value} → {b.value}"
                          for a, b in moves.items())
        raise StatusTransitionError(
            f"{self._path}: cannot apply '{operation}' to row {row.id} (step {row.step}, rank "
            f"{row.rank}, {row.tier.value}): it is {row.status.value}, and '{operation}' takes "
            f"only {takes}")

    def _update(self, conn: Connection, row: CheckpointRow, moves: Mapping[Status, Status],
                operation: str, fields: Mapping[str, Any]) -> CheckpointRow:
        status = self._check_move(row, moves, operation)
        # A digest known only once the bytes are out (the peers' stripe) is recorded when the
        # pending row is published; after that it never changes.
        publishing = row.status is Status.PENDING and status is Status.VALID
        unknown = set(fields) - MUTABLE_FIELDS - ({"sha256"} if publishing else set())
        if unknown:
            raise TypeError(
                f"cannot set {', '.join(sorted(unknown))}; settable fields: "
                f"{', '.join(sorted(MUTABLE_FIELDS))}")
        values = dict(fields)
        if "retention_class" in values:
            values["retention_class"] = as_enum(
                RetentionClass, values["retention_class"], "retention_class").value
        conn.execute(sa.update(checkpoints).where(checkpoints.c.id == row.id).values(
            status=status.value, updated_at=time.time(), **values))
        return self._fetch_or_raise(conn, row.id)

    def mark(self, key: RowKey, moves: Mapping[Status, Status], *, operation: str,
             **fields: Any) -> CheckpointRow:
        """Move a row to the status ``moves`` gives for its present one, and set any of the
        mutable ``fields``, in one transaction (the catalogue's operation ``operation``).

        Raises ``NoCheckpointError`` for an unknown key, :class:`StatusTransitionError` when
        ``moves`` has no move from the row's status, ``TypeError`` for a field that cannot
        change after insertion.
        """
        with self._db.write() as conn:
            return self._update(conn, self._fetch_or_raise(conn, key), moves, operation,
                                fields)

    def compare_and_mark(self, key: RowKey, moves: Mapping[Status, Status], *, operation: str,
                         expect: Mapping[str, Any], **fields: Any) -> CheckpointRow | None:
        """:meth:`mark`, but only while the row still has the ``expect`` column values.

        Returns None, changing nothing, when the row is gone or differs — e.g. a pruning plan
        made before the user pinned that checkpoint as a milestone. Enum values compare equal
        to their strings.
        """
        with self._db.write() as conn:
            row = self._fetch(conn, key)
            if row is None or any(getattr(row, name) != value for name, value in expect.items()):
                return None
            return self._update(conn, row, moves, operation, fields)

    def finish_removal(self, key: RowKey, moves: Mapping[Status, Status], *, operation: str,
                       action: str, details: Mapping[str, Any]) -> CheckpointRow:
        """Record that a row's file is gone: ``removed_at`` and an audit entry. ``moves``
        (the catalogue's) says which statuses that applies to; it changes no status.

        Both are written in one transaction, so a row with ``removed_at`` set always has its
        audit entry, and an expired row without it is unfinished work for the next repair.
        Idempotent: a removal already recorded (by a concurrent repair, say) is left as is.
        """
        with self._db.write() as conn:
            row = self._fetch_or_raise(conn, key)
            self._check_move(row, moves, operation)
            if row.removed_at is not None:
                return row
            now = time.time()
            conn.execute(sa.update(checkpoints).where(checkpoints.c.id == row.id)
                         .values(removed_at=now, updated_at=now))
            self._insert_audit(conn, action, {"row_id": row.id, **details}, None)
            return self._fetch_or_raise(conn, row.id)

    def set_metric(self, key: RowKey, name: str, value: float) -> CheckpointRow:
        """Attach the user metric that best-N retention ranks by; any status, finite value."""
        if not math.isfinite(value):
            raise ValueError(f"metric {name!r}: {value!r} is not finite; best-N cannot rank it")
        with self._db.write() as conn:
            row = self._fetch_or_raise(conn, key)
            conn.execute(sa.update(checkpoints).where(checkpoints.c.id == row.id).values(
                metric_name=name, metric_value=float(value), updated_at=time.time()))
            return self._fetch_or_raise(conn, row.id)

    def pin_milestone(self, step: int, note: str, *,
                      run_id: str | None = None) -> list[CheckpointRow]:
        """Make every live row of ``step`` (all ranks and tiers) a milestone, kept forever.

        ``run_id=None`` pins that step in every run of the file. Expired rows are skipped
        (their files may be gone); the previous classes go to the audit log.
        Raises ``NoCheckpointError`` when no live row has that step.
        """
        c = checkpoints.c
        where = [c.step == step, c.status != Status.EXPIRED.value]
        if run_id is not None:
            where.append(c.run_id == run_id)
        with self._db.write() as conn:
            found = [row_of(m) for m in conn.execute(
                sa.select(checkpoints).where(*where).order_by(c.id)).mappings()]
            if not found:
                scope = f" of run {run_id!r}" if run_id is not None else ""
                raise NoCheckpointError(
                    f"{self._path}: no live checkpoint at step {step}{scope} to pin")
            conn.execute(sa.update(checkpoints).where(c.id.in_([r.id for r in found])).values(
                retention_class=RetentionClass.MILESTONE.value, note=note,
                updated_at=time.time()))
            self._insert_audit(conn, "pin", {
                "step": step, "note": note, "run_id": run_id,
                "rows": {str(r.id): r.retention_class.value for r in found}}, None)
            return [self._fetch_or_raise(conn, r.id) for r in found]

    def get(self, key: RowKey) -> CheckpointRow | None:
        """The row with this id or natural key, or None."""
        with self._db.read() as conn:
            return self._fetch(conn, key)

    def rows(
        self, run_id: str | None = None, rank: int | None = None,
        status: Status | str | Collection[Status | str] | None = None,
        tier: Tier | str | Collection[Tier | str] | None = None,
        level: Level | str | None = None,
    ) -> list[CheckpointRow]:
        """Rows matching every given filter, newest step first (ties: newest insert first).

        ``status`` and ``tier`` take one value or a collection of values.
        """
        c = checkpoints.c
        where: list[sa.ColumnElement[bool]] = []
        if run_id is not None:
            where.append(c.run_id == run_id)
        if rank is not None:
            where.append(c.rank == rank)
        if status is not None:
            values = [status] if isinstance(status, str) else list(status)
            where.append(c.status.in_([as_enum(Status, v, "status").value for v in values]))
        if tier is not None:
            values = [tier] if isinstance(tier, str) else list(tier)
            where.append(c.tier.in_([as_enum(Tier, v, "tier").value for v in values]))
        if level is not None:
            where.append(c.level == as_enum(Level, level, "level").value)
        query = sa.select(checkpoints).where(*where).order_by(c.step.desc(), c.id.desc())
        with self._db.read() as conn:
            return [row_of(m) for m in conn.execute(query).mappings()]

    def run_ids(self) -> dict[str, int]:
        """The number of rows of each run id in the file.

        A run directory's file normally holds one run; another id there means the database
        came from another run, or its rows were keyed before the run had an id.
        """
        c = checkpoints.c
        query = sa.select(c.run_id, sa.func.count()).group_by(c.run_id).order_by(c.run_id)
        with self._db.read() as conn:
            return {run_id: count for run_id, count in conn.execute(query)}

    def adopt_run_id(self, old: str, new: str) -> int:
        """Re-key every row of run ``old``, and the audit entries naming it, to run ``new``.

        For a run directory whose rows were keyed by its folder's name before it had an id:
        its pilot calls this once the id exists. One transaction, audited (``adopt-run-id``);
        returns the number of checkpoint rows re-keyed. Changes nothing and returns 0 when
        ``old`` has no rows (nothing left to adopt) or when ``new`` already has rows, so that
        the rows of two runs are never merged into one.
        """
        if not old or not new:
            raise ValueError(f"adopt_run_id: run ids must not be empty (old={old!r}, "
                             f"new={new!r})")
        if old == new:
            return 0
        c = checkpoints.c
        with self._db.write() as conn:
            if conn.execute(sa.select(c.id).where(c.run_id == new).limit(1)).first():
                return 0
            changed = conn.execute(sa.update(checkpoints).where(c.run_id == old)
                                   .values(run_id=new, updated_at=time.time())).rowcount
            if not changed:
                return 0
            run_of = sa.func.json_extract(audit.c.details, "$.run_id")
            conn.execute(sa.update(audit).where(run_of == old).values(
                details=sa.func.json_set(audit.c.details, "$.run_id", new)))
            self._insert_audit(conn, "adopt-run-id", {"old": old, "new": new, "rows": changed},
                               None)
            return changed

    def newest_valid(self, run_id: str, rank: int,
                     tiers: Collection[Tier | str] = tuple(Tier)) -> CheckpointRow | None:
        """The valid row with the highest step among ``tiers``; ties go to the earlier tier.

        ``tiers`` is an order of preference (default fastest first: memory, peer, remote),
        which is the recovery order of SPEC §7. Heartbeats are not restorable states and
        are ignored.
        """
        order = [as_enum(Tier, t, "tier") for t in tiers]
        candidates = [row for row in self.rows(run_id=run_id, rank=rank, status=Status.VALID,
                                               tier=order)
                      if row.level is not Level.HEARTBEAT]
        if not candidates:
            return None
        return min(candidates, key=lambda row: (-row.step, order.index(row.tier)))

    def verify_chain(self, run_id: str, rank: int, tier: Tier | str) -> list[CheckpointRow]:
        """Rows whose ``prev_sha256`` differs from the ``sha256`` of the row before them.

        Walks the rows of one run, rank and tier by step; the first row must have no
        predecessor digest. An empty list means the chain is intact. A row whose digest was
        altered shows up as a break at the row after it; a deleted row as a break at its
        successor.
        """
        chain = sorted(self.rows(run_id=run_id, rank=rank, tier=tier), key=lambda r: r.step)
        breaks: list[CheckpointRow] = []
        expected: str | None = None
        for row in chain:
            if row.prev_sha256 != expected:
                breaks.append(row)
            expected = row.sha256
        return breaks

    # -- audit ----------------------------------------------------------------------------------

    @staticmethod
    def _insert_audit(conn: Connection, action: str, details: Mapping[str, Any],
                      actor: str | None) -> int:
        return conn.execute(sa.insert(audit).values(
            at=time.time(), action=action, actor=actor or _default_actor(),
            details=dict(details))).inserted_primary_key[0]

    def audit(self, action: str, details: Mapping[str, Any], *,
              actor: str | None = None) -> AuditEntry:
        """Append an audit entry (manual recovery, forced save, rebuild…).

        ``details`` must be JSON-serialisable; ``actor`` defaults to ``pid N@host``.
        """
        if not action:
            raise ValueError("action: must not be empty")
        with self._db.write() as conn:
            entry_id = self._insert_audit(conn, action, details, actor)
            found = conn.execute(sa.select(audit).where(audit.c.id == entry_id)).mappings()
            return AuditEntry(**found.one())

    def audit_log(self, action: str | None = None) -> list[AuditEntry]:
        """Audit entries in the order they were written, optionally of one action."""
        query = sa.select(audit).order_by(audit.c.id)
        if action is not None:
            query = query.where(audit.c.action == action)
        with self._db.read() as conn:
            return [AuditEntry(**m) for m in conn.execute(query).mappings()]
