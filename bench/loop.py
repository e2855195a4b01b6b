"""Training-loop overhead, each run in a fresh process: the demo model at the default policy
against no checkpointing, and the MLP of ``bench/e2e.py`` with a save every ``--every`` steps
(ckptpilot, DCP ``async_save``, no checkpointing).

Why fresh processes: in one long process (``bench/e2e.py``) the same variant's median step
moves by a third from one run to the next, a property of the process (where its tensors
landed), and a process that has already imported and warmed everything hides what a real
run pays once (its first save's imports, the load-test worker's start). Each run here is
``e2e.train`` — the very loop e2e measures — in its own interpreter, variants interleaved
(the order rotates per round), one torch thread (training leaves a core to background work,
as a GPU job's CPU does), with torch's large allocations on transparent huge pages
(``THP_MEM_ALLOC_ENABLE=1``): without them the MLP's median step moved by half from one
process to the next, by where its pages landed, and no variant could be ranked
(bench/RESULTS.md, "loop.py — training-loop overhead in fresh processes").

Two readings of each run:
- **wall**: the loop from the first step to ``close()`` returning, paired with the same
  round's no-checkpointing run (median of the per-round ratios);
- **per process**: the wall against ``steps`` times the median training time (forward to
  loss, without the step boundary's checkpointing work) of that process's own steps before
  its first save, which cancels the process's speed;
  the no-checkpointing run's figure is the noise floor (its steps also drift), subtracted.
And the background CPU: CPU-seconds of the process and its children minus the wall, i.e. the
work done beside the training thread.

Usage: ``.venv/bin/python bench/loop.py [--rounds 5] [--steps 300] [--every 20]``
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

import torch
from e2e import MLP_BATCH, MLP_HIDDEN, MLP_VARIANTS, Sizes, rotated, torch_threads, train
from peer import git_facts, loadavg
from scratch import DEFAULT_DIR, scratch_dir

DEMO = ("demo_none", "demo_pilot")
MLP = tuple(v for v in MLP_VARIANTS if v in ("none", "pilot", "dcp_async"))  # the baseline first
LABELS = {"demo_none": "demo, no checkpointing", "demo_pilot": "demo, ckptpilot default policy",
          "none": "MLP, no checkpointing", "pilot": "MLP, ckptpilot organ every N",
          "dcp_async": "MLP, DCP async_save every N"}
WARM_STEPS = 4  # the first steps of a process: allocator and caches warming


def child(variant: str, sizes: Sizes, workdir: Path) -> None:
    with torch_threads(sizes.loop_threads):
        run = train(variant, sizes, workdir / "run", exclude=())
    print(json.dumps(dataclasses.asdict(run)))


def spawn(variant: str, args: argparse.Namespace, workdir: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--steps", str(args.steps),
           "--every", str(args.every), "--dir", str(workdir)]
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{variant}: the child failed ({done.returncode}):\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def per_process(run: dict, first_save: int) -> float:
    """The wall against ``steps`` x this process's own median training time (no step-boundary
    work) before ``first_save`` (its own first save's, or the compared variants')."""
    steps = run["train_seconds"]
    before = steps[WARM_STEPS:(run["first_save"] or first_save) - 1]
    return run["wall"] / (len(steps) * median(before)) - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=20, help="the MLP's steps between saves")
    parser.add_argument("--only", choices=("demo", "mlp"), help="one of the two models")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--child", choices=(*DEMO, *MLP), help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = Sizes(gb=0.0, rounds=1, steps=args.steps, every=args.every, mlp_hidden=MLP_HIDDEN,
                  mlp_batch=MLP_BATCH, demo_steps=args.steps, quick=False)
    if args.child:
        child(args.child, sizes, args.dir)
        return
    print(f"command: {shlex.join(sys.orig_argv)}")
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}; "
          f"{git_facts()}")
    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"1 torch thread per run; load average at start {loadavg()}")
    groups = {"demo": (DEMO,), "mlp": (MLP,), None: (DEMO, MLP)}[args.only]
    runs: dict[str, list[dict]] = {v: [] for group in groups for v in group}
    with scratch_dir(args.dir, "loop-") as workdir:
        for r in range(args.rounds):
            for group in groups:
                for v in rotated(group, r):
                    print(f"[loop] round {r + 1}/{args.rounds}: {v}", file=sys.stderr,
                          flush=True)
                    run = spawn(v, args, Path(tempfile.mkdtemp(dir=workdir)))
                    runs[v].append({**run, "variant": v})
    for group in groups:
        losses = {run["final_loss"] for v in group for run in runs[v]}
        if len(losses) != 1:
            raise SystemExit(f"{group}: final losses differ between runs: {losses}")
    report(runs, groups)
    print(f"load average at end {loadavg()}")


def report(runs: dict[str, list[dict]], groups: tuple[tuple[str, ...], ...]) -> None:
    print()
    print("| variant | saves | wall s (per round) | wall vs none (median of rounds) "
          "| per process (minus none's) | background CPU-s |")
    print("|---|---:|---|---:|---:|---|")
    result: dict[str, tuple[float, float, float]] = {}
    for group in groups:
        base = group[0]
        # The baseline's steps are cut where the variants' first saves fall.
        first = min((run["first_save"] for v in group for run in runs[v] if run["first_save"]),
                    default=len(runs[base][0]["train_seconds"]) + 1)
        floor = median(per_process(run, first) for run in runs[base])
        for v in group:
            walls = [run["wall"] for run in runs[v]]
            paired = median(run["wall"] / b["wall"] - 1 for run, b in zip(runs[v], runs[base],
                                                                          strict=True))
            own = median(per_process(run, first) for run in runs[v]) - floor
            background = [run["cpu"] - run["wall"] for run in runs[v]]
            result[v] = (paired, own, median(background))
            print(f"| {LABELS[v]} | {median(run['saves'] for run in runs[v]):g} "
                  f"| {', '.join(f'{w:.2f}' for w in walls)} | {paired:+.1%} | {own:+.1%} "
                  f"| {', '.join(f'{b:.2f}' for b in background)} |")
    print()
    goals = []
    if DEMO in groups:
        demo = result["demo_pilot"]
        goals.append(("demo model, default policy: overhead < 2 % (wall, paired)",
                      f"{demo[0]:+.1%}", demo[0] < 0.02))
    if MLP in groups:
        pilot, dcp = result["pilot"], result["dcp_async"]
        goals += [
            ("MLP: ckptpilot's overhead <= DCP async_save's (wall, paired)",
             f"{pilot[0]:+.1%} vs {dcp[0]:+.1%}", pilot[0] <= dcp[0]),
            ("MLP: ckptpilot's overhead <= DCP async_save's (per process)",
             f"{pilot[1]:+.1%} vs {dcp[1]:+.1%}", pilot[1] <= dcp[1]),
            ("MLP: background CPU <= DCP async_save's",
             f"{pilot[2]:.2f} vs {dcp[2]:.2f} CPU-s", pilot[2] <= dcp[2])]
    print("| goal | measured | |")
    print("|---|---|---|")
    for what, value, met in goals:
        print(f"| {what} | {value} | {'met' if met else 'missed'} |")


if __name__ == "__main__":
    main()
