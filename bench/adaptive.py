"""Replay recorded training traces through the adaptive scheduler and two fixed schedules.

The evidence for the adaptive scheduler (SPEC §4): each trace in ``bench/traces/`` (per step:
loss, gradient norm, step seconds, from real runs by ``bench/record_traces.py``) is fed to
:class:`AdaptiveCheckpointScheduler` through its public API only, and the saves it decides are
compared with two fixed schedules **at the same number of saves** (iso-cost):

* ``fixed``: a save every ``I`` steps, ``I`` the integer whose count ⌊(T − 1) / I⌋ over the
  trace's ``T`` steps is nearest the adaptive run's count (the smaller ``I`` on a tie);
* ``Young–Daly-fixed``: a save every τ seconds of the trace's own wall time. Daly's optimum
  τ = daly_interval(save cost, MTBF) assumes a constant period *in time*; at iso-cost its
  value is set by the count alone (saves at k·τ, k = 1 … n, τ = total time / (n + 1)), so
  what remains of Young–Daly is the rule "equal time between saves", which differs from
  "equal steps" wherever step times vary. The unscaled Daly τ for ``--save-seconds`` and
  ``--mtbf-seconds`` is printed for reference only.

Counts leave out a save at the trace's last step: no failure in the replay can use it (a
failure at step f restarts from a save at f − 1 at the latest), while a real run goes on and
would: counting it charged a periodic schedule whose period divides T one useless save.

Pure replay, no training: the scheduler takes its signals as data. The policy is the default
one except for lengths scaled to the traces' few hundred steps (``--base-interval``, minimum
and maximum at 0.1× and 4× it, the hazard window equal to it) and a grad probe every step
(the traces hold one per step).

Failure models. A failure at wall time t interrupts the step ``f`` that was running; the steps
lost are f − 1 − s, ``s`` the newest save at or before f − 1 (0, the start, when none). The
replay does not roll back: failures are evaluated on one pass of the trace.

* ``uniform``: a Poisson process in wall time (failure times uniform over the trace);
* ``weibull``: a Weibull renewal process in wall time, shape ``--weibull-shape`` (< 1: failures
  cluster, as fitted to HPC logs), its mean gap a third of the trace, started at a uniform
  random phase;
* ``precursor p soft`` / ``precursor p hard``: Poisson failures, ``--precursor-failures`` per
  pass of the trace (default 1); a fraction ``p`` of them is preceded for
  ``--precursor-window`` W steps
  by health readings with ``signal=1.0`` (what ``HealthMonitor`` reports for severe throttling
  or sustained slow IO); every other step gets a healthy reading. ``hard``: each window also
  starts with one new hard GPU error (the monitor's cumulative ``hard_errors`` count rises by
  one), which the scheduler answers with an emergency organ. The adaptive run is replayed once
  per seed with that seed's readings, and the fixed schedules are tuned to that replay's
  count. Why 1 failure per pass: the traces' passes hold 12-20 saves, so 1 failure per pass
  is an MTBF of 12-20 save intervals; a schedule at Young's optimum τ = √(2·C·MTBF) has
  MTBF / τ = √(MTBF / 2C), 10-25 for a save cost C of 10 s to 1 min against an MTBF of
  3 hours. With 4 per pass (MTBF 3-5 intervals: a run redoing a fifth of its work) every
  alarm window's extra saves weigh four times as much against the iso-cost fixed schedule;
  ``--precursor-failures 4`` gives that stress case. The windows come only before failures
  here: false alarms, which cost saves and save nothing, are not modelled.

Spikes. The spikes a rollback acts on are the ones the pilot's :class:`SpikeDetector`
confirms (``RollbackPolicy`` defaults: a loss above 2× the median of the last 50 losses for 3
steps, or non-finite), fed the trace's losses as the pilot feeds them; each has an onset and a
confirmation step. The loss of step t comes from the weights saved at t − 1, so the save at
``onset − 1`` is suspect and the rollback point is the newest save *before* ``onset − 1``. At
each confirmation the pilot classes it ``critical`` (never pruned) and every other save in
[onset − 1 − ``baseline_window``, onset − 1) ``important`` if it was ``routine``: the replay
of the adaptive schedule does exactly that. Plain fixed schedules have no one to
promote their saves (no tool does), so the goal's baselines are unpromoted; the cell also gives
the fixed schedules *with* the same promotion, which shows how much of the gain is the
promotion's rather than the schedule's. The rollback distance of a spike is onset − the newest
save before ``onset − 1`` that retention keeps: :func:`ckptpilot.retention.plan.plan_retention`
(default policy) is applied to all the run's saves, with their final classes, at the end of
the trace — a late prune, as when a person looks back at a spike long after it. Each save is
one valid row with its decision's level and retention class; the fixed schedules' saves are
``routine``, every ``organ_every``-th an organ. No kept rollback point rolls back to
step 0. "kept k/n" counts the spikes whose rollback point survives the prune;
"unpruned" gives the median distance to that newest save, kept or not (what the schedule alone
achieved). A prune that runs between an onset and its confirmation (``patience`` − 1 steps)
could remove the point before the promotion; the replay does not model it.

A second column measures the same distances against the bench's own rule, independent of any
detector: an onset is a step whose loss is non-finite, or above ``--spike-factor`` (1.25)
times the largest loss of the previous 20 steps, with no such step in the 10 before it. It
finds divergences the detector misses (a single-step jump, a rise under 2×) but is not
scale-free: minibatch noise on a loss near 0 passes it too. Promotion there is still the
detector's.

Quiet phases: steps more than ``--quiet-margin`` steps from every onset of either kind and
outside every precursor window (and its failure step), the last step excepted; the column
gives the saves taken there (mean over seeds).

Variance: the uniform and Weibull models draw ``--failures`` failures in each of ``--seeds``
seeds, the precursor models ``--precursor-failures`` in each of ``--precursor-seeds`` seeds
(one replay per seed). Steps lost are given as mean ± std of the per-seed means; the ratio is
that of the means over all seeds (the same failures for every schedule), with a 95 % bootstrap
interval over seeds. Spike and quiet numbers of the uniform and Weibull rows come from the one
deterministic replay without precursors; in the precursor rows they pool every seed.

Goals (issue): uniform lost ≤ 1.05× fixed; precursor p = 0.5 lost ≤ 0.7× fixed; spikes median
rollback ≤ 0.25× fixed with the rollback point kept (on the detector's spikes); quiet saves
≤ 1.1× fixed. Each is judged against the *stricter* of the two fixed baselines (the larger
ratio).

Usage, from the repository root: ``.venv/bin/python bench/adaptive.py [--seeds 40]``.
"""

from __future__ import annotations

import argparse
import bisect
import csv
import datetime
import itertools
import math
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import ckptpilot
from ckptpilot.policy import RetentionPolicy, RollbackPolicy, SchedulerPolicy
from ckptpilot.retention.plan import plan_retention
from ckptpilot.scheduler.adaptive import AdaptiveCheckpointScheduler
from ckptpilot.scheduler.decision import SystemHealth
from ckptpilot.scheduler.interval import daly_interval
from ckptpilot.scheduler.spike import SpikeDetector

TRACES = Path(__file__).resolve().parent / "traces"
SPIKE_HISTORY_STEPS = 20
SPIKE_DEBOUNCE_STEPS = 10
BOOTSTRAP_RESAMPLES = 2000
MODELS = (
    "uniform",
    "weibull",
    "precursor p=0.25 soft",
    "precursor p=0.5 soft",
    "precursor p=0.25 hard",
    "precursor p=0.5 hard",
)


@dataclass(frozen=True)
class Trace:
    name: str
    losses: list[float]
    grad_norms: list[float]
    step_seconds: list[float]

    @property
    def steps(self) -> int:
        return len(self.losses)


@dataclass(frozen=True)
class Save:
    step: int
    level: str
    retention_class: str


@dataclass(frozen=True)
class Row:
    """The fields :func:`plan_retention` reads; every replayed save is one valid remote row."""

    id: int
    step: int
    level: str
    retention_class: str
    run_id: str = "bench"
    rank: int = 0
    tier: str = "remote"
    location: str = ""
    status: str = "valid"
    metric_name: str | None = None
    metric_value: float | None = None
    base_step: int | None = None


def load_trace(path: Path) -> Trace:
    """A trace CSV as written by ``bench/record_traces.py`` (``#`` header lines skipped)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    steps = [int(row["step"]) for row in rows]
    if steps != list(range(1, len(rows) + 1)):
        raise ValueError(f"{path}: steps must run 1, 2, 3, ... without gaps; re-record it")
    return Trace(
        name=path.stem,
        losses=[float(row["loss"]) for row in rows],
        grad_norms=[float(row["grad_norm"]) for row in rows],
        step_seconds=[float(row["step_seconds"]) for row in rows],
    )


def bench_policy(base_interval: int) -> SchedulerPolicy:
    return SchedulerPolicy(
        base_interval=base_interval,
        min_interval=max(1, base_interval // 10),
        max_interval=4 * base_interval,
        grad={"probe_every": 1},
        system={"nvml": False, "hazard_window_steps": base_interval},
    )


def health_readings(
    steps: int, windows: Sequence[range], hard: bool
) -> list[SystemHealth]:
    """Per step (index = step − 1) the reading the health monitor would hand over.

    Inside a precursor window the system signal is 1 (what ``HealthMonitor`` reports for
    severe throttling or sustained slow IO). ``hard``: each window also starts with one new
    hard GPU error (a correctable-then-uncorrectable ECC pattern, an XID), so the cumulative
    ``hard_errors`` count rises by one at its first step, as the monitor's count does.
    """
    shown = {step for window in windows for step in window}
    starts = sorted(window.start for window in windows if len(window))
    readings = []
    for step in range(1, steps + 1):
        errors = bisect.bisect_right(starts, step) if hard else 0
        signal = 1.0 if step in shown else 0.0
        readings.append(SystemHealth(signal=signal, hard_errors=errors, gpu_available=True))
    return readings


def replay_adaptive(
    trace: Trace, policy: SchedulerPolicy, readings: Sequence[SystemHealth]
) -> list[Save]:
    scheduler = AdaptiveCheckpointScheduler(policy)
    saves = []
    for step in range(1, trace.steps + 1):
        decision = scheduler.decide(
            step, trace.losses[step - 1], trace.grad_norms[step - 1], readings[step - 1]
        )
        if decision.save and decision.level is not None:
            saves.append(Save(step, decision.level.value, decision.retention_class.value))
    return saves


def _routine(steps: Sequence[int], organ_every: int) -> list[Save]:
    return [
        Save(step, "organ" if (i + 1) % organ_every == 0 else "pulse", "routine")
        for i, step in enumerate(steps)
    ]


def useful_saves(saves: Sequence[Save], trace: Trace) -> int:
    """Saves before the trace's last step: a save at that step protects only steps the replay
    does not have (a failure at step f uses the saves up to f − 1), so it is not counted."""
    return sum(1 for save in saves if save.step < trace.steps)


def fixed_steps(trace: Trace, count: int, organ_every: int) -> tuple[list[Save], int]:
    """Every I steps, I giving the useful count ⌊(T − 1) / I⌋ nearest ``count`` (smaller I on a
    tie)."""
    last = trace.steps - 1
    best = min(range(1, trace.steps + 1), key=lambda i: (abs(last // i - count), i))
    return _routine(range(best, trace.steps + 1, best), organ_every), best


def fixed_time(trace: Trace, count: int, organ_every: int) -> tuple[list[Save], float]:
    """Every τ seconds of trace time, τ = total / (count + 1): ``count`` saves at equal times."""
    ends = _step_ends(trace)
    tau = ends[-1] / (count + 1)
    steps: list[int] = []
    for k in range(1, count + 1):
        step = bisect.bisect_left(ends, k * tau) + 1  # the step running at time k·τ
        if step <= trace.steps and (not steps or step > steps[-1]):
            steps.append(step)
    return _routine(steps, organ_every), tau


def _step_ends(trace: Trace) -> list[float]:
    ends, total = [], 0.0
    for seconds in trace.step_seconds:
        total += seconds
        ends.append(total)
    return ends


def steps_lost(saves: Sequence[Save], failure_steps: Sequence[int]) -> list[int]:
    steps = [save.step for save in saves]
    lost = []
    for failed in failure_steps:
        done = failed - 1
        index = bisect.bisect_right(steps, done)
        lost.append(done - (steps[index - 1] if index else 0))
    return lost


def detector_spikes(trace: Trace, policy: RollbackPolicy) -> list[tuple[int, int]]:
    """(onset, confirmation step) of each spike the pilot's :class:`SpikeDetector` confirms."""
    detector = SpikeDetector(policy)
    found = []
    for step, loss in enumerate(trace.losses, start=1):
        spike = detector.update(step, loss)
        if spike is not None:
            found.append((spike.onset, spike.step))
    return found


def promote(
    saves: Sequence[Save], spikes: Sequence[tuple[int, int]], baseline_window: int
) -> list[Save]:
    """The saves as the pilot leaves them once each spike is confirmed: the newest save before
    ``onset − 1`` (the suspect step: its weights gave the onset's loss) ``critical``, every
    other save in [onset − 1 − ``baseline_window``, onset − 1) ``important`` if it was
    ``routine``."""
    steps = [save.step for save in saves]
    points: set[int] = set()
    run_up: set[int] = set()
    for onset, _ in spikes:
        suspect = onset - 1
        newest = bisect.bisect_left(steps, suspect)
        if newest:
            points.add(newest - 1)
        run_up.update(range(bisect.bisect_left(steps, suspect - baseline_window), newest))
    return [
        Save(save.step, save.level, "critical") if i in points
        else Save(save.step, save.level, "important")
        if i in run_up and save.retention_class == "routine" else save
        for i, save in enumerate(saves)
    ]


def spike_onsets(trace: Trace, factor: float) -> list[int]:
    onsets: list[int] = []
    last_hit = -SPIKE_DEBOUNCE_STEPS - 1
    for step in range(SPIKE_HISTORY_STEPS + 1, trace.steps + 1):
        loss = trace.losses[step - 1]
        history = trace.losses[step - 1 - SPIKE_HISTORY_STEPS : step - 1]
        finite = [x for x in history if math.isfinite(x)]
        hit = not math.isfinite(loss) or (bool(finite) and loss > factor * max(finite))
        if hit:
            if step - last_hit > SPIKE_DEBOUNCE_STEPS:
                onsets.append(step)
            last_hit = step
    return onsets


@dataclass(frozen=True)
class Rollback:
    """One spike under one schedule: distances from the onset back to the rollback point."""

    kept_distance: int
    """To the newest save before ``onset − 1`` that the prune keeps (to step 0 if none)."""
    any_distance: int
    """To the newest save before ``onset − 1``, kept or not: what the schedule achieved."""
    survived: bool
    """Whether that newest save survives the prune."""


def rollbacks(saves: Sequence[Save], onsets: Sequence[int]) -> list[Rollback]:
    rows = [Row(id=i + 1, step=s.step, level=s.level, retention_class=s.retention_class)
            for i, s in enumerate(saves)]
    plan = plan_retention(rows, RetentionPolicy())
    kept = sorted(row.step for row, _ in plan.keep)
    every = [s.step for s in saves]
    result = []
    for onset in onsets:
        index = bisect.bisect_left(kept, onset - 1)
        newest = bisect.bisect_left(every, onset - 1)
        newest_step = every[newest - 1] if newest else 0
        result.append(Rollback(
            kept_distance=onset - (kept[index - 1] if index else 0),
            any_distance=onset - newest_step,
            survived=newest_step == 0 or newest_step in kept,
        ))
    return result


def quiet_saves(saves: Sequence[Save], quiet: Callable[[int], bool], trace: Trace) -> int:
    """Saves in quiet steps, the last step's excepted (not counted as cost either)."""
    return sum(1 for save in saves if save.step < trace.steps and quiet(save.step))


def uniform_failures(trace: Trace, rng: random.Random, count: int) -> list[int]:
    ends = _step_ends(trace)
    return [bisect.bisect_left(ends, rng.uniform(0.0, ends[-1])) + 1 for _ in range(count)]


def weibull_failures(trace: Trace, rng: random.Random, count: int, shape: float) -> list[int]:
    """``count`` failures of a Weibull renewal process, wrapped around the trace's wall time."""
    ends = _step_ends(trace)
    mean_gap = ends[-1] / 3.0
    scale = mean_gap / math.gamma(1.0 + 1.0 / shape)
    at = rng.uniform(0.0, ends[-1])
    failures = []
    for _ in range(count):
        at += rng.weibullvariate(scale, shape)
        failures.append(bisect.bisect_left(ends, at % ends[-1]) + 1)
    return [min(step, trace.steps) for step in failures]


DETECTED = ("adaptive", "fixed", "yd", "fixed+promotion", "yd+promotion")
"""Schedules measured on the detector's spikes; only ``adaptive`` and ``…+promotion`` are
promoted, as the pilot promotes its own saves and a plain fixed schedule has no one to."""


@dataclass
class Outcome:
    """Per seed: mean steps lost and failure count; per schedule: every spike's rollback."""

    lost: list[tuple[float, float, float]]
    failures: list[int]
    detected: dict[str, list[Rollback]]
    ruled: dict[str, list[Rollback]]
    spikes: int
    rule_spikes: int
    quiet: list[tuple[int, int, int]]
    saves: list[int]
    fixed_interval: list[int]


def evaluate(
    trace: Trace,
    model: str,
    args: argparse.Namespace,
    policy: SchedulerPolicy,
    rollback: RollbackPolicy,
) -> Outcome:
    spikes = detector_spikes(trace, rollback)
    onsets = [onset for onset, _ in spikes]
    rule = spike_onsets(trace, args.spike_factor)
    organ_every = policy.organ_every
    outcome = Outcome([], [], {name: [] for name in DETECTED},
                      {name: [] for name in DETECTED[:3]}, len(onsets), len(rule), [], [], [])
    baseline = replay_adaptive(trace, policy, health_readings(trace.steps, (), hard=False))
    deterministic = model in ("uniform", "weibull")
    seeds = args.seeds if deterministic else args.precursor_seeds
    for seed in range(seeds):
        rng = random.Random(f"{trace.name}/{model}/{seed}")
        windows: list[range] = []
        if model == "uniform":
            failures = uniform_failures(trace, rng, args.failures)
            adaptive = baseline
        elif model == "weibull":
            failures = weibull_failures(trace, rng, args.failures, args.weibull_shape)
            adaptive = baseline
        else:
            _, share, kind = model.split()
            p = float(share.removeprefix("p="))
            failures = uniform_failures(trace, rng, args.precursor_failures)
            for failed in failures:
                if rng.random() < p:
                    windows.append(range(max(1, failed - args.precursor_window), failed))
            readings = health_readings(trace.steps, windows, hard=kind == "hard")
            adaptive = replay_adaptive(trace, policy, readings)
        count = useful_saves(adaptive, trace)
        fixed, interval = fixed_steps(trace, count, organ_every)
        timed, _ = fixed_time(trace, count, organ_every)
        schedules = (adaptive, fixed, timed)
        lost = [steps_lost(schedule, failures) for schedule in schedules]
        outcome.lost.append((statistics.fmean(lost[0]), statistics.fmean(lost[1]),
                             statistics.fmean(lost[2])))
        outcome.failures.append(len(failures))
        outcome.saves.append(count)
        outcome.fixed_interval.append(interval)
        blocked = {s for w in windows for s in range(w.start, w.stop + 1)}
        def quiet(step: int, blocked: set[int] = blocked) -> bool:
            close = any(abs(step - onset) <= args.quiet_margin for onset in (*onsets, *rule))
            return not close and step not in blocked

        counts = [quiet_saves(schedule, quiet, trace) for schedule in schedules]
        outcome.quiet.append((counts[0], counts[1], counts[2]))
        if deterministic and seed > 0:
            continue  # the replay without precursors is the same in every seed
        window = rollback.baseline_window
        measured = {
            "adaptive": promote(adaptive, spikes, window),
            "fixed": fixed,
            "yd": timed,
            "fixed+promotion": promote(fixed, spikes, window),
            "yd+promotion": promote(timed, spikes, window),
        }
        for name in DETECTED:
            outcome.detected[name].extend(rollbacks(measured[name], onsets))
        for name in DETECTED[:3]:
            outcome.ruled[name].extend(rollbacks(measured[name], rule))
    return outcome


def pooled_ratio(
    lost: Sequence[tuple[float, float, float]], baseline: int, rng: random.Random
) -> tuple[float, float, float]:
    """Adaptive mean lost / a baseline's, over all seeds, with a 95 % bootstrap interval.

    Seeds are resampled (each seed's failures are one draw of the failure process), so the
    interval states how much the ratio moves with the failures drawn.
    """

    def ratio(sample: Sequence[tuple[float, float, float]]) -> float:
        denominator = sum(x[baseline] for x in sample)
        return sum(x[0] for x in sample) / denominator if denominator else math.nan

    point = ratio(lost)
    draws = sorted(
        ratio(rng.choices(lost, k=len(lost))) for _ in range(BOOTSTRAP_RESAMPLES)
    )
    low = draws[int(0.025 * BOOTSTRAP_RESAMPLES)]
    high = draws[int(0.975 * BOOTSTRAP_RESAMPLES) - 1]
    return point, low, high


def _fmt(value: float, digits: int = 2) -> str:
    return "–" if math.isnan(value) else f"{value:.{digits}f}"


def _verdict(met: bool) -> str:
    return "yes" if met else "**NO**"


def _worst(*ratios: float) -> float:
    """The larger ratio, against the stricter baseline; NaN (a baseline of 0) only when no
    ratio is defined — ``max`` would keep or drop a NaN depending on its position."""
    defined = [r for r in ratios if not math.isnan(r)]
    return max(defined) if defined else math.nan


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.nan


def _median_kept(rows: Sequence[Rollback]) -> float:
    return statistics.median(r.kept_distance for r in rows)


def _spike_cell(measured: dict[str, list[Rollback]]) -> tuple[float, str, int, int]:
    """Adaptive vs the two plain baselines: ratio, cell text, rollback points kept, spikes."""
    kept = [_median_kept(measured[name]) for name in DETECTED[:3]]
    ratio = _worst(_ratio(kept[0], kept[1]), _ratio(kept[0], kept[2]))
    survived = sum(r.survived for r in measured["adaptive"])
    total = len(measured["adaptive"])
    text = (f"{kept[0]:g} / {kept[1]:g} / {kept[2]:g} = {_fmt(ratio)}; "
            f"kept {survived}/{total}")
    return ratio, text, survived, total


def table_row(trace: Trace, model: str, outcome: Outcome) -> list[str]:
    lost = outcome.lost
    mean = [statistics.fmean(x[i] for x in lost) for i in range(3)]
    std = [statistics.pstdev(x[i] for x in lost) for i in range(3)]
    rng = random.Random(f"bootstrap/{trace.name}/{model}")
    r_fixed, lo_fixed, hi_fixed = pooled_ratio(lost, 1, rng)
    r_time, lo_time, hi_time = pooled_ratio(lost, 2, rng)
    verdicts = []
    lost_ratio = _worst(r_fixed, r_time)
    if model == "uniform":
        verdicts.append(f"uniform lost ≤ 1.05×: {_verdict(lost_ratio <= 1.05)}")
    elif model.startswith("precursor p=0.5"):
        verdicts.append(f"precursor lost ≤ 0.7×: {_verdict(lost_ratio <= 0.7)}")
    if outcome.spikes:
        spike_ratio, cell, survived, total = _spike_cell(outcome.detected)
        promoted = [_median_kept(outcome.detected[name]) for name in DETECTED[3:]]
        raw = [statistics.median(r.any_distance for r in outcome.detected[name])
               for name in DETECTED[:3]]
        fair = _worst(*(_ratio(_median_kept(outcome.detected["adaptive"]), x)
                        for x in promoted))
        spike_cell = (f"{outcome.spikes}: {cell}; both promoted: fixed / YD "
                      f"{promoted[0]:g} / {promoted[1]:g} = {_fmt(fair)}; unpruned "
                      f"{raw[0]:g} / {raw[1]:g} / {raw[2]:g}")
        met = spike_ratio <= 0.25 and survived == total
        verdicts.append(f"spikes ≤ 0.25× & kept: {_verdict(met)}")
    else:
        spike_cell = "0: no spike"
    if outcome.rule_spikes:
        rule_cell = f"{outcome.rule_spikes}: {_spike_cell(outcome.ruled)[1]}"
    else:
        rule_cell = "0: no onset"
    quiet = outcome.quiet
    q_mean = [statistics.fmean(x[i] for x in quiet) for i in range(3)]
    q_ratio = _worst(q_mean[0] / q_mean[1] if q_mean[1] else math.nan,
                     q_mean[0] / q_mean[2] if q_mean[2] else math.nan)
    verdicts.append(f"quiet ≤ 1.1×: {_verdict(q_ratio <= 1.1)}")
    return [
        trace.name,
        f"{model} ({len(lost)}×{statistics.fmean(outcome.failures):g})",
        f"{statistics.fmean(outcome.saves):.1f} ({statistics.fmean(outcome.fixed_interval):.1f})",
        f"{mean[0]:.1f}±{std[0]:.1f} / {mean[1]:.1f}±{std[1]:.1f} / {mean[2]:.1f}±{std[2]:.1f}",
        f"{_fmt(r_fixed)} [{_fmt(lo_fixed)}, {_fmt(hi_fixed)}]",
        f"{_fmt(r_time)} [{_fmt(lo_time)}, {_fmt(hi_time)}]",
        spike_cell,
        rule_cell,
        f"{q_mean[0]:.1f} / {q_mean[1]:.1f} / {q_mean[2]:.1f} = {_fmt(q_ratio)}",
        "; ".join(verdicts),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=40,
                        help="seeds of the uniform and Weibull models")
    parser.add_argument("--failures", type=int, default=200,
                        help="failures per seed, uniform and Weibull models")
    parser.add_argument("--precursor-seeds", type=int, default=400,
                        help="seeds of the precursor models (one replay each)")
    parser.add_argument("--base-interval", type=int, default=25)
    parser.add_argument("--precursor-failures", type=int, default=1,
                        help="failures per pass of the trace in the precursor models")
    parser.add_argument("--precursor-window", type=int, default=10, help="W, in steps")
    parser.add_argument("--weibull-shape", type=float, default=0.7)
    parser.add_argument("--spike-factor", type=float, default=1.25)
    parser.add_argument("--quiet-margin", type=int, default=10)
    parser.add_argument("--save-seconds", type=float, default=0.05)
    parser.add_argument("--mtbf-seconds", type=float, default=60.0)
    parser.add_argument("--only", default="", help="comma-separated trace names")
    parser.add_argument("--models", default="",
                        help="only the failure models whose name starts with this "
                             "(uniform, weibull, precursor, 'precursor p=0.5')")
    args = parser.parse_args()

    started = time.perf_counter()
    policy = bench_policy(args.base_interval)
    rollback = RollbackPolicy()
    paths = sorted(TRACES.glob("*.csv"))
    if args.only:
        wanted = set(args.only.split(","))
        paths = [p for p in paths if p.stem in wanted]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "ckptpilot/"], capture_output=True,
                           text=True, check=False).stdout.splitlines()
    changed = ", ".join(line[3:] for line in dirty) or "none"
    python = os.path.relpath(sys.executable)
    print(f"command: {shlex.join([python, *sys.argv])}")
    print(f"date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}")
    print(f"python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs; "
          f"git HEAD {head}; uncommitted in ckptpilot/: {changed}")
    print(f"ckptpilot imported from {Path(ckptpilot.__file__).parent}")
    print(f"policy: base_interval {policy.base_interval}, min {policy.min_interval}, max "
          f"{policy.max_interval}, hazard window {policy.system.hazard_window_steps}, grad probe "
          f"every step, other settings default; retention default")
    print(f"spike detector: the pilot's, rollback policy defaults (factor "
          f"{rollback.spike_factor:g} over the median of the last {rollback.baseline_window} "
          f"losses, patience "
          f"{rollback.patience}); at each confirmation the adaptive schedule's newest save "
          f"before onset - 1 becomes critical, its other saves in "
          f"[onset - 1 - {rollback.baseline_window}, onset - 1) important")
    print(f"seeds {args.seeds}; {args.failures} failures per seed (uniform, weibull shape "
          f"{args.weibull_shape}); precursor: {args.precursor_failures} failures per pass, "
          f"W = {args.precursor_window} steps; rule onsets: loss > {args.spike_factor}x the max "
          f"of the previous {SPIKE_HISTORY_STEPS} steps; quiet: > {args.quiet_margin} steps "
          f"from every onset")
    header = ["trace", "failure model (seeds×failures)", "adaptive saves (fixed I, steps)",
              "steps lost per failure: adaptive / fixed / YD (mean±std over seeds)",
              "lost ratio ad/fixed [95 % CI]", "lost ratio ad/YD [95 % CI]",
              "detector spikes: median rollback after prune ad / fixed / YD = ratio; newest "
              "save before onset - 1 kept; both promoted; unpruned",
              "rule onsets: median rollback ad / fixed / YD = ratio; kept",
              "quiet-phase saves ad / fixed / YD = ratio", "goals (vs the stricter baseline)"]
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for path in paths:
        trace = load_trace(path)
        step_s = statistics.fmean(trace.step_seconds)
        daly = daly_interval(args.save_seconds, args.mtbf_seconds) / step_s
        for model in (m for m in MODELS if m.startswith(args.models)):
            cells = table_row(trace, model, evaluate(trace, model, args, policy, rollback))
            print("| " + " | ".join(cells) + " |")
        plain = replay_adaptive(trace, policy, health_readings(trace.steps, (), hard=False))
        gaps = [b.step - a.step for a, b in itertools.pairwise(plain)]
        detected = ", ".join(f"{onset}→{step}" for onset, step in detector_spikes(trace, rollback))
        print(f"| {trace.name} | (reference) | Daly τ for save {args.save_seconds:g} s, MTBF "
              f"{args.mtbf_seconds:g} s: {daly:.0f} steps at {step_s * 1000:.2f} ms/step | "
              f"adaptive gaps without precursors: min {min(gaps)}, median "
              f"{statistics.median(gaps):g}, max {max(gaps)} steps | | | detector spikes "
              f"(onset→confirmed): {detected or 'none'} | rule onsets: "
              f"{', '.join(map(str, spike_onsets(trace, args.spike_factor))) or 'none'} | | |")
    print()
    print(f"wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
