"""What ``ckptpilot fit`` reports: one ``Outcome`` per scenario, as a progress line, a table,
a JSON document and TensorBoard text + scalars.

Pure formatting except ``write_outputs`` (the two files under the work directory). The
exit code is decided here too: 0 only when every scenario that ran passed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

JSON_VERSION = 1


class Result(str, Enum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class Outcome:
    """One scenario's result. ``recovered_step``/``source`` describe the restore the verdict
    rests on (None when the pass is a refusal, or the scenario never got that far);
    ``steps_lost`` is how far the interrupted run had trained beyond it; ``detail`` says
    what was checked, or why it failed or was skipped."""

    scenario: str
    fault: str
    result: Result
    detail: str
    seconds: float
    recovered_step: int | None = None
    source: str | None = None
    steps_lost: int | None = None
    bit_exact: bool | None = None
    restore_seconds: float | None = None
    run_dir: str | None = None
    restarts: int | None = None  # torchrun campaign: restarts of the worker group

    def row(self) -> dict[str, Any]:
        row = asdict(self)
        row["result"] = self.result.value
        return row


def exit_code(outcomes: Sequence[Outcome]) -> int:
    """1 when a scenario failed; skipped ones neither pass nor fail the run."""
    return 1 if any(o.result is Result.FAILED for o in outcomes) else 0


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


COLUMNS = (("scenario", "scenario"), ("fault", "fault"), ("recovered step", "recovered_step"),
            ("source", "source"), ("steps lost", "steps_lost"), ("seconds", "seconds"),
            ("bit-exact", "bit_exact"), ("result", "result"))
CAMPAIGN_COLUMNS = (("incident", "scenario"), ("fault", "fault"), ("restarts", "restarts"),
                    *COLUMNS[2:])
"""The torchrun campaign's table: one incident a row, with the worker group's restarts."""

Columns = tuple[tuple[str, str], ...]


def _cells(outcomes: Sequence[Outcome], columns: Columns) -> list[list[str]]:
    rows = []
    for o in outcomes:
        values = o.row()
        rows.append([_cell(values[key]) for _, key in columns])
    return rows


PROGRESS_DETAIL_CHARS = 160


def progress_line(index: int, total: int, outcome: Outcome) -> str:
    """One line as a scenario finishes; a long detail is cut (the JSON holds it whole)."""
    width = len(str(total))
    detail = outcome.detail
    if len(detail) > PROGRESS_DETAIL_CHARS:
        detail = detail[:PROGRESS_DETAIL_CHARS - 1] + "…"
    return (f"[{index:>{width}}/{total}] {outcome.scenario:<18} {outcome.result.value:<7} "
            f"{outcome.seconds:5.1f} s  {detail}")


def render_table(outcomes: Sequence[Outcome], *, wall_seconds: float, work_dir: Path,
                 columns: Columns = COLUMNS) -> str:
    """The plain-text table, then one line per scenario that did not pass."""
    header = [name for name, _ in columns]
    rows = _cells(outcomes, columns)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    counts = {r: sum(o.result is r for o in outcomes) for r in Result}
    lines.append("")
    lines.append(f"{counts[Result.PASSED]} passed, {counts[Result.FAILED]} failed, "
                 f"{counts[Result.SKIPPED]} skipped in {wall_seconds:.1f} s; "
                 f"work dir {work_dir}")
    for o in outcomes:
        if o.result is not Result.PASSED:
            kept = f" (kept: {o.run_dir})" if o.run_dir else ""
            lines.append(f"  {o.scenario}: {o.result.value}: {o.detail}{kept}")
    return "\n".join(lines)


def render_markdown(outcomes: Sequence[Outcome], columns: Columns = COLUMNS) -> str:
    """The table as Markdown, which TensorBoard's text tab renders."""
    header = [name for name, _ in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in _cells(outcomes, columns)]
    return "\n".join(lines)


def to_document(outcomes: Sequence[Outcome], *, config: str | None, work_dir: Path,
                wall_seconds: float) -> dict[str, Any]:
    return {
        "version": JSON_VERSION,
        "config": config,
        "work_dir": str(work_dir),
        "wall_seconds": round(wall_seconds, 3),
        "passed": exit_code(outcomes) == 0,
        "scenarios": [o.row() for o in outcomes],
    }


def write_outputs(work_dir: Path, document: dict[str, Any], outcomes: Sequence[Outcome],
                  columns: Columns = COLUMNS) -> None:
    """``<work_dir>/fit.json`` and, under ``<work_dir>/tensorboard``, the table as text and
    ``fit/<scenario>/passed|seconds|steps_lost`` scalars for every scenario that ran."""
    (work_dir / "fit.json").write_text(json.dumps(document, indent=1) + "\n")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(work_dir / "tensorboard"))
    try:
        writer.add_text("fit/table", render_markdown(outcomes, columns))
        for o in outcomes:
            if o.result is Result.SKIPPED:
                continue
            writer.add_scalar(f"fit/{o.scenario}/passed", float(o.result is Result.PASSED))
            writer.add_scalar(f"fit/{o.scenario}/seconds", o.seconds)
            if o.steps_lost is not None:
                writer.add_scalar(f"fit/{o.scenario}/steps_lost", float(o.steps_lost))
    finally:
        writer.close()
