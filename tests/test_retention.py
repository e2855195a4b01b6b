"""Retention: the pure planner rule by rule, then execution and repair against a real metadata
store and real files, including a SIGKILL in the middle of a prune (SPEC §8)."""

from __future__ import annotations

import ast
import hashlib
import multiprocessing as mp
import os
import random
import signal
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from ckptpilot.catalog import Moves
from ckptpilot.policy import RetentionPolicy
from ckptpilot.retention import plan as planner
from ckptpilot.retention.plan import BestPolicy, RetentionPlan, execute_plan, plan_retention, repair
from ckptpilot.storage.metadata import CheckpointRow, MetadataStore, Status
from ckptpilot.tiers.remote.archive import checkpoint_name

POLICY = RetentionPolicy(keep_last=1)  # important 3, routine 1: the class rules alone


@dataclass(frozen=True)
class Row:
    """A hand-made row with the fields the planner reads."""

    id: int
    step: int
    run_id: str = "run"
    rank: int = 0
    level: str = "pulse"
    tier: str = "remote"
    status: str = "valid"
    retention_class: str = "routine"
    metric_name: str | None = None
    metric_value: float | None = None
    base_step: int | None = None
    location: str = ""


def rows_of(*specs: dict[str, object]) -> list[Row]:
    return [Row(id=i + 1, **spec) for i, spec in enumerate(specs)]  # type: ignore[arg-type]


def kept(plan: RetentionPlan[Row]) -> dict[int, str]:
    return {row.step: why for row, why in plan.keep}


def removed(plan: RetentionPlan[Row]) -> dict[int, str]:
    return {row.step: why for row, why in plan.remove}


# --- the pure planner ----------------------------------------------------------------------------


def test_routine_keeps_the_newest_k_of_its_group() -> None:
    plan = plan_retention(rows_of(*({"step": s} for s in (10, 20, 30, 40))), POLICY)
    assert kept(plan) == {40: "newest valid in remote; routine: within newest 1"}
    assert removed(plan) == {s: "routine: beyond newest 1" for s in (10, 20, 30)}
    plan = plan_retention(rows_of(*({"step": s} for s in (10, 20, 30, 40))),
                          RetentionPolicy(routine_keep=3, keep_last=1))
    assert set(kept(plan)) == {20, 30, 40} and set(removed(plan)) == {10}


def test_the_newest_step_every_rank_holds_is_kept_on_every_rank() -> None:
    """Rank 1 never finished step 57: 37 is what a distributed restore falls back to, so
    rank 0 keeps 37 although its routine quota keeps only 57."""
    specs = [{"step": s, "rank": 0} for s in (20, 37, 57)]
    specs += [{"step": s, "rank": 1} for s in (20, 37)]
    plan = plan_retention(rows_of(*specs), POLICY)
    on = {(row.rank, row.step): why for row, why in plan.keep}
    assert on == {
        (0, 57): "newest valid in remote; routine: within newest 1",
        (0, 37): "newest step valid on every rank in remote",
        (1, 37): "newest valid in remote; newest step valid on every rank in remote; "
                 "routine: within newest 1"}
    assert {(row.rank, row.step) for row, _ in plan.remove} == {(0, 20), (1, 20)}


def test_important_keeps_the_newest_k_and_critical_is_kept_forever() -> None:
    specs = [{"step": s, "retention_class": "important"} for s in range(10, 70, 10)]
    specs += [{"step": s, "retention_class": "critical"} for s in (1, 2, 3)]
    plan = plan_retention(rows_of(*specs), POLICY)
    assert removed(plan) == {s: "important: beyond newest 3" for s in (10, 20, 30)}
    assert kept(plan)[40] == "important: within newest 3"
    assert all(kept(plan)[s] == "critical: kept forever" for s in (1, 2, 3))


def test_quotas_count_per_run_rank_level_and_tier() -> None:
    base = {"retention_class": "routine"}
    specs = [{**base, "step": s, **extra} for s in (10, 20)
             for extra in ({}, {"run_id": "b"}, {"rank": 1}, {"level": "organ"},
                           {"tier": "memory"})]
    plan = plan_retention(rows_of(*specs), POLICY)
    assert sorted(row.step for row, _ in plan.keep) == [20] * 5
    assert sorted(row.step for row, _ in plan.remove) == [10] * 5


def test_the_newest_valid_of_every_tier_is_kept() -> None:
    specs = [{"step": 10, "tier": "remote", "retention_class": "important"},
             {"step": 20, "tier": "remote", "level": "organ"},
             {"step": 30, "tier": "memory"}]
    plan = plan_retention(rows_of(*specs), POLICY)
    assert kept(plan)[20].startswith("newest valid in remote")
    assert kept(plan)[30].startswith("newest valid in memory")
    assert "newest valid" not in kept(plan)[10]


def test_pending_rows_are_kept_and_do_not_count_toward_quotas() -> None:
    specs = [{"step": 10}, {"step": 20}, {"step": 30, "status": "pending"},
             {"step": 5, "status": "pending", "retention_class": "important"}]
    plan = plan_retention(rows_of(*specs), POLICY)
    assert kept(plan) == {30: "pending (save in flight)", 5: "pending (save in flight)",
                          20: "newest valid in remote; routine: within newest 1"}
    assert removed(plan) == {10: "routine: beyond newest 1"}


def test_milestones_are_kept_even_when_corrupted() -> None:
    specs = [{"step": 10, "retention_class": "milestone"},
             {"step": 20, "retention_class": "milestone", "status": "corrupted"},
             {"step": 30}, {"step": 40}]
    plan = plan_retention(rows_of(*specs), POLICY)
    assert kept(plan)[10] == kept(plan)[20] == "milestone (pinned)"
    assert removed(plan) == {30: "routine: beyond newest 1"}


def test_corrupted_and_expired_rows_do_not_count_and_corrupted_ones_go() -> None:
    specs = [{"step": 10}, {"step": 20}, {"step": 30, "status": "corrupted"},
             {"step": 40, "status": "expired"},
             {"step": 50, "status": "corrupted", "retention_class": "critical"}]
    plan = plan_retention(rows_of(*specs), POLICY)
    assert kept(plan) == {20: "newest valid in remote; routine: within newest 1"}
    assert removed(plan) == {10: "routine: beyond newest 1",
                             30: "corrupted: never a recovery point",
                             50: "corrupted: never a recovery point"}


def test_bases_of_kept_deltas_are_kept_transitively_and_across_tiers() -> None:
    specs = [{"step": 100, "level": "organ"},
             {"step": 110, "base_step": 100}, {"step": 120, "base_step": 110},
             {"step": 130, "base_step": 120},
             {"step": 200, "level": "organ"},
             {"step": 210, "tier": "memory", "base_step": 200},
             {"step": 200, "level": "organ", "tier": "memory", "status": "corrupted"},
             {"step": 90, "level": "organ"}]
    plan = plan_retention(rows_of(*specs), POLICY)
    remote = {row.step: why for row, why in plan.keep if row.tier == "remote"}
    assert remote[130] == "routine: within newest 1"
    assert remote[120] == "base of kept delta at step 130"
    assert remote[110] == "base of kept delta at step 120"
    assert remote[100] == "base of kept delta at step 110"
    assert remote[200] == ("newest valid in remote; routine: within newest 1; "
                           "base of kept delta at step 210")
    memory = {row.step: why for row, why in plan.keep if row.tier == "memory"}
    assert memory[210] == "newest valid in memory; routine: within newest 1"
    assert memory[200] == "base of kept delta at step 210"  # corrupted, still a base
    assert removed(plan) == {90: "routine: beyond newest 1"}


def test_a_removed_delta_does_not_protect_its_base() -> None:
    specs = [{"step": 100, "level": "organ"}, {"step": 200, "level": "organ"},
             {"step": 150, "base_step": 100}, {"step": 250, "base_step": 200},
             {"step": 300, "base_step": 200, "status": "pending"}]
    plan = plan_retention(rows_of(*specs), POLICY)
    assert set(removed(plan)) == {100, 150}
    assert kept(plan)[200].endswith("base of kept deltas at steps 250, 300")


@pytest.mark.parametrize(("mode", "best_steps"), [("min", {30, 50}), ("max", {20, 60})])
def test_best_n_by_a_user_metric_is_never_removed(mode: str, best_steps: set[int]) -> None:
    values = {10: 3.0, 20: 9.0, 30: 1.0, 40: 4.0, 50: 1.0, 60: 9.0, 70: 5.0}
    specs = [{"step": s, "metric_name": "val_loss", "metric_value": v}
             for s, v in values.items()]
    specs += [{"step": 15, "metric_name": "accuracy", "metric_value": -100.0},
              {"step": 25, "metric_name": "val_loss", "metric_value": float("nan")},
              {"step": 35, "metric_name": "val_loss", "metric_value": 0.5,
               "status": "corrupted"},
              {"step": 80, "level": "organ"}]
    best = BestPolicy(metric="val_loss", mode=mode, keep=2)  # type: ignore[arg-type]
    plan = plan_retention(rows_of(*specs), POLICY, best=best)
    label = f"best 2 by val_loss ({mode})"
    assert {s for s, why in kept(plan).items() if label in why} == best_steps
    assert set(kept(plan)) == best_steps | {70, 80}
    assert 15 in removed(plan) and 25 in removed(plan) and 35 in removed(plan)
    one = plan_retention(rows_of(*specs), POLICY, best=replace(best, keep=1))
    assert {s for s, why in kept(one).items() if "best 1" in why} == {max(best_steps)}


def test_best_policy_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match=r"best\.metric"):
        BestPolicy(metric="")
    with pytest.raises(ValueError, match=r"best\.mode: expected 'min' or 'max', got 'low'"):
        BestPolicy(metric="loss", mode="low")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"best\.keep: expected an int >= 1, got 0"):
        BestPolicy(metric="loss", keep=0)


def test_the_plan_is_deterministic_and_covers_every_live_row_once() -> None:
    rng = random.Random(7)
    rows: list[Row] = []
    for i in range(300):
        rows.append(Row(
            id=i + 1, step=rng.randrange(0, 2000), run_id=rng.choice("ab"),
            rank=rng.randrange(3), level=rng.choice(["pulse", "organ", "heartbeat"]),
            tier=rng.choice(["memory", "peer", "remote"]),
            status=rng.choice(["valid"] * 6 + ["pending", "corrupted", "expired"]),
            retention_class=rng.choice(["routine"] * 4 + ["important", "critical",
                                                          "milestone"]),
            metric_name=rng.choice([None, "val_loss"]), metric_value=rng.random(),
            base_step=rng.choice([None, rng.randrange(0, 2000)])))
    best = BestPolicy(metric="val_loss", keep=2)
    plan = plan_retention(rows, POLICY, best=best, now=1234.5)
    for _ in range(5):
        rng.shuffle(rows)
        assert plan_retention(rows, POLICY, best=best, now=1234.5) == plan
    assert plan.now == 1234.5
    ids = [row.id for row, _ in plan.keep] + [row.id for row, _ in plan.remove]
    assert sorted(ids) == sorted(r.id for r in rows if r.status != "expired")
    assert all(why for _, why in (*plan.keep, *plan.remove))
    assert all(row.status in ("valid", "corrupted") for row, _ in plan.remove)
    assert all(row.retention_class not in ("milestone", "critical") or row.status == "corrupted"
               for row, _ in plan.remove)
    assert plan.reason(plan.remove[0][0].id) == plan.remove[0][1]
    assert plan.reason(10_000) is None


def test_the_planner_module_imports_no_io_module() -> None:
    tree = ast.parse(Path(planner.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)}
    forbidden = ("os", "io", "pathlib", "shutil", "sqlite3", "sqlalchemy", "fsspec", "time",
                 "ckptpilot.storage", "ckptpilot.tiers", "ckptpilot.validation",
                 "ckptpilot.pilot")
    assert not {m for m in imported if m.split(".")[0] in forbidden or m.startswith(forbidden)}


# --- execution against a real store and real files ---------------------------------------------


def populate(store: MetadataStore, root: Path, steps: list[int]) -> list[CheckpointRow]:
    """Valid routine checkpoints of one rank in the remote tier, one real file each."""
    made = []
    for step in steps:
        path = root / checkpoint_name(step, 0)
        path.write_bytes(f"state of step {step}".encode())
        row = store.add_pending(
            run_id="run", step=step, rank=0, level="pulse", tier="remote",
            location=str(path), sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
            retention_class="routine")
        made.append(Moves(store).publish(row.id))
    return made


def unlink(row: planner.RetentionRow) -> None:
    Path(row.location).unlink()


def exists(row: planner.RetentionRow) -> bool:
    return Path(row.location).exists()


def assert_consistent(store: MetadataStore, root: Path) -> None:
    """No valid row without its file, no file without a live row, no expired row's file."""
    rows = store.rows()
    live = {Path(r.location) for r in rows if r.status is not Status.EXPIRED}
    for row in rows:
        if row.status is Status.VALID:
            assert Path(row.location).exists(), f"valid row {row.step} lost its file"
    assert set(root.iterdir()) <= live


@pytest.fixture
def files(tmp_path: Path) -> Path:
    root = tmp_path / "checkpoints"
    root.mkdir()
    return root


def test_execute_plan_expires_rows_removes_files_and_audits(tmp_path: Path,
                                                            files: Path) -> None:
    with MetadataStore(tmp_path / "metadata.db") as store:
        made = populate(store, files, [10, 20, 30, 40])
        plan = plan_retention(store.rows(), POLICY)
        report = execute_plan(plan, Moves(store), unlink)
        assert sorted(report.removed) == [r.id for r in made[:3]]
        assert report.skipped == report.failed == ()
        assert [p.name for p in files.iterdir()] == [checkpoint_name(40, 0)]
        for row in made[:3]:
            now = store.get(row.id)
            assert now is not None and now.status is Status.EXPIRED and now.removed_at
        prunes = store.audit_log("prune")
        assert sorted(e.details["step"] for e in prunes) == [10, 20, 30]
        assert all(e.details["reason"] == "routine: beyond newest 1" for e in prunes)
        assert_consistent(store, files)
        assert plan_retention(store.rows(), POLICY).remove == ()  # nothing left to do


def test_rows_changed_after_planning_are_skipped(tmp_path: Path, files: Path) -> None:
    with MetadataStore(tmp_path / "metadata.db") as store:
        made = populate(store, files, [10, 20, 30])
        plan = plan_retention(store.rows(), POLICY)
        store.pin_milestone(10, "the user pinned it meanwhile")
        report = execute_plan(plan, Moves(store), unlink)
        assert report.skipped == ((made[0].id, "changed or gone since the plan was made"),)
        assert report.removed == (made[1].id,)
        assert store.get(made[0].id).status is Status.VALID  # type: ignore[union-attr]
        assert_consistent(store, files)


def test_failed_removals_are_left_for_repair_and_missing_files_count_as_removed(
        tmp_path: Path, files: Path) -> None:
    with MetadataStore(tmp_path / "metadata.db") as store:
        made = populate(store, files, [10, 20, 30, 40])
        Path(made[0].location).unlink()  # someone removed it by hand

        def flaky(row: CheckpointRow) -> None:
            if row.step == 20:
                raise PermissionError(13, "Permission denied", row.location)
            unlink(row)

        report = execute_plan(plan_retention(store.rows(), POLICY), Moves(store), flaky)
        assert sorted(report.removed) == [made[0].id, made[2].id]
        assert report.failed == ((made[1].id, f"PermissionError: [Errno 13] Permission "
                                               f"denied: '{made[1].location}'"),)
        stuck = store.get(made[1].id)
        assert stuck is not None and stuck.status is Status.EXPIRED and stuck.removed_at is None
        assert Path(stuck.location).exists()

        fixed = repair(Moves(store), exists, unlink)
        assert fixed.removed == (made[1].id,) and fixed.failed == ()
        [entry] = store.audit_log("repair")
        assert entry.details["file_was_present"] is True and entry.details["step"] == 20
        assert repair(Moves(store), exists, unlink) == planner.PruneReport()  # idempotent
        assert_consistent(store, files)


def _prune_and_die(db: str, kill_before_remove: bool) -> None:
    """Child: prune, and SIGKILL itself around the second file removal."""
    store = MetadataStore(db)
    calls = 0

    def remove_then_die(row: CheckpointRow) -> None:
        nonlocal calls
        calls += 1
        if calls == 2 and kill_before_remove:
            os.kill(os.getpid(), signal.SIGKILL)
        Path(row.location).unlink()
        if calls == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    execute_plan(plan_retention(store.rows(), POLICY), Moves(store), remove_then_die)


@pytest.mark.crash
@pytest.mark.parametrize("kill_before_remove", [True, False],
                         ids=["killed-before-removing", "killed-after-removing"])
def test_sigkill_during_a_prune_is_repaired_on_the_next_run(
        tmp_path: Path, files: Path, kill_before_remove: bool) -> None:
    db = tmp_path / "metadata.db"
    with MetadataStore(db) as store:
        populate(store, files, [10, 20, 30, 40, 50])
        order = [row.id for row, _ in plan_retention(store.rows(), POLICY).remove]
    assert len(order) == 4
    child = mp.get_context("spawn").Process(target=_prune_and_die,
                                            args=(str(db), kill_before_remove))
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL

    with MetadataStore(db) as store:
        first, second, *rest = (store.get(row_id) for row_id in order)
        assert first is not None and second is not None
        # the first removal is complete; the second row was marked expired before the kill
        assert first.status is Status.EXPIRED and first.removed_at is not None
        assert second.status is Status.EXPIRED and second.removed_at is None
        assert Path(second.location).exists() is kill_before_remove
        assert all(row is not None and row.status is Status.VALID for row in rest)
        assert len(store.audit_log("prune")) == 1
        for row in store.rows(status=Status.VALID):  # never a valid row without its file
            assert Path(row.location).exists()

        fixed = repair(Moves(store), exists, unlink)
        assert fixed.removed == (second.id,)
        [entry] = store.audit_log("repair")
        assert entry.details["file_was_present"] is kill_before_remove
        assert_consistent(store, files)

        report = execute_plan(plan_retention(store.rows(), POLICY), Moves(store), unlink)
        assert sorted(report.removed) == sorted(order[2:])
        assert {r.id for r in store.rows(status=Status.EXPIRED)} == set(order)
        assert all(r.removed_at is not None for r in store.rows(status=Status.EXPIRED))
        assert [p.name for p in files.iterdir()] == [checkpoint_name(50, 0)]
        assert_consistent(store, files)


def test_plans_accept_real_rows_and_keep_them_typed(tmp_path: Path, files: Path) -> None:
    with MetadataStore(tmp_path / "metadata.db") as store:
        made = populate(store, files, [10, 20])
        store.set_metric(made[0].id, "val_loss", 0.1)
        plan = plan_retention(store.rows(), POLICY, best=BestPolicy("val_loss", "min", 1))
        assert all(isinstance(row, CheckpointRow) for row, _ in plan.keep)
        assert {row.step: why for row, why in plan.keep} == {
            20: "newest valid in remote; routine: within newest 1",
            10: "best 1 by val_loss (min)"}
        stale = replace(made[0], status=Status.EXPIRED)
        assert plan_retention([stale], POLICY) == RetentionPlan(keep=(), remove=())
