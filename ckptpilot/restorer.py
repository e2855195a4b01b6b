"""Finding and loading the checkpoint to resume from (SPEC §7).

This module owns :class:`Restorer`: it lists what this rank could restore from each of its
sources, :class:`~ckptpilot.tiers.base.CheckpointTier` objects the assembly built (the
keeper's images, e.g. the memory tier's newest snapshot; a recorded tier's steps with a
``valid`` row, e.g. the peers' checkpoint; a durable tier's own listing with its rows, e.g.
the remote archives), orders it by the recovery planner (``validation.recovery``: newest
valid first, walk back on damage, then the newest organ), tries each step's sources fastest
first (``capabilities.speed``), each read opened against the digest its row recorded, and
hands the first that verifies to the caller's ``apply``. In a distributed run every rank
restores the same step (:class:`~ckptpilot.agreement.RankAgreement`). A checkpoint the
rank's lineage record says a restore abandoned (``storage.lineage``) is never loaded,
whatever its row says or when it has none: remote archives without a row are excluded from
their own labels' ``branch``, every read is checked again on its state's. It also repairs
what a killed writer left in a durable tier (unfinished saves, rows still ``pending``) and
condemns copies that fail verification. It names no concrete tier: what differs between
sources comes from their capabilities and the protocols they implement. A durable tier that
is :class:`~ckptpilot.tiers.base.Collective` (the sharded tier: one DCP checkpoint of every
rank per step, opened by every rank together) is walked by the same loop; its rows are every
rank's, so the first rank settles them once every rank's writer is idle and before any
rank lists, and the candidates, the condemnations and the abandoned rows come from every
rank's rows (``shared_rows``).

It must not change the live run beyond ``apply``: what a restore means for the step
counters, the scheduler, the ledger and the data cursor is the pilot's. Threading: the
training thread, with the writer idle (the pilot flushes it first).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ckptpilot import shared_rows
from ckptpilot.agreement import RankAgreement
from ckptpilot.catalog import Catalog, Pin
from ckptpilot.errors import (
    CheckpointFormatError,
    CkptPilotError,
    LineageError,
    NoCheckpointError,
)
from ckptpilot.storage.lineage import Lineage
from ckptpilot.tiers.base import CheckpointTier, Collective, OpenedImage, Survey, Surveyed
from ckptpilot.validation.recovery import Candidate, RecoveryPlan, plan_recovery
from ckptpilot.vocab import Level, RecoverySource, Status

__all__ = ["MAX_RECOVERY_WALK", "Restored", "Restorer", "SkippedCheckpoint"]

log = logging.getLogger("ckptpilot")

MAX_RECOVERY_WALK = 5
_ALWAYS_REPORTED = 1 << 62  # a "missing" entry newer than any step: reported on every outcome


class _OtherWorldSize(CkptPilotError):
    """A rank-local copy (memory, peer) saved by a run of another world size: passed over,
    not condemned (its bytes are fine)."""


class _Abandoned(CkptPilotError):
    """A copy of a continuation a restore abandoned: passed over, not condemned."""


@dataclass(frozen=True)
class SkippedCheckpoint:
    location: str
    reason: str


@dataclass(frozen=True)
class Read:
    """One checkpoint read and verified, not yet applied to the live objects."""

    source: RecoverySource
    level: Level
    location: str
    bytes_read: int
    meta: Mapping[str, Any]
    get_tensor: Callable[[str], torch.Tensor]


@dataclass(frozen=True)
class Restored:
    """The step a restore loaded (``read`` None: the run has no checkpoint, step 0);
    ``pin`` the recover pin it followed, for the caller to consume once the restore is
    complete (``Catalog.consume_pin``)."""

    step: int
    read: Read | None
    skipped: tuple[SkippedCheckpoint, ...]
    pin: Pin | None = None


@dataclass(frozen=True)
class _Option:
    """One source of one step. ``read`` raises one of ``unreadable`` when this copy cannot
    be read (the walk goes on to the next); ``on_fail`` records why."""

    where: str
    read: Callable[[], Read]
    unreadable: tuple[type[BaseException], ...]
    on_fail: Callable[[BaseException], None]


@dataclass
class _Plan:
    """What this rank could restore: the sources of each step (newest first in ``steps``),
    and what was excluded or is missing, with reasons."""

    step: int | None
    pin: Pin | None  # the recover pin that chose ``step``
    options: dict[int, list[_Option]]
    steps: list[int]
    missing: list[tuple[int, SkippedCheckpoint]]
    skipped: list[SkippedCheckpoint]


class Restorer:
    """Walks the recovery plan over this rank's tiers; see the module docstring."""

    def __init__(self, catalog: Catalog, tiers: Sequence[CheckpointTier],
                 keeper: CheckpointTier | None, agreement: RankAgreement | None,
                 world_size: int = 1) -> None:
        """``tiers``: the tiers the writer records rows for (one of them durable and
        :class:`~ckptpilot.tiers.base.Surveyed`: the remote tier); ``keeper``: the tier of
        this process's own images, which need no row (the memory tier; None when off)."""
        self._world_size = world_size
        self._catalog = catalog
        self._rank = catalog.rank
        self._keeper = keeper
        self._tiers = sorted(tiers, key=lambda t: t.capabilities.speed)
        self._by_kind = {t.kind: t for t in self._tiers}
        surveyed = [t for t in self._tiers if isinstance(t, Surveyed)]
        if len(surveyed) != 1:
            raise ValueError(f"a restore needs exactly one durable tier it can list, got "
                             f"{[t.where for t in surveyed]}")
        self._durable: Surveyed = surveyed[0]
        self._durable_tier: CheckpointTier = surveyed[0]
        self._agreement = agreement
        self._lineage: Lineage | None = None  # of the restore being planned; None: forced
        # One image of every rank (a DCP checkpoint): its rows are every rank's.
        self._shared = isinstance(self._durable_tier, Collective)

    def restore(self, step: int | None, apply: Callable[[Read], None], *,
                before: int | None = None,
                prepare: Callable[[], None] | None = None) -> Restored | None:
        """Load the newest checkpoint that verifies (or exactly ``step``, or a pinned one)
        into the live objects through ``apply``.

        With ``before`` (a rollback): the newest step below it, no pin, and None, with
        nothing changed, when no such step loads. Without: raises ``NoCheckpointError`` when
        checkpoints exist (or are recorded) but none loads, rather than silently restarting
        the run from scratch; a run with nothing at all restores step 0. ``prepare`` runs
        first (the pilot flushes its writer): in a distributed run its failure, like any on
        this rank, makes every rank raise.
        """
        agreement = self._agreement
        failure: BaseException | None = None
        plan: _Plan | None = None
        try:
            if prepare is not None:
                prepare()
        except BaseException as e:
            if agreement is None:
                raise
            failure = e
        if self._shared:
            self._settle_shared(failure)
        try:
            if failure is None:
                plan = self._plan(step, before)
        except BaseException as e:
            if agreement is None:
                raise
            failure = e
        steps = plan.steps if plan is not None else []
        if agreement is not None:
            common = agreement.common_steps(steps, failure)
            assert plan is not None
            plan.missing += [(s, SkippedCheckpoint(plan.options[s][0].where,
                                                   f"step {s} is not held by every rank"))
                             for s in steps if s not in common]
            steps = common
        assert plan is not None
        skipped = plan.skipped
        for target in steps:
            read = None
            try:
                read = self._read_first(plan.options[target], skipped)
                if read is not None:
                    apply(read)
            except BaseException as e:
                if agreement is None:
                    raise
                failure = e
            if agreement is not None:
                vote = agreement.vote(-1 if failure is not None else int(read is not None))
                agreement.raise_if_failed(vote, failure, f"step {target}")
                if vote == 0:
                    if read is not None:
                        skipped.append(SkippedCheckpoint(
                            read.location, f"another rank cannot load step {target}"))
                    continue
            if read is None:
                continue
            skipped += [m for s, m in plan.missing if s > target]
            if self._shared:
                self._after_shared(target, read)
            return Restored(target, read, tuple(skipped), plan.pin)
        skipped += [m for _, m in plan.missing]
        if before is not None:
            for item in skipped:
                log.warning("cannot roll back to %s: %s", item.location, item.reason)
            return None
        refuse = bool(skipped) or plan.step is not None
        if agreement is not None:
            refuse = agreement.vote(int(not refuse)) == 0
        if refuse:
            raise NoCheckpointError(self._nothing_loads(plan.step, skipped))
        return Restored(0, None, tuple(skipped))

    def _settle_shared(self, failure: BaseException | None) -> None:
        """(rows every rank shares) The first rank settles what a killed save left once
        every rank's writer is idle, and every rank lists after it settled. Each rank marks
        its own row ``valid`` on its writer thread after the commit file is written: a
        settle while another rank's writer is still at it would find that row ``pending`` of
        a published step, mark it, and that writer's own publication would then fail."""
        agreement = self._agreement
        if agreement is not None:
            agreement.raise_if_failed(agreement.vote(-1 if failure is not None else 1),
                                      failure, "preparing the restore")
        try:
            if self._rank == 0:
                shared_rows.settle(self._catalog, self._durable_tier, self._durable,
                                   self._survey()[0])
        except BaseException as e:
            if agreement is None:
                raise
            failure = e
        if agreement is not None:
            agreement.raise_if_failed(agreement.vote(-1 if failure is not None else 1),
                                      failure, "settling the rows of a killed save")

    def _plan(self, step: int | None, before: int | None) -> _Plan:
        """This rank's candidates (all below ``before`` if given), per step and fastest
        source first (rank-local: no collective)."""
        pin = self._catalog.read_pin() if step is None and before is None else None
        forced = pin is not None and pin.force
        if pin is not None:
            step = pin.step
            log.warning("restoring step %d as pinned by `ckptpilot recover`%s", step,
                        " --force" if forced else "")
        self._lineage = None if forced else self._catalog.lineage()
        if self._shared:
            candidates, missing, digests = self._shared_candidates(self._lineage)
        else:
            candidates, missing, digests = self._durable_candidates(self._lineage)
        if before is not None:
            candidates = [c for c in candidates if c.step < before]
            missing = [(s, m) for s, m in missing if s < before]
        if forced:
            candidates = [Candidate(c.step, c.level, c.tier, c.name, None) for c in candidates]
        plan = plan_recovery(candidates, max_walk=MAX_RECOVERY_WALK, step=step)
        options, unproven = self._options(plan, step, forced, digests, before)
        return _Plan(
            step=step, pin=pin, options=options,
            steps=sorted(options, reverse=True), missing=missing,
            skipped=[SkippedCheckpoint(c.name, why) for c, why in plan.excluded] + unproven)

    def _nothing_loads(self, step: int | None, skipped: list[SkippedCheckpoint]) -> str:
        what = f"step {step}" if step is not None else "any step"
        url = self._durable.url
        if not skipped:
            return (f"no usable checkpoint of {what} for rank {self._rank} in {url}"
                    + (" on every rank" if self._agreement is not None else ""))
        first = skipped[0]
        return (f"rank {self._rank} cannot load {what}: none of the {len(skipped)} "
                f"checkpoints recorded or found in {url} loads; newest: {first.location}: "
                f"{first.reason}")

    def _options(self, plan: RecoveryPlan, step: int | None, forced: bool,
                 digests: Mapping[int, str], before: int | None
                 ) -> tuple[dict[int, list[_Option]], list[SkippedCheckpoint]]:
        """For each step this rank could restore, its sources, fastest first; and the copies
        left out because no row can prove them. A forced restore reads the durable tier
        alone (what ``recover --force`` pinned)."""
        options: dict[int, list[_Option]] = {}
        below = math.inf if before is None else before
        newest_durable = plan.attempts[0].step if plan.attempts else -1
        targets: list[tuple[CheckpointTier, int, str | None, str | None]] = []
        unproven: list[tuple[int, SkippedCheckpoint]] = []
        keeper = self._keeper
        if keeper is not None and not forced:
            targets += [(keeper, t, None, None) for t in keeper.steps()
                        if step is None or t == step]
        for tier in self._tiers:
            if tier is self._durable_tier or forced:
                continue
            recorded, left = self._recorded_targets(tier, step, newest_durable)
            targets += [(tier, t, digest, at) for t, (digest, at) in recorded.items()]
            unproven += left
        for cand in plan.attempts:
            tier = self._by_kind[cand.tier]
            targets.append((tier, cand.step, digests.get(cand.step)
                            if cand.status is not None else None, None))
        targets.sort(key=lambda target: target[0].capabilities.speed)
        for tier, target, expect, at in targets:
            if target < below:
                options.setdefault(target, []).append(_Option(
                    tier.locate(target),
                    partial(_read, tier, target, expect, at, self._world_size),
                    tier.failures, partial(self._condemn, tier, target)))
        return options, [s for t, s in unproven if t < below]

    def _read_first(self, options: list[_Option], skipped: list[SkippedCheckpoint]
                    ) -> Read | None:
        """The first source of one step that reads and verifies; each one that cannot is
        skipped with its reason."""
        for option in options:
            try:
                read = option.read()
                self._check_lineage(read)
                return read
            except (_OtherWorldSize, _Abandoned) as e:
                log.warning("skipping checkpoint %s: %s", option.where, e)
                skipped.append(SkippedCheckpoint(option.where, str(e)))
            except LineageError:
                raise  # not this copy's fault: which continuation is current is not known
            except option.unreadable as e:
                log.warning("skipping checkpoint %s: %s", option.where, e)
                skipped.append(SkippedCheckpoint(option.where, str(e)))
                option.on_fail(e)
        return None

    def _check_lineage(self, read: Read) -> None:
        """Raise ``_Abandoned`` for a read of an abandoned continuation (the state says which
        continuation it was saved on): a row or a peer listing may still offer one, e.g.
        when a kill fell between recording a fork and expiring the rows."""
        if self._lineage is not None and read.meta.get("rank", self._rank) == self._rank:
            # (Another rank's state, read on a world-size change, is on that rank's lineage.)
            why = self._lineage.why_abandoned(read.meta.get("branch"), int(read.meta["step"]))
            if why is not None:
                raise _Abandoned(why)

    def _recorded_targets(self, tier: CheckpointTier, step: int | None, newest_durable: int
                          ) -> tuple[dict[int, tuple[str, str]],
                                     list[tuple[int, SkippedCheckpoint]]]:
        """The steps of a tier that is not durable to try, newest first, each with the
        digest and the location its row recorded (the peers: ``stripe_record``, and the
        daemons the shards went to): ``step`` if it is a valid row, else the valid rows at
        least as new as the newest durable candidate. The peers
        keep one state per run, so this is normally one checkpoint.

        With no rows of the tier (the metadata lost or rebuilt), nothing recorded what this
        trainer put, and a copy proven only by the digests the tier keeps could be anyone's:
        it is not read, and what it holds is reported as skipped."""
        rows = self._catalog.rows(tier.kind)
        if not rows:
            try:
                held = tier.steps()
            except tier.failures as e:
                log.warning("cannot list %s: %s", tier.where, e)
                return {}, []
            return {}, [(s, SkippedCheckpoint(
                tier.locate(s), f"not read: no metadata row records what this trainer put on "
                f"{tier.where} (metadata lost or rebuilt?), so its copy cannot be proven; "
                f"{self._durable.url} is read instead"))
                for s in sorted(held, reverse=True)
                if (s == step if step is not None else s >= newest_durable)]
        recorded = {r.step: (r.sha256, r.location) for r in rows if r.status is Status.VALID}
        if step is not None:
            return ({step: recorded[step]} if step in recorded else {}), []
        newer = sorted((s for s in recorded if s >= newest_durable), reverse=True)
        return {s: recorded[s] for s in newer[:MAX_RECOVERY_WALK]}, []

    def _condemn(self, tier: CheckpointTier, step: int, error: BaseException) -> None:
        """A copy that failed on restore is condemned in its row; on a durable tier only for
        wrong bytes: an I/O error may pass (a flaky mount) and must not condemn a good
        checkpoint to the next prune. (The keeper has no rows: nothing to condemn.) A
        checkpoint of every rank is condemned in every rank's row."""
        if self._shared and tier is self._durable_tier:
            if isinstance(error, CheckpointFormatError):
                shared_rows.condemn_every_rank(self._catalog, tier, self._durable, step, error)
        elif isinstance(error, CheckpointFormatError) or not tier.capabilities.durable:
            self._catalog.condemn(step, tier.kind, error)

    def _survey(self) -> tuple[Survey, str | None]:
        """The durable tier's listing (empty, and why, when it cannot be listed), the
        unfinished saves it holds removed."""
        durable, tier = self._durable, self._durable_tier
        try:
            survey = durable.survey()
        except OSError as e:
            log.warning("cannot list %s: %s", tier.where, e)
            return Survey(published={}, unfinished=[]), str(e)
        for debris in survey.unfinished:
            log.warning("removing %s: a save that never finished (writer killed)", debris)
            try:
                durable.clear(debris)
            except OSError as e:
                log.warning("cannot remove %s: %s", debris, e)
        return survey, None

    def _shared_candidates(self, lineage: Lineage | None
                           ) -> tuple[list[Candidate], list[tuple[int, SkippedCheckpoint]],
                                      dict[int, str]]:
        """:meth:`_durable_candidates` for a tier whose images are every rank's: from every
        rank's rows (``shared_rows``), the same on every rank."""
        survey, unlisted = self._survey()
        found, missing, digests = shared_rows.candidates(
            self._catalog, self._durable_tier, self._durable, survey, lineage)
        skipped = [(step, SkippedCheckpoint(where, f"cannot list {self._durable.url}: "
                                                   f"{unlisted}" if unlisted else why))
                   for step, where, why in sorted(missing, reverse=True)]
        if unlisted is not None and not skipped:
            skipped.append((_ALWAYS_REPORTED, SkippedCheckpoint(
                self._durable.url, f"cannot list {self._durable_tier.where}: {unlisted}")))
        return found, skipped, digests

    def _after_shared(self, step: int, read: Read) -> None:
        saved = read.meta.get("world_size")
        if saved != self._world_size:
            log.warning("step %d was saved by %s ranks and this run has %d: resharded from "
                        "%s; rank-local tiers (memory, peer) are never trusted across a "
                        "world-size change", step, saved, self._world_size, read.location)
        shared_rows.abandon_beyond(self._catalog, self._durable_tier, self._durable, step,
                                   self._world_size)

    def _durable_candidates(self, lineage: Lineage | None
                            ) -> tuple[list[Candidate], list[tuple[int, SkippedCheckpoint]],
                                       dict[int, str]]:
        """Published images of this rank on the durable tier with their metadata status, and
        the ``valid`` rows whose image is missing (deleted, a wrong mount or
        ``tiers.remote.url``): those count as checkpoints that exist, so losing them is
        never a silent restart from scratch. An image without a row is excluded when
        ``lineage`` says a restore abandoned it (None: a forced restore, which loads what it
        is told). Repairs the traces a killed writer left (unfinished saves, rows still
        ``pending``). Also returns the digest each step's row recorded."""
        durable, tier = self._durable, self._durable_tier
        survey, unlisted = self._survey()
        published = survey.published
        # Only this pilot's own images: a ``ckptpilot.dcp`` checkpoint in the same run
        # directory has rows of its own layout, which this restore does not read.
        rows = {step: row for step, row in self._catalog.newest_rows_by_step(tier.kind).items()
                if durable.owns(row.location)}
        moves = self._catalog.moves
        for row in rows.values():
            if row.status is not Status.PENDING:
                continue
            if row.step in published:  # validated, published, killed before the row was marked
                rows[row.step] = moves.publish(row.key, location=published[row.step])
            else:
                rows[row.step] = moves.condemn(
                    row.key, "the writer died before the checkpoint was published")
        candidates = []
        for step, location in published.items():
            row = rows.get(step)
            if row is not None:
                candidates.append(Candidate(step, row.level, tier.kind, location, row.status))
                continue
            try:  # no metadata (database lost or rebuilt): the image's labels say what it is
                labels = durable.labels(step)
            except (CheckpointFormatError, OSError):  # reading it again reports why
                level, abandoned = "unknown", None
            else:
                level = labels["level"]
                abandoned = (None if lineage is None
                             else lineage.why_abandoned(labels.get("branch"), step))
            candidates.append(Candidate(step, level, tier.kind, location, None, abandoned))
        missing = [
            (row.step, SkippedCheckpoint(row.location, (
                f"recorded valid but cannot list {durable.url}: {unlisted}" if unlisted
                else f"recorded valid but its data is missing from {durable.url} "
                "(deleted, or a wrong mount / tiers.remote.url?)")))
            for row in sorted(rows.values(), key=lambda r: -r.step)
            if row.status is Status.VALID and row.step not in published]
        if unlisted is not None and not missing:  # nothing recorded, nothing listable
            missing.append((_ALWAYS_REPORTED, SkippedCheckpoint(
                durable.url, f"cannot list {tier.where}: {unlisted}")))
        return candidates, missing, {step: row.sha256 for step, row in rows.items()}


def _read(tier: CheckpointTier, step: int, expect: str | None, at: str | None,
          world_size: int) -> Read:
    """``step`` opened on ``tier`` (looking ``at`` the location its row recorded first),
    verified by the tier against ``expect`` (the digest its row recorded), as a read the
    pilot applies; a copy on a tier that is not durable saved by
    a run of another world size is never trusted (a rank-local tier's copy belongs to one
    rank of one layout of the job)."""
    opened: OpenedImage = tier.open(step, expect=expect, at=at)
    if not tier.capabilities.durable:
        saved = opened.meta.get("world_size")
        if saved != world_size:
            raise _OtherWorldSize(
                f"saved by a run of {saved} ranks and this one has {world_size}: rank-local "
                "tiers are never trusted across a world-size change, the remote tier is read "
                "instead")
    return Read(RecoverySource(tier.kind.value), opened.level, opened.source, opened.bytes_read,
                opened.meta, opened.tensor)
