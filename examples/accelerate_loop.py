"""A training loop driven by Hugging Face Accelerate, checkpointed by ckptpilot.

    python examples/accelerate_loop.py --steps 200 --run-dir runs/accelerate

The objects ``accelerator.prepare`` returns go to the pilot as they are: it finds the torch
optimizer inside Accelerate's wrapper itself. What Accelerate's ``register_for_checkpointing``
adds to ``save_state`` goes into ``pilot.extras`` here (an EMA of the weights below); the data
cursor is the pilot's ``data_state``. Kill it and rerun the same command: it resumes where it
stopped. Runs on the CPU; the data is synthetic, so nothing is downloaded.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ckptpilot import CheckpointPilot, ResumableSampler, load_policy

BATCH_SIZE = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps in total")
    parser.add_argument("--run-dir", default="runs/accelerate", help="checkpoints and logs")
    parser.add_argument("--config", default=None, help="policy YAML (default: the defaults)")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    x = torch.randn(1024, 16, generator=torch.Generator().manual_seed(1))
    y = (x[:, :8].sum(1) > 0).long() + 2 * (x[:, 8:].sum(1) > 0).long()  # 4 classes
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    ema = AveragedModel(accelerator.unwrap_model(model),
                        multi_avg_fn=get_ema_multi_avg_fn(0.99))
    sampler = ResumableSampler(len(x), seed=0, batch_size=BATCH_SIZE)

    with CheckpointPilot(load_policy(args.config), model=accelerator.unwrap_model(model),
                         optimizer=optimizer, lr_scheduler=scheduler, data_state=sampler,
                         run_dir=args.run_dir) as pilot:
        start = pilot.restore()
        if "ema" in pilot.extras:  # restore() replaced pilot.extras with the stored ones
            ema.load_state_dict(pilot.extras["ema"])
        for step in range(start + 1, args.steps + 1):
            idx = sampler.take(BATCH_SIZE)
            loss = F.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            ema.update_parameters(model)
            # Like accelerator.register_for_checkpointing(ema): a save now includes its state
            # (the dict refers to the live tensors; the pilot copies them when it saves).
            pilot.extras["ema"] = ema.state_dict()
            pilot.observe(loss, step=step, epoch=sampler.epoch)
    print(f"resumed from step {start}, trained {max(args.steps - start, 0)} step(s), "
          f"saved {len(pilot.saves)} checkpoint(s) in {args.run_dir}")


if __name__ == "__main__":
    main()
