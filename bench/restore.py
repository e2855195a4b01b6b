"""Restore from the remote tier against ``torch.load``, cold and warm, in one run (issue 24).

One state (``--gb``, the same 4096-wide Linear layers + AdamW as e2e.py) is saved once as a
pilot organ (memory tier off, so every restore reads the remote tier) and once with
``torch.save`` + fsync. Then, for ``--rounds`` rounds in a rotated order, each method restores
it into fresh, uninitialised objects, cold (every file of the save fsynced and dropped from
the page cache with ``POSIX_FADV_DONTNEED``) and warm (every file read once before, buffered:
a cold read with ``O_DIRECT`` leaves nothing in the page cache):

- ``torch.load``: ``torch.load(weights_only=True)`` + ``load_state_dict`` (verifies nothing);
- ``pilot, verify_reads: sha256`` / ``xxh3``: a fresh ``CheckpointPilot``'s ``restore()``
  (its construction not timed), every byte checked against the manifest's chunk digests;
- phases of the pilot's read, on the organ's tensors file alone: ``pread, no check`` (the
  same 8 MiB ``pread`` on the read threads into the same kind of fresh buffer with the same
  ``POSIX_FADV_WILLNEED`` window ahead, nothing hashed: the floor of any verified read), the
  same without the window or into ``np.empty`` (how the tier read before), and
  ``read_verified`` by each digest;
- ``the disk's ceiling``: the tensors file read with ``O_DIRECT`` (no page cache: warm reads
  the disk too) on 4 threads into a buffer faulted in before the clock starts. No reader of
  these bytes, ``torch.load`` included, can be much faster cold on this machine.

Each row: median wall seconds, the ratio to ``torch.load``'s median of the same run (above 1 =
faster), and median user + system CPU seconds of the process (all threads; ``getrusage``).
The load average is printed at the start and the end: on a shared box read the ratios only.

Usage: ``PYTHONPATH=. .venv/bin/python bench/restore.py [--gb 1.0] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import gc
import mmap
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median

import numpy as np
import torch
from e2e import cache_files, drop_cached
from scratch import DEFAULT_DIR, scratch_dir
from stall import Layout, State, assert_same, build_state, fresh_state, state_nbytes

from ckptpilot import CheckpointPilot, load_policy
from ckptpilot.format.digest import chunk_ranges, hash_pool
from ckptpilot.hostmem import fresh_bytes
from ckptpilot.tiers.remote.archive import TENSORS_FILE, read_manifest
from ckptpilot.tiers.remote.store import RemoteTier

AHEAD = 256 << 20  # tiers/remote/store.py's _READ_AHEAD_BYTES
POLICY_YAML = """\
scheduler: {{base_interval: 100000, min_interval: 1, max_interval: 100000}}
observability: {{tensorboard: false, decision_log: false}}
tiers: {{memory: {{enabled: false}}, remote: {{verify_reads: {digest}}}}}
"""


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def git_head() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=Path(__file__).parent)
    return done.stdout.strip() or "?"


def cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


Measured = tuple[float, float, float]  # wall, user, system seconds
Run = Callable[[], tuple[State | None, Measured | None]]


def measured(fn: Callable[[], object]) -> Measured:
    (u0, s0), t0 = cpu(), time.perf_counter()
    fn()
    took = time.perf_counter() - t0
    u1, s1 = cpu()
    return took, u1 - u0, s1 - s0


class Row:
    """One way to restore: ``run`` returns the restored state (checked bit for bit against
    the reference after the clock stops) and, when only part of it is timed, that part's
    figures."""

    def __init__(self, label: str, files: list[Path], run: Run) -> None:
        self.label, self.files, self.run = label, files, run
        self.wall: dict[str, list[float]] = {"cold": [], "warm": []}
        self.user: dict[str, list[float]] = {"cold": [], "warm": []}
        self.sys: dict[str, list[float]] = {"cold": [], "warm": []}

    def measure(self, state: str, reference: State) -> None:
        if state == "cold":
            drop_cached(self.files)
        else:
            cache_files(self.files)
        gc.collect()
        result: list[tuple[State | None, Measured | None]] = []
        whole = measured(lambda: result.append(self.run()))
        restored, part = result[0]
        wall, user, system = part or whole
        self.wall[state].append(wall)
        self.user[state].append(user)
        self.sys[state].append(system)
        if restored is not None:
            assert_same(restored, reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    args = parser.parse_args()
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"machine: {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}; "
          f"load average at start {loadavg()}; git HEAD {git_head()}")
    layout = Layout.for_gb(args.gb)
    reference = build_state(layout)
    nbytes = state_nbytes(reference)
    print(f"state: {layout.layers} x Linear({layout.width}, {layout.width}) fp32 + AdamW, "
          f"{nbytes / 1e9:.3f} GB; rounds {args.rounds} (medians)")
    with scratch_dir(args.dir, "restore-") as work:
        run_dir = work / "run"
        policies = {}
        for digest in ("sha256", "xxh3"):
            policies[digest] = work / f"{digest}.yaml"
            policies[digest].write_text(POLICY_YAML.format(digest=digest))
        pilot = CheckpointPilot(load_policy(policies["sha256"], run_dir=run_dir),
                                model=reference[0], optimizer=reference[1], run_dir=run_dir)
        pilot.observe()
        if not pilot.save(level="organ", reason="bench"):
            raise RuntimeError("the pilot did not save")
        pilot.flush()
        location = Path(pilot.saves[-1].location)
        pilot.close(save=False)
        organ = sorted(p for p in location.iterdir() if p.is_file())
        torch_file = work / "state.pt"
        with open(torch_file, "wb") as f:
            model, opt = reference
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

        def torch_restore() -> tuple[State, None]:
            model, opt = state = fresh_state(layout)
            loaded = torch.load(torch_file, weights_only=True)
            model.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["optimizer"])
            return state, None

        def pilot_restore(digest: str) -> Run:
            def run() -> tuple[State, Measured]:
                state = fresh_state(layout)
                p = CheckpointPilot(load_policy(policies[digest], run_dir=run_dir),
                                    model=state[0], optimizer=state[1], run_dir=run_dir)
                try:  # construction and close are not timed: e2e.py times restore() alone
                    return state, measured(p.restore)
                finally:
                    p.close(save=False)
            return run

        tier = RemoteTier(str(location.parent))
        rel = f"{location.name}/{TENSORS_FILE}"
        rec = read_manifest(tier, location.name)["files"][TENSORS_FILE]
        tensors_file = [location / TENSORS_FILE]

        def pread_only(advise: bool, alloc: Callable[[int], np.ndarray] = fresh_bytes) -> Run:
            return lambda: pread(advise, alloc)

        def pread(advise: bool, alloc: Callable[[int], np.ndarray]) -> tuple[None, None]:
            size = int(rec["bytes"])
            view = memoryview(alloc(size))
            fd = os.open(tensors_file[0], os.O_RDONLY)
            try:
                if advise:
                    os.posix_fadvise(fd, 0, min(size, AHEAD), os.POSIX_FADV_WILLNEED)

                def one(r: tuple[int, int, str]) -> None:
                    begin, end, _ = r
                    if advise and begin + AHEAD < size:
                        os.posix_fadvise(fd, begin + AHEAD, min(end, size - AHEAD) - begin,
                                         os.POSIX_FADV_WILLNEED)
                    got = 0
                    while got < end - begin:
                        got += os.preadv(fd, [view[begin + got:end]], begin + got)
                for _ in hash_pool(background=False).map(one, chunk_ranges(rec, rel)):
                    pass
            finally:
                os.close(fd)
            return None, None

        def read_verified(digest: str) -> Run:
            reader = RemoteTier(str(location.parent), verify_reads=digest)  # type: ignore[arg-type]

            def run() -> tuple[None, None]:
                reader.read_verified(rel, rec)
                return None, None
            return run

        def disk_ceiling() -> tuple[None, Measured]:
            size = -(-int(rec["bytes"]) // 4096) * 4096  # O_DIRECT reads whole blocks
            area = mmap.mmap(-1, size)
            view = memoryview(area)
            np.frombuffer(area, np.uint8)[:] = 1  # fault every page before the clock
            fd = os.open(tensors_file[0], os.O_RDONLY | os.O_DIRECT)

            def one(begin: int) -> None:
                end = min(begin + (8 << 20), size)
                got = 0
                while got < end - begin:
                    n = os.preadv(fd, [view[begin + got:end]], begin + got)
                    if not n or n % 4096:
                        return  # the file ends inside its last block
                    got += n
            try:
                with ThreadPoolExecutor(4) as pool:
                    return None, measured(lambda: list(pool.map(one, range(0, size, 8 << 20))))
            finally:
                os.close(fd)
                view.release()
                area.close()

        rows = [Row("torch.load (weights_only=True) + load_state_dict", [torch_file],
                    torch_restore),
                Row("pilot restore, verify_reads: sha256", organ, pilot_restore("sha256")),
                Row("pilot restore, verify_reads: xxh3", organ, pilot_restore("xxh3")),
                Row("phase: pread on the read threads, no check, no WILLNEED (tensors file)",
                    tensors_file, pread_only(False)),
                Row("phase: pread on the read threads, no check (tensors file)", tensors_file,
                    pread_only(True)),
                Row("phase: the same into np.empty (numpy's huge pages)", tensors_file,
                    pread_only(True, lambda n: np.empty(n, np.uint8))),
                Row("phase: read_verified, sha256 (tensors file)", tensors_file,
                    read_verified("sha256")),
                Row("phase: read_verified, xxh3 (tensors file)", tensors_file,
                    read_verified("xxh3")),
                Row("the disk's ceiling: O_DIRECT pread, 4 threads, buffer faulted in before "
                    "the clock (tensors file)", tensors_file, disk_ceiling)]
        for r in range(args.rounds):
            k = r % len(rows)
            for row in [*rows[k:], *rows[:k]]:
                for state in ("cold", "warm"):
                    row.measure(state, reference)
            print(f"round {r + 1}/{args.rounds} done, load average {loadavg()}",
                  file=sys.stderr, flush=True)
    base = {s: median(rows[0].wall[s]) for s in ("cold", "warm")}
    print(f"load average at end {loadavg()}")
    print()
    print("| restore | cold s | vs torch.load | cold CPU-s user + sys | warm s | vs torch.load "
          "| warm CPU-s user + sys |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        cells = []
        for s in ("cold", "warm"):
            wall = median(row.wall[s])
            cells += [f"{wall:.3f}", f"{base[s] / wall:.2f}x",
                      f"{median(row.user[s]):.2f} + {median(row.sys[s]):.2f}"]
        print(f"| {row.label} | {' | '.join(cells)} |")
    print()
    for row in rows:
        print(f"{row.label}: cold {[round(t, 3) for t in row.wall['cold']]}, "
              f"warm {[round(t, 3) for t in row.wall['warm']]}")


if __name__ == "__main__":
    main()
