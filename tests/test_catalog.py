"""The catalogue owns every change of a row's status (issue 25, item 3): named operations with
their allowed moves, applied atomically by the store, and no other module calling the
store's status-changing methods (read from the source with ``ast``, as tests/test_layout.py
reads the imports)."""

from __future__ import annotations

import ast
import hashlib
import re
from pathlib import Path

import pytest

from ckptpilot.catalog import OPERATIONS, Moves, Operation
from ckptpilot.errors import NoCheckpointError
from ckptpilot.storage.metadata import MetadataStore, StatusTransitionError
from ckptpilot.vocab import RetentionClass, Status

PACKAGE = Path(__file__).resolve().parent.parent / "ckptpilot"
STATUS_CHANGERS = {"mark", "compare_and_mark", "finish_removal"}
"""The store's methods that change a row's status or record its removal."""
DOORS = {"ckptpilot/catalog.py", "ckptpilot/storage/metadata.py"}
"""The catalogue, which calls them, and the store, which defines them."""
RAW_SQL = {"ckptpilot/fit/attacks.py": "`ckptpilot fit` tampers with a scratch run's database "
                                        "on purpose, as an attacker would",
           "ckptpilot/fit/incidents.py": "the torchrun campaign forges a row's digest in a "
                                         "scratch run's database on purpose"}
"""Modules that change rows with SQL of their own, each with why."""


@pytest.fixture
def store(tmp_path: Path) -> MetadataStore:
    with MetadataStore(tmp_path / "metadata.sqlite") as opened:
        yield opened  # type: ignore[misc]


def row_in(store: MetadataStore, status: Status, step: int = 7) -> int:
    """A remote row of rank 0 brought to ``status`` the way the package does it."""
    row = store.add_pending(run_id="run", step=step, rank=0, level="pulse", tier="remote",
                            location=f"remote/ckpt-{step}", retention_class="routine",
                            sha256=hashlib.sha256(str(step).encode()).hexdigest())
    moves = Moves(store)
    if status is Status.VALID:
        moves.publish(row.id)
    elif status is Status.CORRUPTED:
        moves.condemn(row.id, "rotten")
    elif status is Status.EXPIRED:
        moves.supersede(moves.publish(row.id).id, "newer copy")
    return row.id


def apply(moves: Moves, operation: Operation, row_id: int) -> Status:
    """``operation`` on the row through its ``Moves`` method; the row's status after it."""
    done = {
        "publish": lambda: moves.publish(row_id, location="remote/published"),
        "record-check": lambda: moves.record_check(row_id, seconds_validate=0.5),
        "condemn": lambda: moves.condemn(row_id, "failed on restore: bad digest"),
        "abandon": lambda: moves.abandon(row_id, "abandoned: restored to step 3",
                                         location="remote/aside"),
        "supersede": lambda: moves.supersede(row_id, "superseded on the peers"),
        "reclassify": lambda: moves.reclassify(row_id, RetentionClass.CRITICAL, "kept"),
        "expire-rebuilt": lambda: moves.expire_rebuilt(row_id, "abandoned: lineage says so"),
        "prune": lambda: moves.prune(row_id, expect={}),
        "record-removal": lambda: moves.record_removal(row_id, action="prune", details={}),
    }[operation.name]()
    assert done is not None
    return done.status


def test_every_operation_has_a_method_and_every_method_is_listed() -> None:
    named = {op.name for op in OPERATIONS}
    assert len(named) == len(OPERATIONS)
    methods = {name.replace("_", "-") for name in vars(Moves)
               if not name.startswith("_") and name != "rows"}
    assert methods == named


@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: op.name)
@pytest.mark.parametrize("source", list(Status), ids=lambda s: s.value)
def test_each_operation_makes_its_moves_and_refuses_the_rest_naming_the_row(
        store: MetadataStore, operation: Operation, source: Status) -> None:
    row_id = row_in(store, source)
    before = store.get(row_id)
    assert before is not None and before.status is source
    moves = Moves(store)
    if source in operation.moves:
        assert apply(moves, operation, row_id) is operation.moves[source]
        return
    with pytest.raises(StatusTransitionError) as refused:
        apply(moves, operation, row_id)
    message = str(refused.value)
    assert re.search(rf"cannot apply '{operation.name}' to row {row_id} \(step 7, rank 0, "
                     rf"remote\): it is {source.value}, and '{operation.name}' takes only ",
                     message), message
    for allowed, target in operation.moves.items():  # and where each allowed status goes
        assert allowed.value in message and target.value in message
    assert store.get(row_id) == before


def test_the_operations_keep_the_life_cycle() -> None:
    """A corrupted row never becomes valid (its bytes may be intermittently bad), nothing
    moves an expired row (its file may be gone), nothing goes back to pending."""
    for op in OPERATIONS:
        assert op.moves.get(Status.CORRUPTED) is not Status.VALID, op.name
        assert op.moves.get(Status.EXPIRED, Status.EXPIRED) is Status.EXPIRED, op.name
        assert all(target is not Status.PENDING or source is Status.PENDING
                   for source, target in op.moves.items()), op.name


def test_moves_set_their_fields_and_cut_long_notes(store: MetadataStore) -> None:
    moves = Moves(store)
    row = moves.condemn(row_in(store, Status.PENDING), "x" * 5000, seconds_validate=0.25)
    assert (row.status, len(row.note), row.seconds_validate) == (Status.CORRUPTED, 2000, 0.25)
    aside = moves.abandon(row.id, "abandoned by `ckptpilot recover --step 3`",
                          location="remote/ckpt-7.abandoned")
    assert (aside.status, aside.location) == (Status.EXPIRED, "remote/ckpt-7.abandoned")
    kept = moves.reclassify(row_in(store, Status.VALID, step=8), RetentionClass.IMPORTANT,
                            "kept: saved before the loss spike of step 9")
    assert (kept.status, kept.retention_class) == (Status.VALID, RetentionClass.IMPORTANT)
    with pytest.raises(NoCheckpointError, match="no checkpoint row 99"):
        moves.condemn(99, "gone")


def test_prune_changes_nothing_when_the_row_changed_since_the_plan(
        store: MetadataStore) -> None:
    moves = Moves(store)
    row_id = row_in(store, Status.VALID)
    assert moves.prune(row_id, expect={"retention_class": "milestone"}) is None
    assert moves.prune(404, expect={}) is None
    row = store.get(row_id)
    assert row is not None and row.status is Status.VALID
    pruned = moves.prune(row_id, expect={"status": "valid", "location": row.location})
    assert pruned is not None and pruned.status is Status.EXPIRED


def _calls_to_status_changers(tree: ast.AST) -> list[int]:
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in STATUS_CHANGERS]


def _sql_changing_rows(tree: ast.AST) -> list[int]:
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and re.search(r"\bUPDATE\s+checkpoints\b", node.value, re.IGNORECASE)]


def test_no_status_changes_outside_the_catalogue() -> None:
    """Every change of a row's status in the package goes through ``catalog.Moves``: no
    other module calls the store's ``mark``, ``compare_and_mark`` or ``finish_removal``, nor
    updates the checkpoints table with SQL of its own."""
    calls: dict[str, list[int]] = {}
    sql: dict[str, list[int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE.parent))
        tree = ast.parse(path.read_text())
        if name not in DOORS and _calls_to_status_changers(tree):
            calls[name] = _calls_to_status_changers(tree)
        if name not in RAW_SQL and _sql_changing_rows(tree):
            sql[name] = _sql_changing_rows(tree)
    assert calls == {}, f"status changes outside ckptpilot/catalog.py: {calls}"
    assert sql == {}, f"rows updated with raw SQL: {sql}"
    # The scans see what they look for at all.
    assert _calls_to_status_changers(ast.parse((PACKAGE / "catalog.py").read_text()))
    for name in RAW_SQL:
        assert _sql_changing_rows(ast.parse((PACKAGE.parent / name).read_text())), name
