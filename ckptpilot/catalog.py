"""The catalogue: the rules of a checkpoint row's status, one rank's rows, and the recover pin.

This module owns every change of a row's status, in the whole package. Each change is a named
:class:`Operation` with the statuses it applies to and the status each one leads to
(:data:`OPERATIONS`); :class:`Moves` is the one door through which they reach the metadata
store, which applies one atomically (the row is read and changed in one write transaction)
and refuses, naming the row (step, rank, tier), its status and the operation's moves, one the
row's status does not allow. No other module calls the store's status-changing methods
(``tests/test_catalog.py`` reads the source to keep it so). The life cycle the operations
keep: a ``corrupted`` row never becomes ``valid`` again (its bytes may be intermittently bad;
a new checkpoint must be written), and nothing moves an ``expired`` row (its file may already
be gone); a save starts ``pending`` (``MetadataStore.add_pending``).

It also owns :class:`Catalog`, every change the save and restore paths make to the rows of
one (run, rank): a save recorded ``pending``, then published ``valid`` or refused
``corrupted``; an old copy superseded when a step is saved again or the peers drop it; the
continuation after a restored step abandoned; the saves before a loss spike protected from
pruning; a metric attached; a copy that failed on restore condemned. It also
owns the recover pin (``ckptpilot recover --step N`` writes it, the next ``restore`` consumes
it), shared with :mod:`ckptpilot.cli.ops`, and the rank's current continuation: abandoning
the saves after a restored step first records a fork in the rank's lineage file
(``storage.lineage``), so that the files, not only these rows, say what was abandoned.

It must not touch checkpoint bytes or decide what to save or restore: tiers hold bytes, the
writer and the restorer decide. Threading: the writer thread and (during a restore) the
training thread use it, never at once (a restore flushes the writer first); the store itself
is safe across threads.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptpilot.errors import NoCheckpointError
from ckptpilot.rundir import lineage_path
from ckptpilot.storage.lineage import Lineage, read_lineage
from ckptpilot.storage.lineage import fork as _fork
from ckptpilot.storage.metadata import CheckpointRow, MetadataStore, RowKey
from ckptpilot.vocab import CheckpointKey, RetentionClass, Status, Tier

__all__ = ["OPERATIONS", "RECOVER_PIN", "Catalog", "Moves", "Operation", "Pin", "SaveIntent",
           "write_pin"]

_NOTE_CHARS = 2000
"""A note (often an error's text) is cut to this length: a row stays a row, not a log."""


@dataclass(frozen=True)
class Operation:
    """A named change of a row: each status it applies to, with the status it leads to (the
    same status: the row's fields change, not its status)."""

    name: str
    moves: Mapping[Status, Status]


_P, _V, _C, _E = Status.PENDING, Status.VALID, Status.CORRUPTED, Status.EXPIRED

PUBLISH = Operation("publish", {_P: _V})
"""A save verified (and, on the remote tier, published under its name): a recovery point."""
RECORD_CHECK = Operation("record-check", {_P: _P})
"""A part read back and verified before its checkpoint is published: still ``pending``."""
CONDEMN = Operation("condemn", {_P: _C, _V: _C})
"""A copy that failed verification (after writing, on restore, or by ``validate``)."""
ABANDON = Operation("abandon", {_P: _C, _V: _E, _C: _E})
"""A continuation given up (a restore to an earlier step, a step saved again): a checked
copy expires, one never checked counts as corrupted, a corrupted one expires with its bytes
set aside."""
SUPERSEDE = Operation("supersede", {_V: _E})
"""A tier that keeps one state dropped this copy for a newer one."""
RECLASSIFY = Operation("reclassify", {_P: _P, _V: _V})
"""A live row's retention class raised (kept longer), its status unchanged."""
EXPIRE_REBUILT = Operation("expire-rebuilt", {_P: _E})
"""A row rebuilt from a checkpoint's own files that the lineage says was abandoned."""
PRUNE = Operation("prune", {_V: _E, _C: _E})
"""Retention removes a copy: expired first (committed), its files removed after."""
RECORD_REMOVAL = Operation("record-removal", {_E: _E})
"""An expired row's files are gone (``removed_at`` and an audit entry)."""

OPERATIONS = (PUBLISH, RECORD_CHECK, CONDEMN, ABANDON, SUPERSEDE, RECLASSIFY, EXPIRE_REBUILT,
              PRUNE, RECORD_REMOVAL)
"""Every change of a row's status the package makes."""


class Moves:
    """The one door through which a row's status changes: each method applies one
    :class:`Operation` to one row of ``store``, in one write transaction.

    A row whose status the operation does not apply to raises ``StatusTransitionError``
    naming it; a key without a row raises ``NoCheckpointError``. Safe across threads as the
    store is. The retention executors take a ``Moves`` as their store (``prune``,
    ``record_removal``, ``rows``).
    """

    def __init__(self, store: MetadataStore) -> None:
        self.store = store

    def _apply(self, operation: Operation, key: RowKey, **fields: Any) -> CheckpointRow:
        if "note" in fields:
            fields["note"] = fields["note"][:_NOTE_CHARS]
        return self.store.mark(key, operation.moves, operation=operation.name, **fields)

    def publish(self, key: RowKey, **fields: Any) -> CheckpointRow:
        """``pending`` → ``valid``, with what is known once the bytes are verified (its
        final location; the peers' stripe digest; timings)."""
        return self._apply(PUBLISH, key, **fields)

    def record_check(self, key: RowKey, *, seconds_validate: float) -> CheckpointRow:
        return self._apply(RECORD_CHECK, key, seconds_validate=seconds_validate)

    def condemn(self, key: RowKey, note: str, **fields: Any) -> CheckpointRow:
        """→ ``corrupted``; ``note`` says what failed."""
        return self._apply(CONDEMN, key, note=note, **fields)

    def abandon(self, key: RowKey, note: str, *, location: str | None = None) -> CheckpointRow:
        """→ ``expired`` (or ``corrupted`` when never checked); ``location``: where its bytes
        were set aside."""
        moved = {} if location is None else {"location": location}
        return self._apply(ABANDON, key, note=note, **moved)

    def supersede(self, key: RowKey, note: str) -> CheckpointRow:
        return self._apply(SUPERSEDE, key, note=note)

    def reclassify(self, key: RowKey, retention_class: RetentionClass,
                   note: str) -> CheckpointRow:
        return self._apply(RECLASSIFY, key, retention_class=retention_class.value, note=note)

    def expire_rebuilt(self, key: RowKey, note: str) -> CheckpointRow:
        return self._apply(EXPIRE_REBUILT, key, note=note)

    def prune(self, key: RowKey, *, expect: Mapping[str, Any]) -> CheckpointRow | None:
        """→ ``expired``, only while the row still has the ``expect`` column values (None,
        nothing changed, when it is gone or differs: e.g. pinned since the plan was made)."""
        return self.store.compare_and_mark(key, PRUNE.moves, operation=PRUNE.name,
                                           expect=expect)

    def record_removal(self, key: RowKey, *, action: str,
                       details: Mapping[str, Any]) -> CheckpointRow:
        """An expired row's files are gone; idempotent (``MetadataStore.finish_removal``)."""
        return self.store.finish_removal(key, RECORD_REMOVAL.moves,
                                         operation=RECORD_REMOVAL.name, action=action,
                                         details=details)

    def rows(self, *, status: Status) -> list[CheckpointRow]:
        """Every row of the file in ``status`` (what ``retention.repair`` walks)."""
        return self.store.rows(status=status)

RECOVER_PIN = "recover.json"
"""The pin file in a run directory: ``{"step": N, "force": bool}``."""


@dataclass(frozen=True)
class SaveIntent:
    """What a save is for, as every tier's row records it."""

    level: str
    reason: str
    retention_class: str
    score: float | None = None
    metric: tuple[str, float] | None = None


@dataclass(frozen=True)
class Pin:
    """A step pinned by ``ckptpilot recover``; ``force`` loads it whatever its status."""

    step: int
    force: bool


def write_pin(run_dir: Path, step: int, *, force: bool) -> None:
    """Pin ``step`` for the next restore of the run in ``run_dir``."""
    (run_dir / RECOVER_PIN).write_text(json.dumps({"step": step, "force": force}))


class Catalog:
    """The rows of one (run, rank), and the status rules of the save and restore paths."""

    def __init__(self, store: MetadataStore, run_id: str, rank: int, run_dir: Path) -> None:
        self.store = store
        self.moves = Moves(store)
        self.run_id = run_id
        self.rank = rank
        self._run_dir = run_dir
        # The continuation this rank's saves go to ("" before the first restore).
        self.branch = self.lineage().current

    def lineage(self) -> Lineage:
        """This rank's lineage record as the file says now (``ckptpilot recover`` may have
        added to it); raises ``LineageError`` when it is damaged."""
        return read_lineage(lineage_path(self._run_dir, self.rank))

    def key(self, step: int, tier: Tier) -> CheckpointKey:
        return CheckpointKey(self.run_id, step, self.rank, tier)

    def record_pending(self, step: int, tier: Tier, intent: SaveIntent, *, location: str,
                       sha256: str, bytes_raw: int, seconds_snapshot: float, codec: str,
                       bytes_encoded: int | None = None,
                       seconds_write: float | None = None) -> CheckpointKey:
        """A save whose bytes are (being) written to ``tier``, not yet verified."""
        metric_name, metric_value = intent.metric or (None, None)
        self.store.add_pending(
            run_id=self.run_id, step=step, rank=self.rank, level=intent.level, tier=tier,
            location=location, sha256=sha256, retention_class=intent.retention_class,
            score=intent.score, metric_name=metric_name, metric_value=metric_value,
            bytes_raw=bytes_raw, bytes_encoded=bytes_encoded, codec=codec,
            seconds_snapshot=seconds_snapshot, seconds_write=seconds_write,
            reason=intent.reason)
        return self.key(step, tier)

    def retire(self, key: CheckpointKey, set_aside: Callable[[], str | None]) -> None:
        """A run resumed from an earlier step saves a step again: the old copy (from the
        abandoned continuation) is set aside and its row expired, never silently replaced.
        ``set_aside`` moves the old bytes away and returns where they went (None: nothing
        was there to move)."""
        row = self.store.get(key)
        if row is None or row.status not in (Status.PENDING, Status.VALID):
            return
        note = f"superseded by a new save of step {key.step} after resuming from an earlier step"
        self.moves.abandon(key, note, location=set_aside() or row.location)

    def supersede_older(self, tier: Tier, step: int, why: str) -> None:
        """Expire every valid row of ``tier`` below ``step`` (a tier that keeps one state)."""
        for row in self.store.rows(self.run_id, rank=self.rank, tier=tier):
            if row.step < step and row.status is Status.VALID:
                self.moves.supersede(row.key, why)

    def abandon_after(self, step: int, *, fork: bool = True) -> None:
        """Restoring ``step`` abandons the continuation saved after it (in any tier);
        expiring its rows keeps a later restore, after a crash, from going back to it.
        (Re-saving one of those steps would set its files aside anyway.) With ``fork`` (a
        checkpoint was loaded) the new continuation is recorded first, durably, before any
        save can go to it."""
        if fork:
            self.branch = _fork(lineage_path(self._run_dir, self.rank), step,
                                f"pilot restore, rank {self.rank}").current
        for row in self.store.rows(self.run_id, rank=self.rank):
            if row.step > step and row.status in (Status.VALID, Status.PENDING):
                self.moves.abandon(row.key, f"abandoned: the run was restored to step {step}")

    def protect_before(self, suspect: int, window: int) -> None:
        """Class the newest save before ``suspect`` (a rollback point) ``critical``, so that
        no prune ever removes it — as ``important`` it would compete with the next spikes'
        points for ``important_keep`` places — and the other saves within ``window`` steps
        before it ``important`` at least."""
        rows = [row for row in self.store.rows(self.run_id, rank=self.rank,
                                               status=(Status.VALID, Status.PENDING))
                if row.step < suspect]
        if not rows:
            return
        newest = max(row.step for row in rows)
        first = suspect - window
        for row in rows:
            if row.step == newest and row.retention_class is not RetentionClass.CRITICAL:
                promoted = RetentionClass.CRITICAL
            elif row.step >= first and row.retention_class is RetentionClass.ROUTINE:
                promoted = RetentionClass.IMPORTANT
            else:
                continue
            self.moves.reclassify(row.key, promoted,
                                  f"kept: saved before the loss spike of step {suspect + 1}")

    def set_metric(self, step: int, name: str, value: float) -> None:
        """Attach a metric to the rows of ``step`` in every tier."""
        found = [key for key in (self.key(step, Tier.PEER), self.key(step, Tier.REMOTE))
                 if self.store.get(key) is not None]
        if not found:
            raise NoCheckpointError(f"metric {name!r}: step {step} has no checkpoint row")
        for key in found:
            self.store.set_metric(key, name, value)

    def condemn(self, step: int, tier: Tier, error: BaseException) -> None:
        """A copy that failed verification on restore: never tried again, pruned later."""
        row = self.store.get(self.key(step, tier))
        if row is not None and row.status in (Status.VALID, Status.PENDING):
            self.moves.condemn(row.key, f"failed on restore: {error}")

    def rows(self, tier: Tier) -> list[CheckpointRow]:
        return self.store.rows(self.run_id, rank=self.rank, tier=tier)

    def newest_rows_by_step(self, tier: Tier) -> dict[int, CheckpointRow]:
        """The newest row of each step of ``tier``."""
        rows: dict[int, CheckpointRow] = {}
        for row in self.rows(tier):
            rows.setdefault(row.step, row)
        return rows

    def read_pin(self) -> Pin | None:
        path = self._run_dir / RECOVER_PIN
        if not path.exists():
            return None
        pinned = json.loads(path.read_text())
        return Pin(int(pinned["step"]), bool(pinned.get("force", False)))

    def consume_pin(self, step: int, forced: bool) -> None:
        self.store.audit("recover-applied", {"step": step, "rank": self.rank,
                                             "forced": forced})
        # Every rank consumes it; the first one removes it.
        (self._run_dir / RECOVER_PIN).unlink(missing_ok=True)
