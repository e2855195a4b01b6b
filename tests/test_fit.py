"""`ckptpilot fit`: the fault-injection suite as a command (ckptpilot/fit/).

The fast subset CI runs: a real `ckptpilot fit` process with real training children that kill
and damage themselves, checked through its JSON rows, fit.json and TensorBoard. The whole
suite (`ckptpilot fit --with-peers`) runs by hand; see docs/operations/fit.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptpilot.cli import main
from ckptpilot.fit.report import Outcome, Result, exit_code
from ckptpilot.fit.scenarios import SCENARIOS

SUBSET = ("kill-write", "bitflip-newest", "stale-copy", "metadata-lost")

# Saves exactly every 10 steps (no signal can fire, no Young-Daly cap): the job saves at 10,
# 20, 30 ... The in-save kills hit the save of step 30 and the shared job is killed after
# step 34. Hash-only validation keeps each child to a few seconds.
FAST_POLICY = """\
scheduler: {base_interval: 10, min_interval: 1, max_interval: 500, young_daly: false,
            weights: {loss: 1.0, grad: 0.0, system: 0.0}, loss: {slope_threshold: 1000.0}}
validation: {load_test: none}
observability: {tensorboard: false, decision_log: false}
"""


def fit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptpilot", "fit", *args],
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def subset(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("fit")
    cfg = tmp / "policy.yaml"
    cfg.write_text(FAST_POLICY)
    work = tmp / "work"
    args = ["--config", str(cfg), "--work-dir", str(work), "--json"]
    for name in SUBSET:
        args += ["--scenario", name]
    proc = fit(*args)
    document = json.loads(proc.stdout)
    return {"proc": proc, "document": document, "work": work,
            "rows": {row["scenario"]: row for row in document["scenarios"]}}


def row(subset: dict[str, Any], name: str) -> dict[str, Any]:
    found = subset["rows"][name]
    assert found["result"] == "passed", found["detail"]
    return found


@pytest.mark.crash
def test_killed_while_writing_restores_the_save_before_it_bit_exactly(
        subset: dict[str, Any]) -> None:
    got = row(subset, "kill-write")
    assert (got["recovered_step"], got["source"], got["bit_exact"]) == (20, "remote", True)
    assert got["steps_lost"] >= 10  # training went on while the save of step 30 was written
    assert got["detail"].startswith("killed in the write of step 30; restored step 20")


@pytest.mark.crash
def test_a_bit_flipped_newest_checkpoint_is_skipped_and_the_one_before_restores(
        subset: dict[str, Any]) -> None:
    got = row(subset, "bitflip-newest")
    assert (got["recovered_step"], got["source"], got["bit_exact"]) == (20, "remote", True)
    assert got["steps_lost"] == 14
    assert "one bit flipped in " in got["detail"]


@pytest.mark.crash
def test_a_stale_copy_under_the_newest_name_is_not_taken_for_the_newer_step(
        subset: dict[str, Any]) -> None:
    got = row(subset, "stale-copy")
    assert (got["recovered_step"], got["source"], got["bit_exact"]) == (20, "remote", True)


@pytest.mark.crash
def test_a_deleted_metadata_database_still_restores_the_newest_save(
        subset: dict[str, Any]) -> None:
    got = row(subset, "metadata-lost")
    assert (got["recovered_step"], got["source"], got["bit_exact"]) == (30, "remote", True)
    assert got["steps_lost"] == 4


@pytest.mark.crash
def test_the_run_exits_0_and_writes_the_table_to_fit_json_and_tensorboard(
        subset: dict[str, Any]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc, document, work = subset["proc"], subset["document"], subset["work"]
    assert proc.returncode == 0, proc.stderr
    assert document["passed"] is True
    assert [r["scenario"] for r in document["scenarios"]] == list(SUBSET)
    assert json.loads((work / "fit.json").read_text()) == document
    progress = [ln for ln in proc.stderr.splitlines() if ln.startswith("[")]
    assert [ln.split("]", 1)[1].split()[:2] for ln in progress] == [
        [name, "passed"] for name in SUBSET]
    events = EventAccumulator(str(work / "tensorboard"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    for name in SUBSET:
        assert {f"fit/{name}/passed", f"fit/{name}/seconds", f"fit/{name}/steps_lost"} <= scalars
        assert events.Scalars(f"fit/{name}/passed")[0].value == 1.0
    assert not (work / "kill-write").exists(), "a passed scenario's directory is removed"


def test_an_unknown_scenario_is_a_one_line_error_with_exit_2(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", "--scenario", "kill-write", "--scenario", "kill-everything"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("ckptpilot fit: error: unknown scenario 'kill-everything'; valid "
                          "scenarios: kill-capture, kill-write, ")


def test_a_bad_policy_is_the_policy_error_with_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "policy.yaml"
    cfg.write_text("scheduler: {base_intervall: 5}\n")
    assert main(["fit", "--config", str(cfg), "--work-dir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ckptpilot fit: error: scheduler.base_intervall: unknown key; did you "
                          "mean 'base_interval'?")
    assert not (tmp_path / "w").exists()


def test_a_work_dir_fit_did_not_make_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "precious.txt").write_text("mine")
    assert main(["fit", "--work-dir", str(tmp_path)]) == 2
    assert "is not empty and was not made by `ckptpilot fit`" in capsys.readouterr().err
    assert (tmp_path / "precious.txt").read_text() == "mine"


def test_list_prints_every_scenario_with_what_passing_means(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == [s.name for s in SCENARIOS]
    assert len(SCENARIOS) >= 14
    assert any(ln.startswith("peer-lost-2 ") and "[peer tier]" in ln for ln in lines)


def test_peer_scenarios_are_skipped_without_a_peer_tier_and_the_run_exits_0(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work = tmp_path / "w"
    code = main(["fit", "--scenario", "peer-lost-1", "--scenario", "slow-peer",
                 "--work-dir", str(work), "--json"])
    document = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [(r["scenario"], r["result"]) for r in document["scenarios"]] == [
        ("peer-lost-1", "skipped"), ("slow-peer", "skipped")]
    assert document["scenarios"][0]["detail"].startswith("no peer tier in the policy")
    assert json.loads((work / "fit.json").read_text()) == document


def test_the_exit_code_is_1_only_when_a_scenario_that_ran_failed() -> None:
    def outcome(result: Result) -> Outcome:
        return Outcome(scenario="x", fault="f", result=result, detail="", seconds=1.0)

    assert exit_code([outcome(Result.PASSED), outcome(Result.SKIPPED)]) == 0
    assert exit_code([outcome(Result.PASSED), outcome(Result.FAILED)]) == 1
    assert exit_code([]) == 0
