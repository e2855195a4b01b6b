"""The failure ledger and the Young/Daly checkpoint-interval bounds (SPEC §4).

This module owns two things:

* :func:`young_interval` and :func:`daly_interval`, pure functions giving the optimal time
  between checkpoints from the cost of one checkpoint δ and the mean time between failures M;
* :class:`FailureLedger`, an append-only JSON-lines file in the run directory recording when
  runs started, ended cleanly and were interrupted, from which the observed MTBF is derived.

It must not decide when to save (the scheduler does, from the bound) nor find out *that* a run
was interrupted (the pilot does, from its heartbeats, and records it here). It never reads the
clock except to stamp a record whose caller gave no ``wall_time``.

Record format, one JSON object per line, version 1 (``"v": 1``), ``"kind"`` one of:

* ``run_start``: ``wall_time``, ``step`` — a run (or a resumed run) began at this step;
* ``run_end``: ``wall_time``, ``step`` — that run ended cleanly;
* ``interruption``: ``wall_time`` (when recorded), ``failed_at`` (wall time the interrupted run
  was last seen alive), ``last_step``, ``recovered_step``, ``steps_lost``, ``source``,
  ``recovery_seconds``.

Threading and lifecycle: one writer (one process, e.g. rank 0, on one thread) per file. Each
append is a single ``write`` followed by ``fsync``, so a killed writer leaves at most one torn
last line; readers skip it with a warning and the next append cuts it off first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from ckptpilot.errors import CheckpointFormatError

__all__ = [
    "LEDGER_VERSION",
    "FailureLedger",
    "Interruption",
    "daly_interval",
    "young_interval",
]

log = logging.getLogger("ckptpilot")

LEDGER_VERSION = 1

_FIELDS: dict[Any, tuple[str, ...]] = {
    "run_start": ("wall_time", "step"),
    "run_end": ("wall_time", "step"),
    "interruption": (
        "wall_time",
        "failed_at",
        "last_step",
        "recovered_step",
        "steps_lost",
        "source",
        "recovery_seconds",
    ),
}


def _check_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def young_interval(delta: float, mtbf: float) -> float:
    """Young's first-order optimum sqrt(2·δ·M): time between checkpoints minimising waste.

    ``delta`` (checkpoint cost) and ``mtbf`` share one time unit; the result is in that unit.
    Accurate when δ ≪ M; :func:`daly_interval` is the better estimate otherwise.
    """
    _check_positive("delta", delta)
    _check_positive("mtbf", mtbf)
    return math.sqrt(2.0 * delta * mtbf)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly's higher-order optimum, in the unit of ``delta`` and ``mtbf``.

    τ = sqrt(2δM)·[1 + ⅓·sqrt(δ/2M) + (1/9)·(δ/2M)] − δ for δ < 2M; once a checkpoint costs
    twice the MTBF or more, the expansion no longer holds and τ = M.
    """
    _check_positive("delta", delta)
    _check_positive("mtbf", mtbf)
    if delta >= 2.0 * mtbf:
        return mtbf
    ratio = delta / (2.0 * mtbf)
    return math.sqrt(2.0 * delta * mtbf) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - delta


@dataclasses.dataclass(frozen=True)
class Interruption:
    """One recorded interruption: the run last seen alive at ``failed_at`` (wall time, s)
    at ``last_step``, resumed from ``recovered_step`` read from ``source`` in
    ``recovery_seconds``; ``wall_time`` is when the record was written."""

    wall_time: float
    failed_at: float
    last_step: int
    recovered_step: int
    steps_lost: int
    source: str
    recovery_seconds: float


class FailureLedger:
    """Append-only record of run starts, clean ends and interruptions, with the MTBF.

    Lifecycle: the pilot calls :meth:`record_run_start` when a run (or resumed run) starts,
    :meth:`record_interruption` when ``restore()`` finds that the previous run died (before
    its own ``record_run_start``), and :meth:`record_run_end` on a clean ``close()``. The file
    is created on the first append; reading a missing file yields no records.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def record_run_start(self, step: int, *, wall_time: float | None = None) -> None:
        """Record that a run started (or resumed) at ``step``."""
        self._append({"kind": "run_start", "wall_time": _now(wall_time), "step": int(step)})

    def record_run_end(self, step: int, *, wall_time: float | None = None) -> None:
        """Record a clean end at ``step``; without it the run's uptime cannot be counted."""
        self._append({"kind": "run_end", "wall_time": _now(wall_time), "step": int(step)})

    def record_interruption(
        self,
        *,
        failed_at: float,
        last_step: int,
        recovered_step: int,
        source: str,
        recovery_seconds: float,
        wall_time: float | None = None,
    ) -> Interruption:
        """Record one interruption and return it.

        ``failed_at`` is the wall time the dead run was last seen alive (its last heartbeat),
        which ends its uptime. ``steps_lost`` is derived as ``last_step − recovered_step``
        (0 if the recovered step is ahead of the last heartbeat).
        """
        failed_at = float(failed_at)
        recovery_seconds = float(recovery_seconds)
        if not math.isfinite(failed_at):
            raise ValueError(f"failed_at must be a finite wall time, got {failed_at!r}")
        if not (math.isfinite(recovery_seconds) and recovery_seconds >= 0):
            raise ValueError(f"recovery_seconds must be >= 0, got {recovery_seconds!r}")
        record = Interruption(
            wall_time=_now(wall_time),
            failed_at=failed_at,
            last_step=int(last_step),
            recovered_step=int(recovered_step),
            steps_lost=max(0, int(last_step) - int(recovered_step)),
            source=str(getattr(source, "value", source)),
            recovery_seconds=recovery_seconds,
        )
        self._append({"kind": "interruption", **dataclasses.asdict(record)})
        return record

    def last_kind(self) -> str | None:
        """Kind of the newest record (``run_start``/``run_end``/``interruption``), None if empty.

        ``run_start`` as the newest record means the run it started never closed cleanly.
        """
        records = self._records()
        return records[-1]["kind"] if records else None

    def interruptions(self) -> list[Interruption]:
        """Every recorded interruption, oldest first."""
        return [
            _interruption(record) for record in self._records() if record["kind"] == "interruption"
        ]

    def mtbf_seconds(self, now: float | None = None) -> float | None:
        """Observed run time divided by the number of interruptions; None without any.

        A run's uptime runs from its ``run_start`` to the first of: the ``failed_at`` of the
        next interruption, its ``run_end``, or ``now`` for a run still going (pass ``now`` to
        count it). A run followed by another start with neither record between counts no
        uptime: an unknown end is taken pessimistically, which shortens the interval.
        """
        uptime = 0.0
        failures = 0
        started: float | None = None
        for record in self._records():
            kind = record["kind"]
            if kind == "run_start":
                started = record["wall_time"]
            elif kind == "run_end":
                if started is not None:
                    uptime += max(0.0, record["wall_time"] - started)
                started = None
            elif kind == "interruption":
                failures += 1
                if started is not None:
                    uptime += max(0.0, record["failed_at"] - started)
                started = None
        if failures == 0:
            return None
        if started is not None and now is not None:
            uptime += max(0.0, now - started)
        return uptime / failures

    def _records(self) -> list[dict[str, Any]]:
        try:
            lines = self.path.read_bytes().split(b"\n")
        except FileNotFoundError:
            return []
        torn = lines.pop()  # after the last newline: b"" unless the last write was cut short
        records = [self._parse(line, number) for number, line in enumerate(lines, 1) if line]
        if torn:
            try:
                records.append(self._parse(torn, len(lines) + 1))
            except CheckpointFormatError as exc:
                log.warning("%s: skipping the torn last line (%s)", self.path, exc)
        return records

    def _parse(self, line: bytes, number: int) -> dict[str, Any]:
        try:
            record = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointFormatError(
                f"{self.path}:{number}: not a JSON record ({exc}); "
                "move the file aside to start a fresh failure ledger"
            ) from exc
        if not isinstance(record, dict) or record.get("v") != LEDGER_VERSION:
            raise CheckpointFormatError(
                f"{self.path}:{number}: not a version-{LEDGER_VERSION} ledger record: {line[:80]!r}"
            )
        required = _FIELDS.get(record.get("kind"))
        if required is None:
            raise CheckpointFormatError(
                f"{self.path}:{number}: unknown record kind {record.get('kind')!r}"
            )
        missing = [name for name in required if name not in record]
        if missing:
            raise CheckpointFormatError(
                f"{self.path}:{number}: {record['kind']} record lacks {', '.join(missing)}"
            )
        return record

    def _append(self, fields: dict[str, Any]) -> None:
        line = json.dumps({"v": LEDGER_VERSION, **fields}, allow_nan=False) + "\n"
        created = not self.path.exists()
        if created:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self._repair_tail(fd)
            os.write(fd, line.encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            _fsync_dir(self.path.parent)

    def _repair_tail(self, fd: int) -> None:
        """Keep a last line without newline if it parses, else cut it off, before appending.

        Appending after a torn fragment would glue the new record onto it and turn a harmless
        torn tail into a corrupt line in the middle of the file.
        """
        size = os.fstat(fd).st_size
        if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
            return
        start = size
        while start > 0:
            chunk_start = max(0, start - 4096)
            newline = os.pread(fd, start - chunk_start, chunk_start).rfind(b"\n")
            if newline >= 0:
                start = chunk_start + newline + 1
                break
            start = chunk_start
        tail = os.pread(fd, size - start, start)
        try:
            self._parse(tail, 0)
        except CheckpointFormatError:
            log.warning("%s: cutting off a torn last line of %d bytes", self.path, len(tail))
            os.ftruncate(fd, start)
        else:
            os.write(fd, b"\n")


def _interruption(record: dict[str, Any]) -> Interruption:
    return Interruption(
        wall_time=float(record["wall_time"]),
        failed_at=float(record["failed_at"]),
        last_step=int(record["last_step"]),
        recovered_step=int(record["recovered_step"]),
        steps_lost=int(record["steps_lost"]),
        source=str(record["source"]),
        recovery_seconds=float(record["recovery_seconds"]),
    )


def _now(wall_time: float | None) -> float:
    value = time.time() if wall_time is None else float(wall_time)
    if not math.isfinite(value):
        raise ValueError(f"wall_time must be finite, got {value!r}")
    return value


def _fsync_dir(directory: Path) -> None:
    """Make a newly created file's directory entry durable (POSIX; a no-op elsewhere)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on a directory
            os.fsync(fd)
    finally:
        os.close(fd)
