"""Ray Train jobs on a real local Ray cluster, run as a child process by test_ray.py.

One ``ray.init`` (two CPUs, no dashboard, its temporary files under ``--ray-temp``) runs four
``TorchTrainer`` fits of the same two-worker gloo loop (``train_loop``), each worker with a
``RayTrainPilot``, in order:

1. ``reference``: uninterrupted, run directory ``ref``;
2. ``killed``: run directory ``run``, ``FailureConfig(max_failures=1)``; at ``--kill-at`` both
   workers wait for their pending saves, meet at a barrier, and rank 1 SIGKILLs itself, once
   (a marker file); Ray restarts both workers and they resume;
3. ``again``: a new trainer with the ``RunConfig`` of ``killed``: Ray hands it the last
   checkpoint of that job, the pilot restores the final step and trains nothing;
4. ``stranger``: the same, with an empty run directory: the pointer names another run and
   the fit fails (``max_failures=0``).

Each worker appends to ``events/<fit>/rank<r>.txt``: ``RESUMED step ray_step`` after
``restore()`` and ``LOSS step hex`` per step; at the end it writes its model and optimizer to
``final/<fit>_rank<r>.safetensors`` (+ JSON). The driver writes ``summary.json``: per fit the
path of Ray's result checkpoint, its metrics, or the error.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
# Ray's workers inherit the environment of the raylet, which inherits the driver's: the tree
# under test and tests/ (helpers) go first on their path too.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT), str(TESTS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # nothing leaves the machine
sys.path[:0] = [str(ROOT), str(TESTS)]

import ray  # noqa: E402
import ray.train  # noqa: E402
import ray.train.torch  # noqa: E402
import torch  # noqa: E402
from ray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402

STEPS = 30
BATCH = 16


def train_loop(config: dict[str, Any]) -> None:
    from helpers import save_final_state

    from ckptpilot.integrations.ray import RayTrainPilot

    rank = ray.train.get_context().get_world_rank()
    events = Path(config["events"]) / f"rank{rank}.txt"
    events.parent.mkdir(parents=True, exist_ok=True)

    def log(line: str) -> None:
        with events.open("a") as f:
            f.write(line + "\n")

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.2),
                              torch.nn.Linear(32, 1))
    model = ray.train.torch.prepare_model(net)  # DDP over the job's gloo group
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    torch.manual_seed(100 + rank)  # each rank its own dropout masks
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(rank))
    y = x.sum(1, keepdim=True)
    marker = Path(config["marker"])
    with RayTrainPilot(config["policy"], model=net, optimizer=opt, lr_scheduler=sched,
                       run_dir=config["run_dir"]) as pilot:
        start = pilot.restore()
        log(f"RESUMED {start} {pilot.ray_checkpoint_step}")
        for step in range(start + 1, STEPS + 1):
            idx = torch.arange((step - 1) * BATCH, step * BATCH) % len(x)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            sched.step()
            pilot.observe(loss)
            log(f"LOSS {step} {loss.item().hex()}")
            if step == config["kill_at"] and not marker.exists():
                pilot.pilot.flush()  # "between saves": every rank's saves are valid
                torch.distributed.barrier()
                if rank == 1:
                    marker.touch()
                    os.kill(os.getpid(), signal.SIGKILL)
    final = Path(config["final"])
    final.mkdir(parents=True, exist_ok=True)
    save_final_state(net, opt, str(final / f"rank{rank}.safetensors"),
                     sched=sched.state_dict(), torch_rng=torch.get_rng_state().tolist())


def fit(work: Path, policy: str, name: str, ray_run: str, run_dir: str, *, kill_at: int = 0,
        max_failures: int = 0) -> dict[str, Any]:
    """One fit: Ray's run ``ray_run`` (its checkpoints under ``ray_storage/``), the pilot's
    run directory ``run_dir``."""
    trainer = ray.train.torch.TorchTrainer(
        train_loop,
        train_loop_config={"policy": policy, "run_dir": str(work / run_dir),
                           "events": str(work / "events" / name),
                           "final": str(work / "final" / name), "kill_at": kill_at,
                           "marker": str(work / f"killed_{name}")},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(name=ray_run, storage_path=str(work / "ray_storage"),
                             failure_config=FailureConfig(max_failures=max_failures)))
    try:
        result = trainer.fit()
    except Exception as e:  # the fit's failure is what the test looks at
        return {"error": f"{type(e).__name__}: {e}"}
    checkpoint = result.checkpoint
    return {"checkpoint": None if checkpoint is None else checkpoint.path,
            "metrics": {k: v for k, v in result.metrics.items() if isinstance(v, int | float)}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", required=True)
    p.add_argument("--policy", required=True)
    p.add_argument("--kill-at", type=int, required=True)
    p.add_argument("--ray-temp", required=True, help="Ray's temporary directory (short: sockets)")
    a = p.parse_args()
    work = Path(a.work)
    summary: dict[str, Any] = {}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=a.ray_temp)
    try:
        summary["reference"] = fit(work, a.policy, "reference", "ref", "ref")
        summary["killed"] = fit(work, a.policy, "killed", "run", "run", kill_at=a.kill_at,
                                max_failures=1)
        summary["again"] = fit(work, a.policy, "again", "run", "run")
        summary["stranger"] = fit(work, a.policy, "stranger", "run", "other")
    finally:
        ray.shutdown()
        (work / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
