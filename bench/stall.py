"""Training-thread stall of a ckptpilot organ save, against a synchronous ``torch.save``.

The promise of the pilot (SPEC §3) is that the training thread pays only for the snapshot — a
copy of the complete state into host memory — while encoding, hashing, writing and fsync run
on a background thread. This script checks that promise on a ~``--gb`` GB training state (fp32
``Linear`` layers; parameters + AdamW ``exp_avg`` + ``exp_avg_sq``, after one real AdamW step)
and measures, in the same run and on the same disk:

1. the stall of ``pilot.save()`` (first save, which allocates its host buffers, and the
   steady state, which reuses the buffer pool), plus the background persist time and bytes
   from ``pilot.saves``;
2. the stall of a synchronous ``torch.save`` of model + optimizer state dicts, with and
   without an ``os.fsync`` of the file (the pilot fsyncs what it writes);
3. restore into fresh model/optimizer objects: ``pilot.restore()`` (which re-hashes the
   archive before loading it) against ``torch.load`` + ``load_state_dict``, each checked
   bit for bit against the saved state. The page cache is not dropped (that needs root), so
   both read files that were just written. The pilot's AdamW moments stay in a private
   mapping of the archive (safetensors ``load_file``), so their copy is paid at the first
   write, i.e. the next ``optimizer.step``, outside this timing;
4. peak extra host memory of each save variant, each in a fresh subprocess: peak RSS
   (``ru_maxrss``) minus the RSS right after building model + optimizer. The high-water mark
   is reset after the build (``/proc/self/clear_refs``) so that the backward pass, whose
   gradients coexist with the optimizer state, does not mask the save. The subprocesses are
   started before the parent builds its own state because ``ru_maxrss`` of a freshly
   exec'ed process starts at the RSS of the process that spawned it.

Ratios in the table are baseline/pilot: for times, above 1 means the pilot costs less.
``os.sync()`` runs (untimed) before every timed save so that write-back of an earlier
measurement does not land in a later one, and every save replaces the previous save's output
of its variant (deleted untimed, before the save): each variant then writes into page cache
freed by its previous save. On a VM whose memory the host backs lazily, writing
into memory the guest never touched costs several times more (2-2.5 s/GB on the machine of
bench/RESULTS.md), which would otherwise penalise whichever variant holds more files.

Usage: ``.venv/bin/python bench/stall.py [--gb 1.0] [--dir DIR] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import resource
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import psutil
import torch
from scratch import DEFAULT_DIR, scratch_dir

from ckptpilot import CheckpointPilot, SaveRecord, load_policy

MAX_WIDTH = 4096
BYTES_PER_PARAM = 12  # fp32 parameter + AdamW exp_avg + exp_avg_sq
POLICY_YAML = """\
scheduler: {base_interval: 500, min_interval: 10, max_interval: 500}
observability: {tensorboard: false, decision_log: false}
"""

Model = torch.nn.Sequential
State = tuple[Model, torch.optim.AdamW]


@dataclass(frozen=True)
class Layout:
    """``layers`` square ``Linear(width, width)`` layers (with bias)."""

    width: int
    layers: int

    @classmethod
    def for_gb(cls, gb: float) -> Layout:
        params = gb * 1e9 / BYTES_PER_PARAM
        per_layer = MAX_WIDTH * (MAX_WIDTH + 1)
        if params < per_layer:
            return cls(width=max(8, math.isqrt(int(params))), layers=1)
        return cls(width=MAX_WIDTH, layers=round(params / per_layer))

    @property
    def params(self) -> int:
        return self.layers * self.width * (self.width + 1)


def build_state(layout: Layout) -> State:
    """A seeded model and its AdamW optimizer after one real step (gradients freed)."""
    torch.manual_seed(0)
    model = Model(*(torch.nn.Linear(layout.width, layout.width) for _ in range(layout.layers)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, layout.width)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def fresh_state(layout: Layout) -> State:
    """Model and optimizer of the same shapes, uninitialised and without optimizer state."""
    with torch.device("meta"):
        model = Model(*(torch.nn.Linear(layout.width, layout.width)
                        for _ in range(layout.layers)))
    model = model.to_empty(device="cpu")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def state_nbytes(state: State) -> int:
    model, opt = state
    tensors = [*model.state_dict().values(),
               *(v for s in opt.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor))]
    return sum(t.numel() * t.element_size() for t in tensors)


def assert_same(restored: State, reference: State) -> None:
    """The restore must reproduce every parameter and optimizer tensor bit for bit."""
    (model, opt), (ref_model, ref_opt) = restored, reference
    for (name, t), ref in zip(model.state_dict().items(), ref_model.state_dict().values(),
                              strict=True):
        if not torch.equal(t, ref):
            raise AssertionError(f"restored model/{name} differs from the saved one")
    for p, ref_p in zip(model.parameters(), ref_model.parameters(), strict=True):
        for key, ref_v in ref_opt.state[ref_p].items():
            if not torch.equal(opt.state[p][key], ref_v):
                raise AssertionError(f"restored optimizer {key} differs from the saved one")


def make_pilot(policy_yaml: Path, run_dir: Path, state: State) -> CheckpointPilot:
    policy = load_policy(policy_yaml, run_dir=run_dir)
    return CheckpointPilot(policy, model=state[0], optimizer=state[1], run_dir=run_dir)


def torch_save(state: State, path: Path, *, fsync: bool) -> float:
    """Seconds a synchronous ``torch.save`` (optionally + fsync) blocks its caller; an
    existing ``path`` is deleted first (untimed), so the save writes a new file."""
    model, opt = state
    path.unlink(missing_ok=True)
    os.sync()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - t0


def pilot_saves(state: State, policy_yaml: Path, run_dir: Path,
                repeats: int) -> tuple[list[float], list[SaveRecord]]:
    """Stall of each ``pilot.save()``, with the previous save persisted before the next.

    The previous archive is deleted before each save (untimed), as ``torch_save`` deletes
    its previous file, so that only the newest archive exists.
    """
    stalls = []
    with make_pilot(policy_yaml, run_dir, state) as pilot:
        for _ in range(repeats):
            pilot.observe()  # a new step boundary: a save of an already saved step is a no-op
            if pilot.saves:
                shutil.rmtree(pilot.saves[-1].location)
            os.sync()
            t0 = time.perf_counter()
            started = pilot.save(reason="bench")
            stalls.append(time.perf_counter() - t0)
            if not started:
                raise RuntimeError(f"pilot.save() at step {pilot.step} did not start a save")
            pilot.flush()
        records = sorted(pilot.saves, key=lambda r: r.step)
    return stalls, records


def pilot_restore(layout: Layout, policy_yaml: Path, run_dir: Path) -> tuple[float, State]:
    state = fresh_state(layout)
    with make_pilot(policy_yaml, run_dir, state) as pilot:
        t0 = time.perf_counter()
        pilot.restore()
        return time.perf_counter() - t0, state


def torch_restore(layout: Layout, path: Path) -> tuple[float, State]:
    model, opt = state = fresh_state(layout)
    t0 = time.perf_counter()
    loaded = torch.load(path, weights_only=True)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    return time.perf_counter() - t0, state


def child_main(variant: str, gb: float, workdir: Path) -> None:
    """Hidden ``--child`` mode: one save variant in a fresh process; prints a JSON line."""
    state = build_state(Layout.for_gb(gb))
    gc.collect()
    base = psutil.Process().memory_info().rss
    Path("/proc/self/clear_refs").write_text("5")  # reset the RSS high-water mark to now
    if variant == "pilot":
        policy_yaml = workdir / "policy.yaml"
        with make_pilot(policy_yaml, workdir / "child-pilot", state) as pilot:
            pilot.observe()
            pilot.save(reason="bench")
    else:
        torch_save(state, workdir / "child-torch.pt", fsync=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    # The peak may read a few KiB under ``base`` when memory was freed after measuring it.
    print(json.dumps({"extra": max(0, peak - base)}))


def peak_extra(variant: str, gb: float, workdir: Path) -> int:
    cmd = [sys.executable, __file__, "--gb", str(gb), "--dir", str(workdir), "--child", variant]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} memory subprocess failed:\n{done.stderr}")
    return int(json.loads(done.stdout.splitlines()[-1])["extra"])


def ratio(baseline: float, pilot: float) -> str:
    return f"{baseline / pilot:.2f}x" if pilot > 0 else "n/a"


def table(rows: list[tuple[str, float, float, Callable[[float], str]]]) -> str:
    lines = ["| measurement | pilot | baseline | ratio (baseline/pilot) |",
             "|---|---:|---:|---:|"]
    lines += [f"| {name} | {fmt(p)} | {fmt(b)} | {ratio(b, p)} |" for name, p, b, fmt in rows]
    return "\n".join(lines)


def seconds(v: float) -> str:
    return f"{v:.3f} s"


def gigabytes(v: float) -> str:
    return f"{v / 1e9:.3f} GB"


def times(v: float) -> str:
    return f"{v:.2f}x"


def run(args: argparse.Namespace, workdir: Path) -> None:
    layout = Layout.for_gb(args.gb)
    policy_yaml = workdir / "policy.yaml"
    policy_yaml.write_text(POLICY_YAML)
    max_pending = load_policy(policy_yaml).async_.max_pending

    print(f"command: {shlex.join(sys.orig_argv)}")
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs (torch threads {torch.get_num_threads()}), "
          f"CUDA available: {torch.cuda.is_available()}")
    print(f"disk dir: {workdir}")

    # Before this process grows: a child's ru_maxrss starts at its spawner's RSS.
    extra_pilot = peak_extra("pilot", args.gb, workdir)
    extra_torch = peak_extra("torch", args.gb, workdir)

    state = build_state(layout)
    nbytes = state_nbytes(state)
    print(f"state: {layout.layers} x Linear({layout.width}, {layout.width}) fp32 + AdamW "
          f"exp_avg/exp_avg_sq = {layout.params / 1e6:.1f} M params, {nbytes / 1e9:.3f} GB")

    run_dir = workdir / "pilot-run"
    stalls, records = pilot_saves(state, policy_yaml, run_dir, args.repeats)
    torch_path = workdir / "baseline.pt"
    plain = [torch_save(state, torch_path, fsync=False) for _ in range(args.repeats)]
    synced = [torch_save(state, torch_path, fsync=True) for _ in range(args.repeats)]
    torch_bytes = torch_path.stat().st_size

    restores_pilot, restores_torch = [], []
    for _ in range(args.repeats):  # alternated, each into fresh objects, each checked
        took, restored = pilot_restore(layout, policy_yaml, run_dir)
        assert_same(restored, state)
        restores_pilot.append(took)
        took, restored = torch_restore(layout, torch_path)
        assert_same(restored, state)
        restores_torch.append(took)

    durable = [s + r.persist_seconds for s, r in zip(stalls, records, strict=True)]
    rows = [
        ("stall, first save (pilot allocates its host buffers)", stalls[0], median(plain),
         seconds),
        ("stall, later saves (pilot reuses pooled buffers)", median(stalls[1:]), median(plain),
         seconds),
        ("stall, later saves, vs torch.save + fsync", median(stalls[1:]), median(synced),
         seconds),
        ("save until durable (pilot: stall + background persist, later saves) vs "
         "torch.save + fsync", median(durable[1:]), median(synced), seconds),
        ("bytes written per save", float(records[-1].bytes), float(torch_bytes), gigabytes),
        ("restore into fresh objects, warm page cache", median(restores_pilot),
         median(restores_torch), seconds),
        ("peak extra host RSS during a save (fresh process)", float(extra_pilot),
         float(extra_torch), gigabytes),
        ("peak extra host RSS / state bytes", extra_pilot / nbytes, extra_torch / nbytes, times),
    ]
    print()
    print(f"baseline = torch.save({{'model': ..., 'optimizer': ...}}) to the same disk "
          f"(without fsync unless the row says so); torch.load(weights_only=True) + "
          f"load_state_dict for restore. Repeats: {args.repeats}; times are medians over them "
          f"(pilot 'later saves': over saves 2+).")
    print("page cache: nothing dropped (no root); restores read files that were just written.")
    print()
    print(table(rows))
    print()
    print("pilot stalls (s): " + ", ".join(f"{s:.3f}" for s in stalls)
          + "; pilot's own SaveRecord.stall_seconds: "
          + ", ".join(f"{r.stall_seconds:.3f}" for r in records))
    print("pilot background persist (s, write + validate + publish): "
          + ", ".join(f"{r.persist_seconds:.3f}" for r in records)
          + "; of which validation in the load-test worker (s): "
          + ", ".join(f"{r.validate_seconds:.3f}" for r in records))
    print("torch.save (s): " + ", ".join(f"{s:.3f}" for s in plain)
          + "; torch.save + fsync (s): " + ", ".join(f"{s:.3f}" for s in synced))
    print("restore (s): pilot " + ", ".join(f"{s:.3f}" for s in restores_pilot)
          + "; torch.load " + ", ".join(f"{s:.3f}" for s in restores_torch))
    print(f"pilot memory bound: (max_pending + 1) x state = {max_pending + 1} x "
          f"{nbytes / 1e9:.3f} GB = {(max_pending + 1) * nbytes / 1e9:.3f} GB host memory "
          f"incl. the live state, i.e. at most {max_pending}x state extra; measured extra "
          f"{extra_pilot / nbytes:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--gb", type=float, default=1.0,
                        help="training state size in GB (params + AdamW moments)")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                        help=f"a temp dir is made (and removed) under it; default {DEFAULT_DIR}")
    parser.add_argument("--repeats", type=int, default=3,
                        help="saves and restores per variant (at least 2)")
    parser.add_argument("--child", choices=["pilot", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child_main(args.child, args.gb, args.dir)
        return
    if args.repeats < 2:
        parser.error("--repeats must be at least 2 (first save and steady state differ)")
    with scratch_dir(args.dir, "stall-") as workdir:
        run(args, workdir)


if __name__ == "__main__":
    main()
