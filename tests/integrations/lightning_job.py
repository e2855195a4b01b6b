"""A tiny real ``lightning.Trainer`` fit, run as a child process by test_lightning.py.

A two-layer classifier with dropout, AdamW and a per-step cosine schedule, trained on
synthetic data drawn through a ``ResumableSampler`` (12 batches an epoch), validated at each
epoch's end (``val_loss``), checkpointed by ``CheckpointPilotCallback``. Every optimizer
step's loss is appended to ``--losses`` as ``step hex``; each validation prints
``VAL step hex``; the restored step is printed as ``RESUMED step``. At the end the model and
optimizer state go to ``--final`` (safetensors + JSON). ``--kill-after-step S`` SIGKILLs the
process once step S was observed and nothing is in flight.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers

from helpers import save_final_state, seeded_data

from ckptpilot import ResumableSampler
from ckptpilot.integrations.lightning import CheckpointPilotCallback

TRAIN = 384
BATCH = 32


class TinyClassifier(pl.LightningModule):
    def __init__(self, total_steps: int) -> None:
        super().__init__()
        self.total_steps = total_steps
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.3), torch.nn.Linear(32, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.total_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Recorder(pl.Callback):
    """Listed after the pilot's callback, so it sees each step after the pilot observed it."""

    def __init__(self, pilot_callback: CheckpointPilotCallback, losses: str,
                 kill_after_step: int | None) -> None:
        self.pilot_callback, self.losses, self.kill_after_step = (pilot_callback, losses,
                                                                  kill_after_step)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        print(f"RESUMED {trainer.global_step}", flush=True)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        with open(self.losses, "a") as f:
            f.write(f"{trainer.global_step} {outputs['loss'].item().hex()}\n")
        if trainer.global_step == self.kill_after_step:
            assert self.pilot_callback.pilot is not None
            self.pilot_callback.pilot.flush()  # "between saves": nothing in flight
            os.kill(os.getpid(), signal.SIGKILL)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            value = float(trainer.callback_metrics["val_loss"])
            print(f"VAL {trainer.global_step} {value.hex()}", flush=True)


def data() -> tuple[ResumableSampler, DataLoader[Any], DataLoader[Any]]:
    """Seed every RNG; the training cursor and the two loaders (each with its own generator,
    so that creating their iterators draws nothing from the global torch RNG)."""
    x, y = seeded_data()
    sampler = ResumableSampler(TRAIN, seed=7)
    train = DataLoader(TensorDataset(x[:TRAIN], y[:TRAIN]), batch_size=BATCH, sampler=sampler,
                       generator=torch.Generator().manual_seed(1))
    val = DataLoader(TensorDataset(x[TRAIN:], y[TRAIN:]), batch_size=64,
                     generator=torch.Generator().manual_seed(2))
    return sampler, train, val


def make_trainer(callbacks: list[pl.Callback], steps: int, **options: Any) -> pl.Trainer:
    """The Trainer every run here uses: CPU, quiet, no logger and no Lightning checkpoints."""
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=callbacks, **options)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--losses", required=True)
    p.add_argument("--final", required=True)
    p.add_argument("--kill-after-step", type=int)
    a = p.parse_args()

    sampler, train, val = data()
    model = TinyClassifier(a.steps)
    pilot_callback = CheckpointPilotCallback(a.config, run_dir=a.run_dir, data_state=sampler)
    recorder = Recorder(pilot_callback, a.losses, a.kill_after_step)
    fit = make_trainer([pilot_callback, recorder], a.steps)
    fit.fit(model, train, val)

    sched = fit.lr_scheduler_configs[0].scheduler
    save_final_state(model, fit.optimizers[0], a.final, sampler=sampler.state_dict(),
                     sched=sched.state_dict(), torch_rng=torch.get_rng_state().tolist(),
                     global_step=fit.global_step, epoch=fit.current_epoch)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
