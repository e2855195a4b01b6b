"""Hugging Face ``transformers.Trainer`` checkpointed by ckptpilot: one callback.

    python examples/hf_trainer.py --steps 200 --run-dir runs/hf_trainer

A tiny randomly initialised GPT-2 learns to count on synthetic tokens (nothing is
downloaded). Kill it at any point and run the same command again: ``trainer.train()``
resumes from the newest checkpoint as if it had never stopped (weights, optimizer, LR
schedule, the Trainer's step and data position, every RNG). Run it again once it has
finished: it restores the last step and trains nothing. The Trainer's own checkpoints are
off (``save_strategy="no"``); the pilot's take their place. Runs on the CPU.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from ckptpilot.integrations.hf import CheckpointPilotCallback

VOCAB, LENGTH = 128, 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps in total")
    parser.add_argument("--run-dir", default="runs/hf_trainer", help="checkpoints and logs")
    parser.add_argument("--config", default=None, help="policy YAML (default: the defaults)")
    args = parser.parse_args()

    torch.manual_seed(0)  # a fresh run starts from the same weights; a resumed one restores them
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB,
                                       n_positions=LENGTH, bos_token_id=0, eos_token_id=0))
    starts = torch.randint(0, VOCAB, (1024, 1), generator=torch.Generator().manual_seed(1))
    sequences = (starts + torch.arange(LENGTH)) % VOCAB  # 17, 18, 19, ...: learnable
    train = [{"input_ids": s, "labels": s} for s in sequences]

    trainer = Trainer(
        model=model, train_dataset=train,
        callbacks=[CheckpointPilotCallback(args.config, run_dir=args.run_dir)],
        args=TrainingArguments(
            output_dir=os.path.join(args.run_dir, "trainer"), max_steps=args.steps,
            per_device_train_batch_size=16, learning_rate=1e-3, logging_steps=10,
            save_strategy="no", report_to="none", use_cpu=True))
    trainer.train()  # restores the newest checkpoint first: the same call starts and resumes


if __name__ == "__main__":
    main()
