"""The cluster simulator: its optimum, its accounting, the parity rule, and its command."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from ckptpilot.cli import main
from ckptpilot.simulate import (
    ClusterSpec,
    Failure,
    FailureKind,
    FailureModel,
    ProfileError,
    TierCosts,
    ettr_ceiling,
    peer_restore_kind,
    simulate,
)
from ckptpilot.simulate.costs import load_profile, tier_costs
from ckptpilot.simulate.schedules import SaveLevel, Schedule, adaptive_schedule, fixed_schedule

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "bench" / "profiles" / "e2e-2026-12-02.json"
TRACE = ROOT / "tests" / "fixtures" / "traces" / "demo.csv"


def costs(**changes: float) -> TierCosts:
    """A 64-GPU job (8 nodes, parity groups of 4) with round, instantaneous costs."""
    base = TierCosts(gpus=64, nodes=8, bytes_per_gpu=1e9, pulse_stall_seconds=1.0,
                     peer_durable_seconds=1.0, organ_stall_seconds=1.0,
                     remote_durable_seconds=1.0, peer_restore_seconds=0.0,
                     peer_rebuild_seconds=0.0, remote_restore_seconds=0.0,
                     relaunch_seconds=0.0, node_replace_seconds=0.0, hang_detect_seconds=0.0,
                     preemption_notice_seconds=0.0, group_size=4)
    return dataclasses.replace(base, **changes)


def accounted(out) -> float:
    return (out.productive_seconds + out.overhead_seconds
            + sum(out.lost_work_seconds.values()) + sum(out.down_seconds.values()))


def test_simulated_optimum_interval_is_young_dalys_for_exponential_failures() -> None:
    save, mtbf = 10.0, 3600.0
    crashes = FailureModel(mtbf_seconds=mtbf, mix={FailureKind.PROCESS_CRASH: 1.0})
    c = costs(organ_stall_seconds=save, remote_durable_seconds=save)
    young = math.sqrt(2 * save * mtbf)
    intervals = [young * f for f in (0.4, 0.55, 0.7, 0.85, 1.0, 1.2, 1.45, 1.75, 2.1, 2.5)]
    waste = {}
    for tau in intervals:
        outs = [simulate(c, fixed_schedule(tau, peer=False), crashes,
                         horizon_seconds=500 * mtbf, peer=False, seed=s) for s in range(2)]
        waste[tau] = sum(1 - o.ettr for o in outs) / len(outs)
    best = min(waste, key=waste.__getitem__)
    assert abs(best / young - 1) <= 0.25, (best, young, waste)
    # The model's waste near the optimum is the first-order formula's: C/τ + τ/(2M).
    assert waste[young] == pytest.approx(save / young + young / (2 * mtbf), rel=0.1)


@pytest.mark.parametrize("peer", [False, True])
@pytest.mark.parametrize("distribution", ["exponential", "weibull"])
def test_productive_overhead_lost_and_down_add_up_to_the_wall_time(
        peer: bool, distribution: str) -> None:
    profile = load_profile(PROFILE)
    c = tier_costs(profile, ClusterSpec(), 1024)
    model = FailureModel(mtbf_seconds=1200, distribution=distribution,
                         second_node_fraction=0.3)
    for seed in range(3):
        out = simulate(c, fixed_schedule(60, peer=peer, organ_every=3), model,
                       horizon_seconds=2 * 86400, peer=peer, seed=seed)
        assert sum(out.failures.values()) > 50
        assert accounted(out) == pytest.approx(out.wall_seconds, rel=1e-9)
        assert 0 < out.ettr < 1
        assert set(out.failures) == {k.value for k in FailureKind}


def test_no_policy_passes_the_ceiling_and_free_checkpoints_reach_it() -> None:
    mixed = FailureModel(mtbf_seconds=1800)
    cluster = costs(relaunch_seconds=60.0, hang_detect_seconds=600.0, node_replace_seconds=20.0)
    # 60 s relaunch + 0.1 x 600 s hang detection + 0.7 x 20 s node swap per 1800 s.
    assert ettr_ceiling(cluster, mixed) == pytest.approx(1800 / (1800 + 60 + 60 + 14))
    # Free saves every 10 s of a job that hangs 0.5 s after its save at every 1800 s of
    # training: half a second of work and the relaunch and the detection are lost.
    up = 1800.5
    hangs = FailureModel(mtbf_seconds=up, mix={FailureKind.HANG: 1.0})
    cycle = up + 60 + 600
    free = dataclasses.replace(cluster, organ_stall_seconds=0.0, remote_durable_seconds=0.0)
    out = simulate(free, fixed_schedule(10.0, peer=False),
                   [Failure(k * cycle + up, FailureKind.HANG) for k in range(50)],
                   horizon_seconds=50 * cycle, peer=False)
    assert out.lost_work_seconds == {"hang": pytest.approx(50 * 0.5)}
    assert out.ettr == pytest.approx(ettr_ceiling(free, hangs) - 0.5 / cycle)
    real = tier_costs(load_profile(PROFILE), ClusterSpec(), 4096)
    for schedule in (fixed_schedule(20, peer=True), fixed_schedule(200, peer=False)):
        out = simulate(real, schedule, mixed, horizon_seconds=86400, peer=True, seed=3)
        assert out.ettr < ettr_ceiling(real, mixed)


def test_same_seed_same_outcome_and_another_seed_another() -> None:
    c = tier_costs(load_profile(PROFILE), ClusterSpec(), 4096)
    model = FailureModel(mtbf_seconds=1800)
    run = [simulate(c, fixed_schedule(30, peer=True), model, horizon_seconds=86400,
                    peer=True, seed=s) for s in (7, 7, 8)]
    assert run[0] == run[1]
    assert run[0] != run[2]


def test_a_crash_rolls_back_to_the_last_durable_save() -> None:
    c = costs(relaunch_seconds=5.0)
    out = simulate(c, fixed_schedule(100, peer=False), [Failure(250.0, FailureKind.HANG)],
                   horizon_seconds=1000, peer=False)
    # Saves at progress 100 (wall 100-101) and 200 (wall 201-202); the hang at wall 250
    # throws away 48 s of training; 5 s down; the rest of the 1000 s trains and saves.
    assert out.lost_work_seconds == {"hang": pytest.approx(48.0)}
    assert out.down_seconds == {"hang": pytest.approx(5.0)}
    assert out.restores == {"remote": 1}
    assert accounted(out) == pytest.approx(1000.0)


def test_parity_group_rule_one_loss_rebuilt_two_in_a_group_fall_back() -> None:
    assert peer_restore_kind([], 4) == "intact"
    assert peer_restore_kind([1], 4) == "rebuild"
    assert peer_restore_kind([1, 5], 4) == "rebuild"  # groups {0..3} and {4..7}: one each
    assert peer_restore_kind([1, 2], 4) is None
    assert peer_restore_kind([3, 3], 4) == "rebuild"  # the same node twice is one loss


def _pulses_then_organ() -> Schedule:
    # Pulses (peers) every 10 s of training; one organ at 1000 s, i.e. remote holds nothing
    # newer than the start for the failures below.
    return Schedule("t", (10.0,) * 99 + (10.0,), (SaveLevel.PULSE,) * 99 + (SaveLevel.ORGAN,))


# Pulses every 10 s of training with a 1 s stall: saves at wall 10, 21, 32, 43, 54; at wall
# 60 the newest pulse holds progress 50 and the job has trained to 55.
@pytest.mark.parametrize(("failures", "sources", "lost"), [
    ([Failure(60, FailureKind.NODE_LOSS, (1,))], {"peer_rebuild": 1}, 5.0),
    ([Failure(60, FailureKind.NODE_LOSS, (1, 6))], {"peer_rebuild": 1}, 5.0),
    ([Failure(60, FailureKind.NODE_LOSS, (1, 2))], {"none": 1}, 55.0),
    ([Failure(60, FailureKind.PROCESS_CRASH)], {"peer": 1}, 5.0),
    # A second loss in node 1's group before the next pulse: the peers' newest checkpoint
    # lost two holders in one group, so the job goes back to the remote tier (the start).
    ([Failure(60, FailureKind.NODE_LOSS, (1,)), Failure(62, FailureKind.NODE_LOSS, (2,))],
     {"peer_rebuild": 1, "none": 1}, 5.0 + 52.0),
    # ... but a second loss in the other group is rebuilt too.
    ([Failure(60, FailureKind.NODE_LOSS, (1,)), Failure(62, FailureKind.NODE_LOSS, (5,))],
     {"peer_rebuild": 2}, 5.0 + 2.0),
])
def test_lost_nodes_decide_between_peers_and_remote(failures, sources, lost) -> None:
    out = simulate(costs(), _pulses_then_organ(), failures, horizon_seconds=200, peer=True)
    assert dict(out.restores) == sources
    assert sum(out.lost_work_seconds.values()) == pytest.approx(lost)
    assert accounted(out) == pytest.approx(200.0)


def test_a_preemption_with_enough_notice_loses_no_work() -> None:
    c = costs(preemption_notice_seconds=30.0, relaunch_seconds=10.0)
    out = simulate(c, fixed_schedule(100, peer=True, organ_every=5),
                   [Failure(250.0, FailureKind.PREEMPTION, (3,))], horizon_seconds=1000,
                   peer=True)
    assert out.lost_work_seconds == {"preemption": 0.0}
    assert out.restores == {"peer_rebuild": 1}


def test_tier_costs_scale_with_bytes_and_share_the_remote_bandwidth() -> None:
    profile = load_profile(PROFILE)
    cluster = ClusterSpec(state_bytes_total=1e12, remote_bytes_per_second=100e9)
    small, large = tier_costs(profile, cluster, 64), tier_costs(profile, cluster, 4096)
    assert small.pulse_stall_seconds == pytest.approx(
        profile.pulse_stall_seconds * (1e12 / 64) / profile.state_bytes)
    assert large.pulse_stall_seconds == pytest.approx(small.pulse_stall_seconds / 64)
    # The whole state crosses the remote store's shared 100 GB/s at any size: >= 10 s.
    assert large.remote_restore_seconds >= 10.0
    assert large.remote_durable_seconds >= 10.0 + large.organ_stall_seconds - 1e-9


def test_adaptive_schedule_replays_the_real_scheduler_under_the_daly_cap() -> None:
    from ckptpilot.simulate.command import read_trace

    losses, grads = read_trace(TRACE)
    sched = adaptive_schedule(losses, grads, step_seconds=2.0, save_seconds=0.02,
                              mtbf_seconds=1800, peer=True)
    # Daly's τ for 0.02 s and 1800 s is ~8.5 s = 4 steps, below min_interval (10 steps).
    assert max(sched.gaps_seconds) <= 20.0
    assert SaveLevel.ORGAN in sched.levels and SaveLevel.PULSE in sched.levels
    assert len(sched.gaps_seconds) >= 40


def _write(tmp_path: Path, doc: object) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_bad_profile_is_refused_naming_the_key(tmp_path: Path) -> None:
    doc = json.loads(PROFILE.read_text())
    del doc["peer_restore_seconds"]
    with pytest.raises(ProfileError, match="peer_restore_seconds"):
        load_profile(_write(tmp_path, doc))
    doc = json.loads(PROFILE.read_text()) | {"pulse_stall_seconds": -1}
    with pytest.raises(ProfileError, match="pulse_stall_seconds"):
        load_profile(_write(tmp_path, doc))
    with pytest.raises(ProfileError, match="format"):
        load_profile(_write(tmp_path, {"state_bytes": 1}))


def test_cli_exit_codes_and_messages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--profile", str(PROFILE), "--trace", str(TRACE), "--gpus", "64,1024",
            "--mtbf-minutes", "30,120", "--days", "0.5", "--seeds", "1",
            "--plot-dir", str(tmp_path / "plots")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| 1024 | 30.0 | adaptive + peers |" in out
    for name in ("ettr_by_gpus_mtbf30.png", "ettr_by_mtbf_1024.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["simulate", "--profile", str(PROFILE), "--trace", str(TRACE), "--gpus", "64",
                 "--mtbf-minutes", "60", "--days", "0.5", "--seeds", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["label"] for r in rows} >= {"young_daly", "adaptive + peers"}
    bad = _write(tmp_path, {"format": "ckptpilot-cost-profile/1"})
    done = subprocess.run([sys.executable, "-m", "ckptpilot", "simulate", "--profile", str(bad),
                           "--trace", str(TRACE)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2
    assert "state_bytes" in done.stderr and "Traceback" not in done.stderr
    assert main(["simulate", "--profile", str(PROFILE),
                 "--trace", str(tmp_path / "missing.csv")]) == 2
    assert "missing.csv" in capsys.readouterr().err


def test_replay_of_a_run_predicts_its_lost_steps_and_overhead_from_per_event_costs() -> None:
    from ckptpilot.simulate.validate import RunCosts, replay

    run = RunCosts(gpus=1, step_seconds=0.01, stall_seconds=0.1, background_seconds=0.0,
                   interval_steps=100, down_seconds=5.0)
    # A save every 1 s of training (100 steps) costs 0.1 s: saves end at 1.1, 2.2, 3.3 s of
    # the life; a kill at 3.0 s loses 0.8 s = 80 steps. The second life is killed 0.5 s
    # after its restore (50 steps, no save yet), the last one trains 2.25 s (two saves).
    p = replay(run, [3.0, 0.5], 2.25)
    assert p.lost_steps == pytest.approx(80 + 50)
    assert p.saves == 4
    assert p.overhead_seconds == pytest.approx(0.4)


def _report(**figures: object):
    from ckptpilot.cli.report import GoodputReport

    blank = {f.name: None for f in dataclasses.fields(GoodputReport)}
    return GoodputReport(**{**blank, **figures})


def test_report_predict_prints_the_model_beside_the_measured_run() -> None:
    from ckptpilot.simulate.validate import PredictionError, format_prediction

    run = _report(step_seconds=0.01, up_seconds=120.0, stall_seconds=2.0, saves=20,
                  steps_trained=10_000, steps_productive=9_700, steps_lost_to_failures=300,
                  background_seconds=4.0, down_after_failures_seconds=30.0, interruptions=3,
                  mtbf_seconds=40.0, wall_seconds=150.0, goodput_fraction=0.65)
    text = format_prediction(run, seeds=20)
    assert "measured    predicted" in text
    assert "steps lost                  300" in text
    assert "mean step 0.0118 s" in text  # (120 - 2) s over 10,000 steps
    with pytest.raises(PredictionError, match="MTBF unknown"):
        format_prediction(dataclasses.replace(run, mtbf_seconds=None))
    with pytest.raises(PredictionError, match="a save"):
        format_prediction(dataclasses.replace(run, saves=0))


def test_report_refuses_json_with_predict(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["report", "--json", "--predict"])
    assert done.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_save_is_durable_when_the_slowest_rank_holds_it() -> None:
    from types import SimpleNamespace

    from ckptpilot.simulate.validate import durable_lag_seconds, first_save_extra_seconds

    def row(step: int, rank: int, created: float, write: float | None) -> SimpleNamespace:
        return SimpleNamespace(step=step, rank=rank, created_at=created, seconds_snapshot=0.1,
                               seconds_write=write, seconds_validate=0.2)

    rows = [row(100, 0, 10.0, 0.5), row(100, 1, 10.2, 1.5),  # rank 1 ends at 12.0: 2.0 s
            row(200, 0, 20.0, 0.7), row(200, 1, 20.0, 0.3),  # rank 0 ends at 21.0: 1.0 s
            row(300, 0, 30.0, None)]                          # untimed: left out
    # The first save (step 100) is a life's first; the lag is that of the others.
    assert durable_lag_seconds(rows) == pytest.approx(1.0)
    assert first_save_extra_seconds(rows) == pytest.approx(1.0)
    assert durable_lag_seconds([]) is None
