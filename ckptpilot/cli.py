"""The ``ckptpilot`` command: one entry point, one subcommand per job.

Bad input never produces a traceback: it is one line on stderr naming the problem, exit 2.
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from ckptpilot.demo import DemoError, run_demo

    try:
        if args.command == "demo":
            return run_demo(steps=args.steps, run_dir=args.run_dir, config=args.config)
    except (CkptPilotError, DemoError) as e:
        print(f"ckptpilot {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
