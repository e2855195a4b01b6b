"""The metadata store's schema: its tables, their versions and the migrations between them.

This module owns the layout of the database file (SPEC §7) and how an older file is brought
up to date. It runs its statements only through :class:`~ckptpilot.storage.database.Database`
transactions, and knows nothing of what a row means: the store (``storage.metadata``) reads
and writes the rows.

Storage decisions:

- **Migrations without Alembic.** The database is one embedded file that ships with the
  library and is opened by training processes on many nodes; Alembic would add a dependency,
  a migration environment and script directory to the package, and an online tool for a
  schema that has a handful of tables. Instead ``schema_version`` records every applied
  version and ``MIGRATIONS`` is an ordered tuple of functions with frozen DDL; opening the
  store applies the missing ones in one write transaction, so concurrent openers serialise on
  the write lock and a failed migration leaves the file untouched.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ckptpilot.storage.database import Database, MetadataSchemaError

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "audit", "checkpoints", "recorded_version",
           "schema_version", "upgrade"]

SCHEMA_VERSION = 1
"""The schema version this code writes; a database of a newer version is refused."""

# The Core tables describe the current version for queries; the migrations below
# carry their own frozen DDL so that an old database upgrades the same way forever.

_sa_metadata = sa.MetaData()

checkpoints = sa.Table(
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

audit = sa.Table(
    "audit", _sa_metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("action", sa.String, nullable=False),
    sa.Column("actor", sa.String, nullable=False),
    sa.Column("details", sa.JSON, nullable=False),
)

schema_version = sa.Table(
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


MIGRATIONS: tuple[Callable[[Connection], None], ...] = (_migrate_to_v1,)
"""``MIGRATIONS[i]`` upgrades version ``i`` to ``i + 1``; append, never edit."""

_SCHEMA_VERSION_DDL = """
    CREATE TABLE IF NOT EXISTS schema_version (
        version INTEGER PRIMARY KEY,
        applied_at REAL NOT NULL,
        description TEXT NOT NULL
    )
"""


def _read_version(conn: Connection) -> int | None:
    """The recorded version; 0 for an empty file, None when the file is not ours."""
    tables = set(conn.exec_driver_sql(
        "SELECT name FROM sqlite_master WHERE type = 'table' "
        "AND name NOT LIKE 'sqlite_%'").scalars())
    if "schema_version" in tables:
        return conn.execute(sa.select(sa.func.max(schema_version.c.version))).scalar() or 0
    return 0 if not tables else None


def _check_version(db: Database, version: int | None) -> int:
    """``version`` when this code can use or upgrade it; else :class:`MetadataSchemaError`."""
    if version is None:
        raise MetadataSchemaError(
            f"{db.path}: not a ckptpilot metadata database (it has tables but no "
            "schema_version); point the run at another file")
    if version > SCHEMA_VERSION:
        raise MetadataSchemaError(
            f"{db.path}: metadata schema version {version} is newer than this "
            f"ckptpilot understands ({SCHEMA_VERSION}); upgrade ckptpilot, or open a "
            "copy of the run with the version that wrote it")
    return version


def upgrade(db: Database) -> None:
    """Bring the file to ``SCHEMA_VERSION``; a current file costs one read transaction."""
    with db.read() as conn:
        version = _read_version(conn)
    if version == SCHEMA_VERSION:
        return
    if db.read_only:
        _check_version(db, version)
        raise MetadataSchemaError(
            f"{db.path}: metadata schema version {version} is older than this "
            f"ckptpilot's ({SCHEMA_VERSION}) and a read-only store cannot upgrade it; "
            "open it once with write access (any pilot or `ckptpilot validate` does)")
    with db.write() as conn:
        # Read again under the write lock: another process may have migrated meanwhile.
        version = _check_version(db, _read_version(conn))
        conn.exec_driver_sql(_SCHEMA_VERSION_DDL)
        for target in range(version + 1, SCHEMA_VERSION + 1):
            migration = MIGRATIONS[target - 1]
            migration(conn)
            conn.execute(sa.insert(schema_version).values(
                version=target, applied_at=time.time(),
                description=(migration.__doc__ or migration.__name__).strip()))


def recorded_version(db: Database) -> int:
    """The schema version of the file, as recorded in its ``schema_version`` table."""
    with db.read() as conn:
        return conn.execute(sa.select(sa.func.max(schema_version.c.version))).scalar_one()
