"""Every script in ``examples/`` runs as written and, run again, resumes where it stopped.

Each example is a real subprocess, started the way its docstring tells a user to: ``python
examples/X.py --steps N --run-dir DIR``, and a ``torchrun_*.py`` under
``python -m torch.distributed.run --nproc-per-node 2 --standalone``. The examples are found by
glob, so a new one is tested without a change here; none is skipped: an example whose
framework does not import fails. The Hugging Face caches are put offline, so an example that
tries to download a model or data set fails too.

What the runs must leave, read from outside as a user would (``ckptpilot ls`` and the decision
log of each rank):

- after the first run, a ``valid`` checkpoint of step N for every rank, and a decision for
  each of the steps 1..N (the example calls ``observe()`` at every step);
- after a second run with the same arguments, nothing new: no checkpoint and no decision. A
  rerun that started from anything but step N would have trained (observed) steps and saved
  the last one at ``close()``, so this is "restored the last step, 0 steps retrained".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptpilot.cli import main as ckptpilot_main

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.py"))
STEPS = 6
TORCHRUN_RANKS = 2
TIMEOUT_SECONDS = 600  # a safety net against a hung rank, not a speed requirement


def world_size(script: Path) -> int:
    return TORCHRUN_RANKS if script.name.startswith("torchrun_") else 1


def run_example(script: Path, run_dir: Path, cwd: Path) -> None:
    launcher = [sys.executable]
    if world_size(script) > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(TORCHRUN_RANKS),
                     "--standalone"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*launcher, str(script), "--steps", str(STEPS), "--run-dir",
                           str(run_dir)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_SECONDS)
    assert proc.returncode == 0, (f"{script.name} exited with {proc.returncode}\n"
                                  f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}")


def checkpoints(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> list[tuple[str, ...]]:
    """(step, rank, tier, status) of every row ``ckptpilot ls`` lists (columns found by
    their header; all four come before the first column whose cells hold spaces)."""
    capsys.readouterr()
    assert ckptpilot_main(["ls", "--run-dir", str(run_dir)]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.split()[:2] == ["step", "rank"], f"ckptpilot ls listed no checkpoint: {header}"
    at = [header.split().index(name) for name in ("step", "rank", "tier", "status")]
    return [tuple(line.split()[i] for i in at) for line in lines]


def decided_steps(run_dir: Path, rank: int) -> list[int]:
    log = run_dir / f"decisions_rank_{rank:05d}.jsonl"
    return [json.loads(line)["step"] for line in log.read_text().splitlines()]


def test_the_glob_finds_the_examples_so_none_goes_untested() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"plain_loop.py", "torchrun_ddp.py", "accelerate_loop.py"} <= names, names


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_saves_its_last_step_and_a_rerun_restores_it_with_nothing_to_retrain(
        script: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    ranks = range(world_size(script))

    run_example(script, run_dir, cwd=tmp_path)
    rows = checkpoints(run_dir, capsys)
    last = {int(rank) for step, rank, tier, status in rows
            if int(step) == STEPS and tier == "remote" and status == "valid"}
    assert last == set(ranks), f"no valid checkpoint of step {STEPS} for every rank: {rows}"
    assert max(int(row[0]) for row in rows) == STEPS, rows
    for rank in ranks:
        assert decided_steps(run_dir, rank) == list(range(1, STEPS + 1)), \
            f"rank {rank} did not observe() each of the steps 1..{STEPS} once"

    run_example(script, run_dir, cwd=tmp_path)
    assert checkpoints(run_dir, capsys) == rows, "the rerun added a checkpoint: it trained"
    for rank in ranks:
        assert decided_steps(run_dir, rank) == list(range(1, STEPS + 1)), \
            f"rank {rank} observed steps again after restoring step {STEPS}"
