"""The sharded tier as a :class:`~ckptpilot.tiers.base.CheckpointTier`: a sharded training
state (``capture.sharded``) as one DCP checkpoint per step, ``dcp_step_N`` on the remote
store, written and read by ``ckptpilot.dcp``'s ``Writer`` and ``Reader`` (SHA256 per item,
the commit file last, non-tensor values as JSON, no pickle read).

Why it is a tier: the pilot's writer and restorer then run the same loops for a sharded
state as for a replicated one — one pending row per rank, validation, publication or abort,
the disk budget, retention, telemetry — and the sharded path has no loop of its own. What a
DCP checkpoint needs beyond another tier is collective, and stays inside this tier:

- ``stage`` is ``dcp.save`` on this tier's process group: every rank writes its part into
  the staging directory and reports it (``StageOptions.written``: the pending row is
  recorded while the collective still runs); the coordinator writes DCP's ``.metadata`` and
  builds the commit file, but does not write it. The commit file is the publication: no
  commit file, no checkpoint.
- ``validate`` re-reads this rank's part (``validation.paranoid`` with ``sha256``; without,
  the hashes taken as it was written stand) and every rank learns the others' verdict, so
  that every rank publishes or every rank aborts.
- ``publish``: the coordinator writes the commit file and publishes the directory; every
  rank learns whether it did. ``abort``: the coordinator sets the staging directory aside.
- ``open`` is ``dcp.load`` into host buffers shaped like the live tensors (``live``: their
  sharding now; DCP reshards into them, rank r resuming saved rank r mod N's own state) or,
  with no live tensors, like the saved global tensors. Every rank plans its load, learns
  whether every other could, then loads: a step one rank cannot read is read by none.
- ``first_rank_refuses``: the disk budget's verdict of the first rank, for every rank;
  ``any_rank_fails``: whether any rank failed what the pilot's writer does before the put
  (``tiers.base.Collective``, which also tells the restorer that a step is every rank's:
  ``shared_rows``).
- ``survey``, ``clear``, ``labels``, ``owns`` (``tiers.base.Surveyed``): the published
  steps; the first rank alone reports a killed save's staging directory, so one rank
  removes it.

A failed ``open`` fails on every rank, each with its reason: a DCP load's failure (every
rank's, ``CheckpointException``) becomes a ``CheckpointFormatError`` when any rank read
wrong bytes, an ``OSError`` when every rank failed to read, naming each rank; a rank that
could read a step another could not raises :class:`~ckptpilot.tiers.sharded.load.NotLoadable`,
or a ``CheckpointFormatError`` when the other read wrong bytes, so that the step is condemned
in every rank's row whichever rank read them.
So nothing live changes on one rank when another cannot load the step.

Every collective runs on ``group``, the tier's own (DCP's collectives run on the writer
thread while training runs its own: on one process group they could interleave differently
on different ranks). ``group`` None: a single process (``no_dist``). The pilot calls
``stage`` … ``publish`` on the writer thread and ``open`` on the training thread with the
writer idle, in the same order on every rank. ``set_aside`` and ``discard`` act on the
first rank only: the directory is every rank's.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckptpilot.capture.sharded import json_tensor
from ckptpilot.codecs.selector import CodecSelector
from ckptpilot.dcp import Reader, Writer, dcp_name
from ckptpilot.dcp.storage import entry_of, is_dcp_entry, list_dcp, read_manifest
from ckptpilot.dcp.writer import WrittenPart, read_back
from ckptpilot.errors import CheckpointFormatError, IntegrityError, NoCheckpointError
from ckptpilot.policy import Policy
from ckptpilot.tiers.base import (
    PLAIN,
    Check,
    CheckpointImage,
    OpenedImage,
    PutReceipt,
    Staged,
    StageOptions,
    Survey,
    TierCapabilities,
    put_in_two_phases,
)
from ckptpilot.tiers.remote.store import STAGING_MARK, RemoteTier
from ckptpilot.tiers.sharded.load import (
    LiveTensors,
    NotLoadable,
    meta_of,
    plan_load,
    rank_failures,
    tensor_getter,
    why_failed,
)
from ckptpilot.vocab import Level, RetentionClass, Tier

__all__ = ["ShardedTier"]

_BRANCH_ID = re.compile(r"[0-9a-f]{16}")  # storage.lineage's continuation ids
# A rank's verdict on a step it opens; every rank acts on the least: a rank that failed, then
# one that read wrong bytes (every rank condemns the step, so rank 0 condemns every row of
# it, whichever rank saw them), then one that cannot read it (passed over, not condemned).
_FAILED, _WRONG_BYTES, _UNREADABLE, _READ = -1, 0, 1, 2


class ShardedTier:
    """One rank's view of a run's sharded checkpoints; see the module docstring."""

    kind = Tier.REMOTE
    capabilities = TierCapabilities(durable=True, survives_node_loss=True, folds_deltas=False,
                                    speed=Tier.REMOTE.speed, keeps_older=True)
    failures: tuple[type[BaseException], ...] = (OSError, CheckpointFormatError,
                                                 NoCheckpointError, NotLoadable)

    def __init__(self, policy: Policy, remote: RemoteTier, *, rank: int, world_size: int,
                 group: dist.ProcessGroup | None, live: LiveTensors | None = None,
                 codecs: CodecSelector | None = None) -> None:
        """``live``: the live tensors a load reshards into (None: load the saved global
        tensors whole); ``codecs``: the run's codec selector (its trials carry over from
        save to save), used when a save asks for codecs."""
        self.remote = remote
        self.url = remote.url
        self.rank = rank
        self.where = f"the sharded checkpoints in {remote.url}"
        self._policy = policy
        self._world_size = world_size
        self._group = group
        self._live = live
        self._codecs = codecs

    # -- collectives ------------------------------------------------------------------------

    def first_rank_refuses(self, refused: bool) -> bool:
        if self._group is None:
            return refused
        flag = torch.tensor([int(refused)], dtype=torch.int64)
        dist.broadcast(flag, src=0, group=self._group)
        return bool(flag.item())

    def any_rank_fails(self, failed: bool) -> bool:
        return self._least(int(not failed)) == 0

    def _every_rank(self, row: list[int]) -> list[list[int]]:
        """Every rank's ``row`` (as many ints on every rank), by rank."""
        if self._group is None:
            return [row]
        mine = torch.tensor(row, dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(self._group))]
        dist.all_gather(every, mine, group=self._group)
        return [t.tolist() for t in every]

    def _least(self, vote: int) -> int:
        """Every rank's ``vote`` reduced to its minimum."""
        if self._group is None:
            return vote
        flag = torch.tensor([vote], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return int(flag.item())

    def _dcp(self, run: Callable[[], object]) -> None:
        """A DCP collective (its failure is every rank's); in a single process its one
        failure raised as itself, else as a format error when any rank read wrong bytes, an
        I/O error when every rank failed to read, each rank's reason named."""
        try:
            run()
        except CheckpointException as e:
            failures = list(rank_failures(e).values())
            if self._group is None and len(failures) == 1:
                raise failures[0] from e
            if any(isinstance(f, CheckpointFormatError) for f in failures) and all(
                    isinstance(f, (CheckpointFormatError, OSError)) for f in failures):
                raise CheckpointFormatError(why_failed(e)) from e
            if all(isinstance(f, OSError) for f in failures):
                raise OSError(why_failed(e)) from e
            raise

    # -- the two-phase put ------------------------------------------------------------------

    def stage(self, image: CheckpointImage, base: CheckpointImage | None = None, *,
              options: StageOptions = PLAIN) -> Staged:
        """``dcp.save`` of the image (collective), up to the commit file; ``base`` is
        ignored (no deltas). Every rank first learns whether every other could build its
        state dict (a rank that raised before ``dcp.save`` would leave the others in it for
        ever) and every rank's continuation (``storage.lineage``), which the commit file
        records: a restore without rows tells from it which steps a restore abandoned."""
        state: dict[str, torch.Tensor] = {}
        error: Exception | None = None
        mine = [0, 0, 0, 0]
        try:
            state = dict(image.tensors())  # a bad arena is refused before anything is written
            state[f"rank/{self.rank}/meta"] = json_tensor(dict(image.meta))
            mine = [1, *_branch_code(image.meta.get("branch"), image.step)]
        except Exception as e:
            error = e
        every = self._every_rank(mine)
        if error is not None:
            raise error
        failed = [rank for rank, row in enumerate(every) if row[0] != 1]
        if failed:
            raise RuntimeError(f"{self.where}: rank(s) {failed} could not stage step "
                               f"{image.step} (their logs say why)")
        branches = {rank: _branch_of(row[1:]) for rank, row in enumerate(every)}
        parts: list[WrittenPart] = []

        def written(part: WrittenPart) -> None:
            parts.append(part)
            if options.written is not None:
                options.written(self._staged(image, part, None))

        writer = Writer(self._policy, step=image.step, codecs=options.codecs,
                        reason=image.reason, retention_class=image.retention_class,
                        score=image.score, codec_selector=self._codecs, on_written=written,
                        level=image.level, remote=self.remote, branches=branches)
        self._dcp(lambda: dcp.save(state, storage_writer=writer, process_group=self._group,
                                   no_dist=self._group is None))
        return self._staged(image, parts[0], writer)

    def _staged(self, image: CheckpointImage, part: WrittenPart,
                writer: Writer | None) -> Staged:
        return Staged(image.step, self.kind, part.location, part.sha256, image.nbytes,
                      part.bytes_encoded, part.codec, part.write_seconds, image,
                      handle=(writer, part))

    def validate(self, staged: Staged) -> Check:
        """This rank's part read back (paranoid mode), then every rank's verdict shared: a
        rank whose read-back raised anything else raises after the vote, and every other
        rank with it."""
        _, part = staged.handle
        ok, reason, seconds, error = True, "hashed as written", None, None
        checks = self._policy.validation
        if checks.sha256 and checks.paranoid:
            t0 = time.perf_counter()
            try:
                read_back(self.remote, part)
                reason = "read back"
            except (CheckpointFormatError, OSError) as e:
                ok, reason = False, f"read back after writing: {e}"
            except Exception as e:
                error = e
            seconds = time.perf_counter() - t0
        agreed = self._least(-1 if error is not None else int(ok))
        if error is not None:
            raise error
        if agreed < 0:
            raise RuntimeError(f"{self.where}: another rank failed to validate step "
                               f"{staged.step} (its log says why)")
        if agreed == 0 and ok:
            ok, reason = False, f"another rank's part of step {staged.step} failed validation"
        return Check(ok, reason, seconds)

    def publish(self, staged: Staged) -> PutReceipt:
        """The commit file, written by the coordinator; every rank learns whether it was,
        whatever the coordinator's failure."""
        writer, part = staged.handle
        error: Exception | None = None
        try:
            if writer.is_coordinator:
                writer.commit()
        except Exception as e:
            error = e
        refused = self.first_rank_refuses(error is not None)
        if error is not None:
            raise error
        if refused:
            raise OSError(f"{self.where}: rank 0 could not publish step {staged.step} (rank "
                          "0's log says why)")
        return PutReceipt(staged.step, self.locate(staged.step), part.bytes_encoded,
                          digest=part.sha256, codec=part.codec,
                          write_seconds=part.write_seconds)

    def abort(self, staged: Staged, why: str) -> str | None:
        writer, _ = staged.handle
        return writer.set_aside("corrupted") if writer.is_coordinator else None

    def put(self, image: CheckpointImage, base: CheckpointImage | None = None) -> PutReceipt:
        return put_in_two_phases(self, image, base)

    # -- reading ----------------------------------------------------------------------------

    def open(self, step: int, *, expect: str | None = None,
             at: str | None = None) -> OpenedImage:
        """``dcp.load`` of ``step`` (collective), every item verified as it is read; the
        meta is the saved rank's this rank resumes. ``expect``: this rank's part digest as
        its row recorded."""
        return self._open(step, expect)[0]

    def _open(self, step: int, expect: str | None) -> tuple[OpenedImage, list[str]]:
        where = self.locate(step)
        load, reader, vote, error = None, None, _READ, None
        try:
            if step not in self.steps():
                raise NoCheckpointError(f"{self.where}: step {step} not held ({where} is "
                                        "not published)")
            reader = Reader(self._policy, step=step, remote=self.remote)
            entries = reader.read_metadata().state_dict_metadata
            part = reader.manifest.get("parts", {}).get(str(self.rank))
            if expect is not None and part != expect:
                raise IntegrityError(f"{where}: rank {self.rank}'s part of step {step} (not "
                                     "the checkpoint recorded)", expect, str(part))
            load = plan_load(entries, where, saved_world_size=int(reader.manifest["world_size"]),
                             rank=self.rank, world_size=self._world_size, live=self._live)
        except CheckpointFormatError as e:
            vote, error = _WRONG_BYTES, e
        except (OSError, NoCheckpointError, NotLoadable) as e:
            vote, error = _UNREADABLE, e
        except BaseException as e:
            vote, error = _FAILED, e
        _verdict(self._least(vote), error, where, step, "plan the load of")
        assert load is not None and reader is not None
        try:
            self._dcp(lambda: dcp.load(load.state, storage_reader=reader,
                                       process_group=self._group, no_dist=self._group is None))
        except IntegrityError as e:  # one process's own: the item's message, with the step
            raise IntegrityError(f"step {step}: {e.key}", e.expected, e.actual,
                                 e.digest) from e
        meta, vote, error = None, _READ, None
        try:
            meta = meta_of(load, load.source, where)
        except CheckpointFormatError as e:
            vote, error = _WRONG_BYTES, e
        except Exception as e:
            vote, error = _FAILED, e
        # Loaded everywhere, or used nowhere.
        _verdict(self._least(vote), error, where, step, "read the meta of")
        assert meta is not None
        opened = OpenedImage(step, meta, Level(reader.manifest["level"]), where,
                             reader.bytes_read, tensor_getter(load, where))
        return opened, [k for k in load.state if not k.startswith("rank/")]

    def get(self, step: int) -> CheckpointImage:
        opened, keys = self._open(step, None)
        return CheckpointImage.copied(step, opened.meta, {k: opened.tensor(k) for k in keys},
                                      level=opened.level, reason="",
                                      retention_class=RetentionClass.ROUTINE, score=None)

    def steps(self) -> list[int]:
        return [step for step, _ in list_dcp(self.remote)]

    def locate(self, step: int) -> str:
        return self.remote.path(dcp_name(step))

    # -- the listing a restore repairs and chooses from (tiers.base.Surveyed) ---------------

    def survey(self) -> Survey:
        names = self.remote.list()
        published = {step: self.remote.path(name) for step, name in list_dcp(self.remote)}
        unfinished = [name for name in names if STAGING_MARK in name and is_dcp_entry(name)]
        return Survey(published, unfinished if self.rank == 0 else [])

    def clear(self, location: str) -> None:
        self.remote.remove(entry_of(location))

    def labels(self, step: int) -> Mapping[str, Any]:
        """The commit file's level and number of ranks, and, for a rank that saved a part
        of it, the continuation that rank saved it on ("" the run's first: also a commit
        file from before the field, as for a per-rank archive's manifest)."""
        manifest = read_manifest(self.remote, dcp_name(step))
        labels = {"level": manifest["level"], "world_size": manifest["world_size"]}
        if self.rank < int(manifest["world_size"]):
            labels["branch"] = manifest.get("branches", {}).get(str(self.rank), "")
        return labels

    def owns(self, location: str) -> bool:
        return is_dcp_entry(entry_of(location))

    # -- housekeeping (the first rank: the directory is every rank's) -----------------------

    def set_aside(self, step: int, why: str) -> str | None:
        name = dcp_name(step)
        if self.rank != 0 or not self.remote.exists(name):
            return None
        return self.remote.path(self.remote.set_aside(name, why))

    def discard(self, step: int) -> None:
        name = dcp_name(step)
        if self.rank == 0 and self.remote.exists(name):
            self.remote.remove(name)

    def close(self) -> None:
        """Nothing to release: the process group is the assembly's."""


def _branch_code(branch: object, step: int) -> tuple[int, int, int]:
    """A continuation id (16 hex digits, or ""/None: the run's first) as three ints a
    collective carries: whether there is one, then its two halves."""
    if branch is None or branch == "":
        return 0, 0, 0
    if not isinstance(branch, str) or not _BRANCH_ID.fullmatch(branch):
        raise CheckpointFormatError(f"step {step}: meta branch {str(branch)[:40]!r} is not a "
                                    "continuation id (16 hex digits)")
    return 1, int(branch[:8], 16), int(branch[8:], 16)


def _branch_of(code: list[int]) -> str:
    present, high, low = code
    return f"{high:08x}{low:08x}" if present else ""


def _verdict(agreed: int, error: BaseException | None, where: str, step: int,
             doing: str) -> None:
    """Raise unless every rank could go on (``agreed``: the least verdict): this rank's own
    error, as wrong bytes when another rank read wrong bytes, else why another could not."""
    if agreed == _WRONG_BYTES and not isinstance(error, CheckpointFormatError):
        raise CheckpointFormatError(f"{where}: another rank read wrong bytes of step {step} "
                                    "(its log says which)") from error
    if error is not None:
        raise error
    if agreed == _UNREADABLE:
        raise NotLoadable(f"{where}: another rank cannot read step {step}")
    if agreed < 0:
        raise RuntimeError(f"{where}: another rank failed to {doing} step {step}")
