"""Retention while the run trains, and the disk budget (SPEC §8; policy keys
``retention.auto``, ``retention.max_bytes``, ``retention.min_free_bytes``).

This module owns :class:`AutoPruner`. The writer thread calls :meth:`AutoPruner.prune` after
each save it published valid, and :meth:`AutoPruner.make_room` before it writes one to the
remote tier; never the training thread. Both go through the pure planners of ``retention``
(``plan_retention``, ``plan_room``) and its crash-safe executor, exactly like
``ckptpilot prune``: a prune killed half-way leaves ``expired`` rows whose files the next
prune removes (``repair``), never a ``valid`` row without its files.

One rank decides for the shared storage: rank 0 has a pruner, the others none. It plans over
every rank's rows, and the planner keeps the newest step that every rank holds, so what it
removes never leaves the ranks without a step they all can restore. The budget is checked
by rank 0 for the whole step (its part times the world size).

It must not decide what to save: a save it cannot make room for is refused with
:class:`DiskBudgetError` before a byte of it is written (the writer logs it, training goes
on, the last valid checkpoint stays).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ckptpilot.errors import CkptPilotError
from ckptpilot.policy import RetentionPolicy
from ckptpilot.retention import (
    BestPolicy,
    PruneReport,
    execute_plan,
    plan_retention,
    plan_room,
    repair,
)
from ckptpilot.storage.metadata import CheckpointRow, MetadataStore
from ckptpilot.tiers.remote import RemoteTier
from ckptpilot.vocab import Status, Tier

__all__ = ["AutoPruner", "DiskBudgetError", "remote_remover"]

log = logging.getLogger("ckptpilot")

SAVE_MARGIN_BYTES = 1 << 20
"""Added to a save's tensor bytes for its state.json, manifest and headers."""


class DiskBudgetError(CkptPilotError):
    """A save does not fit the disk budget even after pruning everything retention allows."""


def remote_remover(remote: RemoteTier) -> tuple[Callable[[CheckpointRow], bool],
                                                Callable[[CheckpointRow], None]]:
    """``exists`` and ``remove`` for the retention executors. Files exist only for rows of
    the remote tier; a peer's or the memory tier's copy of an expired row is the holder's to
    drop (peers drop superseded states on commit and expire a run's shards with its lease),
    so removing such a row only marks it."""

    def entry(row: CheckpointRow) -> str:
        return row.location.rstrip("/").rsplit("/", 1)[-1]

    def exists(row: CheckpointRow) -> bool:
        return row.tier is Tier.REMOTE and remote.exists(entry(row))

    def remove(row: CheckpointRow) -> None:
        if row.tier is Tier.REMOTE and remote.exists(entry(row)):
            remote.remove(entry(row))

    return exists, remove


def _occupies(row: CheckpointRow) -> bool:
    """Whether the row's files may still be on the remote tier."""
    if row.tier is not Tier.REMOTE:
        return False
    return row.status is not Status.EXPIRED or row.removed_at is None


class AutoPruner:
    """Retention and the disk budget of one run, applied from the writer thread."""

    def __init__(self, store: MetadataStore, run_id: str, remote: RemoteTier,
                 policy: RetentionPolicy, *, world_size: int) -> None:
        self._store = store
        self._run_id = run_id
        self._remote = remote
        self._policy = policy
        self._world_size = world_size
        best = policy.best
        self._best = None if best is None else BestPolicy(best.metric, best.mode, best.keep)
        self._exists, self._remove = remote_remover(remote)

    @property
    def auto(self) -> bool:
        return self._policy.auto

    @property
    def budgeted(self) -> bool:
        return self._policy.budgeted

    def prune(self) -> PruneReport:
        """Apply the retention policy now (after a save was published valid)."""
        self._repair()
        plan = plan_retention(self._store.rows(self._run_id), self._policy, best=self._best)
        report = execute_plan(plan, self._store, self._remove)  # type: ignore[arg-type]
        if report.removed or report.failed:
            log.info("retention: removed %d checkpoint(s)%s", len(report.removed),
                     f", {len(report.failed)} removal(s) failed (the next prune retries)"
                     if report.failed else "")
        return report

    def used_bytes(self) -> int:
        """Bytes the run's checkpoints hold on the remote tier, by their rows."""
        return sum(row.bytes_encoded or 0 for row in self._store.rows(self._run_id)
                   if _occupies(row))

    def make_room(self, step: int, part_bytes: int) -> None:
        """Prune what the budget needs for step ``step`` (``part_bytes`` on this rank, the
        same on every rank), in retention order; raises :class:`DiskBudgetError` naming the
        step, the budget and what stays protected when even that is not enough."""
        incoming = (part_bytes + SAVE_MARGIN_BYTES) * self._world_size
        need = self._shortfall(incoming)
        if need <= 0:
            return
        self._repair()
        plan = plan_room(self._store.rows(self._run_id), self._policy, need,
                         best=self._best)
        report = execute_plan(plan, self._store, self._remove)  # type: ignore[arg-type]
        if report.removed:
            log.warning("disk budget: removed %d checkpoint(s) to make room for step %d",
                        len(report.removed), step)
        still = self._shortfall(incoming)
        if still > 0:
            kept = ", ".join(f"step {row.step} ({why})" for row, why in plan.keep[:5])
            raise DiskBudgetError(
                f"step {step}: the save needs {incoming} bytes on {self._remote.url}, "
                f"{still} more than the budget allows ({self._budget_words()}) after "
                f"pruning all that retention allows; kept: {kept or 'nothing'}")

    def _shortfall(self, incoming: int) -> int:
        short = 0
        policy = self._policy
        if policy.max_bytes is not None:
            short = max(short, self.used_bytes() + incoming - policy.max_bytes)
        if policy.min_free_bytes is not None:
            free = self._remote.free_bytes()
            if free is not None:
                short = max(short, policy.min_free_bytes - (free - incoming))
        return short

    def _budget_words(self) -> str:
        policy, words = self._policy, []
        if policy.max_bytes is not None:
            words.append(f"retention.max_bytes {policy.max_bytes}, used {self.used_bytes()}")
        if policy.min_free_bytes is not None:
            free = self._remote.free_bytes()
            words.append(f"retention.min_free_bytes {policy.min_free_bytes}, free "
                         f"{'unknown' if free is None else free}")
        return "; ".join(words)

    def _repair(self) -> None:
        fixed = repair(self._store, self._exists, self._remove)  # type: ignore[arg-type]
        if fixed.removed:
            log.info("retention: finished %d interrupted removal(s)", len(fixed.removed))
