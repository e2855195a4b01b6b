"""The simulator against a real run: its own measured costs in, its goodput predicted.

This module owns :class:`RunCosts` (the per-event costs a run's goodput report measured: step
time, stall and background seconds per save, the steps between saves, down time per failure),
:func:`run_costs` (reading them off a :class:`MeasuredRun`: what ``ckptpilot report``'s
``GoodputReport`` measured, which this module reads but does not import, being below the
command) and two
predictions of the run's totals from them: :func:`replay` (the model given the run's own
failure times) and :func:`expected` (the model drawing exponential failures at the run's
MTBF). ``ckptpilot report --predict`` prints the second beside what was measured;
``bench/goodput.py`` checks both against real kills. Pure: no file, clock or process.

Per-event costs go in, totals come out: lost steps depend on where the kills fell against
the saves and their time to durable, and the overhead on how many saves (re-done ones too)
the run made, which the model has to get right on its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from statistics import fmean
from typing import Protocol

from ckptpilot.errors import CkptPilotError
from ckptpilot.simulate.costs import TierCosts
from ckptpilot.simulate.failures import Failure, FailureKind, FailureModel
from ckptpilot.simulate.model import Outcome, simulate
from ckptpilot.simulate.schedules import fixed_schedule
from ckptpilot.storage.metadata import CheckpointRow

__all__ = ["MeasuredRun", "Prediction", "RunCosts", "expected", "replay", "run_costs"]


class MeasuredRun(Protocol):
    """The figures of a run's goodput report the prediction reads (``cli/report.py``'s
    ``GoodputReport`` has them all); None where the run's records did not say."""

    @property
    def steps_trained(self) -> int | None: ...
    @property
    def steps_productive(self) -> int | None: ...
    @property
    def steps_lost_to_failures(self) -> int: ...
    @property
    def step_seconds(self) -> float | None: ...
    @property
    def wall_seconds(self) -> float | None: ...
    @property
    def up_seconds(self) -> float | None: ...
    @property
    def down_after_failures_seconds(self) -> float | None: ...
    @property
    def stall_seconds(self) -> float | None: ...
    @property
    def saves(self) -> int: ...
    @property
    def background_seconds(self) -> float | None: ...
    @property
    def goodput_fraction(self) -> float | None: ...
    @property
    def interruptions(self) -> int: ...
    @property
    def mtbf_seconds(self) -> float | None: ...


class PredictionError(CkptPilotError, ValueError):
    """The run's records lack a figure the prediction needs; the message names it."""


@dataclass(frozen=True)
class RunCosts:
    """Per-event costs of one run, in its own units (seconds, steps)."""

    gpus: int
    step_seconds: float
    stall_seconds: float
    background_seconds: float
    interval_steps: float
    down_seconds: float
    first_save_extra_seconds: float = 0.0

    def tier_costs(self) -> TierCosts:
        """The run as a one-node job: every save to the remote tier, restores in the down
        time (the ledger's restart + restore)."""
        durable = self.stall_seconds + self.background_seconds
        return TierCosts(gpus=self.gpus, nodes=1, bytes_per_gpu=0.0,
                         pulse_stall_seconds=self.stall_seconds,
                         peer_durable_seconds=durable, organ_stall_seconds=self.stall_seconds,
                         remote_durable_seconds=durable, peer_restore_seconds=0.0,
                         peer_rebuild_seconds=0.0, remote_restore_seconds=0.0,
                         relaunch_seconds=self.down_seconds, node_replace_seconds=0.0,
                         hang_detect_seconds=0.0, preemption_notice_seconds=0.0, group_size=2,
                         first_save_extra_seconds=self.first_save_extra_seconds)


@dataclass(frozen=True)
class Prediction:
    """The model's totals for a run, in the report's units."""

    lost_steps: float
    productive_steps: float
    overhead_seconds: float
    saves: float
    goodput: float


def _need(value: float | None, what: str) -> float:
    if value is None or value <= 0:
        raise PredictionError(f"the run's records do not give {what}; a prediction needs it "
                              "(train longer, with heartbeats and at least one save)")
    return value


def _lags(rows: Iterable[CheckpointRow]) -> dict[int, float]:
    """Per step: seconds from the save's start until every rank holds it (a restore skips a
    step not held by every rank), from each row's start and its own stall, write and
    validate seconds; untimed rows are left out."""
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    for row in rows:
        parts = (row.seconds_snapshot, row.seconds_write, row.seconds_validate)
        if any(p is None for p in parts):
            continue
        end = row.created_at + sum(parts)  # type: ignore[arg-type]
        starts[row.step] = min(starts.get(row.step, row.created_at), row.created_at)
        ends[row.step] = max(ends.get(row.step, end), end)
    return {s: ends[s] - starts[s] for s in ends}


def durable_lag_seconds(rows: Iterable[CheckpointRow]) -> float | None:
    """Mean lag until every rank holds a save, over the saves after the first; None without
    timed rows."""
    lags = _lags(rows)
    rest = [lags[s] for s in sorted(lags)[1:]] or list(lags.values())
    return fmean(rest) if rest else None


def first_save_extra_seconds(rows: Iterable[CheckpointRow]) -> float:
    """How much longer the first save of a life (the lowest step on record: rows of a step
    saved again after a restore are replaced) took to be held by every rank than the others."""
    lags = _lags(rows)
    steps = sorted(lags)
    if len(steps) < 2:
        return 0.0
    return max(0.0, lags[steps[0]] - fmean(lags[s] for s in steps[1:]))


def run_costs(report: MeasuredRun, *, gpus: int = 1,
              rows: Iterable[CheckpointRow] | None = None) -> RunCosts:
    """The per-event costs of a report: mean step time, stall and background per save, mean
    steps between saves, down time per failure (0 without failures). With the run's
    ``rows``, the background time is the lag until every rank holds a save
    (:func:`durable_lag_seconds`) less the stall: the slowest rank sets it; and the first
    save of a life pays :func:`first_save_extra_seconds` on top.

    The step time is the mean over the up time less the stalls, not the report's median:
    saves are spaced in steps, so it is the mean that sets how much wall time lies between
    them (on a loaded machine the two differ by 2x and more).
    """
    stall = _need(report.stall_seconds, "the stall of its saves")
    saves = _need(report.saves, "a save")
    trained = _need(report.steps_trained, "the steps trained")
    step = ((report.up_seconds - stall) / trained
            if report.up_seconds is not None and report.up_seconds > stall
            else _need(report.step_seconds, "the step time (heartbeats)"))
    background = (report.background_seconds or 0.0) / saves
    rows = list(rows) if rows is not None else []
    lag = durable_lag_seconds(rows)
    if lag is not None:
        background = max(0.0, lag - stall / saves)
    down = ((report.down_after_failures_seconds or 0.0) / report.interruptions
            if report.interruptions else 0.0)
    return RunCosts(gpus=gpus, step_seconds=step, stall_seconds=stall / saves,
                    background_seconds=background, interval_steps=trained / saves,
                    down_seconds=down, first_save_extra_seconds=first_save_extra_seconds(rows))


def _prediction(costs: RunCosts, out: Outcome) -> Prediction:
    """Stalls and saves as the run's records count them: one row per step of the final
    timeline (a save re-done after a restore replaces the row of the rolled-back one)."""
    return Prediction(lost_steps=sum(out.lost_work_seconds.values()) / costs.step_seconds,
                      productive_steps=out.productive_seconds / costs.step_seconds,
                      overhead_seconds=sum(out.kept_stalls),
                      saves=float(len(out.kept_stalls)), goodput=out.ettr)


def replay(costs: RunCosts, uptimes_seconds: Sequence[float], tail_seconds: float,
           *, max_pending: int = 2) -> Prediction:
    """The run replayed: each life trains ``uptimes_seconds[i]`` after its restore, then is
    killed; the last one trains ``tail_seconds`` to the end. Down time is left out (the
    totals compared do not contain it)."""
    tc = costs.tier_costs()
    no_down = TierCosts(**{**tc.__dict__, "relaunch_seconds": 0.0})
    at, failures = 0.0, []
    for uptime in uptimes_seconds:
        at += uptime
        failures.append(Failure(at, FailureKind.PROCESS_CRASH))
    schedule = fixed_schedule(costs.interval_steps * costs.step_seconds, peer=False)
    out = simulate(no_down, schedule, failures, horizon_seconds=at + tail_seconds, peer=False,
                   max_pending=max_pending)
    return _prediction(costs, out)


def expected(costs: RunCosts, *, mtbf_seconds: float, wall_seconds: float, seeds: int = 200,
             max_pending: int = 2) -> Prediction:
    """Means over ``seeds`` runs of ``wall_seconds`` with exponential failures (crashes) at
    ``mtbf_seconds`` of wall time, down time included."""
    model = FailureModel(mtbf_seconds=mtbf_seconds, mix={FailureKind.PROCESS_CRASH: 1.0})
    schedule = fixed_schedule(costs.interval_steps * costs.step_seconds, peer=False)
    runs = [_prediction(costs, simulate(costs.tier_costs(), schedule, model,
                                        horizon_seconds=wall_seconds, peer=False, seed=s,
                                        max_pending=max_pending)) for s in range(seeds)]
    return Prediction(lost_steps=fmean(p.lost_steps for p in runs),
                      productive_steps=fmean(p.productive_steps for p in runs),
                      overhead_seconds=fmean(p.overhead_seconds for p in runs),
                      saves=fmean(p.saves for p in runs),
                      goodput=fmean(p.goodput for p in runs))


def format_prediction(report: MeasuredRun, *, gpus: int = 1, seeds: int = 200) -> str:
    """``ckptpilot report --predict``: the model's goodput for this run's own size and costs
    beside the measured one."""
    costs = run_costs(report, gpus=gpus)
    wall = _need(report.wall_seconds, "the wall time")
    if report.mtbf_seconds is None:
        raise PredictionError("the run has no failures yet (MTBF unknown): nothing to predict "
                              "against; the simulator needs the run's failure rate")
    p = expected(costs, mtbf_seconds=report.mtbf_seconds, wall_seconds=wall, seeds=seeds)
    measured = report.goodput_fraction
    # The report's goodput is productive steps x its median step time / wall: the same here.
    predicted = p.productive_steps * (report.step_seconds or costs.step_seconds) / wall
    lines = [
        "",
        f"simulator (ckptpilot simulate's model, {seeds} seeds of {wall:.0f} s, exponential "
        f"failures at the run's MTBF {report.mtbf_seconds:.0f} s, its own per-event costs: "
        f"mean step {costs.step_seconds:.4g} s, stall {costs.stall_seconds:.4g} s and background "
        f"{costs.background_seconds:.4g} s per save, a save every {costs.interval_steps:.1f} "
        f"steps, {costs.down_seconds:.3g} s down per failure)",
        "",
        "                       measured    predicted",
        f"goodput                {_pct(measured):>8}    {_pct(predicted):>8}",
        f"productive steps       {report.steps_productive or 0:>8}    {p.productive_steps:>8.1f}",
        f"steps lost             {report.steps_lost_to_failures:>8}    {p.lost_steps:>8.1f}",
        f"stall seconds          {report.stall_seconds or 0:>8.3f}    {p.overhead_seconds:>8.3f}",
        f"saves                  {report.saves:>8}    {p.saves:>8.1f}",
        "",
    ]
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.1%}"
