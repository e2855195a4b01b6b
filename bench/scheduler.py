"""Per-step cost of ckptpilot's bookkeeping on the training thread, against one training step.

The pilot's promise for the steps on which nothing is saved (all but one in ``base_interval``)
is that it stays out of the way: the issue's goal is under 1 % of one step of the demo model
and under 50 µs absolute. This script measures, in one process and one run:

1. baseline: the wall time of one full training step without a pilot, exactly as
   ``ckptpilot.cli.demo.train_child`` runs it (batch 32 x context 64 drawn through a
   ``ResumableSampler``, forward, cross-entropy, ``zero_grad``, backward,
   ``clip_grad_norm_``, AdamW ``step``, OneCycleLR ``step``), minus its TensorBoard and
   stdout reporting;
2. the same steps with a ``CheckpointPilot`` attached (``restore()`` first, as the demo
   does; TensorBoard off; decision log on and off as two variants; a 100000-step interval so
   that no save falls in the measured window): per step, ``pilot.observe(loss)`` and the
   optimizer post-step hook. The hook is timed by replacing the pilot's hook registration
   with a timing wrapper around ``pilot._after_optimizer_step``; steps on which it probes the
   gradient norm (every ``grad.probe_every``) are reported apart from plain ones;
3. a third pilot variant ("instrumented", decision log on) wraps the parts of ``observe``
   in timers (``_decide``, ``scheduler.measure`` / ``set_cost_model`` / ``decide_from``,
   health snapshot, telemetry enqueue, ``_write_heartbeat``, ``HeartbeatWriter.write``) for
   the breakdown. Each timer wrapper adds its own overhead (printed), so the breakdown is
   not used for the headline numbers;
4. each part again in isolation, per call with ``perf_counter_ns`` (median, p99) and as a
   ``timeit`` mean, on a live pilot in its steady state, including the torch RNG
   fingerprint that ``_write_heartbeat`` computes (and, for reference, what python/numpy
   fingerprints would cost) and the heartbeat flush thread's ``fdatasync``.

Everything runs for the demo model (``CharTransformer``, AdamW) and for a tiny model (a
2-layer MLP of ~10k parameters, same loop) whose step is a fraction of a millisecond, where
the absolute cost decides. Variants are interleaved in rounds (the order rotates per round),
every pilot block starts with a fresh pilot in its own run directory, and the first steps of
each block are not measured. The heartbeat ring (128 slots of one 4 KiB page each) is
pre-filled before a block so the window sees its steady state, not first-touch page faults.

"pilot cost per step" = observe + hook of the same step; the ratio divides it by the
baseline's median step. The end-to-end difference of median steps (pilot − baseline) is
printed too: it includes background-thread interference, but on a 2-core machine shared with
other processes its noise is larger than the effect for the demo model.

Usage: ``.venv/bin/python bench/scheduler.py [--steps 2000] [--demo-steps 160] [--dir DIR]``
(``--steps``: measured steps per variant of the tiny model; ``--demo-steps``: of the demo
model, whose step takes ~60 ms on 2 cores).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import random
import shlex
import sys
import timeit
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter_ns
from typing import Any

import numpy as np
import torch
from scratch import DEFAULT_DIR, scratch_dir
from torch import nn

from ckptpilot import CheckpointPilot, ResumableSampler, load_policy
from ckptpilot.cli.demo import BATCH, CONTEXT, build_demo_job
from ckptpilot.scheduler.adaptive import AdaptiveCheckpointScheduler

POLICY_YAML = """\
scheduler: {{base_interval: 100000, min_interval: 10, max_interval: 100000, young_daly: false}}
observability: {{tensorboard: false, decision_log: {log}}}
"""
ROUNDS = 4
VARIANTS = ("baseline", "log on", "log off", "instrumented")
GOAL_RATIO = 0.01
GOAL_US = 50.0
MSYNC = ("heartbeat flush thread, every 0.2 s: write + fdatasync (GIL released "
         "during the syscall)")


# -- workloads -------------------------------------------------------------------------------

@dataclass
class Workload:
    """A model, its optimizer, LR scheduler and data cursor, and one training step."""

    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    sampler: ResumableSampler
    step: Callable[[], torch.Tensor]
    warmup: int

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, sched: Any,
                batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                classes: int) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:  # the loop body of demo.train_child, up to observe()
        x, y = batch()
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, classes), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        return loss
    return step


def demo_workload(total_steps: int) -> Workload:
    job = build_demo_job(total_steps)
    return Workload("demo CharTransformer", job.model, job.opt, job.sched, job.sampler,
                    lambda: job.train_step()[0], warmup=3)


def tiny_workload(total_steps: int) -> Workload:
    torch.manual_seed(0)
    n, features, hidden, classes = 4096, 64, 128, 16
    data = torch.randn(n, features)
    labels = torch.randint(0, classes, (n,))
    sampler = ResumableSampler(n, seed=0)
    model = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=total_steps,
                                                pct_start=0.1)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        idx = sampler.take(BATCH)
        return data[idx], labels[idx]

    return Workload("tiny MLP", model, opt, sched, sampler,
                    _train_step(model, opt, sched, batch, classes), warmup=50)


# -- timing helpers --------------------------------------------------------------------------

def timed(record: list[int], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with each call's duration (ns) appended to ``record``."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append(perf_counter_ns() - t0)
    return wrapper


def us(values: list[int] | list[float] | np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float64) / 1e3


def p99(values: np.ndarray) -> float:
    return float(np.percentile(values, 99))


@dataclass
class Block:
    """Per-step timings (ns) of one variant, accumulated over its blocks."""

    train: list[int] = field(default_factory=list)  # step up to observe (hook included)
    observe: list[int] = field(default_factory=list)
    hook: list[int] = field(default_factory=list)
    probe: list[bool] = field(default_factory=list)  # the hook probed the grad norm
    parts: dict[str, list[int]] = field(default_factory=dict)

    def part(self, name: str) -> list[int]:
        return self.parts.setdefault(name, [])


def make_pilot(w: Workload, policy_yaml: Path, run_dir: Path) -> CheckpointPilot:
    pilot = CheckpointPilot(load_policy(policy_yaml, run_dir=run_dir), model=w.model,
                            optimizer=w.opt, lr_scheduler=w.sched, data_state=w.sampler)
    pilot.restore()
    return pilot


def attach_timed_hook(pilot: CheckpointPilot, opt: torch.optim.Optimizer, res: Block,
                      live: list[bool]) -> None:
    """Re-register the pilot's post-step hook behind a timer (``close()`` removes it)."""
    inner = pilot._after_optimizer_step
    probe_every = pilot.policy.scheduler.grad.probe_every

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        t0 = perf_counter_ns()
        inner(optimizer, args, kwargs)
        if live[0]:
            res.hook.append(perf_counter_ns() - t0)
            res.probe.append(pilot._optimizer_steps % probe_every == 0)

    assert pilot._hook is not None
    pilot._hook.remove()
    pilot._hook = opt.register_step_post_hook(hook)


def instrument(pilot: CheckpointPilot, res: Block) -> None:
    """Shadow the parts of observe() with timed instance attributes."""
    pilot._decide = timed(res.part("_decide"), pilot._decide)  # type: ignore[method-assign]
    pilot._write_heartbeat = timed(  # type: ignore[method-assign]
        res.part("_write_heartbeat"), pilot._write_heartbeat)
    hb = pilot._heartbeat
    hb.write = timed(res.part("HeartbeatWriter.write"), hb.write)  # type: ignore[method-assign]
    s = pilot.scheduler
    s.measure = timed(res.part("scheduler.measure"), s.measure)  # type: ignore[method-assign]
    s.set_cost_model = timed(  # type: ignore[method-assign]
        res.part("scheduler.set_cost_model"), s.set_cost_model)
    s.decide_from = timed(  # type: ignore[method-assign]
        res.part("scheduler.decide_from"), s.decide_from)
    if pilot._health is not None:
        h = pilot._health
        h.snapshot = timed(res.part("health snapshot"), h.snapshot)  # type: ignore[method-assign]
    t = pilot._telemetry
    t.decision = timed(res.part("telemetry enqueue"), t.decision)  # type: ignore[method-assign]


def prefill_heartbeats(pilot: CheckpointPilot) -> None:
    """Write every slot of the ring once, as a long run has (no first-touch page faults)."""
    for _ in range(pilot._heartbeat.slots):
        pilot._write_heartbeat()


def run_block(w: Workload, variant: str, steps: int, workdir: Path, tag: str,
              res: Block) -> None:
    if variant == "baseline":
        for i in range(w.warmup + steps):
            t0 = perf_counter_ns()
            w.step()
            if i >= w.warmup:
                res.train.append(perf_counter_ns() - t0)
        return
    log = "false" if variant == "log off" else "true"
    policy_yaml = workdir / f"policy-log-{log}.yaml"
    live = [False]
    with make_pilot(w, policy_yaml, workdir / tag) as pilot:
        attach_timed_hook(pilot, w.opt, res, live)
        prefill_heartbeats(pilot)
        for i in range(w.warmup + steps):
            if i == w.warmup:
                live[0] = True
                if variant == "instrumented":
                    instrument(pilot, res)
            t0 = perf_counter_ns()
            loss = w.step()
            t1 = perf_counter_ns()
            decision = pilot.observe(loss)
            t2 = perf_counter_ns()
            if decision.save:
                raise RuntimeError(f"a save at step {decision.step} fell in the window")
            if live[0]:
                res.train.append(t1 - t0)
                res.observe.append(t2 - t1)
        live[0] = False


def run_workload(w: Workload, steps: int, workdir: Path) -> dict[str, Block]:
    results = {v: Block() for v in VARIANTS}
    for _ in range(max(20, w.warmup * 3)):
        w.step()
    per_round = max(1, steps // ROUNDS)
    for r in range(ROUNDS):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for variant in order:
            tag = f"{w.name.split()[0]}-{r}-{variant.replace(' ', '-')}"
            run_block(w, variant, per_round, workdir, tag, results[variant])
    return results


# -- isolated measurements -------------------------------------------------------------------

@dataclass
class Isolated:
    median: float
    p99: float
    mean: float  # timeit


def isolate(fn: Callable[[], Any], n: int) -> Isolated:
    for _ in range(min(n, 200)):
        fn()
    samples = []
    for _ in range(n):
        t0 = perf_counter_ns()
        fn()
        samples.append(perf_counter_ns() - t0)
    mean = timeit.timeit(fn, number=n) / n * 1e6
    arr = us(samples)
    return Isolated(float(np.median(arr)), p99(arr), mean)


def run_isolated(w: Workload, workdir: Path, tag: str) -> dict[str, Isolated]:
    """Each part on its own, on a live pilot (decision log on) after some real steps."""
    out: dict[str, Isolated] = {}
    with make_pilot(w, workdir / "policy-log-true.yaml", workdir / tag) as pilot:
        prefill_heartbeats(pilot)
        loss = torch.tensor(0.0)
        for _ in range(w.warmup + 20):
            loss = w.step()
            pilot.observe(loss)
        value = loss.detach().item()
        policy = pilot.policy
        sched = AdaptiveCheckpointScheduler(policy.scheduler, policy.retention)
        health = pilot._health
        snapshot = health.snapshot() if health is not None else None
        steps = itertools.count(1)
        signals = sched.measure(0, value, None, snapshot)
        grad_norm = pilot.last_grad_norm or 1.0
        grads = [p.grad for g in w.opt.param_groups for p in g["params"] if p.grad is not None]
        decision = pilot.last_decision
        assert decision is not None
        record = {"step": 1, "epoch": 0, "loss": value, "cursor": w.sampler.state_dict(),
                  "lr": [0.003], "lr_scheduler_step": 1,
                  "rng_crc32": {"torch": 1, "python": 2, "numpy": 3}}
        noop: list[int] = []
        wrapped = timed(noop, lambda: None)
        n = 5000
        cases: list[tuple[str, Callable[[], Any], int]] = [
            ("timer: empty call", lambda: None, n),
            ("timer: empty call behind a timing wrapper", wrapped, n),
            ("scheduler.measure (loss only)",
             lambda: sched.measure(next(steps), value, None, snapshot), n),
            ("scheduler.measure (loss + grad probe)",
             lambda: sched.measure(next(steps), value, grad_norm, snapshot), n),
            ("scheduler.set_cost_model", lambda: sched.set_cost_model(None, None, 0.06), n),
            ("scheduler.decide_from (not due)",
             lambda: sched.decide_from(next(steps), signals), n),
        ]
        if health is not None:
            cases.append(("health snapshot", health.snapshot, n))
        cases += [
            ("telemetry enqueue", lambda: pilot._telemetry.decision(decision), n),
            ("_write_heartbeat (record + torch RNG CRC + write)", pilot._write_heartbeat, n),
            ("HeartbeatWriter.write (JSON + CRC + mmap copy)",
             lambda: pilot._heartbeat.write(record), n),
            ("RNG CRC: torch (get_rng_state + crc32)",
             lambda: zlib.crc32(torch.get_rng_state().numpy()), n),
            ("for reference, not in the heartbeat: python RNG CRC",
             lambda: hash(random.getstate()) & 0xFFFFFFFF, n),
            ("for reference, not in the heartbeat: numpy RNG CRC",
             lambda: zlib.crc32(np.random.get_state(legacy=False)["state"]["key"]), n),
            ("loss.detach().item()", lambda: loss.detach().item(), n),
            ("grad-norm probe: get_total_norm (hook)",
             lambda: torch.nn.utils.get_total_norm(grads), 300),
        ]
        for name, fn, count in cases:
            out[name] = isolate(fn, count)
        out[MSYNC] = isolate(lambda: (pilot._heartbeat.write(record),
                                      pilot._heartbeat._map.flush()), 50)
    return out


# -- machine load ----------------------------------------------------------------------------

def cpu_jiffies() -> dict[str, int] | None:
    """Machine-wide CPU time by state (/proc/stat, in clock ticks); None off Linux."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return dict(zip(names, map(int, fields[:len(names)]), strict=True))


def load_line(before: dict[str, int] | None, after: dict[str, int] | None,
              own_seconds: float, wall: float) -> str:
    """How much of the machine this process had: CPU of other processes and hypervisor steal."""
    if before is None or after is None:
        return f"wall time {wall:.0f} s"
    delta = {k: after[k] - before[k] for k in before}
    total = sum(delta.values()) or 1
    tick = os.sysconf("SC_CLK_TCK")
    busy = (delta["user"] + delta["nice"] + delta["system"] + delta["irq"]
            + delta["softirq"]) / tick
    others = max(0.0, busy - own_seconds)
    return (f"wall time {wall:.0f} s; machine CPU busy {busy:.0f} s of "
            f"{total / tick:.0f} s, of which this process {own_seconds:.0f} s and other "
            f"processes {others:.0f} s; hypervisor steal {100 * delta['steal'] / total:.1f} %, "
            f"iowait {100 * delta['iowait'] / total:.1f} %")


# -- report ----------------------------------------------------------------------------------

def fmt_us(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if v < 1000 else f"{v:,.0f}"


def pct(v: float) -> str:
    return f"{v * 100:.3f} %" if v < 0.1 else f"{v * 100:.1f} %"


def summary_rows(w: Workload, res: dict[str, Block]) -> list[str]:
    base = us(res["baseline"].train)
    step_med = float(np.median(base))
    rows = [f"| {w.name} ({w.params:,} params) | baseline: one training step, no pilot | "
            f"{len(base)} | {fmt_us(step_med)} | {fmt_us(p99(base))} | "
            f"{fmt_us(float(base.mean()))} | - | - | - |"]
    for variant in ("log on", "log off"):
        b = res[variant]
        cost = us(b.observe) + us(b.hook)
        med, mean = float(np.median(cost)), float(cost.mean())
        ok_ratio = "yes" if med / step_med < GOAL_RATIO else "**no**"
        ok_abs = "yes" if med < GOAL_US else "**no**"
        rows.append(
            f"| {w.name} | pilot cost/step (observe + hook), decision log {variant[4:]} | "
            f"{len(cost)} | {fmt_us(med)} | {fmt_us(p99(cost))} | {fmt_us(mean)} | "
            f"{pct(med / step_med)} (mean {pct(mean / step_med)}) | {ok_ratio} | {ok_abs} |")
    for variant in ("log on", "log off"):
        b = res[variant]
        e2e = us(b.train) + us(b.observe)
        delta = float(np.median(e2e)) - step_med
        rows.append(
            f"| {w.name} | end to end: step with pilot, decision log {variant[4:]} "
            f"(Δ median vs baseline {delta:+.1f} µs) | {len(e2e)} | "
            f"{fmt_us(float(np.median(e2e)))} | {fmt_us(p99(e2e))} | "
            f"{fmt_us(float(e2e.mean()))} | {pct(delta / step_med)} | - | - |")
    return rows


BREAKDOWN = [
    # (label, in-loop source, isolated key)
    ("hook, plain step", "hook-plain", None),
    ("hook, grad-norm probe step (1 in probe_every=10)", "hook-probe",
     "grad-norm probe: get_total_norm (hook)"),
    ("observe() total (instrumented; incl. wrapper overhead)", "observe", None),
    ("&nbsp;&nbsp;_decide", "_decide", None),
    ("&nbsp;&nbsp;&nbsp;&nbsp;scheduler.measure", "scheduler.measure",
     "scheduler.measure (loss only)"),
    ("&nbsp;&nbsp;&nbsp;&nbsp;scheduler.set_cost_model", "scheduler.set_cost_model",
     "scheduler.set_cost_model"),
    ("&nbsp;&nbsp;&nbsp;&nbsp;scheduler.decide_from", "scheduler.decide_from",
     "scheduler.decide_from (not due)"),
    ("&nbsp;&nbsp;&nbsp;&nbsp;health snapshot", "health snapshot", "health snapshot"),
    ("&nbsp;&nbsp;&nbsp;&nbsp;telemetry enqueue", "telemetry enqueue", "telemetry enqueue"),
    ("&nbsp;&nbsp;&nbsp;&nbsp;rest of _decide (cost dict, decision bookkeeping)",
     "decide-rest", None),
    ("&nbsp;&nbsp;_write_heartbeat", "_write_heartbeat",
     "_write_heartbeat (record + torch RNG CRC + write)"),
    ("&nbsp;&nbsp;&nbsp;&nbsp;HeartbeatWriter.write", "HeartbeatWriter.write",
     "HeartbeatWriter.write (JSON + CRC + mmap copy)"),
    ("&nbsp;&nbsp;&nbsp;&nbsp;rest of _write_heartbeat (record dict + torch RNG CRC)",
     "heartbeat-rest", None),
    ("&nbsp;&nbsp;rest of observe (loss.item, step clock, checks)", "observe-rest",
     "loss.detach().item()"),
]
ISOLATED_ONLY = [
    "RNG CRC: torch (get_rng_state + crc32)",
    "for reference, not in the heartbeat: python RNG CRC",
    "for reference, not in the heartbeat: numpy RNG CRC",
    "scheduler.measure (loss + grad probe)",
    MSYNC,
    "timer: empty call",
    "timer: empty call behind a timing wrapper",
]


def in_loop(res: dict[str, Block], key: str) -> np.ndarray:
    b = res["instrumented"]
    if key in ("hook-plain", "hook-probe"):
        want = key == "hook-probe"
        hooks = [h for variant in ("log on", "log off", "instrumented")
                 for h, p in zip(res[variant].hook, res[variant].probe, strict=True)
                 if p == want]
        return us(hooks)
    if key == "observe":
        return us(b.observe)
    if key == "decide-rest":
        subs = ("scheduler.measure", "scheduler.set_cost_model", "scheduler.decide_from",
                "health snapshot", "telemetry enqueue")
        return us(b.parts["_decide"]) - sum(us(b.parts[k]) for k in subs if k in b.parts)
    if key == "heartbeat-rest":
        return us(b.parts["_write_heartbeat"]) - us(b.parts["HeartbeatWriter.write"])
    if key == "observe-rest":
        return us(b.observe) - us(b.parts["_decide"]) - us(b.parts["_write_heartbeat"])
    return us(b.parts.get(key, []))


def breakdown_table(demo_res: dict[str, Block],
                    tiny_res: dict[str, Block], iso: dict[str, Isolated]) -> str:
    step_med = float(np.median(us(demo_res["baseline"].train)))
    lines = ["| part | demo in-loop median µs | p99 µs | tiny in-loop median µs | p99 µs | "
             "isolated median µs | p99 µs | timeit mean µs | share of a demo step "
             "(in-loop median) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, key, iso_key in BREAKDOWN:
        d, t = in_loop(demo_res, key), in_loop(tiny_res, key)
        i = iso.get(iso_key) if iso_key else None
        cells = [fmt_us(float(np.median(d))) if len(d) else "-",
                 fmt_us(p99(d)) if len(d) else "-",
                 fmt_us(float(np.median(t))) if len(t) else "-",
                 fmt_us(p99(t)) if len(t) else "-",
                 fmt_us(i.median if i else None), fmt_us(i.p99 if i else None),
                 fmt_us(i.mean if i else None),
                 pct(float(np.median(d)) / step_med) if len(d) else "-"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for key in ISOLATED_ONLY:
        i = iso.get(key)
        if i is None:
            continue
        share = "-" if key == MSYNC else pct(i.median / step_med)  # not per step
        lines.append(f"| {key} (isolated only) | - | - | - | - | {fmt_us(i.median)} | "
                     f"{fmt_us(i.p99)} | {fmt_us(i.mean)} | {share} |")
    return "\n".join(lines)


def run(args: argparse.Namespace, workdir: Path) -> None:
    for log in ("true", "false"):
        (workdir / f"policy-log-{log}.yaml").write_text(POLICY_YAML.format(log=log))
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))  # as demo.train_child
    print(f"command: {shlex.join(sys.orig_argv)}")
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs (torch threads {torch.get_num_threads()}), "
          f"CUDA available: {torch.cuda.is_available()}, "
          f"load average at start {os.getloadavg()[0]:.2f}")
    print(f"temp dir: {workdir}")
    print("policy: " + POLICY_YAML.format(log="true|false").replace("\n", " ").strip())

    jiffies0, times0, wall0 = cpu_jiffies(), os.times(), perf_counter_ns()
    margin = 4 * ROUNDS * 60 + 500
    demo = demo_workload(args.demo_steps * len(VARIANTS) + margin)
    tiny = tiny_workload(args.steps * len(VARIANTS) + margin * 10)
    print(f"demo: CharTransformer {demo.params:,} params, AdamW, batch {BATCH} x context "
          f"{CONTEXT}; {args.demo_steps} measured steps per variant")
    print(f"tiny: MLP Linear(64,128)-ReLU-Linear(128,16), {tiny.params:,} params, AdamW, "
          f"batch {BATCH}; {args.steps} measured steps per variant")
    print(f"variants {', '.join(VARIANTS)}; {ROUNDS} interleaved rounds, order rotated")

    demo_res = run_workload(demo, args.demo_steps, workdir)
    tiny_res = run_workload(tiny, args.steps, workdir)
    iso = run_isolated(demo, workdir, "isolated-demo")
    load_end = os.getloadavg()[0]
    times1 = os.times()
    machine = load_line(jiffies0, cpu_jiffies(),
                        times1.user + times1.system - times0.user - times0.system,
                        (perf_counter_ns() - wall0) / 1e9)

    print()
    print("Per-step pilot cost against one training step (µs; ratio = pilot cost median / "
          "baseline step median; goals: < 1 % and < 50 µs):")
    print()
    print("| model | measurement | steps | median µs | p99 µs | mean µs | ratio to one step "
          "| < 1 % | < 50 µs |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for line in summary_rows(demo, demo_res) + summary_rows(tiny, tiny_res):
        print(line)
    print()
    print("Breakdown (in-loop: instrumented variant, decision log on; hook rows pool all pilot "
          "variants; isolated: one part called alone on a live pilot of the demo model):")
    print()
    print(breakdown_table(demo_res, tiny_res, iso))
    print()
    probes = sum(sum(b.probe) for b in demo_res.values())
    print(f"hook calls measured: demo {sum(len(b.hook) for b in demo_res.values())} "
          f"({probes} probes), tiny {sum(len(b.hook) for b in tiny_res.values())} "
          f"({sum(sum(b.probe) for b in tiny_res.values())} probes); load average at end "
          f"{load_end:.2f}")
    print(machine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--steps", type=int, default=2000,
                        help="measured steps per variant, tiny model (default 2000)")
    parser.add_argument("--demo-steps", type=int, default=160,
                        help="measured steps per variant, demo model (default 160)")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                        help=f"a temp dir is made (and removed) under it; default {DEFAULT_DIR}")
    args = parser.parse_args()
    if args.steps < ROUNDS * 10 or args.demo_steps < ROUNDS * 10:
        parser.error(f"--steps and --demo-steps must be at least {ROUNDS * 10}")
    with scratch_dir(args.dir, "scheduler-") as workdir:
        run(args, workdir)


if __name__ == "__main__":
    main()
