"""A LightningModule trained by ``lightning.Trainer``, checkpointed by ckptpilot.

    python examples/lightning_module.py --steps 200 --run-dir runs/lightning

Kill it at any point and run the same command again: it resumes from the newest checkpoint
and trains on exactly as if it had never stopped (weights, optimizer, LR schedule, Lightning's
step and epoch counters, the batch position within the epoch and every RNG come back). Each
validation's ``val_loss`` is attached to a checkpoint (``ckptpilot ls`` shows it). Run it
again once it has finished: it restores the last step and has nothing left to train. The data
is synthetic, so nothing is downloaded. Needs ``pip install 'ckptpilot[lightning]'``.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ckptpilot import ResumableSampler, load_policy
from ckptpilot.integrations.lightning import CheckpointPilotCallback

BATCH_SIZE = 32


class Classifier(pl.LightningModule):
    def __init__(self, total_steps: int) -> None:
        super().__init__()
        self.total_steps = total_steps
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.1), torch.nn.Linear(64, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler,
                                                         "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps in total")
    parser.add_argument("--run-dir", default="runs/lightning", help="checkpoints and logs")
    parser.add_argument("--config", default=None, help="policy YAML (default: the defaults)")
    args = parser.parse_args()

    torch.manual_seed(0)  # a fresh run starts from the same weights; a resumed one restores them
    x = torch.randn(1280, 16, generator=torch.Generator().manual_seed(1))
    y = (x[:, :8].sum(1) > 0).long() + 2 * (x[:, 8:].sum(1) > 0).long()  # 4 classes
    sampler = ResumableSampler(1024, seed=0)  # the data cursor the pilot saves and restores
    # Each loader has its own generator: creating an iterator then leaves the global RNG alone.
    train = DataLoader(TensorDataset(x[:1024], y[:1024]), batch_size=BATCH_SIZE,
                       sampler=sampler, generator=torch.Generator().manual_seed(2))
    val = DataLoader(TensorDataset(x[1024:], y[1024:]), batch_size=128,
                     generator=torch.Generator().manual_seed(3))

    checkpoints = CheckpointPilotCallback(load_policy(args.config), run_dir=args.run_dir,
                                          data_state=sampler, monitor="val_loss")
    trainer = pl.Trainer(max_steps=args.steps, callbacks=[checkpoints],
                         enable_checkpointing=False,  # the pilot does the checkpointing
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Classifier(args.steps), train, val)  # restores, trains, saves the last step

    pilot = checkpoints.pilot
    assert pilot is not None and pilot.last_recovery is not None
    start = pilot.last_recovery.step  # 0 for a fresh run
    print(f"resumed from step {start}, trained {trainer.global_step - start} step(s), "
          f"saved {len(pilot.saves)} checkpoint(s) in {args.run_dir}")


if __name__ == "__main__":
    main()
