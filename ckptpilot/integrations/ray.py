"""Ray Train: a :class:`~ckptpilot.CheckpointPilot` inside the worker loop of a
``ray.train.torch.TorchTrainer`` (``pip install 'ckptpilot[ray]'``).

    def train_loop(config):
        model = ray.train.torch.prepare_model(build_model())
        optimizer = torch.optim.AdamW(model.parameters())
        with RayTrainPilot("policy.yaml", model=model, optimizer=optimizer,
                           run_dir="/shared/runs/exp1") as pilot:
            start = pilot.restore()
            for step in range(start + 1, total + 1):
                loss = train_step(...)
                pilot.observe(loss)           # the step boundary; reports to Ray Train

This module owns the mapping between the pilot and Ray Train's session: the rank and world
size come from ``ray.train.get_context()``; ``ray.train.report`` receives the metrics of the
step and, once a checkpoint is valid on the remote tier of every rank, a Ray ``Checkpoint``
that points at it; ``ray.train.get_checkpoint()`` is checked against the pilot's catalogue
before the pilot restores. It does not decide when to save, where, or what a valid checkpoint
is, and never moves checkpoint bytes: the pilot does all of that, and Ray's storage only
holds pointers.

A pointer is one small JSON file per rank (``ckptpilot_rank_NNNNN.json``: run id, step,
rank, the SHA256 and location of that rank's checkpoint), so Ray copies bytes, not the
state, into its ``storage_path``. Ray hands a pointer back after a restart, or to a new
``TorchTrainer`` with the ``RunConfig(name=..., storage_path=...)`` of an earlier job; it is
untrusted input: a pointer that does not parse, that names another run than the pilot's
``run_dir`` holds, or whose step and digest the catalogue does not know is refused with an
error that names the file. A verified pointer does not choose the step: Ray registers a
report some time after the workers make it, and loses the last ones when a worker dies, so
the pilot's newest valid checkpoint (agreed by every rank) is usually newer;
``ckptpilot recover --step N`` picks an older one, audited.

Lifecycle, all on the training thread of each worker, every rank making the same calls:
construct (the pilot starts), ``restore()`` once, ``observe()`` per step, ``close()`` (or leave
the ``with`` block): the final save, then a last report that points at it.
``ray.train.report`` is a barrier across the workers, so every rank reports at the same
steps: when a save the ranks agreed on is valid on the remote tier of all of them (one
all-gather over the job's process group tells), and every ``report_every_steps`` if set.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray.train
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ckptpilot.agreement import RankAgreement
from ckptpilot.errors import CheckpointFormatError, IntegrityError, NoCheckpointError, StateError
from ckptpilot.pilot import CheckpointPilot
from ckptpilot.policy import Policy
from ckptpilot.rundir import metadata_path
from ckptpilot.scheduler.decision import CheckpointDecision
from ckptpilot.storage.metadata import CheckpointRow, MetadataStore
from ckptpilot.vocab import Level, Status, Tier

__all__ = ["POINTER_FORMAT", "CheckpointPointer", "RayTrainPilot", "pointer_file",
           "read_pointer", "verify_pointer", "write_pointer"]

log = logging.getLogger(__name__)

POINTER_FORMAT = "ckptpilot-ray-pointer/1"
"""The ``format`` of a pointer file; another value is refused, not guessed at."""

_POINTER_MAX_BYTES = 64 * 1024  # a pointer is a few hundred bytes: more is not one of ours


class CheckpointPointer(BaseModel):
    """What a Ray checkpoint holds for one rank: which checkpoint of which run it stands for.
    ``run_dir`` and ``location`` are for messages; nothing is opened through them."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    format: str = POINTER_FORMAT
    run_id: str = Field(min_length=1, max_length=256)
    run_dir: str = Field(max_length=4096)
    step: int = Field(ge=0)
    rank: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    location: str = Field(max_length=4096)


def pointer_file(directory: str | os.PathLike[str], rank: int) -> Path:
    """The pointer of ``rank`` in a Ray checkpoint directory (the ranks' files sit side by
    side: Ray merges what every worker reported into one directory)."""
    return Path(directory) / f"ckptpilot_rank_{rank:05d}.json"


def write_pointer(directory: str | os.PathLike[str], pointer: CheckpointPointer) -> Path:
    """Write ``pointer`` into ``directory`` (a fresh temporary one that Ray copies)."""
    path = pointer_file(directory, pointer.rank)
    path.write_text(pointer.model_dump_json())
    return path


def read_pointer(directory: str | os.PathLike[str], rank: int) -> CheckpointPointer:
    """The pointer of ``rank`` in a Ray checkpoint directory, parsed strictly; raises
    ``CheckpointFormatError`` naming the file when it is missing, too large, not JSON, of
    another format, or has a missing, unknown or mistyped field."""
    path = pointer_file(directory, rank)
    try:
        with path.open("rb") as f:
            raw = f.read(_POINTER_MAX_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointFormatError(
            f"{path}: the Ray checkpoint has no pointer for rank {rank}; it was not reported "
            "by RayTrainPilot, or by a job with fewer workers (resume with the same "
            "ScalingConfig(num_workers=...))") from None
    if len(raw) > _POINTER_MAX_BYTES:
        raise CheckpointFormatError(f"{path}: larger than {_POINTER_MAX_BYTES} bytes; not a "
                                    "ckptpilot pointer")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointFormatError(f"{path}: not JSON ({e})") from e
    if not isinstance(data, dict) or data.get("format") != POINTER_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise CheckpointFormatError(f"{path}: format {found!r}, expected {POINTER_FORMAT!r}; "
                                    "upgrade ckptpilot if the pointer is newer")
    try:
        pointer = CheckpointPointer.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "(root)"
        raise CheckpointFormatError(f"{path}: {key}: {first['msg']}") from e
    if pointer.rank != rank:
        raise CheckpointFormatError(f"{path}: names rank {pointer.rank}; the file of rank "
                                    f"{rank} must hold rank {rank}'s pointer")
    return pointer


def verify_pointer(pointer: CheckpointPointer, pilot: CheckpointPilot, *,
                   source: str | os.PathLike[str]) -> CheckpointRow:
    """The catalogue row that ``pointer`` stands for; raises when the pilot's run is another
    run (``StateError``), when the catalogue has no remote checkpoint of that step for this
    rank (``NoCheckpointError``), or records another digest for it (``IntegrityError``).
    The row may since have been pruned: a pointer names history, the restore picks the
    step. ``source`` is the pointer's file, for the messages."""
    if pointer.run_id != pilot.run_id:
        raise StateError(
            f"{source}: Ray's checkpoint points at step {pointer.step} of run "
            f"{pointer.run_id} (run_dir {pointer.run_dir}), but this pilot's run_dir "
            f"{pilot.run_dir} holds run {pilot.run_id}; give RayTrainPilot the run_dir of "
            "that run, or resume without Ray's checkpoint")
    rows = [row for row in pilot.store.rows(pilot.run_id, rank=pilot.rank, tier=Tier.REMOTE)
            if row.step == pointer.step]
    if not rows:
        raise NoCheckpointError(
            f"{source}: run {pilot.run_id} has no remote checkpoint of step {pointer.step} "
            f"for rank {pilot.rank} in {metadata_path(pilot.run_dir)}; the pointer does not "
            "belong to this run's catalogue")
    for row in rows:
        if row.sha256 == pointer.sha256:
            return row
    raise IntegrityError(f"{source} (step {pointer.step}, rank {pilot.rank})",
                         rows[0].sha256, pointer.sha256)


def _remote_rows(store: MetadataStore, pilot: CheckpointPilot) -> dict[int, CheckpointRow]:
    """This rank's valid checkpoints on the remote tier, by step: what survives the loss of
    every worker process (the memory tier does not; a pulse kept by the peers only is not
    reported)."""
    rows = store.rows(pilot.run_id, rank=pilot.rank, status=Status.VALID, tier=Tier.REMOTE)
    return {row.step: row for row in rows if row.level is not Level.HEARTBEAT}


class RayTrainPilot:
    """A :class:`~ckptpilot.CheckpointPilot` for one Ray Train worker, reporting to Ray.

    ``policy``, ``run_dir`` and ``**pilot_kwargs`` (``optimizer``, ``lr_scheduler``,
    ``scaler``, ``data_state``, …) go to the pilot, which ``self.pilot`` is (its ``saves``,
    ``last_recovery`` and ``extras`` are there). ``run_dir`` must be the same directory on
    every worker and after every restart: a shared file system on a cluster of several
    nodes. ``report_every_steps``: also report the metrics alone every so many steps (None:
    only with a checkpoint, and at ``close``); each ``ray.train.report`` is a barrier across
    the workers and a round trip to Ray's controller, so a report per step costs more than a
    short step. ``ray_checkpoint_step`` is the step of the pointer Ray handed to
    ``restore()``, after it was verified (None when Ray had none); ``metrics`` the newest
    value of each metric given to ``observe``, which every report carries.
    """

    def __init__(self, policy: Policy | str | os.PathLike[str] | None = None, *,
                 model: torch.nn.Module, run_dir: str | os.PathLike[str] | None = None,
                 report_every_steps: int | None = None, **pilot_kwargs: Any) -> None:
        taken = sorted({"rank", "world_size"} & pilot_kwargs.keys())
        if taken:
            raise TypeError(f"RayTrainPilot takes {', '.join(taken)} from "
                            "ray.train.get_context(); do not pass them")
        if report_every_steps is not None and (
                isinstance(report_every_steps, bool) or not isinstance(report_every_steps, int)
                or report_every_steps < 1):
            raise ValueError(f"report_every_steps: {report_every_steps!r} is not a whole "
                             "number of steps >= 1 (or None)")
        context = ray.train.get_context()
        rank, world_size = context.get_world_rank(), context.get_world_size()
        if world_size > 1 and not (torch.distributed.is_available()
                                   and torch.distributed.is_initialized()):
            raise RuntimeError(f"RayTrainPilot: {world_size} workers and no torch.distributed "
                               "process group; use ray.train.torch.TorchTrainer, which "
                               "starts one before the loop")
        self.report_every_steps = report_every_steps
        self.pilot = CheckpointPilot(policy, model=model, run_dir=run_dir, rank=rank,
                                     world_size=world_size, **pilot_kwargs)
        self.ray_checkpoint_step: int | None = None
        self.metrics: dict[str, float] = {}
        self._agreement = RankAgreement(rank, world_size) if world_size > 1 else None
        self._reported_step = -1  # the newest step a pointer went to Ray for
        self._awaited_step: int | None = None  # saved, not yet reported: watch the catalogue
        self._remote: dict[int, CheckpointRow] = {}
        self._saves_seen = -1  # len(pilot.saves) when _remote was read
        self._closed = False

    # -- restore -------------------------------------------------------------------------------

    def restore(self) -> int:
        """Verify the pointer Ray hands (``ray.train.get_checkpoint()``), if any, then
        restore the pilot's newest checkpoint that every rank can load; returns its step
        (0 for a fresh run). Every rank must call it."""
        pointer = None
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is not None:
            with checkpoint.as_directory() as directory:
                source = pointer_file(directory, self.pilot.rank)
                pointer = read_pointer(directory, self.pilot.rank)
                verify_pointer(pointer, self.pilot, source=source)
            self.ray_checkpoint_step = self._reported_step = pointer.step
        step = self.pilot.restore()
        if pointer is not None and step < pointer.step:
            log.warning("Ray's checkpoint points at step %d; the pilot restored step %d (see "
                        "last_recovery.skipped, or a `ckptpilot recover` pin)", pointer.step,
                        step)
        if step > self._reported_step:  # Ray has not heard of it: report it when it can
            self._awaited_step = step
        return step

    # -- per step ------------------------------------------------------------------------------

    def observe(self, loss: Any = None, *, metrics: Mapping[str, float] | None = None,
                **observe_kwargs: Any) -> CheckpointDecision:
        """``pilot.observe`` (the step boundary: after ``optimizer.step()``, the LR scheduler
        and the data cursor; ``observe_kwargs`` go to it), then ``ray.train.report`` when a
        checkpoint newer than the last one reported is valid on the remote tier of every
        rank, or when ``report_every_steps`` says so. ``metrics`` (plain numbers: Ray refuses
        tensors) are kept and go with every report, beside ``step`` and ``loss``.

        From a save until every rank's copy of it is valid, each step boundary runs one
        all-gather of the ranks' newest remote steps: the ranks' background writers finish
        at different times, and a Ray checkpoint must stand for a step every rank can load.
        """
        decision = self.pilot.observe(loss, **observe_kwargs)
        if metrics:
            self.metrics.update({name: float(value) for name, value in metrics.items()})
        if decision.save:  # the ranks agreed on it: every rank awaits the same step
            self._awaited_step = self.pilot.step
        step = None
        if self._awaited_step is not None:
            step = self._agreed_remote_step(self.pilot.store)
            if step is not None and step >= self._awaited_step:
                self._awaited_step = None
            if step is not None and step <= self._reported_step:
                step = None
        every = self.report_every_steps
        if step is not None or (every is not None and self.pilot.step % every == 0):
            self._report(step)
        return decision

    def _report(self, step: int | None) -> None:
        """One ``ray.train.report``: metrics, and a pointer to ``step`` unless None."""
        pilot = self.pilot
        values: dict[str, Any] = {**self.metrics, "step": pilot.step}
        if pilot.last_loss is not None:
            values["loss"] = pilot.last_loss
        if step is None:
            ray.train.report(values)
            return
        row = self._remote[step]
        pointer = CheckpointPointer(run_id=pilot.run_id, run_dir=str(pilot.run_dir), step=step,
                                    rank=pilot.rank, sha256=row.sha256, location=row.location)
        with tempfile.TemporaryDirectory(prefix="ckptpilot-ray-") as directory:
            write_pointer(directory, pointer)
            ray.train.report({**values, "checkpoint_step": step},
                             checkpoint=ray.train.Checkpoint.from_directory(directory))
        self._reported_step = step

    def _agreed_remote_step(self, store: MetadataStore) -> int | None:
        """The newest step valid on the remote tier of every rank (None: no such step). The
        catalogue is read again only after a save of this rank completed."""
        saves = len(self.pilot.saves)
        if saves != self._saves_seen:
            self._remote, self._saves_seen = _remote_rows(store, self.pilot), saves
        steps = sorted(self._remote, reverse=True)
        if self._agreement is not None:
            steps = self._agreement.common_steps(steps, None)
        return steps[0] if steps else None

    # -- end -----------------------------------------------------------------------------------

    def close(self, save: bool = True) -> None:
        """Close the pilot (with ``save``, the final step is saved and waited for), then, with
        ``save``, a last report that points at the newest step every rank holds on the
        remote tier: a finished job started again from Ray's checkpoint restores its end.
        Every rank must call it; without ``save`` (a failed step) nothing is reported, since
        the other workers may be gone."""
        if self._closed:
            return
        self._closed = True
        pilot = self.pilot
        pilot.close(save=save)
        if not save:
            return
        self._saves_seen = -1  # the final save is new
        with MetadataStore(metadata_path(pilot.run_dir), read_only=True) as store:
            step = self._agreed_remote_step(store)
        self._report(step if step is not None and step > self._reported_step else None)

    def __enter__(self) -> RayTrainPilot:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # A step that raised may have left the state half-updated: only a clean exit saves.
        self.close(save=exc_type is None)
