"""Showing simulated outcomes: a Markdown table, a JSON document, matplotlib PNG plots.

This module owns the presentation of :class:`~ckptpilot.simulate.study.Row` and nothing else.
matplotlib is an optional extra (``pip install 'ckptpilot[sim]'``), imported only when a plot
is asked for, so the table and JSON work without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptpilot.errors import CkptPilotError
from ckptpilot.simulate.study import Row

__all__ = ["PlotError", "format_table", "plot_sweep", "rows_as_json"]


class PlotError(CkptPilotError, RuntimeError):
    """A plot was asked for and cannot be drawn (matplotlib missing)."""


def _gpu_hours(hours: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:,.0f}" for k, v in sorted(hours.items(), key=lambda kv: -kv[1])
                     if v >= 0.5) or "-"


def format_table(rows: Sequence[Row]) -> str:
    """One line per policy: ETTR and where the rest went, lost GPU-hours per day by cause."""
    lines = [
        "| GPUs | job MTBF min | policy | interval s | ETTR | overhead | rolled back + down "
        "| recovery s | restores from | lost GPU-h/day by cause |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        restores = ", ".join(f"{k} {v:g}" for k, v in sorted(r.restores.items()))
        lines.append(
            f"| {r.gpus} | {r.mtbf_seconds / 60:.1f} | {r.label} | {r.interval_seconds:.1f} "
            f"| {r.ettr:.4f} | {r.overhead_fraction:.2%} | {r.lost_fraction:.2%} "
            f"| {r.recovery_seconds:.1f} | {restores} | {_gpu_hours(r.lost_gpu_hours_per_day)} |")
    return "\n".join(lines) + "\n"


def rows_as_json(rows: Sequence[Row]) -> list[dict[str, Any]]:
    return [{**dataclasses.asdict(r), "label": r.label} for r in rows]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise PlotError("plots need matplotlib: pip install 'ckptpilot[sim]' "
                        "(or leave out --plot-dir)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(rows: Sequence[Row], x: str, path: Path, title: str) -> Path:
    """ETTR of every policy against ``x`` (``gpus`` or ``mtbf_minutes``), one PNG."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in dict.fromkeys(r.label for r in rows):
        mine = [r for r in rows if r.label == label]
        xs = [r.gpus if x == "gpus" else r.mtbf_seconds / 60 for r in mine]
        ax.plot(xs, [r.ettr for r in mine], marker="o", label=label,
                linestyle="-" if mine[0].peer else "--")
    ax.set_xscale("log", base=2 if x == "gpus" else 10)
    ax.set_xlabel("GPUs" if x == "gpus" else "job MTBF (minutes)")
    ax.set_ylabel("ETTR (productive / wall time)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
