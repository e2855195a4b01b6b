"""The SQLite file under the metadata store: its connections, its locking and its errors.

This module owns how the store reaches its file: one :class:`Database` per store opens the
connections, starts every transaction (:meth:`Database.read`, :meth:`Database.write`) and
turns SQLite's errors about the file into clear ones. Every statement of the store runs
inside one of those two transactions; the locking discipline below holds because nothing
opens a connection to the file another way. It knows no table: the schema, its migrations
(``storage.schema``) and the rows (``storage.metadata``) are the store's.

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
- **SQLite's own errors never escape.** A damaged file (SQLITE_CORRUPT, SQLITE_NOTADB, or a
  directory in its place) raises :class:`MetadataCorruptError`, which names the file and the
  command that rebuilds it; a file out of reach (unwritable, disk full, I/O error) raises
  :class:`MetadataAccessError`. Both come from every transaction (so from the store's
  constructor and every method), because a partly damaged file may open cleanly and fail on
  the first page a query touches. Any other SQLite error is a bug in the store and is raised
  as is.
- **Read-only stores create nothing** (``read_only=True``, for listing and dry runs). Opening
  a WAL database with ``mode=ro`` still creates the ``-wal`` and ``-shm`` files, and fails
  where the directory is not writable; so a file without a ``-wal`` file (every commit is in
  the main file) is opened ``immutable=1``, which reads the main file alone, without locks.
  A ``-wal`` file means a writer is live or died mid-run: then ``mode=ro`` reads the log too,
  under the usual locks. Each read transaction opens its own connection, so a writer that
  starts meanwhile is seen by the next read; one that checkpoints its first log during an
  immutable read could show that read a half-copied page, which is reported as such.

Threading and processes: a database (and so a store) may be shared by the threads of one
process (every transaction checks a connection out of the pool for its duration). Each process
must use its own connections: one carried across ``fork`` drops the inherited pool on first
use, as SQLite forbids using a connection in two processes.
"""

from __future__ import annotations

import os
import random
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

from ckptpilot.errors import CkptPilotError

__all__ = [
    "BUSY_TIMEOUT_SECONDS",
    "Database",
    "MetadataAccessError",
    "MetadataBusyError",
    "MetadataCorruptError",
    "MetadataSchemaError",
]

# Jitter for lock/retry back-off from a private generator: drawing from the global `random`
# would consume the training job's Python RNG and break a bit-exact resume.
_JITTER = random.Random()

BUSY_TIMEOUT_SECONDS = 30.0
"""How long a transaction waits for the file's lock before giving up (SPEC §7)."""
_LOCK_POLL_SECONDS = 0.002
_WRITE_OPTION = "ckptpilot_write"

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


def _sqlite_code(error: BaseException) -> int | None:
    """The primary SQLite result code of a driver error (None when it is not a known one)."""
    code = getattr(error, "sqlite_errorcode", None)
    if code is not None:
        return int(code) & 0xFF  # extended codes keep the primary code in the low byte
    text = str(error)
    return next((c for c, message in _SQLITE_MESSAGES.items() if message in text), None)


def _is_busy(error: sqlite3.OperationalError) -> bool:
    return _sqlite_code(error) == _SQLITE_BUSY


class Database:
    """The connections to one metadata file, and the two kinds of transaction on it.

    Life cycle: ``Database(path)`` prepares the engine (no connection is opened yet); any
    thread may then run transactions; ``close()`` releases the connections, after which
    every transaction raises ``RuntimeError``. ``read_only=True`` opens an existing file and
    creates nothing beside it (see "Read-only stores" above); :meth:`write` then raises
    :class:`MetadataAccessError`.
    """

    def __init__(self, path: str | os.PathLike[str], *,
                 busy_timeout_seconds: float = BUSY_TIMEOUT_SECONDS,
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
    def read(self) -> Iterator[Connection]:
        """A read transaction (plain BEGIN: it never blocks the writer)."""
        with self._clear_errors(), self._engines()[0].begin() as conn:
            yield conn

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """A write transaction, its lock taken at BEGIN (queued by polling, see above)."""
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

    @property
    def path(self) -> Path:
        return self._path

    @property
    def read_only(self) -> bool:
        return self._read_only

    def close(self) -> None:
        """Release every pooled connection; idempotent."""
        if not self._closed:
            self._closed = True
            self._engine.dispose()
