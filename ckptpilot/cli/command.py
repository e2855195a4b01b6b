"""The ``ckptpilot`` command: one entry point, one subcommand per job.

Bad input never produces a traceback: it is one line on stderr naming the problem, exit 2.
So does a run operation's ``OSError`` (an unreadable, unwritable or missing file): the line
names the file.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import NoReturn

from ckptpilot.errors import CkptPilotError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ckptpilot", description="Adaptive, tiered, validated checkpointing "
                     "for long PyTorch training runs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = sub.add_parser("demo", help="train a small transformer, kill it, recover, report")
    demo.add_argument("--steps", type=_positive_int, default=400,
                      help="training steps in total (default 400)")
    demo.add_argument("--run-dir", type=Path, default=Path("runs/demo"),
                      help="where checkpoints and TensorBoard logs go (default runs/demo)")
    demo.add_argument("--config", type=Path, default=None,
                      help="policy YAML (default: the reference policy, 40-step interval)")

    def run_parser(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--run-dir", type=Path, default=None,
                       help="the run directory (default: run_dir of the policy)")
        p.add_argument("--config", type=Path, default=None,
                       help="policy YAML the run was trained with (default: reference policy)")
        return p

    run_parser("ls", "list the run's checkpoints (step, level, tier, status, class, size, age)")
    rec = run_parser("recover", "make step N the point the next restore() loads")
    rec.add_argument("--step", type=_non_negative_int, required=True,
                     help="the step the next restore() loads")
    rec.add_argument("--dry-run", action="store_true", help="print what would happen only")
    rec.add_argument("--force", action="store_true",
                     help="allow a checkpoint whose status is not valid (audited)")
    pr = run_parser("prune", "apply the retention classes: remove what no rule keeps")
    pr.add_argument("--dry-run", action="store_true", help="print the plan only")
    va = run_parser("validate", "re-verify every checkpoint; mark failures corrupted")
    va_mode = va.add_mutually_exclusive_group()
    va_mode.add_argument("--rebuild", action="store_true",
                         help="recreate a lost or damaged metadata database from the checkpoint "
                         "manifests (the old file is kept, renamed)")
    va_mode.add_argument("--dry-run", action="store_true",
                         help="re-verify and report only; mark nothing (read-only)")
    rep = run_parser("report", "the run's goodput from its records: time lost to failures, "
                     "recovery and checkpointing, checkpoints, bytes, MTBF")
    rep_out = rep.add_mutually_exclusive_group()
    rep_out.add_argument("--json", action="store_true",
                         help="print the JSON document, not the table")
    rep_out.add_argument("--predict", action="store_true",
                         help="also print the simulator's goodput for this run's own size, "
                         "costs and MTBF beside the measured one (docs/operations/simulate.md)")
    rep.add_argument("--gpus", type=_positive_int, default=None, metavar="N",
                     help="also show every duration in GPU-hours for N GPUs")
    rep.add_argument("--no-tensorboard", action="store_true",
                     help="do not write the goodput/* scalars to the run's TensorBoard")
    from ckptpilot.tiers.peer.command import add_peer_parser

    add_peer_parser(sub)
    from ckptpilot.simulate.command import add_simulate_parser

    add_simulate_parser(sub)
    fit = sub.add_parser("fit", help="fault-injection suite: kill, corrupt and restore a small "
                         "job under your policy; exit 0 only when every scenario passes")
    fit.add_argument("--config", type=Path, default=None,
                     help="policy YAML to test (default: the reference policy)")
    fit.add_argument("--scenario", action="append", default=None, metavar="NAME",
                     help="run only this scenario (repeatable; --list shows them)")
    fit.add_argument("--only", type=_names, default=None, metavar="NAME,...",
                     help="run only these scenarios (incidents with --launcher torchrun)")
    fit.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                     help="print the JSON document instead of the table; with PATH, write it "
                          "there and print the table")
    fit.add_argument("--launcher", choices=("process", "torchrun"), default="process",
                     help="torchrun: the incident campaign against a real torchrun "
                          "--max-restarts job of --nproc ranks")
    fit.add_argument("--nproc", type=_positive_int, default=2, metavar="N",
                     help="ranks of the torchrun campaign's jobs (default 2)")
    fit.add_argument("--reference", type=Path, default=None, metavar="DIR",
                     help="torchrun: compare with an earlier campaign's uninterrupted job "
                          "(WORK_DIR/reference-torchrun/out/uninterrupted) instead of "
                          "running it again")
    fit.add_argument("--work-dir", type=Path, default=None,
                     help="where the scenarios run (default: a new temporary directory)")
    fit.add_argument("--with-peers", action="store_true",
                     help="run the peer scenarios on local daemons even without a peer tier")
    fit.add_argument("--keep", action="store_true",
                     help="keep every scenario's directory (default: only failed ones)")
    fit.add_argument("--list", action="store_true", help="list the scenarios and exit")
    return parser


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected NAME,..., got {text!r}")
    return names


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a step >= 0, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:  # each command imports what it needs: a peer daemon's process loads no torch
        if args.command == "peer":
            from ckptpilot.tiers.peer.command import run_peer_command

            return run_peer_command(args)
        if args.command == "simulate":
            from ckptpilot.simulate.command import run_simulate

            return run_simulate(args)
        if args.command == "demo":
            return _demo(args)
        if args.command == "fit":
            from ckptpilot.fit import list_scenarios, run_fit

            if args.list:
                return list_scenarios(sys.stdout, args.launcher)
            names = [*(args.scenario or []), *(args.only or [])]
            return run_fit(config=args.config, scenarios=names or None,
                           work_dir=args.work_dir, with_peers=args.with_peers,
                           as_json=args.json == "-", keep=args.keep, launcher=args.launcher,
                           nproc=args.nproc, reference=args.reference,
                           json_path=None if args.json in (None, "-") else Path(args.json))
        from ckptpilot.cli import ops
        from ckptpilot.policy import load_policy

        policy = load_policy(args.config, run_dir=args.run_dir)
        out = sys.stdout
        if args.command == "ls":
            return ops.ls(policy, out)
        if args.command == "recover":
            return ops.recover(policy, step=args.step, dry_run=args.dry_run,
                               force=args.force, out=out)
        if args.command == "prune":
            return ops.prune(policy, dry_run=args.dry_run, out=out)
        if args.command == "report":
            from ckptpilot.cli.report import run_report

            rc = run_report(policy, out, as_json=args.json, gpus=args.gpus,
                            tensorboard=not args.no_tensorboard)
            if args.predict:
                from ckptpilot.cli.report import build_report, read_records
                from ckptpilot.simulate.validate import format_prediction

                out.write(format_prediction(build_report(read_records(policy)),
                                            gpus=args.gpus or 1))
            return rc
        return ops.validate(policy, rebuild=args.rebuild, dry_run=args.dry_run, out=out)
    except CkptPilotError as e:
        print(f"ckptpilot {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"ckptpilot {args.command}: error: {_describe_os_error(e)}", file=sys.stderr)
        return 2


def _demo(args: argparse.Namespace) -> int:
    from ckptpilot.cli.demo import DemoError, run_demo

    try:
        return run_demo(steps=args.steps, run_dir=args.run_dir, config=args.config)
    except DemoError as e:
        print(f"ckptpilot demo: error: {e}", file=sys.stderr)
        return 2


def _describe_os_error(error: OSError) -> str:
    """``strerror: file`` (both files of a failed rename), and what to check."""
    if error.filename is None:
        return str(error)
    files = f"{error.filename}" + (f" -> {error.filename2}" if error.filename2 else "")
    return (f"{error.strerror or type(error).__name__}: {files}; check that it exists and that "
            "this user may read (and, for changes, write) it and its directory")
