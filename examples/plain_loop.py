"""A plain PyTorch training loop checkpointed by ckptpilot.

    python examples/plain_loop.py --steps 200 --run-dir runs/plain_loop

Kill it at any point and run the same command again: it resumes from the newest checkpoint
and trains on exactly as if it had never stopped (weights, optimizer, LR schedule, data
position and every RNG come back). Run it again once it has finished: it restores the last
step and has nothing left to train. The data is synthetic, so nothing is downloaded.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from ckptpilot import CheckpointPilot, ResumableSampler, load_policy

BATCH_SIZE = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps in total")
    parser.add_argument("--run-dir", default="runs/plain_loop", help="checkpoints and logs")
    parser.add_argument("--config", default=None, help="policy YAML (default: the defaults)")
    args = parser.parse_args()

    torch.manual_seed(0)  # a fresh run starts from the same weights; a resumed one restores them
    x = torch.randn(1024, 16, generator=torch.Generator().manual_seed(1))
    y = (x[:, :8].sum(1) > 0).long() + 2 * (x[:, 8:].sum(1) > 0).long()  # 4 classes
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    sampler = ResumableSampler(len(x), seed=0, batch_size=BATCH_SIZE)  # the data cursor

    with CheckpointPilot(load_policy(args.config), model=model, optimizer=optimizer,
                         lr_scheduler=scheduler, data_state=sampler,
                         run_dir=args.run_dir) as pilot:
        start = pilot.restore()  # the step to resume from: 0 for a fresh run
        for step in range(start + 1, args.steps + 1):
            idx = sampler.take(BATCH_SIZE)
            loss = F.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            pilot.observe(loss, step=step, epoch=sampler.epoch)  # may save, off this thread
        # Leaving the block saves the last step (close()), so a rerun has nothing to redo.
    print(f"resumed from step {start}, trained {max(args.steps - start, 0)} step(s), "
          f"saved {len(pilot.saves)} checkpoint(s) in {args.run_dir}")


if __name__ == "__main__":
    main()
