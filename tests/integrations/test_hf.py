"""CheckpointPilotCallback inside the real ``transformers.Trainer``: a tiny GPT-2 (dropout on)
trained in child processes (tests/integrations/hf_job.py), SIGKILLed twice and resumed by
rerunning the same script, against an uninterrupted run, bit for bit.

16 batches make an epoch and 2 batches an optimizer step (gradient accumulation), so an
epoch is 8 steps. The policy saves every 8 steps and the job evaluates every 10; each
evaluation reports ``eval_loss``, which saves the step if it was not saved (and restarts the
interval). Saves land at 8, 10, 18, 20, 28, 30, 38 and 40, so the two kills resume

- after step 9 from step 8, saved at the step boundary where the second epoch starts, and
- after step 22 from step 20, saved by the metric report after an evaluation, in the middle
  of the third epoch: the Trainer, counting its epochs from 0 again, must skip 8 batches and
  draw epoch 2's order at its epoch 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from ckptpilot import PolicyError, StateError, load_policy
from ckptpilot.cli.ops import Run
from ckptpilot.integrations.hf import CheckpointPilotCallback
from ckptpilot.retention.plan import BestPolicy, plan_retention
from ckptpilot.storage.metadata import CheckpointRow

pytestmark = [pytest.mark.integration, pytest.mark.crash]

JOB = Path(__file__).with_name("hf_job.py")
STEPS, EVAL_STEPS, ACCUMULATION = 40, 10, 2
KILLS = ((9, 8), (22, 20))  # (killed after step, resumes from step)
TIMEOUT_SECONDS = 600  # a safety net against a hung child, not a speed requirement
# No load test in a worker process: tests/test_loadcheck.py covers it; here it would only
# start one more process per child.
POLICY = """\
scheduler: {base_interval: 8, min_interval: 1, max_interval: 500, young_daly: false,
  weights: {loss: 1.0, grad: 0.0, system: 0.0}, loss: {slope_threshold: 1000.0}}
retention: {important_keep: 1, auto: false, best: {metric: eval_loss, mode: min, keep: 2}}
validation: {load_test: none}
observability: {tensorboard: false, decision_log: false}
"""


class Job:
    """One child run of hf_job.py, started at construction."""

    def __init__(self, tmp: Path, name: str, run: str, kill_after_step: int | None = None
                 ) -> None:
        self.losses, self.final = tmp / f"{name}.jsonl", tmp / f"{name}.safetensors"
        cmd = [sys.executable, str(JOB), "--run-dir", str(tmp / run), "--config",
               str(tmp / "policy.yaml"), "--steps", str(STEPS), "--eval-steps", str(EVAL_STEPS),
               "--accumulation", str(ACCUMULATION),
               "--losses", str(self.losses), "--final", str(self.final)]
        if kill_after_step is not None:
            cmd += ["--kill-after-step", str(kill_after_step)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)

    def wait(self) -> Job:
        self.stdout, self.stderr = self.proc.communicate(timeout=TIMEOUT_SECONDS)
        return self

    @property
    def summary(self) -> tuple[int, int]:
        """(step restored at train begin, steps trained) from the job's last line."""
        words = self.stdout.split()
        return int(words[words.index("RESUMED") + 1]), int(words[words.index("TRAINED") + 1])


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _rows(tmp: Path, run: str) -> list[CheckpointRow]:
    with Run(load_policy(tmp / "policy.yaml", run_dir=tmp / run)).store(read_only=True) as store:
        return store.rows()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Runs every child (two at a time, 1 thread each): the uninterrupted reference; the
    killed-twice chain (its three runs share a run dir and a losses file); and the finished
    reference run restarted."""
    tmp = tmp_path_factory.mktemp("hf")
    (tmp / "policy.yaml").write_text(POLICY)
    reference = Job(tmp, "reference", "reference")
    first = Job(tmp, "chain", "chain", kill_after_step=KILLS[0][0])
    reference.wait()
    first.wait()
    assert reference.proc.returncode == 0, reference.stderr[-6000:]
    rows_before_restart = _rows(tmp, "reference")
    second = Job(tmp, "chain", "chain", kill_after_step=KILLS[1][0])
    restart = Job(tmp, "restart", "reference").wait()
    second.wait()
    third = Job(tmp, "chain", "chain").wait()
    rows_after_restart = _rows(tmp, "reference")
    return {"tmp": tmp, "reference": reference, "chain": (first, second, third),
            "restart": restart, "rows": (rows_before_restart, rows_after_restart)}


def _assert_final_states_equal(a: Path, b: Path) -> None:
    ta, tb = safetensors.torch.load_file(a), safetensors.torch.load_file(b)
    assert ta.keys() == tb.keys()
    for key, x in ta.items():
        y = tb[key]
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), \
            f"{key} differs bit-wise"
    ja, jb = (json.loads(Path(f"{p}.json").read_text()) for p in (a, b))
    assert ja == jb  # LR schedule, torch RNG, global step, epoch


def test_a_trainer_killed_twice_resumes_bit_exactly_mid_epoch_and_at_an_epoch_start(
        jobs: dict[str, Any]) -> None:
    first, second, third = jobs["chain"]
    reference = jobs["reference"]
    for job in (first, second):
        assert job.proc.returncode == -signal.SIGKILL, job.stderr[-6000:]
    assert third.proc.returncode == 0, third.stderr[-6000:]
    assert third.summary == (KILLS[1][1], STEPS - KILLS[1][1])

    ref = {r["step"]: r for r in _lines(reference.losses) if "loss_observed" in r}
    assert sorted(ref) == list(range(1, STEPS + 1))
    # The pilot observes the loss the Trainer trains on and logs: with accumulation the sum
    # of the micro-batches' losses, each normalised by the step's token count.
    assert all(r["loss_observed"] == r["loss_logged"] for r in ref.values())
    chain = [r for r in _lines(first.losses) if "loss_observed" in r]
    # Run 1: steps 1-9; run 2: 9-22; run 3: 21-40 — the steps after each restore replayed.
    expected = [*range(1, KILLS[0][0] + 1), *range(KILLS[0][1] + 1, KILLS[1][0] + 1),
                *range(KILLS[1][1] + 1, STEPS + 1)]
    assert [r["step"] for r in chain] == expected
    mismatched = [(r["step"], r["loss_observed"], ref[r["step"]]["loss_observed"])
                  for r in chain if r["loss_observed"] != ref[r["step"]]["loss_observed"]]
    assert not mismatched, f"losses differ after a resume: {mismatched[:3]}"

    # The Trainer's own running-loss log matches too, except its first line after a resume,
    # which it averages from step 0 (module docstring of ckptpilot.integrations.hf): pinned,
    # so that the docstring is revisited if a transformers release changes it.
    for previous, r in zip([None, *chain], chain, strict=False):
        if previous is not None and r["step"] <= previous["step"]:  # first after a resume
            averaged = float.fromhex(r["loss_observed"]) / r["step"]
            assert float.fromhex(r["loss_logged"]) == averaged, r
        else:
            assert r["loss_logged"] == ref[r["step"]]["loss_logged"], r

    _assert_final_states_equal(reference.final, third.final)


def test_each_evaluation_reaches_its_checkpoint_row_and_best_n_keeps_the_best(
        jobs: dict[str, Any]) -> None:
    tmp = jobs["tmp"]
    evals = {r["step"]: float.fromhex(r["eval_loss"])
             for r in _lines(jobs["reference"].losses) if "eval_loss" in r}
    assert sorted(evals) == [10, 20, 30, 40]
    policy = load_policy(tmp / "policy.yaml", run_dir=tmp / "reference")
    rows = jobs["rows"][0]
    assert {r.step: (r.metric_name, r.metric_value) for r in rows if r.metric_name} == \
        {step: ("eval_loss", value) for step, value in evals.items()}

    plan = plan_retention(rows, policy.retention, best=BestPolicy("eval_loss", "min", 2))
    best_two = sorted(evals, key=lambda s: (evals[s], -s))[:2]
    kept_as_best = sorted(r.step for r, why in plan.keep if "best 2 by eval_loss" in why)
    assert kept_as_best == sorted(best_two)
    # important_keep 1: without best-N only the newest metric save (40) would be kept.
    removed = {r.step for r, _ in plan.remove}
    assert set(evals) - {40, *best_two} <= removed


def test_a_finished_run_restarted_restores_its_end_and_trains_no_step(
        jobs: dict[str, Any]) -> None:
    restart, reference = jobs["restart"], jobs["reference"]
    assert restart.proc.returncode == 0, restart.stderr[-6000:]
    assert restart.summary == (STEPS, 0)
    assert not restart.losses.exists() or not [
        r for r in _lines(restart.losses) if "loss_observed" in r]
    before, after = jobs["rows"]
    assert after == before, "the restart saved a checkpoint"
    _assert_final_states_equal(reference.final, restart.final)


# -- refused at train begin, before the pilot touches the run directory ------------------------

def _trainer(tmp_path: Path, callback: CheckpointPilotCallback, **args: Any) -> Trainer:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32,
                                       n_positions=8, bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 32, (64, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": x, "labels": x} for x in ids]
    return Trainer(model=model, train_dataset=data, callbacks=[callback], args=TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=4, per_device_train_batch_size=4,
        save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, **args))


def test_a_policy_with_instability_rollback_is_refused_when_the_callback_is_built(
        tmp_path: Path) -> None:
    cfg = tmp_path / "rollback.yaml"
    cfg.write_text("rollback: {enabled: true}\n")
    with pytest.raises(PolicyError, match=r"rollback\.enabled: .*cannot be rewound"):
        CheckpointPilotCallback(cfg, run_dir=tmp_path / "run")


@pytest.mark.parametrize(("args", "message"), [
    ({"accelerator_config": {"use_seedable_sampler": False}},
     r"sampler RandomSampler draws each epoch's order from the global RNG"),
    ({"gradient_accumulation_steps": 3},
     r"gradient_accumulation_steps=3 does not divide the 16 batches of an epoch"),
])
def test_a_data_position_that_cannot_be_resumed_exactly_is_refused_at_train_begin(
        tmp_path: Path, args: dict[str, Any], message: str) -> None:
    trainer = _trainer(tmp_path, CheckpointPilotCallback(run_dir=tmp_path / "run"), **args)
    with pytest.raises(StateError, match=message):
        trainer.train()
    assert not (tmp_path / "run").exists()
