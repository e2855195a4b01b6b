"""``ckptpilot simulate``: the ETTR of every policy at cluster scale, from measured costs.

This module owns the subcommand's arguments and its I/O: reading the profile, the cluster
file and the trace, running :func:`~ckptpilot.simulate.study.compare` over the sizes and
MTBFs asked for, and printing the table, the JSON or the plots. Bad input is one
:class:`SimulateError` naming the file or option, which ``ckptpilot`` turns into exit 2.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import TextIO

from pydantic import ValidationError

from ckptpilot.errors import CkptPilotError
from ckptpilot.simulate.costs import ClusterSpec, load_profile
from ckptpilot.simulate.failures import (
    LLAMA3_FAILURES_PER_GPU_HOUR,
    FailureModel,
    mtbf_seconds_for,
)
from ckptpilot.simulate.render import format_table, plot_sweep, rows_as_json
from ckptpilot.simulate.study import Row, StudySpec, compare

__all__ = ["SimulateError", "add_simulate_parser", "read_trace", "run_simulate"]

DEFAULT_GPUS = (64, 1024, 4096, 16384)
DEFAULT_TRACE = Path("bench/traces/demo.csv")


class SimulateError(CkptPilotError, ValueError):
    """Bad input to ``ckptpilot simulate``: the message names the file or option."""


def _number_list(kind: type) -> argparse._ActionsContainer:
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of numbers, "
                                             f"got {text!r}") from None
        if not values or min(values) <= 0:
            raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
        return values

    return parse  # type: ignore[return-value]


def add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="predict ETTR and lost GPU-hours per policy at 64 to "
                       "16,384 GPUs from a measured cost profile (discrete-event model)")
    p.add_argument("--profile", type=Path, required=True,
                   help="cost profile JSON (bench/e2e.py --json; bench/profiles/)")
    p.add_argument("--gpus", type=_number_list(int), default=list(DEFAULT_GPUS),
                   help="job sizes, comma-separated (default 64,1024,4096,16384)")
    p.add_argument("--mtbf-minutes", type=_number_list(float), default=None,
                   help="job MTBFs to sweep, comma-separated (default: from the failure rate)")
    p.add_argument("--failures-per-gpu-hour", type=float, default=LLAMA3_FAILURES_PER_GPU_HOUR,
                   help="failure rate when --mtbf-minutes is not given (default: Llama 3's, "
                   f"{LLAMA3_FAILURES_PER_GPU_HOUR:.3g})")
    p.add_argument("--distribution", choices=["exponential", "weibull"], default="exponential")
    p.add_argument("--weibull-shape", type=float, default=0.7)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                   help=f"loss/grad-norm trace CSV the adaptive policy replays "
                   f"(default {DEFAULT_TRACE})")
    p.add_argument("--cluster", type=Path, default=None,
                   help="JSON object of cluster assumptions (keys of ClusterSpec, see "
                   "docs/operations/simulate.md)")
    p.add_argument("--step-seconds", type=float, default=2.0, help="seconds per step (2.0)")
    p.add_argument("--days", type=float, default=7.0, help="wall time simulated per run (7)")
    p.add_argument("--seeds", type=int, default=3, help="runs per policy, averaged (3)")
    p.add_argument("--no-peer", action="store_true", help="compare without the peer tier only")
    p.add_argument("--json", action="store_true", help="print JSON rows, not the table")
    p.add_argument("--plot-dir", type=Path, default=None,
                   help="also write ETTR plots (PNG) here; needs matplotlib ('ckptpilot[sim]')")


def read_trace(path: Path) -> tuple[list[float], list[float]]:
    """Losses and grad norms of a trace CSV (bench/record_traces.py; ``#`` lines skipped)."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    except OSError as e:
        raise SimulateError(f"cannot read trace {path}: {e.strerror or e}; pass --trace with "
                            "a CSV recorded by bench/record_traces.py") from e
    try:
        losses = [float(r["loss"]) for r in rows]
        grads = [float(r["grad_norm"]) for r in rows]
    except (KeyError, TypeError, ValueError) as e:
        raise SimulateError(f"trace {path}: every row needs numeric 'loss' and 'grad_norm' "
                            f"({e})") from e
    if len(losses) < 2:
        raise SimulateError(f"trace {path}: needs at least two steps, has {len(losses)}")
    return losses, grads


def _cluster(path: Path | None) -> ClusterSpec:
    if path is None:
        return ClusterSpec()
    try:
        return ClusterSpec(**json.loads(path.read_text()))
    except OSError as e:
        raise SimulateError(f"cannot read cluster file {path}: {e.strerror or e}") from e
    except (json.JSONDecodeError, TypeError) as e:
        raise SimulateError(f"cluster file {path}: expected a JSON object ({e})") from e
    except ValidationError as e:
        first = e.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise SimulateError(f"cluster file {path}: key {key!r}: {first['msg']}") from e


def run_simulate(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the comparison over ``--gpus`` × MTBFs; print it (to ``out``, default stdout);
    write plots if asked."""
    out = sys.stdout if out is None else out
    if args.seeds < 1 or args.days <= 0 or args.step_seconds <= 0:
        raise SimulateError("--seeds must be >= 1, --days and --step-seconds positive")
    if args.failures_per_gpu_hour <= 0:
        raise SimulateError("--failures-per-gpu-hour must be positive")
    profile = load_profile(args.profile)
    cluster = _cluster(args.cluster)
    trace = read_trace(args.trace)
    spec = StudySpec(step_seconds=args.step_seconds, horizon_seconds=args.days * 86400,
                     seeds=args.seeds)
    try:
        model = FailureModel(mtbf_seconds=1.0, distribution=args.distribution,
                             weibull_shape=args.weibull_shape)
    except ValidationError as e:
        raise SimulateError(f"--weibull-shape: {e.errors()[0]['msg']}") from e
    peer_options = (False,) if args.no_peer else (False, True)
    rows: list[Row] = []
    for gpus in args.gpus:
        mtbfs = ([m * 60 for m in args.mtbf_minutes] if args.mtbf_minutes else
                 [mtbf_seconds_for(args.failures_per_gpu_hour, gpus)])
        for mtbf in mtbfs:
            rows += compare(profile, cluster, gpus, model.model_copy(update={
                "mtbf_seconds": mtbf}), trace, spec, peer_options=peer_options)
    if args.json:
        print(json.dumps(rows_as_json(rows), indent=2), file=out)
    else:
        out.write(format_table(rows))
    if args.plot_dir is not None:
        if len(args.gpus) > 1:
            for mtbf in sorted({r.mtbf_seconds for r in rows}) if args.mtbf_minutes else [None]:
                mine = [r for r in rows if mtbf is None or r.mtbf_seconds == mtbf]
                name = "ettr_by_gpus.png" if mtbf is None else f"ettr_by_gpus_mtbf{mtbf / 60:g}.png"
                print(f"plot: {plot_sweep(mine, 'gpus', args.plot_dir / name, 'ETTR by job size')}",
                      file=out)
        if args.mtbf_minutes and len(args.mtbf_minutes) > 1:
            for gpus in args.gpus:
                mine = [r for r in rows if r.gpus == gpus]
                path = plot_sweep(mine, "mtbf_minutes", args.plot_dir / f"ettr_by_mtbf_{gpus}.png",
                                  f"ETTR by job MTBF, {gpus} GPUs")
                print(f"plot: {path}", file=out)
    return 0
