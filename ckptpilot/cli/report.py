"""The goodput report of a run: what failures and checkpointing cost it, read from its records.

This module owns :class:`GoodputReport` and the three steps of ``ckptpilot report``: reading a
run directory's records (:func:`read_records`), turning them into figures
(:func:`build_report`, pure: no I/O, no clock), and showing them (:func:`format_table`, JSON
through :meth:`GoodputReport.as_dict`, TensorBoard scalars ``goodput/*`` through
:func:`write_tensorboard`). It must not change a run: it decides nothing, and it reads each
file through the reader of the module that owns its format.

Where each figure comes from (one rank's records, rank 0 by default; counts and bytes cover
every rank):

- **Runs** (failure ledger): each ``run_start`` up to the next ``run_end``, ``stop`` or
  ``interruption``. Wall time runs from the first start to the last end, or to the newest
  heartbeat of a run with no end yet; up time adds the runs' monotonic uptimes.
- **Step time** (heartbeat ring): the median seconds per step between consecutive heartbeats
  of one process (its uptime grows, no run started between them). The median leaves out the
  intervals a save stalled, which are counted apart. The ring keeps only its newest records.
- **Lost to failures**: the ledger's steps lost per interruption (the dead run's last
  heartbeat step minus the restored step) × step time; the steps after the last heartbeat
  before a kill are never known. A hang (a ``stop`` with cause ``hang``) loses its step minus
  the next run's start step. Crashes (interruptions), hangs and preemptions (``stop`` with
  cause ``preemption``: no failure, its emergency organ loses nothing) are counted apart.
  Rollbacks (``step`` − ``to_step``) are counted apart: the
  run went on, they are no failure. **Productive** steps are the final timeline, from the
  first start step to the last step reached.
- **Down after failures**: from the dead run's last heartbeat to the interruption's record,
  written once the restore finished; **recovery** is the restores' own seconds in it.
- **Stall and background** (metadata rows): the training thread's stall is a row's
  ``seconds_snapshot``, once per save (a save on two tiers has two rows with the same stall);
  background time is the rows' ``seconds_write`` + ``seconds_validate``: wall seconds of the
  writer thread, since CPU time is not recorded. A sum covers the rows that carry the figure;
  the rows that do not (a database rebuilt from manifests) are counted.
- **MTBF** is the ledger's; the Young–Daly interval is Daly's for the median stall per save
  (the save cost the scheduler uses) and that MTBF.

A figure that the records cannot give is None ("unknown"), never an estimate.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ckptpilot.cli.ops import Run
from ckptpilot.errors import CheckpointFormatError
from ckptpilot.format.heartbeat_ring import HeartbeatRecord
from ckptpilot.format.ledger_line import parse_line
from ckptpilot.policy import Policy
from ckptpilot.rundir import heartbeat_path, ledger_path
from ckptpilot.scheduler.interval import daly_interval
from ckptpilot.storage.heartbeat import read_all
from ckptpilot.storage.ledger import FailureLedger, Interruption, Rollback, Stop
from ckptpilot.storage.metadata import CheckpointRow
from ckptpilot.vocab import Status, StopCause, Tier

__all__ = ["TIME_FIELDS", "GoodputReport", "RunRecords", "build_report", "format_table",
           "read_records", "run_report", "write_tensorboard"]

log = logging.getLogger("ckptpilot")

TIME_FIELDS = ("wall_seconds", "up_seconds", "productive_seconds", "lost_to_failures_seconds",
               "lost_to_rollbacks_seconds", "down_after_failures_seconds", "recovery_seconds",
               "stall_seconds", "background_seconds")
"""The fields that are durations: shown in GPU-hours too when the number of GPUs is given."""

_LIFECYCLE = ("run_start", "run_end", "interruption", "stop")


@dataclass(frozen=True)
class RunRecords:
    """What :func:`read_records` found for one rank: the inputs of :func:`build_report`.

    ``ledger`` holds the ledger's records in file order as dicts (format
    ``ckptpilot.format.ledger_line``); ``rows`` every metadata row of the run, all ranks.
    """

    run_id: str
    rank: int
    rows: tuple[CheckpointRow, ...]
    ledger: tuple[dict[str, Any], ...]
    interruptions: tuple[Interruption, ...]
    rollbacks: tuple[Rollback, ...]
    mtbf_seconds: float | None
    heartbeats: tuple[HeartbeatRecord, ...]
    stops: tuple[Stop, ...] = ()


@dataclass(frozen=True)
class GoodputReport:
    """The figures of ``ckptpilot report``; None is unknown. Units are in the names; counts
    by level, class, tier and status are of metadata rows (one per rank and tier)."""

    run_id: str
    rank: int
    gpus: int | None
    first_step: int | None
    last_step: int | None
    steps_trained: int | None
    steps_productive: int | None
    steps_lost_to_failures: int
    steps_rolled_back: int
    step_seconds: float | None
    step_time_samples: int
    wall_seconds: float | None
    up_seconds: float | None
    productive_seconds: float | None
    lost_to_failures_seconds: float | None
    lost_to_rollbacks_seconds: float | None
    down_after_failures_seconds: float | None
    recovery_seconds: float
    stall_seconds: float | None
    saves: int
    saves_without_stall: int
    background_seconds: float | None
    rows_without_timing: int
    goodput_fraction: float | None
    interruptions: int
    hangs: int
    preemptions: int
    rollbacks: int
    mtbf_seconds: float | None
    save_cost_seconds: float | None
    young_daly_seconds: float | None
    young_daly_steps: float | None
    checkpoints: int
    by_level: dict[str, int]
    by_class: dict[str, int]
    by_tier: dict[str, int]
    by_status: dict[str, int]
    bytes_written: int | None
    bytes_written_by_tier: dict[str, int]
    bytes_kept_remote: int | None
    rows_without_size: int

    def gpu_hours(self) -> dict[str, float | None] | None:
        """Every duration × GPUs / 3600; None without a number of GPUs."""
        if self.gpus is None:
            return None
        return {name.removesuffix("_seconds"): _gpu_hours(getattr(self, name), self.gpus)
                for name in TIME_FIELDS}

    def as_dict(self) -> dict[str, Any]:
        """The JSON document of ``--json``: every field, and ``gpu_hours``."""
        return {**dataclasses.asdict(self), "gpu_hours": self.gpu_hours()}


def _gpu_hours(seconds: float | None, gpus: int) -> float | None:
    return None if seconds is None else seconds * gpus / 3600.0


# -- reading ---------------------------------------------------------------------------------


def read_records(policy: Policy, *, rank: int = 0) -> RunRecords:
    """The records of ``policy.run_dir`` for ``rank``: the metadata store opened read-only,
    the ledger and the heartbeat ring through their readers. Nothing is written, except that
    the ledger's reader sets a damaged ledger aside as it always does. A damaged heartbeat
    ring is a WARNING and no heartbeats (the step time is then unknown)."""
    run = Run(policy)
    with run.store(read_only=True) as store:
        rows = tuple(store.rows(run.run_id))
    ledger_file = ledger_path(run.dir, rank)
    ledger = FailureLedger(ledger_file)
    ring_path = heartbeat_path(run.dir, rank)
    try:
        heartbeats = tuple(read_all(ring_path))
    except CheckpointFormatError as e:
        log.warning("%s; the step time is unknown", e)
        heartbeats = ()
    return RunRecords(run_id=run.run_id, rank=rank, rows=rows, ledger=_ledger_lines(ledger_file),
                      interruptions=tuple(ledger.interruptions()),
                      rollbacks=tuple(ledger.rollbacks()), mtbf_seconds=ledger.mtbf_seconds(),
                      heartbeats=heartbeats, stops=tuple(ledger.stops()))


def _ledger_lines(path: Path) -> tuple[dict[str, Any], ...]:
    """Every record of the ledger in file order; a line that does not parse (a torn last
    line) is skipped with a WARNING. ``FailureLedger`` has no public reader of its start and
    end records, so the lines go through the format's own parser."""
    try:
        lines = path.read_bytes().split(b"\n")
    except FileNotFoundError:
        return ()
    records = []
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            records.append(parse_line(line, number))
        except CheckpointFormatError as e:
            log.warning("%s: %s; left out of the report", path, e)
    return tuple(records)


# -- figures ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Run:
    """One process's run between its start record and its end (None: not known)."""

    start_step: int
    start_wall: float
    end_step: int | None
    end_wall: float | None
    uptime_seconds: float | None


def build_report(records: RunRecords, *, gpus: int | None = None) -> GoodputReport:
    """The figures of ``records`` (see the module docstring for each one's source)."""
    if gpus is not None and gpus <= 0:
        raise ValueError(f"gpus: expected a positive number of GPUs, got {gpus}")
    runs = _runs(records.ledger, records.heartbeats)
    step_seconds, samples = _step_seconds(records.heartbeats, [r.start_wall for r in runs])
    first_step = runs[0].start_step if runs else None
    last_step = runs[-1].end_step if runs else None
    steps_lost = sum(i.steps_lost for i in records.interruptions) + _hang_losses(records.ledger)
    rolled_back = sum(max(0, r.step - r.to_step) for r in records.rollbacks)
    trained = [max(0, r.end_step - r.start_step) for r in runs if r.end_step is not None]
    productive = None
    if first_step is not None and last_step is not None:
        productive = last_step - first_step
    wall = None
    if runs and runs[-1].end_wall is not None:
        wall = _positive(runs[-1].end_wall - runs[0].start_wall)
    uptimes = [r.uptime_seconds for r in runs if r.uptime_seconds is not None]
    downs = [i.wall_time - i.failed_at for i in records.interruptions]

    stalls = _stall_per_save(r for r in records.rows if r.rank == records.rank)
    known_stalls = [s for s in stalls.values() if s is not None]
    timed = [r for r in records.rows if r.rank == records.rank and r.seconds_write is not None]
    untimed = sum(r.rank == records.rank for r in records.rows) - len(timed)
    save_cost = statistics.median(known_stalls) if known_stalls else None
    mtbf = records.mtbf_seconds
    daly = None
    if save_cost is not None and save_cost > 0 and mtbf is not None:
        daly = daly_interval(save_cost, mtbf)
    sized = [r for r in records.rows if r.bytes_encoded is not None]
    bytes_by_tier = {t.value: sum(r.bytes_encoded or 0 for r in sized if r.tier is t)
                     for t in Tier if any(r.tier is t for r in sized)}
    kept = sum(r.bytes_encoded or 0 for r in sized
               if r.tier is Tier.REMOTE and r.status is Status.VALID)

    def times_step(steps: int | None) -> float | None:
        return None if steps is None or step_seconds is None else steps * step_seconds

    def known(value: Any, figures: int, rows: int) -> Any:
        """A sum stands for the rows when at least one carries the figure (or none exist)."""
        return value if figures or not rows else None

    productive_seconds = times_step(productive)
    return GoodputReport(
        run_id=records.run_id, rank=records.rank, gpus=gpus, first_step=first_step,
        last_step=last_step,
        steps_trained=sum(trained) + rolled_back if runs and len(trained) == len(runs)
        else None,
        steps_productive=productive, steps_lost_to_failures=steps_lost,
        steps_rolled_back=rolled_back, step_seconds=step_seconds, step_time_samples=samples,
        wall_seconds=wall,
        up_seconds=math.fsum(uptimes) if runs and len(uptimes) == len(runs) else None,
        productive_seconds=productive_seconds,
        lost_to_failures_seconds=times_step(steps_lost),
        lost_to_rollbacks_seconds=times_step(rolled_back),
        down_after_failures_seconds=math.fsum(downs) if all(d >= 0 for d in downs) else None,
        recovery_seconds=math.fsum(i.recovery_seconds for i in records.interruptions),
        stall_seconds=known(math.fsum(known_stalls), len(known_stalls), len(stalls)),
        saves=len(stalls), saves_without_stall=len(stalls) - len(known_stalls),
        background_seconds=known(math.fsum([r.seconds_write or 0.0 for r in timed]
                                           + [r.seconds_validate or 0.0 for r in timed]),
                                 len(timed), len(timed) + untimed),
        rows_without_timing=untimed,
        goodput_fraction=(productive_seconds / wall if productive_seconds is not None
                          and wall is not None else None),
        interruptions=len(records.interruptions),
        hangs=sum(s.cause == StopCause.HANG for s in records.stops),
        preemptions=sum(s.cause == StopCause.PREEMPTION for s in records.stops),
        rollbacks=len(records.rollbacks),
        mtbf_seconds=mtbf, save_cost_seconds=save_cost, young_daly_seconds=daly,
        young_daly_steps=daly / step_seconds if daly is not None and step_seconds else None,
        checkpoints=len(records.rows),
        by_level=_count(r.level.value for r in records.rows),
        by_class=_count(r.retention_class.value for r in records.rows),
        by_tier=_count(r.tier.value for r in records.rows),
        by_status=_count(r.status.value for r in records.rows),
        bytes_written=known(sum(bytes_by_tier.values()), len(sized), len(records.rows)),
        bytes_written_by_tier=bytes_by_tier,
        bytes_kept_remote=known(kept, len(sized), len(records.rows)),
        rows_without_size=len(records.rows) - len(sized),
    )


def _runs(ledger: Sequence[dict[str, Any]],
          heartbeats: Sequence[HeartbeatRecord]) -> list[_Run]:
    """The ledger's runs in order. A start followed by another start lost its end (a run
    that died with no heartbeat to tell of it); the last run with no end record yet ends at
    the newest heartbeat written after its start."""
    runs: list[_Run] = []
    start: dict[str, Any] | None = None
    for record in (r for r in ledger if r["kind"] in _LIFECYCLE):
        kind = record["kind"]
        if kind == "run_start":
            if start is not None:
                runs.append(_Run(start["step"], start["wall_time"], None, None, None))
            start = record
            continue
        if start is None:  # an end without its start: nothing to measure it from
            continue
        ended = kind != "interruption"
        runs.append(_Run(start["step"], start["wall_time"],
                         record["step"] if ended else record["last_step"],
                         record["wall_time"] if ended else record["failed_at"],
                         _positive(record.get("uptime_seconds"))))
        start = None
    if start is not None:
        newest = heartbeats[-1] if heartbeats else None
        if newest is not None and newest.step is not None and (
                newest.wall_time >= start["wall_time"]):
            runs.append(_Run(start["step"], start["wall_time"], newest.step, newest.wall_time,
                             _positive(newest.uptime_seconds)))
        else:
            runs.append(_Run(start["step"], start["wall_time"], None, None, None))
    return runs


def _hang_losses(ledger: Sequence[dict[str, Any]]) -> int:
    """Steps lost to hangs: each hang's step minus the start step of the run after it."""
    lost, hang = 0, None
    for record in ledger:
        if record["kind"] == "stop" and record["cause"] == StopCause.HANG:
            hang = record["step"]
        elif record["kind"] == "run_start":
            if hang is not None:
                lost += max(0, hang - record["step"])
            hang = None
    return lost


def _step_seconds(heartbeats: Sequence[HeartbeatRecord],
                  starts: Iterable[float]) -> tuple[float | None, int]:
    """The median seconds per step between consecutive heartbeats of one process, and the
    number of such intervals. Two heartbeats belong to one process when their sequence
    numbers follow, their uptime and step grow, and no run started between them."""
    starts = list(starts)
    samples = []
    for a, b in itertools.pairwise(heartbeats):
        if (b.seq != a.seq + 1 or a.step is None or b.step is None or b.step <= a.step
                or a.uptime_seconds is None or b.uptime_seconds is None
                or b.uptime_seconds <= a.uptime_seconds
                or any(a.wall_time < s <= b.wall_time for s in starts)):
            continue
        samples.append((b.uptime_seconds - a.uptime_seconds) / (b.step - a.step))
    return (statistics.median(samples) if samples else None), len(samples)


def _stall_per_save(rows: Iterable[CheckpointRow]) -> dict[tuple[int, int], float | None]:
    """The stall of each save (rank, step): its rows on every tier carry the same one."""
    stalls: dict[tuple[int, int], float | None] = {}
    for row in rows:
        key = (row.rank, row.step)
        if stalls.get(key) is None:
            stalls[key] = row.seconds_snapshot
    return stalls


def _positive(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def _count(values: Iterable[str]) -> dict[str, int]:
    return dict(sorted(Counter(values).items()))


# -- output ----------------------------------------------------------------------------------


def format_table(report: GoodputReport) -> str:
    """The one-screen table of ``ckptpilot report``."""
    r = report
    hours = r.gpu_hours()
    head = f"goodput of run {r.run_id} (rank {r.rank})"
    time_rows = [
        ("wall time", "wall_seconds", "first start to last end"),
        ("up time", "up_seconds", f"{_n(r.steps_trained)} steps trained"),
        ("productive steps", "productive_seconds",
         f"{_n(r.steps_productive)} steps x step time"),
        ("lost to failures", "lost_to_failures_seconds",
         f"{r.steps_lost_to_failures} steps lost x step time"),
        ("lost to rollbacks", "lost_to_rollbacks_seconds",
         f"{r.steps_rolled_back} steps rolled back x step time"),
        ("down after failures", "down_after_failures_seconds",
         "last heartbeat to restored (restart + restore)"),
        ("in recovery", "recovery_seconds", f"{r.interruptions} restore(s) after a failure"),
        ("training-thread stall", "stall_seconds",
         f"{r.saves} saves" + _missing(r.saves_without_stall, "save")),
        ("background saving", "background_seconds",
         "write + validate, wall (CPU time not recorded)"
         + _missing(r.rows_without_timing, "row")),
    ]
    header = ["", "seconds", *([f"GPU-hours (x{r.gpus})"] if hours is not None else []), ""]
    cells = [header]
    for label, name, note in time_rows:
        value = getattr(r, name)
        cells.append([label, _num(value, 3),
                      *([_num(hours[name.removesuffix("_seconds")], 4)]
                        if hours is not None else []), note])
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [head, ""] + ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
                          .rstrip() for row in cells]
    young_daly = ("unknown" if r.young_daly_seconds is None else
                  f"{r.young_daly_seconds:.3f} s" + (
                      "" if r.young_daly_steps is None else f" = {r.young_daly_steps:.1f} steps"))
    facts = [
        ("goodput", "unknown" if r.goodput_fraction is None
         else f"{100 * r.goodput_fraction:.1f} % of wall time in productive steps"),
        ("step time", "unknown" if r.step_seconds is None else
         f"{r.step_seconds:.6f} s (median of {r.step_time_samples} heartbeat intervals)"),
        ("steps", f"{_n(r.first_step)} -> {_n(r.last_step)}"),
        ("failures", f"{r.interruptions} crash(es), {r.hangs} hang(s), {r.preemptions} "
         f"preemption(s), {r.rollbacks} rollback(s); MTBF "
         + ("unknown" if r.mtbf_seconds is None else f"{r.mtbf_seconds:.3f} s")),
        ("Young-Daly interval", f"{young_daly} (save cost {_num(r.save_cost_seconds, 6)} s, "
         "the median stall)"),
        ("checkpoints", f"{r.checkpoints} rows; {_counts(r.by_level)} | {_counts(r.by_class)}"),
        ("", f"{_counts(r.by_tier)} | {_counts(r.by_status)}"),
        ("bytes written", _size(r.bytes_written) + "".join(
            f"; {tier} {_size(n)}" for tier, n in r.bytes_written_by_tier.items())
         + _missing(r.rows_without_size, "row")),
        ("bytes kept", f"{_size(r.bytes_kept_remote)} (valid on the remote tier)"),
    ]
    width = max(len(label) for label, _ in facts)
    lines += [""] + [f"{label.ljust(width)}  {text}" for label, text in facts]
    return "\n".join(lines) + "\n"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {n}" for name, n in counts.items()) or "-"


def _num(value: float | None, digits: int) -> str:
    return "unknown" if value is None else f"{value:.{digits}f}"


def _n(value: int | None) -> str:
    return "unknown" if value is None else str(value)


def _missing(count: int, what: str) -> str:
    return f" ({count} {what}(s) without the figure)" if count else ""


def _size(n: int | None) -> str:
    if n is None:
        return "unknown"
    if n < 1000:
        return f"{n} B"
    scaled = float(n)
    for unit in ("KB", "MB", "GB", "TB"):
        scaled /= 1000
        if scaled < 1000 or unit == "TB":
            break
    return f"{n} B ({scaled:.1f} {unit})"


def write_tensorboard(report: GoodputReport, directory: Path) -> list[str]:
    """Every known figure as a TensorBoard scalar ``goodput/<field>`` (durations also as
    ``goodput/gpu_hours/<name>`` with a number of GPUs) at the last step; returns the tags."""
    from torch.utils.tensorboard import SummaryWriter

    values: dict[str, float] = {}
    for name in (*TIME_FIELDS, "goodput_fraction", "step_seconds", "steps_lost_to_failures",
                 "steps_rolled_back", "mtbf_seconds", "young_daly_seconds", "checkpoints",
                 "bytes_written", "bytes_kept_remote"):
        value = getattr(report, name)
        if value is not None:
            values[f"goodput/{name}"] = float(value)
    for name, value in (report.gpu_hours() or {}).items():
        if value is not None:
            values[f"goodput/gpu_hours/{name}"] = value
    writer = SummaryWriter(log_dir=str(directory))
    try:
        for tag, value in values.items():
            writer.add_scalar(tag, value, global_step=report.last_step or 0)
    finally:
        writer.close()
    return list(values)


def run_report(policy: Policy, out: TextIO, *, as_json: bool, gpus: int | None,
               tensorboard: bool) -> int:
    """``ckptpilot report``: print the table (or the JSON document) and, when the policy
    writes TensorBoard and ``tensorboard`` is left on, the ``goodput/*`` scalars."""
    report = build_report(read_records(policy), gpus=gpus)
    if as_json:
        print(json.dumps(report.as_dict(), indent=2), file=out)
    else:
        out.write(format_table(report))
    if tensorboard and policy.observability.tensorboard:
        write_tensorboard(report, Path(policy.run_dir) / "tensorboard")
    return 0
