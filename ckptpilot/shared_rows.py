"""The rows of a checkpoint every rank shares: the images of a
:class:`~ckptpilot.tiers.base.Collective` tier (the DCP-backed sharded tier: one DCP
checkpoint per step, each rank's row pointing at it), as the restorer reads and settles them.

Where one rank's image is that rank's alone, its rows are too (``catalog``, ``restorer``);
here a step is one checkpoint of every rank of its save, so a restore decides from every
rank's row, on every rank alike: the step is a candidate only when every row is ``valid``
(and every saved rank has one), and the first rank settles what a killed save left, condemns
every rank's row of a step whose bytes are wrong, and abandons the rows of saved ranks the
run no longer has. Every rank computes the same candidates, whatever rows its own rank
index has (a rank the saved run did not have has none).

It must not read the images (the tier does) nor choose what to load (the recovery plan).
Threading: the training thread, during a restore.
"""

from __future__ import annotations

import logging

from ckptpilot.catalog import Catalog
from ckptpilot.errors import CheckpointFormatError
from ckptpilot.storage.lineage import Lineage
from ckptpilot.storage.metadata import CheckpointRow
from ckptpilot.tiers.base import CheckpointTier, Survey, Surveyed
from ckptpilot.validation.recovery import Candidate
from ckptpilot.vocab import Status

__all__ = ["abandon_beyond", "candidates", "condemn_every_rank", "settle"]

log = logging.getLogger("ckptpilot")


def _rows(catalog: Catalog, tier: CheckpointTier, durable: Surveyed,
          status: tuple[Status, ...] | None = None) -> list[CheckpointRow]:
    """Every rank's rows of ``tier`` at one of its images (not, say, a replicated archive
    in the same place)."""
    return [row for row in catalog.store.rows(catalog.run_id, tier=tier.kind, status=status)
            if durable.owns(row.location)]


def settle(catalog: Catalog, tier: CheckpointTier, durable: Surveyed, survey: Survey) -> None:
    """(first rank) Every rank's rows a killed save left ``pending``: ``valid`` when the
    checkpoint was published (its commit file is written only after every rank's part was
    validated; the read verifies every item again), else ``corrupted``."""
    for row in _rows(catalog, tier, durable, (Status.PENDING,)):
        if row.step in survey.published:
            catalog.moves.publish(row.key, note="published, then the writer died",
                                  location=survey.published[row.step])
        else:
            catalog.moves.condemn(row.key,
                                  "the writer died before the checkpoint was published")


def candidates(catalog: Catalog, tier: CheckpointTier, durable: Surveyed, survey: Survey,
               lineage: Lineage | None
               ) -> tuple[list[Candidate], list[tuple[int, str, str]], dict[int, str]]:
    """The steps to consider, from every rank's rows and the tier's listing; the steps that
    exist but cannot be tried, as (step, location, why); and this rank's digest of each
    step (None for a rank without a row of it)."""
    by_step: dict[int, list[CheckpointRow]] = {}
    for row in _rows(catalog, tier, durable):
        by_step.setdefault(row.step, []).append(row)
    found: list[Candidate] = []
    missing: list[tuple[int, str, str]] = []
    for step in sorted(set(by_step) | set(survey.published)):
        rows, where = by_step.get(step, []), tier.locate(step)
        bad = [row for row in rows if row.status is not Status.VALID]
        if not rows:  # no metadata (database lost or rebuilt): its own labels say what it is
            found.append(_unrecorded(durable, tier, step, where, lineage))
        elif bad:
            found.append(Candidate(step, rows[0].level, tier.kind, where, bad[0].status))
        elif step not in survey.published:
            missing.append((step, where, f"recorded valid but its data is missing from "
                            f"{durable.url} (deleted, or a wrong mount / tiers.remote.url?)"))
        else:
            absent = _ranks_without_rows(durable, step, rows)
            if absent:
                missing.append((step, where, f"no row for rank(s) {absent}"))
            else:
                found.append(Candidate(step, rows[0].level, tier.kind, where, Status.VALID))
    own = {row.step: row.sha256 for rows in by_step.values() for row in rows
           if row.rank == catalog.rank}
    return found, missing, own


def _unrecorded(durable: Surveyed, tier: CheckpointTier, step: int, where: str,
                lineage: Lineage | None) -> Candidate:
    try:
        labels = durable.labels(step)
    except (CheckpointFormatError, OSError):  # reading it again reports why
        return Candidate(step, "unknown", tier.kind, where, None)
    # A rank the saved run did not have saved no part on any of its continuations: the
    # saved ranks judge the step (the agreement keeps only the steps every rank offers).
    abandoned = (None if lineage is None or "branch" not in labels
                 else lineage.why_abandoned(labels["branch"], step))
    return Candidate(step, labels["level"], tier.kind, where, None, abandoned)


def _ranks_without_rows(durable: Surveyed, step: int, rows: list[CheckpointRow]) -> list[int]:
    """The saved ranks of ``step`` (its own labels' ``world_size``) that have no row."""
    try:
        saved = int(durable.labels(step)["world_size"])
    except (CheckpointFormatError, OSError):  # reading it reports why
        return []
    return sorted(set(range(saved)) - {row.rank for row in rows})


def condemn_every_rank(catalog: Catalog, tier: CheckpointTier, durable: Surveyed, step: int,
                       error: BaseException) -> None:
    """(first rank) The step's bytes are wrong: every rank's row of it, never tried again."""
    if catalog.rank != 0:
        return
    for row in _rows(catalog, tier, durable, (Status.VALID, Status.PENDING)):
        if row.step == step:
            catalog.moves.condemn(row.key, f"failed on restore: {error}")


def abandon_beyond(catalog: Catalog, tier: CheckpointTier, durable: Surveyed, step: int,
                   world_size: int) -> None:
    """(first rank) Restoring ``step`` abandons the continuation after it; the rows of
    saved ranks this run does not have belong to no rank that would abandon them."""
    if catalog.rank != 0:
        return
    for row in _rows(catalog, tier, durable, (Status.VALID, Status.PENDING)):
        if row.step > step and row.rank >= world_size:
            catalog.moves.abandon(row.key, f"abandoned: the run was restored to step {step}")
