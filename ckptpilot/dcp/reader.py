"""``Reader``: a ``torch.distributed.checkpoint`` StorageReader for checkpoints written by
:class:`~ckptpilot.dcp.Writer`, verifying every byte it uses.

Which checkpoint: ``step=N`` loads step N from storage (its commit file must be there, and
must be the checkpoint the metadata rows recorded, when there are rows); ``step=None`` the
newest step whose rows are ``valid`` on every rank of its save and whose directory is
published — chosen in the constructor, so that ``reader.step`` says what a load will read
and an empty or damaged run raises ``NoCheckpointError`` (with what was skipped and why)
before DCP starts. Read-only: it opens the metadata store read-only and changes nothing.

Lifecycle (DCP calls it in this order, on every rank): ``read_metadata`` (the commit file,
checked, turned into DCP's ``Metadata``; DCP's pickled ``.metadata`` is never read),
``set_up_storage_reader``, ``prepare_local_plan`` and (coordinator) ``prepare_global_plan``
(both unchanged), ``read_data``: each tensor item a request needs is read once, whole, and
its SHA256 checked before any of it is used — a request for part of a saved chunk (another
sharding) verifies exactly the item its bytes come from; a non-tensor value comes from the
commit file, checked with it. A mismatch or a short file raises
``CheckpointFormatError`` naming the file, the item (fqn, chunk offset) and its byte range;
DCP reports it from every rank as a ``CheckpointException``.

Nothing read from storage is unpickled. Tensors are rebuilt from their storage records
(``dcp.format``). A non-tensor value (DCP's "bytes" item) is decoded from its JSON in the
verified commit file (``dcp.values``: only None, bool, int, float, str, lists, tuples and
dicts are built); the pickle beside it in the data file, there for stock readers, is never
read. DCP's ``LoadPlanner.load_bytes`` takes a value only as a stream that it passes to
``torch.load`` (``DefaultLoadPlanner``: with ``weights_only=False``), so the stream handed
to it is ``torch.save`` of that decoded value, made here: what the planner unpickles is plain
data this process built, never bytes from storage. A version 1 "bytes" item, a pickle only, is
refused when a load asks for it, naming the item (``dcp.format.pickled_refusal``).
Threading: DCP's thread calls the methods, one at a time.
"""

from __future__ import annotations

import io
import os
import uuid
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptpilot.dcp.format import (
    Encoding,
    ItemRecord,
    checkpoint_metadata,
    dcp_name,
    decode_item_tensor,
    item_value,
    narrow,
)
from ckptpilot.dcp.storage import (
    entry_of,
    is_dcp_entry,
    list_dcp,
    read_item,
    read_manifest,
    remote_of,
    resolve_policy,
    verify_parts,
)
from ckptpilot.errors import CheckpointFormatError, NoCheckpointError
from ckptpilot.policy import Policy
from ckptpilot.rundir import metadata_path, read_run_id
from ckptpilot.storage.metadata import CheckpointRow, MetadataStore
from ckptpilot.tiers.remote.store import RemoteTier
from ckptpilot.vocab import Status, Tier

__all__ = ["Reader", "recorded_rows", "usable_steps"]


class Reader(StorageReader):
    """Loads step ``step`` (None: the newest valid one) of the run in ``target`` (a run
    directory, or a resolved :class:`~ckptpilot.policy.Policy`); see the module docstring.

    ``skipped`` lists (step, why) for every newer checkpoint passed over by ``step=None``.
    ``remote``: the store to read, when not ``tiers.remote`` of the policy (a tier's own).
    """

    def __init__(self, target: Policy | str | os.PathLike[str], *,
                 step: int | None = None, remote: RemoteTier | None = None) -> None:
        super().__init__()
        self.policy = resolve_policy(target)
        self.remote = remote_of(self.policy) if remote is None else remote
        self.skipped: list[tuple[int, str]] = []
        recorded = recorded_rows(self.policy)
        self.step = self._newest(recorded) if step is None else step
        self.name = dcp_name(self.step)
        # {rank: part SHA256} of the rows at this checkpoint's directory, whatever their status
        self._parts = {row.rank: row.sha256 for row in recorded.get(self.step, [])}
        self.load_id = uuid.uuid4().hex
        self._items: dict[MetadataIndex, ItemRecord] = {}
        self.bytes_read = 0  # the items read_data read (and verified), over every load
        self.manifest: dict[str, Any] = {}  # the commit file, once read_metadata read it

    # -- StorageReader ----------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            raise ValueError(
                f"ckptpilot.dcp.Reader reads by step (now {self.name} under "
                f"{self.remote.url}); call dcp.load without checkpoint_id")
        self.load_id = uuid.uuid4().hex
        self._items = {}

    def read_metadata(self, *args: Any) -> Metadata:
        """DCP's ``Metadata`` from the commit file. Takes no ``rank``: DCP then does not look
        for rank-local metadata (never written here) and reports this method's error alone."""
        manifest = read_manifest(self.remote, self.name)
        verify_parts(self.remote.path(self.name), manifest, self._parts)
        self.manifest = manifest
        metadata = checkpoint_metadata(manifest, self.remote.path(self.name))
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        self._items = metadata.storage_data
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self._items = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        location = self.remote.path(self.name)
        wanted: dict[MetadataIndex, list[ReadItem]] = {}
        for req in plan.items:
            wanted.setdefault(req.storage_index, []).append(req)
        by_file: dict[str, list[tuple[MetadataIndex, ItemRecord]]] = {}
        for index, requests in wanted.items():
            rec = self._items.get(index)
            if rec is None:
                raise CheckpointFormatError(f"{location}: the manifest has no item "
                                            f"{index.fqn!r} at {index.offset}")
            _check_kind(requests, rec, rec.where(index, location))
            if rec.encoding is Encoding.BYTES:  # its value is in the verified commit file
                _apply_value(planner, requests, rec, rec.where(index, location))
            else:
                by_file.setdefault(rec.file, []).append((index, rec))
        for fname, entries in sorted(by_file.items()):
            with self.remote.open_read(f"{self.name}/{fname}") as f:
                for index, rec in sorted(entries, key=lambda e: e[1].at):
                    payload = read_item(f, rec, index, location)
                    self.bytes_read += rec.nbytes
                    _apply_tensor(planner, wanted[index], rec, payload,
                                  rec.where(index, location))
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @property
    def checkpoint_id(self) -> str:
        """The directory read (DCP logs it)."""
        return self.remote.path(self.name)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Never chosen by DCP from a bare ``checkpoint_id``: it needs a run."""
        return False

    # -- helpers ----------------------------------------------------------------------------

    def _newest(self, recorded: dict[int, list[CheckpointRow]]) -> int:
        steps, self.skipped = usable_steps(self.policy, self.remote, recorded, limit=1)
        if steps:
            return steps[0]
        run_dir = self.policy.run_dir
        found = "; ".join(f"step {s}: {why}" for s, why in self.skipped)
        raise NoCheckpointError(
            f"no valid DCP checkpoint in {self.remote.url} for the run in {run_dir}"
            + (f" ({found})" if found else " (no DCP save recorded in its metadata store)")
            + "; Reader(..., step=N) loads a step by its files alone")


def _check_kind(requests: list[ReadItem], rec: ItemRecord, where: str) -> None:
    if any((req.type == LoadItemType.BYTE_IO) != (rec.encoding is Encoding.BYTES)
           for req in requests):
        raise CheckpointFormatError(f"{where}: the load plan and the manifest disagree on "
                                    "whether it is a tensor")


def _apply_value(planner: LoadPlanner, requests: list[ReadItem], rec: ItemRecord,
                 where: str) -> None:
    """A non-tensor value to the planner, as a stream of plain data built here (the module
    docstring says why a stream)."""
    value = item_value(rec, where)
    for req in requests:
        stream = io.BytesIO()
        torch.save(value, stream)
        stream.seek(0)
        planner.load_bytes(req, stream)


def _apply_tensor(planner: LoadPlanner, requests: list[ReadItem], rec: ItemRecord,
                  payload: bytearray, where: str) -> None:
    saved = decode_item_tensor(rec, payload, where)
    for req in requests:
        piece = narrow(saved, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != piece.size():
            raise CheckpointFormatError(f"{where}: the load plan wants {list(target.size())}"
                                        f" of it, the item gives {list(piece.size())}")
        target.copy_(piece)
        planner.commit_tensor(req, target)


def recorded_rows(policy: Policy) -> dict[int, list[CheckpointRow]]:
    """The remote rows of the run at DCP checkpoint directories (published or staging), by
    step; empty without a store. Opens the store read-only."""
    run_dir = Path(policy.run_dir)
    run_id = read_run_id(run_dir)
    if run_id is None or not (metadata_path(run_dir)).exists():
        return {}
    by_step: dict[int, list[CheckpointRow]] = {}
    with MetadataStore(metadata_path(run_dir), read_only=True) as store:
        for row in store.rows(run_id, tier=Tier.REMOTE):
            if is_dcp_entry(entry_of(row.location)):
                by_step.setdefault(row.step, []).append(row)
    return by_step


def usable_steps(policy: Policy, remote: RemoteTier,
                 recorded: dict[int, list[CheckpointRow]] | None = None, *,
                 limit: int | None = None) -> tuple[list[int], list[tuple[int, str]]]:
    """The steps whose DCP save is ``valid`` on every rank of the save and published, newest
    first (at most ``limit``), and (step, why) for each recorded step passed over on the way.
    A usable step still has to verify as it is read."""
    if recorded is None:
        recorded = recorded_rows(policy)
    published = dict(list_dcp(remote))
    steps, skipped = [], []
    for step in sorted(recorded, reverse=True):
        why = _unusable(remote, step, recorded[step], published)
        if why is None:
            steps.append(step)
            if limit is not None and len(steps) >= limit:
                break
        else:
            skipped.append((step, why))
    return steps, skipped


def _unusable(remote: RemoteTier, step: int, rows: list[CheckpointRow],
              published: dict[int, str]) -> str | None:
    """Why the save of ``step`` cannot be loaded as a valid one, or None."""
    bad = sorted((r for r in rows if r.status is not Status.VALID), key=lambda r: r.rank)
    if bad:
        note = next((r.note for r in bad if r.note), "")
        return ", ".join(f"rank {r.rank} {r.status.value}" for r in bad) + (
            f" ({note})" if note else "")
    if step not in published:
        return (f"recorded valid but {remote.path(dcp_name(step))} is not published "
                "(deleted, or a wrong tiers.remote.url?)")
    try:
        manifest = read_manifest(remote, published[step])
    except (CheckpointFormatError, OSError) as e:
        return str(e)
    missing = set(range(int(manifest["world_size"]))) - {r.rank for r in rows}
    if missing:
        return f"no row for rank(s) {sorted(missing)}"
    return None
