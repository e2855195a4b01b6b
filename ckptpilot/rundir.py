"""What a run directory holds beside its checkpoints: the run's identity and the live pilot's
lease.

- **Identity** (file ``run_id``): a random id made once per run directory. Metadata rows and
  shared peers are keyed by it rather than by the folder's name, so a copied or renamed run
  directory keeps its history, and two jobs that both call their directory ``run`` stay apart.
  Created by an atomic link, so ranks starting together agree on one.
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
import os
import socket
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

from ckptpilot.errors import RunDirBusyError

RUN_ID_FILE = "run_id"
__all__ = ["RUN_ID_FILE", "RunDirBusyError", "RunLease", "aside_path", "every_lease",
           "lease_path", "read_run_id", "run_identity"]


def read_run_id(run_dir: Path) -> str | None:
    """The run's id, or None when the directory has none yet (never written to by a pilot)."""
    try:
        text = (run_dir / RUN_ID_FILE).read_text().strip()
    except FileNotFoundError:
        return None
    return text or None


def run_identity(run_dir: Path) -> str:
    """The run's id, created on first use. Raises ``OSError`` when it must be created and the
    directory is not writable."""
    existing = read_run_id(run_dir)
    if existing is not None:
        return existing
    tmp = run_dir / f".run_id.{os.getpid()}.{uuid.uuid4().hex}"
    tmp.write_text(uuid.uuid4().hex[:16])
    try:
        os.link(tmp, run_dir / RUN_ID_FILE)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return (run_dir / RUN_ID_FILE).read_text().strip()


def metadata_path(run_dir: Path) -> Path:
    """The run's metadata store (``storage.metadata``), shared by every rank."""
    return run_dir / "metadata.sqlite"


def heartbeat_path(run_dir: Path, rank: int) -> Path:
    """The rank's heartbeat ring (``storage.heartbeat``)."""
    return run_dir / f"heartbeat_rank_{rank:05d}.ring"


def ledger_path(run_dir: Path, rank: int) -> Path:
    """The rank's failure ledger (``storage.ledger``)."""
    return run_dir / f"ledger_rank_{rank:05d}.jsonl"


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
