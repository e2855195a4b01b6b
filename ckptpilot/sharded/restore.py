"""The restore side of a sharded training state, collective: every rank walks the same
list of steps, loads a step with ``dcp.load`` through :class:`ckptpilot.dcp.Reader` (every item
verified as it is read) into host buffers — nothing live changes until the step has loaded on
every rank — walks back together past a step that any rank cannot read, and applies it
(``set_state_dict``), resharded when the world size changed. Rank 0 also settles what a killed
save left.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
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
from ckptpilot.capture.state import TrainingComponents, apply, decode, encode_tree
from ckptpilot.catalog import Catalog
from ckptpilot.dcp import Reader, dcp_name
from ckptpilot.dcp.reader import usable_steps
from ckptpilot.dcp.storage import entry_of, is_dcp_entry, list_dcp, remote_of, rows_of, verify_dcp
from ckptpilot.errors import CheckpointFormatError, NoCheckpointError, StateError
from ckptpilot.policy import Policy
from ckptpilot.restorer import Read, Restored, SkippedCheckpoint
from ckptpilot.sharded.meta import (
    NO_MODEL,
    SHARDED_FORMAT,
    SHARDED_FORMAT_VERSION,
    host_like,
    local_part,
    rank_failures,
    resume_cursor,
    why_failed,
)
from ckptpilot.tiers.remote.store import STAGING_MARK
from ckptpilot.vocab import Level, RecoverySource, Status, Tier

log = logging.getLogger("ckptpilot")


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


class ShardedRestorer:
    """One rank's restores of a sharded training state (:meth:`ShardedState.restore` and
    :meth:`ShardedState.apply`), on the training thread; every method that votes is
    collective."""

    def __init__(self, policy: Policy, components: TrainingComponents, *, catalog: Catalog,
                 agreement: RankAgreement | None, rank: int, world_size: int,
                 group: dist.ProcessGroup | None) -> None:
        self._policy = policy
        self._components = components
        self._catalog = catalog
        self._agreement = agreement
        self._rank = rank
        self._world_size = world_size
        self._remote = remote_of(policy)
        self._group = group

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
            errors = rank_failures(e).values()
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
        reason = why_failed(why) if why is not None else f"another rank cannot read step {target}"
        log.warning("skipping sharded checkpoint %s: %s", where, reason)
        skipped.append(SkippedCheckpoint(where, reason))
        if isinstance(why, CheckpointException):
            wrong_bytes = any(isinstance(x, CheckpointFormatError)
                              for x in rank_failures(why).values())
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
            state[name] = host_like(tensor, pin=False)
            devices[name] = local_part(tensor).device
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
        extras = apply(TrainingComponents(model=NO_MODEL, lr_scheduler=components.lr_scheduler,
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
