"""The restore of a sharded training state: the walk over its steps, collective.

This module owns :class:`ShardedRestorer`, the assembly's restorer for a model of DTensors
(the other is :class:`~ckptpilot.restorer.Restorer`; the pilot calls either the same way).
Every rank walks the same list of steps (the steps whose DCP save is valid on every rank of
the save and published, newest first), opens a step on the DCP-backed tier
(``tiers.sharded``: ``dcp.load`` into host buffers, every item verified as it is read,
resharded when the world size changed) — nothing live changes until the step has loaded on
every rank — walks back together past a step that any rank cannot read, condemning every
rank's row of a step whose bytes are wrong, and applies it through the caller's ``apply``.
Rank 0 first settles what a killed save left.

It differs from ``Restorer`` where one checkpoint is every rank's: its steps come from the
rows of every rank of the save (``dcp.reader.usable_steps``), and condemning, settling and
abandoning act on all of them. It must not change the live run beyond ``apply``.
Threading: the training thread, with the writer idle.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch.distributed.checkpoint.api import CheckpointException

from ckptpilot.agreement import RankAgreement
from ckptpilot.capture.sharded import check_format
from ckptpilot.catalog import Catalog
from ckptpilot.dcp import dcp_name
from ckptpilot.dcp.reader import usable_steps
from ckptpilot.dcp.storage import entry_of, is_dcp_entry, list_dcp, rows_of, verify_dcp
from ckptpilot.errors import CheckpointFormatError, NoCheckpointError
from ckptpilot.policy import Policy
from ckptpilot.restorer import Read, Restored, SkippedCheckpoint
from ckptpilot.tiers.remote.store import STAGING_MARK
from ckptpilot.tiers.sharded import NotLoadable, ShardedTier
from ckptpilot.tiers.sharded.load import rank_failures, why_failed
from ckptpilot.vocab import RecoverySource, Status, Tier

__all__ = ["ShardedRestorer"]

log = logging.getLogger("ckptpilot")


class ShardedRestorer:
    """One rank's restores of a sharded training state from ``tier``; every method that
    votes is collective (``agreement`` None: a single process)."""

    def __init__(self, policy: Policy, tier: ShardedTier, *, catalog: Catalog,
                 agreement: RankAgreement | None, rank: int, world_size: int) -> None:
        self._policy = policy
        self._tier = tier
        self._catalog = catalog
        self._agreement = agreement
        self._rank = rank
        self._world_size = world_size
        self._remote = tier.remote

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
        where = self._tier.locate(target)
        read: Read | None = None
        why: BaseException | None = None
        failure: BaseException | None = None
        try:
            opened = self._tier.open(target)
            check_format(opened.meta, f"{where}: the meta of the saved rank")
            read = Read(RecoverySource.REMOTE, opened.level, opened.source,
                        opened.bytes_read, opened.meta, opened.tensor)
        except CheckpointException as e:  # raised on every rank, whichever rank failed
            errors = rank_failures(e).values()
            if all(isinstance(x, (CheckpointFormatError, OSError)) for x in errors):
                why = e
            else:
                failure = e
        except (CheckpointFormatError, OSError, NoCheckpointError) as e:
            why = e  # not StateError: the live state misfits, every rank raises
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
                why, NotLoadable)
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

    def _after(self, step: int, read: Read) -> None:
        saved_world = int(read.meta["world_size"])
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
