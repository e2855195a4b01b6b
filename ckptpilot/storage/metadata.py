"""The metadata store: one SQLite row per checkpoint per rank per tier, plus an audit trail.

This module owns the database file, its schema and migrations, the status life cycle of a
checkpoint row, the hash chain between rows, and the audit log (SPEC §7). Long because every
transaction lives here: the locking discipline below (BEGIN IMMEDIATE, polled write lock,
synchronous=FULL) holds only if no statement runs anywhere else. It never touches
checkpoint bytes, never decides what to keep (``ckptpilot.retention`` does) and never decides
which checkpoint to load (the pilot does). Callers get frozen :class:`CheckpointRow` /
:class:`AuditEntry` values; no SQLAlchemy object or session escapes this module.

Storage decisions:

- **SQLite in WAL mode** so that readers never block the writer and the writer never blocks
  readers; the database must live on a local file system (WAL needs shared memory between the
  processes, which NFS does not provide).
- **synchronous=FULL**, not NORMAL. In WAL mode NORMAL keeps the file consistent but a commit
  may be rolled back by a power loss or kernel crash. Retention relies on commit order ("row
  marked ``expired`` and committed, *then* the file is removed"): under NORMAL a power loss
  could undo the mark after the file is gone and leave a ``valid`` row without its file. A
  handful of rows per checkpoint makes the extra fsync per commit negligible next to the
  checkpoint itself.
- **foreign_keys=ON** on every connection (SQLite defaults it off per connection), so any
  reference a later schema version adds is enforced from the start.
- **Write transactions start with BEGIN IMMEDIATE.** A deferred transaction that reads and
  then writes must upgrade its lock; in WAL mode SQLite answers a failed upgrade with
  SQLITE_BUSY at once, without calling the busy handler, because waiting could not help a
  transaction whose snapshot is already stale — the classic "database is locked" under
  concurrent writers. Taking the write lock at BEGIN makes writers queue instead.
- **Writers queue by polling, not by SQLite's busy handler.** The built-in handler backs off
  to 100 ms sleeps, so a process that commits in a loop keeps re-taking the lock while the
  others sleep, and under sustained load they starve until their busy timeout expires
  (bench/RESULTS.md, "Figures formerly quoted in code"). The write lock is therefore requested
  with the busy timeout set to zero and retried after a short random sleep (at most
  ``_LOCK_POLL_SECONDS``) until ``busy_timeout_seconds`` have passed; every other statement
  keeps SQLite's own busy handler with that same timeout.
- **SQLAlchemy Core, not the ORM.** The API returns frozen dataclasses and every method is
  one short transaction; an ORM session's identity map and lazy state would have to be
  converted away at every return and would tempt callers to hold sessions across threads.
- **Migrations without Alembic.** The database is one embedded file that ships with the
  library and is opened by training processes on many nodes; Alembic would add a dependency,
  a migration environment and script directory to the package, and an online tool for a
  schema that has a handful of tables. Instead ``schema_version`` records every applied
  version and ``_MIGRATIONS`` is an ordered tuple of functions with frozen DDL; opening the
  store applies the missing ones in one write transaction, so concurrent openers serialise on
  the write lock and a failed migration leaves the file untouched.
- **SQLite's own errors never escape.** A damaged file (SQLITE_CORRUPT, SQLITE_NOTADB, or a
  directory in its place) raises :class:`MetadataCorruptError`, which names the file and the
  command that rebuilds it; a file out of reach (unwritable, disk full, I/O error) raises
  :class:`MetadataAccessError`. Both come from the constructor and from every method, because
  a partly damaged file may open cleanly and fail on the first page a query touches. Any other
  SQLite error is a bug in this module and is raised as is.
- **Read-only stores create nothing** (``read_only=True``, for listing and dry runs). Opening
  a WAL database with ``mode=ro`` still creates the ``-wal`` and ``-shm`` files, and fails
  where the directory is not writable; so a file without a ``-wal`` file (every commit is in
  the main file) is opened ``immutable=1``, which reads the main file alone, without locks.
  A ``-wal`` file means a writer is live or died mid-run: then ``mode=ro`` reads the log too,
  under the usual locks. Each read transaction opens its own connection, so a writer that
  starts meanwhile is seen by the next read; one that checkpoints its first log during an
  immutable read could show that read a half-copied page, which is reported as such.

Threading and processes: a store may be shared by the threads of one process (every call
checks a connection out of the pool for the duration of one transaction). Each process must
use its own connections: a store carried across ``fork`` drops the inherited pool on first
use, as SQLite forbids using a connection in two processes.
"""

from __future__ import annotations

import math
import os
import random
import re
import socket
import sqlite3
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

from ckptpilot.errors import CkptPilotError, NoCheckpointError
from ckptpilot.vocab import CheckpointKey, Level, RetentionClass, Status, Tier

# Jitter for lock/retry back-off from a private generator: drawing from the global `random`
# would consume the training job's Python RNG and break a bit-exact resume.
_JITTER = random.Random()

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


# Allowed status moves. A row found corrupted never becomes valid again (its bytes may be
# intermittently bad; a new checkpoint must be written), and expired is terminal because its
# file may already be gone. Same-status moves update fields only.
_TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.PENDING: frozenset(Status),
    Status.VALID: frozenset({Status.VALID, Status.CORRUPTED, Status.EXPIRED}),
    Status.CORRUPTED: frozenset({Status.CORRUPTED, Status.EXPIRED}),
    Status.EXPIRED: frozenset({Status.EXPIRED}),
}

SCHEMA_VERSION = 1
"""The schema version this code writes; a database of a newer version is refused."""

_BUSY_TIMEOUT_SECONDS = 30.0
_LOCK_POLL_SECONDS = 0.002
_WRITE_OPTION = "ckptpilot_write"
_SHA256_RE = re.compile(r"[0-9a-f]{64}")

# SQLite primary result codes and their messages; the messages identify an error where Python
# (before 3.11) does not expose the code.
_SQLITE_PERM = 3
_SQLITE_BUSY = 5
_SQLITE_READONLY = 8
_SQLITE_IOERR = 10
_SQLITE_CORRUPT = 11
_SQLITE_FULL = 13
_SQLITE_CANTOPEN = 14
_SQLITE_NOTADB = 26
_SQLITE_MESSAGES = {
    _SQLITE_PERM: "access permission denied",
    _SQLITE_BUSY: "database is locked",
    _SQLITE_READONLY: "attempt to write a readonly database",
    _SQLITE_IOERR: "disk I/O error",
    _SQLITE_CORRUPT: "database disk image is malformed",
    _SQLITE_FULL: "database or disk is full",
    _SQLITE_CANTOPEN: "unable to open database file",
    _SQLITE_NOTADB: "file is not a database",
}
_REBUILD_HINT = ("`ckptpilot validate --rebuild` moves it aside (kept, not deleted) and rebuilds "
                 "the database from the checkpoints")
_READ_ONLY_HINT = ("`ckptpilot ls`, `validate --dry-run` and `recover --dry-run` only read and "
                   "work without write access")

# Fields a caller may change after insertion. Identity (run, step, rank, tier, level), the
# digest and its chain link, and created_at are fixed at add_pending; removed_at is set only
# by finish_removal.
_MUTABLE_FIELDS = frozenset({
    "location", "retention_class", "score", "metric_name", "metric_value", "bytes_raw",
    "bytes_encoded", "codec", "seconds_snapshot", "seconds_write", "seconds_validate",
    "reason", "note",
})


class MetadataSchemaError(CkptPilotError, RuntimeError):
    """The database file has a schema this code cannot use (newer, foreign, or no WAL)."""


class MetadataBusyError(CkptPilotError, TimeoutError):
    """No write lock within the busy timeout: another process holds a write transaction."""


class MetadataCorruptError(CkptPilotError, RuntimeError):
    """The database file is damaged, or something that is not a database sits at its path;
    ``ckptpilot validate --rebuild`` sets it aside and rebuilds it from the checkpoints."""


class MetadataAccessError(CkptPilotError, RuntimeError):
    """The database cannot be opened or changed: an unwritable directory or file, a full disk,
    an I/O error, or a write to a store opened read-only. The file itself is not at fault."""


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


# ---------------------------------------------------------------------------------------------
# Schema. The Core tables describe the current version for queries; the migrations below
# carry their own frozen DDL so that an old database upgrades the same way forever.

_sa_metadata = sa.MetaData()

_checkpoints = sa.Table(
    "checkpoints", _sa_metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("run_id", sa.String, nullable=False),
    sa.Column("step", sa.Integer, nullable=False),
    sa.Column("rank", sa.Integer, nullable=False),
    sa.Column("level", sa.String, nullable=False),
    sa.Column("tier", sa.String, nullable=False),
    sa.Column("location", sa.String, nullable=False),
    sa.Column("status", sa.String, nullable=False),
    sa.Column("retention_class", sa.String, nullable=False),
    sa.Column("score", sa.Float),
    sa.Column("metric_name", sa.String),
    sa.Column("metric_value", sa.Float),
    sa.Column("sha256", sa.String, nullable=False),
    sa.Column("prev_sha256", sa.String),
    sa.Column("base_step", sa.Integer),
    sa.Column("bytes_raw", sa.Integer),
    sa.Column("bytes_encoded", sa.Integer),
    sa.Column("codec", sa.String),
    sa.Column("seconds_snapshot", sa.Float),
    sa.Column("seconds_write", sa.Float),
    sa.Column("seconds_validate", sa.Float),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("removed_at", sa.Float),
    sa.Column("reason", sa.String, nullable=False),
    sa.Column("note", sa.String, nullable=False),
)

_audit = sa.Table(
    "audit", _sa_metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("action", sa.String, nullable=False),
    sa.Column("actor", sa.String, nullable=False),
    sa.Column("details", sa.JSON, nullable=False),
)

_schema_version = sa.Table(
    "schema_version", _sa_metadata,
    sa.Column("version", sa.Integer, primary_key=True),
    sa.Column("applied_at", sa.Float, nullable=False),
    sa.Column("description", sa.String, nullable=False),
)

_V1_DDL = (
    """
    CREATE TABLE checkpoints (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        run_id TEXT NOT NULL,
        step INTEGER NOT NULL CHECK (step >= 0),
        rank INTEGER NOT NULL CHECK (rank >= 0),
        level TEXT NOT NULL CHECK (level IN ('heartbeat', 'pulse', 'organ')),
        tier TEXT NOT NULL CHECK (tier IN ('memory', 'peer', 'remote')),
        location TEXT NOT NULL,
        status TEXT NOT NULL CHECK (status IN ('pending', 'valid', 'corrupted', 'expired')),
        retention_class TEXT NOT NULL
            CHECK (retention_class IN ('critical', 'important', 'routine', 'milestone')),
        score REAL,
        metric_name TEXT,
        metric_value REAL,
        sha256 TEXT NOT NULL,
        prev_sha256 TEXT,
        base_step INTEGER CHECK (base_step IS NULL OR (base_step >= 0 AND base_step < step)),
        bytes_raw INTEGER CHECK (bytes_raw IS NULL OR bytes_raw >= 0),
        bytes_encoded INTEGER CHECK (bytes_encoded IS NULL OR bytes_encoded >= 0),
        codec TEXT,
        seconds_snapshot REAL,
        seconds_write REAL,
        seconds_validate REAL,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        removed_at REAL,
        reason TEXT NOT NULL DEFAULT '',
        note TEXT NOT NULL DEFAULT '',
        UNIQUE (run_id, step, rank, tier)
    )
    """,
    "CREATE INDEX ix_checkpoints_lineage ON checkpoints (run_id, rank, tier, step)",
    "CREATE INDEX ix_checkpoints_status ON checkpoints (status)",
    """
    CREATE TABLE audit (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        at REAL NOT NULL,
        action TEXT NOT NULL,
        actor TEXT NOT NULL,
        details TEXT NOT NULL
    )
    """,
)


def _migrate_to_v1(conn: Connection) -> None:
    """Version 1: the checkpoints and audit tables."""
    for ddl in _V1_DDL:
        conn.exec_driver_sql(ddl)


_MIGRATIONS: tuple[Callable[[Connection], None], ...] = (_migrate_to_v1,)
"""``_MIGRATIONS[i]`` upgrades version ``i`` to ``i + 1``; append, never edit."""

_SCHEMA_VERSION_DDL = """
    CREATE TABLE IF NOT EXISTS schema_version (
        version INTEGER PRIMARY KEY,
        applied_at REAL NOT NULL,
        description TEXT NOT NULL
    )
"""


# ---------------------------------------------------------------------------------------------


def _sqlite_code(error: BaseException) -> int | None:
    """The primary SQLite result code of a driver error (None when it is not a known one)."""
    code = getattr(error, "sqlite_errorcode", None)
    if code is not None:
        return int(code) & 0xFF  # extended codes keep the primary code in the low byte
    text = str(error)
    return next((c for c, message in _SQLITE_MESSAGES.items() if message in text), None)


def _is_busy(error: sqlite3.OperationalError) -> bool:
    return _sqlite_code(error) == _SQLITE_BUSY


def _enum(kind: type[Enum], value: object, field: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(str(member.value) for member in kind)  # type: ignore[attr-defined]
        raise ValueError(f"{field}: {value!r} is not one of {allowed}") from None


def _check_sha256(value: object, field: str) -> str:
    if not isinstance(value, str) or _SHA256_RE.fullmatch(value) is None:
        raise ValueError(f"{field}: expected 64 lowercase hex digits, got {value!r}")
    return value


def _row(mapping: Mapping[str, Any]) -> CheckpointRow:
    values = dict(mapping)
    values["level"] = Level(values["level"])
    values["tier"] = Tier(values["tier"])
    values["status"] = Status(values["status"])
    values["retention_class"] = RetentionClass(values["retention_class"])
    return CheckpointRow(**values)


def _default_actor() -> str:
    return f"pid {os.getpid()}@{socket.gethostname()}"


class MetadataStore:
    """The checkpoint metadata database of one run directory.

    Life cycle: ``MetadataStore(path)`` creates or upgrades the file and returns ready to
    use; any thread may then call the methods; ``close()`` (or leaving a ``with`` block)
    releases the connections, after which every call raises ``RuntimeError``.

    Row life cycle: the save pipeline calls :meth:`add_pending` once the checkpoint's digest
    is known, then :meth:`mark` it ``valid`` or ``corrupted`` after validation; the pruning
    job moves rows to ``expired`` with :meth:`compare_and_mark` and records the removal of
    their files with :meth:`finish_removal`. Rows are never deleted, so the hash chain and
    the audit log stay verifiable; the only exception is a key reused after a corrupted or
    expired row (see :meth:`add_pending`).

    ``read_only=True`` opens an existing file for reading only and creates no file beside it
    (see "Read-only stores" above); every write method then raises
    :class:`MetadataAccessError`, and a file of an older schema version is refused, as
    upgrading it would be a write.

    Raises :class:`MetadataSchemaError` when the file is of a newer schema version, is not a
    ckptpilot database, or cannot be put in WAL mode; :class:`MetadataCorruptError` and
    :class:`MetadataAccessError` (from here and from every method) as described above.
    """

    def __init__(self, path: str | os.PathLike[str], *,
                 busy_timeout_seconds: float = _BUSY_TIMEOUT_SECONDS,
                 read_only: bool = False) -> None:
        self._path = Path(path)
        self._busy_timeout_seconds = busy_timeout_seconds
        self._read_only = read_only
        if read_only:
            if not os.path.lexists(self._path):
                raise MetadataAccessError(
                    f"{self._path}: no such file; a read-only store opens an existing "
                    "database and creates nothing")
            self._engine = sa.create_engine(
                "sqlite://", creator=self._connect_read_only, poolclass=sa.pool.NullPool)
        else:
            self._engine = sa.create_engine(
                f"sqlite:///{self._path}", connect_args={"timeout": busy_timeout_seconds})
        event.listen(self._engine, "connect", self._on_connect)
        event.listen(self._engine, "begin", self._on_begin)
        self._write_engine = self._engine.execution_options(**{_WRITE_OPTION: True})
        self._pid = os.getpid()
        self._closed = False
        try:
            self._upgrade()
        except BaseException:
            self._engine.dispose()
            raise

    # -- connection plumbing ------------------------------------------------------------------

    def _connect_read_only(self) -> sqlite3.Connection:
        """A connection that reads without creating files: ``immutable=1`` while no ``-wal``
        file exists, ``mode=ro`` (which reads the log) while one does."""
        has_log = os.path.lexists(f"{self._path}-wal")
        uri = f"{self._path.absolute().as_uri()}?mode=ro" + ("" if has_log else "&immutable=1")
        return sqlite3.connect(uri, uri=True, timeout=self._busy_timeout_seconds)

    def _on_connect(self, dbapi_connection: sqlite3.Connection, _record: object) -> None:
        """Set the per-connection pragmas and take BEGIN away from the sqlite3 module.

        ``isolation_level = None`` stops the driver from opening transactions on its own
        (it would skip BEGIN before SELECT and DDL); :meth:`_on_begin` emits it instead.
        WAL is persistent in the file, so it is only switched on when not already set
        (:meth:`_journal_mode_wal`); a read-only connection cannot switch it and needs none
        of the write pragmas.
        """
        dbapi_connection.isolation_level = None
        if self._read_only:
            dbapi_connection.execute("PRAGMA query_only=ON")
            return
        cursor = dbapi_connection.cursor()
        try:
            mode = self._journal_mode_wal(cursor)
            if mode.lower() != "wal":
                raise MetadataSchemaError(
                    f"{self._path}: SQLite refused WAL mode (journal_mode stays {mode!r}); "
                    "put the run directory's metadata on a local file system")
            cursor.execute("PRAGMA synchronous=FULL")
            cursor.execute("PRAGMA foreign_keys=ON")
        finally:
            cursor.close()

    def _journal_mode_wal(self, cursor: sqlite3.Cursor) -> str:
        """Switch a fresh file to WAL; returns the journal mode it ends up in.

        The switch reads the file, then upgrades to a write lock. When several processes open
        a fresh file at once, SQLite answers one of two such upgrades "database is locked" at
        once, without its busy handler (it would deadlock otherwise: each holds the read lock
        the other waits for), so the switch is retried until the busy timeout.
        """

        def switch() -> str:
            mode = str(cursor.execute("PRAGMA journal_mode").fetchone()[0])
            if mode.lower() == "wal":
                return mode
            return str(cursor.execute("PRAGMA journal_mode=WAL").fetchone()[0])

        return self._until_unlocked(
            switch, f"could not switch the file to WAL mode within "
            f"{self._busy_timeout_seconds:g} s; another process keeps it locked")

    def _on_begin(self, conn: Connection) -> None:
        """Emit BEGIN for reads and BEGIN IMMEDIATE, queued by polling, for writes."""
        driver = cast(sqlite3.Connection, conn.connection.driver_connection)
        if not conn.get_execution_options().get(_WRITE_OPTION, False):
            driver.execute("BEGIN")
            return
        timeout_ms = round(self._busy_timeout_seconds * 1000)
        driver.execute("PRAGMA busy_timeout=0")
        try:
            self._until_unlocked(
                lambda: driver.execute("BEGIN IMMEDIATE"),
                f"no write lock after {self._busy_timeout_seconds:g} s; another process holds "
                "a write transaction open (a hung pruner or a debugger paused in one?)")
        finally:
            driver.execute(f"PRAGMA busy_timeout={timeout_ms}")

    def _until_unlocked(self, attempt: Callable[[], Any], failure: str) -> Any:
        """``attempt()``, retried after a jittered pause while SQLite answers "database is
        locked", up to the busy timeout; then :class:`MetadataBusyError` saying ``failure``."""
        deadline = time.monotonic() + self._busy_timeout_seconds
        while True:
            try:
                return attempt()
            except sqlite3.OperationalError as error:
                if not _is_busy(error):
                    raise
                if time.monotonic() >= deadline:
                    raise MetadataBusyError(f"{self._path}: {failure}") from error
            time.sleep(_JITTER.uniform(0.0, _LOCK_POLL_SECONDS))

    def _engines(self) -> tuple[Engine, Engine]:
        if self._closed:
            raise RuntimeError(f"MetadataStore({self._path}) is closed")
        if os.getpid() != self._pid:
            # Forked child: the inherited connections belong to the parent.
            self._engine.dispose(close=False)
            self._write_engine = self._engine.execution_options(**{_WRITE_OPTION: True})
            self._pid = os.getpid()
        return self._engine, self._write_engine

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with self._clear_errors(), self._engines()[0].begin() as conn:
            yield conn

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        if self._read_only:
            raise MetadataAccessError(
                f"{self._path}: this store was opened read-only and cannot be changed; open "
                "it without read_only=True (needs write access to its directory)")
        with self._clear_errors(), self._engines()[1].begin() as conn:
            yield conn

    @contextmanager
    def _clear_errors(self) -> Iterator[None]:
        """Raise SQLite's errors about the file as :class:`MetadataCorruptError` or
        :class:`MetadataAccessError`; any other error passes unchanged."""
        try:
            yield
        except (sa.exc.DBAPIError, sqlite3.Error) as error:
            clear = self._clear_error(error)
            if clear is None:
                raise
            raise clear from error

    def _clear_error(self, error: Exception) -> CkptPilotError | None:
        cause = error.orig if isinstance(error, sa.exc.DBAPIError) else error
        code = _sqlite_code(cause)
        detail = str(cause)
        path, folder = self._path, self._path.parent
        if code in (_SQLITE_CANTOPEN, _SQLITE_IOERR, _SQLITE_NOTADB) and path.is_dir():
            return MetadataCorruptError(
                f"{path} is a directory, not the metadata database; {_REBUILD_HINT}")
        if code in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
            if self._read_only and os.path.lexists(f"{path}-wal"):
                return MetadataCorruptError(
                    f"{path}: unreadable ({detail}); a pilot may have started writing it "
                    f"during this read: run the command again, and if it fails the same way "
                    f"the file is damaged: {_REBUILD_HINT}")
            return MetadataCorruptError(f"{path}: the metadata database is damaged ({detail}); "
                                        f"{_REBUILD_HINT}")
        if code == _SQLITE_FULL:
            return MetadataAccessError(
                f"{path}: the disk is full ({detail}); free space on the file system of "
                f"{folder} and retry")
        if code == _SQLITE_IOERR:
            return MetadataAccessError(
                f"{path}: I/O error on the metadata database ({detail}); check the disk and "
                f"the file system of {folder}, then retry")
        if code in (_SQLITE_READONLY, _SQLITE_PERM):
            return MetadataAccessError(
                f"{path}: cannot write the metadata database ({detail}); make {folder} and "
                f"the file writable; {_READ_ONLY_HINT}")
        if code == _SQLITE_CANTOPEN:
            return MetadataAccessError(
                f"{path}: cannot open the metadata database ({detail}); check that {folder} "
                f"exists and is writable, and that the database files in it are readable; "
                f"{_READ_ONLY_HINT}")
        return None

    # -- schema ---------------------------------------------------------------------------------

    def _read_version(self, conn: Connection) -> int | None:
        """The recorded version; 0 for an empty file, None when the file is not ours."""
        tables = set(conn.exec_driver_sql(
            "SELECT name FROM sqlite_master WHERE type = 'table' "
            "AND name NOT LIKE 'sqlite_%'").scalars())
        if "schema_version" in tables:
            return conn.execute(sa.select(sa.func.max(_schema_version.c.version))).scalar() or 0
        return 0 if not tables else None

    def _check_version(self, version: int | None) -> int:
        """``version`` when this code can use or upgrade it; else :class:`MetadataSchemaError`."""
        if version is None:
            raise MetadataSchemaError(
                f"{self._path}: not a ckptpilot metadata database (it has tables but no "
                "schema_version); point the run at another file")
        if version > SCHEMA_VERSION:
            raise MetadataSchemaError(
                f"{self._path}: metadata schema version {version} is newer than this "
                f"ckptpilot understands ({SCHEMA_VERSION}); upgrade ckptpilot, or open a "
                "copy of the run with the version that wrote it")
        return version

    def _upgrade(self) -> None:
        """Bring the file to ``SCHEMA_VERSION``; a current file costs one read transaction."""
        with self._read() as conn:
            version = self._read_version(conn)
        if version == SCHEMA_VERSION:
            return
        if self._read_only:
            self._check_version(version)
            raise MetadataSchemaError(
                f"{self._path}: metadata schema version {version} is older than this "
                f"ckptpilot's ({SCHEMA_VERSION}) and a read-only store cannot upgrade it; "
                "open it once with write access (any pilot or `ckptpilot validate` does)")
        with self._write() as conn:
            # Read again under the write lock: another process may have migrated meanwhile.
            version = self._check_version(self._read_version(conn))
            conn.exec_driver_sql(_SCHEMA_VERSION_DDL)
            for target in range(version + 1, SCHEMA_VERSION + 1):
                migration = _MIGRATIONS[target - 1]
                migration(conn)
                conn.execute(sa.insert(_schema_version).values(
                    version=target, applied_at=time.time(),
                    description=(migration.__doc__ or migration.__name__).strip()))

    @property
    def path(self) -> Path:
        return self._path

    @property
    def read_only(self) -> bool:
        return self._read_only

    @property
    def schema_version(self) -> int:
        """The schema version of the file, as recorded in its ``schema_version`` table."""
        with self._read() as conn:
            return conn.execute(sa.select(sa.func.max(_schema_version.c.version))).scalar_one()

    def close(self) -> None:
        """Release every pooled connection; idempotent."""
        if not self._closed:
            self._closed = True
            self._engine.dispose()

    def __enter__(self) -> MetadataStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- rows -----------------------------------------------------------------------------------

    @staticmethod
    def _where_key(key: RowKey) -> sa.ColumnElement[bool]:
        if isinstance(key, int) and not isinstance(key, bool):
            return _checkpoints.c.id == key
        if isinstance(key, tuple) and len(key) == 4:
            run_id, step, rank, tier = key
            return sa.and_(
                _checkpoints.c.run_id == run_id, _checkpoints.c.step == step,
                _checkpoints.c.rank == rank,
                _checkpoints.c.tier == _enum(Tier, tier, "tier").value)
        raise TypeError(f"expected a row id or (run_id, step, rank, tier), got {key!r}")

    def _fetch(self, conn: Connection, key: RowKey) -> CheckpointRow | None:
        found = conn.execute(sa.select(_checkpoints).where(self._where_key(key))).mappings()
        first = found.first()
        return _row(first) if first is not None else None

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
        level = _enum(Level, level, "level")
        tier = _enum(Tier, tier, "tier")
        retention_class = _enum(RetentionClass, retention_class, "retention_class")
        _check_sha256(sha256, "sha256")
        for name, value in (("step", step), ("rank", rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
        if base_step is not None and not 0 <= base_step < step:
            raise ValueError(
                f"base_step: {base_step} must be an earlier step than the delta's ({step})")
        now = time.time()
        c = _checkpoints.c
        with self._write() as conn:
            existing = self._fetch(conn, (run_id, step, rank, tier))
            if existing is not None:
                if existing.status in (Status.PENDING, Status.VALID):
                    raise DuplicateCheckpointError(
                        f"{self._path}: run {run_id!r} step {step} rank {rank} tier "
                        f"{tier.value} already has a {existing.status.value} row "
                        f"(id {existing.id}); mark it corrupted first if its writer died")
                conn.execute(sa.delete(_checkpoints).where(c.id == existing.id))
                self._insert_audit(conn, "replace", {
                    "replaced_id": existing.id, "run_id": run_id, "step": step, "rank": rank,
                    "tier": tier.value, "status": existing.status.value,
                    "sha256": existing.sha256}, None)
            prev_sha256 = conn.execute(
                sa.select(c.sha256)
                .where(c.run_id == run_id, c.rank == rank, c.tier == tier.value,
                       c.step < step)
                .order_by(c.step.desc()).limit(1)).scalar()
            row_id = conn.execute(sa.insert(_checkpoints).values(
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

    def _update(self, conn: Connection, row: CheckpointRow, status: Status | str,
                fields: Mapping[str, Any]) -> CheckpointRow:
        status = _enum(Status, status, "status")
        # A digest known only once the bytes are out (the peers' stripe) is recorded when the
        # pending row is published; after that it never changes.
        publishing = row.status is Status.PENDING and status is Status.VALID
        unknown = set(fields) - _MUTABLE_FIELDS - ({"sha256"} if publishing else set())
        if unknown:
            raise TypeError(
                f"cannot set {', '.join(sorted(unknown))}; settable fields: "
                f"{', '.join(sorted(_MUTABLE_FIELDS))}")
        if status not in _TRANSITIONS[row.status]:
            raise StatusTransitionError(
                f"{self._path}: row {row.id} (step {row.step}, rank {row.rank}, "
                f"{row.tier.value}) cannot go from {row.status.value} to {status.value}")
        values = dict(fields)
        if "retention_class" in values:
            values["retention_class"] = _enum(
                RetentionClass, values["retention_class"], "retention_class").value
        conn.execute(sa.update(_checkpoints).where(_checkpoints.c.id == row.id).values(
            status=status.value, updated_at=time.time(), **values))
        return self._fetch_or_raise(conn, row.id)

    def mark(self, key: RowKey, status: Status | str, **fields: Any) -> CheckpointRow:
        """Move a row to ``status`` and set any of the mutable ``fields`` in one transaction.

        Raises ``NoCheckpointError`` for an unknown key, :class:`StatusTransitionError` for a
        forbidden move, ``TypeError`` for a field that cannot change after insertion.
        """
        with self._write() as conn:
            return self._update(conn, self._fetch_or_raise(conn, key), status, fields)

    def compare_and_mark(self, key: RowKey, status: Status | str, *,
                         expect: Mapping[str, Any], **fields: Any) -> CheckpointRow | None:
        """:meth:`mark`, but only while the row still has the ``expect`` column values.

        Returns None, changing nothing, when the row is gone or differs — e.g. a pruning plan
        made before the user pinned that checkpoint as a milestone. Enum values compare equal
        to their strings.
        """
        with self._write() as conn:
            row = self._fetch(conn, key)
            if row is None or any(getattr(row, name) != value for name, value in expect.items()):
                return None
            return self._update(conn, row, status, fields)

    def finish_removal(self, key: RowKey, *, action: str,
                       details: Mapping[str, Any]) -> CheckpointRow:
        """Record that an expired row's file is gone: ``removed_at`` and an audit entry.

        Both are written in one transaction, so a row with ``removed_at`` set always has its
        audit entry, and an expired row without it is unfinished work for the next repair.
        Idempotent: a removal already recorded (by a concurrent repair, say) is left as is.
        """
        with self._write() as conn:
            row = self._fetch_or_raise(conn, key)
            if row.status is not Status.EXPIRED:
                raise StatusTransitionError(
                    f"{self._path}: row {row.id} is {row.status.value}; only an expired row's "
                    "file may be removed")
            if row.removed_at is not None:
                return row
            now = time.time()
            conn.execute(sa.update(_checkpoints).where(_checkpoints.c.id == row.id)
                         .values(removed_at=now, updated_at=now))
            self._insert_audit(conn, action, {"row_id": row.id, **details}, None)
            return self._fetch_or_raise(conn, row.id)

    def set_metric(self, key: RowKey, name: str, value: float) -> CheckpointRow:
        """Attach the user metric that best-N retention ranks by; any status, finite value."""
        if not math.isfinite(value):
            raise ValueError(f"metric {name!r}: {value!r} is not finite; best-N cannot rank it")
        with self._write() as conn:
            row = self._fetch_or_raise(conn, key)
            conn.execute(sa.update(_checkpoints).where(_checkpoints.c.id == row.id).values(
                metric_name=name, metric_value=float(value), updated_at=time.time()))
            return self._fetch_or_raise(conn, row.id)

    def pin_milestone(self, step: int, note: str, *,
                      run_id: str | None = None) -> list[CheckpointRow]:
        """Make every live row of ``step`` (all ranks and tiers) a milestone, kept forever.

        ``run_id=None`` pins that step in every run of the file. Expired rows are skipped
        (their files may be gone); the previous classes go to the audit log.
        Raises ``NoCheckpointError`` when no live row has that step.
        """
        c = _checkpoints.c
        where = [c.step == step, c.status != Status.EXPIRED.value]
        if run_id is not None:
            where.append(c.run_id == run_id)
        with self._write() as conn:
            found = [_row(m) for m in conn.execute(
                sa.select(_checkpoints).where(*where).order_by(c.id)).mappings()]
            if not found:
                scope = f" of run {run_id!r}" if run_id is not None else ""
                raise NoCheckpointError(
                    f"{self._path}: no live checkpoint at step {step}{scope} to pin")
            conn.execute(sa.update(_checkpoints).where(c.id.in_([r.id for r in found])).values(
                retention_class=RetentionClass.MILESTONE.value, note=note,
                updated_at=time.time()))
            self._insert_audit(conn, "pin", {
                "step": step, "note": note, "run_id": run_id,
                "rows": {str(r.id): r.retention_class.value for r in found}}, None)
            return [self._fetch_or_raise(conn, r.id) for r in found]

    def get(self, key: RowKey) -> CheckpointRow | None:
        """The row with this id or natural key, or None."""
        with self._read() as conn:
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
        c = _checkpoints.c
        where: list[sa.ColumnElement[bool]] = []
        if run_id is not None:
            where.append(c.run_id == run_id)
        if rank is not None:
            where.append(c.rank == rank)
        if status is not None:
            values = [status] if isinstance(status, str) else list(status)
            where.append(c.status.in_([_enum(Status, v, "status").value for v in values]))
        if tier is not None:
            values = [tier] if isinstance(tier, str) else list(tier)
            where.append(c.tier.in_([_enum(Tier, v, "tier").value for v in values]))
        if level is not None:
            where.append(c.level == _enum(Level, level, "level").value)
        query = sa.select(_checkpoints).where(*where).order_by(c.step.desc(), c.id.desc())
        with self._read() as conn:
            return [_row(m) for m in conn.execute(query).mappings()]

    def run_ids(self) -> dict[str, int]:
        """The number of rows of each run id in the file.

        A run directory's file normally holds one run; another id there means the database
        came from another run, or its rows were keyed before the run had an id.
        """
        c = _checkpoints.c
        query = sa.select(c.run_id, sa.func.count()).group_by(c.run_id).order_by(c.run_id)
        with self._read() as conn:
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
        c = _checkpoints.c
        with self._write() as conn:
            if conn.execute(sa.select(c.id).where(c.run_id == new).limit(1)).first():
                return 0
            changed = conn.execute(sa.update(_checkpoints).where(c.run_id == old)
                                   .values(run_id=new, updated_at=time.time())).rowcount
            if not changed:
                return 0
            run_of = sa.func.json_extract(_audit.c.details, "$.run_id")
            conn.execute(sa.update(_audit).where(run_of == old).values(
                details=sa.func.json_set(_audit.c.details, "$.run_id", new)))
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
        order = [_enum(Tier, t, "tier") for t in tiers]
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
        return conn.execute(sa.insert(_audit).values(
            at=time.time(), action=action, actor=actor or _default_actor(),
            details=dict(details))).inserted_primary_key[0]

    def audit(self, action: str, details: Mapping[str, Any], *,
              actor: str | None = None) -> AuditEntry:
        """Append an audit entry (manual recovery, forced save, rebuild…).

        ``details`` must be JSON-serialisable; ``actor`` defaults to ``pid N@host``.
        """
        if not action:
            raise ValueError("action: must not be empty")
        with self._write() as conn:
            entry_id = self._insert_audit(conn, action, details, actor)
            found = conn.execute(sa.select(_audit).where(_audit.c.id == entry_id)).mappings()
            return AuditEntry(**found.one())

    def audit_log(self, action: str | None = None) -> list[AuditEntry]:
        """Audit entries in the order they were written, optionally of one action."""
        query = sa.select(_audit).order_by(_audit.c.id)
        if action is not None:
            query = query.where(_audit.c.action == action)
        with self._read() as conn:
            return [AuditEntry(**m) for m in conn.execute(query).mappings()]
