"""Sharded training state — FSDP2 ``fully_shard``, or DTensors on a device mesh — saved and
restored by the pilot through :mod:`ckptpilot.dcp`, resharded when the number of ranks changed.

This module owns the pilot's path for a model that holds DTensors (``state.holds_dtensors``;
every other model keeps the replicated path: ``state.capture`` and the writer's tiers):

- capture, on the training thread: DCP's view of the model and optimizer
  (``get_state_dict``: fully qualified names, DTensors as sharded), each rank's local shards
  copied into host buffers the snapshot owns (kept from save to save while the layout stays:
  the stall is a memcpy), and the rest of the training state — LR scheduler, scaler, data
  cursor, RNG, extras, step — captured by ``state.capture`` as in a replicated run;
- the save, on the writer thread, queued behind its other jobs and inside its back-pressure:
  ``dcp.save`` through :class:`ckptpilot.dcp.Writer` on a gloo process group of its own, so
  its collectives never interleave with the training thread's;
- the restore, collective: every rank walks the same list of steps, loads a step with
  ``dcp.load`` through :class:`ckptpilot.dcp.Reader` (every item verified as it is read)
  into host buffers — nothing live changes until the step has loaded on every rank — walks
  back together past a step that any rank cannot read, and applies it (``set_state_dict``).

A sharded checkpoint is one DCP checkpoint, ``dcp_step_N``, with one metadata row per rank:
``model/<fqn>`` and ``optimizer/state/<fqn>/<name>``, the global tensors as they were sharded
(DCP reshards them on load), and per rank ``rank/<r>/meta``, a JSON document stored as a
uint8 tensor (format :data:`SHARDED_FORMAT`): the model and optimizer trees around their
tensors (param groups and every other non-tensor value), the rest of the state in
``state.capture``'s form with its tensors (RNG, …) at ``rank/<r>/<name>``, and the data
cursor's data-parallel rank and degree. DCP's own "bytes" items (non-tensor values) are never
written, and a restore asks DCP for tensors only: a checkpoint that holds anything else where
the pilot expects a tensor is refused naming the key. (``ckptpilot.dcp`` would not unpickle
one anyway: it loads a non-tensor value from its JSON in the commit file.)

Across a change of the number of ranks: DCP reshards the global tensors; rank r resumes the
per-rank state (RNG, LR scheduler, scaler, extras) of saved rank r, or of r mod N for a rank
the saved run (N ranks) did not have; the data cursor is redistributed over the cursors of
every saved data-parallel rank (:func:`resume_cursor`), or refused. The memory and peer tiers
hold one rank's replicated state: they take no sharded save, and no sharded restore reads
them.

Long because capture, save, the collective restore and resharding all read and write one
layout (the key scheme and the per-rank meta document above); split, each part would have to
re-derive it, and a change to it would have to land in several modules at once.

It must not decide when to save (the pilot, the scheduler) nor how bytes are laid out and
verified (``ckptpilot.dcp``). Threading: ``save``, ``restore`` and ``apply`` run on the
training thread; the ``dcp.save`` of a save on the writer thread.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from sqlalchemy.exc import SQLAlchemyError
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from ckptpilot.agreement import RankAgreement
from ckptpilot.autoprune import DiskBudgetError
from ckptpilot.catalog import Catalog, SaveIntent
from ckptpilot.dcp import Reader, Writer, dcp_name
from ckptpilot.dcp.reader import usable_steps
from ckptpilot.dcp.storage import entry_of, is_dcp_entry, list_dcp, remote_of, rows_of, verify_dcp
from ckptpilot.dcp.writer import codec_selector
from ckptpilot.errors import CheckpointFormatError, CkptPilotError, NoCheckpointError, StateError
from ckptpilot.policy import Policy
from ckptpilot.restorer import Read, Restored, SkippedCheckpoint
from ckptpilot.saveplan import plan_save
from ckptpilot.state import Stateful, TrainingComponents, apply, capture, decode, encode_tree
from ckptpilot.telemetry import Telemetry
from ckptpilot.tiers.remote import STAGING_MARK
from ckptpilot.vocab import Level, RecoverySource, RetentionClass, Status, Tier
from ckptpilot.writer import CheckpointWriter, SaveRecord

__all__ = ["SHARDED_FORMAT", "SHARDED_FORMAT_VERSION", "ShardedState",
           "resume_cursor"]

log = logging.getLogger("ckptpilot")

SHARDED_FORMAT = "ckptpilot-sharded"
SHARDED_FORMAT_VERSION = 1

_NO_MODEL = torch.nn.Module()  # stands in for the model when state.capture takes the rest
_Layout = tuple[tuple[str, torch.dtype, tuple[int, ...], tuple[int, ...], str], ...]


def _data_parallel(cursor: object) -> dict[str, int] | None:
    """How a data cursor says it is split: ``num_replicas`` cursors, this one ``rank``."""
    degree, rank = getattr(cursor, "num_replicas", None), getattr(cursor, "rank", None)
    if isinstance(degree, int) and isinstance(rank, int):
        return {"degree": degree, "rank": rank}
    return None


def resume_cursor(cursor: Stateful | None,
                  saved: Mapping[int, tuple[Any, Mapping[str, int] | None]], *, rank: int,
                  world_size: int, saved_world_size: int) -> Callable[[], None]:
    """How the live data cursor resumes: ``saved`` maps saved ranks to their cursor state and
    data-parallel split (every saved rank when the world size changed, else this rank's).

    Returns the action that loads it, after every check passed (``StateError`` otherwise):
    the same split loads the saved state of this data-parallel rank; another degree hands
    the states of every saved data-parallel rank, in order, to the cursor's
    ``load_resharded``. A cursor that does not say how it is split (``num_replicas`` and
    ``rank`` attributes) resumes only with the world size it was saved with.
    """
    if cursor is None:
        return lambda: None
    live = _data_parallel(cursor)
    what = type(cursor).__name__
    if saved_world_size == world_size:
        state, split = saved[rank]
        if live is None or split is None or split == live:
            return partial(cursor.load_state_dict, state)
        raise StateError(
            f"data_state: {what} was saved as data-parallel rank {split['rank']} of "
            f"{split['degree']} and is rank {live['rank']} of {live['degree']} now, with the "
            f"same {world_size} ranks: a new mesh shape at the same world size is not "
            "redistributed; resume with the saved data-parallel degree")
    splits = [split for _, split in saved.values()]
    if live is None or any(split is None for split in splits):
        raise StateError(
            f"data_state: the checkpoint was saved by {saved_world_size} ranks and this run "
            f"has {world_size}, but {what} does not say how it is split across data-parallel "
            "ranks (num_replicas and rank attributes, and load_resharded(states)), so its "
            "position cannot be redistributed exactly; use ckptpilot.ResumableSampler(..., "
            f"num_replicas=D, rank=d), or resume with {saved_world_size} ranks")
    degrees = {split["degree"] for split in splits if split is not None}
    by_dp: dict[int, Any] = {}
    for r in sorted(saved):
        state, split = saved[r]
        assert split is not None
        by_dp.setdefault(split["rank"], state)
    if len(degrees) != 1 or sorted(by_dp) != list(range(next(iter(degrees)))):
        raise StateError(f"data_state: the saved cursors are of data-parallel degrees "
                         f"{sorted(degrees)} and ranks {sorted(by_dp)}, not one full set")
    degree = degrees.pop()
    if live["degree"] == degree:
        return partial(cursor.load_state_dict, by_dp[live["rank"]])
    reshard = getattr(cursor, "load_resharded", None)
    if reshard is None:
        raise StateError(
            f"data_state: saved by {degree} data-parallel ranks, this run has "
            f"{live['degree']}, and {what} has no load_resharded(states) to deal out the rest "
            "of the epoch among them; use ckptpilot.ResumableSampler, or resume with "
            f"{degree} data-parallel ranks")
    return partial(reshard, [by_dp[d] for d in range(degree)])


@dataclass
class _Snapshot:
    """One step's sharded state, in host memory the snapshot owns: ``state`` is what
    ``dcp.save`` writes; ``shards`` the reusable host copies of the global tensors in it."""

    step: int
    state: dict[str, torch.Tensor]
    shards: dict[str, torch.Tensor]
    layout: _Layout
    nbytes: int


@dataclass
class _Load:
    """One step, ready for ``dcp.load``: where every tensor lands (host buffers), and what
    the read needs to become a :class:`~ckptpilot.restorer.Read`."""

    reader: Reader
    state: dict[str, torch.Tensor]
    devices: dict[str, torch.device]
    saved_world_size: int
    source: int  # the saved rank whose per-rank state this rank resumes
    metas: list[int]  # the saved ranks whose meta is read
    level: Level


class _NotThePilots(CheckpointFormatError):
    """A DCP checkpoint of the run that the pilot did not write (``dcp.save`` called with
    ``ckptpilot.dcp.Writer`` directly): passed over, not condemned."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _layout(sources: Mapping[str, torch.Tensor]) -> _Layout:
    return tuple((name, t.dtype, tuple(_local(t).shape), tuple(t.shape),
                  repr(t.placements) if isinstance(t, DTensor) else "")
                 for name, t in sources.items())


def _host_like(src: torch.Tensor, pin: bool) -> torch.Tensor:
    """An empty host tensor shaped like ``src``'s local part, a DTensor of the same mesh and
    placements when ``src`` is one: what DCP writes from or reads into."""
    local = _local(src)
    host = torch.empty(local.shape, dtype=local.dtype, pin_memory=pin)
    if isinstance(src, DTensor):
        return DTensor.from_local(host, src.device_mesh, src.placements, run_check=False,
                                  shape=src.shape, stride=src.stride())
    return host


def _json_tensor(value: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def _failures(error: CheckpointException) -> dict[int, BaseException]:
    """The exception of each failed rank (DCP keeps some with their traceback)."""
    return {rank: f[0] if isinstance(f, tuple) else f for rank, f in error.failures.items()}


def _why(error: BaseException) -> str:
    """One line per failed rank instead of DCP's tracebacks."""
    if isinstance(error, CheckpointException):
        return "; ".join(f"rank {rank}: {e}" for rank, e in sorted(_failures(error).items()))
    return str(error)


class ShardedState:
    """One rank's save and restore of a sharded training state; see the module docstring.

    ``save`` and ``restore`` are collective: every rank of the run calls them, in the same
    order (the pilot's scheduled saves are agreed steps; ``save()``, ``report_metric()`` and
    ``close()`` of a sharded run must be called on every rank).
    """

    def __init__(self, policy: Policy, components: TrainingComponents, *, catalog: Catalog,
                 writer: CheckpointWriter, telemetry: Telemetry,
                 agreement: RankAgreement | None, rank: int, world_size: int) -> None:
        self._policy = policy
        self._components = components
        self._catalog = catalog
        self._writer = writer
        self._telemetry = telemetry
        self._agreement = agreement
        self._rank = rank
        self._world_size = world_size
        self._remote = remote_of(policy)
        # DCP's collectives run on the writer thread while training runs its own: on one
        # process group they could interleave differently on different ranks.
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._selector = codec_selector(policy)  # one per run: auto's trials carry over
        self._free: list[_Snapshot] = []  # host copies to reuse, at most async.max_pending
        self._max_free = policy.async_.max_pending
        self._lock = threading.Lock()
        mem, peer = policy.tiers.memory.enabled, policy.tiers.peer.enabled
        if mem or peer:
            log.info("sharded state: saves go to the remote tier only (ckptpilot.dcp); the "
                     "memory and peer tiers hold one rank's replicated state")

    # -- save ------------------------------------------------------------------------------

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
        layout = _layout(sources)
        shards = self._reusable(layout)
        cuda = any(_local(t).is_cuda for t in sources.values())
        if shards is None:
            shards = {name: _host_like(t, cuda) for name, t in sources.items()}
        for name, src in sources.items():
            _local(shards[name]).copy_(_local(src).detach(), non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        rest = capture(TrainingComponents(model=_NO_MODEL, lr_scheduler=c.lr_scheduler,
                                          scaler=c.scaler, data_state=c.data_state),
                       step=step, epoch=epoch, extras=extras, rank=self._rank,
                       world_size=self._world_size)
        meta = {"format": SHARDED_FORMAT, "format_version": SHARDED_FORMAT_VERSION,
                "step": step, "epoch": epoch, "rank": self._rank,
                "world_size": self._world_size, "model": model_tree, "optimizer": optim_tree,
                "state": rest.meta, "data_parallel": _data_parallel(c.data_state)}
        prefix = f"rank/{self._rank}/"
        state = dict(shards)
        state[prefix + "meta"] = _json_tensor(meta)
        state.update((prefix + name, t) for name, t in rest.tensors.items())
        nbytes = sum(_local(t).numel() * t.element_size() for t in state.values())
        return _Snapshot(step, state, shards, layout, nbytes)

    def _reusable(self, layout: _Layout) -> dict[str, torch.Tensor] | None:
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

    # -- restore ---------------------------------------------------------------------------

    def restore(self, step: int | None, apply: Callable[[Read], None], *,
                before: int | None = None,
                prepare: Callable[[], None] | None = None) -> Restored | None:
        """The sharded :meth:`ckptpilot.restorer.Restorer.restore`: the same contract (the
        newest step that loads, or exactly ``step``, or with ``before`` the newest below it
        and None when none loads; ``NoCheckpointError`` when checkpoints exist but none
        loads), with every rank on the same step, resharded when the world size changed."""
        failure: BaseException | None = None
        try:
            if prepare is not None:
                prepare()
            if self._rank == 0:
                self._settle_killed_saves()
        except BaseException as e:
            failure = e
        self._together(-1 if failure is not None else 1, failure, "preparing the restore")
        steps: list[int] = []
        skipped: list[SkippedCheckpoint] = []
        try:  # every rank lists after rank 0 settled what a killed save left
            steps, skipped = self._candidates(step, before)
        except BaseException as e:
            if self._agreement is None:
                raise
            failure = e
        if self._agreement is not None:
            steps = self._agreement.common_steps(steps, failure)
        for target in steps:
            read = self._try(target, apply, skipped)
            if read is not None:
                self._after(target, read)
                return Restored(target, read, tuple(skipped))
        if before is not None:
            for item in skipped:
                log.warning("cannot roll back to %s: %s", item.location, item.reason)
            return None
        refuse = bool(skipped) or step is not None
        if self._agreement is not None:
            refuse = self._agreement.vote(int(not refuse)) == 0
        if refuse:
            what = f"step {step}" if step is not None else "any step"
            first = skipped[0] if skipped else SkippedCheckpoint(self._remote.url, "none found")
            raise NoCheckpointError(
                f"rank {self._rank} cannot load {what} of the sharded state: none of the "
                f"{len(skipped)} DCP checkpoints recorded or found in {self._remote.url} "
                f"loads on every rank; newest: {first.location}: {first.reason}")
        return Restored(0, None, tuple(skipped))

    def _candidates(self, step: int | None, before: int | None
                    ) -> tuple[list[int], list[SkippedCheckpoint]]:
        remote = self._remote
        if step is not None:
            if step in dict(list_dcp(remote)):
                return [step], []
            return [], [SkippedCheckpoint(remote.path(dcp_name(step)), "not published")]
        steps, passed = usable_steps(self._policy, remote)
        if before is not None:
            steps = [s for s in steps if s < before]
            passed = [(s, why) for s, why in passed if s < before]
        return steps, [SkippedCheckpoint(remote.path(dcp_name(s)), why) for s, why in passed]

    def _together(self, vote: int, failure: BaseException | None, where: str) -> int:
        """Every rank's ``vote`` (1 ok, 0 cannot read, -1 failed) reduced to its minimum;
        raises on every rank when one failed."""
        if self._agreement is None:
            if failure is not None:
                raise failure
            return vote
        agreed = self._agreement.vote(vote)
        self._agreement.raise_if_failed(agreed, failure, where)
        return agreed

    def _try(self, target: int, apply: Callable[[Read], None],
             skipped: list[SkippedCheckpoint]) -> Read | None:
        """Load and apply ``target`` on every rank, or on none (then why is in ``skipped``)."""
        where = self._remote.path(dcp_name(target))
        load: _Load | None = None
        read: Read | None = None
        why: BaseException | None = None
        failure: BaseException | None = None
        try:
            load = self._plan_load(target)
        except (CheckpointFormatError, OSError) as e:  # not StateError: the live state misfits
            why = e
        except BaseException as e:
            failure = e
        if self._skip(target, where, why, failure, skipped, "reading its metadata"):
            return None
        assert load is not None
        try:
            dcp.load(load.state, storage_reader=load.reader, process_group=self._group,
                     no_dist=self._group is None)
            read = self._read(target, load)
        except CheckpointException as e:  # raised on every rank, whichever rank failed
            errors = _failures(e).values()
            if all(isinstance(x, (CheckpointFormatError, OSError)) for x in errors):
                why = e
            else:
                failure = e
        except (CheckpointFormatError, OSError) as e:
            why = e
        except BaseException as e:
            failure = e
        if self._skip(target, where, why, failure, skipped, "loading it"):
            return None
        assert read is not None
        try:
            apply(read)
        except BaseException as e:
            failure = e
        self._together(-1 if failure is not None else 1, failure, f"applying step {target}")
        return read

    def _skip(self, target: int, where: str, why: BaseException | None,
              failure: BaseException | None, skipped: list[SkippedCheckpoint],
              doing: str) -> bool:
        """Whether every rank passes over ``target`` (one cannot read it); raises on every
        rank when one failed otherwise. The first rank condemns the step's rows when its
        bytes are wrong, so that no restore tries it again."""
        vote = -1 if failure is not None else 0 if why is not None else 1
        if self._together(vote, failure, f"{doing}: step {target}") == 1:
            return False
        reason = _why(why) if why is not None else f"another rank cannot read step {target}"
        log.warning("skipping sharded checkpoint %s: %s", where, reason)
        skipped.append(SkippedCheckpoint(where, reason))
        if isinstance(why, CheckpointException):
            wrong_bytes = any(isinstance(x, CheckpointFormatError)
                              for x in _failures(why).values())
        else:
            wrong_bytes = isinstance(why, CheckpointFormatError) and not isinstance(
                why, _NotThePilots)
        if wrong_bytes:
            self._condemn(target, reason)
        return True

    def _condemn(self, step: int, reason: str) -> None:
        """(first rank) Every rank's row of the step: the checkpoint is one."""
        if self._rank != 0:
            return
        catalog = self._catalog
        for row in rows_of(catalog.store, catalog.run_id, step, dcp_name(step)):
            if row.status in (Status.VALID, Status.PENDING):
                catalog.moves.condemn(row.key, f"failed on restore: {reason}")

    def _plan_load(self, target: int) -> _Load:
        """(local) The host buffers ``dcp.load`` of ``target`` fills: the live model's and
        optimizer's tensors, checked against the checkpoint's, and the per-rank items this
        rank needs."""
        reader = Reader(self._policy, step=target)
        entries = reader.read_metadata().state_dict_metadata
        saved_world = int(reader.manifest["world_size"])
        if any(f"rank/{r}/meta" not in entries for r in range(saved_world)):
            raise _NotThePilots(f"{reader.checkpoint_id}: not a sharded checkpoint of "
                                "CheckpointPilot (no rank/<r>/meta for every rank)")
        state, devices = self._template(entries, reader.checkpoint_id)
        source = self._rank % saved_world
        metas = list(range(saved_world)) if saved_world != self._world_size else [source]
        for key, entry in entries.items():
            r, _, name = key.removeprefix("rank/").partition("/")
            if not key.startswith("rank/") or not r.isdigit():
                continue
            if int(r) == source or (int(r) in metas and (
                    name == "meta" or name.startswith("data_state/"))):
                if not isinstance(entry, TensorStorageMetadata):
                    raise CheckpointFormatError(f"{reader.checkpoint_id}: {key} is no tensor")
                state[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
        return _Load(reader, state, devices, saved_world, source, metas,
                     Level(reader.manifest["level"]))

    def _template(self, entries: Mapping[str, Any], where: str
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.device]]:
        """Host buffers shaped like the live model's and optimizer's tensors (their live
        sharding), for the tensors the checkpoint holds; a model tensor missing from it, one
        it holds that the live model lacks, or one of another shape or dtype is refused
        naming the key."""
        c = self._components
        if c.optimizer is None:
            model_sd, optim_sd = get_model_state_dict(c.model), None
        else:
            model_sd, optim_sd = get_state_dict(c.model, c.optimizer)
        _, live = encode_tree(model_sd, "model")
        saved_model = {k for k in entries if k.startswith("model/")}
        missing, unexpected = sorted(set(live) - saved_model), sorted(saved_model - set(live))
        if missing or unexpected:
            raise StateError(f"{where}: model keys differ from the checkpoint: missing "
                             f"{missing[:5]}, unexpected {unexpected[:5]}")
        if optim_sd is not None:
            _, optim = encode_tree(optim_sd, "optimizer")
            saved_optim = {k for k in entries if k.startswith("optimizer/")}
            unknown = sorted(saved_optim - set(optim))
            if unknown:
                raise StateError(f"{where}: the checkpoint holds optimizer state the live "
                                 f"optimizer has no place for: {unknown[:5]}")
            live.update((k, t) for k, t in optim.items() if k in saved_optim)
        state, devices = {}, {}
        for name, tensor in live.items():
            entry = entries[name]
            if (not isinstance(entry, TensorStorageMetadata)
                    or tuple(entry.size) != tuple(tensor.shape)
                    or entry.properties.dtype != tensor.dtype):
                saved = (f"{entry.properties.dtype} {list(entry.size)}"
                         if isinstance(entry, TensorStorageMetadata) else "no tensor")
                raise StateError(f"{where}: {name}: the checkpoint has {saved}, the live "
                                 f"state {tensor.dtype} {list(tensor.shape)}")
            state[name] = _host_like(tensor, pin=False)
            devices[name] = _local(tensor).device
        return state, devices

    def _read(self, target: int, load: _Load) -> Read:
        """The loaded step as the pilot applies it: ``meta["sharded"]`` holds the per-rank
        documents read (by saved rank), the source rank and the saved world size."""
        metas: dict[int, Any] = {}
        for r in load.metas:
            raw = bytes(load.state[f"rank/{r}/meta"].numpy())
            where = f"{load.reader.checkpoint_id}: rank/{r}/meta"
            try:
                meta = json.loads(raw)
            except (ValueError, RecursionError) as e:  # JSON, UTF-8, an int too long
                raise CheckpointFormatError(f"{where}: not valid JSON ({e})") from e
            if not isinstance(meta, dict):
                raise CheckpointFormatError(f"{where}: a JSON {type(meta).__name__}, not an "
                                            "object")
            if (meta.get("format"), meta.get("format_version")) != (SHARDED_FORMAT,
                                                                   SHARDED_FORMAT_VERSION):
                raise CheckpointFormatError(
                    f"{where}: format {meta.get('format')!r} version "
                    f"{meta.get('format_version')!r} is not {SHARDED_FORMAT} version "
                    f"{SHARDED_FORMAT_VERSION}")
            metas[r] = meta
        state, devices = load.state, load.devices

        def get_tensor(name: str) -> torch.Tensor:
            try:
                tensor = state[name]
            except KeyError:
                raise CheckpointFormatError(f"{load.reader.checkpoint_id}: state refers to "
                                            f"tensor {name!r}, which was not read") from None
            device = devices.get(name)
            if device is None or device.type == "cpu":
                return tensor
            if isinstance(tensor, DTensor):
                return DTensor.from_local(tensor.to_local().to(device), tensor.device_mesh,
                                          tensor.placements, run_check=False,
                                          shape=tensor.shape, stride=tensor.stride())
            return tensor.to(device)

        source = metas[load.source]
        meta = {"step": target, "epoch": source.get("epoch"),
                "sharded": {"source": load.source, "world_size": load.saved_world_size,
                            "ranks": metas}}
        return Read(RecoverySource.REMOTE, load.level, load.reader.checkpoint_id,
                    load.reader.bytes_read, meta, get_tensor)

    def apply(self, components: TrainingComponents, meta: Mapping[str, Any],
              get_tensor: Callable[[str], torch.Tensor]) -> dict[str, Any]:
        """Load a step read by :meth:`restore` into the live objects; returns the extras.
        The data cursor is checked (and loaded) first, then the rest of the state (checked
        before it changes), then the model and optimizer (``set_state_dict``)."""
        sharded = meta["sharded"]
        ranks: Mapping[int, Any] = sharded["ranks"]
        source = sharded["source"]

        def of_rank(r: int) -> Callable[[str], torch.Tensor]:
            return lambda name: get_tensor(f"rank/{r}/{name}")

        if components.data_state is not None and any(
                m["state"]["data_state"] is None for m in ranks.values()):
            raise StateError("data_state: the checkpoint holds no data_state state but one "
                             "was given")
        saved = {r: (decode(m["state"]["data_state"], of_rank(r)), m["data_parallel"])
                 for r, m in ranks.items()}
        resume_cursor(components.data_state, saved, rank=self._rank,
                      world_size=self._world_size,
                      saved_world_size=sharded["world_size"])()
        own = ranks[source]
        extras = apply(TrainingComponents(model=_NO_MODEL, lr_scheduler=components.lr_scheduler,
                                          scaler=components.scaler),
                       own["state"], of_rank(source))
        model_sd = decode(own["model"], get_tensor)
        if components.optimizer is None:
            set_model_state_dict(components.model, model_sd)
        elif own["optimizer"] is None:
            raise StateError("optimizer: the checkpoint holds no optimizer state but one was "
                             "given")
        else:
            set_state_dict(components.model, components.optimizer, model_state_dict=model_sd,
                           optim_state_dict=decode(own["optimizer"], get_tensor))
        return extras

    def _after(self, step: int, read: Read) -> None:
        saved_world = read.meta["sharded"]["world_size"]
        if saved_world != self._world_size:
            log.warning("step %d was saved by %d ranks and this run has %d: resharded from "
                        "the remote tier (%s); rank-local tiers (memory, peer) are never "
                        "trusted across a world-size change", step, saved_world,
                        self._world_size, read.location)
        if self._rank == 0:  # the rows of saved ranks this run does not have, abandoned too
            catalog = self._catalog
            for row in catalog.store.rows(catalog.run_id, tier=Tier.REMOTE,
                                          status=(Status.VALID, Status.PENDING)):
                if row.step > step and row.rank >= self._world_size:
                    catalog.moves.abandon(row.key,
                                          f"abandoned: the run was restored to step {step}")

    def _settle_killed_saves(self) -> None:
        """(first rank) What a killed save left: its staging directory is removed; the rows
        it left ``pending`` become ``valid`` when the checkpoint was published (killed
        after the commit file) and verifies, else ``corrupted``."""
        remote, store, run_id = self._remote, self._catalog.store, self._catalog.run_id
        try:
            entries = remote.list()
        except OSError as e:
            log.warning("cannot list the remote tier %s: %s", remote.url, e)
            return
        for name in entries:
            if STAGING_MARK in name and is_dcp_entry(name):
                log.warning("removing %s: a sharded save that never finished (writer killed)",
                            remote.path(name))
                remote.remove(name)
        published = dict(list_dcp(remote))
        pending = [r for r in store.rows(run_id, tier=Tier.REMOTE, status=Status.PENDING)
                   if is_dcp_entry(entry_of(r.location))]
        for step in sorted({r.step for r in pending}):
            rows = [r for r in pending if r.step == step]
            note, location = "the writer died before the checkpoint was published", None
            if step in published:
                try:
                    verify_dcp(remote, published[step], ranks={r.rank: r.sha256 for r in rows})
                    note = "published, then the writer died: verified"
                    location = remote.path(published[step])
                except (CheckpointFormatError, OSError) as e:
                    note = f"published, then the writer died; does not verify: {e}"
            for row in rows:
                if location is None:
                    self._catalog.moves.condemn(row.key, note)
                else:
                    self._catalog.moves.publish(row.key, note=note, location=location)
