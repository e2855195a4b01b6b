"""One rank of the two-rank (gloo) tests of the hang watchdog (tests/test_watchdog.py) and of
a preemption notice (tests/test_preemption.py).

Data-parallel training by hand: both ranks start from the same model, compute gradients on
their own data, average them with an all-reduce (the collective a dead peer hangs), step and
observe. ``--stop-at-step S`` makes this rank wait for its saves, then SIGSTOP itself in
the middle of step S, before the all-reduce: the other rank then waits in it forever, unless
its watchdog ends it.
``--notice-at-step S`` makes this rank send itself SIGTERM there instead: a notice the other
rank never gets. At the end the model and optimizer state go to ``--final`` (safetensors +
JSON).
"""

from __future__ import annotations

import argparse
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
from helpers import save_final_state

from ckptpilot import CheckpointPilot


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--final", required=True)
    p.add_argument("--stop-at-step", type=int)
    p.add_argument("--notice-at-step", type=int)
    a = p.parse_args()
    # gloo's own timeout is far above the watchdog's bound: the watchdog must be what ends it.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank,
                            world_size=2, timeout=timedelta(seconds=600))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(7 + a.rank)
    x = torch.randn(32, 8, generator=gen)
    y = x.sum(1, keepdim=True).sin()
    pilot = CheckpointPilot(a.config, model=model, optimizer=opt, run_dir=a.run_dir)
    start = pilot.restore()
    print(f"RESUMED {start}", flush=True)
    for step in range(start, a.steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if a.stop_at_step == step:
            pilot.flush()  # its saves so far durable: the restart's step does not race them
            print(f"STOPPING {step}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        if a.notice_at_step == step:
            os.kill(os.getpid(), signal.SIGTERM)
        for param in model.parameters():
            assert param.grad is not None
            dist.all_reduce(param.grad)
            param.grad /= 2
        opt.step()
        pilot.observe(loss)
    pilot.close()
    save_final_state(model, opt, a.final)
    print("DONE", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
