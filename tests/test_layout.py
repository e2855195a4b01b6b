"""The package's shape (issues 12 and 25): the pilot is a small facade on top, the save and
restore paths run one way down through the modules, never back up to the pilot; storage sits
below the tiers, the remote tier is one folder, and no module is over 600 lines.

Read from the source with ``ast`` (imports inside functions count too), so a lazy import
cannot hide a climb back up.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ckptpilot"
TOP = {"ckptpilot.pilot", "ckptpilot.assembly", "ckptpilot.steps"}
"""The facade and the modules that build and drive its parts: nothing below may import them."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """The ckptpilot modules ``path`` imports (a ``from x import y`` counts ``x.y`` when
    that is a module, else ``x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("ckptpilot")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("ckptpilot"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in GRAPH.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_pilot_is_a_facade_of_at_most_400_lines() -> None:
    lines = len((PACKAGE / "pilot.py").read_text().splitlines())
    assert lines <= 400, (f"ckptpilot/pilot.py has {lines} lines; move a part out "
                          "(docs/reference/layout.md)")


def test_the_save_and_restore_paths_never_climb_back_to_the_pilot() -> None:
    for start in ("ckptpilot.save.writer", "ckptpilot.restorer", "ckptpilot.save.plan",
                  "ckptpilot.catalog", "ckptpilot.guards.rollback", "ckptpilot.agreement",
                  "ckptpilot.lifecycle"):
        assert start in MODULES, start
        climbs = reachable(start) & TOP
        assert climbs == set(), f"{start} reaches {sorted(climbs)}"


def test_only_the_entry_points_import_the_pilot() -> None:
    importers = {name for name, deps in GRAPH.items() if "ckptpilot.pilot" in deps
                 and not name.startswith("ckptpilot.integrations.")}  # the frameworks' entry
    assert importers <= {"ckptpilot", "ckptpilot.cli", "ckptpilot.demo",
                         "ckptpilot.fit.job"}, importers


def test_the_ground_floor_modules_import_nothing_above_them() -> None:
    assert GRAPH["ckptpilot.vocab"] == set()
    assert GRAPH["ckptpilot.errors"] == set()
    assert GRAPH["ckptpilot.background"] == set()  # thread priority, used by format.digest
    assert GRAPH["ckptpilot.capture.devicecopy"] == set()  # under state.py: copies and their order
    for name, deps in GRAPH.items():
        if name.startswith(("ckptpilot.format", "ckptpilot.codecs")):
            above = {d for d in deps if not d.startswith(
                ("ckptpilot.format", "ckptpilot.codecs", "ckptpilot.vocab", "ckptpilot.errors",
                 "ckptpilot.background"))}
            assert above == set(), f"{name} imports {sorted(above)}"


def test_the_import_graph_has_no_cycle() -> None:
    for name in GRAPH:
        assert name not in reachable(name) or name == "ckptpilot", f"{name} is in a cycle"


def test_no_module_is_over_600_lines() -> None:
    over = {name: lines for name, path in MODULES.items()
            if (lines := len(path.read_text().splitlines())) > 600}
    assert over == {}, f"split these modules (600 lines at most): {over}"


def test_no_module_explains_its_length_instead_of_being_split() -> None:
    for name, path in MODULES.items():
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert "Long because" not in docstring, f"{name}: split it instead"


def test_storage_is_below_the_tiers() -> None:
    """``storage/`` holds the run's own records (metadata, heartbeat, ledger, lineage); the
    tiers and their formats sit above it, so nothing in it reaches up into ``tiers/``."""
    for name, deps in GRAPH.items():
        if name.startswith("ckptpilot.storage"):
            above = sorted(d for d in deps if d.startswith("ckptpilot.tiers"))
            assert above == [], f"{name} imports {above}"


def test_the_remote_tier_lives_in_one_folder() -> None:
    """Every module of the remote tier is under ``tiers/remote/``; nothing else in ``tiers/``
    but the protocol, the memory tier and the peer tier."""
    assert {"ckptpilot.tiers.remote.store", "ckptpilot.tiers.remote.archive",
            "ckptpilot.tiers.remote.tier", "ckptpilot.tiers.remote.entries"} <= set(MODULES)
    flat = {name for name in MODULES if name.count(".") == 2 and name.startswith(
        "ckptpilot.tiers.")}
    assert flat == {"ckptpilot.tiers.base", "ckptpilot.tiers.memory", "ckptpilot.tiers.peer",
                    "ckptpilot.tiers.remote"}, flat
