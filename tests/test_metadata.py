"""The metadata store: WAL and pragmas, every field, the status life cycle, the hash chain,
schema versions and migrations, and real multi-process write concurrency (SPEC §7)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import re
import sqlite3
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from ckptpilot.catalog import Moves
from ckptpilot.errors import NoCheckpointError
from ckptpilot.policy import RetentionPolicy
from ckptpilot.retention.plan import execute_plan, plan_retention
from ckptpilot.storage import metadata, schema
from ckptpilot.storage.metadata import (
    SCHEMA_VERSION,
    DuplicateCheckpointError,
    MetadataBusyError,
    MetadataSchemaError,
    MetadataStore,
    Status,
    StatusTransitionError,
    Tier,
)
from ckptpilot.tiers.remote.archive import checkpoint_name
from ckptpilot.vocab import CheckpointKey, Level, RetentionClass


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture
def store(tmp_path: Path) -> MetadataStore:
    with MetadataStore(tmp_path / "metadata.db") as opened:
        yield opened


def add(store: MetadataStore, step: int, *, run_id: str = "run", rank: int = 0,
        tier: Tier | str = Tier.REMOTE, level: Level | str = Level.PULSE,
        retention_class: RetentionClass | str = RetentionClass.ROUTINE,
        **fields: Any) -> metadata.CheckpointRow:
    tier_text = tier.value if isinstance(tier, Tier) else tier
    return store.add_pending(
        run_id=run_id, step=step, rank=rank, level=level, tier=tier,
        location=f"{tier_text}/{checkpoint_name(step, rank)}",
        sha256=sha(f"{run_id}/{step}/{rank}/{tier_text}"), retention_class=retention_class,
        **fields)


# --- pragmas, WAL ------------------------------------------------------------------------------


def test_wal_mode_is_on_in_the_file_and_pragmas_on_every_connection(tmp_path: Path) -> None:
    path = tmp_path / "metadata.db"
    MetadataStore(path).close()
    raw = sqlite3.connect(path)
    try:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        raw.close()
    with MetadataStore(path) as store, store._db.read() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30_000


def test_writers_queue_on_the_busy_timeout_then_fail_with_a_clear_error(
        tmp_path: Path) -> None:
    path = tmp_path / "metadata.db"
    with MetadataStore(path, busy_timeout_seconds=5) as patient, \
            MetadataStore(path, busy_timeout_seconds=0.3) as impatient:
        holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(MetadataBusyError, match=r"no write lock after 0\.3 s"):
            add(impatient, 1)
        release = threading.Timer(0.5, holder.execute, args=("COMMIT",))
        release.start()
        started = time.monotonic()
        row = add(patient, 1)  # waits for the holder instead of failing
        waited = time.monotonic() - started
        release.join()
        holder.close()
        assert row.status is Status.PENDING
        assert 0.3 < waited < 5


# --- fields and life cycle ---------------------------------------------------------------------


def test_every_field_round_trips(store: MetadataStore) -> None:
    first = add(store, 100, tier=Tier.PEER, level=Level.ORGAN)
    row = store.add_pending(
        run_id="run", step=110, rank=0, level="pulse", tier="peer", location="peer/ckpt-110",
        sha256=sha("110"), retention_class="important", score=0.61, base_step=100,
        metric_name="val_loss", metric_value=2.5, bytes_raw=4096, bytes_encoded=1024,
        codec="xor_delta", seconds_snapshot=0.01, seconds_write=0.2, reason="interval",
        note="first pulse")
    assert row.level is Level.PULSE and row.tier is Tier.PEER
    assert row.status is Status.PENDING and row.retention_class is RetentionClass.IMPORTANT
    assert (row.run_id, row.step, row.rank, row.location) == ("run", 110, 0, "peer/ckpt-110")
    assert (row.score, row.base_step, row.metric_name, row.metric_value) == (
        0.61, 100, "val_loss", 2.5)
    assert (row.sha256, row.prev_sha256) == (sha("110"), first.sha256)
    assert (row.bytes_raw, row.bytes_encoded, row.codec) == (4096, 1024, "xor_delta")
    assert (row.seconds_snapshot, row.seconds_write, row.seconds_validate) == (0.01, 0.2, None)
    assert (row.reason, row.note, row.removed_at) == ("interval", "first pulse", None)
    assert row.created_at == row.updated_at and abs(row.created_at - time.time()) < 60

    marked = Moves(store).publish(row.key, seconds_validate=0.3, bytes_encoded=1000,
                                  codec="byteplane", location="peer/moved", score=0.7,
                                  retention_class="critical", reason="trigger", note="checked")
    assert marked.status is Status.VALID and marked.seconds_validate == 0.3
    assert (marked.bytes_encoded, marked.codec, marked.location) == (1000, "byteplane",
                                                                      "peer/moved")
    assert marked.retention_class is RetentionClass.CRITICAL
    assert (marked.score, marked.reason, marked.note) == (0.7, "trigger", "checked")
    assert marked.updated_at >= marked.created_at == row.created_at
    assert store.get(row.id) == marked == store.get(("run", 110, 0, "peer"))
    assert store.get(12345) is None and store.get(("run", 110, 0, Tier.MEMORY)) is None
    assert row.key == CheckpointKey("run", 110, 0, Tier.PEER) and row.key.tier is Tier.PEER
    assert store.get(CheckpointKey("run", 110, 0, Tier.PEER)) == marked

    metric = store.set_metric(row.id, "accuracy", 0.93)
    assert (metric.metric_name, metric.metric_value) == ("accuracy", 0.93)
    with pytest.raises(ValueError, match="not finite"):
        store.set_metric(row.id, "accuracy", float("nan"))


def test_add_pending_validates_its_input(store: MetadataStore) -> None:
    with pytest.raises(ValueError, match="level: 'big' is not one of heartbeat, pulse, organ"):
        add(store, 1, level="big")
    with pytest.raises(ValueError, match="tier: 'disk'"):
        add(store, 1, tier="disk")
    with pytest.raises(ValueError, match="sha256: expected 64 lowercase hex"):
        store.add_pending(run_id="r", step=1, rank=0, level="pulse", tier="memory",
                          location="x", sha256="abc", retention_class="routine")
    with pytest.raises(ValueError, match="step: expected a non-negative int"):
        add(store, -1)
    with pytest.raises(ValueError, match="base_step: 5 must be an earlier step"):
        add(store, 5, base_step=5)
    assert store.rows() == []


PUBLISH = {Status.PENDING: Status.VALID}
EXPIRE = {Status.VALID: Status.EXPIRED, Status.CORRUPTED: Status.EXPIRED}


def test_mark_makes_only_the_moves_it_is_given_in_one_step(store: MetadataStore) -> None:
    """The store applies the catalogue's moves; it holds no rule of its own (the operations
    and their rules: tests/test_catalog.py)."""
    row = add(store, 1)
    published = store.mark(row.id, PUBLISH, operation="publish", note="checked")
    assert (published.status, published.note) == (Status.VALID, "checked")
    with pytest.raises(StatusTransitionError,
                       match=r"cannot apply 'publish' to row \d+ \(step 1, rank 0, remote\): it "
                             r"is valid, and 'publish' takes only pending → valid$"):
        store.mark(row.id, PUBLISH, operation="publish", note="again")
    assert store.get(row.id) == published
    same = store.mark(row.id, {Status.VALID: Status.VALID}, operation="reclassify",
                      retention_class="critical")
    assert (same.status, same.retention_class) == (Status.VALID, RetentionClass.CRITICAL)


def test_mark_rejects_unknown_rows_and_fields(store: MetadataStore) -> None:
    row = add(store, 1)
    moves = Moves(store)
    with pytest.raises(NoCheckpointError, match="no checkpoint row 99"):
        moves.publish(99)
    with pytest.raises(TypeError, match="cannot set step;"):
        moves.publish(row.id, sha256=sha("x"), step=3)
    with pytest.raises(TypeError, match="cannot set sha256;"):  # only publishing sets it
        moves.condemn(row.id, "bad", sha256=sha("x"))
    with pytest.raises(TypeError, match="expected a row id or"):
        moves.publish(("run", 1))  # type: ignore[arg-type]
    assert store.get(row.id) == row


def test_compare_and_mark_only_changes_rows_that_still_match(store: MetadataStore) -> None:
    row = Moves(store).publish(add(store, 1).id)
    assert store.compare_and_mark(row.id, EXPIRE, operation="prune",
                                  expect={"status": "corrupted"}) is None
    assert store.get(row.id) == row
    assert store.compare_and_mark(99, EXPIRE, operation="prune",
                                  expect={"status": "valid"}) is None
    done = store.compare_and_mark(row.id, EXPIRE, operation="prune",
                                  expect={"status": Status.VALID, "retention_class": "routine"})
    assert done is not None and done.status is Status.EXPIRED


def test_finish_removal_records_once_and_only_for_expired_rows(store: MetadataStore) -> None:
    moves = Moves(store)
    row = moves.publish(add(store, 1).id)
    with pytest.raises(StatusTransitionError,
                       match=r"cannot apply 'record-removal' to row \d+ \(step 1, rank 0, "
                             r"remote\): it is valid, and 'record-removal' takes only expired "
                             r"\(status unchanged\)"):
        moves.record_removal(row.id, action="prune", details={})
    moves.supersede(row.id, "newer copy")
    finished = moves.record_removal(row.id, action="prune", details={"reason": "routine"})
    assert finished.removed_at is not None and finished.status is Status.EXPIRED
    assert moves.record_removal(row.id, action="repair", details={}) == finished
    [entry] = store.audit_log()
    assert (entry.action, entry.details) == ("prune", {"row_id": row.id, "reason": "routine"})


def test_duplicate_live_keys_are_refused_and_dead_keys_reused(store: MetadataStore) -> None:
    pending = add(store, 5)
    with pytest.raises(DuplicateCheckpointError,
                       match="step 5 rank 0 tier remote already has a pending row"):
        add(store, 5)
    Moves(store).publish(pending.id)
    with pytest.raises(DuplicateCheckpointError, match="already has a valid row"):
        add(store, 5)
    Moves(store).condemn(pending.id, "rotten")
    again = add(store, 5, note="saved again after resuming")
    assert again.id != pending.id and store.get(pending.id) is None
    assert [r.id for r in store.rows()] == [again.id]
    [entry] = store.audit_log("replace")
    assert entry.details["replaced_id"] == pending.id
    assert entry.details["status"] == "corrupted"


def test_rows_filters_and_orders_newest_first(store: MetadataStore) -> None:
    made = [
        add(store, 10, rank=0, tier="memory"), add(store, 30, rank=0, tier="memory"),
        add(store, 20, rank=0, tier="memory"), add(store, 20, rank=1, tier="memory"),
        add(store, 20, rank=0, tier="remote"), add(store, 40, run_id="other", tier="memory"),
    ]
    Moves(store).publish(made[1].id)
    Moves(store).condemn(made[4].id, "rotten")
    steps = [(r.step, r.id) for r in store.rows()]
    assert steps == sorted(steps, reverse=True) and len(steps) == 6
    assert [r.step for r in store.rows(run_id="run", rank=0, tier="memory")] == [30, 20, 10]
    assert [r.id for r in store.rows(status=Status.VALID)] == [made[1].id]
    assert {r.id for r in store.rows(status=("valid", Status.CORRUPTED))} == {
        made[1].id, made[4].id}
    assert [r.id for r in store.rows(tier=[Tier.REMOTE])] == [made[4].id]
    assert [r.id for r in store.rows(rank=1)] == [made[3].id]
    assert [r.id for r in store.rows(run_id="other")] == [made[5].id]
    assert store.rows(run_id="run", status="expired") == []
    assert len(store.rows(level=Level.PULSE)) == 6 and store.rows(level="organ") == []


def test_newest_valid_prefers_the_newest_step_then_the_faster_tier(
        store: MetadataStore) -> None:
    assert store.newest_valid("run", 0) is None
    for step, tier, level in [(100, "remote", "organ"), (150, "remote", "pulse"),
                              (150, "memory", "pulse"), (150, "peer", "pulse"),
                              (160, "memory", "heartbeat"), (170, "memory", "pulse")]:
        row = add(store, step, tier=tier, level=level)
        if step != 170:
            Moves(store).publish(row.id)
        else:
            Moves(store).condemn(row.id, "rotten")
    add(store, 180, tier="memory")  # pending
    best = store.newest_valid("run", 0)
    assert best is not None and (best.step, best.tier) == (150, Tier.MEMORY)
    best = store.newest_valid("run", 0, tiers=("remote", "peer"))
    assert best is not None and (best.step, best.tier) == (150, Tier.REMOTE)
    best = store.newest_valid("run", 0, tiers=[Tier.PEER, Tier.REMOTE])
    assert best is not None and best.tier is Tier.PEER
    assert store.newest_valid("run", 1) is None


def test_pin_milestone_pins_every_live_row_of_the_step(store: MetadataStore) -> None:
    rows = [add(store, 200, rank=rank, tier=tier, retention_class="important")
            for rank in (0, 1) for tier in ("memory", "remote")]
    gone = add(store, 200, rank=2)
    Moves(store).abandon(Moves(store).publish(gone.id).id, "abandoned")
    other_run = add(store, 200, run_id="other")
    pinned = store.pin_milestone(200, "best eval so far", run_id="run")
    assert sorted(r.id for r in pinned) == sorted(r.id for r in rows)
    assert all(r.retention_class is RetentionClass.MILESTONE and r.note == "best eval so far"
               for r in pinned)
    assert store.get(gone.id).retention_class is RetentionClass.ROUTINE  # type: ignore[union-attr]
    assert store.get(other_run.id).retention_class is RetentionClass.ROUTINE  # type: ignore[union-attr]
    [entry] = store.audit_log("pin")
    assert entry.details["rows"] == {str(r.id): "important" for r in rows}
    assert len(store.pin_milestone(200, "all runs")) == len(rows) + 1
    with pytest.raises(NoCheckpointError, match="no live checkpoint at step 7 of run 'run'"):
        store.pin_milestone(7, "nothing there", run_id="run")


# --- hash chain --------------------------------------------------------------------------------


def test_hash_chain_links_rows_per_run_rank_and_tier(store: MetadataStore) -> None:
    chain = [add(store, step, tier="remote") for step in (10, 20, 30, 40)]
    memory = [add(store, step, tier="memory") for step in (10, 20)]
    other_rank = add(store, 20, rank=1, tier="remote")
    assert chain[0].prev_sha256 is None
    assert [r.prev_sha256 for r in chain[1:]] == [r.sha256 for r in chain[:-1]]
    assert memory[1].prev_sha256 == memory[0].sha256 and other_rank.prev_sha256 is None
    assert store.verify_chain("run", 0, "remote") == []
    assert store.verify_chain("run", 0, Tier.MEMORY) == []


def test_verify_chain_detects_a_tampered_or_deleted_row(store: MetadataStore,
                                                        tmp_path: Path) -> None:
    chain = [add(store, step) for step in (10, 20, 30, 40, 50)]
    raw = sqlite3.connect(tmp_path / "metadata.db")
    try:
        with raw:
            raw.execute("UPDATE checkpoints SET sha256 = ? WHERE id = ?",
                        (sha("forged"), chain[1].id))
        assert [r.id for r in store.verify_chain("run", 0, "remote")] == [chain[2].id]
        with raw:
            raw.execute("DELETE FROM checkpoints WHERE id = ?", (chain[3].id,))
        assert [r.id for r in store.verify_chain("run", 0, "remote")] == [
            chain[2].id, chain[4].id]
    finally:
        raw.close()


# --- schema versions ---------------------------------------------------------------------------


def _versions(path: Path) -> list[int]:
    raw = sqlite3.connect(path)
    try:
        return [v for (v,) in raw.execute("SELECT version FROM schema_version ORDER BY version")]
    finally:
        raw.close()


def test_schema_version_is_recorded_and_reopening_is_idempotent(tmp_path: Path) -> None:
    path = tmp_path / "metadata.db"
    with MetadataStore(path) as store:
        assert store.schema_version == SCHEMA_VERSION == 1
        row = add(store, 1)
    for _ in range(3):
        with MetadataStore(path) as store:
            assert store.get(row.id) == row
    assert _versions(path) == [1]


def test_an_empty_file_is_version_0_and_gets_migrated(tmp_path: Path) -> None:
    path = tmp_path / "metadata.db"
    path.touch()
    with MetadataStore(path) as store:
        assert store.schema_version == 1 and store.rows() == []


def test_a_newer_schema_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    path = tmp_path / "metadata.db"
    with MetadataStore(path) as store:
        add(store, 1)
    raw = sqlite3.connect(path)
    with raw:
        raw.execute("INSERT INTO schema_version VALUES (7, 0, 'from the future')")
    raw.close()
    with pytest.raises(MetadataSchemaError,
                       match=r"schema version 7 is newer than this ckptpilot understands \(1\); "
                             "upgrade ckptpilot"):
        MetadataStore(path)


def test_a_foreign_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    raw = sqlite3.connect(path)
    with raw:
        raw.execute("CREATE TABLE users (name TEXT)")
    raw.close()
    with pytest.raises(MetadataSchemaError, match="not a ckptpilot metadata database"):
        MetadataStore(path)


def test_migrations_apply_in_order_in_one_transaction(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "metadata.db"
    with MetadataStore(path) as store:
        row = add(store, 1)

    def add_column(conn: sa.Connection) -> None:
        """Version 2: a column for the test."""
        conn.exec_driver_sql("ALTER TABLE checkpoints ADD COLUMN extra TEXT")

    def broken(conn: sa.Connection) -> None:
        conn.exec_driver_sql("ALTER TABLE checkpoints ADD COLUMN doomed TEXT")
        conn.exec_driver_sql("SELECT * FROM no_such_table")

    monkeypatch.setattr(schema, "SCHEMA_VERSION", 3)
    monkeypatch.setattr(schema, "MIGRATIONS", (*schema.MIGRATIONS, add_column, broken))
    with pytest.raises(sa.exc.OperationalError, match="no_such_table"):
        MetadataStore(path)
    raw = sqlite3.connect(path)
    columns = {name for (_, name, *_) in raw.execute("PRAGMA table_info(checkpoints)")}
    raw.close()
    assert "extra" not in columns and "doomed" not in columns  # all rolled back
    assert _versions(path) == [1]

    monkeypatch.setattr(schema, "SCHEMA_VERSION", 2)
    with MetadataStore(path) as store:
        assert store.schema_version == 2
        assert store.get(row.id) == row
    raw = sqlite3.connect(path)
    description = raw.execute("SELECT description FROM schema_version WHERE version = 2")
    assert description.fetchone()[0] == "Version 2: a column for the test."
    raw.close()


def test_the_core_tables_match_the_migrated_schema(tmp_path: Path) -> None:
    path = tmp_path / "metadata.db"
    MetadataStore(path).close()
    raw = sqlite3.connect(path)
    try:
        for table in (schema.checkpoints, schema.audit, schema.schema_version):
            info = raw.execute(f"PRAGMA table_info({table.name})").fetchall()
            assert [row[1] for row in info] == [c.name for c in table.columns]
            assert {row[1] for row in info if row[3]} == {
                c.name for c in table.columns if not c.nullable and not c.primary_key}
    finally:
        raw.close()


# --- audit, life cycle -------------------------------------------------------------------------


def test_audit_log_keeps_order_details_and_actor(store: MetadataStore) -> None:
    first = store.audit("recover", {"step": 100, "forced": True, "tiers": ["remote"]})
    store.audit("prune", {"removed": 3}, actor="cron")
    store.audit("rebuild", {})
    log = store.audit_log()
    assert [e.action for e in log] == ["recover", "prune", "rebuild"]
    assert log[0] == first and first.details == {"step": 100, "forced": True,
                                                 "tiers": ["remote"]}
    assert first.actor.startswith("pid ") and log[1].actor == "cron"
    assert log[0].at <= log[1].at <= log[2].at
    assert [e.action for e in store.audit_log("prune")] == ["prune"]
    with pytest.raises(ValueError, match="action: must not be empty"):
        store.audit("", {})


def test_a_closed_store_refuses_calls(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "metadata.db")
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match="is closed"):
        store.rows()


def _forked_child(store: MetadataStore) -> None:
    add(store, 2)


def test_a_store_carried_across_fork_opens_its_own_connections(tmp_path: Path) -> None:
    with MetadataStore(tmp_path / "metadata.db") as store:
        add(store, 1)
        child = mp.get_context("fork").Process(target=_forked_child, args=(store,))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        assert [r.step for r in store.rows()] == [2, 1]
        assert store.verify_chain("run", 0, "remote") == []


# --- damaged files, unusable file systems, read-only stores -------------------------------------


def _filled(path: Path, rows: int = 60) -> None:
    with MetadataStore(path) as store:
        for step in range(1, rows + 1):
            add(store, step, note="x" * 500)


def _garbage(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 40)


def _truncated(path: Path) -> None:
    _filled(path)
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 3])


def _header_zeroed(path: Path) -> None:
    _filled(path)
    data = bytearray(path.read_bytes())
    data[:100] = bytes(100)
    path.write_bytes(bytes(data))


def _directory(path: Path) -> None:
    path.mkdir()
    (path / "stray").write_text("not a database")


DAMAGE = {"garbage": _garbage, "truncated": _truncated, "header zeroed": _header_zeroed,
          "a directory": _directory}


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("read_only", [False, True], ids=["writable", "read-only"])
def test_a_damaged_file_is_refused_naming_it_and_the_rebuild(
        tmp_path: Path, damage: str, read_only: bool) -> None:
    path = tmp_path / "metadata.sqlite"
    DAMAGE[damage](path)
    before = path.read_bytes() if path.is_file() else None
    with pytest.raises(metadata.MetadataCorruptError,
                       match=rf"^{re.escape(str(path))}.*(damaged|is a directory).*"
                             r"`ckptpilot validate --rebuild` moves it aside \(kept, not "
                             r"deleted\)"):
        MetadataStore(path, read_only=read_only)
    if before is not None:
        assert path.read_bytes() == before


def test_damage_beyond_the_pages_read_at_open_is_reported_by_the_query_that_meets_it(
        tmp_path: Path) -> None:
    path = tmp_path / "metadata.sqlite"
    _filled(path)
    data = bytearray(path.read_bytes())
    data[-4096:] = b"\xff" * 4096  # the last page: rows, not the schema
    path.write_bytes(bytes(data))
    with MetadataStore(path) as store, pytest.raises(
            metadata.MetadataCorruptError,
            match=r"database disk image is malformed.*validate --rebuild"):
        store.rows()


def test_a_full_disk_is_a_clear_error_and_the_file_stays_usable(tmp_path: Path) -> None:
    path = tmp_path / "metadata.sqlite"
    with MetadataStore(path) as store:
        first = add(store, 1)
        with store._db.read() as conn:  # the pooled connection every later call reuses
            pages = conn.exec_driver_sql("PRAGMA page_count").scalar()
            conn.exec_driver_sql(f"PRAGMA max_page_count={pages}")
        with pytest.raises(metadata.MetadataAccessError,
                           match=rf"^{re.escape(str(path))}: the disk is full \(database or "
                                 r"disk is full\); free space"):
            for step in range(2, 200):
                add(store, step, note="x" * 3000)
    with MetadataStore(path) as store:
        assert store.rows()[-1] == first
        assert store.verify_chain("run", 0, "remote") == []


def test_a_write_the_file_system_refuses_is_a_clear_error(tmp_path: Path) -> None:
    """A WAL writer needs the ``-shm`` file; a directory in its place stands in for a
    directory this user cannot write (root ignores permissions, so chmod cannot)."""
    path = tmp_path / "metadata.sqlite"
    MetadataStore(path).close()
    (tmp_path / "metadata.sqlite-shm").mkdir()
    with MetadataStore(path) as store, pytest.raises(
            metadata.MetadataAccessError,
            match=rf"^{re.escape(str(path))}: cannot write the metadata database \(attempt to "
                  r"write a readonly database\); make .* writable; `ckptpilot ls`"):
        add(store, 1)


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def test_a_read_only_store_reads_creates_nothing_and_refuses_every_write(
        tmp_path: Path) -> None:
    path = tmp_path / "metadata.sqlite"
    with MetadataStore(path) as store:
        row = add(store, 1)
        store.audit("recover", {"step": 1})
    before = _snapshot(tmp_path)
    assert sorted(before) == ["metadata.sqlite"]
    with MetadataStore(path, read_only=True) as store:
        assert store.read_only
        assert store.rows() == [row] and store.get(row.key) == row
        assert store.schema_version == SCHEMA_VERSION
        assert [e.action for e in store.audit_log()] == ["recover"]
        assert store.run_ids() == {"run": 1}
        writes = {
            "add_pending": lambda: add(store, 2),
            "mark": lambda: Moves(store).publish(row.id),
            "set_metric": lambda: store.set_metric(row.id, "loss", 1.0),
            "pin_milestone": lambda: store.pin_milestone(1, "keep"),
            "audit": lambda: store.audit("prune", {}),
            "adopt_run_id": lambda: store.adopt_run_id("run", "other"),
        }
        for name, write in writes.items():
            with pytest.raises(metadata.MetadataAccessError,
                               match=rf"^{re.escape(str(path))}: this store was opened "
                                     "read-only and cannot be changed"):
                write()
            assert _snapshot(tmp_path) == before, name
    assert _snapshot(tmp_path) == before


def test_a_read_only_store_never_touches_the_shm_file_of_a_closed_database(
        tmp_path: Path) -> None:
    """``mode=ro`` alone would create ``-wal`` and ``-shm``; with a directory squatting on the
    ``-shm`` name the read-only store still reads, and the names stay as they were."""
    path = tmp_path / "metadata.sqlite"
    with MetadataStore(path) as store:
        row = add(store, 1)
    (tmp_path / "metadata.sqlite-shm").mkdir()
    with MetadataStore(path, read_only=True) as store:
        assert store.rows() == [row]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metadata.sqlite",
                                                          "metadata.sqlite-shm"]


def test_a_read_only_store_sees_every_commit_of_a_live_writer(tmp_path: Path) -> None:
    path = tmp_path / "metadata.sqlite"
    with MetadataStore(path) as writer:
        first = add(writer, 1)
        assert (tmp_path / "metadata.sqlite-wal").exists()  # the commit is in the log only
        with MetadataStore(path, read_only=True) as reader:
            assert reader.rows() == [first]
            second = add(writer, 2)
            assert reader.rows() == [second, first]


def test_a_read_only_store_refuses_a_missing_or_old_file_and_creates_nothing(
        tmp_path: Path) -> None:
    missing = tmp_path / "missing.sqlite"
    with pytest.raises(metadata.MetadataAccessError,
                       match=rf"^{re.escape(str(missing))}: no such file; a read-only store"):
        MetadataStore(missing, read_only=True)
    empty = tmp_path / "empty.sqlite"
    empty.touch()
    with pytest.raises(MetadataSchemaError,
                       match=r"schema version 0 is older than this ckptpilot's \(1\) and a "
                             "read-only store cannot upgrade it"):
        MetadataStore(empty, read_only=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.sqlite"]
    assert empty.read_bytes() == b""


# --- run ids -----------------------------------------------------------------------------------


def test_adopt_run_id_rekeys_rows_and_audit_in_one_audited_step(store: MetadataStore) -> None:
    for step in (1, 2, 3):
        add(store, step, run_id="legacy-folder")
    add(store, 1, run_id="legacy-folder", rank=1)
    Moves(store).condemn(("legacy-folder", 3, 0, "remote"), "rotten")
    add(store, 3, run_id="legacy-folder")  # replaces the corrupted row: a "replace" audit
    store.pin_milestone(2, "keep", run_id="legacy-folder")
    add(store, 1, run_id="someone-else")
    before = {(r.step, r.rank): r for r in store.rows("legacy-folder")}

    assert store.adopt_run_id("legacy-folder", "a1b2c3") == 4
    assert store.run_ids() == {"a1b2c3": 4, "someone-else": 1}
    after = {(r.step, r.rank): r for r in store.rows("a1b2c3")}
    assert after.keys() == before.keys()
    for key, row in after.items():
        old = before[key]
        assert (row.id, row.sha256, row.prev_sha256, row.status, row.retention_class) == (
            old.id, old.sha256, old.prev_sha256, old.status, old.retention_class)
    assert store.verify_chain("a1b2c3", 0, "remote") == []
    audit = store.audit_log()
    assert [e.details["run_id"] for e in audit if e.action in ("replace", "pin")] == [
        "a1b2c3", "a1b2c3"]
    assert audit[-1].action == "adopt-run-id"
    assert audit[-1].details == {"old": "legacy-folder", "new": "a1b2c3", "rows": 4}

    assert store.adopt_run_id("legacy-folder", "a1b2c3") == 0  # nothing left to adopt
    assert len(store.audit_log()) == len(audit)


def test_adopt_run_id_never_merges_two_runs(store: MetadataStore) -> None:
    add(store, 1, run_id="old")
    add(store, 5, run_id="new")
    assert store.adopt_run_id("old", "new") == 0
    assert store.run_ids() == {"new": 1, "old": 1}
    assert store.adopt_run_id("same", "same") == 0
    with pytest.raises(ValueError, match="run ids must not be empty"):
        store.adopt_run_id("", "new")


# --- concurrency: real processes, real contention ---------------------------------------------

def test_opening_a_fresh_file_waits_for_another_process_switching_it_to_wal(
    tmp_path: Path,
) -> None:
    """Ranks opening a fresh file at once each switch it to WAL: one holds the write lock
    while the others, already reading, want it too. SQLite answers those "database is locked"
    at once, without its busy handler (CI hit this in the writers test below); the store must
    wait instead. Here another connection holds that write lock for 0.5 s."""
    path = tmp_path / "metadata.db"
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    release = threading.Timer(0.5, lambda: other.execute("COMMIT"))
    release.start()
    start = time.monotonic()
    try:
        with MetadataStore(path) as store:
            add(store, 1)
            assert [r.step for r in store.rows()] == [1]
    finally:
        release.join()
        other.close()
    assert time.monotonic() - start >= 0.4
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"

# How long the processes contend: 6 s in the default run, 60 s in the soak (opt-in: `pytest -m
# soak`; .ci/run runs it when its time budget allows).
DURATIONS_SECONDS = [6.0, pytest.param(60.0, marks=pytest.mark.soak, id="soak")]
WRITERS = 4
RUN = "concurrency"


def _count_error(errors: Counter[str], samples: list[str], error: Exception) -> None:
    locked = "database is locked" in str(error)
    errors["database is locked" if locked else type(error).__name__] += 1
    if len(samples) < 5:
        samples.append(repr(error))


def _writer(path: str, files: str, rank: int, seconds: float, start: Any,
            results: Any) -> None:
    """Save loop of one rank: file, pending row, valid, metric; as fast as it can."""
    start.wait(120)
    store = MetadataStore(path)  # every process opens the fresh file at once
    inserted: list[int] = []
    updates = 0
    errors: Counter[str] = Counter()
    samples: list[str] = []
    organ_step = 0
    step = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        step += 1
        is_organ = step % 5 == 1
        payload = f"{rank}/{step}".encode()
        location = Path(files, checkpoint_name(step, rank))
        try:
            location.write_bytes(payload)
            row = store.add_pending(
                run_id=RUN, step=step, rank=rank, level="organ" if is_organ else "pulse",
                tier="memory", location=str(location),
                sha256=hashlib.sha256(payload).hexdigest(), retention_class="routine",
                base_step=None if is_organ else organ_step)
            inserted.append(row.id)
            Moves(store).publish(row.id, bytes_raw=len(payload), seconds_write=0.001)
            store.set_metric(row.id, "val_loss", 1.0 / step)
            updates += 2
            organ_step = step if is_organ else organ_step
        except Exception as error:  # every failure is counted and reported, none expected
            _count_error(errors, samples, error)
    store.close()
    results.put({"role": "writer", "rank": rank, "inserted": inserted, "updates": updates,
                 "errors": dict(errors), "samples": samples})


def _pruner(path: str, seconds: float, start: Any, results: Any) -> None:
    """Prune loop: the library's retention path, plus a compaction that deletes tombstones."""
    start.wait(120)
    store = MetadataStore(path)
    policy = RetentionPolicy(routine_keep=2, keep_last=1)
    expired: list[int] = []
    deleted: list[int] = []
    skipped = 0
    transactions = 0
    errors: Counter[str] = Counter()
    samples: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            live = store.rows(run_id=RUN, status=("pending", "valid", "corrupted"))
            plan = plan_retention(live, policy, now=time.time())
            report = execute_plan(plan, Moves(store), lambda row: Path(row.location).unlink())
            expired.extend(report.removed)
            skipped += len(report.skipped)
            transactions += 2 * len(report.removed) + len(report.skipped)
            with store._db.write() as conn:  # heavier than anything the library issues
                table = schema.checkpoints
                doomed = list(conn.execute(sa.select(table.c.id).where(
                    table.c.status == "expired", table.c.removed_at.is_not(None))).scalars())
                conn.execute(sa.delete(table).where(table.c.id.in_(doomed)))
            deleted.extend(doomed)
            transactions += 1
        except Exception as error:  # every failure is counted and reported, none expected
            _count_error(errors, samples, error)
    store.close()
    results.put({"role": "pruner", "expired": expired, "deleted": deleted,
                 "skipped": skipped, "transactions": transactions, "errors": dict(errors),
                 "samples": samples})


@pytest.mark.slow
@pytest.mark.parametrize("seconds", DURATIONS_SECONDS)
def test_concurrent_writers_and_pruner_never_hit_database_is_locked(tmp_path: Path,
                                                                   seconds: float) -> None:
    path = str(tmp_path / "metadata.db")
    files = tmp_path / "files"
    files.mkdir()
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(WRITERS + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=_writer,
                         args=(path, str(files), rank, seconds, start, results))
             for rank in range(WRITERS)]
    procs.append(ctx.Process(target=_pruner, args=(path, seconds, start, results)))
    for proc in procs:
        proc.start()
    try:
        reports = [results.get(timeout=seconds + 180) for _ in procs]
    finally:
        for proc in procs:
            proc.join(30)
    assert [proc.exitcode for proc in procs] == [0] * len(procs)

    writers = sorted((r for r in reports if r["role"] == "writer"), key=lambda r: r["rank"])
    [pruner] = [r for r in reports if r["role"] == "pruner"]
    errors = Counter[str]()
    for report in reports:
        errors.update(report["errors"])
    inserts = sum(len(w["inserted"]) for w in writers)
    updates = sum(w["updates"] for w in writers)
    print(f"\n{WRITERS} writers + 1 pruner, {seconds:g} s: "
          f"{inserts / seconds:.0f} inserts/s, {updates / seconds:.0f} "
          f"updates/s, per writer {[len(w['inserted']) for w in writers]} inserts; pruner: "
          f"{pruner['transactions']} transactions, {len(pruner['expired'])} rows expired, "
          f"{len(pruner['deleted'])} deleted, {pruner['skipped']} skipped; "
          f"errors: {dict(errors) or 0}")
    assert not errors, [s for r in reports for s in r["samples"]]
    mean = inserts / WRITERS
    assert all(len(w["inserted"]) > mean / 10 for w in writers), "a writer was starved"
    assert pruner["expired"] and pruner["deleted"]

    expired, deleted = set(pruner["expired"]), set(pruner["deleted"])
    with MetadataStore(path) as store:
        rows = {row.id: row for row in store.rows()}
        assert deleted <= expired
        for writer in writers:
            lost = set(writer["inserted"]) - rows.keys() - deleted
            assert not lost, f"rank {writer['rank']}: committed rows lost: {sorted(lost)[:10]}"
        for row in rows.values():
            if row.status is Status.EXPIRED:
                assert row.id in expired and row.removed_at is not None
                assert not Path(row.location).exists()
            else:
                assert row.status is Status.VALID and Path(row.location).exists()
        for rank in range(WRITERS):
            newest = store.newest_valid(RUN, rank)
            assert newest is not None
            assert newest.id == writers[rank]["inserted"][-1]
        assert len(store.audit_log("prune")) == len(expired)
