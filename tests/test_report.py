"""`ckptpilot report`: the goodput of a real run killed with SIGKILL and restarted, checked
figure by figure against the run's own records (metadata rows, ledger, heartbeat ring)."""

from __future__ import annotations

import itertools
import json
import math
import shutil
import signal
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from ckptpilot.cli import main
from ckptpilot.cli.report import RunRecords, build_report, format_table
from ckptpilot.rundir import read_run_id
from ckptpilot.scheduler.interval import daly_interval
from ckptpilot.storage.heartbeat import HeartbeatRecord, read_all
from ckptpilot.storage.ledger import FailureLedger, Interruption, Rollback
from ckptpilot.storage.metadata import CheckpointRow, MetadataStore
from ckptpilot.vocab import Level, RetentionClass, Status, Tier

JOB = Path(__file__).with_name("crashjob.py")
STEPS = 40
KILL_AFTER = 23  # the loop's index: the pilot's step 24 is observed, then SIGKILL


@pytest.fixture(scope="module")
def crashed_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Saves every 10 steps; killed after step 24; the restart restores step 20 and ends at
    40. Heartbeats every step (the default), TensorBoard on."""
    tmp = tmp_path_factory.mktemp("report")
    cfg = tmp / "policy.yaml"
    cfg.write_text(
        "scheduler: {base_interval: 10, min_interval: 1, max_interval: 500,\n"
        "  young_daly: false, weights: {loss: 1.0, grad: 0.0, system: 0.0},\n"
        "  loss: {slope_threshold: 1000.0}}\n"
        "observability: {tensorboard: true, decision_log: false}\n")
    run_dir = tmp / "run"

    def child(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(JOB), "--run-dir", str(run_dir), "--steps", str(STEPS),
             "--config", str(cfg), "--losses", str(tmp / "losses.txt"),
             "--final", str(tmp / "final"), *extra],
            capture_output=True, text=True, timeout=300)

    first = child("--kill-after-step", str(KILL_AFTER))
    assert first.returncode == -signal.SIGKILL, first.stderr
    second = child()
    assert second.returncode == 0, second.stderr
    resumed = next(ln for ln in second.stdout.splitlines() if ln.startswith("RESUMED"))
    return {"cfg": cfg, "run_dir": run_dir, "restored": int(resumed.split()[1])}


def report_json(capsys: pytest.CaptureFixture[str], run: dict[str, Any],
                *extra: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["report", "--run-dir", str(run["run_dir"]), "--config", str(run["cfg"]),
                 "--json", "--no-tensorboard", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def ledger_lines(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in
            (run_dir / "ledger_rank_00000.jsonl").read_text().splitlines()]


@pytest.mark.crash
def test_the_report_reads_lost_steps_checkpoints_stall_and_mtbf_from_the_records(
        crashed_run: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = crashed_run["run_dir"]
    got = report_json(capsys, crashed_run)

    # Lost steps: the heartbeat gap at the crash, the last heartbeat before the kill minus
    # the step the restart restored.
    beats = read_all(run_dir / "heartbeat_rank_00000.ring")
    steps = [b.step for b in beats]
    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    last_before_kill = steps[restart - 1]
    assert (last_before_kill, crashed_run["restored"]) == (KILL_AFTER + 1, 20)
    assert got["steps_lost_to_failures"] == last_before_kill - crashed_run["restored"] == 4
    assert (got["first_step"], got["last_step"], got["steps_productive"]) == (0, STEPS, STEPS)
    assert got["steps_trained"] == STEPS + 4

    # Step time: the median over the intervals within each process (none across the kill).
    lives = (beats[:restart], beats[restart:])
    rates = [(b.uptime_seconds - a.uptime_seconds) / (b.step - a.step)
             for life in lives for a, b in itertools.pairwise(life)]
    assert got["step_time_samples"] == len(rates) == (len(lives[0]) - 1) + (len(lives[1]) - 1)
    assert got["step_seconds"] == statistics.median(rates) > 0
    assert got["lost_to_failures_seconds"] == 4 * got["step_seconds"]
    assert got["productive_seconds"] == STEPS * got["step_seconds"]
    assert got["goodput_fraction"] == got["productive_seconds"] / got["wall_seconds"]

    # Checkpoints, stall, background time and bytes: the metadata rows.
    with MetadataStore(run_dir / "metadata.sqlite", read_only=True) as store:
        rows = store.rows(read_run_id(run_dir))
    assert got["checkpoints"] == len(rows) == 4
    assert got["by_level"] == dict(Counter(r.level.value for r in rows))
    assert got["by_class"] == dict(Counter(r.retention_class.value for r in rows))
    assert got["by_tier"] == {"remote": 4}
    assert got["by_status"] == dict(Counter(r.status.value for r in rows))
    assert got["saves"] == 4 and got["saves_without_stall"] == 0
    assert got["stall_seconds"] == math.fsum(r.seconds_snapshot for r in rows) > 0
    assert got["background_seconds"] == math.fsum(
        [r.seconds_write for r in rows] + [r.seconds_validate for r in rows])
    assert got["bytes_written"] == sum(r.bytes_encoded for r in rows)
    assert got["bytes_kept_remote"] == sum(r.bytes_encoded for r in rows if r.status == "valid")
    assert got["bytes_written_by_tier"] == {"remote": got["bytes_written"]}

    # The ledger: one interruption; MTBF is its; wall time from first start to the end.
    ledger = ledger_lines(run_dir)
    assert [r["kind"] for r in ledger] == ["run_start", "interruption", "run_start", "run_end"]
    interruption, end = ledger[1], ledger[3]
    assert (got["interruptions"], got["rollbacks"]) == (1, 0)
    assert got["recovery_seconds"] == interruption["recovery_seconds"]
    assert got["down_after_failures_seconds"] == (interruption["wall_time"]
                                                  - interruption["failed_at"])
    assert got["wall_seconds"] == end["wall_time"] - ledger[0]["wall_time"]
    assert got["up_seconds"] == interruption["uptime_seconds"] + end["uptime_seconds"]
    mtbf = FailureLedger(run_dir / "ledger_rank_00000.jsonl").mtbf_seconds()
    assert got["mtbf_seconds"] == mtbf == got["up_seconds"]
    save_cost = statistics.median(r.seconds_snapshot for r in rows)
    assert got["save_cost_seconds"] == save_cost
    assert got["young_daly_seconds"] == daly_interval(save_cost, mtbf)
    assert got["young_daly_steps"] == got["young_daly_seconds"] / got["step_seconds"]
    assert got["gpus"] is None and got["gpu_hours"] is None


@pytest.mark.crash
def test_gpus_turn_every_duration_into_gpu_hours(
        crashed_run: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    one = report_json(capsys, crashed_run, "--gpus", "1")
    eight = report_json(capsys, crashed_run, "--gpus", "8")
    assert eight["gpus"] == 8
    assert eight["gpu_hours"].keys() == one["gpu_hours"].keys() and len(eight["gpu_hours"]) == 9
    for name, hours in eight["gpu_hours"].items():
        assert hours == eight[f"{name}_seconds"] * 8 / 3600
        assert hours == pytest.approx(8 * one["gpu_hours"][name], rel=1e-12)


@pytest.mark.crash
def test_the_command_prints_the_table_and_writes_goodput_scalars(
        crashed_run: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = crashed_run["run_dir"]
    got = report_json(capsys, crashed_run, "--gpus", "8")
    out = subprocess.run(
        [sys.executable, "-m", "ckptpilot", "report", "--run-dir", str(run_dir), "--config",
         str(crashed_run["cfg"]), "--gpus", "8"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"goodput of run {got['run_id']} (rank 0)"
    assert len(lines) <= 25 and max(map(len, lines)) <= 100  # one screen
    row = next(ln for ln in lines if ln.startswith("lost to failures"))
    assert row.split()[3:5] == [f"{got['lost_to_failures_seconds']:.3f}",
                                f"{got['gpu_hours']['lost_to_failures']:.4f}"]
    assert "4 steps lost x step time" in row
    assert f"MTBF {got['mtbf_seconds']:.3f} s" in out.stdout
    assert "4 rows; pulse 4 | routine 4\n" in out.stdout

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    scalars = {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]
               if tag.startswith("goodput/")}
    assert {"goodput/wall_seconds", "goodput/lost_to_failures_seconds",
            "goodput/stall_seconds", "goodput/mtbf_seconds", "goodput/young_daly_seconds",
            "goodput/gpu_hours/wall"} <= scalars.keys()
    lost = scalars["goodput/steps_lost_to_failures"]
    assert [(e.step, e.value) for e in lost] == [(STEPS, 4.0)]


@pytest.mark.crash
def test_what_the_records_cannot_tell_is_unknown(
        crashed_run: dict[str, Any], capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    """Without the heartbeat ring the step time, and every time counted in steps, is
    unknown; the steps lost are still the ledger's."""
    copy = tmp_path / "run"
    shutil.copytree(crashed_run["run_dir"], copy)
    (copy / "heartbeat_rank_00000.ring").unlink()
    got = report_json(capsys, {**crashed_run, "run_dir": copy})
    assert got["steps_lost_to_failures"] == 4
    for name in ("step_seconds", "lost_to_failures_seconds", "productive_seconds",
                 "goodput_fraction", "young_daly_steps"):
        assert got[name] is None, name
    assert got["young_daly_seconds"] is not None

    (copy / "ledger_rank_00000.jsonl").unlink()
    assert main(["report", "--run-dir", str(copy), "--config", str(crashed_run["cfg"]),
                 "--no-tensorboard"]) == 0
    table = capsys.readouterr().out
    assert "wall time              unknown" in table
    assert "MTBF unknown" in table and "Young-Daly interval  unknown" in table


def test_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--run-dir", "/nonexistent/run"]) == 2
    err = capsys.readouterr().err
    assert err == ("ckptpilot report: error: run directory /nonexistent/run does not exist "
                   "(check --run-dir)\n")
    with pytest.raises(SystemExit) as exited:
        main(["report", "--gpus", "0"])
    assert exited.value.code == 2
    assert "--gpus: expected a positive integer, got 0" in capsys.readouterr().err


# -- the figures from records made by hand: rules a single real run does not exercise --------


def row(step: int, tier: Tier, *, stall: float | None, write: float | None = 1.0,
        validate: float | None = None, size: int | None = 100,
        level: Level = Level.PULSE, status: Status = Status.VALID) -> CheckpointRow:
    return CheckpointRow(
        id=0, run_id="r", step=step, rank=0, level=level, tier=tier, location="-",
        status=status, retention_class=RetentionClass.ROUTINE, score=None, metric_name=None,
        metric_value=None, sha256="0" * 64, prev_sha256=None, base_step=None, bytes_raw=None,
        bytes_encoded=size, codec=None, seconds_snapshot=stall, seconds_write=write,
        seconds_validate=validate, created_at=0.0, updated_at=0.0, removed_at=None, reason="",
        note="")


def beat(seq: int, step: int, uptime: float, wall: float) -> HeartbeatRecord:
    return HeartbeatRecord(seq=seq, wall_time=wall, data={"step": step}, uptime_seconds=uptime)


def test_stall_counts_once_per_save_and_step_time_never_spans_two_processes() -> None:
    """Run 1 (steps 0-50) dies; run 2 restores 40, rolls back from 80 to 70, ends at 100.
    Its heartbeats follow run 1's in sequence, with a higher step and a longer uptime: only
    the run start between them tells that they belong to two processes."""
    ledger = (
        {"kind": "run_start", "wall_time": 100.0, "step": 0},
        {"kind": "interruption", "wall_time": 200.0, "failed_at": 150.0, "last_step": 50,
         "recovered_step": 40, "steps_lost": 10, "source": "remote",
         "recovery_seconds": 2.0, "uptime_seconds": 50.0},
        {"kind": "run_start", "wall_time": 200.0, "step": 40},
        {"kind": "rollback", "wall_time": 230.0, "step": 80, "onset": 78, "to_step": 70,
         "skipped_batches": 10, "reason": "spike"},
        {"kind": "run_end", "wall_time": 260.0, "step": 100, "uptime_seconds": 60.0},
    )
    records = RunRecords(
        run_id="r", rank=0,
        rows=(row(20, Tier.PEER, stall=0.25),
              row(40, Tier.PEER, stall=0.5, level=Level.ORGAN),
              row(40, Tier.REMOTE, stall=0.5, validate=0.5, size=300, level=Level.ORGAN),
              row(60, Tier.REMOTE, stall=None, write=None, size=None)),  # a rebuilt row
        ledger=ledger,
        interruptions=(Interruption(wall_time=200.0, failed_at=150.0, last_step=50,
                                    recovered_step=40, steps_lost=10, source="remote",
                                    recovery_seconds=2.0, uptime_seconds=50.0),),
        rollbacks=(Rollback(wall_time=230.0, step=80, onset=78, to_step=70,
                            skipped_batches=10, reason="spike"),),
        mtbf_seconds=110.0,
        heartbeats=(beat(1, 48, 48.0, 148.0), beat(2, 49, 49.0, 149.0),
                    beat(3, 50, 50.0, 150.0), beat(4, 98, 58.0, 258.0),
                    beat(5, 99, 60.0, 259.0), beat(6, 100, 62.0, 260.0)))
    r = build_report(records, gpus=2)
    assert (r.step_seconds, r.step_time_samples) == (1.5, 4)  # 1, 1, 2, 2: not 50 -> 98
    assert (r.first_step, r.last_step, r.steps_productive) == (0, 100, 100)
    assert (r.steps_lost_to_failures, r.steps_rolled_back, r.steps_trained) == (10, 10, 120)
    assert (r.lost_to_failures_seconds, r.lost_to_rollbacks_seconds) == (15.0, 15.0)
    assert (r.wall_seconds, r.up_seconds, r.down_after_failures_seconds) == (160.0, 110.0, 50.0)
    assert r.goodput_fraction == 150.0 / 160.0
    assert (r.stall_seconds, r.saves, r.saves_without_stall) == (0.75, 3, 1)
    assert (r.background_seconds, r.rows_without_timing) == (3.5, 1)
    assert r.young_daly_seconds == daly_interval(0.375, 110.0)
    assert r.by_level == {"organ": 2, "pulse": 2} and r.by_tier == {"peer": 2, "remote": 2}
    assert (r.bytes_written, r.bytes_kept_remote, r.rows_without_size) == (500, 300, 1)
    assert r.bytes_written_by_tier == {"peer": 200, "remote": 300}
    assert r.gpu_hours()["wall"] == 160.0 * 2 / 3600
    table = format_table(r)
    assert "training-thread stall  0.750" in table
    assert "(1 save(s) without the figure)" in table


def test_a_run_without_an_end_record_ends_at_its_newest_heartbeat() -> None:
    records = RunRecords(
        run_id="r", rank=0, rows=(), interruptions=(), rollbacks=(), mtbf_seconds=None,
        ledger=({"kind": "run_start", "wall_time": 100.0, "step": 0},),
        heartbeats=(beat(1, 1, 1.0, 101.0), beat(2, 2, 2.0, 102.0)))
    r = build_report(records)
    assert (r.last_step, r.wall_seconds, r.up_seconds) == (2, 2.0, 2.0)
    assert (r.stall_seconds, r.background_seconds, r.bytes_written) == (0.0, 0.0, 0)
    nothing = build_report(RunRecords(run_id="r", rank=0, rows=(), ledger=(), interruptions=(),
                                      rollbacks=(), mtbf_seconds=None, heartbeats=()))
    assert (nothing.wall_seconds, nothing.step_seconds, nothing.last_step) == (None, None, None)
    assert "wall time              unknown" in format_table(nothing)
