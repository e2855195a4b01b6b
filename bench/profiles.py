"""Where a save's and a restore's time goes, by CPU kind and by thread (issue 15's misses).

Three profiles of the same 1.007 GB state as bench/e2e.py (5 x Linear(4096, 4096) + AdamW),
each printed as plain lines (RESULTS "Where a save's time goes" quotes them):

- ``save``: six forced organ saves through a pilot on the default policy; per save the stall,
  the time to durable, the pilot's write / validate records and the user + system CPU
  seconds of this process (``getrusage``) from the save to its flush;
- ``read``: the organ's tensor file read cold (dropped with ``POSIX_FADV_DONTNEED``) and
  warm by a plain sequential ``readinto`` and by ``RemoteTier.read_verified``, with user +
  system CPU seconds;
- ``loop``: bench/e2e.py's MLP training loop (300 steps, an organ every 20) with a pilot:
  CPU seconds per thread (``/proc/self/task``, Python threads by name, torch's own threads
  as ``native``) and of the live child processes (the load-test worker).

Usage: ``.venv/bin/python bench/profiles.py save|read|loop [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ckptpilot import CheckpointPilot
from ckptpilot.capture.state import Snapshot
from ckptpilot.tiers.remote.archive import TENSORS_FILE, stage_organ
from ckptpilot.tiers.remote.store import RemoteTier

DEFAULT_DIR = Path(__file__).resolve().parent.parent / ".bench-tmp" / "profiles"
LOOP_YAML = """scheduler: {base_interval: 20, min_interval: 20, max_interval: 20,
            trigger_threshold: 1.0, organ_every: 1, young_daly: false}
"""


def cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def since(start: tuple[float, float]) -> str:
    user, system = cpu()
    return f"user+sys {user - start[0]:.2f}+{system - start[1]:.2f} CPU-s"


def big_state() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(5)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, 4096)).sum().backward()
    opt.step()
    return model, opt


def profile_save(work: Path) -> None:
    model, opt = big_state()
    (work / "p.yaml").write_text("")
    pilot = CheckpointPilot(work / "p.yaml", model=model, optimizer=opt, run_dir=work / "run")
    for i in range(6):
        pilot.observe()
        os.sync()
        c0, t0 = cpu(), time.perf_counter()
        pilot.save(level="organ", reason="bench")
        stall = time.perf_counter() - t0
        pilot.flush()
        durable = time.perf_counter() - t0
        r = pilot.saves[-1]
        print(f"save {i + 1}: stall {stall:.3f} s, durable {durable:.3f} s, write "
              f"{r.write_seconds:.3f} s, validate {r.validate_seconds:.3f} s, {since(c0)}")
    pilot.close(save=False)


def profile_read(work: Path) -> None:
    tensors = {f"t{i}": torch.randn(4096 * 4096) for i in range(15)}
    tier = RemoteTier(str(work))
    staged = stage_organ(tier, Snapshot(step=1, tensors=tensors,
                                        meta={"rank": 0, "world_size": 1, "step": 1}))
    rel, rec = f"{staged.staging}/{TENSORS_FILE}", staged.manifest["files"][TENSORS_FILE]
    path = tier.path(rel)
    del tensors

    def drop() -> None:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    def plain() -> np.ndarray:
        buf = np.empty(int(rec["bytes"]), np.uint8)
        view, got = memoryview(buf), 0
        with open(path, "rb", buffering=0) as f:
            while got < len(view):
                got += f.readinto(view[got:])
        return buf

    def verified() -> np.ndarray:
        return tier.read_verified(rel, rec)

    for _ in range(3):
        for name, read in (("plain readinto", plain), ("read_verified", verified)):
            for state in ("cold", "warm"):
                if state == "cold":
                    drop()
                c0, t0 = cpu(), time.perf_counter()
                read()
                print(f"{name} {state}: {time.perf_counter() - t0:.3f} s, {since(c0)}")


def _threads() -> dict[tuple[str, str], float]:
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[(tid, "")] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _children() -> float:
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for tid in os.listdir("/proc/self/task"):
        for pid in Path(f"/proc/self/task/{tid}/children").read_text().split():
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def profile_loop(work: Path) -> None:
    (work / "p.yaml").write_text(LOOP_YAML)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                          nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(64, 512), torch.randint(0, 16, (64,))
    pilot = CheckpointPilot(work / "p.yaml", model=model, optimizer=opt, run_dir=work / "run")
    children0, before, t0 = _children(), _threads(), time.perf_counter()
    for _ in range(300):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        pilot.observe(loss.item())
    pilot.flush()
    wall, after = time.perf_counter() - t0, _threads()
    names = {str(t.native_id): t.name.rstrip("0123456789_-") for t in threading.enumerate()}
    per: dict[str, float] = {}
    for (tid, _), seconds in after.items():
        label = names.get(tid, "native (torch)")
        per[label] = per.get(label, 0.0) + seconds - before.get((tid, ""), 0.0)
    print(f"wall {wall:.2f} s, {len(pilot.saves)} saves")
    for label, seconds in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"  {label}: {seconds:.2f} CPU-s")
    print(f"  child processes (the load-test worker): {_children() - children0:.2f} CPU-s "
          f"during the loop, {_children():.2f} since it started")
    pilot.close(save=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("what", choices=("save", "read", "loop"))
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    args = parser.parse_args()
    work = args.dir / args.what
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        {"save": profile_save, "read": profile_read, "loop": profile_loop}[args.what](work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
