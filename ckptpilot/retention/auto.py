"""Retention while the run trains, and the disk budget (SPEC §8; policy keys
``retention.auto``, ``retention.max_bytes``, ``retention.min_free_bytes``).

This module owns :class:`AutoPruner`. The writer thread calls :meth:`AutoPruner.prune` after
each save it published valid, and :meth:`AutoPruner.make_room` before it writes one to the
remote tier; never the training thread. Both go through the pure planners of ``retention.plan``
(``plan_retention``, ``plan_room``) and its crash-safe executor, exactly like
``ckptpilot prune``: a prune killed half-way leaves ``expired`` rows whose files the next
prune removes (``repair``), never a ``valid`` row without its files. What a row's location
names is deleted only when the tier finds it is that row's checkpoint
(``tiers.remote.entries``); a refused row is logged with the reason and left as it was.

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
from typing import NamedTuple

from ckptpilot.catalog import Moves
from ckptpilot.errors import CkptPilotError, RemovalRefusedError
from ckptpilot.policy import RetentionPolicy
from ckptpilot.retention.plan import (
    BestPolicy,
    PruneReport,
    RetentionPlan,
    execute_plan,
    plan_retention,
    plan_room,
    repair,
)
from ckptpilot.storage.metadata import CheckpointRow, MetadataStore
from ckptpilot.tiers.remote.entries import location_entry, sweep
from ckptpilot.tiers.remote.store import RemoteTier
from ckptpilot.vocab import Status, Tier

__all__ = ["AutoPruner", "DiskBudgetError", "Remover", "remote_remover", "sweep_removals"]

log = logging.getLogger("ckptpilot")

SAVE_MARGIN_BYTES = 1 << 20
"""Added to a save's tensor bytes for its state.json, manifest and headers."""


class DiskBudgetError(CkptPilotError):
    """A save does not fit the disk budget even after pruning everything retention allows."""


class Remover(NamedTuple):
    """The callbacks of the retention executors (``retention.plan.execute_plan``, ``repair``)."""

    exists: Callable[[CheckpointRow], bool]
    remove: Callable[[CheckpointRow], None]
    vet: Callable[[CheckpointRow], str | None]


def remote_remover(remote: RemoteTier) -> Remover:
    """The retention executors' view of the remote tier. Files exist only for rows of the
    remote tier; a peer's or the memory tier's copy of an expired row is the holder's to
    drop (peers drop superseded states on commit and expire a run's shards with its lease),
    so removing such a row only marks it. A remote row's files are removed through
    ``RemoteTier.remove`` with the row's step and rank, so only that checkpoint can go."""

    def exists(row: CheckpointRow) -> bool:
        return row.tier is Tier.REMOTE and remote.exists(location_entry(row.location))

    def remove(row: CheckpointRow) -> None:
        if row.tier is Tier.REMOTE:
            remote.remove(location_entry(row.location), step=row.step, rank=row.rank)

    def vet(row: CheckpointRow) -> str | None:
        if row.tier is not Tier.REMOTE:
            return None
        try:
            remote.vet_removal(location_entry(row.location), step=row.step, rank=row.rank)
        except RemovalRefusedError as e:
            return str(e)
        except OSError:
            return None  # gone (removed), or unreadable: the removal itself reports it
        return None

    return Remover(exists, remove, vet)


def sweep_removals(remote: RemoteTier) -> tuple[list[str], list[str]]:
    """Remove what removals cut short left on the remote tier (``*.removing-*``): returns
    (names removed, one line per failure)."""
    try:
        names = remote.list()
    except OSError as e:
        return [], [f"cannot list {remote.url}: {e}"]
    return sweep(remote, names)


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
        self._remover = remote_remover(remote)

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
        report = self._execute(plan)
        if report.removed or report.failed:
            log.info("retention: removed %d checkpoint(s)%s", len(report.removed),
                     f", {len(report.failed)} removal(s) failed (the next prune retries)"
                     if report.failed else "")
        return report

    def _execute(self, plan: RetentionPlan[CheckpointRow]) -> PruneReport:
        remover = self._remover
        report = execute_plan(plan, Moves(self._store), remover.remove,  # type: ignore[arg-type]
                              vet=remover.vet)
        _log_refusals(report)
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
        report = self._execute(plan)
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
        remover = self._remover
        fixed = repair(Moves(self._store), remover.exists, remover.remove,  # type: ignore[arg-type]
                       vet=remover.vet)  # type: ignore[arg-type]
        _log_refusals(fixed)
        if fixed.removed:
            log.info("retention: finished %d interrupted removal(s)", len(fixed.removed))
        swept, failed = sweep_removals(self._remote)
        if swept:
            log.info("retention: removed %d leftover(s) of interrupted removals",
                     len(swept))
        for line in failed:
            log.warning("retention: %s", line)


def _log_refusals(report: PruneReport) -> None:
    for row_id, line in report.refused:
        log.warning("retention: row %d %s", row_id, line)
