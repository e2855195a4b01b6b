"""The package's shape (issues 12 and 25): the pilot is a small facade on top, the save and
restore paths run one way down through the modules, never back up to the pilot; storage sits
below the tiers, the remote tier is one folder, the command (``cli/``) sits above everything,
and no module is over 600 lines.

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
    assert importers <= {"ckptpilot", "ckptpilot.cli.demo", "ckptpilot.fit.job"}, importers


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


def _is_cli(name: str) -> bool:
    return name == "ckptpilot.cli" or name.startswith("ckptpilot.cli.")




def test_nothing_below_the_command_imports_it() -> None:
    """``cli/`` is the top: the command imports the library, never the other way round, so a
    job, an integration or a daemon never loads the command's parser or operations. Only
    ``python -m ckptpilot`` (``__main__``) enters it from outside."""
    for name, deps in GRAPH.items():
        if _is_cli(name) or name == "ckptpilot.__main__":
            continue
        climbs = sorted(d for d in deps if _is_cli(d))
        assert climbs == [], f"{name} imports {climbs}: nothing outside ckptpilot/cli/ may"
    assert {"ckptpilot.cli.command", "ckptpilot.cli.ops", "ckptpilot.cli.report",
            "ckptpilot.cli.demo"} <= set(MODULES)
    assert not {"ckptpilot.runops", "ckptpilot.report", "ckptpilot.demo"} & set(MODULES)


def test_storage_is_below_the_tiers() -> None:
    """``storage/`` holds the run's own records (metadata, heartbeat, ledger, lineage); the
    tiers and their formats sit above it, so nothing in it reaches up into ``tiers/``."""
    for name, deps in GRAPH.items():
        if name.startswith("ckptpilot.storage"):
            above = sorted(d for d in deps if d.startswith("ckptpilot.tiers"))
            assert above == [], f"{name} imports {above}"


def test_the_remote_tier_lives_in_one_folder() -> None:
    """Every module of the remote tier is under ``tiers/remote/``; nothing else in ``tiers/``
    but the protocol, the memory tier, the peer tier and the sharded (DCP) tier."""
    assert {"ckptpilot.tiers.remote.store", "ckptpilot.tiers.remote.archive",
            "ckptpilot.tiers.remote.tier", "ckptpilot.tiers.remote.entries"} <= set(MODULES)
    flat = {name for name in MODULES if name.count(".") == 2 and name.startswith(
        "ckptpilot.tiers.")}
    assert flat == {"ckptpilot.tiers.base", "ckptpilot.tiers.memory", "ckptpilot.tiers.peer",
                    "ckptpilot.tiers.remote", "ckptpilot.tiers.sharded"}, flat


CONCRETE_TIERS = ("ckptpilot.tiers.memory", "ckptpilot.tiers.peer", "ckptpilot.tiers.remote",
                  "ckptpilot.tiers.sharded")
"""The concrete tiers: everything in ``tiers/`` but the protocol (``tiers.base``)."""

OPENS_A_CONCRETE_TIER = {
    "ckptpilot.assembly": "builds the tier objects the writer and the restorer are given",
    "ckptpilot.cli.command": "`ckptpilot peer serve` runs the peer daemon (tiers.peer.command)",
    "ckptpilot.cli.ops": "`ls` / `validate` / `prune` / `recover` work on the remote archives",
    "ckptpilot.retention.auto": "prunes and budgets the remote store's entries",
    "ckptpilot.validation.postwrite": "the remote tier's validator: checks a staged archive",
    "ckptpilot.validation.loadcheck": "the load test reads a staged archive's files",
    "ckptpilot.dcp": "DCP's storage reader/writer over the remote store (not tier images)",
    "ckptpilot.fit": "the fault-injection campaign damages and forges the tiers directly",
}
"""The modules above ``tiers/`` that may import a concrete tier, and why: each one operates
on one tier's own storage, outside the save and restore paths."""


def test_no_module_above_the_tiers_imports_a_concrete_tier_but_the_listed_ones() -> None:
    """The save and restore paths go through ``tiers.base.CheckpointTier`` only: the writer
    loops over the tiers its plan names, the restorer over its sources; which object is which
    tier is the assembly's business (issue 25)."""
    allowed = tuple(OPENS_A_CONCRETE_TIER)
    for name, deps in GRAPH.items():
        if name.startswith("ckptpilot.tiers") or name.startswith(allowed):
            continue
        concrete = sorted(d for d in deps if d.startswith(CONCRETE_TIERS))
        assert concrete == [], (f"{name} imports {concrete}: use ckptpilot.tiers.base and "
                                "let ckptpilot.assembly build the tier")
    for start in ("ckptpilot.save.writer", "ckptpilot.restorer", "ckptpilot.save.plan",
                  "ckptpilot.pilot"):
        concrete = sorted(d for d in GRAPH[start] if d.startswith(CONCRETE_TIERS))
        assert concrete == [], f"{start} imports {concrete}"
    for listed in OPENS_A_CONCRETE_TIER:  # the list names modules that exist and need it
        names = [n for n in GRAPH if n == listed or n.startswith(f"{listed}.")]
        assert any(d.startswith(CONCRETE_TIERS) for n in names for d in GRAPH[n]), listed


def test_the_conformance_suite_builds_its_tiers_as_the_assembly_does() -> None:
    """The suite certifies the objects training uses: it builds every concrete tier through
    ``ckptpilot.assembly``'s factories, never with a tier class's own constructor."""
    classes = {"MemoryTier", "PeerCheckpointTier", "RemoteCheckpointTier", "ShardedTier"}
    factories = {"memory_tier", "peer_tier", "remote_tier", "sharded_tier"}
    used: set[str] = set()
    for path in (PACKAGE.parent / "tests" / "tiers").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                callee = node.func.id if isinstance(node.func, ast.Name) else (
                    node.func.attr if isinstance(node.func, ast.Attribute) else "")
                assert callee not in classes, (
                    f"{path.name}:{node.lineno} builds {callee} itself; use "
                    "ckptpilot.assembly's factory, as the pilot does")
                used.add(callee)
            if isinstance(node, ast.ImportFrom) and node.module == "ckptpilot.assembly":
                used |= {a.name for a in node.names}
    assert factories <= used, f"the suite does not build {sorted(factories - used)}"
    assembly = ast.parse((PACKAGE / "assembly.py").read_text())
    for function in (n for n in assembly.body if isinstance(n, ast.FunctionDef)):
        calls = {n.func.id for n in ast.walk(function)
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        if function.name in factories:
            assert len(calls & classes) == 1, function.name
        else:  # the pilot's parts come from the same factories as the suite's tiers
            assert not calls & classes, f"assembly.{function.name} builds {calls & classes}"


def test_the_pilot_has_no_sharded_branch() -> None:
    """Replicated or sharded is chosen once, in the assembly (``StateHandling``, the tier
    list, the restorer): the pilot's save and restore are one path for both (issue 25)."""
    source = (PACKAGE / "pilot.py").read_text()
    assert "sharded" not in source.lower(), "ckptpilot/pilot.py mentions sharded state"
    assert not any(d.startswith(("ckptpilot.capture.sharded", "ckptpilot.tiers.sharded",
                                 "ckptpilot.sharded")) for d in GRAPH["ckptpilot.pilot"])


def test_the_sharded_save_is_a_tier_behind_the_writers_loop() -> None:
    """No second writer: the sharded state's parts are a capture (``capture/sharded.py``)
    and a DCP-backed tier (``tiers/sharded/``); nothing but the writer calls its internals."""
    assert "ckptpilot.sharded" not in MODULES and not (PACKAGE / "sharded").exists()
    assert {"ckptpilot.capture.sharded", "ckptpilot.tiers.sharded.tier"} <= set(MODULES)
    internals = ("acquire_slot", "release_slot", "run_after", "make_room", "refuse",
                 "retain", "saves.append")
    for name, path in MODULES.items():
        if name.startswith(("ckptpilot.save.", "ckptpilot.guards.")) or name in TOP:
            continue
        text = path.read_text()
        used = [f for f in internals if f"writer.{f}(" in text or f"_writer.{f}" in text]
        assert used == [], f"{name} drives the writer's internals: {used}"
