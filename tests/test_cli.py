"""The `ckptpilot` command: the demo end to end, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckptpilot.cli import main


def ckptpilot(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptpilot", *args], capture_output=True,
                          text=True, timeout=1200, cwd=cwd)


@dataclass(frozen=True)
class DemoRun:
    run_dir: Path
    config: Path
    stdout: str
    fields: dict[str, str]  # the summary's lines, by name


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """One 100-step demo for every test of what it prints and leaves: the LR mistake at steps
    35-36 spikes the loss, confirmed at 38 the run goes back to the save of step 30 and skips
    8 batches; near step 65 the child is SIGKILLed (later on a box where the save of step 60
    is not durable yet), the second child restores step 60 and finishes."""
    tmp = tmp_path_factory.mktemp("demo")
    cfg = tmp / "fast.yaml"
    cfg.write_text("scheduler: {base_interval: 10, min_interval: 1, max_interval: 500,\n"
                   "  young_daly: false, weights: {loss: 1.0, grad: 0.0, system: 0.0},\n"
                   "  loss: {slope_threshold: 1000.0}}\n"
                   "rollback: {enabled: true}\n")
    run_dir = tmp / "demo"
    out = ckptpilot("demo", "--steps", "100", "--run-dir", str(run_dir), "--config", str(cfg))
    assert out.returncode == 0, out.stderr
    summary = out.stdout.split("\nsummary\n", 1)[1]
    fields = {k.strip(): v.strip() for k, v in (
        line.strip().split("  ", 1) for line in summary.splitlines() if line.strip())}
    return DemoRun(run_dir, cfg, out.stdout, fields)


def _crash_step(demo: DemoRun) -> int:
    crash = int(demo.fields["crash"].removeprefix("SIGKILL of the training process at step "))
    assert 65 <= crash < 70  # killed at 65, or once the save of step 60 is durable
    return crash


@pytest.mark.crash
def test_demo_trains_is_killed_recovers_and_reports(demo: DemoRun, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fields, run_dir = demo.fields, demo.run_dir
    crash = _crash_step(demo)
    assert fields["recovered step"] == "60"
    assert fields["steps lost"] == str(crash - 60)
    assert fields["recovery source"].startswith("remote (")
    assert fields["replayed steps"].startswith(f"{crash - 60}/{crash - 60} losses bit-identical")
    assert fields["checkpoints saved"] == "10 (run 1: 6, run 2: 4)"
    assert float(fields["median stall per save"].split()[0]) > 0
    # Saved every 10 steps (routine pulses); retention during training keeps the newest
    # (routine_keep 1) and the one before it (keep_last 2), and steps 20 and 30, which the
    # spike's rollback classed above routine.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_00000020_rank_00000", "step_00000030_rank_00000",
        "step_00000090_rank_00000", "step_00000100_rank_00000"]
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "checkpoint/save_seconds", "checkpoint/bytes"} <= tags

    report = ckptpilot("report", "--run-dir", str(run_dir), "--config", str(demo.config))
    assert report.returncode == 0, report.stderr
    table = {line.split("  ", 1)[0]: line for line in report.stdout.splitlines()}
    assert f"{crash - 60} steps lost x step time" in table["lost to failures"]
    assert "8 steps rolled back x step time" in table["lost to rollbacks"]
    assert table["failures"].startswith("failures             1 crash(es), 0 hang(s), 0 "
                                        "preemption(s), 1 rollback(s); MTBF")

    # A previous demo directory is reused, its old run removed first (the shortest demo, on
    # a copy: the other tests read this run).
    reused = shutil.copytree(run_dir, tmp_path / "demo")
    again = ckptpilot("demo", "--steps", "20", "--run-dir", str(reused), "--config",
                      str(demo.config))
    assert again.returncode == 0, again.stderr
    assert max(int(p.name.split("_")[1]) for p in (reused / "checkpoints").iterdir()) == 20


@pytest.mark.crash
def test_the_demo_spikes_rolls_back_and_says_so(demo: DemoRun) -> None:
    fields = demo.fields
    assert fields["loss spike"].startswith("LR x100 at steps 35-36: loss ")
    assert fields["rollback"] == ("confirmed at step 38 (onset 36); back to step 30, 8 batches "
                                  "skipped; 1 rollback(s)")
    crash = _crash_step(demo)
    assert fields["steps trained"] == (f"100 (+{crash - 60} re-run after the crash, +8 after "
                                       "the rollback)")
    assert fields["saves by trigger"].startswith("interval 10, score 0, emergency 0")
    assert "[run 1] step    38: ROLLBACK to step 30" in demo.stdout
    decisions = [json.loads(line) for line in
                 (demo.run_dir / "decisions_rank_00000.jsonl").read_text().splitlines()]
    assert [(d["step"], d["rollback_to"]) for d in decisions if "rollback_to" in d] == [(38, 30)]


def run_main(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """``ckptpilot ARGS`` in this process: (exit status, stdout, stderr); argparse's exit
    counts as the status it exits with."""
    capsys.readouterr()
    try:
        status = main([str(a) for a in args])
    except SystemExit as exit_:
        assert isinstance(exit_.code, int)
        status = exit_.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


BAD_INPUT = [
    (["demo", "--steps", "0"], "--steps: expected a positive integer, got 0"),
    (["demo", "--steps", "many"], "expected a positive integer, got 'many'"),
    (["demo", "--steps", "5"], "--steps must be at least 20"),
    (["demo", "--bogus"], "unrecognized arguments: --bogus"),
    (["demo", "--config", "/nonexistent/p.yaml"], "/nonexistent/p.yaml"),
    (["nope"], "invalid choice: 'nope'"),
    ([], "the following arguments are required: command"),
    (["validate", "--dry-run", "--rebuild"],
     "argument --rebuild: not allowed with argument --dry-run"),
]


def test_the_command_prints_one_line_and_exits_2_from_its_own_process(tmp_path: Path) -> None:
    """``python -m ckptpilot`` passes main()'s status and argparse's exit on as the process's
    exit code; the other bad inputs below run main() in this process (each start of the
    command imports torch)."""
    for args, message in (BAD_INPUT[2], BAD_INPUT[5]):
        out = ckptpilot(*args, cwd=tmp_path)
        assert out.returncode == 2
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, out.stderr
        assert message in lines[0]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("args", "message"), BAD_INPUT)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str], args: list[str],
                                          message: str) -> None:
    monkeypatch.chdir(tmp_path)
    status, out, err = run_main(capsys, *args)
    assert (status, out) == (2, "")
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert message in lines[0]
    assert not (tmp_path / "runs").exists()


def test_the_demo_is_never_silent_for_long(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A child that prints nothing (importing torch, a slow step) still gets a line every
    PROGRESS_SECONDS: before its first event one that says it is starting, after it the step
    it is on."""
    import time

    from ckptpilot.cli import demo

    monkeypatch.setattr(demo, "PROGRESS_SECONDS", 0.2)
    run = demo._Run(last_step=7)
    ticker = demo._Ticker("run 1", run, 40)
    lines: list[str] = []
    deadline = time.monotonic() + 60  # a safety net: the first line is due after 0.2 s
    try:
        while not any("starting" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.1)
            lines += capsys.readouterr().out.splitlines()
        ticker.heard()
        while not any("step     7/40" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.1)
            lines += capsys.readouterr().out.splitlines()
    finally:
        ticker.stop()
    assert any(line.startswith("[run 1] starting: importing torch") for line in lines)
    assert any(line.startswith("[run 1] step     7/40  (still working") for line in lines)


def test_demo_refuses_a_foreign_non_empty_run_dir(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    status, _, err = run_main(capsys, "demo", "--run-dir", tmp_path)
    assert status == 2
    assert "is not empty and was not made by the demo" in err
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_bad_policy_key_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("scheduler: {min_interval: 50, max_interval: 10}\n")
    status, _, err = run_main(capsys, "demo", "--config", cfg, "--run-dir", tmp_path / "r")
    assert status == 2
    assert "scheduler.min_interval" in err
    assert len(err.strip().splitlines()) == 1




@pytest.mark.parametrize("command", [
    ["ls"], ["validate"], ["validate", "--dry-run"], ["prune"], ["prune", "--dry-run"],
    ["recover", "--step", "4"], ["recover", "--step", "4", "--dry-run"],
], ids=" ".join)
def test_a_damaged_metadata_database_is_one_line_exit_2_naming_it_and_the_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    db = tmp_path / "metadata.sqlite"
    db.write_bytes(b"this is not a database" * 200)
    (tmp_path / "checkpoints").mkdir()
    status, out, err = run_main(capsys, *command, "--run-dir", tmp_path)
    assert (status, out) == (2, "")
    assert err == (f"ckptpilot {command[0]}: error: {db}: the metadata database is damaged "
                   "(file is not a database); `ckptpilot validate --rebuild` moves it aside "
                   "(kept, not deleted) and rebuilds the database from the checkpoints\n")
    assert db.read_bytes() == b"this is not a database" * 200
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "metadata.sqlite"]


def test_an_os_error_in_a_run_operation_is_one_line_naming_the_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run_id").mkdir()  # where the run's id file belongs
    status, out, err = run_main(capsys, "ls", "--run-dir", tmp_path)
    assert (status, out) == (2, "")
    assert err == (f"ckptpilot ls: error: Is a directory: {tmp_path / 'run_id'}; check that it "
                   "exists and that this user may read (and, for changes, write) it and its "
                   "directory\n")
