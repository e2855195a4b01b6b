"""ckptpilot's DCP backend (``ckptpilot.dcp.Writer`` / ``Reader``) against stock DCP.

Issue 14 makes ckptpilot a ``torch.distributed.checkpoint`` storage backend: SHA256 of every
item while it is written, a read-back check of every rank's file before its part counts
(``validation.sha256``), optional codecs, atomic publication and a metadata row per rank.
This script measures what that costs, in the same run and on the same disk, against DCP's own
``FileSystemWriter`` / ``FileSystemReader``, on one sharded training state:

- two gloo ranks on the CPU (``torch.multiprocessing`` with ``fork``), a 1-D device mesh;
- ``--mb`` MB of state in all (both ranks): ``Linear``-shaped fp32 weights and biases as
  DTensors sharded on dim 0, and the AdamW ``exp_avg`` / ``exp_avg_sq`` of one real AdamW
  step on them (DTensors too), ``step`` and ``param_groups`` as
  ``torch.distributed.checkpoint.state_dict.get_state_dict`` lays out a sharded optimizer.

Save variants (each rank calls ``dcp.save`` or ``dcp.async_save`` with its writer):

1. stock: ``FileSystemWriter(dir)`` with its defaults (fsync of every file, one thread);
2. ckptpilot ``Writer(policy, step=N)`` with codecs off, then with codecs on;
3. ``dcp.async_save`` with ``FileSystemWriter``, and with ckptpilot's ``Writer`` (codecs off,
   then on): DCP copies the state to CPU memory on the calling thread, then saves it on its
   own thread, which the training thread (here: idle, waiting) does not wait for. The copy is
   DCP's, and which stager makes it depends on the writer: ``FileSystemWriter`` is its own
   (``BlockingAsyncStager``), any other writer gets ``DefaultStager``. So that the stall
   rows compare writers and not stagers, stock ``async_save`` also runs with
   ``async_stager=DefaultStager(StagingOptions(False, False, False, False))``, the stager
   ``async_save`` makes for ckptpilot's writer.

Per save: *stall* — seconds the calling (training) thread is blocked: the whole ``dcp.save``;
until ``dcp.async_save`` returns for the async rows; *durable* — seconds until the checkpoint
is written, fsynced and published on every rank (``dcp.save`` returns; the async future
resolves); the slower rank counts for both. *Bytes on disk*: the sizes of every file of the
published directory. *Restore*: fresh zero-filled DTensors of the same sharding, then
``dcp.load`` with ``FileSystemReader`` (stock directories) or ``Reader(policy)`` (ckptpilot's,
the newest valid step, constructed inside the timing), first from a cold page cache (``sync``
+ ``echo 1 > /proc/sys/vm/drop_caches`` by rank 0 before the load, when it may write that
file; the output says whether it could), then again with the cache warm; plus stock
``FileSystemReader`` on ckptpilot's codecs-off directory (the interop path, no verification).
Every restore is checked bit for bit (integer views of every local shard, on every rank, and
``param_groups``); a mismatch aborts the benchmark.

Fairness: ``os.sync()`` runs (untimed) before every save, each variant's checkpoint is deleted
(untimed) after its restores so that the next save writes into page cache freed as much as
the others', and the order of the variants rotates with each round. Each rank runs torch with
one thread (two ranks on two cores), and the codecs with one encoder thread per rank
(``codecs.threads: 1``). Times are medians over ``--rounds``; ratios are stock / variant, so
above 1 means ckptpilot is faster (or smaller): sync rows against the stock sync save, async
rows against stock ``async_save``, restores against ``FileSystemReader`` in the same cache state.

Usage: ``.venv/bin/python bench/dcp.py [--mb 320] [--rounds 3] [--dir DIR]``
"""

from __future__ import annotations

import argparse
import copy
import datetime
import enum
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from peer import drop_page_cache, git_facts, loadavg
from scratch import DEFAULT_DIR, scratch_dir
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from ckptpilot.dcp import Reader, Writer, dcp_name
from ckptpilot.policy import Policy, load_policy
from ckptpilot.rundir import metadata_path, read_run_id
from ckptpilot.storage.metadata import MetadataStore
from ckptpilot.vocab import Tier

WORLD = 2
MAX_WIDTH = 2048
BYTES_PER_PARAM = 12  # fp32 parameter + AdamW exp_avg + exp_avg_sq
JOIN_SECONDS = 60  # how often the parent wakes while the ranks run; not a limit
POLICY_YAML = """\
codecs: {threads: 1}
observability: {tensorboard: false, decision_log: false}
"""

# What dcp.async_save gives a writer that is not its own stager: no pinned or shared memory,
# no staging thread, no non-blocking copy.
STAGING = StagingOptions(False, False, False, False)

State = dict[str, Any]


class Reading(enum.Enum):
    """Who reads a checkpoint back."""

    STOCK = "FileSystemReader"
    PILOT = "ckptpilot Reader"


@dataclass(frozen=True)
class Variant:
    """One way of saving: ``pilot`` False is stock ``FileSystemWriter``."""

    key: str
    label: str
    pilot: bool
    codecs: bool
    asynchronous: bool
    default_stager: bool = False  # async only: DCP's DefaultStager instead of the writer's

    @property
    def readers(self) -> tuple[Reading, ...]:
        if not self.pilot:
            return (Reading.STOCK,)
        if self.codecs or self.asynchronous:
            return (Reading.PILOT,)
        return (Reading.PILOT, Reading.STOCK)  # the interop path, on the sync codecs-off save

    @property
    def baseline(self) -> str:
        return "stock_async" if self.asynchronous else "stock"


VARIANTS = (
    Variant("stock", "stock FileSystemWriter", False, False, False),
    Variant("pilot", "ckptpilot Writer, codecs off", True, False, False),
    Variant("pilot_codecs", "ckptpilot Writer, codecs on", True, True, False),
    Variant("stock_async", "stock async_save(FileSystemWriter)", False, False, True),
    Variant("stock_async_ds", "stock async_save(FileSystemWriter), DefaultStager", False, False,
            True, default_stager=True),
    Variant("pilot_async", "async_save(ckptpilot Writer), codecs off", True, False, True),
    Variant("pilot_codecs_async", "async_save(ckptpilot Writer), codecs on", True, True, True),
)


@dataclass(frozen=True)
class Layout:
    """``layers`` Linear(width, width) layers (weight + bias), sharded on dim 0 over WORLD."""

    width: int
    layers: int

    @classmethod
    def for_mb(cls, mb: float) -> Layout:
        params = mb * 1e6 / BYTES_PER_PARAM
        per_layer = MAX_WIDTH * (MAX_WIDTH + 1)
        if params < per_layer:
            width = max(WORLD, math.isqrt(int(params)) // WORLD * WORLD)
            return cls(width=width, layers=1)
        return cls(width=MAX_WIDTH, layers=max(1, round(params / per_layer)))

    @property
    def params(self) -> int:
        return self.layers * self.width * (self.width + 1)

    @property
    def state_bytes(self) -> int:
        return self.params * BYTES_PER_PARAM


# ----------------------------------------------------------------------------- state

def build_state(layout: Layout, mesh: DeviceMesh, rank: int) -> State:
    """This rank's part of the sharded state after one real AdamW step on its local shards
    (AdamW is elementwise, so the step on a shard is the step on the global tensor)."""
    g = torch.Generator().manual_seed(1000 + rank)
    names, params = [], []
    local_rows = layout.width // WORLD
    for i in range(layout.layers):
        names += [f"layers.{i}.weight", f"layers.{i}.bias"]
        params += [torch.nn.Parameter(torch.randn(local_rows, layout.width, generator=g) * 0.02),
                   torch.nn.Parameter(torch.randn(local_rows, generator=g) * 0.02)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    opt.step()

    def sharded(t: torch.Tensor) -> DTensor:
        return DTensor.from_local(t.detach(), mesh, [Shard(0)], run_check=False)

    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    return {
        "model": {name: sharded(p) for name, p in zip(names, params, strict=True)},
        "optim": {
            "state": {name: {"step": opt.state[p]["step"].clone(),
                             "exp_avg": sharded(opt.state[p]["exp_avg"]),
                             "exp_avg_sq": sharded(opt.state[p]["exp_avg_sq"])}
                      for name, p in zip(names, params, strict=True)},
            "param_groups": [{**group, "params": names}],
        },
    }


def zeros_like_state(state: State) -> State:
    """A load target of the same structure and sharding, every tensor zero and the
    ``param_groups`` values changed, so that a load that skips anything shows."""
    def zero(value: Any) -> Any:
        if isinstance(value, DTensor):
            return DTensor.from_local(torch.zeros_like(value.to_local()), value.device_mesh,
                                      value.placements, run_check=False)
        if isinstance(value, torch.Tensor):
            return torch.zeros_like(value)
        if isinstance(value, dict):
            return {k: zero(v) for k, v in value.items()}
        return value

    target = zero(state)
    target["optim"]["param_groups"] = copy.deepcopy(state["optim"]["param_groups"])
    target["optim"]["param_groups"][0]["lr"] = 0.0
    return target


def state_tensors(state: State) -> dict[str, torch.Tensor]:
    """Every local tensor (a DTensor's local shard), by path."""
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, DTensor):
            out[prefix] = value.to_local()
        elif isinstance(value, torch.Tensor):
            out[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)

    walk("", state)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def mismatches(got: State, ref: State) -> list[str]:
    """Paths whose local bytes differ from the saved state (empty: restored bit for bit)."""
    want = state_tensors(ref)
    have = state_tensors(got)
    bad = [path for path, t in want.items() if path not in have or not same_bits(have[path], t)]
    if got["optim"]["param_groups"] != ref["optim"]["param_groups"]:
        bad.append("/optim/param_groups")
    return bad


def state_nbytes(state: State) -> int:
    """Bytes of this rank's tensors (a replicated ``step`` counted on every rank)."""
    return sum(t.numel() * t.element_size() for t in state_tensors(state).values())


# ------------------------------------------------------------------------------ ranks

@dataclass
class Sample:
    """One round of one variant, the slower rank's times."""

    stall: float
    durable: float
    nbytes: int
    restore_cold: dict[Reading, float]
    restore_warm: dict[Reading, float]
    breakdown: dict[str, float]
    codecs: str


class Rank:
    """What one rank runs: saves, restores and checks, with the collectives that keep the
    two ranks in step. Rank 0 measures the files and prints."""

    def __init__(self, rank: int, mesh: DeviceMesh, layout: Layout, workdir: Path,
                 policy_yaml: Path) -> None:
        self.rank = rank
        self.layout = layout
        self.workdir = workdir
        self.policy_yaml = policy_yaml
        self.state = build_state(layout, mesh, rank)
        self.cold_ok = True
        self._policies: dict[str, Policy] = {}
        self._step = 0

    def policy(self, variant: Variant) -> Policy:
        if variant.key not in self._policies:
            run_dir = self.workdir / f"run-{variant.key}"
            self._policies[variant.key] = load_policy(self.policy_yaml, run_dir=run_dir)
        return self._policies[variant.key]

    def slowest(self, *values: float) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def sync_disks(self, *, drop: bool) -> None:
        """Write back everything (and drop the page cache when ``drop``) before a timing; one
        rank does it for the machine, both wait."""
        dist.barrier()
        if self.rank == 0:
            if drop:
                self.cold_ok = drop_page_cache() and self.cold_ok
            else:
                os.sync()
        dist.barrier()

    def one_round(self, variant: Variant) -> Sample:
        self._step += 1
        step = self._step
        stock_dir = self.workdir / f"stock-{variant.key}" / f"step_{step}"
        writer: Any
        if variant.pilot:
            writer = Writer(self.policy(variant), step=step, codecs=variant.codecs)
            ckpt_dir = Path(writer.checkpoint_id)
        else:
            writer = FileSystemWriter(stock_dir)
            ckpt_dir = stock_dir
        self.sync_disks(drop=False)
        t0 = time.perf_counter()
        if variant.asynchronous:
            stager = DefaultStager(STAGING) if variant.default_stager else None
            response = dcp.async_save(self.state, storage_writer=writer, async_stager=stager)
            stall = time.perf_counter() - t0
            getattr(response, "upload_completion", response).result()
            if stager is not None:
                stager.close()
        else:
            dcp.save(self.state, storage_writer=writer)
            stall = time.perf_counter() - t0
        durable = time.perf_counter() - t0
        stall, durable = self.slowest(stall, durable)
        nbytes = (sum(f.stat().st_size for f in ckpt_dir.rglob("*") if f.is_file())
                  if self.rank == 0 else 0)
        breakdown, codecs = self.pilot_rows(variant, step) if variant.pilot else ({}, "-")

        cold: dict[Reading, float] = {}
        warm: dict[Reading, float] = {}
        for reading in variant.readers:
            cold[reading] = self.restore(variant, reading, ckpt_dir, drop=True)
            warm[reading] = self.restore(variant, reading, ckpt_dir, drop=False)
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(ckpt_dir)
        return Sample(stall, durable, nbytes, cold, warm, breakdown, codecs)

    def restore(self, variant: Variant, reading: Reading, ckpt_dir: Path, *,
                drop: bool) -> float:
        target = zeros_like_state(self.state)
        self.sync_disks(drop=drop)
        t0 = time.perf_counter()
        reader = (Reader(self.policy(variant)) if reading is Reading.PILOT
                  else FileSystemReader(ckpt_dir))
        dcp.load(target, storage_reader=reader)
        (seconds,) = self.slowest(time.perf_counter() - t0)
        bad = mismatches(target, self.state)
        if bad:
            raise AssertionError(f"rank {self.rank}: {variant.label} read by {reading.value}: "
                                 f"{len(bad)} tensors differ from the saved state, e.g. "
                                 f"{bad[:3]}")
        return seconds

    def pilot_rows(self, variant: Variant, step: int) -> tuple[dict[str, float], str]:
        """The seconds ckptpilot recorded for its write (slowest rank per field) and the
        codecs it chose, from the run's metadata rows (rank 0 reads them)."""
        if self.rank != 0:
            return {}, ""
        run_dir = Path(self.policy(variant).run_dir)
        with MetadataStore(metadata_path(run_dir), read_only=True) as store:
            rows = [r for r in store.rows(read_run_id(run_dir), tier=Tier.REMOTE)
                    if r.step == step and r.location.endswith(dcp_name(step))]
        fields = {"resolve": "seconds_snapshot", "write + hash": "seconds_write",
                  "read-back check": "seconds_validate"}
        breakdown = {name: max(getattr(r, field) or 0.0 for r in rows)
                     for name, field in fields.items()}
        codecs = " | ".join(f"rank {r.rank}: {r.codec}" for r in sorted(rows, key=lambda r: r.rank))
        return breakdown, codecs


def rank_main(rank: int, port: int, args: argparse.Namespace, workdir: Path,
              policy_yaml: Path) -> None:
    warnings.simplefilter("ignore")  # DCP warns about its defaults on every call
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    layout = Layout.for_mb(args.mb)
    me = Rank(rank, mesh, layout, workdir, policy_yaml)
    per_rank = state_nbytes(me.state)
    samples: dict[str, list[Sample]] = {v.key: [] for v in VARIANTS}
    # One untimed save and load of each kind first: imports, thread pools and the run
    # directories are made there, not in the first timed round.
    for variant in VARIANTS:
        me.one_round(variant)
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for variant in order:
            samples[variant.key].append(me.one_round(variant))
    if rank == 0:
        report(args, layout, per_rank, samples, me.cold_ok)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- output

def fmt_ratio(baseline: float, value: float) -> str:
    return f"{baseline / value:.2f}x" if value > 0 else "n/a"


def report(args: argparse.Namespace, layout: Layout, per_rank: int,
           samples: dict[str, list[Sample]], cold_ok: bool) -> None:
    def med(key: str, get: Callable[[Sample], float]) -> float:
        return median(get(s) for s in samples[key])

    def secs(key: str, get: Callable[[Sample], float]) -> str:
        return ", ".join(f"{get(s):.3f}" for s in samples[key])

    print(f"state: {layout.layers} x Linear({layout.width}, {layout.width}) fp32 weight + bias,"
          f" sharded on dim 0 over {WORLD} gloo ranks (DTensor, 1-D mesh), + AdamW exp_avg / "
          f"exp_avg_sq (DTensors), step, param_groups = {layout.params / 1e6:.1f} M params, "
          f"{layout.state_bytes / 1e6:.1f} MB in all, {per_rank / 1e6:.1f} MB on each rank")
    cache = ("cold = `sync` + `echo 1 > /proc/sys/vm/drop_caches` (rank 0) before the load"
             if cold_ok else "cold restores NOT cold: /proc/sys/vm/drop_caches could not be "
             "written here, so every load found the files in the page cache")
    print(f"rounds: {args.rounds} (after one untimed warm-up round); values are medians; "
          f"ratio = stock / row (above 1: ckptpilot faster or smaller); restore: {cache}")
    print()
    print("| save variant | stall s | vs stock | durable s | vs stock | bytes on disk | "
          "vs stock | restore cold s | vs stock | restore warm s | vs stock |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    stock_cold = med("stock", lambda s: s.restore_cold[Reading.STOCK])
    stock_warm = med("stock", lambda s: s.restore_warm[Reading.STOCK])
    for v in VARIANTS:
        base = v.baseline
        stall = med(v.key, lambda s: s.stall)
        durable = med(v.key, lambda s: s.durable)
        nbytes = med(v.key, lambda s: s.nbytes)
        for i, reading in enumerate(v.readers):
            cold = med(v.key, lambda s, rd=reading: s.restore_cold[rd])
            warm = med(v.key, lambda s, rd=reading: s.restore_warm[rd])
            restore = (f"{cold:.3f} | {fmt_ratio(stock_cold, cold)} | {warm:.3f} | "
                       f"{fmt_ratio(stock_warm, warm)}")
            if i == 0:
                print(f"| {v.label} | {stall:.3f} | "
                      f"{fmt_ratio(med(base, lambda s: s.stall), stall)} | {durable:.3f} | "
                      f"{fmt_ratio(med(base, lambda s: s.durable), durable)} | "
                      f"{nbytes / 1e6:.1f} MB | "
                      f"{fmt_ratio(med(base, lambda s: s.nbytes), nbytes)} | {restore} |")
            else:
                print(f"| ... same checkpoint read by stock {reading.value} (no verification) | "
                      f"- | - | - | - | - | - | {restore} |")
    print()
    for v in VARIANTS:
        line = (f"{v.label}: stall (s) {secs(v.key, lambda s: s.stall)}; durable (s) "
                f"{secs(v.key, lambda s: s.durable)}")
        for reading in v.readers:
            line += (f"; restore by {reading.value} cold (s) "
                     f"{secs(v.key, lambda s, rd=reading: s.restore_cold[rd])}, warm (s) "
                     f"{secs(v.key, lambda s, rd=reading: s.restore_warm[rd])}")
        print(line)
    print()
    print("ckptpilot's own record of its writes (metadata rows; slowest rank, medians; "
          "resolve = DCP's planner handing over each item, write + hash = torch.save or "
          "codec into the file with SHA256 per item, read-back check = re-reading and "
          "re-hashing the rank's file):")
    for v in VARIANTS:
        if v.pilot:
            parts = ", ".join(f"{name} {median(s.breakdown[name] for s in samples[v.key]):.3f} s"
                              for name in samples[v.key][0].breakdown)
            print(f"- {v.label}: {parts}; codecs {samples[v.key][-1].codecs}")
    print(f"load average at end {loadavg()}")
    sys.stdout.flush()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace, workdir: Path) -> None:
    print(f"command: {shlex.join(sys.orig_argv)}")
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.1f} GiB RAM, "
          f"CUDA available: {torch.cuda.is_available()}; {WORLD} ranks with 1 torch thread "
          f"each; load average at start {loadavg()}")
    print(git_facts())
    print(f"scratch dir: {workdir}")
    policy_yaml = workdir / "policy.yaml"
    policy_yaml.write_text(POLICY_YAML)
    sys.stdout.flush()  # the forked ranks inherit this buffer
    ctx = mp.start_processes(rank_main, args=(free_port(), args, workdir, policy_yaml),
                             nprocs=WORLD, join=False, start_method="fork")
    assert ctx is not None
    while not ctx.join(timeout=JOIN_SECONDS):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--mb", type=float, default=320.0,
                        help="training state in MB over both ranks (params + AdamW moments)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed rounds per variant (at least 1); the table shows medians")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                        help=f"a temp dir is made (and removed) under it; default {DEFAULT_DIR}")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.mb <= 0:
        parser.error("--mb must be positive")
    # SIGTERM unwinds like Ctrl-C, so the scratch dir is removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with scratch_dir(args.dir, "dcp-") as workdir:
        run(args, workdir)


if __name__ == "__main__":
    main()
