"""The save side of a sharded training state: capture on the training thread into host
buffers the snapshot owns (reused while the layout stays), then ``dcp.save`` on the writer
thread through :class:`ckptpilot.dcp.Writer`, inside the writer's back-pressure and the disk
budget.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from sqlalchemy.exc import SQLAlchemyError
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

from ckptpilot.capture.state import TrainingComponents, capture, encode_tree
from ckptpilot.catalog import Catalog, SaveIntent
from ckptpilot.dcp import Writer
from ckptpilot.dcp.writer import codec_selector
from ckptpilot.errors import CkptPilotError
from ckptpilot.policy import Policy
from ckptpilot.retention.auto import DiskBudgetError
from ckptpilot.save.plan import plan_save
from ckptpilot.save.writer import CheckpointWriter, SaveRecord
from ckptpilot.sharded.meta import (
    NO_MODEL,
    SHARDED_FORMAT,
    SHARDED_FORMAT_VERSION,
    Layout,
    data_parallel,
    host_like,
    json_tensor,
    layout_of,
    local_part,
)
from ckptpilot.telemetry import Telemetry
from ckptpilot.vocab import RetentionClass, Status, Tier

log = logging.getLogger("ckptpilot")


@dataclass
class _Snapshot:
    """One step's sharded state, in host memory the snapshot owns: ``state`` is what
    ``dcp.save`` writes; ``shards`` the reusable host copies of the global tensors in it."""

    step: int
    state: dict[str, torch.Tensor]
    shards: dict[str, torch.Tensor]
    layout: Layout
    nbytes: int


class ShardedSaver:
    """One rank's saves of a sharded training state (:meth:`ShardedState.save`).

    ``save`` runs on the training thread, ``_persist`` on the writer thread; the free list of
    host copies is shared between them under a lock.
    """

    def __init__(self, policy: Policy, components: TrainingComponents, *, catalog: Catalog,
                 writer: CheckpointWriter, telemetry: Telemetry, rank: int, world_size: int,
                 group: dist.ProcessGroup | None) -> None:
        self._policy = policy
        self._components = components
        self._catalog = catalog
        self._writer = writer
        self._telemetry = telemetry
        self._rank = rank
        self._world_size = world_size
        self._group = group
        self._selector = codec_selector(policy)  # one per run: auto's trials carry over
        self._free: list[_Snapshot] = []  # host copies to reuse, at most async.max_pending
        self._max_free = policy.async_.max_pending
        self._lock = threading.Lock()

    def save(self, intent: SaveIntent, *, step: int, epoch: int | None,
             extras: Mapping[str, Any]) -> float:
        """Copy the state of ``step`` to host memory and queue its ``dcp.save`` on the
        writer thread; returns what the training thread paid (back-pressure wait + copy)."""
        t0 = time.perf_counter()
        self._writer.acquire_slot()
        try:
            snapshot = self._capture(step, epoch, extras)
        except BaseException:
            self._writer.release_slot()
            raise
        stall = time.perf_counter() - t0
        self._writer.run_after(step, "sharded save", self._persist, snapshot, intent, stall)
        return stall

    def _capture(self, step: int, epoch: int | None, extras: Mapping[str, Any]) -> _Snapshot:
        c = self._components
        if c.optimizer is None:
            model_sd, optim_sd = get_model_state_dict(c.model), None
        else:
            model_sd, optim_sd = get_state_dict(c.model, c.optimizer)
        model_tree, sources = encode_tree(model_sd, "model")
        optim_tree = None
        if optim_sd is not None:
            optim_tree, optim_tensors = encode_tree(optim_sd, "optimizer")
            sources.update(optim_tensors)
        layout = layout_of(sources)
        shards = self._reusable(layout)
        cuda = any(local_part(t).is_cuda for t in sources.values())
        if shards is None:
            shards = {name: host_like(t, cuda) for name, t in sources.items()}
        for name, src in sources.items():
            local_part(shards[name]).copy_(local_part(src).detach(), non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        rest = capture(TrainingComponents(model=NO_MODEL, lr_scheduler=c.lr_scheduler,
                                          scaler=c.scaler, data_state=c.data_state),
                       step=step, epoch=epoch, extras=extras, rank=self._rank,
                       world_size=self._world_size)
        meta = {"format": SHARDED_FORMAT, "format_version": SHARDED_FORMAT_VERSION,
                "step": step, "epoch": epoch, "rank": self._rank,
                "world_size": self._world_size, "model": model_tree, "optimizer": optim_tree,
                "state": rest.meta, "data_parallel": data_parallel(c.data_state)}
        prefix = f"rank/{self._rank}/"
        state = dict(shards)
        state[prefix + "meta"] = json_tensor(meta)
        state.update((prefix + name, t) for name, t in rest.tensors.items())
        nbytes = sum(local_part(t).numel() * t.element_size() for t in state.values())
        return _Snapshot(step, state, shards, layout, nbytes)

    def _reusable(self, layout: Layout) -> dict[str, torch.Tensor] | None:
        with self._lock:
            for i, held in enumerate(self._free):
                if held.layout == layout:
                    return self._free.pop(i).shards
        return None

    def _give_back(self, snapshot: _Snapshot) -> None:
        with self._lock:
            if len(self._free) < self._max_free:
                self._free.append(snapshot)

    def _persist(self, snapshot: _Snapshot, intent: SaveIntent, stall: float) -> None:
        """(writer thread) ``dcp.save`` of one snapshot: every rank's part written and hashed
        (read back too in the paranoid mode), the commit file last, the rows ``valid``
        (``ckptpilot.dcp.Writer``)."""
        try:
            if self._refused_by_budget(snapshot):
                return
            t0 = time.perf_counter()
            writer = Writer(self._policy, step=snapshot.step,
                            codecs=plan_save(intent, self._policy).codecs, reason=intent.reason,
                            retention_class=intent.retention_class, score=intent.score,
                            codec_selector=self._selector)
            dcp.save(snapshot.state, storage_writer=writer, process_group=self._group,
                     no_dist=self._group is None)
            seconds = time.perf_counter() - t0
            catalog = self._catalog
            if intent.metric is not None:
                catalog.set_metric(snapshot.step, *intent.metric)
            row = catalog.store.get(catalog.key(snapshot.step, Tier.REMOTE))
            assert row is not None, f"dcp.save of step {snapshot.step} left no row"
            record = SaveRecord(
                step=snapshot.step, level=row.level, reason=intent.reason,
                retention_class=RetentionClass(intent.retention_class), stall_seconds=stall,
                persist_seconds=seconds, validate_seconds=row.seconds_validate or 0.0,
                bytes=row.bytes_encoded or 0, location=row.location, status=row.status,
                bytes_raw=snapshot.nbytes, write_seconds=row.seconds_write or 0.0)
            self._writer.saves.append(record)
            if record.status is Status.VALID:
                self._writer.retain()
            self._telemetry.save(snapshot.step, {
                "checkpoint/save_seconds": seconds, "checkpoint/stall_seconds": stall,
                "checkpoint/bytes": float(record.bytes)})
            log.info("saved sharded %s step %d: %.1f MB of this rank's shards, stall %.1f ms, "
                     "persisted in %.2f s (%s)", row.level.value, snapshot.step,
                     record.bytes / 1e6, stall * 1e3, seconds, intent.reason)
        finally:
            self._give_back(snapshot)
            self._writer.release_slot()

    def _refused_by_budget(self, snapshot: _Snapshot) -> bool:
        """(writer thread, collective) Rank 0 makes room under the disk budget for the whole
        step (``retention.max_bytes`` / ``min_free_bytes``); every rank learns its answer, so
        no rank enters a ``dcp.save`` that rank 0 refused."""
        if not self._policy.retention.budgeted:
            return False
        try:
            refusal = self._writer.make_room(snapshot.step, snapshot.nbytes)
        except (OSError, CkptPilotError, SQLAlchemyError) as e:
            # Not raised before the broadcast: the other ranks would wait in it for ever.
            refusal = DiskBudgetError(f"step {snapshot.step}: the disk budget could not be "
                                      f"checked: {e}")
        if self._group is not None:
            refused = torch.tensor([int(refusal is not None)], dtype=torch.int64)
            dist.broadcast(refused, src=0, group=self._group)
            if refused.item() and refusal is None:
                refusal = DiskBudgetError(
                    f"step {snapshot.step}: rank 0 found no room for it under the disk "
                    "budget (rank 0's log says why)")
        if refusal is None:
            return False
        self._writer.refuse(snapshot.step, snapshot.nbytes, refusal)
        return True
