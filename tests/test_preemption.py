"""Preemption notices: real signals to a real training process (tests/crashjob.py), the
emergency organ, the exit statuses, the ledger, and a bit-exact resume; the guard's handlers."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers import assert_states_bit_equal, ddp_policy, start_ddp_ranks

from ckptpilot import CheckpointPilot
from ckptpilot.cli.report import build_report, read_records
from ckptpilot.policy import Policy, PreemptionPolicy
from ckptpilot.storage.ledger import FailureLedger
from ckptpilot.tiers.remote import archive
from ckptpilot.tiers.remote.store import RemoteTier
from ckptpilot.vocab import ExitStatus

JOB = Path(__file__).with_name("crashjob.py")
STEPS = 40
INTERVAL = 10

def _config(tmp: Path, grace_seconds: float = 120.0) -> Path:
    """A fixed interval (saves at 10, 20, 30; every one a pulse), so the recovery point of a
    preemption whose organ is too late is known."""
    cfg = tmp / "policy.yaml"
    cfg.write_text(
        f"scheduler: {{base_interval: {INTERVAL}, min_interval: 1, max_interval: 500,\n"
        "  young_daly: false, weights: {loss: 1.0, grad: 0.0, system: 0.0},\n"
        "  loss: {slope_threshold: 1000.0}, organ_every: 100}\n"
        "observability: {tensorboard: false, decision_log: false}\n"
        "retention: {auto: false}\n"
        f"preemption: {{grace_seconds: {grace_seconds}}}\n")
    return cfg


def _cmd(run_dir: Path, cfg: Path, losses: Path, final: Path, *extra: str) -> list[str]:
    return [sys.executable, str(JOB), "--run-dir", str(run_dir), "--steps", str(STEPS),
            "--config", str(cfg), "--losses", str(losses), "--final", str(final), *extra]


def _run(*args: object, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_cmd(*args, *extra), capture_output=True, text=True,  # type: ignore[arg-type]
                          timeout=300)


def _losses(path: Path) -> dict[int, str]:
    return {int(s): v for s, v in (line.split() for line in path.read_text().splitlines())}


def _resumed(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESUMED")).split()[1:]


def _published(run_dir: Path) -> list[int]:
    tier = RemoteTier(str(run_dir / "checkpoints"))
    return sorted(s for s, _ in archive.list_archives(tier, 0).published)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    tmp = tmp_path_factory.mktemp("reference")
    losses, final = tmp / "losses.txt", tmp / "final.safetensors"
    proc = _run(tmp / "run", _config(tmp), losses, final)
    assert proc.returncode == 0, proc.stderr
    return {"losses": _losses(losses), "final": safetensors.torch.load_file(final)}


def _assert_finished_like(reference: dict[str, object], losses: Path, final: Path) -> None:
    assert _losses(losses) == reference["losses"]
    assert_states_bit_equal(safetensors.torch.load_file(final), reference["final"])  # type: ignore[arg-type]


@pytest.mark.crash
@pytest.mark.slow
def test_sigterm_mid_step_saves_an_organ_exits_75_and_resumes_with_no_step_lost(
        tmp_path: Path, reference: dict[str, object]) -> None:
    """SIGTERM from outside in the middle of loop step 21 (pilot step 22), while the save of
    step 20 is still being published: the notice waits for it, then an organ of step 22."""
    cfg, run_dir = _config(tmp_path), tmp_path / "run"
    losses, final = tmp_path / "losses.txt", tmp_path / "final.safetensors"
    job = subprocess.Popen(_cmd(run_dir, cfg, losses, final, "--notice-at-step", "21",
                                "--notice-from", "parent", "--slow-publish", "20:2"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert job.stdout is not None
        for line in job.stdout:
            if line.startswith("WAITING"):
                break
        job.send_signal(signal.SIGTERM)
        out, err = job.communicate(timeout=300)
    finally:
        job.kill()
    assert job.returncode == ExitStatus.PREEMPTED == 75, err
    assert "DONE" not in out
    assert "PREEMPTION: rank 0 got SIGTERM; saving an emergency organ of step 22" in err
    assert "the emergency organ of step 22 is durable and valid" in err
    assert _published(run_dir) == [10, 20, 22]
    stops = FailureLedger(run_dir / "ledger_rank_00000.jsonl").stops()
    assert [(s.step, s.cause) for s in stops] == [(22, "preemption")]

    again = _run(run_dir, cfg, losses, final)
    assert again.returncode == 0, again.stderr
    assert _resumed(again)[:4] == ["22", "remote", "0", "organ"]  # 0 steps lost
    _assert_finished_like(reference, losses, final)
    ledger = FailureLedger(run_dir / "ledger_rank_00000.jsonl")
    assert ledger.interruptions() == []  # a preemption is no failure
    assert ledger.mtbf_seconds() is None
    report = build_report(read_records(Policy().with_run_dir(run_dir)))
    assert (report.preemptions, report.hangs, report.interruptions) == (1, 0, 0)


@pytest.mark.crash
@pytest.mark.slow
def test_sigusr1_sent_by_the_job_itself_is_a_notice_too(
        tmp_path: Path, reference: dict[str, object]) -> None:
    cfg, run_dir = _config(tmp_path), tmp_path / "run"
    losses, final = tmp_path / "losses.txt", tmp_path / "final.safetensors"
    first = _run(run_dir, cfg, losses, final,
                 extra=("--notice-at-step", "5", "--notice", "SIGUSR1"))
    assert first.returncode == ExitStatus.PREEMPTED, first.stderr
    assert "got SIGUSR1" in first.stderr
    again = _run(run_dir, cfg, losses, final)
    assert again.returncode == 0, again.stderr
    assert _resumed(again)[:3] == ["6", "remote", "0"]
    _assert_finished_like(reference, losses, final)


@pytest.mark.crash
@pytest.mark.slow
def test_a_grace_period_too_short_keeps_the_previous_checkpoint_and_exits_76(
        tmp_path: Path, reference: dict[str, object]) -> None:
    """The organ of step 24 is held back 60 s in publication; the grace period is 1 s. The
    pulse of step 20 may still be in flight too (its validation runs in a child process): the
    log names whichever is the newest valid one then, and the restart resumes from it."""
    cfg, run_dir = _config(tmp_path, grace_seconds=1.0), tmp_path / "run"
    losses, final = tmp_path / "losses.txt", tmp_path / "final.safetensors"
    first = _run(run_dir, cfg, losses, final,
                 extra=("--notice-at-step", "23", "--slow-publish", "24:60"))
    assert first.returncode == ExitStatus.PREEMPTED_UNSAVED == 76, first.stderr
    said = re.search(r"PREEMPTION: rank 0: SIGTERM: the emergency organ of step 24 is NOT "
                     r"durable \(still being written when the grace_seconds=1 ran out\); the "
                     r"previous valid checkpoint, step (\d+), stays the recovery point; exiting "
                     r"with status 76", first.stderr)
    assert said is not None, first.stderr
    point = int(said.group(1))
    assert point in (10, 20) and 24 not in _published(run_dir)
    stop = FailureLedger(run_dir / "ledger_rank_00000.jsonl").stops()[-1]
    assert (stop.step, stop.cause) == (24, "preemption") and "NOT durable" in stop.reason

    again = _run(run_dir, cfg, losses, final)
    assert again.returncode == 0, again.stderr
    assert _resumed(again)[:3] == [str(point), "remote", str(24 - point)]
    _assert_finished_like(reference, losses, final)


# -- the guard in this process ------------------------------------------------------------


def _pilot(tmp_path: Path, **preemption: object) -> tuple[CheckpointPilot, torch.optim.Optimizer]:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = Policy.model_validate({
        "observability": {"tensorboard": False, "decision_log": False},
        "validation": {"load_test": "none"},
        "preemption": PreemptionPolicy(**preemption).model_dump()}).with_run_dir(tmp_path)
    return CheckpointPilot(policy, model=model, optimizer=opt), opt


def test_handlers_are_chained_and_put_back_on_close(tmp_path: Path) -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))
    try:
        pilot, _ = _pilot(tmp_path, signals=["SIGUSR2"])
        ours = signal.getsignal(signal.SIGUSR2)
        assert signal.getsignal(signal.SIGTERM) != ours  # only the configured signals
        signal.raise_signal(signal.SIGUSR2)
        assert seen == [signal.SIGUSR2]  # the previous handler still ran
        assert pilot._preemption.pending
        pilot.close(save=False)
        handler = signal.getsignal(signal.SIGUSR2)
        assert callable(handler) and handler != ours
        signal.raise_signal(signal.SIGUSR2)
        assert seen == [signal.SIGUSR2] * 2
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_a_loop_without_observe_is_stopped_at_the_optimizer_step(tmp_path: Path) -> None:
    pilot, opt = _pilot(tmp_path, signals=["SIGUSR2"])
    params = opt.param_groups[0]["params"]

    def train_step() -> None:
        opt.zero_grad()
        sum(p.sum() for p in params).backward()
        opt.step()

    train_step()
    train_step()  # hook-mode boundaries start at the second optimizer step
    signal.raise_signal(signal.SIGUSR2)
    with pytest.raises(SystemExit) as stopped:
        train_step()
    assert stopped.value.code == ExitStatus.PREEMPTED
    with pytest.raises(RuntimeError, match="closed"):
        pilot.observe()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL  # closed: put back
    saved = [p.detach().clone() for p in params]

    again, again_opt = _pilot(tmp_path, signals=["SIGUSR2"])
    assert again.restore() == 3
    rec = again.last_recovery
    assert rec is not None and rec.level == "organ"  # no heartbeats without observe()
    for a, b in zip(saved, again_opt.param_groups[0]["params"], strict=True):
        assert torch.equal(a.view(torch.int32), b.detach().view(torch.int32))
    again.close(save=False)


def test_disabled_or_off_the_main_thread_installs_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    before = signal.getsignal(signal.SIGTERM)
    pilot, _ = _pilot(tmp_path / "off", enabled=False)
    assert signal.getsignal(signal.SIGTERM) == before
    pilot.close(save=False)
    built: list[CheckpointPilot] = []
    thread = threading.Thread(target=lambda: built.append(_pilot(tmp_path / "thread")[0]))
    thread.start()
    thread.join()
    assert signal.getsignal(signal.SIGTERM) == before
    assert "preemption notices are not handled" in caplog.text
    built[0].close(save=False)


def test_stop_records_parse_and_count_in_the_mtbf_only_for_hangs(tmp_path: Path) -> None:
    ledger = FailureLedger(tmp_path / "ledger.jsonl")
    ledger.record_run_start(0, wall_time=1000.0)
    ledger.record_stop(step=50, cause="preemption", reason="SIGTERM", uptime_seconds=100.0)
    assert ledger.mtbf_seconds() is None  # uptime, but no failure
    ledger.record_run_start(50, wall_time=2000.0)
    ledger.record_stop(step=90, cause="hang", reason="stuck", uptime_seconds=60.0)
    assert ledger.last_kind() == "stop"
    assert ledger.mtbf_seconds() == pytest.approx(160.0)
    assert [(s.step, s.cause) for s in ledger.stops()] == [(50, "preemption"), (90, "hang")]
    lines = [json.loads(line) for line in ledger.path.read_text().splitlines()]
    assert lines[1]["kind"] == "stop" and lines[1]["cause"] == "preemption"


def _ddp_config(tmp: Path) -> Path:
    return ddp_policy(tmp, "preemption: {grace_seconds: 120}")


def _communicate(procs: list[subprocess.Popen[str]]) -> list[tuple[str, str]]:
    try:
        return [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()


@pytest.mark.crash
@pytest.mark.slow
def test_a_notice_to_one_rank_stops_both_at_the_same_step_and_both_resume_bit_exactly(
        tmp_path: Path) -> None:
    """Rank 0 alone gets SIGTERM in the middle of loop step 15 (pilot step 16); the notice
    travels with step 16's agreement, so both ranks save pilot step 17 and exit 75."""
    ref = tmp_path / "reference"
    ref.mkdir()
    procs = start_ddp_ranks(ref, _ddp_config(ref), 30)
    outs = _communicate(procs)
    assert [p.returncode for p in procs] == [0, 0], outs

    cfg = _ddp_config(tmp_path)
    procs = start_ddp_ranks(tmp_path, cfg, 30, ["--notice-at-step", "15"], [])
    outs = _communicate(procs)
    assert [p.returncode for p in procs] == [ExitStatus.PREEMPTED] * 2, outs
    assert "rank 0 got SIGTERM; saving an emergency organ of step 17" in outs[0][1]
    assert ("rank 1 got a preemption notice on another rank; saving an emergency organ of "
            "step 17") in outs[1][1]
    for r in (0, 1):
        stops = FailureLedger(tmp_path / "run" / f"ledger_rank_{r:05d}.jsonl").stops()
        assert [(s.step, s.cause) for s in stops] == [(17, "preemption")]

    procs = start_ddp_ranks(tmp_path, cfg, 30)
    outs = _communicate(procs)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("RESUMED 17" in out for out, _ in outs)
    for r in (0, 1):
        assert_states_bit_equal(safetensors.torch.load_file(tmp_path / f"final{r}"),
                                safetensors.torch.load_file(ref / f"final{r}"))
