"""No load path unpickles (issue 23): every module under ``ckptpilot/`` is read with ``ast``
(not grep: aliases, ``from`` imports and imports inside functions resolve to what they name),
and each use of a deserialiser that can run code fails the test naming ``file:line``.

Refused: ``pickle``/``_pickle`` ``load``, ``loads``, ``Unpickler``; ``marshal.load(s)``;
importing ``dill``, ``cloudpickle``, ``jsonpickle``, ``joblib`` or ``shelve``;
``pandas.read_pickle``; ``torch.package.PackageImporter``; ``torch.load`` (and
``torch.serialization``'s loaders) unless called with ``weights_only=True`` spelled out;
``numpy.load`` with ``allow_pickle`` other than ``False``; ``yaml.load`` without a SafeLoader,
``yaml.unsafe_load``, ``yaml.full_load``; and the ``torch.distributed.checkpoint`` paths that
unpickle — ``FileSystemReader`` (DCP's pickled ``.metadata``, its subclass
``HuggingFaceStorageReader``), ``format_utils`` (``torch.load(weights_only=False)``),
``_pg_transport``, ``_experimental``, ``load_state_dict`` / ``_load_state_dict*``, and
``dcp.load`` without ``storage_reader=`` (it would pick ``FileSystemReader`` itself); and
any call of a ``LoadPlanner``'s ``load_bytes``, which passes the stream it is given to
``torch.load`` with ``weights_only=False`` (``DefaultLoadPlanner``): handing it stored bytes
was issue 23.

Writing a pickle (``pickle.dumps`` of DCP's ``.metadata`` for stock readers) is not a load
and is not listed. ``ALLOWED`` names each whitelisted finding by file, function and rule
(not by line number, which any edit above it would shift), with its reason; an entry that no
longer matches a finding fails. The scan itself is tested on a source that holds every
refused form and its safe twins, so a scan that finds nothing because it is broken fails too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ckptpilot"

ALLOWED: dict[tuple[str, str, str], str] = {
    ("ckptpilot/dcp/reader.py", "_apply_value", "load_bytes"):
        "the stream is torch.save, made on the line above, of a value that dcp.values built "
        "from verified JSON (None/bool/int/float/str/list/tuple/dict only): DCP's planner "
        "API takes a value only as a stream, and no stored byte is in this one",
}
"""(file, enclosing function, rule) -> why that use unpickles nothing read from storage."""

_ALWAYS = {
    "pickle.load", "pickle.loads", "pickle.Unpickler", "pickle._load", "pickle._loads",
    "pickle._Unpickler", "_pickle.load", "_pickle.loads", "_pickle.Unpickler",
    "marshal.load", "marshal.loads", "pandas.read_pickle", "torch.package.PackageImporter",
    "yaml.unsafe_load", "yaml.full_load", "yaml.unsafe_load_all", "yaml.full_load_all",
}
_MODULES = {"dill", "cloudpickle", "jsonpickle", "joblib", "shelve", "cPickle"}
_TORCH_LOADS = {"torch.load", "torch.serialization.load", "torch.serialization._load",
                "torch.serialization._legacy_load"}
_DCP = "torch.distributed.checkpoint"
_DCP_UNPICKLING = {"FileSystemReader", "HuggingFaceStorageReader", "BroadcastingTorchSaveReader",
                   "format_utils", "_pg_transport", "_experimental", "load_state_dict",
                   "_load_state_dict", "_load_state_dict_from_keys", "dcp_to_torch_save",
                   "torch_save_to_dcp"}
_DCP_LOADS = {f"{_DCP}.load", f"{_DCP}.state_dict_loader.load"}
_SAFE_YAML_LOADERS = {"yaml.SafeLoader", "yaml.CSafeLoader"}


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Each local name an import binds (anywhere in the module) -> the dotted name it is."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:  # ``import a.b`` binds ``a``
                    top = alias.name.split(".", 1)[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, names: dict[str, str]) -> str | None:
    """The dotted name an expression refers to through the module's imports, or None."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, names)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _splat(call: ast.Call) -> bool:
    """``**kwargs``: what it passes cannot be read from the source."""
    return any(k.arg is None for k in call.keywords)


def _is_const(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def _safe_loader(node: ast.expr | None, names: dict[str, str], tree: ast.Module) -> bool:
    """A yaml Loader that builds no objects: SafeLoader, or a class of this module that
    derives from one."""
    if node is None:
        return False
    if _dotted(node, names) in _SAFE_YAML_LOADERS:
        return True
    if isinstance(node, ast.Name):
        for cls in ast.walk(tree):
            if isinstance(cls, ast.ClassDef) and cls.name == node.id:
                return any(_safe_loader(base, names, tree) for base in cls.bases)
    return False


def _call_fault(call: ast.Call, name: str, names: dict[str, str], tree: ast.Module
                ) -> str | None:
    """Why a call of ``name`` may unpickle, or None when it cannot (or is not a rule's)."""
    if name in _TORCH_LOADS:
        if _is_const(_keyword(call, "weights_only"), True) and not _splat(call):
            return None
        return f"{name}(...) without weights_only=True"
    if name == "numpy.load":
        pickle = _keyword(call, "allow_pickle")
        if _splat(call) or (pickle is not None and not _is_const(pickle, False)):
            return "numpy.load(...) with allow_pickle not False"
        return None
    if name in _DCP_LOADS:
        if _keyword(call, "storage_reader") is None:
            return (f"{name}(...) without storage_reader= (DCP would read with "
                    "FileSystemReader, which unpickles .metadata)")
        return None
    if name in ("yaml.load", "yaml.load_all"):
        if _safe_loader(_keyword(call, "Loader"), names, tree):
            return None
        return f"{name}(...) without a SafeLoader"
    return None


def _reference_fault(name: str) -> str | None:
    if name in _ALWAYS or name.split(".", 1)[0] in _MODULES:
        return name
    if name in _TORCH_LOADS:
        return f"{name} used other than called with weights_only=True"
    if name.startswith(_DCP + ".") and _DCP_UNPICKLING & set(name.split(".")):
        return f"{name} (unpickles what it reads)"
    return None


_CALL_RULES = _TORCH_LOADS | _DCP_LOADS | {"numpy.load", "yaml.load", "yaml.load_all"}


def _chain(node: ast.expr) -> list[ast.expr]:
    """``a.b.c`` as its prefixes, innermost first: ``a``, ``a.b``, ``a.b.c``."""
    parts = [node]
    while isinstance(parts[-1], ast.Attribute):
        parts.append(parts[-1].value)  # type: ignore[attr-defined]
    return parts[::-1]


class Finding(NamedTuple):
    file: str
    line: int
    function: str  # the enclosing function ("" at module level)
    rule: str  # the loader, as ALLOWED names it
    what: str

    def __str__(self) -> str:
        inside = f" (in {self.function})" if self.function else ""
        return f"{self.file}:{self.line}: {self.what}{inside}"


def _functions(tree: ast.AST) -> dict[int, str]:
    """id(node) -> the name of the innermost function around it."""
    around: dict[int, str] = {}

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) \
                else function
            around[id(child)] = name
            visit(child, name)

    visit(tree, "")
    return around


def findings(source: str, filename: str) -> Iterator[Finding]:
    """Each use of an unpickling loader in ``source``."""
    tree = ast.parse(source, filename)
    names = _aliases(tree)
    around = _functions(tree)
    called: set[int] = set()  # a call rule's function, judged with its arguments
    inner: set[int] = set()  # the base of a longer name, judged with it

    def found(node: ast.AST, rule: str, what: str) -> Finding:
        return Finding(filename, getattr(node, "lineno", 0), around.get(id(node), ""), rule,
                       what)

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            inner.add(id(node.value))
        if isinstance(node, ast.Call):
            name = _dotted(node.func, names)
            if name in _CALL_RULES:
                called.add(id(node.func))
                fault = _call_fault(node, name, names, tree)
                if fault is not None:
                    yield found(node, name, fault)
            elif isinstance(node.func, ast.Attribute) and node.func.attr == "load_bytes":
                yield found(node, "load_bytes", (
                    "a LoadPlanner's load_bytes(...) (DCP's planner torch.loads the stream "
                    "with weights_only=False)"))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""])
            for module in modules:
                if module.split(".", 1)[0] in _MODULES:
                    yield found(node, module, f"import of {module}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute | ast.Name) or id(node) in inner \
                or isinstance(node.ctx, ast.Store):
            continue
        for part in _chain(node):
            name = _dotted(part, names)
            if id(part) in called or name is None or name.split(".", 1)[0] in _MODULES:
                continue  # judged as a call, not an import, or reported at its import
            fault = _reference_fault(name)
            if fault is not None:
                yield found(node, name, fault)
                break


def _scan_package() -> list[Finding]:
    found: list[Finding] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found.extend(findings(path.read_text(), path.relative_to(ROOT).as_posix()))
    return sorted(set(found))


def test_no_module_of_ckptpilot_unpickles_on_any_path() -> None:
    bad = [f for f in _scan_package() if (f.file, f.function, f.rule) not in ALLOWED]
    assert bad == [], "unpickling loaders (a load path must not unpickle):\n" + "\n".join(
        map(str, bad))


def test_every_whitelisted_use_is_still_there_and_says_why() -> None:
    present = {(f.file, f.function, f.rule) for f in _scan_package()}
    for key, why in ALLOWED.items():
        assert key in present, f"{key}: no such finding any more (drop the entry)"
        assert len(why) > 20, f"{key}: a whitelisted use needs its reason"


SAMPLE = '''\
import pickle
import pickle as pk
import marshal
import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import yaml
from pickle import loads as unpickle
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystemReader as FSR
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
import dill


class Loader(yaml.SafeLoader):
    pass


def bad(raw, path, state, reader, kw, planner, item):
    pickle.loads(raw)
    pk.load(raw)
    unpickle(raw)
    marshal.loads(raw)
    torch.load(path)
    torch.load(path, weights_only=False)
    torch.load(path, **kw)
    np.load(path, allow_pickle=True)
    dcp.load(state, checkpoint_id=path)
    FileSystemReader(path)
    FSR(path)
    dcp_to_torch_save(path, path)
    dcp.state_dict_loader._load_state_dict(state, reader)
    yaml.load(raw)
    yaml.load(raw, Loader=yaml.Loader)
    yaml.unsafe_load(raw)
    loader = torch.load
    torch.serialization._load(raw)
    planner.load_bytes(item, raw)


def good(raw, path, state, reader):
    pickle.dumps(raw)
    torch.load(path, weights_only=True)
    np.load(path)
    np.load(path, allow_pickle=False)
    dcp.load(state, storage_reader=reader)
    yaml.load(raw, Loader=Loader)
    yaml.load(raw, Loader=yaml.SafeLoader)
    yaml.safe_load(raw)
    torch.save(state, path)
'''


def test_the_scan_finds_every_unpickling_form_and_passes_the_safe_ones() -> None:
    found = [str(f) for f in findings(SAMPLE, "sample.py")]
    lines = SAMPLE.splitlines()
    flagged = sorted({int(f.split(":")[1]) for f in found})
    expected = [n for n, line in enumerate(lines, 1)
                if line.startswith("import dill") or (
                    n > lines.index("def bad(raw, path, state, reader, kw, planner, item):") + 1
                    and n < lines.index("def good(raw, path, state, reader):") - 1)]
    assert flagged == expected, "\n".join(found)
    def at(line: str) -> str:
        return f"sample.py:{lines.index(line) + 1}: "

    assert at("    torch.load(path)") + (
        "torch.load(...) without weights_only=True (in bad)") in found
    assert at("    dcp.load(state, checkpoint_id=path)") + (
        "torch.distributed.checkpoint.load(...) without storage_reader= (DCP would read with "
        "FileSystemReader, which unpickles .metadata) (in bad)") in found
    assert at("    FSR(path)") + (
        "torch.distributed.checkpoint.filesystem.FileSystemReader (unpickles what it reads) "
        "(in bad)") in found
    assert at("    unpickle(raw)") + "pickle.loads (in bad)" in found
    assert at("import dill") + "import of dill" in found
