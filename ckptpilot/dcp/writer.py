"""``Writer``: a ``torch.distributed.checkpoint`` StorageWriter that saves through ckptpilot's
remote tier and records every rank's part in the run's metadata store.

Lifecycle (DCP calls it in this order; one Writer per rank, one step per Writer):

1. (every rank) ``set_up_storage_writer`` — the rank DCP gives it. (DCP calls ``reset`` only
   for a ``checkpoint_id``, which is refused: the directory is named by ``step``.)
2. (every rank) ``prepare_local_plan`` — the plan unchanged.
3. (coordinator) ``prepare_global_plan`` — every live row of this step, on every rank, stops
   counting and its bytes are set aside (a run resumed from an earlier step saves a step
   again); the staging directory is made (locally ``dcp_step_N.staging-…``, on an object
   store ``dcp_step_N`` itself) and each rank's plan names it and the rank's one data file.
4. (every rank) ``write_data`` — the rank's items, streamed into its file while they are
   hashed (SHA256 per item, of the very bytes written); the rank's row recorded ``pending``
   with the SHA256 of its part; in the paranoid mode (``validation.paranoid`` and ``sha256``)
   the file re-read and checked, a mismatch marking the row ``corrupted`` and failing the save
   on every rank.
5. (coordinator, after every rank wrote) ``finish`` — DCP's ``.metadata`` (codecs off), then
   the commit file ``manifest.json`` last, then the publication (locally the staging
   directory's rename, on an object store the commit file's PUT), then every rank's row
   ``valid``. A save killed at any point before the publication leaves no checkpoint: no
   commit file means unfinished, and the rows stay ``pending``. One killed after it leaves a
   published checkpoint with ``pending`` rows, which ``ckptpilot validate`` settles.

Driven by a tier (``on_written`` given: the DCP-backed sharded tier,
``ckptpilot.tiers.sharded``) the same writer stops short of the publication, because there
the pilot's writer owns the rows and the two phases: ``prepare_global_plan`` retires no row
(the pilot's writer did, each rank its own), ``write_data`` records no row but hands the
rank's :class:`WrittenPart` to ``on_written`` (the pilot records it ``pending`` there, while
the collective still runs, so that a rank killed before it ends leaves its row, as a killed
save of any tier does), the read-back is the tier's validation, and ``finish`` writes DCP's
``.metadata`` and builds the commit file without writing it: :meth:`Writer.commit` (the
tier's ``publish``) writes it and publishes, :meth:`Writer.set_aside` (its ``abort``) keeps
the staging directory for inspection instead.

The policy's other checks (``validation.load_test``: a worker process decoding the archive
and comparing it with the live model) are the pilot's and are not run here: the read-back
re-hash is what stands between a bad write and a ``valid`` row.

A non-tensor value (DCP's "bytes" item) is recorded as JSON in the commit file
(``dcp.values``), which is what ``Reader`` loads; its file keeps DCP's ``torch.save`` of it, for
stock readers. The JSON comes from that very stream, read back with
``torch.load(weights_only=True)`` (bytes the planner made in this process a moment before,
not bytes from storage), so the value recorded is the one DCP serialised, whatever the
planner. A value with no JSON form (a set, bytes, an object, a tensor inside a tuple) fails
the save on that rank, naming the step and the item and saying what to store instead.

Codecs are off by default: the directory is then a plain DCP checkpoint that stock
``dcp.load`` with ``FileSystemReader`` reads. ``codecs=True`` encodes each tensor with the
policy's codecs (a self-contained blob per item, no delta) and writes no ``.metadata``, so a
stock reader refuses the directory instead of misreading it.

``dcp.async_save`` works as with any writer: DCP stages the state to CPU, then runs the steps
above on its own thread. Threading: DCP's thread calls the methods, one at a time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import pickle
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptpilot.catalog import Catalog, Moves, SaveIntent
from ckptpilot.codecs.selector import CodecSelector
from ckptpilot.dcp.format import (
    DCP_METADATA_FILE,
    MANIFEST_FILE,
    Encoding,
    ItemRecord,
    build_manifest,
    dcp_name,
    dtype_name,
    empty_part_digest,
    encode_manifest,
    part_digests,
)
from ckptpilot.dcp.storage import read_item, remote_of, resolve_policy, retire_step
from ckptpilot.dcp.values import canonical, encode_value, unsupported
from ckptpilot.errors import CheckpointFormatError
from ckptpilot.policy import Policy
from ckptpilot.rundir import metadata_path, run_identity
from ckptpilot.storage.metadata import MetadataStore
from ckptpilot.tiers.remote.store import HashingWriter, RemoteTier
from ckptpilot.vocab import CheckpointKey, Level, RetentionClass, Tier

__all__ = ["Writer", "WrittenPart"]


@dataclass(frozen=True)
class _Target:
    """Where one rank writes, chosen by the coordinator: the staging directory (relative to
    the tier's root) and the rank's data file in it."""

    staging: str
    file: str


@dataclass(frozen=True)
class WrittenPart:
    """One rank's part of a save, written and hashed, not yet published: what its
    ``pending`` row records. ``location``: the staging directory; ``file``: the rank's data
    file relative to the tier's root (None: the rank had no items); ``sha256``: the part's
    digest (``dcp.format.part_digests``), which the commit file records for the rank."""

    step: int
    rank: int
    location: str
    file: str | None
    sha256: str
    bytes_raw: int
    bytes_encoded: int
    codec: str
    resolve_seconds: float
    write_seconds: float
    items: Mapping[MetadataIndex, ItemRecord]


class _ItemStream:
    """What ``torch.save`` and the codecs write one item into: hashed on its own, and on to
    the data file (whose writer hashes and counts the whole file)."""

    def __init__(self, out: HashingWriter) -> None:
        self._out = out
        self._digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        self._digest.update(view)
        self._out.write(view)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        """``torch.save`` flushes; durability is the tier's, when the file is closed."""

    @property
    def sha256(self) -> str:
        return self._digest.hexdigest()


def _plain_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as ``torch.save`` must see it for a reader that takes the storage bytes
    as the tensor: on the CPU, contiguous, alone in its storage from byte 0."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if (not tensor.is_contiguous() or tensor.storage_offset() != 0
            or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()):
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def codec_selector(policy: Policy) -> CodecSelector:
    """The codec choice of a run's DCP saves, from its policy: keep one for the whole run and
    pass it to every :class:`Writer`."""
    codecs = policy.codecs
    return CodecSelector(
        {"weights": codecs.weights, "optimizer": codecs.optimizer, "other": codecs.other},
        bandwidth_bytes_per_s=policy.tiers.remote.bandwidth, level=codecs.zstd_level,
        prefix_bits=codecs.prefix_bits, threads=codecs.threads)


class Writer(StorageWriter):
    """Saves a DCP state dict as step ``step`` of the run in ``target`` (a run directory, or
    a resolved :class:`~ckptpilot.policy.Policy` whose ``tiers.remote`` is used); see the
    module docstring for the call order.

    ``reason``, ``retention_class`` and ``score`` go to every rank's row and the commit
    file, as the pilot's saves record theirs (``ckptpilot prune`` keeps by them). The level
    is ``level``, by default ``organ`` with codecs off and ``pulse`` with them
    (``vocab.Level``). ``on_written``: driven by a tier (module docstring); ``remote``: the
    store to write to, when not ``tiers.remote`` of the policy (the tier's own);
    ``branches``: every rank's continuation id (``storage.lineage``), which the commit file
    records (the coordinator's Writer needs them; a tier gathers them).
    """

    def __init__(self, target: Policy | str | os.PathLike[str], *, step: int,
                 codecs: bool = False, reason: str = "dcp.save",
                 retention_class: RetentionClass | str = RetentionClass.ROUTINE,
                 score: float | None = None,
                 codec_selector: CodecSelector | None = None,
                 on_written: Callable[[WrittenPart], None] | None = None,
                 level: Level | None = None, remote: RemoteTier | None = None,
                 branches: Mapping[int, str] | None = None) -> None:
        super().__init__()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step: expected a non-negative int, got {step!r}")
        self.policy = resolve_policy(target)
        self.step = step
        self.codecs = codecs
        if level is None:
            level = Level.PULSE if codecs else Level.ORGAN
        self.intent = SaveIntent(level=level.value,
                                 reason=reason,
                                 retention_class=RetentionClass(retention_class).value,
                                 score=score)
        self.remote = remote_of(self.policy) if remote is None else remote
        self.name = dcp_name(step)
        self.save_id = uuid.uuid4().hex
        self._run_dir = Path(self.policy.run_dir)
        self._rank = 0
        self._staging: str | None = None
        # A run that saves many times passes one selector: its ``auto`` trials are then
        # reused from save to save instead of run again for every save. Used only with
        # ``codecs`` on (``_selector`` stays None otherwise: plain DCP items).
        self._run_selector = codec_selector
        self._selector: CodecSelector | None = None
        self._on_written = on_written
        self._branches = branches
        self.is_coordinator = False  # the rank that finishes and commits (DCP says which)
        self._commit: bytes | None = None  # the commit file finish() built, for commit()

    # -- StorageWriter ----------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            raise ValueError(
                f"ckptpilot.dcp.Writer names the checkpoint by its step ({self.name} under "
                f"{self.remote.url}); call dcp.save without checkpoint_id")
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise ValueError("ckptpilot.dcp.Writer needs use_collectives=True: one commit "
                             "file publishes every rank's part at once")
        self._rank = int(kwargs.get("rank", 0))
        self.is_coordinator = is_coordinator
        self._staging = None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self._on_written is None:
            self._run_dir.mkdir(parents=True, exist_ok=True)
            run_id = run_identity(self._run_dir)
            with MetadataStore(metadata_path(self._run_dir)) as store:
                retire_step(store, run_id, self._run_dir, self.remote, self.step)
        self._staging = self.remote.new_staging(self.name)
        return [dataclasses.replace(plan, storage_data=_Target(self._staging,
                                                               f"__{i}_0.distcp"))
                for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        target: _Target = plan.storage_data
        rel = f"{target.staging}/{target.file}"
        items: dict[MetadataIndex, ItemRecord] = {}
        codecs: Counter[str] = Counter()
        resolve_seconds = 0.0
        bytes_raw = 0
        t0 = time.perf_counter()
        if plan.items:
            if self.codecs:
                self._selector = (self._selector or self._run_selector
                                  or self._codec_selector())
                self._selector.new_save()
            # Objects first, then tensors, as FileSystemWriter orders them.
            ordered = sorted(plan.items, key=lambda i: i.type != WriteItemType.BYTE_IO)
            # Each item is hashed as it is written (_ItemStream); a whole-file digest
            # would hash every byte a second time and nothing reads it.
            with self.remote.open_write(rel, digest=False) as out:
                for item in ordered:
                    t = time.perf_counter()
                    data = planner.resolve_data(item)
                    if isinstance(data, torch.Tensor):
                        data = _plain_cpu(data)
                        bytes_raw += data.numel() * data.element_size()
                    resolve_seconds += time.perf_counter() - t
                    items[item.index] = self._write_item(out, item, data, target.file, codecs)
        part = WrittenPart(
            step=self.step, rank=self._rank, location=self.remote.path(target.staging),
            file=rel if items else None,
            sha256=part_digests(items).get(self._rank, empty_part_digest()),
            bytes_raw=bytes_raw, bytes_encoded=sum(r.nbytes for r in items.values()),
            codec=",".join(f"{c}:{n}" for c, n in sorted(codecs.items())) or "raw",
            resolve_seconds=resolve_seconds,
            write_seconds=time.perf_counter() - t0 - resolve_seconds, items=items)
        if self._on_written is not None:
            self._on_written(part)
        else:
            self._record(part)
        results = [WriteResult(index=index, size_in_bytes=rec.nbytes, storage_data=rec)
                   for index, rec in items.items()]
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._staging is None:
            raise RuntimeError("finish() before prepare_global_plan(): not the coordinator")
        tier, staging = self.remote, self._staging
        items = {wr.index: wr.storage_data for rank in results for wr in rank}
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_meta = self.storage_meta()
        # What stock readers find in .metadata: DCP's own per-item record.
        metadata.storage_data = {index: _StorageInfo(rec.file, rec.at, rec.nbytes)
                                 for index, rec in items.items()}
        metadata_file = None
        if not self.codecs:
            size, sha = tier.write_file(f"{staging}/{DCP_METADATA_FILE}",
                                        [pickle.dumps(metadata)])
            metadata_file = {"bytes": size, "sha256": sha}
        manifest = build_manifest(
            step=self.step, world_size=len(results), level=self.intent.level,
            reason=self.intent.reason, retention_class=self.intent.retention_class,
            score=self.intent.score, created_unix=time.time(), codecs=self.codecs,
            metadata=metadata, items=items, metadata_file=metadata_file,
            branches=self._branches)
        self._commit = encode_manifest(manifest)
        if self._on_written is not None:
            return  # the tier's publish commits, once every rank's part is validated
        self.commit()
        run_id = run_identity(self._run_dir)
        with MetadataStore(metadata_path(self._run_dir)) as store:
            moves = Moves(store)
            for rank in range(len(results)):
                moves.publish(CheckpointKey(run_id, self.step, rank, Tier.REMOTE),
                              location=tier.path(self.name))

    def commit(self) -> None:
        """(coordinator, after ``finish``) Write the commit file last and publish the
        checkpoint: locally the staging directory's rename, on an object store the commit
        file's PUT."""
        if self._commit is None or self._staging is None:
            raise RuntimeError(f"{self.name}: commit() before finish(): nothing to publish")
        tier, staging = self.remote, self._staging
        if tier.renames:
            tier.write_file(f"{staging}/{MANIFEST_FILE}", [self._commit])
            tier.publish(staging, self.name)
        else:  # an object store: the commit file's PUT is the publication
            tier.write_file(f"{self.name}/{MANIFEST_FILE}", [self._commit])

    def set_aside(self, why: str) -> str | None:
        """(coordinator, instead of ``commit``) Keep the unpublished staging directory for
        inspection under a name no listing takes; where it went (None: nothing staged)."""
        if self._staging is None or not self.remote.exists(self._staging):
            return None
        return self.remote.path(self.remote.set_aside(self._staging, why,
                                                      label=self.name))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        """Where the checkpoint is published (DCP logs it)."""
        return self.remote.path(self.name)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Never chosen by DCP from a bare ``checkpoint_id``: it needs a run and a step."""
        return False

    # -- helpers ----------------------------------------------------------------------------

    def _codec_selector(self) -> CodecSelector:
        return codec_selector(self.policy)

    def _write_item(self, out: HashingWriter, item: WriteItem, data: Any, file: str,
                    codecs: Counter[str]) -> ItemRecord:
        stream = _ItemStream(out)
        at = out.size
        if item.type == WriteItemType.BYTE_IO:
            if not isinstance(data, io.BytesIO):
                raise TypeError(f"{item.index.fqn}: the planner resolved an object item to "
                                f"{type(data).__name__}, not io.BytesIO")
            value = self._json_of(item.index.fqn, data)
            stream.write(data.getbuffer())
            return ItemRecord(self._rank, file, at, stream.size, stream.sha256, Encoding.BYTES,
                              value=value)
        shape = () if item.tensor_data is None else tuple(item.tensor_data.chunk.sizes)
        if (item.tensor_data is None or not isinstance(data, torch.Tensor)
                or tuple(data.shape) != shape):
            raise CheckpointFormatError(
                f"{item.index.fqn}: the planner resolved the chunk of shape {list(shape)} to "
                f"{getattr(data, 'shape', type(data).__name__)}")
        dtype = dtype_name(data.dtype, item.index.fqn)
        if self._selector is not None:
            codec, _ = self._selector.codec_for(item.index.fqn, data)
            for part in codec.encode_parts(data):
                stream.write(part)
            codecs[codec.codec_id] += 1
            encoding = Encoding.BLOB
        else:
            torch.save(data, stream)
            codecs["raw"] += 1
            encoding = Encoding.TORCH_SAVE
        return ItemRecord(self._rank, file, at, stream.size, stream.sha256, encoding, dtype,
                          shape)

    def _json_of(self, fqn: str, data: io.BytesIO) -> str:
        """The canonical JSON of the value the planner serialised into ``data``."""
        item = f"{self.name} (step {self.step}): item {fqn!r}"
        try:
            value = torch.load(io.BytesIO(data.getbuffer()), weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"GLOBAL ([\w.]+)", str(e))
            raise unsupported(item, f"a value of type {found.group(1) if found else '?'}"
                              ) from None
        return canonical(encode_value(value, item))

    def _record(self, part: WrittenPart) -> None:
        """(standalone) The rank's row, ``pending``; in the paranoid mode (``validation.paranoid``
        and ``sha256``) the part read back first, a mismatch marking the row corrupted and
        failing the save."""
        run_id = run_identity(self._run_dir)
        with MetadataStore(metadata_path(self._run_dir)) as store:
            catalog = Catalog(store, run_id, self._rank, self._run_dir)
            key = catalog.record_pending(
                self.step, Tier.REMOTE, self.intent, location=part.location,
                sha256=part.sha256, bytes_raw=part.bytes_raw,
                seconds_snapshot=part.resolve_seconds, codec=part.codec,
                bytes_encoded=part.bytes_encoded, seconds_write=part.write_seconds)
            if part.file is not None and self.policy.validation.sha256 \
                    and self.policy.validation.paranoid:
                t0 = time.perf_counter()
                try:
                    read_back(self.remote, part)
                except CheckpointFormatError as e:
                    Moves(store).condemn(key, f"read back after writing: {e}",
                                         seconds_validate=time.perf_counter() - t0)
                    raise
                Moves(store).record_check(key, seconds_validate=time.perf_counter() - t0)


def read_back(remote: RemoteTier, part: WrittenPart) -> None:
    """Read a rank's file back from storage and check every item's SHA256 (the paranoid
    validation); raises ``CheckpointFormatError`` naming the item at fault."""
    if part.file is None:
        return
    with remote.open_read(part.file) as f:
        for index, rec in sorted(part.items.items(), key=lambda kv: kv[1].at):
            read_item(f, rec, index, part.location)
