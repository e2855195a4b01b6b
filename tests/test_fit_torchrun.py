"""`ckptpilot fit --launcher torchrun`: the incident campaign against real torchrun jobs.

Three representative incidents (a rank SIGKILLed between saves, one killed mid-write, one
whose newest checkpoint was bit-flipped) each run as a real `torchrun --max-restarts 1` job
of two gloo ranks, checked through the JSON document, the table and the exit code; then the
same campaign against a reference with one flipped bit must fail. The whole campaign runs by
hand (docs/operations/fit-torchrun.md).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from ckptpilot.cli import main
from ckptpilot.fit.campaign import agreed_step
from ckptpilot.fit.incident import QUIET_STEP, Damage
from ckptpilot.fit.incidents import INCIDENTS

SUBSET = ("rank-killed", "kill-write", "bitflip-newest")

# Saves exactly every 10 steps (no signal can fire): the 40-step jobs save at 10, 20, 30, 40;
# the ranks stop at the quiet point after step 24 holding 10 and 20.
FAST_POLICY = """\
scheduler: {base_interval: 10, min_interval: 1, max_interval: 500, young_daly: false,
            weights: {loss: 1.0, grad: 0.0, system: 0.0}, loss: {slope_threshold: 1000.0}}
validation: {load_test: none}
observability: {tensorboard: false, decision_log: false}
"""


def fit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptpilot", "fit", "--launcher", "torchrun",
                           "--nproc", "2", *args], capture_output=True, text=True, timeout=1500)


@pytest.fixture(scope="module")
def campaign(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("campaign")
    (tmp / "policy.yaml").write_text(FAST_POLICY)
    proc = fit("--config", str(tmp / "policy.yaml"), "--work-dir", str(tmp / "work"),
               "--only", ",".join(SUBSET), "--json", str(tmp / "campaign.json"))
    document = json.loads((tmp / "campaign.json").read_text())
    return {"proc": proc, "document": document, "tmp": tmp,
            "rows": {row["scenario"]: row for row in document["scenarios"]}}


@pytest.mark.slow
@pytest.mark.crash
def test_every_restart_resumes_the_agreed_step_bit_exactly(campaign: dict[str, Any]) -> None:
    proc, document = campaign["proc"], campaign["document"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (document["launcher"], document["nproc"], document["passed"]) == ("torchrun", 2, True)
    assert (document["incident_types"], document["incidents_passed"]) == (3, 3)
    got = {name: (row["result"], row["restarts"], row["recovered_step"], row["source"],
                  row["bit_exact"]) for name, row in campaign["rows"].items()}
    assert got == {
        "rank-killed": ("passed", 1, 20, "remote", True),  # killed after step 24
        "kill-write": ("passed", 1, 20, "remote", True),  # killed in the write of step 30
        "bitflip-newest": ("passed", 1, 10, "remote", True),  # rank 1's step 20 damaged
    }
    rows = campaign["rows"]
    assert rows["kill-write"]["detail"].startswith("rank 1 died in the write of step 30; "
                                                   "restart 1: all 2 ranks restored step 20")
    assert rows["bitflip-newest"]["detail"].startswith(
        "rank 1: one bit flipped in step_00000020_rank_00001/")
    assert rows["rank-killed"]["steps_lost"] == QUIET_STEP - 20


@pytest.mark.slow
@pytest.mark.crash
def test_the_table_has_one_row_per_incident_with_its_restarts(
        campaign: dict[str, Any]) -> None:
    lines = campaign["proc"].stdout.splitlines()
    assert lines[0].split()[:3] == ["incident", "fault", "restarts"]
    rows = {ln.split()[0]: ln.split() for ln in lines[2:2 + len(SUBSET)]}
    assert set(rows) == set(SUBSET)
    assert all(r[-1] == "passed" and r[-2] == "yes" for r in rows.values())
    assert lines[2 + len(SUBSET) + 1].startswith("3 passed, 0 failed, 0 skipped")
    work = campaign["tmp"] / "work"
    assert json.loads((work / "fit.json").read_text()) == campaign["document"]
    assert not (work / "kill-write").exists(), "a passed incident's directory is removed"


@pytest.mark.slow
@pytest.mark.crash
def test_a_reference_one_bit_off_fails_the_campaign(campaign: dict[str, Any]) -> None:
    tmp = campaign["tmp"]
    tampered = tmp / "tampered"
    shutil.copytree(tmp / "work" / "reference-torchrun" / "out" / "uninterrupted", tampered)
    final = tampered / "final_rank00001.safetensors"
    tensors = safetensors.torch.load_file(final)
    bits = tensors["model/body.0.weight"].view(torch.int32)
    bits.view(-1)[0] ^= 1
    safetensors.torch.save_file(tensors, final)

    proc = fit("--config", str(tmp / "policy.yaml"), "--work-dir", str(tmp / "work2"),
               "--only", "rank-killed", "--reference", str(tampered), "--json")
    document = json.loads(proc.stdout)
    assert proc.returncode == 1
    (row,) = document["scenarios"]
    assert (row["result"], row["recovered_step"], row["bit_exact"]) == ("failed", 20, False)
    assert row["detail"] == ("the job is not bit-exact with the uninterrupted one: rank 1: "
                             "final model/body.0.weight differs from the reference")
    assert document["passed"] is False
    assert Path(row["run_dir"]).is_dir(), "a failed incident keeps its directory"


def _quiet(*saves: tuple[int, str]) -> dict[str, Any]:
    return {"saves": [{"step": s, "tier": t, "status": "valid"} for s, t in saves]}


def test_the_agreed_step_is_the_newest_every_rank_still_holds_on_a_lasting_tier() -> None:
    quiet = {0: _quiet((10, "remote"), (20, "remote"), (24, "memory")),
             1: _quiet((10, "remote"), (20, "remote"), (20, "peer"))}
    assert agreed_step(quiet, Damage(""), frozenset()) == 20  # memory dies with the process
    lost_remote = Damage("", lost=frozenset({(1, 20, "remote")}))
    assert agreed_step(quiet, lost_remote, frozenset()) == 20  # rank 1's peer copy is left
    assert agreed_step(quiet, lost_remote, frozenset({"peer"})) == 10
    assert agreed_step(quiet, Damage("", lost=frozenset({(0, 20, "remote")})),
                       frozenset()) == 10
    assert agreed_step({0: _quiet(), 1: _quiet((10, "remote"))}, Damage(""), frozenset()) == 0


def test_list_prints_at_least_21_incident_types(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", "--launcher", "torchrun", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == [i.name for i in INCIDENTS]
    assert len({i.name for i in INCIDENTS}) == len(INCIDENTS) >= 21


@pytest.mark.parametrize(("args", "message"), [
    (["--only", "rank-killed,kill-everything"],
     "unknown incident 'kill-everything'; valid incidents: rank-killed, "),
    (["--nproc", "1"], "--nproc 1: a torchrun campaign needs at least 2 ranks"),
])
def test_bad_campaign_input_is_a_one_line_error_with_exit_2(
        args: list[str], message: str, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    assert main(["fit", "--launcher", "torchrun", "--work-dir", str(tmp_path / "w"),
                 *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"ckptpilot fit: error: {message}")
    assert not (tmp_path / "w").exists()


def test_the_starts_of_a_job_launched_again_are_numbered_on(tmp_path: Path) -> None:
    from ckptpilot.fit.campaign import Starts
    from ckptpilot.fit.harness import ChildRun

    runs = []
    for label, attempts in (("job", (0, 1)), ("relaunched", (0,))):
        out = tmp_path / label
        out.mkdir()
        for rank in range(2):
            (out / f"events_rank{rank:05d}.jsonl").write_text("".join(
                json.dumps({"event": "restored", "attempt": a, "step": 10 * a + rank}) + "\n"
                for a in attempts) + '{"event": "torn')
        runs.append(ChildRun(label, out, 0, 1.0, 2))
    starts = Starts(runs)
    assert starts.last == 2
    assert starts.launch_of == {0: 0, 1: 0, 2: 1}
    assert {r: e["step"] for r, e in starts.every("restored", 1).items()} == {0: 10, 1: 11}
    assert {r: e["step"] for r, e in starts.every("restored", 2).items()} == {0: 0, 1: 1}
