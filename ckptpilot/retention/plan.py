"""Retention: which checkpoints to keep, and the crash-safe removal of the others (SPEC §8).

This module owns the retention rules and the order of the removal steps. The planner,
:func:`plan_retention`, is pure: rows, the policy and the time arrive as data and a frozen
:class:`RetentionPlan` comes back, so every rule is testable without files or a database.
The executors, :func:`execute_plan` and :func:`repair`, touch the world only through what they
are handed: a store object with the few methods of :class:`RetentionStore` (the
catalogue's ``catalog.Moves`` has them, as every change of a row's status is the
catalogue's) and callbacks that test for and remove a checkpoint's files. This module
imports no storage or tier module; deciding how a checkpoint's files are removed belongs to
the tier that holds them.

Rules, applied per (run, rank, level, tier) group (SPEC §2, §8):

- ``critical`` and ``milestone`` rows are kept forever; ``important`` keeps the newest
  ``important_keep`` and ``routine`` the newest ``routine_keep`` of the group's valid rows.
- With a :class:`BestPolicy`, the ``keep`` best valid rows by the user metric of each (run,
  rank, tier) are kept, whatever their level or class: "the best checkpoints" are steps to the
  user, not pulses or organs.
- Never removed: anything ``pending``; a milestone; the newest ``keep_last`` valid rows of
  each (run, rank, tier) (default 2: a newest one that rots after validation needs an older
  one to walk back to) — per tier rather than per rank, because the tiers fail differently
  (the memory tier dies with the node, so the newest remote copy must survive a newer memory
  copy); and,
  transitively, the base of any kept delta (``base_step``). The base is matched by step in
  every tier of the same run and rank, since a row does not record which tier holds its base;
  over-keeping a base costs bytes, removing a needed one loses the delta. And the newest
  step that every rank of the run holds valid (per tier), on every rank: when one rank's
  newest part is lost, that is the step a distributed restore falls back to.
- ``expired`` rows are not planned (their removal is :func:`repair`'s business) and neither
  they nor ``corrupted`` rows count toward a quota.
- ``corrupted`` rows are removed unless a never-remove rule protects them (a milestone, the
  base of a kept delta): recovery never loads them, so keeping them only costs storage, and
  their metadata row stays behind as an ``expired`` record with its audit entry. This holds
  for a corrupted ``critical`` row too: its class says the state was worth keeping, the
  corruption says this copy cannot provide it.

Removal order, per row (:func:`execute_plan`): the tier checks that the row's location is
one of its checkpoints (``vet``: a tampered or wrong location is refused and the row left as
it was), the row is marked ``expired`` and committed, the file is removed, then the removal
is committed with its audit entry. A crash between the
steps leaves an ``expired`` row whose removal is unrecorded, never a ``valid`` row without
its file nor a file without a row; :func:`repair` finishes such rows on the next run.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, Literal, Protocol, TypeVar

from ckptpilot.policy import RetentionPolicy
from ckptpilot.vocab import Level, RetentionClass, Status, Tier

__all__ = [
    "BestPolicy",
    "PruneReport",
    "RetentionPlan",
    "RetentionRow",
    "RetentionStore",
    "StoredRow",
    "execute_plan",
    "plan_retention",
    "plan_room",
    "repair",
]

class RetentionRow(Protocol):
    """The fields of a checkpoint row the planner reads (``CheckpointRow`` has them).

    Enumerated fields may be str enums or plain strings (``"valid"``, ``"memory"``).
    """

    @property
    def id(self) -> int: ...
    @property
    def run_id(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def level(self) -> Level | str: ...
    @property
    def tier(self) -> Tier | str: ...
    @property
    def location(self) -> str: ...
    @property
    def status(self) -> Status | str: ...
    @property
    def retention_class(self) -> RetentionClass | str: ...
    @property
    def metric_name(self) -> str | None: ...
    @property
    def metric_value(self) -> float | None: ...
    @property
    def base_step(self) -> int | None: ...


class StoredRow(RetentionRow, Protocol):
    """A row as :func:`repair` reads it back: ``removed_at`` is None until removal is recorded."""

    @property
    def removed_at(self) -> float | None: ...


class RetentionStore(Protocol):
    """What the executors need from the catalogue (``catalog.Moves`` provides it).

    ``prune`` marks the row ``expired`` only while it still has the ``expect`` values and
    returns None otherwise; ``record_removal`` records in one transaction that an expired
    row's file is gone, with an audit entry.
    """

    def prune(self, key: int, *, expect: Mapping[str, Any]) -> object | None: ...

    def record_removal(self, key: int, *, action: str,
                       details: Mapping[str, Any]) -> object: ...

    def rows(self, *, status: Status) -> Sequence[StoredRow]: ...


R = TypeVar("R", bound=RetentionRow)


@dataclass(frozen=True)
class BestPolicy:
    """Keep the ``keep`` best checkpoints by the user metric ``metric`` (``min`` or ``max``).

    Rows carry the metric through ``metric_name`` / ``metric_value``; rows without it, or
    with another metric, do not compete. Ties go to the newer step.
    """

    metric: str
    mode: Literal["min", "max"] = "min"
    keep: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"best.metric: expected a metric name, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"best.mode: expected 'min' or 'max', got {self.mode!r}")
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise ValueError(f"best.keep: expected an int >= 1, got {self.keep!r}")


@dataclass(frozen=True)
class RetentionPlan(Generic[R]):
    """What to keep and what to remove, each row with a human-readable reason.

    Both tuples are sorted by run, rank, tier, level, then newest step first. Rows already
    ``expired`` appear in neither. ``now`` is the time the caller planned at (seconds since
    the epoch, or None); the planner never reads the clock.
    """

    keep: tuple[tuple[R, str], ...]
    remove: tuple[tuple[R, str], ...]
    now: float | None = None

    def reason(self, row_id: int) -> str | None:
        """The reason recorded for a row id, or None when the row is not in the plan."""
        for row, why in (*self.keep, *self.remove):
            if row.id == row_id:
                return why
        return None


@dataclass(frozen=True)
class PruneReport:
    """What an executor did: row ids removed, skipped (with why), failed (with the error)
    and refused (one line naming the row and the reason).

    A skipped row changed after planning (pinned, re-validated, replaced) and was left alone;
    a failed row is ``expired`` with its file still present, for :func:`repair` to finish; a
    refused row's location is not a checkpoint the tier may delete: nothing was deleted and
    the row is as it was (the next prune refuses it again until someone looks at it).
    """

    removed: tuple[int, ...] = ()
    skipped: tuple[tuple[int, str], ...] = ()
    failed: tuple[tuple[int, str], ...] = ()
    refused: tuple[tuple[int, str], ...] = ()


def _text(value: object) -> str:
    return str(value.value) if isinstance(value, Enum) else str(value)


def _sort_key(row: RetentionRow) -> tuple[str, int, str, str, int, int]:
    return (row.run_id, row.rank, _text(row.tier), _text(row.level), -row.step, row.id)


def _newest_first(rows: Sequence[R]) -> list[R]:
    return sorted(rows, key=lambda row: (-row.step, -row.id))


def _newest_complete(valid: Sequence[R]) -> list[R]:
    """The rows of the newest step that every rank of a multi-rank run holds valid, per tier:
    what a distributed restore agrees on when one rank's newest part is missing or damaged."""
    ranks: dict[tuple[str, str], set[int]] = defaultdict(set)
    holders: dict[tuple[str, str, int], list[R]] = defaultdict(list)
    for row in valid:
        ranks[(row.run_id, _text(row.tier))].add(row.rank)
        holders[(row.run_id, _text(row.tier), row.step)].append(row)
    newest: dict[tuple[str, str], int] = {}
    for (run, tier, step), rows in holders.items():
        everyone = ranks[(run, tier)]
        if (len(everyone) > 1 and {row.rank for row in rows} == everyone
                and step > newest.get((run, tier), -1)):
            newest[(run, tier)] = step
    return [row for (run, tier), step in newest.items() for row in holders[(run, tier, step)]]


def plan_retention(
    rows: Sequence[R],
    policy: RetentionPolicy,
    *,
    best: BestPolicy | None = None,
    now: float | None = None,
) -> RetentionPlan[R]:
    """Decide, for every row not yet expired, whether it is kept or removed, and why.

    ``rows`` may span several runs, ranks, levels and tiers and come in any order; the plan
    depends only on their content. A kept row lists every rule that keeps it.
    """
    live = [row for row in rows if _text(row.status) != Status.EXPIRED]
    keep = _never_removed(live, best, policy.keep_last)
    remove: dict[int, str] = {}
    for row in live:
        if _text(row.status) == Status.CORRUPTED:
            remove[row.id] = "corrupted: never a recovery point"

    valid = [row for row in live if _text(row.status) == Status.VALID]
    by_group: dict[tuple[str, int, str, str], list[R]] = defaultdict(list)
    for row in valid:
        by_group[(row.run_id, row.rank, _text(row.level), _text(row.tier))].append(row)

    quotas = {
        RetentionClass.IMPORTANT.value: policy.important_keep,
        RetentionClass.ROUTINE.value: policy.routine_keep,
    }
    for group_rows in by_group.values():
        seen: dict[str, int] = defaultdict(int)
        for row in _newest_first(group_rows):
            cls = _text(row.retention_class)
            if cls == RetentionClass.CRITICAL.value:
                keep[row.id].append("critical: kept forever")
            elif cls in quotas:
                seen[cls] += 1
                if seen[cls] <= quotas[cls]:
                    keep[row.id].append(f"{cls}: within newest {quotas[cls]}")
                else:
                    remove[row.id] = f"{cls}: beyond newest {quotas[cls]}"

    _keep_bases(keep, live)
    by_id = {row.id: row for row in live}
    kept = tuple(sorted(((by_id[row_id], "; ".join(reasons)) for row_id, reasons in keep.items()),
                        key=lambda item: _sort_key(item[0])))
    removed = tuple(sorted(((by_id[row_id], why) for row_id, why in remove.items()
                            if row_id not in keep),
                           key=lambda item: _sort_key(item[0])))
    return RetentionPlan(keep=kept, remove=removed, now=now)


def _never_removed(live: Sequence[R], best: BestPolicy | None,
                   keep_last: int) -> dict[int, list[str]]:
    """The rows no rule may remove, not even a disk budget, each with why: pending, a
    milestone, the newest ``keep_last`` valid per (run, rank, tier), the newest step valid on
    every rank, and the best N by the user metric."""
    keep: dict[int, list[str]] = defaultdict(list)
    for row in live:
        if _text(row.status) == Status.PENDING:
            keep[row.id].append("pending (save in flight)")
        if _text(row.retention_class) == RetentionClass.MILESTONE.value:
            keep[row.id].append("milestone (pinned)")
    valid = [row for row in live if _text(row.status) == Status.VALID]
    by_tier: dict[tuple[str, int, str], list[R]] = defaultdict(list)
    for row in valid:
        by_tier[(row.run_id, row.rank, _text(row.tier))].append(row)
    for (_run, _rank, tier), tier_rows in by_tier.items():
        newest = _newest_first(tier_rows)
        keep[newest[0].id].append(f"newest valid in {tier}")
        for row in newest[1:keep_last]:
            keep[row.id].append(f"within the newest {keep_last} valid in {tier} (walk-back)")
    for row in _newest_complete(valid):
        keep[row.id].append(f"newest step valid on every rank in {_text(row.tier)}")
    if best is not None:
        for tier_rows in by_tier.values():
            ranked = [row for row in tier_rows
                      if row.metric_name == best.metric and row.metric_value is not None
                      and math.isfinite(row.metric_value)]
            sign = 1.0 if best.mode == "min" else -1.0
            ranked.sort(key=lambda row: (sign * float(row.metric_value or 0.0), -row.step,
                                         -row.id))
            for row in ranked[:best.keep]:
                keep[row.id].append(f"best {best.keep} by {best.metric} ({best.mode})")
    return keep


def _keep_bases(keep: dict[int, list[str]], live: Sequence[R]) -> None:
    """Add the bases of kept deltas to ``keep``, transitively: a kept base that is itself a
    delta needs its own."""
    by_step: dict[tuple[str, int, int], list[R]] = defaultdict(list)
    for row in live:
        by_step[(row.run_id, row.rank, row.step)].append(row)
    by_id = {row.id: row for row in live}
    dependents: dict[int, set[int]] = defaultdict(set)
    todo = list(keep)
    while todo:
        delta = by_id[todo.pop()]
        if delta.base_step is None:
            continue
        for base in by_step.get((delta.run_id, delta.rank, delta.base_step), []):
            if base.id not in keep and base.id not in dependents:
                todo.append(base.id)
            dependents[base.id].add(delta.step)
    for base_id, steps in dependents.items():
        listed = ", ".join(str(step) for step in sorted(steps))
        noun = "delta at step" if len(steps) == 1 else "deltas at steps"
        keep[base_id].append(f"base of kept {noun} {listed}")


_BUDGET_ORDER = {RetentionClass.ROUTINE.value: 0, RetentionClass.IMPORTANT.value: 1,
                 RetentionClass.CRITICAL.value: 2}


def _bytes(row: RetentionRow) -> int:
    return int(getattr(row, "bytes_encoded", None) or 0)


def plan_room(
    rows: Sequence[R],
    policy: RetentionPolicy,
    need_bytes: int,
    *,
    tier: Tier = Tier.REMOTE,
    best: BestPolicy | None = None,
    now: float | None = None,
) -> RetentionPlan[R]:
    """What to remove so that ``need_bytes`` more fit a disk budget on ``tier``: first what
    :func:`plan_retention` removes anyway, then, while that frees less, valid checkpoints of
    ``tier`` that only their class quota keeps, in retention order — routine before important
    before critical, oldest step first, every rank's part of a step together. Never a row
    :func:`plan_retention` may never remove (pending, a milestone, the newest valid, the newest
    step complete on every rank, best N) nor the base of a delta that stays. Sizes come from
    the rows' ``bytes_encoded``. When even that is not enough the plan removes all it may: the
    caller compares what it frees with what it needed.
    """
    plan = plan_retention(rows, policy, best=best, now=now)
    freed = sum(_bytes(row) for row, _ in plan.remove if _text(row.tier) == tier.value)
    if freed >= need_bytes:
        return plan
    live = [row for row in rows if _text(row.status) != Status.EXPIRED]
    protected = _never_removed(live, best, policy.keep_last)
    removing = {row.id for row, _ in plan.remove}
    candidates = sorted(
        (row for row, _ in plan.keep
         if row.id not in protected and _text(row.status) == Status.VALID
         and _text(row.tier) == tier.value and _text(row.retention_class) in _BUDGET_ORDER),
        key=lambda row: (_BUDGET_ORDER[_text(row.retention_class)], row.step, row.rank, row.id))
    evicted: dict[int, R] = {}
    last_step: tuple[str, int] | None = None
    for row in candidates:
        if freed >= need_bytes and (row.run_id, row.step) != last_step:
            break
        if any(other.base_step == row.step and other.run_id == row.run_id
               and other.rank == row.rank and other.id not in evicted
               and other.id not in removing for other in live):
            continue  # the base of a delta that stays
        evicted[row.id] = row
        last_step = (row.run_id, row.step)
        freed += _bytes(row)
    if not evicted:
        return plan
    why = f"disk budget: {need_bytes} bytes needed on {tier.value}, oldest of the lowest class"
    keep = tuple(item for item in plan.keep if item[0].id not in evicted)
    remove = tuple(sorted((*plan.remove, *((row, why) for row in evicted.values())),
                          key=lambda item: _sort_key(item[0])))
    return RetentionPlan(keep=keep, remove=remove, now=now)


def _details(row: RetentionRow, reason: str) -> dict[str, Any]:
    return {
        "run_id": row.run_id, "step": row.step, "rank": row.rank, "tier": _text(row.tier),
        "level": _text(row.level), "location": row.location, "reason": reason,
    }


def _refusal(row: RetentionRow, reason: str) -> str:
    return (f"refused: run {row.run_id}, step {row.step}, rank {row.rank}, {_text(row.tier)}, "
            f"location {row.location}: {reason}; nothing was deleted")


def execute_plan(plan: RetentionPlan[R], store: RetentionStore,
                 remove_file: Callable[[R], None], *,
                 vet: Callable[[R], str | None] | None = None) -> PruneReport:
    """Remove the plan's rows one at a time, in the crash-safe order.

    Per row: ``vet(row)`` (the reason the tier refuses to delete what the row's location
    names, or None) — a refused row is reported and left as it was; then mark it
    ``expired`` (committed, and only if its status, class and location are still what the
    plan saw), call ``remove_file(row)``, then record the removal with an
    audit entry (committed). ``remove_file`` must delete the checkpoint's files in its tier;
    a missing file counts as removed. Any other ``OSError`` leaves the row expired for
    :func:`repair` and the executor goes on with the next row; other exceptions propagate.
    """
    removed: list[int] = []
    skipped: list[tuple[int, str]] = []
    failed: list[tuple[int, str]] = []
    refused: list[tuple[int, str]] = []
    for row, reason in plan.remove:
        refusal = None if vet is None else vet(row)
        if refusal is not None:
            refused.append((row.id, _refusal(row, refusal)))
            continue
        expect = {"status": _text(row.status), "retention_class": _text(row.retention_class),
                  "location": row.location}
        if store.prune(row.id, expect=expect) is None:
            skipped.append((row.id, "changed or gone since the plan was made"))
            continue
        try:
            remove_file(row)
        except FileNotFoundError:
            pass
        except OSError as error:
            failed.append((row.id, f"{type(error).__name__}: {error}"))
            continue
        store.record_removal(row.id, action="prune", details=_details(row, reason))
        removed.append(row.id)
    return PruneReport(removed=tuple(removed), skipped=tuple(skipped), failed=tuple(failed),
                       refused=tuple(refused))


def repair(store: RetentionStore, exists: Callable[[StoredRow], bool],
           remove_file: Callable[[StoredRow], None], *,
           vet: Callable[[StoredRow], str | None] | None = None) -> PruneReport:
    """Finish the removals a crash or an I/O error interrupted; run before planning.

    Every ``expired`` row whose removal is not recorded has its file removed when
    ``exists(row)`` says it is still there, then the removal is recorded (action
    ``repair``); a row ``vet`` refuses (as in :func:`execute_plan`) is reported and left
    unrecorded. Idempotent: a second run finds nothing more to do.
    """
    removed: list[int] = []
    failed: list[tuple[int, str]] = []
    refused: list[tuple[int, str]] = []
    for row in store.rows(status=Status.EXPIRED):
        if row.removed_at is not None:
            continue
        refusal = None if vet is None else vet(row)
        if refusal is not None:
            refused.append((row.id, _refusal(row, refusal)))
            continue
        try:
            present = exists(row)
            if present:
                remove_file(row)
        except FileNotFoundError:
            present = False
        except OSError as error:
            failed.append((row.id, f"{type(error).__name__}: {error}"))
            continue
        details = _details(row, "finishing an interrupted removal")
        details["file_was_present"] = present
        store.record_removal(row.id, action="repair", details=details)
        removed.append(row.id)
    return PruneReport(removed=tuple(removed), failed=tuple(failed), refused=tuple(refused))
