"""The README is the front page: its two set-up commands are the contract with newcomers and
CI, and everything else it says in depth lives in the documentation site under docs/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def bash_blocks(path: Path = README) -> list[str]:
    text = path.read_text()
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_readme_has_exactly_two_setup_commands() -> None:
    blocks = bash_blocks()
    assert len(blocks) == 2
    assert blocks[0].endswith("ckptpilot demo")
    assert "pytest" in blocks[1]
    assert "mkdocs build --strict" in blocks[1]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert bash_blocks()[1] in ci


def test_getting_started_shows_the_readme_commands() -> None:
    assert bash_blocks(ROOT / "docs" / "getting-started.md") == bash_blocks()


def test_readme_is_a_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move reference to docs/"
    duration = [line for line in lines if line.startswith("Demo duration:")]
    assert len(duration) == 1, "one line 'Demo duration: ...' that the measured time updates"


def test_every_relative_link_of_the_readme_exists() -> None:
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [t for t in targets if "://" not in t]
    missing = [t for t in local if not (ROOT / t).exists()]
    assert local and missing == []
