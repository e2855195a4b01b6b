"""Hugging Face ``transformers.Trainer`` integration: a ``TrainerCallback`` that runs a
:class:`~ckptpilot.CheckpointPilot` inside the Trainer's own loop, so a Trainer job resumes
bit-exactly without a line of glue.

    trainer = Trainer(model=model, args=TrainingArguments(..., save_strategy="no"),
                      train_dataset=train, eval_dataset=val,
                      callbacks=[CheckpointPilotCallback("policy.yaml", run_dir="runs/exp1")])
    trainer.train()        # the same call starts a run and resumes it after a crash

What happens at each Trainer event (all on the training thread):

- ``on_train_begin``: the pilot is built from the Trainer's model, optimizer (Accelerate's
  ``AcceleratedOptimizer``; the pilot hooks the torch optimizer inside it), LR scheduler and,
  under fp16, Accelerate's grad scaler, and restores the newest checkpoint that verifies:
  weights, optimizer, schedule, scaler, every RNG (python, numpy, torch CPU and CUDA), and the
  Trainer's progress — ``state.global_step``, ``state.epoch`` and the data position (epoch
  and batches consumed). The Trainer skips batches only when it resumes from its own
  checkpoints, so the callback does it: the resumed epoch starts after exactly the batches
  already trained on, later epochs draw the order of the epochs they stand for, and a run
  that had already reached ``max_steps`` trains 0 steps.
- ``on_step_begin``: torch's CPU RNG is put back to what it was at the end of the previous
  step. Between two steps the Trainer draws from it for no training purpose (each new
  DataLoader iterator, for the next epoch or an evaluation, draws a base seed), and a resumed
  run, which builds its iterators at other steps, cannot replay those draws. Python's, numpy's
  and CUDA's RNGs are not drawn from between steps and are left alone. ``on_evaluate`` and
  ``on_train_end`` put it back too.
- ``on_step_end``: ``pilot.observe(loss, step=state.global_step, epoch=...)`` — the step
  boundary, where the pilot decides and may save. The loss is the ``loss`` the model's own
  forward returned for the step's micro-batches (read by a forward hook, so no Trainer
  subclass is needed): their mean, or their sum when the Trainer passed
  ``num_items_in_batch`` (each part is then already scaled to the whole step). A model that
  returns no ``loss`` (labels consumed by ``compute_loss_func`` or label smoothing) leaves
  the pilot's loss signal off; the checkpoints are the same.
- ``on_evaluate``: the metric that best-N retention ranks by (``retention.best.metric``,
  named as the Trainer reports it, e.g. ``eval_loss``) goes to ``pilot.report_metric``.
- ``on_train_end``: ``pilot.close()``, which saves the final step: rerunning a finished job
  restores its end and trains nothing.

The Trainer's own checkpoints: use ``save_strategy="no"``. With ``save_steps`` the Trainer
keeps writing its own full checkpoints beside the pilot's (the same state twice, on the
training thread); nothing conflicts, but resume through one of them only: ``train()`` with
``resume_from_checkpoint`` and this callback together are refused.

Refused, with the fix named, because a resume could not be exact: at ``on_train_begin``
(``StateError``), a training set without ``__len__`` (an ``IterableDataset``), a sampler whose
order is drawn from the global RNG when an epoch starts (``RandomSampler``; keep Accelerate's
default ``use_seedable_sampler=True``, or use a sampler with ``set_epoch``), and
``gradient_accumulation_steps`` that does not divide the batches of an epoch (the Trainer
decides the epoch's last optimizer step by counting batches from where its iterator started);
when the callback is built (``PolicyError``), ``rollback.enabled`` in the policy (the
Trainer's data iterator cannot be rewound from a callback). Not reproduced either: random
draws of the data set or the data collator (MLM masking), in the main process or in the
DataLoader's workers.

What a callback cannot reach: the Trainer sets the counters behind its running ``loss`` log
and its final ``train_loss`` / throughput summary before any callback runs, so after a resume
the first logged ``loss`` and that summary are averaged as if training had started at step 0
(the training itself, and ``pilot.last_loss``, are exact).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import SequentialSampler
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ckptpilot.errors import PolicyError, StateError
from ckptpilot.pilot import CheckpointPilot
from ckptpilot.policy import Policy, load_policy

__all__ = ["CheckpointPilotCallback"]

log = logging.getLogger("ckptpilot")


class _TrainerProgress:
    """The Trainer's progress as the pilot's ``data_state``: captured with every checkpoint,
    handed back by ``restore()`` in ``restored`` for the callback to apply.

    The data position counts micro-batches (DataLoader batches) of the current epoch, the unit
    in which the Trainer's DataLoader skips; ``batches_per_epoch`` and
    ``gradient_accumulation_steps`` identify the layout they count in.
    """

    def __init__(self, state: TrainerState, batches_per_epoch: int, accumulation: int) -> None:
        self.state = state
        self.batches_per_epoch = batches_per_epoch
        self.accumulation = accumulation
        self.data_epoch = 0
        self.batches = 0
        self.restored: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_step": self.state.global_step,
            "epoch": self.state.epoch,
            "data_epoch": self.data_epoch,
            "batches": self.batches,
            "batches_per_epoch": self.batches_per_epoch,
            "gradient_accumulation_steps": self.accumulation,
            "num_input_tokens_seen": self.state.num_input_tokens_seen,
            "total_flos": self.state.total_flos,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        for key, mine in (("batches_per_epoch", self.batches_per_epoch),
                          ("gradient_accumulation_steps", self.accumulation)):
            if state_dict[key] != mine:
                raise StateError(
                    f"trainer progress: {key} is {state_dict[key]} in the checkpoint but {mine} "
                    "here; the data position cannot be carried over (restore with the batch "
                    "size, data set and gradient accumulation the run was saved with)")
        self.restored = dict(state_dict)


class _EpochOffsetSampler(torch.utils.data.Sampler[int]):
    """The Trainer's sampler, shifted by ``offset`` epochs: a resumed Trainer counts its
    epochs from 0 again, so its epoch ``e`` is the run's epoch ``e + offset``. ``finished``
    yields nothing: the Trainer then ends the run without a training step."""

    def __init__(self, sampler: Any, offset: int, finished: bool) -> None:
        super().__init__()
        self.sampler, self.offset, self.finished = sampler, offset, finished

    def __iter__(self) -> Iterator[int]:
        return iter(()) if self.finished else iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch + self.offset)


class CheckpointPilotCallback(TrainerCallback):
    """Checkpoints a ``transformers.Trainer`` run with a :class:`CheckpointPilot` (see the
    module docstring for what each Trainer event does and what is refused).

    ``policy``: a :class:`Policy`, a policy YAML path, or ``None`` for the defaults;
    ``run_dir`` overrides its run directory; ``pilot_kwargs`` go to ``CheckpointPilot``
    (``gpu_health``, ``rank``, ``world_size``). The policy is loaded here, so a bad one fails
    before the Trainer starts.

    Lifecycle: one pilot per ``trainer.train()`` call, built at ``on_train_begin`` and closed
    at ``on_train_end``; ``pilot`` stays readable afterwards (``last_recovery``, ``saves``,
    ``stats()``). A ``train()`` that raised leaves its pilot open (no final save: the state
    may be half-updated); the next ``train()`` closes it without saving, or call ``close()``.
    """

    def __init__(self, policy: Policy | str | os.PathLike[str] | None = None, *,
                 run_dir: str | os.PathLike[str] | None = None, **pilot_kwargs: Any) -> None:
        if isinstance(policy, Policy):
            self.policy = policy.with_run_dir(run_dir) if run_dir is not None else policy
        else:
            self.policy = load_policy(policy, run_dir=run_dir)
        if self.policy.rollback.enabled:
            raise PolicyError(
                "rollback.enabled",
                "CheckpointPilotCallback cannot roll back: the Trainer's data iterator cannot "
                "be rewound from a callback; set rollback.enabled: false")
        self.pilot_kwargs = pilot_kwargs
        self.pilot: CheckpointPilot | None = None
        self._progress: _TrainerProgress | None = None
        self._dataloader: Any = None
        self._continuing = False  # the first epoch of a resumed run continues a started one
        self._torch_rng: torch.Tensor | None = None
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._loss_sum: torch.Tensor | None = None
        self._loss_parts = 0
        self._loss_scaled = False

    def close(self) -> None:
        """Close a pilot that ``train()`` left open by raising, without a final save."""
        self._detach()
        if self.pilot is not None:
            self.pilot.close(save=False)

    # -- Trainer events ----------------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, *, model: torch.nn.Module | None = None,
                       optimizer: Any = None, lr_scheduler: Any = None,
                       train_dataloader: Any = None, **kwargs: Any) -> None:
        self.close()
        if model is None:
            raise StateError("CheckpointPilotCallback: the Trainer passed no model")
        if state.global_step != 0:
            raise StateError(
                f"the Trainer resumed its own checkpoint (global step {state.global_step}); "
                "CheckpointPilotCallback restores the run itself: call train() without "
                "resume_from_checkpoint")
        sampler = _check_resumable(train_dataloader, args.gradient_accumulation_steps)
        self._dataloader = train_dataloader
        self._progress = _TrainerProgress(state, len(train_dataloader),
                                          args.gradient_accumulation_steps)
        self.pilot = CheckpointPilot(
            self.policy, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
            scaler=getattr(optimizer, "scaler", None), data_state=self._progress,
            **self.pilot_kwargs)
        if self.pilot.restore() > 0:
            self._resume(state, sampler)
        self._torch_rng = torch.get_rng_state()
        self._hook = model.register_forward_hook(self._on_forward, with_kwargs=True)

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        progress = self._progress
        if progress is None:
            return
        if self._continuing:
            self._continuing = False
        elif progress.batches > 0:
            progress.data_epoch += 1
            progress.batches = 0

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        if self._dataloader is not None:
            self._dataloader.skip_batches = 0  # the skip was for the epoch a resume continued

    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kwargs: Any) -> None:
        if self._torch_rng is not None:
            torch.set_rng_state(self._torch_rng)
        self._loss_sum, self._loss_parts = None, 0

    def on_substep_end(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        if self._progress is not None:
            self._progress.batches += 1

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        pilot, progress = self.pilot, self._progress
        if pilot is None or progress is None:
            return
        progress.batches += 1
        # The Trainer computes the epoch from the batches its iterator yielded, which after
        # a resume start at the skip: the same formula on the run's own position.
        state.epoch = progress.data_epoch + progress.batches / progress.batches_per_epoch
        loss = self._loss_sum
        if loss is not None and not self._loss_scaled:
            loss = loss / self._loss_parts
        pilot.observe(loss, step=state.global_step, epoch=progress.data_epoch)
        self._torch_rng = torch.get_rng_state()

    def on_evaluate(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, metrics: Mapping[str, float] | None = None,
                    **kwargs: Any) -> None:
        best, pilot = self.policy.retention.best, self.pilot
        if best is None or pilot is None or self._torch_rng is None or not metrics:
            return  # no best-N retention, or an evaluation outside train()
        if best.metric not in metrics:
            log.warning("retention.best.metric %r is not among this evaluation's metrics %s; "
                        "name it as the Trainer reports it (e.g. 'eval_loss')",
                        best.metric, sorted(metrics))
            return
        # The evaluation drew from it; a checkpoint saved here must hold the training RNG.
        torch.set_rng_state(self._torch_rng)
        pilot.report_metric(best.metric, metrics[best.metric])

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        if self._torch_rng is not None:
            # As at a step begin: a finished run restarted (whose empty epoch built an
            # iterator) ends with the RNG the uninterrupted run ended with.
            torch.set_rng_state(self._torch_rng)
        self._detach()
        if self.pilot is not None:
            self.pilot.close()

    # -- helpers -----------------------------------------------------------------------------

    def _resume(self, state: TrainerState, sampler: Any) -> None:
        progress, dataloader = self._progress, self._dataloader
        assert progress is not None and progress.restored is not None
        restored = progress.restored
        state.global_step = restored["global_step"]
        state.epoch = restored["epoch"]
        state.num_input_tokens_seen = restored["num_input_tokens_seen"]
        state.total_flos = restored["total_flos"]
        progress.data_epoch, progress.batches = restored["data_epoch"], restored["batches"]
        if progress.batches >= progress.batches_per_epoch:
            progress.data_epoch, progress.batches = progress.data_epoch + 1, 0
        finished = state.global_step >= state.max_steps
        if finished:
            # Said at warning level: the Trainer then warns of an empty epoch iterator.
            log.warning("restored step %d, max_steps is %d: nothing left to train (the "
                        "Trainer stops at its empty first epoch)", state.global_step,
                        state.max_steps)
        if finished or progress.data_epoch > 0:
            dataloader.set_sampler(_EpochOffsetSampler(sampler, progress.data_epoch, finished))
        dataloader.skip_batches = progress.batches
        self._continuing = True

    def _on_forward(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any],
                    output: Any) -> None:
        if not module.training or not isinstance(output, Mapping):
            return
        loss = output.get("loss")
        if not isinstance(loss, torch.Tensor):
            return
        loss = loss.detach()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._loss_parts += 1
        self._loss_scaled = "num_items_in_batch" in kwargs

    def _detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._progress, self._dataloader, self._torch_rng = None, None, None


def _check_resumable(dataloader: Any, accumulation: int) -> Any:
    """The Trainer's index sampler, once the data position is known to be resumable."""
    if dataloader is None or not hasattr(dataloader, "skip_batches") \
            or not hasattr(dataloader, "set_sampler"):
        raise StateError(
            "CheckpointPilotCallback needs the Trainer's Accelerate-prepared DataLoader (it "
            f"skips the batches already trained on); got {type(dataloader).__qualname__}")
    try:
        batches = len(dataloader)
    except TypeError as e:
        raise StateError(
            "CheckpointPilotCallback needs a train_dataset with __len__ (a map-style data "
            "set): the position in an IterableDataset cannot be resumed") from e
    sampler = dataloader.get_sampler()
    if sampler is None:
        raise StateError(
            "the Trainer's DataLoader draws whole batches from a batch sampler (e.g. "
            "train_sampling_strategy='batch_rebalance'), which CheckpointPilotCallback "
            "cannot move to a resumed epoch; use the 'random' (default) or 'sequential' "
            "train_sampling_strategy")
    if not isinstance(sampler, SequentialSampler) and not hasattr(sampler, "set_epoch"):
        raise StateError(
            f"the Trainer's sampler {type(sampler).__qualname__} draws each epoch's order "
            "from the global RNG when the epoch starts, which a resumed run cannot replay; "
            "keep accelerator_config use_seedable_sampler=True (the default) or give the "
            "sampler a set_epoch(epoch) that seeds its order")
    if accumulation > 1 and batches % accumulation:
        raise StateError(
            f"gradient_accumulation_steps={accumulation} does not divide the {batches} "
            "batches of an epoch: after a resume the Trainer would misplace the epoch's last "
            "optimizer step; change the batch size or the data set size so that it does")
    return sampler
