"""A small real training job with a learning-rate bump that makes its loss spike.

Run as a child process by ``tests/test_rollback.py``. The model, data and sampler are those
of ``tests/crashjob.py`` (dropout, BatchNorm, shuffled data through ``ResumableSampler``),
trained with SGD + momentum at a constant learning rate, except steps ``--bump-at`` and the
next one, whose learning rate is ``--bump`` times higher — unless the run has rolled back
already (the operator's bump is abandoned after a rollback; that is what makes the rerun
calm). At the end the model and optimizer state go to ``--final`` (safetensors + JSON).

Modes:
- ``pilot``: a ``CheckpointPilot`` with the policy ``--config`` (rollback enabled) does the
  rollback; ``--kill-after-rollback K`` SIGKILLs the process K steps after it rolled back.
  Prints ``ROLLBACK <to> <onset> <at> <skipped>`` for each rollback it made.
- ``reference``: no pilot; keeps an in-memory copy of the state after step ``--to``, trains
  through step ``--at``, then goes back to that copy itself and skips ``--skip`` batches: the
  same rollback decisions, made by hand.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import signal
import sys
from typing import Any

import numpy as np
import torch
from helpers import save_final_state, seeded_data

from ckptpilot import CheckpointPilot, ResumableSampler, load_policy
from ckptpilot.fit.job import Net

BATCH = 32
LR = 0.05


def _lr(step: int, rolled_back: bool, bump_at: int, bump: float) -> float:
    return LR * bump if not rolled_back and bump_at <= step <= bump_at + 1 else LR


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer,
           sampler: ResumableSampler) -> dict[str, Any]:
    return copy.deepcopy({
        "model": model.state_dict(), "opt": opt.state_dict(), "sampler": sampler.state_dict(),
        "torch_rng": torch.get_rng_state(), "numpy_rng": np.random.get_state(),
        "python_rng": random.getstate()})


def _load(state: dict[str, Any], model: torch.nn.Module, opt: torch.optim.Optimizer,
          sampler: ResumableSampler) -> None:
    state = copy.deepcopy(state)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    sampler.load_state_dict(state["sampler"])
    torch.set_rng_state(state["torch_rng"])
    np.random.set_state(state["numpy_rng"])
    random.setstate(state["python_rng"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["pilot", "reference"], required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--bump-at", type=int, required=True)
    p.add_argument("--bump", type=float, default=60.0)
    p.add_argument("--final", required=True)
    p.add_argument("--run-dir")
    p.add_argument("--config")
    p.add_argument("--kill-after-rollback", type=int)
    p.add_argument("--to", type=int)
    p.add_argument("--at", type=int)
    p.add_argument("--skip", type=int)
    a = p.parse_args()

    x, y = seeded_data()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sampler = ResumableSampler(len(x), seed=7, batch_size=BATCH)

    def train_step(step: int, rolled_back: bool) -> torch.Tensor:
        for group in opt.param_groups:
            group["lr"] = _lr(step, rolled_back, a.bump_at, a.bump)
        model.train()
        idx = sampler.take(BATCH)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        return loss

    if a.mode == "pilot":
        pilot = CheckpointPilot(load_policy(a.config, run_dir=a.run_dir), model=model,
                                optimizer=opt, data_state=sampler)
        step = pilot.restore()
        print(f"RESUMED {step} {len(pilot.rollbacks)}", flush=True)
        since_rollback = None
        while step < a.steps:
            step += 1
            loss = train_step(step, bool(pilot.rollbacks))
            decision = pilot.observe(loss)
            if decision.rollback_to is not None:
                event = pilot.rollbacks[-1]
                print(f"ROLLBACK {event.to_step} {event.onset} {event.step} "
                      f"{event.skipped_batches}", flush=True)
                step, since_rollback = pilot.step, 0
                continue
            if since_rollback is not None:
                since_rollback += 1
                if since_rollback == a.kill_after_rollback:
                    pilot.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
        pilot.close()
    else:
        saved: dict[str, Any] | None = None
        rolled_back = False
        step = 0
        while step < a.steps:
            step += 1
            train_step(step, rolled_back)
            if step == a.to and not rolled_back:
                saved = _state(model, opt, sampler)
            if step == a.at and not rolled_back:
                assert saved is not None
                _load(saved, model, opt, sampler)
                sampler.skip_batches(a.skip)
                step, rolled_back = a.to, True

    save_final_state(model, opt, a.final, sampler=sampler.state_dict(),
                     torch_rng=torch.get_rng_state().tolist())
    print("DONE", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
