"""What a run directory holds beside its checkpoints: the run's identity and the live pilot's
lease.

- **Identity** (file ``run_id``): a random id (16 hex digits) made once per run directory.
  Metadata rows and shared peers are keyed by it rather than by the folder's name, so a copied
  or renamed run directory keeps its history, and two jobs that both call their directory
  ``run`` stay apart. Created by an atomic link, so ranks starting together agree on one. A
  damaged file (empty, blank, not text, not 16 hex digits) is never replaced by a new id,
  which would orphan every row: the id the metadata database's rows carry repairs it (a
  WARNING says from where; readers that must not write use it without writing), and with no
  such record :class:`~ckptpilot.errors.RunIdError` names the file and the fix.
- **Lease** (file ``lease_rank_NNNNN.lock``): an exclusive OS file lock (``flock``) that a live
  pilot holds for its rank. A second pilot for the same rank of the same run directory refuses
  to start instead of silently sharing (and overwriting) checkpoints, heartbeat ring and
  ledger. The kernel releases the lock when the holder dies, however it dies, so a crashed run
  never leaves a stale lease behind; the file itself stays (removing a lock file races with the
  next holder) and only says who held it last.

This module does no checkpoint I/O. Operations that only read a run (``ckptpilot ls``,
``validate --dry-run``) take no lease.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import socket
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

from ckptpilot.errors import CkptPilotError, RunDirBusyError, RunIdError
from ckptpilot.storage.metadata import MetadataStore

RUN_ID_FILE = "run_id"
__all__ = ["RUN_ID_FILE", "RunDirBusyError", "RunIdError", "RunLease", "aside_path",
           "every_lease", "lease_path", "lineage_path", "read_run_id", "run_identity"]

log = logging.getLogger("ckptpilot")

_RUN_ID = re.compile(r"[0-9a-f]{16}")


def read_run_id(run_dir: Path) -> str | None:
    """The run's id, or None when the directory has none yet (never written to by a pilot).
    Writes nothing: a damaged file is read as the id the metadata records (see the module
    docstring), or raises :class:`RunIdError`."""
    path = run_dir / RUN_ID_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    problem = _run_id_problem(raw)
    if problem is None:
        return raw.decode().strip()
    recorded = _recorded_run_id(run_dir, path, problem)
    log.warning("%s is damaged (%s); using run id %s, which the rows of %s carry (the file is "
                "left as is: the next pilot start or `ckptpilot validate --rebuild` repairs "
                "it)", path, problem, recorded, metadata_path(run_dir))
    return recorded


def run_identity(run_dir: Path) -> str:
    """The run's id, created on first use and repaired when damaged. Raises ``OSError`` when
    it must be written and the directory is not writable, :class:`RunIdError` when it is
    damaged and nothing records what it was."""
    path = run_dir / RUN_ID_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        pass
    else:
        problem = _run_id_problem(raw)
        if problem is None:
            return raw.decode().strip()
        recorded = _recorded_run_id(run_dir, path, problem)
        tmp = run_dir / f".run_id.{os.getpid()}.{uuid.uuid4().hex}"
        tmp.write_text(recorded)
        os.replace(tmp, path)
        log.warning("%s was damaged (%s); repaired it to run id %s, which the rows of %s "
                    "carry", path, problem, recorded, metadata_path(run_dir))
        return recorded
    tmp = run_dir / f".run_id.{os.getpid()}.{uuid.uuid4().hex}"
    tmp.write_text(uuid.uuid4().hex[:16])
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return run_identity(run_dir)


def _run_id_problem(raw: bytes) -> str | None:
    """What is wrong with the bytes of a run id file (None: a valid id)."""
    if not raw:
        return "empty"
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        return f"not text: {raw[:24]!r}"
    if not text:
        return "only white space"
    if not _RUN_ID.fullmatch(text):
        return f"{text[:40]!r} is not a run id of 16 hex digits"
    return None


def _recorded_run_id(run_dir: Path, path: Path, problem: str) -> str:
    """The one run id the metadata database's rows carry, for repairing a damaged file."""
    db = metadata_path(run_dir)
    found: list[str] = []
    why = f"there is no {db}"
    if os.path.lexists(db):
        try:
            with MetadataStore(db, read_only=True) as store:
                found = [k for k in store.run_ids() if _RUN_ID.fullmatch(k)]
        except CkptPilotError as e:
            why = f"{db} cannot be read ({e})"
        else:
            why = f"{db} records no run id"
    if len(found) == 1:
        return found[0]
    if found:
        why = f"{db} holds rows of {len(found)} run ids ({', '.join(found)})"
    raise RunIdError(
        f"{path} is damaged ({problem}) and nothing records the run's id: {why}. Write the "
        "run's 16-hex-digit id into the file (from a backup, or the run_id column of a copy "
        "of metadata.sqlite); or, if no recorded history of this run must be kept, remove the "
        "file: the next pilot start makes a new id")


def metadata_path(run_dir: Path) -> Path:
    """The run's metadata store (``storage.metadata``), shared by every rank."""
    return run_dir / "metadata.sqlite"


def heartbeat_path(run_dir: Path, rank: int) -> Path:
    """The rank's heartbeat ring (``storage.heartbeat``)."""
    return run_dir / f"heartbeat_rank_{rank:05d}.ring"


def ledger_path(run_dir: Path, rank: int) -> Path:
    """The rank's failure ledger (``storage.ledger``)."""
    return run_dir / f"ledger_rank_{rank:05d}.jsonl"


def lineage_path(run_dir: Path, rank: int) -> Path:
    """The rank's lineage record (``storage.lineage``)."""
    return run_dir / f"lineage_rank_{rank:05d}.jsonl"


def lease_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"lease_rank_{rank:05d}.lock"


class RunLease:
    """This process's exclusive hold on one rank of a run directory.

    Acquired in the constructor (never blocks: a held lease is an error, not a queue),
    released by ``release()`` or by the process's death. Not thread-aware: one pilot owns it.
    """

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.path = lease_path(run_dir, rank)
        self.rank = rank
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise RunDirBusyError(
                f"cannot take the lease {self.path} for rank {rank}: {e.strerror or e}; a "
                "pilot needs a writable run directory (read-only access: `ckptpilot ls`, "
                "`ckptpilot validate --dry-run`)") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(fd)
            os.close(fd)
            raise RunDirBusyError(
                f"run directory {run_dir} is in use: rank {rank} is held by {holder} "
                f"(lease {self.path}); stop that process or give this run another "
                "run_dir") from None
        except OSError as e:
            os.close(fd)
            raise RunDirBusyError(
                f"cannot lock {self.path}: {e.strerror or e} (a file system without file "
                "locks? put the run directory on one that has them)") from e
        try:
            info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                               "since_unix": time.time()}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, info, 0)
        except OSError as e:
            os.close(fd)
            raise RunDirBusyError(
                f"cannot write the lease {self.path}: {e.strerror or e}") from e
        self._fd: int | None = fd
        # A pilot dropped without close() still lets go when it is collected.
        self._finalizer = weakref.finalize(self, os.close, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        self._finalizer.detach()
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _describe_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {int(info['pid'])} on host {info['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (its pid is not recorded yet)"


@contextlib.contextmanager
def every_lease(run_dir: Path) -> Iterator[list[RunLease]]:
    """Hold the lease of every rank that ever ran in ``run_dir`` (one with a lease file), for
    an operation that must not run beside a live pilot (rebuilding the metadata database).
    Raises ``RunDirBusyError`` naming the live holder; nothing is held then."""
    held: list[RunLease] = []
    try:
        for path in sorted(run_dir.glob("lease_rank_*.lock")):
            rank = path.stem.rsplit("_", 1)[1]
            if rank.isdigit():
                held.append(RunLease(run_dir, int(rank)))
        yield held
    finally:
        for lease in held:
            lease.release()


def aside_path(path: Path, label: str, companions: Sequence[str] = ("",)) -> Path:
    """A name beside ``path`` that neither it nor any companion file (``path`` + suffix, e.g.
    a database's ``-wal``) takes yet: ``<name>.<label>-<unix time>``, then ``-1``, ``-2`` …
    What a run sets aside (damaged or replaced files) is evidence and is never deleted."""
    stamp = int(time.time())
    aside = path.with_name(f"{path.name}.{label}-{stamp}")
    extra = 0
    while any(os.path.lexists(f"{aside}{suffix}") for suffix in companions):
        extra += 1
        aside = path.with_name(f"{path.name}.{label}-{stamp}-{extra}")
    return aside
