"""``ckptpilot demo``: the main job. Trains, gets killed for real, recovers, reports.

The parent process (``run_demo``) never trains: it starts a training child, watches its
progress on a pipe, SIGKILLs it mid-run, starts a second child that restores from the
checkpoints and finishes, then prints a summary. The child (``python -m ckptpilot.cli.demo``)
trains a small character-level transformer on the source text of the Python standard library
(no downloads) with a ``CheckpointPilot`` and reports JSON lines on stdout.

At about a third of the run an operator's mistake is played out: the learning rate is raised
:data:`BUMP` times for two steps, and the loss spikes. With the demo's policy (rollback on)
the pilot rolls the run back to the checkpoint before the spike and skips its batches; the
bump is not repeated once the run has rolled back (``pilot.rollbacks``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from ckptpilot.sampler import ResumableSampler

DEMO_MARKER = ".ckptpilot-demo"
DEMO_POLICY = """\
# Written by `ckptpilot demo` (no --config given): the reference policy with a short
# interval so that a demo-sized run saves several times, and instability rollback on.
scheduler: {base_interval: 40, min_interval: 10, max_interval: 500}
rollback: {enabled: true}
"""
CONTEXT = 64
PROGRESS_SECONDS = 5.0
"""The longest the demo stays silent."""
BATCH = 16
BUMP = 100.0
"""The learning-rate multiplier of the demo's two-step mistake (AdamW: the loss goes from
~2.3 to above 6 and takes tens of steps to come back)."""
BUMP_MIN_STEPS = 100
"""Runs shorter than this have no bump: the spike needs a baseline and a checkpoint before it."""


# -- the training child --------------------------------------------------------------------

def stdlib_text(max_bytes: int = 2_000_000) -> torch.Tensor:
    """Bytes of the standard library's own source, in a fixed order, as a uint8 tensor."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < CONTEXT * 4:
        raise RuntimeError(f"found only {total} bytes of Python source under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


class CharTransformer(nn.Module):
    """A small byte-level causal transformer: enough to show a real loss curve in seconds."""

    def __init__(self, vocab: int = 256, dim: int = 128, layers: int = 2, heads: int = 4,
                 context: int = CONTEXT, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.tok(idx) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


@dataclass
class DemoJob:
    """The demo's model, optimizer, schedule and data cursor, seeded: the same every time."""

    text: torch.Tensor
    sampler: ResumableSampler
    model: CharTransformer
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    offsets: torch.Tensor

    def train_step(self, lr_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """One step up to the pilot: returns (loss, grad norm before clipping).

        ``lr_factor`` scales this step's learning rate only: the schedule sets the next one.
        """
        windows = self.text[self.sampler.take(BATCH)[:, None] + self.offsets].long()
        logits = self.model(windows[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 256),
                                           windows[:, 1:].reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        if lr_factor != 1.0:
            for group in self.opt.param_groups:
                group["lr"] *= lr_factor
        self.opt.step()
        self.sched.step()
        return loss, grad_norm


def build_demo_job(steps: int) -> DemoJob:
    torch.manual_seed(0)
    text = stdlib_text()
    model = CharTransformer(dim=96)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps,
                                                pct_start=0.1)
    return DemoJob(text, ResumableSampler(len(text) - CONTEXT - 1, seed=0, batch_size=BATCH),
                   model, opt, sched, torch.arange(CONTEXT + 1))


def _emit(out: TextIO, event: str, **fields: Any) -> None:
    out.write(json.dumps({"event": event, **fields}) + "\n")
    out.flush()


def bump_step(steps: int) -> int | None:
    """The first of the two steps whose learning rate the demo raises (None: no bump)."""
    return int(steps * 0.35) if steps >= BUMP_MIN_STEPS else None


def _decision_event(decision: Any) -> dict[str, Any]:
    return {"step": decision.step, "save": decision.save,
            "level": decision.level.value if decision.level else None,
            "interval": decision.interval, "score": decision.score,
            "signals": decision.signals, "retention": decision.retention_class.value,
            "reason": decision.reason, "emergency": decision.emergency,
            "spike_onset": decision.spike_onset, "rollback_to": decision.rollback_to}


def train_child(run_dir: Path, config: Path, steps: int) -> None:
    """Train with a pilot until ``steps``; restores first, so a second start resumes."""
    from ckptpilot import CheckpointPilot, load_policy

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    job = build_demo_job(steps)
    out = sys.stdout
    pilot = CheckpointPilot(load_policy(config, run_dir=run_dir), model=job.model,
                            optimizer=job.opt, lr_scheduler=job.sched, data_state=job.sampler)
    start = pilot.restore()
    rec = pilot.last_recovery
    assert rec is not None
    _emit(out, "restored", step=start, source=rec.source.value, seconds=rec.seconds,
          location=rec.location, skipped=[s.reason for s in rec.skipped])
    from torch.utils.tensorboard import SummaryWriter

    tb = SummaryWriter(log_dir=str(pilot.run_dir / "tensorboard"))
    reported = 0
    bump = bump_step(steps)
    step = start
    while step < steps:
        step += 1
        mistake = bump is not None and bump <= step <= bump + 1 and not pilot.rollbacks
        loss, grad_norm = job.train_step(BUMP if mistake else 1.0)
        decision = pilot.observe(loss, grad_norm=grad_norm)
        value = loss.item()
        tb.add_scalar("train/loss", value, step)
        _emit(out, "step", step=step, loss=value, lr_factor=BUMP if mistake else 1.0)
        if decision.save or decision.score > 0 or decision.spike_onset is not None:
            _emit(out, "decision", **_decision_event(decision))
        if decision.rollback_to is not None:
            event = pilot.rollbacks[-1]
            _emit(out, "rollback", step=event.step, onset=event.onset, to=event.to_step,
                  skipped=event.skipped_batches, reason=event.reason)
            step = pilot.step
        for record in pilot.saves[reported:]:
            _emit(out, "save", step=record.step, bytes=record.bytes,
                  stall=record.stall_seconds, persist=record.persist_seconds)
        reported = len(pilot.saves)
    pilot.close()
    tb.close()
    for record in pilot.saves[reported:]:
        _emit(out, "save", step=record.step, bytes=record.bytes, stall=record.stall_seconds,
              persist=record.persist_seconds)
    _emit(out, "done", step=steps, stats=dict(pilot.stats()))


# -- the parent ----------------------------------------------------------------------------

@dataclass
class _Run:
    restored: dict[str, Any] = field(default_factory=dict)
    last_step: int = 0
    saves: list[dict[str, Any]] = field(default_factory=list)
    losses: dict[int, float] = field(default_factory=dict)
    timeline: list[tuple[int, float, float]] = field(default_factory=list)  # step, loss, lr x
    decisions: list[dict[str, Any]] = field(default_factory=list)
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    stats: dict[str, Any] = field(default_factory=dict)
    returncode: int | None = None


def _events(proc: subprocess.Popen[str]) -> Iterator[dict[str, Any]]:
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.strip()
        if line.startswith("{"):
            yield json.loads(line)


def _child(run_dir: Path, config: Path, steps: int, kill_at: int | None, run: _Run,
           label: str, total: int) -> None:
    cmd = [sys.executable, "-m", "ckptpilot.cli.demo", "--child", "--run-dir", str(run_dir),
           "--config", str(config), "--steps", str(steps)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1)
    t0 = time.monotonic()
    ticker = _Ticker(label, run, total)
    try:
        for ev in _events(proc):
            ticker.heard()
            kind = ev["event"]
            if kind == "restored":
                run.restored = ev
                src = ev["source"]
                print(f"[{label}] started; restored step {ev['step']} from {src}"
                      + (f" in {ev['seconds']:.3f} s" if src != "none" else " (fresh run)"))
            elif kind == "step":
                run.last_step = ev["step"]
                run.losses[ev["step"]] = ev["loss"]
                run.timeline.append((ev["step"], ev["loss"], ev["lr_factor"]))
                if ev["lr_factor"] != 1.0:
                    print(f"[{label}] step {ev['step']:>5}: learning rate x{ev['lr_factor']:g} "
                          f"(the operator's mistake), loss {ev['loss']:.3f}")
                if ev["step"] % 50 == 0 or ev["step"] == steps or ticker.due():
                    ticker.printed()
                    rate = (ev["step"] - run.restored.get("step", 0)) / (time.monotonic() - t0)
                    print(f"[{label}] step {ev['step']:>5}/{total}  loss {ev['loss']:.3f}  "
                          f"{rate:5.1f} steps/s  checkpoints written {len(run.saves)}")
                if kill_at is not None and ev["step"] >= kill_at and (
                        _saved_before(run, kill_at) or ev["step"] >= steps - 1):
                    proc.send_signal(signal.SIGKILL)
                    late = "" if ev["step"] == kill_at else (
                        " (waited for the checkpoints before step "
                        f"{kill_at} to become durable)")
                    print(f"[{label}] SIGKILL sent at step {ev['step']}{late}")
                    break
            elif kind == "decision":
                run.decisions.append(ev)
                _print_decision(label, ev, run)
            elif kind == "rollback":
                run.rollbacks.append(ev)
                print(f"[{label}] step {ev['step']:>5}: ROLLBACK to step {ev['to']} "
                      f"({ev['reason']}); skipped {ev['skipped']} batches")
            elif kind == "save":
                run.saves.append(ev)
            elif kind == "done":
                run.done = True
                run.stats = ev["stats"]
    finally:
        ticker.stop()
        run.returncode = proc.wait()


class _Ticker:
    """A progress line at least every :data:`PROGRESS_SECONDS`, even while the child prints
    nothing (importing torch, restoring, a busy machine's slow steps): a newcomer should never
    wonder whether the demo hangs."""

    def __init__(self, label: str, run: _Run, total: int) -> None:
        self._label, self._run, self._total = label, run, total
        self._last = time.monotonic()
        self._started = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="demo-progress", daemon=True)
        self._thread.start()

    def heard(self) -> None:
        self._started = True

    def due(self) -> bool:
        return time.monotonic() - self._last >= PROGRESS_SECONDS - 1.0

    def printed(self) -> None:
        self._last = time.monotonic()

    def _loop(self) -> None:
        while not self._done.wait(0.5):
            if time.monotonic() - self._last < PROGRESS_SECONDS:
                continue
            self.printed()
            if not self._started:
                print(f"[{self._label}] starting: importing torch, building the model, "
                      "looking for a checkpoint to restore", flush=True)
            else:
                print(f"[{self._label}] step {self._run.last_step:>5}/{self._total}  "
                      "(still working: this step is slow on a busy machine)", flush=True)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def _saved_before(run: _Run, step: int) -> bool:
    """Whether every save decided before ``step`` is durable: the demo's crash then always
    tells the same story (recovery to the last checkpoint before it), however slow the box."""
    done = {s["step"] for s in run.saves}
    return all(d["step"] in done for d in run.decisions if d["save"] and d["step"] < step)


def _print_decision(label: str, ev: dict[str, Any], run: _Run) -> None:
    """A save, a spike, or a score that moved by 0.1 or more since the last line printed."""
    shown = [d for d in run.decisions[:-1] if d.get("printed")]
    moved = not shown or abs(ev["score"] - shown[-1]["score"]) >= 0.1
    if not (ev["save"] or ev["spike_onset"] is not None or moved):
        return
    ev["printed"] = True
    sig = ev["signals"]
    what = (f"{ev['level']:<5} checkpoint" if ev["save"]
            else "spike confirmed " if ev["spike_onset"] is not None else "no save        ")
    print(f"[{label}] step {ev['step']:>5}: {what}, interval {ev['interval']:>3}, score "
          f"{ev['score']:.2f} (loss {sig['loss']:.2f} grad {sig['grad']:.2f} system "
          f"{sig['system']:.2f}), {ev['retention']}: {ev['reason']}")


def _trigger(ev: dict[str, Any]) -> str:
    """What caused a save, from its reason: ``interval: ...``, ``trigger: ...`` and so on."""
    if ev["emergency"]:
        return "emergency"
    head = ev["reason"].split(":", 1)[0].strip()
    return "score" if head == "trigger" else head


def _saves_by_trigger(decisions: list[dict[str, Any]]) -> str:
    saves = [d for d in decisions if d["save"]]
    counts: dict[str, int] = {}
    for ev in saves:
        counts[_trigger(ev)] = counts.get(_trigger(ev), 0) + 1
    for name in ("interval", "score", "emergency"):
        counts.setdefault(name, 0)
    organs = sum(d["level"] == "organ" and not d["emergency"] for d in saves)
    parts = ", ".join(f"{name} {n}" for name, n in counts.items())
    return f"{parts}; {organs} of them organs (organ_every)"


def _spike_story(runs: list[_Run], policy_rollback: bool) -> tuple[str, str]:
    timeline = [t for run in runs for t in run.timeline]
    bumped = [i for i, (_, _, factor) in enumerate(timeline) if factor != 1.0]
    if not bumped:
        return "none (runs of 100 steps or more raise the LR at a third of the run)", "none"
    first = bumped[0]
    before = timeline[first - 1][1] if first else None
    peak = max((loss for _, loss, _ in timeline[first + 1:first + 6]), default=math.nan)
    spike = (f"LR x{BUMP:g} at steps {timeline[first][0]}-{timeline[bumped[-1]][0]}: loss "
             + (f"{before:.2f} → " if before is not None else "") + f"up to {peak:.2f}")
    rollbacks = [r for run in runs for r in run.rollbacks]
    if rollbacks:
        r = rollbacks[0]
        return spike, (f"confirmed at step {r['step']} (onset {r['onset']}); back to step "
                       f"{r['to']}, {r['skipped']} batches skipped; {len(rollbacks)} rollback(s)")
    spikes = [d for run in runs for d in run.decisions if d["spike_onset"] is not None]
    if not policy_rollback:
        return spike, ("off in this policy" + (f"; spike confirmed at step {spikes[0]['step']}, "
                                               "the save before it kept for good (critical)"
                                               if spikes else "; no spike confirmed"))
    return spike, "no spike confirmed"


def _interval_story(configured: int, stats: dict[str, Any]) -> str:
    base = stats.get("base_interval")
    mtbf = stats.get("mtbf_seconds")
    if mtbf is None or base is None or base >= configured:
        return f"base {configured} steps (no failure history caps it)"
    return (f"base {configured} → {base} steps after the crash: Young–Daly with an MTBF of "
            f"{mtbf:.0f} s (failure ledger), a {stats['median_stall_seconds'] * 1e3:.1f} ms "
            f"save cost and {stats['step_seconds'] * 1e3:.0f} ms steps")


def _prepare_run_dir(run_dir: Path) -> None:
    if run_dir.exists() and any(run_dir.iterdir()):
        if not (run_dir / DEMO_MARKER).exists():
            raise DemoError(f"--run-dir {run_dir} is not empty and was not made by the demo; "
                            "choose another directory")
        import shutil

        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / DEMO_MARKER).write_text("made by `ckptpilot demo`; removed by its next run\n")


class DemoError(Exception):
    """Bad demo options or a failed demo child; the CLI prints it on one line."""


def run_demo(*, steps: int, run_dir: Path, config: Path | None) -> int:
    from ckptpilot.policy import load_policy

    if steps < 20:
        raise DemoError(f"--steps must be at least 20 (got {steps})")
    if config is not None:
        load_policy(config, run_dir=run_dir)
    _prepare_run_dir(run_dir)
    if config is None:
        config = run_dir / "demo-policy.yaml"
        config.write_text(DEMO_POLICY)
    policy = load_policy(config, run_dir=run_dir)
    interval = policy.scheduler.base_interval
    bump = bump_step(steps)
    kill_at = max(int(steps * 0.6), interval + interval // 2)
    if kill_at % interval == 0:
        kill_at += interval // 2
    kill_at = min(kill_at, steps - 1)
    if bump is not None:
        kill_at = max(kill_at, min(steps - 1, bump + interval + interval // 2))
    if kill_at <= interval:
        print(f"note: with {steps} steps and a {interval}-step interval no checkpoint exists "
              "before the crash; the second run starts over")
    print(f"ckptpilot demo: {steps} steps of a char-level transformer on stdlib text, "
          f"checkpoint every {interval} steps, SIGKILL near step {kill_at}"
          + (f", learning rate x{BUMP:g} at steps {bump}-{bump + 1}" if bump else ""))
    print(f"run dir: {run_dir}")
    t0 = time.monotonic()
    first, second = _Run(), _Run()
    _child(run_dir, config, steps, kill_at, first, "run 1", steps)
    if first.returncode != -signal.SIGKILL:
        raise DemoError(f"the first training child exited with {first.returncode} "
                        "instead of being killed")
    _child(run_dir, config, steps, None, second, "run 2", steps)
    if second.returncode != 0 or not second.done:
        raise DemoError(f"the resumed training child failed (exit code {second.returncode})")
    wall = time.monotonic() - t0
    restored = second.restored
    saves = first.saves + second.saves
    stalls = [s["stall"] for s in saves]
    replayed = sorted(set(first.losses) & set(second.losses))
    identical = sum(first.losses[s] == second.losses[s] for s in replayed)
    spike, rollback = _spike_story([first, second], policy.rollback.enabled)
    rolled = sum(r["step"] - r["to"] for r in first.rollbacks + second.rollbacks)
    rows = [
        ("steps trained", f"{steps} (+{first.last_step - restored['step']} re-run after "
                          f"the crash, +{rolled} after the rollback)"),
        ("loss", f"{first.losses[1]:.3f} at step 1, {second.losses[steps]:.3f} at step {steps}"),
        ("replayed steps", f"{identical}/{len(replayed)} losses bit-identical to the run "
                           "before the crash"),
        ("checkpoints saved", f"{len(saves)} (run 1: {len(first.saves)}, "
                              f"run 2: {len(second.saves)})"),
        ("bytes written", f"{sum(s['bytes'] for s in saves) / 1e6:.1f} MB"),
        ("median stall per save", f"{statistics.median(stalls) * 1e3:.1f} ms"
         if stalls else "n/a"),
        ("saves by trigger", _saves_by_trigger(first.decisions + second.decisions)),
        ("loss spike", spike),
        ("rollback", rollback),
        ("crash", f"SIGKILL of the training process at step {first.last_step}"),
        ("recovery source", f"{restored['source']} ({restored['location']})"),
        ("recovered step", str(restored["step"])),
        ("recovery seconds", f"{restored['seconds']:.3f}"),
        ("steps lost", str(first.last_step - restored["step"])),
        ("adaptive interval", _interval_story(interval, second.stats)),
        ("wall time", f"{wall:.1f} s"),
        ("tensorboard", f"tensorboard --logdir {run_dir / 'tensorboard'}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\nsummary")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    if identical != len(replayed):
        raise DemoError(f"resume was not bit-exact: {len(replayed) - identical} replayed "
                        "steps have a different loss")
    if not math.isfinite(second.losses[steps]):
        raise DemoError("training diverged (non-finite loss)")
    return 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ckptpilot.cli.demo")
    p.add_argument("--child", action="store_true", required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    a = p.parse_args(argv)
    train_child(a.run_dir, a.config, a.steps)


if __name__ == "__main__":
    main()
