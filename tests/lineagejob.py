"""One rank of tests/test_lineage.py's two-rank (gloo) abandoned-continuation test.

``--phase train``: 15 steps with an organ forced at steps 5, 10, 15, then every rank restores
step 10 (abandoning 15) and closes without saving; prints the model digest of every step.
``--phase restore``: restores the newest step and prints it, the model digest and the skipped
locations with their reasons.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

import torch
import torch.distributed as dist
from rankjob import digest

from ckptpilot import CheckpointPilot


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--phase", choices=("train", "restore"), required=True)
    a = p.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank,
                            world_size=2)
    a.run_dir.mkdir(parents=True, exist_ok=True)
    cfg = a.run_dir.parent / f"policy-{a.run_dir.name}.yaml"
    cfg.write_text(textwrap.dedent("""\
        scheduler: {base_interval: 1000, max_interval: 100000, young_daly: false,
                    weights: {loss: 1.0, grad: 0.0, system: 0.0}}
        validation: {load_test: none}
        retention: {auto: false}
        observability: {tensorboard: false, decision_log: false}
        """))
    torch.manual_seed(a.rank)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pilot = CheckpointPilot(cfg, model=model, optimizer=opt, run_dir=a.run_dir)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(7 + a.rank))
    if a.phase == "train":
        pilot.restore()
        digests = {}
        for step in range(1, 16):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            pilot.observe()
            if step % 5 == 0:
                pilot.save("organ", reason="test")
            digests[str(step)] = digest(model)
        pilot.flush()
        restored = pilot.restore(step=10)
        pilot.close(save=False)
        print(json.dumps({"restored": restored, "digests": digests}))
    else:
        step = pilot.restore()
        rec = pilot.last_recovery
        assert rec is not None
        print(json.dumps({"step": step, "digest": digest(model),
                          "skipped": [f"{s.location}: {s.reason}" for s in rec.skipped]}))
        pilot.close(save=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
