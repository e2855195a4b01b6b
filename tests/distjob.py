"""One rank of the distributed-agreement test (tests/test_distributed.py).

Each rank trains its own small model on its own data shard, so the local loss and gradient
signals differ; rank 1 also has a GPU health provider that reports an uncorrected ECC error
after ``--ecc-after`` seconds (this machine has no GPU: the provider stands in for NVML).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from ckptpilot import CheckpointPilot, load_policy
from ckptpilot.probes.gpu import DeviceReading, GpuHealthProvider, GpuReading


class EccAfter(GpuHealthProvider):
    def __init__(self, seconds: float) -> None:
        self._at = time.monotonic() + seconds

    def read(self) -> GpuReading:
        errors = 1 if time.monotonic() >= self._at else 0
        return GpuReading(devices=(DeviceReading(index=0, ecc_volatile_uncorrected=errors),))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--ecc-after", type=float, default=1.5)
    a = p.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank,
                            world_size=2)
    torch.manual_seed(a.rank)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05 * (1 + a.rank))
    x = torch.randn(256, 8) * (1 + 3 * a.rank)
    y = x.sum(1, keepdim=True)
    provider = EccAfter(a.ecc_after) if a.rank == 1 else None
    pilot = CheckpointPilot(load_policy(a.config, run_dir=a.run_dir), model=model,
                            optimizer=opt, gpu_health=provider)
    pilot.restore()
    t0 = time.perf_counter()
    collective_wait = 0.0
    for step in range(a.steps):
        idx = torch.arange(step * 16, step * 16 + 16) % 256
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        s = time.perf_counter()
        pilot.observe(loss)
        collective_wait += time.perf_counter() - s
        time.sleep(0.01)
    pilot.close()
    print(json.dumps({"rank": a.rank, "seconds": time.perf_counter() - t0,
                      "observe_seconds": collective_wait,
                      "saves": [(r.step, r.level, r.reason) for r in pilot.saves]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
