"""The scheduler package stays pure: decisions from data, no file, clock or thread (STYLE #1).

Probes, the heartbeat ring and the failure ledger do I/O and live elsewhere (``probes/``,
``storage/``); these checks keep them from drifting back in, directly or through an import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ckptpilot.scheduler

PACKAGE = Path(ckptpilot.scheduler.__file__).parent
MODULES = sorted(PACKAGE.glob("*.py"))

IO_MODULES = frozenset(
    {"fcntl", "io", "mmap", "os", "pathlib", "shutil", "socket", "sqlite3", "subprocess",
     "tempfile", "threading", "time"}
)
"""Standard modules that touch files, processes, sockets, threads or the clock."""

ALLOWED_CKPTPILOT = ("ckptpilot.errors", "ckptpilot.policy", "ckptpilot.scheduler",
                     "ckptpilot.vocab")
"""What the scheduler may build on: its inputs' types and the errors it raises."""


def imported_names(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.append(node.module)
    return names


def test_the_package_has_its_modules() -> None:
    assert {path.name for path in MODULES} >= {"adaptive.py", "decision.py", "interval.py"}


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.name)
def test_no_scheduler_module_imports_io_or_opens_a_file(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    io_imports = [name for name in imported_names(tree) if name.split(".")[0] in IO_MODULES]
    opens = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        and node.func.id == "open"
    ]
    assert (io_imports, opens) == ([], []), f"{path.name} does I/O"


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.name)
def test_no_scheduler_module_imports_an_io_area_of_ckptpilot(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    outside = [
        name
        for name in imported_names(tree)
        if name.split(".")[0] == "ckptpilot"
        and not any(name == ok or name.startswith(ok + ".") for ok in ALLOWED_CKPTPILOT)
    ]
    assert outside == []

