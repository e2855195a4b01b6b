"""The lineage of one rank's checkpoints: which saved steps make up the run's current
continuation, recorded beside the checkpoints so that losing the metadata database changes
no restore (issue 23).

Restoring step S (``restore(step=S)``, an instability rollback, ``ckptpilot recover``)
abandons what was saved after S. The catalogue expires those rows; but rows are not the
checkpoints, and with the database deleted or rebuilt the abandoned archives would again look
like the newest state. So the abandonment is recorded in the files themselves:

- **A fork record per rank** (``lineage_rank_NNNNN.jsonl``, append-only, one JSON line per
  fork). Every restore that loads a step S starts a new *continuation*: a random id whose
  parent is the continuation current until then, appended (one ``write``, then ``fsync``)
  before the restore returns, so before any save on it.
- **The continuation's id in every checkpoint.** A save carries the current id in its state
  (``meta["branch"]``, hence also in memory and peer images) and in its manifest
  (``branch``). The run's first continuation, before any restore, has the empty id and writes
  neither: checkpoints of a run that never restored are byte for byte what they were, and
  every older checkpoint reads as the first continuation.

Both are needed. A record alone ("steps after S abandoned") cannot tell the abandoned step 27
from step 27 saved again on the new continuation; ids alone say nothing after a restore that
no save has followed yet.

Decision: a fork's parent is always the continuation current when it was made, so the
continuations form one chain. A checkpoint of continuation X at step s belongs to the current
one iff X is the current continuation, or s is at most the step of every fork made after X;
otherwise the first such fork with a lower step abandoned it. A continuation the record does
not know means the record was lost or replaced: :class:`LineageError`, never a guess. A
*reset* fork (parent ``*``, written by ``ckptpilot recover``) adopts every continuation the
lines before it do not know, up to its step: that is how an operator who lost the record
states where the run goes on.

Ranks: every rank's checkpoints, rows and restore are its own, so each rank has its own
record, appended by its pilot under its own lease (and an exclusive ``flock`` on the file,
for ``ckptpilot recover`` writing beside it): no rank reads a file another is writing. The
ranks restore the same step (``RankAgreement``) and each appends after the collective votes;
a rank killed before appending still offers the steps the others refuse, and the agreement's
common steps make every rank load the same one.

Damage: each line carries the SHA256 of its other fields (``json.dumps(..., sort_keys=True)``),
and each names its parent, so a dropped or reordered line is seen. A fork returns only after
writing its whole line, newline included: a last line without its newline never completed,
its restore never returned and nothing was saved on it; it is ignored with a warning and cut
off by the next append. Any other bad line is a :class:`LineageError` naming the file and
line, because it may be an abandonment and guessing could resume the wrong continuation;
``ckptpilot recover --step N --force`` sets such a file aside and starts a new one at N.

Trust (SECURITY.md): the run directory's owner is trusted; this defends against lost and
damaged files, not against that owner. Deleting the record is detected as soon as a checkpoint
names a continuation the record does not know; a deletion before any save on the newest
continuation goes unnoticed and brings back the behaviour before lineage records: the newest
checkpoint that verifies is restored, abandoned or not.

Owns the file's format, its append and damage rules, and the decision above. Must not read
checkpoints or rows: the restorer, the catalogue and ``ckptpilot validate --rebuild`` ask it
about the ids the checkpoints carry.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptpilot.errors import LineageError

__all__ = ["LINEAGE_VERSION", "RESET_PARENT", "Fork", "Lineage", "UnknownContinuationError",
           "fork", "read_lineage"]

log = logging.getLogger("ckptpilot")

LINEAGE_VERSION = 1
RESET_PARENT = "*"
"""The parent of a reset fork: it adopts every continuation the lines before it do not know."""

_ID = re.compile(r"[0-9a-f]{16}")
_FIELDS = ("v", "branch", "parent", "step", "wall_time", "why")


class UnknownContinuationError(LineageError):
    """A checkpoint names a continuation the record does not know (lost or replaced)."""


@dataclass(frozen=True)
class Fork:
    """One restore that started continuation ``branch`` at ``step``; ``line`` is its line
    number in the file."""

    branch: str
    parent: str
    step: int
    wall_time: float
    why: str
    line: int

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.wall_time))
        return f"the run was restored to step {self.step} ({self.why}) at {when}"


@dataclass(frozen=True)
class Lineage:
    """The forks of one rank's record, oldest first."""

    path: Path
    forks: tuple[Fork, ...]

    @property
    def current(self) -> str:
        """The id of the continuation saves go to now ("" before the first restore)."""
        return self.forks[-1].branch if self.forks else ""

    def why_abandoned(self, branch: object, step: int) -> str | None:
        """None when the checkpoint of ``step`` saved on continuation ``branch`` (None or
        "" for the first one) belongs to the current continuation, else why it does not.
        Raises :class:`UnknownContinuationError` for a continuation the record does not
        know."""
        name = "" if branch is None else branch
        if name == self.current:
            return None
        if not isinstance(name, str) or (name and not _ID.fullmatch(name)):
            raise UnknownContinuationError(
                f"continuation id {str(branch)[:40]!r} is not 16 hex digits")
        # Newest fork first: ``cutter`` ends as the oldest fork after ``name`` below ``step``.
        cutter: Fork | None = None
        adopted: tuple[Fork | None] | None = None  # at the oldest reset fork
        for index in range(len(self.forks) - 1, -1, -1):
            later = self.forks[index]
            if later.step < step:
                cutter = later
            if later.parent == RESET_PARENT:
                adopted = (cutter,)
            before = self.forks[index - 1].branch if index else ""
            if before == name:
                return None if cutter is None else self._reason(step, cutter)
        if adopted is not None:
            return None if adopted[0] is None else self._reason(step, adopted[0])
        raise UnknownContinuationError(
            f"saved on continuation {name}, which {self.path} does not record (the file was "
            "deleted, replaced by another run's or restored from an older copy): which saved "
            "steps a restore abandoned cannot be told. Put the file back, or state where the "
            "run goes on with `ckptpilot recover --step N` (it records a new continuation "
            "that adopts the unknown ones up to step N)")

    def _reason(self, step: int, cutter: Fork) -> str:
        return (f"step {step} belongs to a continuation abandoned when {cutter.describe()}; "
                f"recorded in {self.path} line {cutter.line}")


def read_lineage(path: Path) -> Lineage:
    """The record at ``path`` (no file: no fork yet). Raises :class:`LineageError` for a
    damaged one (see the module docstring)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return Lineage(path, ())
    try:
        with contextlib.suppress(OSError):  # a file system without locks: read as is
            fcntl.flock(fd, fcntl.LOCK_SH)
        raw = _read_all(fd)
    finally:
        os.close(fd)
    forks, torn = _parse(path, raw)
    if torn:
        log.warning("%s: ignoring a last line without its newline (%d bytes): a fork whose "
                    "write was cut short never completed, and nothing was saved on it", path,
                    torn)
    return Lineage(path, forks)


def fork(path: Path, step: int, why: str, *, reset: bool = False) -> Lineage:
    """Start a new continuation at ``step`` and return the record with it, durable once this
    returns. ``reset``: a reset fork (see the module docstring). Raises
    :class:`LineageError` when the record is damaged (nothing is written then)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected a non-negative int, got {step!r}")
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        raw = _read_all(fd)
        forks, torn = _parse(path, raw)
        if torn:
            log.warning("%s: cutting off a last line without its newline (%d bytes): a fork "
                        "that never completed", path, torn)
            os.ftruncate(fd, len(raw) - torn)
        parent = RESET_PARENT if reset else (forks[-1].branch if forks else "")
        body: dict[str, Any] = {"v": LINEAGE_VERSION, "branch": uuid.uuid4().hex[:16],
                                "parent": parent, "step": step, "wall_time": time.time(),
                                "why": why}
        line = json.dumps({**body, "sha256": _digest(body)}) + "\n"
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:
        _fsync_dir(path.parent)
    new = Fork(body["branch"], parent, step, body["wall_time"], why, len(forks) + 1)
    return Lineage(path, (*forks, new))


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    return os.pread(fd, size, 0) if size else b""


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _parse(path: Path, raw: bytes) -> tuple[tuple[Fork, ...], int]:
    """The forks in ``raw`` and the length of a torn last line (0: none)."""
    lines = raw.split(b"\n")
    torn = len(lines.pop())
    forks: list[Fork] = []
    for number, line in enumerate(lines, 1):
        forks.append(_parse_line(path, line, number, forks[-1].branch if forks else ""))
    seen = [f.branch for f in forks]
    if len(set(seen)) != len(seen):
        raise LineageError(f"{path}: a continuation id appears twice; the file was edited or "
                           f"pieced together; {_FIX}")
    return tuple(forks), torn


_FIX = ("`ckptpilot recover --step N --force` sets it aside and records where the run goes "
        "on")


def _parse_line(path: Path, line: bytes, number: int, before: str) -> Fork:
    where = f"{path} line {number}"
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as e:
        raise LineageError(f"{where}: not a JSON record ({e}); {_FIX}") from e
    if not isinstance(record, dict) or record.get("v") != LINEAGE_VERSION \
            or set(record) != {*_FIELDS, "sha256"}:
        raise LineageError(f"{where}: not a version-{LINEAGE_VERSION} fork record: "
                           f"{line[:80]!r}; {_FIX}")
    body = {k: record[k] for k in _FIELDS}
    if record["sha256"] != _digest(body):
        raise LineageError(f"{where}: SHA256 mismatch (the line was altered or damaged); "
                           f"{_FIX}")
    branch, parent, step = record["branch"], record["parent"], record["step"]
    wall = record["wall_time"]
    if not (isinstance(branch, str) and _ID.fullmatch(branch)
            and isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 2**63
            and isinstance(wall, (int, float)) and not isinstance(wall, bool)
            and math.isfinite(wall) and isinstance(record["why"], str)):
        raise LineageError(f"{where}: a field is out of range: {line[:120]!r}; {_FIX}")
    if parent not in (before, RESET_PARENT):
        raise LineageError(
            f"{where}: its parent {parent!r} is not the continuation before it "
            f"({before or 'the first'!r}): lines are missing or out of order; {_FIX}")
    return Fork(branch, parent, step, float(wall), record["why"], number)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
