"""The documentation site (mkdocs.yml, docs/): generated references are complete, and every page
the code or the navigation names exists. ``mkdocs build --strict`` itself runs in .ci/run."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml
from pydantic import BaseModel

from ckptpilot.cli import build_parser
from ckptpilot.policy import Policy

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def load_hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference_hook",
                                                  DOCS / "hooks" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def policy_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every key of the policy YAML as a dotted path; a mapping of sections as ``<name>``."""
    keys = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        keys.append(key)
        sub = _model_in(field.annotation)
        if sub is not None:
            mapped = getattr(field.annotation, "__origin__", None) is dict
            keys += policy_keys(sub, f"{key}.<name>." if mapped else f"{key}.")
    return keys


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def subcommands(parser: argparse.ArgumentParser, prog: str = "ckptpilot",
                ) -> dict[str, argparse.ArgumentParser]:
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= subcommands(sub, f"{prog} {name}") or {f"{prog} {name}": sub}
    return found


def test_the_policy_reference_lists_every_key_with_its_default() -> None:
    reference = load_hook().policy_reference()
    keys = policy_keys(Policy)
    assert {"async.max_pending", "scheduler.extra_signals.<name>.factory",
            "retention.best.metric", "tiers.remote.retries.attempts"} <= set(keys)
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([^`]+)` \|.*$", reference,
                                                         flags=re.M)}
    assert sorted(rows) == sorted(keys)
    assert "| `tiers.memory.max_bytes` | byte size | `8GiB` |" in rows["tiers.memory.max_bytes"]
    assert "| `scheduler.base_interval` | int | `100` | ≥ 1, ≤ 10^9 |" in reference
    assert "| `validation.load_test` | choice | `subprocess` | `subprocess`, `none` |" in reference


def test_the_cli_reference_lists_every_subcommand_and_option() -> None:
    reference = load_hook().cli_reference()
    commands = subcommands(build_parser())
    assert {"ckptpilot demo", "ckptpilot fit", "ckptpilot peer serve",
            "ckptpilot peer registry", "ckptpilot report"} <= set(commands)
    headings = re.findall(r"^### `(.+)`$", reference, flags=re.M)
    assert headings == list(commands)
    for name, parser in commands.items():
        section = reference.split(f"### `{name}`\n", 1)[1].split("\n### ", 1)[0]
        options = [o for a in parser._actions for o in a.option_strings if o not in ("-h",
                                                                                   "--help")]
        assert options, name
        missing = [o for o in options if f"`{o}" not in section]
        assert missing == [], f"{name}: {missing}"


def test_each_reference_page_holds_its_marker_once() -> None:
    for page, marker in load_hook().MARKERS.items():
        assert (DOCS / page).read_text().count(marker) == 1, page


def nav_pages(entries: list[Any]) -> list[str]:
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_in_the_navigation_exists() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = nav_pages(config["nav"])
    assert "reference/policy.md" in pages and "reference/cli.md" in pages
    assert [p for p in pages if not (DOCS / p).is_file()] == []


def test_every_docs_page_the_code_cites_exists() -> None:
    cited = []
    for path in [*ROOT.glob("ckptpilot/**/*.py"), *ROOT.glob("ckptpilot/configs/*.yaml"),
                 *ROOT.glob("configs/*.yaml"), *ROOT.glob("tests/*.py")]:
        for page in re.findall(r"\bdocs/[\w/.-]+\.md\b", path.read_text()):
            cited.append((path.relative_to(ROOT).as_posix(), page))
    assert cited, "the code cites the documentation pages by path"
    assert [(where, page) for where, page in cited if not (ROOT / page).is_file()] == []


def test_every_relative_link_in_the_included_results_resolves_inside_the_site() -> None:
    """bench/RESULTS.md is pasted into docs/benchmarks/results.md, so its links resolve from
    there: a link that works on GitHub (``../docs/…``, ``plots/…``) fails the strict build."""
    text = (ROOT / "bench" / "RESULTS.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    broken = [t for t in targets if not t.startswith(("http://", "https://", "#"))
              and not (DOCS / "benchmarks" / t.split("#", 1)[0]).exists()]
    assert broken == [], f"bench/RESULTS.md links outside the site: {broken}"
