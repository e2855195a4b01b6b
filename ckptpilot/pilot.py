"""CheckpointPilot: the one object a training loop talks to.

Data path of one save: ``observe`` (training thread) decides → ``state.capture`` copies the
complete state into host memory (the only cost training pays) → a background writer thread
encodes, writes and publishes the archive on the remote tier. Recovery runs the path backwards.

Threading and lifecycle:

1. construct on the training thread (registers a post-step hook on the optimizer);
2. ``restore()`` once, before the loop;
3. per step, ``observe()`` after ``optimizer.step()``, ``lr_scheduler.step()`` and after the
   data cursor moved — that is the step boundary at which every part of the state belongs to
   the same step;
4. ``close()`` (or leave the ``with`` block): waits for every pending save and surfaces errors.

Only the writer thread touches storage. At most ``async.max_pending`` snapshots exist at once;
a save requested while that many are in flight waits (back-pressure) rather than allocating
more host memory. An exception in the writer is raised on the training thread at the next
``observe``/``save``/``close`` as ``CheckpointWriteError``; it is never swallowed.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from ckptpilot.errors import CheckpointFormatError, CheckpointWriteError, NoCheckpointError
from ckptpilot.observe import Telemetry
from ckptpilot.policy import Policy, load_policy
from ckptpilot.state import HostBufferPool, Snapshot, Stateful, TrainingComponents, apply, capture
from ckptpilot.storage.archive import list_archives, read_organ, write_organ
from ckptpilot.tiers.remote import RemoteTier

log = logging.getLogger("ckptpilot")


class RecoverySource(str, Enum):
    MEMORY = "memory"
    PEER = "peer"
    REMOTE = "remote"
    NONE = "none"


@dataclass(frozen=True)
class SkippedCheckpoint:
    location: str
    reason: str


@dataclass(frozen=True)
class RecoveryReport:
    """What ``restore()`` did. ``steps_lost`` is None until heartbeats tell how far a run got."""

    source: RecoverySource
    step: int
    level: str | None
    seconds: float
    steps_lost: int | None
    location: str | None
    skipped: tuple[SkippedCheckpoint, ...] = ()


@dataclass(frozen=True)
class SaveRecord:
    """One published checkpoint. ``stall_seconds`` is what the training thread paid for it
    (back-pressure wait + snapshot copy); ``persist_seconds`` ran in the background."""

    step: int
    level: str
    reason: str
    stall_seconds: float
    persist_seconds: float
    bytes: int
    location: str


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class CheckpointPilot:
    """Keeps a training run resumable: decides when to save, saves off-thread, restores.

    ``extras`` is a dict the caller may fill with JSON-able values (or tensors); it is saved
    with every checkpoint and replaced by the stored one on ``restore()``.
    """

    def __init__(self, policy: Policy | str | os.PathLike[str] | None = None, *,
                 model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 lr_scheduler: Stateful | None = None, scaler: Stateful | None = None,
                 data_state: Stateful | None = None, run_dir: str | os.PathLike[str] | None = None,
                 rank: int | None = None, world_size: int | None = None) -> None:
        if isinstance(policy, Policy):
            self.policy = policy.with_run_dir(run_dir) if run_dir is not None else policy
        else:
            self.policy = load_policy(policy, run_dir=run_dir)
        self.run_dir = Path(self.policy.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        dist_rank, dist_world = _dist_rank_world()
        self.rank = dist_rank if rank is None else rank
        self.world_size = dist_world if world_size is None else world_size
        self.components = TrainingComponents(model=model, optimizer=optimizer,
                                             lr_scheduler=lr_scheduler, scaler=scaler,
                                             data_state=data_state)
        self.remote = RemoteTier(self.policy.tiers.remote.url)
        self.extras: dict[str, Any] = {}
        self.step = 0
        self.epoch: int | None = None
        self.last_loss: Any = None
        self.last_recovery: RecoveryReport | None = None
        self.saves: list[SaveRecord] = []

        max_pending = self.policy.async_.max_pending
        self._slots = threading.BoundedSemaphore(max_pending)
        self._pool = HostBufferPool(max_pending)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptpilot-writer")
        self._inflight: deque[tuple[int, Future[SaveRecord]]] = deque()
        self._telemetry = Telemetry(self.run_dir / "tensorboard",
                                    tensorboard=self.policy.observability.tensorboard)
        self._last_save_step: int | None = None
        self._base_step = 0
        self._optimizer_steps = 0
        self._observed = False
        self._closed = False
        self._grad_norm: torch.Tensor | None = None
        self._hook = (optimizer.register_step_post_hook(self._after_optimizer_step)
                      if optimizer is not None else None)

    # -- training thread -------------------------------------------------------------------

    def observe(self, loss: Any = None, *, step: int | None = None,
                epoch: int | None = None) -> bool:
        """Mark a step boundary; returns True when a save was started at this step.

        ``step`` defaults to one more than the previous step (the pilot counts completed
        iterations; after ``restore()`` it continues from the restored step).
        """
        self._check_open()
        self._raise_background_errors()
        if step is None:
            step = self.step + 1 if self._observed else self._base_step + 1
        self._observed = True
        self.step = step
        if epoch is not None:
            self.epoch = epoch
        self.last_loss = loss
        if self._interval_due():
            return self._save(level="organ", reason="interval")
        return False

    def save(self, level: str = "organ", reason: str = "manual") -> bool:
        """Force a save of the current step; False if this step is already saved."""
        self._check_open()
        self._raise_background_errors()
        if level != "organ":
            raise ValueError(f"level {level!r} is not available yet; use 'organ'")
        return self._save(level=level, reason=reason)

    @property
    def last_grad_norm(self) -> float | None:
        """Global L2 norm of the gradients at the last probe (every ``grad.probe_every``)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any,
                              kwargs: Any) -> None:
        self._optimizer_steps += 1
        if self._optimizer_steps % self.policy.scheduler.grad.probe_every == 0:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"]
                     if p.grad is not None]
            self._grad_norm = torch.nn.utils.get_total_norm(grads) if grads else None
        # Without observe() the hook is the step boundary. The first optimizer step cannot
        # tell the two modes apart, so hook-time saves start at the second one.
        if not self._observed:
            self.step = self._base_step + self._optimizer_steps
            if self._optimizer_steps >= 2 and self._interval_due():
                self._save(level="organ", reason="interval (optimizer hook)")

    def _interval_due(self) -> bool:
        since = self.step - (self._last_save_step or 0)
        return since >= self.policy.scheduler.base_interval

    def _save(self, *, level: str, reason: str) -> bool:
        if self._last_save_step == self.step:
            return False
        t0 = time.perf_counter()
        self._slots.acquire()
        try:
            snapshot = capture(self.components, step=self.step, epoch=self._current_epoch(),
                               extras=self.extras, rank=self.rank, world_size=self.world_size,
                               pool=self._pool)
        except BaseException:
            self._slots.release()
            raise
        stall = time.perf_counter() - t0
        future = self._executor.submit(self._persist, snapshot, level, reason, stall)
        self._inflight.append((self.step, future))
        self._last_save_step = self.step
        return True

    def _current_epoch(self) -> int | None:
        if self.epoch is not None:
            return self.epoch
        epoch = getattr(self.components.data_state, "epoch", None)
        return epoch if isinstance(epoch, int) else None

    def _raise_background_errors(self) -> None:
        while self._inflight and self._inflight[0][1].done():
            step, future = self._inflight.popleft()
            error = future.exception()
            if error is not None:
                raise CheckpointWriteError(
                    f"background save of step {step} to {self.remote.url} failed: {error}"
                ) from error

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this CheckpointPilot is closed")

    # -- writer thread ---------------------------------------------------------------------

    def _persist(self, snapshot: Snapshot, level: str, reason: str, stall: float) -> SaveRecord:
        try:
            t0 = time.perf_counter()
            written = write_organ(self.remote, snapshot, level=level, reason=reason)
            seconds = time.perf_counter() - t0
            record = SaveRecord(step=snapshot.step, level=level, reason=reason,
                                stall_seconds=stall, persist_seconds=seconds,
                                bytes=written.bytes, location=written.location)
            self.saves.append(record)
            log.info("saved %s step %d: %.1f MB, stall %.1f ms, persisted in %.2f s",
                     level, snapshot.step, written.bytes / 1e6, stall * 1e3, seconds)
            self._telemetry.scalars(snapshot.step, {
                "checkpoint/save_seconds": seconds,
                "checkpoint/stall_seconds": stall,
                "checkpoint/bytes": float(written.bytes),
            })
            return record
        except Exception:
            log.exception("background save of step %d failed", snapshot.step)
            raise
        finally:
            self._pool.give_back(snapshot.tensors)
            self._slots.release()

    # -- recovery --------------------------------------------------------------------------

    def restore(self, step: int | None = None) -> int:
        """Load the newest checkpoint that verifies (or exactly ``step``); returns the step
        to resume from, 0 when the run has no checkpoint yet.

        A checkpoint that fails verification is skipped and reported in
        ``last_recovery.skipped``; if checkpoints exist but none verifies, this raises rather
        than silently restarting the run from scratch.
        """
        self._check_open()
        self.flush()
        t0 = time.perf_counter()
        listing = list_archives(self.remote, self.rank)
        for debris in listing.staging:
            log.warning("removing %s: a save that never finished (writer killed)",
                        self.remote.path(debris))
            self.remote.remove(debris)
        candidates = [(s, n) for s, n in listing.published if step is None or s == step]
        if step is not None and not candidates:
            raise NoCheckpointError(f"no checkpoint of step {step} for rank {self.rank} "
                                    f"in {self.remote.url}")
        skipped: list[SkippedCheckpoint] = []
        for ckpt_step, name in candidates:
            try:
                loaded = read_organ(self.remote, name)
            except CheckpointFormatError as e:
                log.warning("skipping checkpoint %s: %s", self.remote.path(name), e)
                skipped.append(SkippedCheckpoint(self.remote.path(name), str(e)))
                continue
            restored_extras = apply(self.components, loaded.meta, loaded.tensor)
            self.extras.clear()
            self.extras.update(restored_extras)
            self.step = self._base_step = ckpt_step
            self._optimizer_steps = 0
            self.epoch = loaded.meta.get("epoch")
            self._last_save_step = ckpt_step
            self.last_recovery = RecoveryReport(
                source=RecoverySource.REMOTE, step=ckpt_step,
                level=loaded.manifest["level"], seconds=time.perf_counter() - t0,
                steps_lost=None, location=loaded.location, skipped=tuple(skipped))
            log.info("restored step %d from %s in %.2f s", ckpt_step, loaded.location,
                     self.last_recovery.seconds)
            return ckpt_step
        if skipped:
            raise NoCheckpointError(
                f"none of the {len(skipped)} checkpoints in {self.remote.url} verifies; "
                f"newest: {skipped[0].reason}")
        self.last_recovery = RecoveryReport(
            source=RecoverySource.NONE, step=0, level=None, seconds=time.perf_counter() - t0,
            steps_lost=None, location=None)
        return 0

    # -- lifecycle -------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait for every pending save; raises the first background error."""
        for _, future in list(self._inflight):
            future.exception()
        self._raise_background_errors()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
        try:
            self.flush()
        finally:
            self._executor.shutdown(wait=True)
            self._telemetry.close()

    def __enter__(self) -> CheckpointPilot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> Mapping[str, Any]:
        """Totals over the saves this process completed."""
        stalls = [r.stall_seconds for r in self.saves]
        return {
            "saves": len(self.saves),
            "bytes": sum(r.bytes for r in self.saves),
            "median_stall_seconds": statistics.median(stalls) if stalls else None,
        }
