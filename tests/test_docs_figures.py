"""Measured figures live in bench/RESULTS.md; code keeps the rule and cites the section (issue 12).

A throughput or a speed ratio in a docstring goes stale with the next machine or the next
optimisation, silently; a citation of a section that was renamed points nowhere. Both are
checked on the comments and string literals of the whole package.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FIGURE = re.compile(
    r"(?<![\w.@])\d[\d.,]*\s?(?:[GMK]i?B/s|µs|ns)\b"  # throughput, sub-millisecond costs
    r"|(?<![\w.@])\d[\d.,]*\s?x (?:faster|slower|cheaper)"  # speed ratios
)
"""A number with a throughput or sub-millisecond unit, or a speed ratio. Bench row labels such
as ``xor_delta@50MB/s`` are names, not figures, hence the lookbehind."""

CITATION = re.compile(
    r'bench/RESULTS\.md(?:(?:,\s*|\s*\()(?:"(?P<heading>[^"]+)"|(?P<script>[\w-]+\.py)))?')
"""``bench/RESULTS.md, "<heading>"``, or ``bench/RESULTS.md, <bench script>`` (also in
parentheses) for the section of that script; a bare mention matches with neither group."""

KNOWN_FIGURES: set[tuple[str, str]] = set()
"""Figures a file may still quote, as (path, figure); empty, and nothing may be added."""


def prose(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of every comment and string literal."""
    return [(token.start[0], token.string)
            for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
            if token.type in (tokenize.COMMENT, tokenize.STRING)]


def package_files() -> list[Path]:
    return sorted((ROOT / "ckptpilot").rglob("*.py"))


def results_headings() -> list[str]:
    text = (ROOT / "bench" / "RESULTS.md").read_text()
    return [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("##")]


def test_no_docstring_or_comment_quotes_a_measured_figure() -> None:
    quoted = []
    for path in package_files():
        rel = path.relative_to(ROOT).as_posix()
        for line, text in prose(path):
            for match in FIGURE.finditer(text):
                if (rel, match.group()) not in KNOWN_FIGURES:
                    at = line + text.count("\n", 0, match.start())
                    quoted.append(f"{rel}:{at}: {match.group()!r}")
    assert quoted == [], (
        "measured figures belong in bench/RESULTS.md; state the rule here and cite the section: "
        + "; ".join(quoted))


def test_every_citation_of_the_results_names_a_section_that_exists() -> None:
    headings = results_headings()
    broken = []
    cited = 0
    for path in package_files():
        rel = path.relative_to(ROOT).as_posix()
        for line, text in prose(path):
            # collapsed, so that a citation wrapped over two docstring lines reads as one
            for match in CITATION.finditer(" ".join(text.split())):
                cited += 1
                heading, script = match.group("heading"), match.group("script")
                if heading is not None and heading not in headings:
                    broken.append(f"{rel}:{line}: no heading {heading!r}")
                elif script is not None and not any(h.startswith(f"{script} — ")
                                                    for h in headings):
                    broken.append(f"{rel}:{line}: no section for {script}")
                elif heading is None and script is None:
                    broken.append(f"{rel}:{line}: names no section")
    assert broken == []
    assert cited > 0


def test_the_figure_pattern_catches_the_forms_that_went_stale() -> None:
    stale = ["XXH3 (~30 GB/s here)", "1.1-1.7 GB/s measured", "one per call, ~10 µs",
             "2-5x faster than its byte-strided copy", "1.4-2.5x cheaper", "100-130 MB/s"]
    assert [bool(FIGURE.search(text)) for text in stale] == [True] * len(stale)
    names = ["the ``xor_delta@50MB/s`` rows", "hash_log 6", "``MIN_TRIAL_SECONDS`` (1 ms)"]
    assert [bool(FIGURE.search(text)) for text in names] == [False] * len(names)
