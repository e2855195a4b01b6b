"""examples/slurm/train.sbatch: it parses as bash, asks Slurm for SIGUSR1 90 s before the time
limit and for requeueing, and its policy validates. Run with stand-ins for ``srun`` and
``scontrol`` (this machine has no Slurm) and for ``python``, the script must hand every rank
its torch.distributed environment, requeue itself after a stop and not after a clean finish,
and stop requeueing after ``MAX_REQUEUES``."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from ckptpilot import load_policy
from ckptpilot.policy import Policy

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
POLICY = ROOT / "examples" / "slurm" / "policy.yaml"

# The stand-ins: srun runs its command as task 5 (local 1, 4 per node) and exits with
# $FAKE_SRUN_STATUS; scontrol names two hosts and records a requeue; python records what a
# rank would start with.
FAKE_SRUN = """#!/bin/bash
echo "$@" > "$FAKE_LOG/srun"
SLURM_PROCID=5 SLURM_LOCALID=1 SLURM_NTASKS_PER_NODE=4 "${@: -3}"
exit "$FAKE_SRUN_STATUS"
"""
FAKE_SCONTROL = """#!/bin/bash
case "$1" in
  show) printf 'gpu-a17\\ngpu-a18\\n' ;;
  requeue) echo "$2" >> "$FAKE_LOG/requeue" ;;
  *) exit 2 ;;
esac
"""
FAKE_PYTHON = """#!/bin/bash
{ echo "$@"
  env | grep -E '^(RANK|LOCAL_RANK|LOCAL_WORLD_SIZE|WORLD_SIZE|MASTER_ADDR|MASTER_PORT)=' | sort
} > "$FAKE_LOG/python"
"""


def test_the_sbatch_script_parses_and_asks_for_the_signal_and_the_requeue() -> None:
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    directives = [line.split(None, 1)[1] for line in SBATCH.read_text().splitlines()
                  if line.startswith("#SBATCH")]
    assert "--signal=USR1@90" in directives
    assert "--requeue" in directives


def test_the_example_policy_validates(tmp_path: Path) -> None:
    data = yaml.safe_load(POLICY.read_text())
    assert data["preemption"] == {"enabled": True, "signals": ["SIGUSR1"], "grace_seconds": 75}
    # The preemption keys come with the preemption feature; until the schema has them, the
    # rest of the file is validated alone.
    if "preemption" not in Policy.model_fields:
        del data["preemption"]
    validated = tmp_path / "policy.yaml"
    validated.write_text(yaml.safe_dump(data))
    policy = load_policy(validated, run_dir="/shared/runs/x")
    assert policy.tiers.remote.url == "/shared/runs/x/checkpoints"


def _submit(tmp: Path, srun_status: int, restarts: int) -> tuple[int, Path]:
    bin_dir, log = tmp / "bin", tmp / "log"
    bin_dir.mkdir()
    log.mkdir()
    for name, text in {"srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL,
                       "python": FAKE_PYTHON}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp),
           "FAKE_LOG": str(log), "FAKE_SRUN_STATUS": str(srun_status),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "ddp", "SLURM_JOB_NODELIST": "gpu-a[17-18]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "8",
           "SLURM_RESTART_COUNT": str(restarts)}
    proc = subprocess.run(["bash", str(SBATCH)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    return proc.returncode, log


def test_every_rank_gets_its_distributed_environment(tmp_path: Path) -> None:
    status, log = _submit(tmp_path, 0, 0)
    assert status == 0
    assert "--kill-on-bad-exit=0" in (log / "srun").read_text()
    argv, *environment = (log / "python").read_text().splitlines()
    assert argv == (f"examples/torchrun_ddp.py --steps 100000 --run-dir {ROOT}/runs/ddp "
                    "--config examples/slurm/policy.yaml")
    assert environment == ["LOCAL_RANK=1", "LOCAL_WORLD_SIZE=4", "MASTER_ADDR=gpu-a17",
                           "MASTER_PORT=29500", "RANK=5", "WORLD_SIZE=8"]
    assert (ROOT / "examples" / "torchrun_ddp.py").exists()


@pytest.mark.parametrize(("srun_status", "restarts", "requeued"), [
    (0, 0, False),    # finished: done
    (1, 0, True),     # stopped after SIGUSR1, or failed: run again
    (137, 19, True),
    (137, 20, False),  # MAX_REQUEUES reached
])
def test_the_job_requeues_itself_unless_it_finished(tmp_path: Path, srun_status: int,
                                                    restarts: int, requeued: bool) -> None:
    status, log = _submit(tmp_path, srun_status, restarts)
    assert status == srun_status
    requeues = (log / "requeue").read_text().split() if (log / "requeue").exists() else []
    assert requeues == (["4242"] if requeued else [])
