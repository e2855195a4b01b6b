"""A tiny GPT-2 trained through the real ``transformers.Trainer`` with CheckpointPilotCallback,
run as a child process by tests/integrations/test_hf.py.

Randomly initialised (dropout on), synthetic tokens, 16 batches per epoch, ``--accumulation``
batches per optimizer step, an evaluation every ``--eval-steps`` steps. Each training step
appends a JSON line to ``--losses``: the step, the loss the pilot observed and the loss the
Trainer logged; each evaluation one with its ``eval_loss`` (floats as hex strings). At the
end the weights and the optimizer state go to ``--final`` (safetensors) and the schedule,
torch RNG, global step and epoch to ``--final``.json. ``--kill-after-step S`` SIGKILLs this
process once step S is logged and the pilot has no save in flight.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

import safetensors.torch
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from ckptpilot.integrations.hf import CheckpointPilotCallback

VOCAB, LENGTH = 96, 16
TRAIN_SAMPLES, EVAL_SAMPLES, BATCH = 64, 16, 4


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, LENGTH), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recorder(TrainerCallback):
    """Writes each step's losses; registered after the pilot's callback, so its on_step_end
    sees the step already observed."""

    def __init__(self, pilot_callback: CheckpointPilotCallback, path: str,
                 kill_after_step: int | None) -> None:
        self.pilot_callback, self.kill_after_step = pilot_callback, kill_after_step
        self.file = open(path, "a")  # noqa: SIM115 - closed at train end
        self.observed: dict[int, str] = {}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        pilot = self.pilot_callback.pilot
        assert pilot is not None and pilot.last_loss is not None
        self.observed[state.global_step] = pilot.last_loss.hex()

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
               **kwargs: Any) -> None:
        step = state.global_step
        if "eval_loss" in logs:
            self._write({"step": step, "eval_loss": float(logs["eval_loss"]).hex()})
        if "loss" not in logs:
            return
        self._write({"step": step, "loss_observed": self.observed.pop(step),
                     "loss_logged": float(logs["loss"]).hex()})
        if step == self.kill_after_step:
            pilot = self.pilot_callback.pilot
            assert pilot is not None
            pilot.flush()  # no save in flight when the kill lands
            os.kill(os.getpid(), signal.SIGKILL)

    def _write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.file.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--eval-steps", type=int, required=True)
    p.add_argument("--accumulation", type=int, required=True)
    p.add_argument("--losses", required=True)
    p.add_argument("--final", required=True)
    p.add_argument("--kill-after-step", type=int)
    a = p.parse_args()
    torch.set_num_threads(1)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB,
                                       n_positions=LENGTH, bos_token_id=0, eos_token_id=0))
    pilot_callback = CheckpointPilotCallback(a.config, run_dir=a.run_dir)
    recorder = Recorder(pilot_callback, a.losses, a.kill_after_step)
    args = TrainingArguments(
        output_dir=os.path.join(a.run_dir, "hf"), max_steps=a.steps, learning_rate=1e-3,
        per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
        gradient_accumulation_steps=a.accumulation,
        eval_strategy="steps", eval_steps=a.eval_steps, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(TRAIN_SAMPLES, seed=1),
                      eval_dataset=Tokens(EVAL_SAMPLES, seed=2),
                      callbacks=[pilot_callback, recorder])
    output = trainer.train()

    pilot = pilot_callback.pilot
    assert pilot is not None and pilot.last_recovery is not None
    resumed = pilot.last_recovery.step or 0
    print(f"RESUMED {resumed} TRAINED {output.global_step - resumed}", flush=True)
    optimizer = trainer.optimizer.optimizer  # inside Accelerate's AcceleratedOptimizer
    # clone(): the tied input and output embeddings share memory, which safetensors refuses
    tensors = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    for pid, st in optimizer.state_dict()["state"].items():
        tensors.update({f"opt/{pid}/{k}": v.contiguous() for k, v in st.items()})
    safetensors.torch.save_file(tensors, a.final)
    with open(a.final + ".json", "w") as f:
        json.dump({"sched": trainer.lr_scheduler.state_dict(),
                   "torch_rng": torch.get_rng_state().tolist(),
                   "global_step": trainer.state.global_step, "epoch": trainer.state.epoch}, f)


if __name__ == "__main__":
    main()
