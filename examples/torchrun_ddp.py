"""Data-parallel training under torchrun (DDP), checkpointed by ckptpilot.

    torchrun --nproc-per-node 2 examples/torchrun_ddp.py --steps 200 --run-dir runs/ddp

NCCL when every local rank has a GPU of its own, gloo on CPU otherwise. Each rank runs its
own pilot on the shared run directory; rank and world size come from torch.distributed. The
ranks agree on every save, and restore() makes them all resume from the same step: kill the
job (or one rank: torchrun then stops the others) and rerun the same command. The data is
synthetic, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ckptpilot import CheckpointPilot, ResumableSampler, load_policy

BATCH_SIZE = 16  # per rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps in total")
    parser.add_argument("--run-dir", default="runs/ddp", help="checkpoints and logs")
    parser.add_argument("--config", default=None, help="policy YAML (default: the defaults)")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)  # before the process group: NCCL binds to it
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    x = torch.randn(1024, 16, generator=torch.Generator().manual_seed(1))
    y = (x[:, :8].sum(1) > 0).long() + 2 * (x[:, 8:].sum(1) > 0).long()  # 4 classes
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4)).to(device)
    ddp_model = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    # One order for the whole job, one global batch per step, each rank training on its
    # slice (as DistributedSampler does): the cursor is the same on every rank.
    sampler = ResumableSampler(len(x), seed=0, batch_size=BATCH_SIZE * world)

    # The pilot gets the module inside DDP, so checkpoints hold plain parameter names.
    with CheckpointPilot(load_policy(args.config), model=model, optimizer=optimizer,
                         lr_scheduler=scheduler, data_state=sampler,
                         run_dir=args.run_dir) as pilot:
        start = pilot.restore()  # the same step on every rank; 0 for a fresh run
        for step in range(start + 1, args.steps + 1):
            idx = sampler.take(BATCH_SIZE * world)[rank::world]
            loss = F.cross_entropy(ddp_model(x[idx].to(device)), y[idx].to(device))
            optimizer.zero_grad()
            loss.backward()  # DDP averages the gradients across ranks here
            optimizer.step()
            scheduler.step()
            pilot.observe(loss, step=step, epoch=sampler.epoch)
    print(f"rank {rank}/{world} ({device}): resumed from step {start}, trained "
          f"{max(args.steps - start, 0)} step(s), saved {len(pilot.saves)} checkpoint(s)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
