"""One rank of the two-rank (gloo) extra-signal test in tests/test_signal_registry.py.

Each rank trains its own tiny model and reports its real loss, except at the steps given by
``--spike STEP:LOSS`` (repeatable), where it reports LOSS instead: a bad batch on this rank
only. The policy (``--config``) adds the signals of ``tests/ceiling_signal.py``; the decision
log shows what the ranks agreed. Prints the saves as JSON.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from ckptpilot import CheckpointPilot, load_policy


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=70)
    p.add_argument("--spike", action="append", default=[])
    a = p.parse_args()
    spikes = {int(step): float(loss) for step, loss in (s.split(":") for s in a.spike)}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank,
                            world_size=2)
    torch.manual_seed(a.rank)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 4)
    y = x.sum(1, keepdim=True)
    pilot = CheckpointPilot(load_policy(a.config, run_dir=a.run_dir), model=model,
                            optimizer=opt)
    pilot.restore()
    for step in range(1, a.steps + 1):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        pilot.observe(spikes.get(step, loss.item()))
    pilot.close(save=False)
    print(json.dumps({"rank": a.rank, "saves": [(r.step, r.reason) for r in pilot.saves]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
