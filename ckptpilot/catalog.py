"""The catalog of one rank's checkpoints: its rows in the metadata store, and the recover pin.

This module owns :class:`Catalog`, every change the save and restore paths make to the rows of
one (run, rank): a save recorded ``pending``, then published ``valid`` or refused
``corrupted``; an old copy superseded when a step is saved again or the peers drop it; the
continuation after a restored step abandoned; the saves before a loss spike protected from
pruning; a metric attached; a copy that failed on restore condemned. The rules for *which*
status a row moves to live here, in one place, instead of beside each tier's write. It also
owns the recover pin (``ckptpilot recover --step N`` writes it, the next ``restore`` consumes
it), shared with :mod:`ckptpilot.runops`, and the rank's current continuation: abandoning
the saves after a restored step first records a fork in the rank's lineage file
(``storage.lineage``), so that the files, not only these rows, say what was abandoned.

It must not touch checkpoint bytes or decide what to save or restore: tiers hold bytes, the
writer and the restorer decide. Threading: the writer thread and (during a restore) the
training thread use it, never at once (a restore flushes the writer first); the store itself
is safe across threads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ckptpilot.errors import NoCheckpointError
from ckptpilot.rundir import lineage_path
from ckptpilot.storage.lineage import Lineage, read_lineage
from ckptpilot.storage.lineage import fork as _fork
from ckptpilot.storage.metadata import CheckpointRow, MetadataStore
from ckptpilot.vocab import CheckpointKey, RetentionClass, Status, Tier

__all__ = ["RECOVER_PIN", "Catalog", "Pin", "SaveIntent", "write_pin"]

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
        location = set_aside() or row.location
        status = Status.CORRUPTED if row.status is Status.PENDING else Status.EXPIRED
        self.store.mark(key, status, location=location, note=note)

    def supersede_older(self, tier: Tier, step: int, why: str) -> None:
        """Expire every valid row of ``tier`` below ``step`` (a tier that keeps one state)."""
        for row in self.store.rows(self.run_id, rank=self.rank, tier=tier):
            if row.step < step and row.status is Status.VALID:
                self.store.mark(row.key, Status.EXPIRED, note=why)

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
                target = Status.CORRUPTED if row.status is Status.PENDING else Status.EXPIRED
                self.store.mark(row.key, target,
                                note=f"abandoned: the run was restored to step {step}")

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
            self.store.mark(row.key, row.status, retention_class=promoted.value,
                            note=f"kept: saved before the loss spike of step {suspect + 1}")

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
            self.store.mark(row.key, Status.CORRUPTED, note=f"failed on restore: {error}"[:2000])

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
