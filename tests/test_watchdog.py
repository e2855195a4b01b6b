"""The hang watchdog: its bound, its thread in this process, and two real gloo ranks of which
one is SIGSTOPped mid-step (tests/ddpjob.py): the other exits 77, the restart is bit-exact."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
from helpers import assert_states_bit_equal, ddp_policy, start_ddp_ranks

from ckptpilot.cli.report import build_report, read_records
from ckptpilot.guards.watchdog import HangWatchdog, hang_bound_seconds
from ckptpilot.lifecycle import RunLifecycle
from ckptpilot.policy import Policy, WatchdogPolicy
from ckptpilot.storage.heartbeat import HeartbeatWriter
from ckptpilot.storage.ledger import FailureLedger
from ckptpilot.vocab import ExitStatus

STEPS = 40
SAFETY_NET_SECONDS = 240  # how long a test waits for an exit the bound promises far sooner


def test_the_bound_is_a_multiple_of_the_median_step_never_below_the_floor() -> None:
    options = WatchdogPolicy(enabled=True, step_time_multiple=10, min_seconds=30)
    assert hang_bound_seconds([], options) == 30  # no step time yet
    assert hang_bound_seconds([1.0, 2.0, 100.0], options) == 30  # median 2 s: the floor wins
    assert hang_bound_seconds([5.0, 4.0, 6.0, 500.0], options) == 55  # median 5.5 s
    with pytest.raises(ValueError, match="step_time_multiple"):
        WatchdogPolicy(step_time_multiple=1)


class _Exits:
    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.done = threading.Event()

    def __call__(self, status: int) -> None:
        self.statuses.append(status)
        self.done.set()


def _watchdog(tmp_path: Path, min_seconds: float,
              drain: Callable[[float], bool] | None = None,
              ) -> tuple[HangWatchdog, _Exits, HeartbeatWriter, FailureLedger]:
    heartbeat = HeartbeatWriter(tmp_path / "hb.ring")
    ledger = FailureLedger(tmp_path / "ledger.jsonl")
    lifecycle = RunLifecycle(ledger, None)
    lifecycle.start(0)
    exits = _Exits()
    watchdog = HangWatchdog(WatchdogPolicy(enabled=True, step_time_multiple=2,
                                           min_seconds=min_seconds, drain_seconds=7),
                            rank=3, heartbeat=heartbeat, heartbeat_path=tmp_path / "hb.ring",
                            lifecycle=lifecycle, drain=drain, exit=exits)
    return watchdog, exits, heartbeat, ledger


def test_no_progress_logs_the_phase_records_a_hang_and_exits_77(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    watchdog, exits, heartbeat, ledger = _watchdog(tmp_path, min_seconds=0.3)
    try:
        heartbeat.write({"step": 7})
        watchdog.beat(7)
        watchdog.left_boundary()
        assert exits.done.wait(SAFETY_NET_SECONDS)
    finally:
        watchdog.close()
        heartbeat.close()
    assert exits.statuses == [ExitStatus.HANG] == [77]
    assert "HANG: rank 3: no step progress for" in caplog.text
    assert "stuck in training step 8 (forward, backward" in caplog.text
    assert "its newest heartbeat is of step 7" in caplog.text
    stop = ledger.stops()[-1]
    assert (stop.step, stop.cause) == (7, "hang") and "stuck in training step 8" in stop.reason
    assert ledger.last_kind() == "stop" and stop.uptime_seconds is not None
    assert heartbeat.flushed_seq == heartbeat.last_seq


def test_the_saves_in_flight_get_drain_seconds_before_the_exit(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The writer's threads are not stuck in the hang: a save taken before it may still
    become durable, so the exit waits for it, bounded; what it abandons is logged."""
    seen: list[tuple[float, list[int]]] = []

    def drain(seconds: float) -> bool:
        seen.append((seconds, list(exits.statuses)))
        return False  # one save still in flight when the time is up

    watchdog, exits, heartbeat, ledger = _watchdog(tmp_path, min_seconds=0.3, drain=drain)
    try:
        watchdog.beat(4)
        watchdog.left_boundary()
        assert exits.done.wait(SAFETY_NET_SECONDS)
    finally:
        watchdog.close()
        heartbeat.close()
    assert seen == [(7.0, [])]  # drain_seconds, and before the exit
    assert exits.statuses == [77]
    assert "saves still in flight after watchdog.drain_seconds=7 s are abandoned" in caplog.text
    assert [(s.step, s.cause) for s in ledger.stops()] == [(4, "hang")]


def test_nothing_fires_before_the_first_step_nor_while_suspended(tmp_path: Path) -> None:
    """A negative check that no speed can break: with correct code nothing can fire here."""
    watchdog, exits, heartbeat, ledger = _watchdog(tmp_path, min_seconds=0.1)
    try:
        time.sleep(0.5)  # not armed yet
        watchdog.beat(1)
        with watchdog.suspended():
            time.sleep(0.5)  # restore, back-pressure, flush: the pilot's own waits
        assert exits.statuses == []
        watchdog.beat(2)  # in time after the resume: progress (the suspension is no sample)
        assert exits.statuses == [] and ledger.stops() == []
    finally:
        watchdog.close()
        heartbeat.close()


# -- two real ranks ------------------------------------------------------------------------


def _config(tmp: Path) -> Path:
    # A floor far above any step of this job on a loaded machine: a safety net, not a race.
    return ddp_policy(tmp, "watchdog: {enabled: true, step_time_multiple: 50, min_seconds: 10}")


def _finish(procs: list[subprocess.Popen[str]]) -> list[tuple[str, str]]:
    try:
        outs = [p.communicate(timeout=SAFETY_NET_SECONDS) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    return outs


@pytest.mark.crash
@pytest.mark.slow
def test_a_stopped_rank_makes_the_other_exit_77_and_the_restart_is_bit_exact(
        tmp_path: Path) -> None:
    ref = tmp_path / "reference"
    ref.mkdir()
    _finish(start_ddp_ranks(ref, _config(ref), STEPS))

    cfg = _config(tmp_path)
    procs = start_ddp_ranks(tmp_path, cfg, STEPS, [], ["--stop-at-step", "25"])
    try:
        _, err0 = procs[0].communicate(timeout=SAFETY_NET_SECONDS)
        assert procs[0].returncode == ExitStatus.HANG == 77, err0
        assert procs[1].poll() is None  # still stopped: only the watchdog ended rank 0
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert "HANG: rank 0: no step progress for" in err0
    assert "stuck in training step 26 (forward, backward" in err0  # waiting in the all-reduce
    assert "its newest heartbeat is of step 25" in err0
    ledger = FailureLedger(tmp_path / "run" / "ledger_rank_00000.jsonl")
    assert [(s.step, s.cause) for s in ledger.stops()] == [(25, "hang")]

    # Rank 1 made its saves durable before it stopped (ddpjob.py), rank 0 drained its own
    # before the exit: both hold step 20, whatever the machine's speed.
    outs = _finish(start_ddp_ranks(tmp_path, cfg, STEPS))
    assert all("RESUMED 20" in out for out, _ in outs)
    for r in (0, 1):
        assert_states_bit_equal(safetensors.torch.load_file(tmp_path / f"final{r}"),
                                safetensors.torch.load_file(ref / f"final{r}"))
    report = build_report(read_records(Policy().with_run_dir(tmp_path / "run")))
    assert (report.hangs, report.preemptions, report.interruptions) == (1, 0, 0)
    assert report.steps_lost_to_failures == 5  # step 25 reached, 20 restored
    rank1 = FailureLedger(tmp_path / "run" / "ledger_rank_00001.jsonl")
    assert len(rank1.interruptions()) == 1 and rank1.stops() == []  # killed: a crash
