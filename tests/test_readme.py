"""The README's two set-up commands are the contract with newcomers and CI."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bash_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_readme_has_exactly_two_setup_commands() -> None:
    blocks = bash_blocks()
    assert len(blocks) == 2
    assert blocks[0].endswith("ckptpilot demo")
    assert "pytest" in blocks[1]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert bash_blocks()[1] in ci
