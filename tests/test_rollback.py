"""Instability rollback: a loss spike sends the run back to the checkpoint before it.

The crash tests train a real child (``tests/rollbackjob.py``) whose learning-rate bump makes
the loss spike; the in-process tests feed the pilot a loss sequence with a spike in it, on a
real model, real archives and a real metadata store, to pin the rules one at a time.
"""

from __future__ import annotations

import io
import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers import assert_states_bit_equal

from ckptpilot import CheckpointPilot, PolicyError, ResumableSampler, RollbackLimitError
from ckptpilot.cli import ops
from ckptpilot.policy import load_policy
from ckptpilot.storage.metadata import MetadataStore

JOB = Path(__file__).with_name("rollbackjob.py")
STEPS, BUMP_AT = 60, 30

POLICY = """\
scheduler: {{base_interval: {interval}, min_interval: 1, max_interval: 500, young_daly: false,
  weights: {{loss: 1.0, grad: 0.0, system: 0.0}}, loss: {{slope_threshold: 1000.0}},
  organ_every: 100}}
rollback: {{enabled: {enabled}, baseline_window: 20, patience: 3, max_rollbacks: {max_rollbacks},
  skip_batches: {skip}}}
observability: {{tensorboard: false, decision_log: true}}
retention: {{auto: false}}
"""


def _config(tmp: Path, *, interval: int = 5, enabled: bool = True, max_rollbacks: int = 3,
            skip: str = "null") -> Path:
    cfg = tmp / "policy.yaml"
    cfg.write_text(POLICY.format(interval=interval, enabled=str(enabled).lower(),
                                 max_rollbacks=max_rollbacks, skip=skip))
    return cfg


def _job(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(JOB), "--steps", str(STEPS), "--bump-at",
                           str(BUMP_AT), *args], capture_output=True, text=True, timeout=300)


def _tagged(proc: subprocess.CompletedProcess[str], tag: str) -> list[list[int]]:
    return [[int(v) for v in line.split()[1:]] for line in proc.stdout.splitlines()
            if line.startswith(tag + " ")]



@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The uninterrupted pilot run, and a run without a pilot making its rollback by hand."""
    tmp = tmp_path_factory.mktemp("rollback")
    run = _job("--mode", "pilot", "--final", str(tmp / "pilot.st"), "--run-dir",
               str(tmp / "run"), "--config", str(_config(tmp)))
    assert run.returncode == 0, run.stderr
    [event] = _tagged(run, "ROLLBACK")
    to, _onset, at, skipped = event
    hand = _job("--mode", "reference", "--final", str(tmp / "hand.st"), "--to", str(to),
                "--at", str(at), "--skip", str(skipped))
    assert hand.returncode == 0, hand.stderr
    return {"event": event, "run_dir": tmp / "run", "pilot": tmp / "pilot.st",
            "hand": tmp / "hand.st"}


@pytest.mark.crash
def test_a_spike_rolls_back_to_the_checkpoint_before_it_bit_exactly(
        reference: dict[str, object]) -> None:
    # The bump applies to the updates of steps 30-31, so the loss of step 31 is the first
    # high one (onset); the checkpoint of step 30 holds the weights that produced it, so the
    # run goes back to the save before it (25), skipping the 8 batches of steps 26-33.
    assert reference["event"] == [25, BUMP_AT + 1, BUMP_AT + 3, 8]
    pilot = safetensors.torch.load_file(reference["pilot"])
    assert_states_bit_equal(pilot, safetensors.torch.load_file(reference["hand"]))
    assert json.loads(Path(f"{reference['pilot']}.json").read_text())["sampler"] == \
        json.loads(Path(f"{reference['hand']}.json").read_text())["sampler"]
    run_dir = Path(reference["run_dir"])  # type: ignore[arg-type]
    decisions = [json.loads(line) for line in
                 (run_dir / "decisions_rank_00000.jsonl").read_text().splitlines()]
    rolled = [d for d in decisions if "rollback_to" in d]
    assert [(d["step"], d["spike_onset"], d["rollback_to"], d["save"]) for d in rolled] == [
        (BUMP_AT + 3, BUMP_AT + 1, 25, False)]
    ledger = [json.loads(line) for line in
              (run_dir / "ledger_rank_00000.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in ledger] == ["run_start", "rollback", "run_end"]


@pytest.mark.crash
@pytest.mark.parametrize("kill_after", [2, 7], ids=["before-the-next-save", "after-it"])
def test_killed_after_a_rollback_resumes_on_the_same_data_bit_exactly(
        reference: dict[str, object], tmp_path: Path, kill_after: int) -> None:
    """Killed 2 steps after the rollback, the run resumes from the rollback point (25), whose
    cursor predates the skip, and must skip again; killed 7 steps after, from the save of
    step 30 of the new timeline (never the abandoned one of the same step)."""
    cfg, final = _config(tmp_path), tmp_path / "final.st"
    args = ("--mode", "pilot", "--final", str(final), "--run-dir", str(tmp_path / "run"),
            "--config", str(cfg))
    killed = _job(*args, "--kill-after-rollback", str(kill_after))
    assert killed.returncode == -9, killed.stderr
    assert _tagged(killed, "ROLLBACK") == [reference["event"]]
    resumed = _job(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert _tagged(resumed, "RESUMED") == [[25 if kill_after == 2 else 30, 1]]
    assert _tagged(resumed, "ROLLBACK") == []  # the bump is gone, the data skipped: calm
    assert_states_bit_equal(safetensors.torch.load_file(final),
                      safetensors.torch.load_file(reference["hand"]))


# -- in-process: the rules ---------------------------------------------------------------


def _pilot(tmp_path: Path, cfg: Path, *, sampler: bool = True) -> tuple[CheckpointPilot,
                                                                      ResumableSampler]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = ResumableSampler(64, seed=1, batch_size=4)
    pilot = CheckpointPilot(load_policy(cfg, run_dir=tmp_path / "run"), model=model,
                            optimizer=opt, data_state=data if sampler else None)
    return pilot, data


def _losses(spike_at: int, n: int, high: float = 9.0) -> list[float]:
    """A calm loss near 1 with a spike of three high steps from ``spike_at`` on."""
    return [high if spike_at <= s < spike_at + 3 else 1.0 + 0.01 * math.sin(s)
            for s in range(1, n + 1)]


def _train(pilot: CheckpointPilot, data: ResumableSampler, losses: list[float]):  # type: ignore[no-untyped-def]
    """One real optimizer step and one cursor batch per loss; returns the decisions."""
    params = [p for g in pilot.components.optimizer.param_groups for p in g["params"]]
    decisions = []
    for loss in losses:
        data.take(4)
        pilot.components.optimizer.zero_grad()
        pilot.components.model(torch.ones(1, 4)).sum().backward()
        pilot.components.optimizer.step()
        decisions.append(pilot.observe(loss))
        assert all(p.grad is not None for p in params)
    return decisions


def test_without_rollback_the_save_before_a_spike_is_kept_for_good_and_survives_prune(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = _config(tmp_path, enabled=False)
    pilot, data = _pilot(tmp_path, cfg)
    with caplog.at_level(logging.WARNING, logger="ckptpilot"):
        decisions = _train(pilot, data, _losses(42, 60))
    pilot.close()
    [spiked] = [d for d in decisions if d.spike_onset is not None]
    assert (spiked.step, spiked.spike_onset, spiked.rollback_to) == (44, 42, None)
    assert "rollback is off" in caplog.text
    with MetadataStore(tmp_path / "run" / "metadata.sqlite") as store:
        classes = {r.step: r.retention_class.value for r in store.rows(tier="remote")}
    # Suspect from step 41 (its weights gave the onset's loss): 40 is the rollback point,
    # kept for good; the saves within baseline_window (20) steps before 41 are kept too.
    assert {s: c for s, c in classes.items() if c != "routine"} == {
        25: "important", 30: "important", 35: "important", 40: "critical"}
    assert classes[45] == classes[20] == "routine"
    policy = load_policy(cfg, run_dir=tmp_path / "run")
    assert ops.prune(policy, dry_run=False, out=io.StringIO()) == 0
    with MetadataStore(tmp_path / "run" / "metadata.sqlite") as store:
        valid = sorted(r.step for r in store.rows(tier="remote", status="valid"))
    assert 40 in valid and 20 not in valid


def test_a_non_finite_loss_rolls_back_at_once_and_skips_the_batches_since(
        tmp_path: Path) -> None:
    pilot, data = _pilot(tmp_path, _config(tmp_path, skip="6"))
    losses = [*_losses(1000, 23), math.nan]
    decisions = _train(pilot, data, losses)
    assert (decisions[-1].spike_onset, decisions[-1].rollback_to) == (24, 20)
    assert not decisions[-1].save
    assert pilot.step == 20
    cursor = data.state_dict()  # the cursor of step 20, 6 batches on: (20 + 6) x 4 of 64
    assert (cursor["epoch"], cursor["position"]) == divmod(4 * (20 + 6), 64)
    assert [(e.to_step, e.onset, e.step, e.skipped_batches) for e in pilot.rollbacks] == [
        (20, 24, 24, 6)]
    follow = _train(pilot, data, [1.0])
    assert follow[0].step == 21
    pilot.close()


def test_rollbacks_beyond_the_limit_stop_the_run_with_a_clear_error(tmp_path: Path) -> None:
    pilot, data = _pilot(tmp_path, _config(tmp_path, max_rollbacks=1))
    first = _train(pilot, data, _losses(42, 44))
    assert first[-1].rollback_to == 40
    with pytest.raises(RollbackLimitError, match=r"step 44 .* rollback 2 within 1000 steps"):
        _train(pilot, data, [1.0, 9.0, 9.0, 9.0])  # step 41 calm, 42-44 high again
    assert len(pilot.rollbacks) == 1
    pilot.close()


def test_a_spike_before_any_checkpoint_is_reported_and_training_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pilot, data = _pilot(tmp_path, _config(tmp_path, interval=100))
    with caplog.at_level(logging.WARNING, logger="ckptpilot"):
        decisions = _train(pilot, data, _losses(12, 20))
    spiked = decisions[13]
    assert (spiked.step, spiked.spike_onset, spiked.rollback_to) == (14, 12, None)
    assert "no checkpoint before step 11 loads" in spiked.reason
    assert "training goes on without a rollback" in caplog.text
    assert pilot.step == 20 and pilot.rollbacks == ()
    pilot.close()


def test_rollback_needs_a_data_state_that_can_skip(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"rollback\.skip_batches: .*no data_state"):
        _pilot(tmp_path, _config(tmp_path), sampler=False)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    with pytest.raises(PolicyError, match=r"batch_size=B"):
        CheckpointPilot(load_policy(_config(tmp_path), run_dir=tmp_path / "run"), model=model,
                        data_state=ResumableSampler(64))
    pilot, _ = _pilot(tmp_path, _config(tmp_path, skip="0"), sampler=False)
    pilot.close()


def test_the_example_config_enables_rollback_and_starts_a_pilot(tmp_path: Path) -> None:
    policy = load_policy(Path(__file__).parents[1] / "configs" / "rollback.yaml",
                         run_dir=tmp_path / "run")
    assert policy.rollback.enabled and policy.rollback.skip_batches is None
    assert policy.rollback.max_rollbacks == 3 and policy.scheduler.base_interval == 50
    model = torch.nn.Linear(4, 2)
    with CheckpointPilot(policy, model=model, data_state=ResumableSampler(8, batch_size=2)) as p:
        assert p.rollbacks == ()
