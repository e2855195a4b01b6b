"""Lightning: a ``Callback`` that checkpoints a ``lightning.Trainer`` fit with a CheckpointPilot
and resumes it bit for bit (``pip install 'ckptpilot[lightning]'``).

This module owns the mapping from Lightning's hooks to the pilot's lifecycle (``pilot.py``):
build and restore in ``on_fit_start`` — after Lightning configured the optimizer and moved the
model, before the fit loop creates its DataLoader iterators — observe after each optimizer
step in ``on_train_batch_end``, report the monitored metric after validation, close in
``on_fit_end``. It does not decide when to save and never touches checkpoint storage: the
pilot does both. Lightning's own checkpointing (``ModelCheckpoint``, ``fit(ckpt_path=...)``)
is not used; turn it off with ``Trainer(enable_checkpointing=False)``.

The loop state (global step, epoch, batches consumed in the epoch, validation progress) has
no public restore API in Lightning beyond its own checkpoint files: it travels in
``pilot.extras`` and is read and loaded by the two functions under "Lightning's loop state"
below, the one place that reaches below the Trainer's public surface.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.callbacks import Callback

from ckptpilot.capture.state import Stateful
from ckptpilot.errors import StateError
from ckptpilot.pilot import CheckpointPilot
from ckptpilot.policy import Policy

__all__ = ["CheckpointPilotCallback"]

log = logging.getLogger(__name__)

LOOP_STATE_KEY = "lightning_fit_loop"
"""The key of ``pilot.extras`` that holds Lightning's fit-loop state."""


# -- Lightning's loop state --------------------------------------------------------------------
# ``Trainer.global_step`` / ``current_epoch`` are read-only; Lightning restores its counters only
# from its own checkpoint files, through ``fit_loop.load_state_dict`` (what
# ``_CheckpointConnector.restore_loops`` calls). ``trainer.fit_loop`` is public, its class
# (``_FitLoop``) is not: a Lightning release that changes the loops changes these two functions.

def _fit_loop_state(trainer: pl.Trainer) -> dict[str, Any]:
    """Every progress counter of the fit loop and its children (plain ints and bools), plus the
    state of a DataLoader that has ``state_dict``/``load_state_dict``, as Lightning's own
    checkpoints store it under ``loops.fit_loop``."""
    return trainer.fit_loop.state_dict()


def _load_fit_loop_state(trainer: pl.Trainer, state: Mapping[str, Any]) -> None:
    """Load what :func:`_fit_loop_state` read. Lightning then treats the fit as restarted from a
    checkpoint taken in ``on_train_batch_end``, as ``ModelCheckpoint`` takes them: it counts
    the batch as completed, fast-forwards over the validation that followed it (it ran before
    the save that carries its metric) and goes on with the next batch, or the next epoch."""
    trainer.fit_loop.load_state_dict(dict(state))


# -- the callback ------------------------------------------------------------------------------

class CheckpointPilotCallback(Callback):
    """Checkpoints a ``Trainer.fit`` with a :class:`~ckptpilot.CheckpointPilot`.

    ``policy``, ``run_dir`` and ``**pilot_kwargs`` (``scaler``, ``gpu_health``, ``rank``, …) go
    to the pilot; model, optimizer and LR scheduler come from the Trainer: the LightningModule,
    its one optimizer (unwrapped by the pilot), its LR scheduler if any, and the AMP grad scaler
    of a mixed-precision plugin unless ``scaler`` is given. ``data_state`` is the data cursor:
    for an exact data position pass the ``ResumableSampler`` the training DataLoader samples
    with (``DataLoader(ds, sampler=s, generator=g)``, ``num_workers=0``). A DataLoader with its
    own ``state_dict``/``load_state_dict`` needs none: its state travels with the loop state.
    ``monitor`` names the entry of ``trainer.callback_metrics`` reported to best-N retention
    after each validation (default: the policy's ``retention.best.metric``; none: no report).

    Lifecycle, all on the training thread, one fit at a time: ``on_fit_start`` builds the pilot
    (``self.pilot``) and restores the newest checkpoint that verifies — model, optimizer,
    scheduler, scaler, data cursor, every RNG, and Lightning's loop state; ``on_train_batch_end``
    observes each optimizer step with the batch's loss (``trainer.global_step`` is the pilot's
    step, so batches that only accumulate gradients are no step boundary); ``on_validation_end``
    reports the metric (saving a pulse when the step has no checkpoint yet); ``on_fit_end``
    closes the pilot, which saves the final step, so a finished fit restarted trains 0 steps;
    ``on_exception`` closes it without that save. ``self.pilot`` stays readable after the fit
    (``saves``, ``last_recovery``).

    Bit-exact resume needs DataLoaders that do not draw from the global torch RNG: Lightning
    creates an iterator for each epoch and each validation, and a DataLoader without
    ``generator=`` draws its base seed from the global RNG then, so a run resumed from an
    epoch's last step or from a validation step would continue with other random numbers.
    ``on_train_start`` logs one warning naming such loaders.
    """

    def __init__(self, policy: Policy | str | os.PathLike[str] | None = None, *,
                 run_dir: str | os.PathLike[str] | None = None,
                 data_state: Stateful | None = None, monitor: str | None = None,
                 **pilot_kwargs: Any) -> None:
        taken = sorted({"model", "optimizer", "lr_scheduler"} & pilot_kwargs.keys())
        if taken:
            raise TypeError(f"CheckpointPilotCallback takes {', '.join(taken)} from the Trainer; "
                            "do not pass them")
        self._policy, self._run_dir, self._data_state = policy, run_dir, data_state
        self._monitor, self._pilot_kwargs = monitor, pilot_kwargs
        self.pilot: CheckpointPilot | None = None
        self._metric: str | None = None
        self._last_step = 0
        self._missing_metric_logged = False
        self._torch_rng: torch.Tensor | None = None

    def _open_pilot(self) -> CheckpointPilot:
        pilot = self.pilot
        if pilot is None:
            raise RuntimeError("CheckpointPilotCallback: no pilot outside Trainer.fit")
        return pilot

    # -- start and restore ---------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.ckpt_path is not None:
            raise ValueError(f"Trainer.fit(ckpt_path={trainer.ckpt_path!r}) and "
                             "CheckpointPilotCallback both restore the run; pass no ckpt_path")
        if len(trainer.optimizers) > 1:
            raise ValueError(f"CheckpointPilotCallback: the module configured "
                             f"{len(trainer.optimizers)} optimizers; a pilot captures one")
        if len(trainer.lr_scheduler_configs) > 1:
            raise ValueError(f"CheckpointPilotCallback: the module configured "
                             f"{len(trainer.lr_scheduler_configs)} LR schedulers; a pilot "
                             "captures one")
        kwargs = dict(self._pilot_kwargs)
        kwargs.setdefault("scaler", getattr(trainer.precision_plugin, "scaler", None))
        self.pilot = pilot = CheckpointPilot(
            self._policy, model=pl_module,
            optimizer=trainer.optimizers[0] if trainer.optimizers else None,
            lr_scheduler=(trainer.lr_scheduler_configs[0].scheduler
                          if trainer.lr_scheduler_configs else None),
            data_state=self._data_state, run_dir=self._run_dir, **kwargs)
        best = pilot.policy.retention.best
        self._metric = self._monitor or (best.metric if best is not None else None)
        self._missing_metric_logged = False
        step = pilot.restore()
        if step:
            self._resume_loops(trainer, step)
        self._last_step = trainer.global_step

    def _resume_loops(self, trainer: pl.Trainer, step: int) -> None:
        state = self._open_pilot().extras.get(LOOP_STATE_KEY)
        if not isinstance(state, Mapping):
            raise StateError(f"the checkpoint of step {step} holds no Lightning loop state "
                             f"(extras[{LOOP_STATE_KEY!r}]): it was not saved by "
                             "CheckpointPilotCallback; start a new run_dir")
        _load_fit_loop_state(trainer, state)
        if trainer.global_step != step:
            raise StateError(f"the checkpoint of step {step} restores Lightning's global_step "
                             f"to {trainer.global_step}; the loop state does not belong to it")
        # Lightning's restart path creates DataLoader iterators before the first batch (the
        # training loader, and the validation loader it fast-forwards over); one without a
        # generator draws a seed from the global torch RNG, which the uninterrupted run did not
        # do at this step. The first batch starts from the restored state again.
        self._torch_rng = torch.get_rng_state()
        if self._data_state is not None:
            # Lightning warns that a DataLoader without state_dict cannot resume mid-epoch; the
            # restored data cursor is what resumes it.
            warnings.filterwarnings(
                "ignore", message="You're resuming from a checkpoint that ended before the epoch",
                category=PossibleUserWarning)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        drawing = [name for name, loader in _loaders(trainer) if loader.generator is None]
        if drawing:
            log.warning("%s draw from the global torch RNG at each new iterator (each epoch, "
                        "each validation): a resume from an epoch's last step or a validation "
                        "step is then not bit-exact; give each DataLoader generator=",
                        " and ".join(drawing))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if self._torch_rng is not None:
            torch.set_rng_state(self._torch_rng)
            self._torch_rng = None

    # -- per step ------------------------------------------------------------------------------

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:  # accumulating gradients: no optimizer step
            return
        self._last_step = step
        pilot = self._open_pilot()
        pilot.extras[LOOP_STATE_KEY] = _fit_loop_state(trainer)
        pilot.observe(_loss(outputs), step=step, epoch=trainer.current_epoch)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._report(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Without validation, a metric logged in training (on_epoch=True) is fresh here; with
        # validation a validation metric here would belong to an older step.
        if not trainer.enable_validation:
            self._report(trainer)

    def _report(self, trainer: pl.Trainer) -> None:
        if self._metric is None or trainer.global_step == 0:
            return
        value = trainer.callback_metrics.get(self._metric)
        if value is None:
            if not self._missing_metric_logged:
                self._missing_metric_logged = True
                log.warning("metric %r is not among the logged metrics %s; nothing is reported "
                            "to best-N retention", self._metric, sorted(trainer.callback_metrics))
            return
        self._open_pilot().report_metric(self._metric, float(value))

    # -- end -----------------------------------------------------------------------------------

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._open_pilot().close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        # A step that raised may have left the state half-updated: close without the final save.
        if self.pilot is not None:
            self.pilot.close(save=False)


def _loss(outputs: Any) -> Any:
    """The loss of a ``training_step`` output: the tensor, or its ``"loss"`` entry."""
    if isinstance(outputs, Mapping):
        return outputs.get("loss")
    return outputs if isinstance(outputs, torch.Tensor) else None


def _loaders(trainer: pl.Trainer) -> Iterator[tuple[str, torch.utils.data.DataLoader[Any]]]:
    """The fit's torch DataLoaders, named for a message (a single loader or nested lists and
    dicts of them, as ``train_dataloader`` / ``val_dataloaders`` return them)."""
    def walk(name: str, value: Any) -> Iterator[tuple[str, torch.utils.data.DataLoader[Any]]]:
        if isinstance(value, torch.utils.data.DataLoader):
            yield name, value
        elif isinstance(value, Mapping):
            for key, item in value.items():
                yield from walk(f"{name}[{key!r}]", item)
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                yield from walk(f"{name}[{i}]", item)

    yield from walk("train_dataloader", trainer.train_dataloader)
    yield from walk("val_dataloaders", trainer.val_dataloaders)
