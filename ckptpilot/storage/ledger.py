"""The failure ledger: when runs started, ended and were interrupted (SPEC §4).

This module owns :class:`FailureLedger`, an append-only JSON-lines file in the run directory
recording when runs started, ended cleanly and were interrupted, from which the observed MTBF
is derived; the interval bound computed from that MTBF is ``scheduler/interval.py``'s.

It must not decide when to save (the scheduler does, from the bound) nor find out *that* a run
was interrupted (the pilot does, from its heartbeats, and records it here). It reads the clock
only to stamp a record whose caller gave no ``wall_time``, to time a run it saw start and end
itself, and to tell a stamp from the future when asked for the MTBF without ``now``.

Records are JSON lines of the kinds ``run_start``, ``run_end``, ``interruption``, ``stop``
and ``rollback`` (their fields and version: ``ckptpilot.format.ledger_line``). A rollback is
an instability rollback: the run went on, so it is no failure and no lifecycle event; the MTBF
and :meth:`FailureLedger.last_kind` pass over it. A ``stop`` is a run the pilot ended itself
(``ckptpilot.vocab.StopCause``): it ends the run like ``run_end``; a preemption is no
failure, a hang counts as one in the MTBF.

Durations: wall times only stamp records. ``uptime_seconds`` is how long the run was up,
measured on the monotonic clock (by this ledger between its own start and end records, or by
the dead run's heartbeat writer), so a wall clock stepped back or ahead while the run lived
does not change it. Without it a run's uptime is the difference of two wall stamps, which a
clock step can make negative, zero, or end in the future: such a duration is unknown, and a
run of unknown duration counts neither its uptime nor its interruption in the MTBF. Counting
the interruption with no uptime would drag the MTBF towards 0 (and a 0 is no MTBF at all).

Damage: a killed writer leaves at most a torn last line; readers skip it with a warning and
the next append cuts it off first. Any other line that is not a valid record means the file
was damaged otherwise (a bad disk block, an edit, a newer ckptpilot's records). The file is
then set aside (``damaged.py``: renamed ``<name>.damaged-<unix time>``, a WARNING names it and
the first bad line) and a fresh file holding its valid records takes its place. The valid
records are kept rather than dropped because each line stands alone and the MTBF pairs a
run's start with its end only when both are present: a missing line makes at most one run's
duration unknown, never a wrong one, whereas starting empty would forget every earlier run.

Threading and lifecycle: one writer (one process, e.g. rank 0, on one thread) per file. Each
append is a single ``write`` followed by ``fsync``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from ckptpilot.errors import CheckpointFormatError
from ckptpilot.format.ledger_line import LEDGER_VERSION, encode_line, parse_line
from ckptpilot.storage.damaged import set_aside

__all__ = [
    "FUTURE_SLACK_SECONDS",
    "LEDGER_VERSION",
    "FailureLedger",
    "Interruption",
    "Rollback",
    "Stop",
]

log = logging.getLogger("ckptpilot")

FUTURE_SLACK_SECONDS = 60.0
"""A wall stamp up to this far after the present still counts: a run resumed on another host
reads a clock that may differ a little from the one that stamped the dead run's records."""

_NUMBER = (int, float)


@dataclasses.dataclass(frozen=True)
class Interruption:
    """One recorded interruption: the run last seen alive at ``failed_at`` (wall time, s)
    at ``last_step``, after ``uptime_seconds`` up (None: unknown), resumed from
    ``recovered_step`` read from ``source`` in ``recovery_seconds``; ``wall_time`` is when the
    record was written."""

    wall_time: float
    failed_at: float
    last_step: int
    recovered_step: int
    steps_lost: int
    source: str
    recovery_seconds: float
    uptime_seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class Rollback:
    """One instability rollback: a spike starting at ``onset`` confirmed at ``step``; the run
    restored ``to_step`` and skipped ``skipped_batches`` batches of its data."""

    wall_time: float
    step: int
    onset: int
    to_step: int
    skipped_batches: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Stop:
    """One run the pilot ended itself at ``step`` (the last step boundary reached), for
    ``cause`` (``preemption`` or ``hang``), after ``uptime_seconds`` up (None: unknown)."""

    wall_time: float
    step: int
    cause: str
    reason: str
    uptime_seconds: float | None = None


class FailureLedger:
    """Append-only record of run starts, clean ends and interruptions, with the MTBF.

    Lifecycle: the pilot calls :meth:`record_run_start` when a run (or resumed run) starts,
    :meth:`record_interruption` when ``restore()`` finds that the previous run died (before
    its own ``record_run_start``), and :meth:`record_run_end` on a clean ``close()``, all on
    one ledger object: a run whose start and end it stamped itself gets its uptime from the
    monotonic clock. The file is created on the first append; reading a missing file yields
    no records; reading a damaged one sets it aside (see the module docstring).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._started_monotonic: float | None = None

    def record_run_start(self, step: int, *, wall_time: float | None = None) -> None:
        """Record that a run started (or resumed) at ``step``.

        Without ``wall_time`` the ledger stamps the start itself and also notes the monotonic
        clock, from which :meth:`record_run_end` measures the run's uptime.
        """
        self._append({"kind": "run_start", "wall_time": _now(wall_time), "step": int(step)})
        self._started_monotonic = time.monotonic() if wall_time is None else None

    def record_run_end(self, step: int, *, wall_time: float | None = None) -> None:
        """Record a clean end at ``step``; without it the run's uptime cannot be counted.

        When this ledger stamped the run's start and is left to stamp the end too, the record
        carries ``uptime_seconds`` from the monotonic clock.
        """
        record: dict[str, Any] = {
            "kind": "run_end",
            "wall_time": _now(wall_time),
            "step": int(step),
        }
        if wall_time is None and self._started_monotonic is not None:
            record["uptime_seconds"] = time.monotonic() - self._started_monotonic
        self._started_monotonic = None
        self._append(record)

    def record_interruption(
        self,
        *,
        failed_at: float,
        last_step: int,
        recovered_step: int,
        source: str,
        recovery_seconds: float,
        uptime_seconds: float | None = None,
        wall_time: float | None = None,
    ) -> Interruption:
        """Record one interruption and return it.

        ``failed_at`` is the wall time the dead run was last seen alive (its last heartbeat).
        ``uptime_seconds`` is how long it had been up then, on the monotonic clock (the last
        heartbeat's ``uptime_seconds``); pass it whenever known, since the wall clock may have
        been stepped meanwhile. A value that is not a positive finite number is recorded as
        unknown. ``steps_lost`` is derived as ``last_step − recovered_step`` (0 if the
        recovered step is ahead of the last heartbeat).
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
            uptime_seconds=_duration(uptime_seconds),
        )
        fields = dataclasses.asdict(record)
        if record.uptime_seconds is None:
            del fields["uptime_seconds"]
        self._append({"kind": "interruption", **fields})
        return record

    def record_stop(self, *, step: int, cause: str, reason: str,
                    uptime_seconds: float | None = None) -> Stop:
        """Record that the pilot ended the run at ``step`` for ``cause`` and return it.

        May be called from a thread other than the one that recorded the start (the hang
        watchdog's, while the training thread is stuck): it is still the file's only writer
        then. The uptime is the monotonic time since this ledger stamped the start, when it
        did, else ``uptime_seconds`` (the caller's, e.g. the heartbeat writer's).
        """
        uptime = _duration(uptime_seconds)
        if self._started_monotonic is not None:
            uptime = time.monotonic() - self._started_monotonic
        record = Stop(wall_time=_now(None), step=int(step),
                      cause=str(getattr(cause, "value", cause)), reason=str(reason),
                      uptime_seconds=_duration(uptime))
        fields = dataclasses.asdict(record)
        if record.uptime_seconds is None:
            del fields["uptime_seconds"]
        self._started_monotonic = None
        self._append({"kind": "stop", **fields})
        return record

    def stops(self) -> list[Stop]:
        """Every recorded stop (preemptions and hangs), oldest first."""
        return [
            Stop(wall_time=float(r["wall_time"]), step=r["step"], cause=r["cause"],
                 reason=r["reason"], uptime_seconds=_duration(r.get("uptime_seconds")))
            for r in self._records() if r["kind"] == "stop"
        ]

    def record_rollback(self, *, step: int, onset: int, to_step: int, skipped_batches: int,
                        reason: str, wall_time: float | None = None) -> Rollback:
        """Record one instability rollback and return it."""
        record = Rollback(wall_time=_now(wall_time), step=int(step), onset=int(onset),
                          to_step=int(to_step), skipped_batches=int(skipped_batches),
                          reason=str(reason))
        self._append({"kind": "rollback", **dataclasses.asdict(record)})
        return record

    def rollbacks(self) -> list[Rollback]:
        """Every recorded rollback, oldest first."""
        return [
            Rollback(wall_time=float(r["wall_time"]), step=r["step"], onset=r["onset"],
                     to_step=r["to_step"], skipped_batches=r["skipped_batches"],
                     reason=r["reason"])
            for r in self._records() if r["kind"] == "rollback"
        ]

    def last_kind(self) -> str | None:
        """Kind of the newest lifecycle record (``run_start``/``run_end``/``interruption``/
        ``stop``), None if there is none; rollbacks are passed over.

        ``run_start`` as the newest record means the run it started never closed cleanly.
        """
        kinds = [r["kind"] for r in self._records() if r["kind"] != "rollback"]
        return kinds[-1] if kinds else None

    def interruptions(self) -> list[Interruption]:
        """Every recorded interruption, oldest first."""
        return [
            _interruption(record) for record in self._records() if record["kind"] == "interruption"
        ]

    def mtbf_seconds(self, now: float | None = None) -> float | None:
        """Observed uptime divided by the number of failures (interruptions and hangs): a
        positive finite number, or None while unknown (no failure of known duration).

        A run's uptime is its end record's ``uptime_seconds`` or, without one, the wall time
        from its ``run_start`` to the ``failed_at`` of the next interruption or to its
        ``run_end`` or ``stop``; a wall-clock duration that is not positive, or that ends more than
        :data:`FUTURE_SLACK_SECONDS` after ``now`` (default: the clock), is unknown. A run of
        unknown duration is left out, interruption and all. A run still going counts up to
        ``now`` only when ``now`` is passed.
        """
        present = time.time() if now is None else float(now)
        uptime = 0.0
        failures = 0
        left_out = 0
        start: dict[str, Any] | None = None
        for record in self._records():
            kind = record["kind"]
            if kind == "rollback":
                continue
            if kind == "run_start":
                start = record
                continue
            failed = kind == "interruption" or (kind == "stop" and record["cause"] == "hang")
            end = record["failed_at"] if kind == "interruption" else record["wall_time"]
            seconds = _duration(record.get("uptime_seconds"))
            if seconds is None and start is not None:
                seconds = _wall_duration(start["wall_time"], end, present)
            start = None
            if seconds is None:
                left_out += 1
                continue
            uptime += seconds
            if failed:
                failures += 1
        if failures == 0:
            return None
        if start is not None and now is not None:
            uptime += _wall_duration(start["wall_time"], present, present) or 0.0
        if left_out:
            log.info(
                "%s: %d run(s) of unknown duration left out of the MTBF (a wall clock stepped "
                "back or ahead, or an end without a start)",
                self.path,
                left_out,
            )
        mtbf = uptime / failures
        return mtbf if math.isfinite(mtbf) and mtbf > 0 else None

    def _records(self) -> list[dict[str, Any]]:
        try:
            lines = self.path.read_bytes().split(b"\n")
        except FileNotFoundError:
            return []
        torn = lines.pop()  # after the last newline: b"" unless the last write was cut short
        records: list[dict[str, Any]] = []
        bad: list[str] = []
        for number, line in enumerate(lines, 1):
            if not line:
                continue
            try:
                records.append(parse_line(line, number))
            except CheckpointFormatError as exc:
                bad.append(str(exc))
        if torn:
            try:
                records.append(parse_line(torn, len(lines) + 1))
            except CheckpointFormatError as exc:
                log.warning("%s: skipping the torn last line (%s)", self.path, exc)
        if bad:
            self._replace_damaged(records, bad)
        return records

    def _replace_damaged(self, records: list[dict[str, Any]], bad: list[str]) -> None:
        """Set the file aside and put a fresh one holding ``records`` in its place."""
        temporary = self.path.with_name(f"{self.path.name}.tmp{os.getpid()}")
        with open(temporary, "wb") as file:
            file.write(b"".join(encode_line(record) for record in records))
            file.flush()
            os.fsync(file.fileno())
        more = f", and {len(bad) - 1} more bad line(s)" if len(bad) > 1 else ""
        set_aside(
            self.path,
            f"{bad[0]}{more}",
            f"the fresh one holds its {len(records)} valid record(s); the MTBF goes on without "
            "the bad line(s)",
        )
        os.replace(temporary, self.path)
        _fsync_dir(self.path.parent)

    def _append(self, fields: dict[str, Any]) -> None:
        line = encode_line({"v": LEDGER_VERSION, **fields})
        created = not self.path.exists()
        if created:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self._repair_tail(fd)
            os.write(fd, line)
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
            parse_line(tail, 0)
        except CheckpointFormatError:
            log.warning("%s: cutting off a torn last line of %d bytes", self.path, len(tail))
            os.ftruncate(fd, start)
        else:
            os.write(fd, b"\n")


def _duration(value: Any) -> float | None:
    """``value`` as a duration in seconds if it is a positive finite number, else None."""
    if isinstance(value, bool) or not isinstance(value, _NUMBER):
        return None
    seconds = float(value)
    return seconds if math.isfinite(seconds) and seconds > 0 else None


def _wall_duration(start: float, end: float, present: float) -> float | None:
    """``end − start`` of two wall stamps, or None when a clock step makes it nonsense."""
    if not end <= present + FUTURE_SLACK_SECONDS:  # also false for NaN
        return None
    return _duration(end - start)


def _interruption(record: dict[str, Any]) -> Interruption:
    return Interruption(
        wall_time=float(record["wall_time"]),
        failed_at=float(record["failed_at"]),
        last_step=int(record["last_step"]),
        recovered_step=int(record["recovered_step"]),
        steps_lost=int(record["steps_lost"]),
        source=str(record["source"]),
        recovery_seconds=float(record["recovery_seconds"]),
        uptime_seconds=_duration(record.get("uptime_seconds")),
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
