"""Peer tier at the hardware's speed: puts, deltas and recovery against loopback and the disk.

The peer tier (SPEC §6) keeps a checkpoint as N data shards + 1 XOR parity shard in the memory
of N+1 ``ckptpilot peer serve`` daemons. One run of this script measures, on a ~``--gb`` GB
training state (fp32 ``Linear`` layers; parameters + AdamW ``exp_avg`` + ``exp_avg_sq``, built
as in bench/stall.py) and its snapshot arena (what the pilot puts), with N = 3:

1. references: loopback TCP throughput (one plain socket between two processes: ``sendall``
   of a buffer in one, ``recv_into`` a buffer in the other, both touched beforehand), the
   state's SHA256 and XXH3-128 on one thread;
2. full put: ``PeerTier.put`` of the image (parity, digests, transfers, COMMIT), each repeat
   under a fresh run id dropped right after, so daemon memory never accumulates; and, for
   comparison, the organ written to the local disk (``stage_organ`` + ``publish``);
3. puts of a next state while the peers hold the previous one (each after a full put of its
   base, as in a run): after a step that changes only the last layer (the others frozen) and
   after a step of every layer, each with ``deltas: never`` (full shards), ``auto`` (the
   client estimates per shard from a sample and sends a delta only where it would be faster)
   and ``always`` (every shard a delta, the kind with fewer bytes); the modes interleaved,
   their order rotated per repeat; how each shard travelled, bytes sent, seconds until
   ``put`` returned, and seconds more until the daemons had folded;
4. recovery of the last state: ``PeerTier.fetch`` from a fresh ``PeerTier`` (timed from its
   construction, as a restarted process pays it) with every peer up, into a fresh image (as
   a restarted process has no buffer yet) and into a buffer the caller reuses (the
   destination a restore could hand over: memory already mapped, as the loopback reference
   receives into), then with the holder of data shard 0 SIGKILLed (its shard rebuilt from
   parity); against ``read_organ`` of the same state from the local disk (reads and
   SHA256-checks every byte) with a cold page cache (``sync`` + ``drop_caches`` before each
   read, when this process may) and a warm one. Every recovered state is compared bit for bit
   with the saved arena once (untimed).

Everything runs on one host over loopback: the client, five daemons and the disk share the
same cores and memory bus, so the peer figures are the CPU, memory and loopback cost of the
protocol (digests, parity, socket copies), not a network's. The CPU seconds of this process
and of the daemons are counted per operation. Times are medians over ``--repeats``, after
one untimed put, fetch and drop (the memory of a VM that backs guest pages lazily costs
several times more on its first write).

Usage: ``.venv/bin/python bench/peer.py [--gb 1.0 | --quick] [--repeats 3] [--dir DIR]``
(``--quick`` is ``--gb 0.1``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import datetime
import gc
import hashlib
import inspect
import itertools
import logging
import math
import os
import platform
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np
import psutil
import torch
import xxhash
from scratch import DEFAULT_DIR, REPO, scratch_dir
from stall import Layout, State, build_state, state_nbytes

import ckptpilot
from ckptpilot.capture.state import Snapshot, TrainingComponents, capture
from ckptpilot.format.image import ImageMeta
from ckptpilot.tiers.peer import PeerTier
from ckptpilot.tiers.peer.auth import load_secret
from ckptpilot.tiers.peer.calls import call as _call
from ckptpilot.tiers.peer.protocol import Frame, Op
from ckptpilot.tiers.remote.archive import read_organ, stage_organ
from ckptpilot.tiers.remote.store import RemoteTier
from ckptpilot.vocab import Level, RetentionClass

DAEMONS = 5
LAYERS = 5
BYTES_PER_PARAM = 12  # fp32 parameter + AdamW exp_avg + exp_avg_sq
DATA_SHARDS = 3
MEM_LIMIT = "6GiB"
TIMEOUT_SECONDS = 120.0  # per socket step; a 1 GB shard on a loaded 2-core box is seconds
LISTENING = "ckptpilot peer listening on "
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
CODE_ROOT = Path(ckptpilot.__file__).resolve().parents[1]  # the daemons run the same code
_CHUNK = 64 << 20
_LOOPBACK_SENDER = """
import socket, sys
import numpy as np
n, port = int(sys.argv[1]), int(sys.argv[2])
buf = np.ones(n, dtype=np.uint8)  # touched: pages are in memory before the clock starts
with socket.create_connection(("127.0.0.1", port)) as sock:
    while sock.recv(1) == b"g":
        sock.sendall(memoryview(buf))
"""


# ----------------------------------------------------------------------------- daemons

_SECRET_DIR = Path(tempfile.mkdtemp(prefix="ckptpilot-bench-peer-secret-"))
SECRET_FILE = _SECRET_DIR / "peer.secret"
"""The benchmark's peer secret: every daemon it starts and every client share it, as one
job's daemons and trainers do (policies: ``tiers.peer.secret_file``)."""
KEY = load_secret(SECRET_FILE, what="the benchmark's peer secret")
atexit.register(shutil.rmtree, _SECRET_DIR, ignore_errors=True)


def call(endpoint: str, op: Op, header: dict[str, Any], **kw: Any) -> Frame:
    """``calls.call`` with the benchmark's key."""
    return _call(endpoint, op, header, key=KEY, **kw)


class Daemon:
    """One ``ckptpilot peer serve`` process on a free port of 127.0.0.1."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.endpoint = ""
        cmd = [sys.executable, "-m", "ckptpilot", "peer", "serve", "--host", "127.0.0.1",
               "--port", "0", "--mem-limit", MEM_LIMIT, "--log-level", "WARNING",
               "--secret-file", str(SECRET_FILE)]
        with open(log_path, "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                         # Spawned before any thread of ours starts.
                                         cwd=CODE_ROOT, preexec_fn=_die_with_parent,  # noqa: PLW1509
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.ps = psutil.Process(self.proc.pid)

    def wait_listening(self, timeout: float = 120.0) -> None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if line.startswith(LISTENING):
                    self.endpoint = line.strip()[len(LISTENING):]
                    return
                if not line:
                    break
        raise RuntimeError(f"peer daemon did not start; its log:\n{self.log_path.read_text()}")

    def cpu_seconds(self) -> float:
        if self.proc.poll() is not None:
            return 0.0
        t = self.ps.cpu_times()
        return t.user + t.system

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the benchmark dies, however it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def daemons(workdir: Path, count: int) -> Iterator[list[Daemon]]:
    """``count`` daemons, started in parallel; all stopped (or killed) on exit."""
    started: list[Daemon] = []
    try:
        for i in range(count):
            started.append(Daemon(workdir / f"daemon-{i}.log"))
        for d in started:
            d.wait_listening()
        yield started
    finally:
        for d in started:
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
        for d in started:
            d.stop()


def drop_run(endpoints: list[str], run_id: str) -> None:
    """Free ``run_id`` on every live daemon."""
    for endpoint in endpoints:
        with contextlib.suppress(OSError):
            call(endpoint, Op.DROP, {"run_id": run_id}, timeout_seconds=30)


def wait_folded(endpoints: list[str], run_id: str, ckpt_id: int, timeout: float = 300.0) -> float:
    """Seconds until every shard of ``ckpt_id`` is ready and no older checkpoint is held."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        shards = [s for e in endpoints
                  for s in call(e, Op.LIST, {"run_id": run_id},
                                timeout_seconds=30).header.get("shards", [])]
        if shards and all(s["ckpt_id"] == ckpt_id and s["state"] == "ready" for s in shards):
            return time.perf_counter() - t0
        time.sleep(0.005)
    raise RuntimeError(f"the daemons did not fold checkpoint {ckpt_id} within {timeout} s")


# ------------------------------------------------------------------------------ timing

@dataclass
class Sample:
    """One timed operation: wall seconds, CPU seconds of this process and of the daemons."""

    seconds: float
    client_cpu: float
    daemon_cpu: float


@dataclass
class Row:
    name: str
    nbytes: int  # state bytes the operation moves (throughput = nbytes / seconds)
    samples: list[Sample] = field(default_factory=list)
    note: str = ""

    def seconds(self) -> float:
        return median(s.seconds for s in self.samples)

    def cpu(self) -> tuple[float, float]:
        return (median(s.client_cpu for s in self.samples),
                median(s.daemon_cpu for s in self.samples))


class Clock:
    """Times an operation with the CPU seconds it cost here and in the daemons."""

    def __init__(self, procs: list[Daemon]) -> None:
        self.procs = procs

    def _cpu(self) -> tuple[float, float]:
        me = psutil.Process().cpu_times()
        return me.user + me.system, sum(d.cpu_seconds() for d in self.procs)

    def time(self, fn: Callable[[], Any]) -> tuple[Sample, Any]:
        gc.collect()
        c0, d0 = self._cpu()
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
        c1, d1 = self._cpu()
        return Sample(seconds, c1 - c0, d1 - d0), out


def loopback(nbytes: int, repeats: int) -> list[Sample]:
    """Moving ``nbytes`` over one loopback TCP connection from another process (``sendall``
    there, ``recv_into`` a touched buffer here), per repeat: seconds, and the CPU seconds of
    the receiver (``client``) and of the sender (``daemon``)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = subprocess.Popen([sys.executable, "-c", _LOOPBACK_SENDER, str(nbytes),
                                   str(listener.getsockname()[1])],
                                  preexec_fn=_die_with_parent)  # noqa: PLW1509
        them, me = psutil.Process(sender.pid), psutil.Process()

        def cpu() -> tuple[float, float]:
            a, b = me.cpu_times(), them.cpu_times()
            return a.user + a.system, b.user + b.system

        try:
            conn, _ = listener.accept()
            dest = np.ones(nbytes, dtype=np.uint8)
            view = memoryview(dest)
            out = []
            with conn:
                for _ in range(repeats):
                    (c0, s0), t0 = cpu(), time.perf_counter()
                    conn.sendall(b"g")
                    got = 0
                    while got < nbytes:
                        n = conn.recv_into(view[got:got + (1 << 20)])
                        if n == 0:
                            raise RuntimeError("the loopback sender closed early")
                        got += n
                    seconds = time.perf_counter() - t0
                    c1, s1 = cpu()
                    out.append(Sample(seconds, c1 - c0, s1 - s0))
                conn.sendall(b"q")
        finally:
            sender.wait(30)
    return out


def hash_speeds(buf: np.ndarray) -> tuple[float, float]:
    """SHA256 and XXH3-128 GB/s on one thread over ``buf``."""
    t0 = time.perf_counter()
    hashlib.sha256(buf).hexdigest()
    sha = buf.size / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    xxhash.xxh3_128_hexdigest(buf)
    return sha, buf.size / (time.perf_counter() - t0) / 1e9


# ------------------------------------------------------------------------------- state

def snapshot_of(state: State, step: int) -> Snapshot:
    model, opt = state
    return capture(TrainingComponents(model=model, optimizer=opt), step=step)


def arena_of(snapshot: Snapshot) -> np.ndarray:
    assert snapshot.arena is not None
    return snapshot.arena.numpy()


def peer_meta(snapshot: Snapshot) -> bytes:
    """The meta the pilot's writer puts next to the image."""
    return ImageMeta(step=snapshot.step, rank=0, level=Level.ORGAN, reason="bench",
                     retention_class=RetentionClass.ROUTINE, score=None,
                     created_unix=time.time(), layout=tuple(snapshot.layout),
                     state=snapshot.meta).encode()


def step(state: State, width: int, *, only_last: bool) -> None:
    """One AdamW step; with ``only_last`` the other layers are frozen (no gradient), so
    their weights and moments stay as they were."""
    model, opt = state
    frozen = list(model)[:-1] if only_last else []
    for layer in frozen:
        layer.requires_grad_(False)
    torch.manual_seed(1)
    model(torch.randn(4, width)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    for layer in frozen:
        layer.requires_grad_(True)


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Equality without a state-sized temporary."""
    return a.size == b.size and all(np.array_equal(a[i:i + _CHUNK], b[i:i + _CHUNK])
                                    for i in range(0, a.size, _CHUNK))


def drop_page_cache() -> bool:
    """``sync`` + drop clean page cache; False when this process may not (needs root)."""
    os.sync()
    try:
        DROP_CACHES.write_text("1")
    except OSError:
        return False
    return True


def tier(endpoints: list[str], run_id: str, deltas: str = "never") -> PeerTier:
    return PeerTier(endpoints, run_id=run_id, data_shards=DATA_SHARDS, deltas=deltas,
                    timeout_seconds=TIMEOUT_SECONDS, secret=KEY)


# ------------------------------------------------------------------------------ output

def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def git_facts() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else "?"

    dirty = git("status", "--porcelain", "--", "ckptpilot/tiers/peer").splitlines()
    changed = ", ".join(line[3:] for line in dirty) or "none"
    head = git("rev-parse", "--short", "HEAD").strip()
    where = "" if CODE_ROOT == REPO else f"; ckptpilot imported from {CODE_ROOT}"
    return f"git HEAD {head}; uncommitted in ckptpilot/tiers/peer: {changed}{where}"


def gb(v: float) -> str:
    return f"{v / 1e9:.3f} GB"


def secs(values: list[Sample]) -> str:
    return ", ".join(f"{v.seconds:.3f}" for v in values)


# --------------------------------------------------------------------------------- run

def layout_for(gb: float) -> Layout:
    """Five square layers (so that four can be frozen), widths a multiple of 64: at 1 GB the
    5 x Linear(4096, 4096) state of issue 15."""
    params = gb * 1e9 / BYTES_PER_PARAM / LAYERS
    return Layout(width=max(64, round(math.isqrt(int(params)) / 64) * 64), layers=LAYERS)


def run(args: argparse.Namespace, workdir: Path) -> None:
    layout = layout_for(args.gb)
    print(f"command: {shlex.join(sys.orig_argv)}")
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs (torch threads {torch.get_num_threads()}), "
          f"{psutil.virtual_memory().total / 2**30:.1f} GiB RAM, CUDA available: "
          f"{torch.cuda.is_available()}; load average at start {loadavg()}")
    print(git_facts())
    print(f"peers: {DAEMONS} `ckptpilot peer serve` daemons on 127.0.0.1 (--mem-limit "
          f"{MEM_LIMIT}), {DATA_SHARDS} data shards + parity; client, daemons and disk share "
          "the CPUs above (loopback, no network)")
    repeats = args.repeats

    # Daemons first: they are forked before this process runs any thread (torch's pools).
    with daemons(workdir, DAEMONS) as procs:
        endpoints = [d.endpoint for d in procs]
        clock = Clock(procs)
        state = build_state(layout)
        nbytes = state_nbytes(state)
        first = snapshot_of(state, step=1)
        image1, meta1 = arena_of(first), peer_meta(first)
        print(f"state: {layout.layers} x Linear({layout.width}, {layout.width}) fp32 + AdamW "
              f"exp_avg/exp_avg_sq = {layout.params / 1e6:.1f} M params, {gb(nbytes)}; "
              f"image: the snapshot arena, {gb(image1.size)}, + {len(meta1)} bytes of meta")

        # Warm-up, untimed: on a VM that backs guest memory lazily, the first bytes a process
        # ever writes cost several times more; a daemon that has served a while has its
        # memory. One full put, fetch and drop does that for the daemons and this process.
        with tier(endpoints, "bench-warm-up") as t:
            t.put(0, image1, meta1)
            t.fetch(0)
        drop_run(endpoints, "bench-warm-up")

        # 1. References.
        wire = Row("loopback TCP, 1 stream, process to process (reference)", image1.size)
        wire.samples = loopback(image1.size, repeats)
        sha_gbs, xxh_gbs = hash_speeds(image1)
        print(f"one thread over the image: SHA256 {sha_gbs:.2f} GB/s, XXH3-128 {xxh_gbs:.2f} "
              "GB/s")

        # 2. Full puts, and the organ to the local disk.
        full = Row(f"peer put, full, N={DATA_SHARDS}, the first of a run (the peers hold "
                   "nothing of it)", image1.size)
        sent_full = 0
        for r in range(repeats):
            run_id = f"bench-full-{r}"
            with tier(endpoints, run_id) as t:
                sample, result = clock.time(lambda t=t, im=image1: t.put(1, im, meta1))
            full.samples.append(sample)
            sent_full = result.bytes_sent
            drop_run(endpoints, run_id)
        full.note = f"{gb(sent_full)} sent"

        # 3. Delta puts: frozen layers (base: first), then every layer moving (base: frozen).
        step(state, layout.width, only_last=True)
        frozen = snapshot_of(state, step=2)
        step(state, layout.width, only_last=False)
        moved = snapshot_of(state, step=3)
        scenarios = (("4 of 5 layers frozen", first, frozen),
                     ("one AdamW step of every layer", frozen, moved))
        modes = ("never", "auto", "always")
        deltas = {(what, mode): Row(f"peer put, {what}, deltas: {mode}", image1.size)
                  for what, _, _ in scenarios for mode in modes}
        kinds: dict[tuple[str, str], list[str]] = {key: [] for key in deltas}
        folds: dict[tuple[str, str], list[float]] = {key: [] for key in deltas}
        for r in range(repeats):
            # The modes interleaved and their order rotated per repeat, so that drift and the
            # memory each put leaves behind in the daemons hit them alike.
            turn = modes[r % len(modes):] + modes[:r % len(modes)]
            for (what, base, new), mode in itertools.product(scenarios, turn):
                run_id = f"bench-delta-{mode}-{base.step}-{r}"
                with tier(endpoints, run_id, deltas=mode) as t:
                    t.put(base.step, arena_of(base), peer_meta(base))  # measures the wire
                    sample, result = clock.time(
                        lambda t=t, base=base, new=new: t.put(
                            new.step, arena_of(new), peer_meta(new),
                            base=(base.step, arena_of(base))))
                folds[what, mode].append(wait_folded(endpoints, run_id, new.step))
                deltas[what, mode].samples.append(sample)
                # Checkouts before the encodings field counted shards only.
                how = ("/".join(getattr(result, "encodings", ()))
                       or f"{result.delta_shards} delta + {result.full_shards} full")
                kinds[what, mode].append(f"{how}: {gb(result.bytes_sent)}")
                drop_run(endpoints, run_id)
        for key, row in deltas.items():
            row.note = (f"{'; '.join(dict.fromkeys(kinds[key]))}; folded "
                        f"{median(folds[key]):.3f} s after")
        del first, frozen
        gc.collect()

        # The organ of the last state on the local disk: the recovery baseline.
        remote = RemoteTier(str(workdir / "remote"))
        organ_w = Row("organ to local disk (stage_organ + publish: SHA256, fsync)", nbytes)
        name = ""
        for _ in range(repeats):
            if name:
                remote.remove(name)
            os.sync()
            sample, staged = clock.time(lambda: stage_organ(remote, moved, reason="bench"))
            t0 = time.perf_counter()
            remote.publish(staged.staging, staged.name)
            sample.seconds += time.perf_counter() - t0
            organ_w.samples.append(sample)
            name = staged.name

        # 4. Recovery of the last state.
        run_id = "bench-recovery"
        image3 = arena_of(moved)
        with tier(endpoints, run_id) as t:
            put = t.put(moved.step, image3, peer_meta(moved))

        def recover(into: np.ndarray | None = None) -> Any:
            with tier(endpoints, run_id) as fresh:
                return fresh.fetch(moved.step, **({} if into is None else {"into": into}))

        # Checkouts before fetch(into=) received into a fresh image only.
        reusable = (np.ones(image3.size, dtype=np.uint8)
                    if "into" in inspect.signature(PeerTier.fetch).parameters else None)

        cold_ok = drop_page_cache()
        fetch = Row(f"peer fetch, N={DATA_SHARDS}, fresh PeerTier, every peer up", image3.size)
        into = Row(f"peer fetch, N={DATA_SHARDS}, the same into a buffer the caller reuses",
                   image3.size)
        cold = Row("read_organ from local disk, cold page cache", nbytes)
        warm = Row("read_organ from local disk, warm page cache", nbytes)
        for r in range(repeats):
            sample, got = clock.time(recover)
            if r == 0 and not same_bytes(np.frombuffer(memoryview(got.image), np.uint8),
                                         image3):
                raise AssertionError("peer fetch: the image differs from the saved arena")
            fetch.samples.append(sample)
            fetch.note = f"{gb(got.bytes_fetched)} received"
            del got
            if reusable is not None:
                sample, got = clock.time(lambda: recover(reusable))
                if r == 0 and not same_bytes(got.image, image3):
                    raise AssertionError("peer fetch into: the image differs from the arena")
                into.samples.append(sample)
                del got
            for row in (cold, warm):
                if row is cold and cold_ok:
                    drop_page_cache()
                sample, organ = clock.time(lambda: read_organ(remote, name))
                if r == 0:
                    for key, ref in moved.tensors.items():
                        if key.startswith(("model/", "optimizer/")) and not torch.equal(
                                organ.tensors[key], ref):
                            raise AssertionError(f"read_organ: {key} differs")
                row.samples.append(sample)
                del organ
        victim = next(d for d in procs if d.endpoint == put.endpoints[0])
        victim.kill()
        degraded = Row(f"peer fetch, N={DATA_SHARDS}, holder of shard 0 SIGKILLed (parity "
                       "rebuild)", image3.size)
        for r in range(repeats):
            sample, got = clock.time(recover)
            if got.rebuilt_shard != 0:
                raise AssertionError(f"expected shard 0 rebuilt, got {got.rebuilt_shard}")
            if r == 0 and not same_bytes(np.frombuffer(memoryview(got.image), np.uint8),
                                         image3):
                raise AssertionError("parity rebuild: the image differs from the saved arena")
            degraded.samples.append(sample)
            degraded.note = f"{gb(got.bytes_fetched)} received"
            del got
        drop_run([d.endpoint for d in procs if d is not victim], run_id)

    # ------------------------------------------------------------------ table
    lo_rate = wire.nbytes / wire.seconds()
    print()
    cache = ("cold = `sync` + `echo 1 > /proc/sys/vm/drop_caches` before each read" if cold_ok
             else "cold rows NOT cold: drop_caches is not writable here (needs root)")
    print(f"## Peer tier, one run (medians of {repeats}; {cache})")
    print()
    print("vs loopback = the row's GB/s / loopback TCP GB/s; vs disk = the disk row's seconds / "
          "the row's seconds (puts: the organ write; fetches: read_organ cold / warm); above 1 "
          "= faster. CPU = CPU seconds of this process / of the five daemons (loopback: of the "
          "receiver / the sender).")
    print()
    print("| operation | seconds | GB/s | vs loopback | vs disk | CPU s (client / daemons) | "
          "notes |")
    print("|---|---:|---:|---:|---:|---:|---|")
    organ_s, cold_s, warm_s = organ_w.seconds(), cold.seconds(), warm.seconds()

    def line(row: Row, disk: str) -> None:
        s = row.seconds()
        client, peers = row.cpu()
        print(f"| {row.name} | {s:.3f} | {row.nbytes / s / 1e9:.2f} | "
              f"{row.nbytes / s / lo_rate:.2f}x | {disk} | {client:.2f} / {peers:.2f} | "
              f"{row.note} |")

    line(wire, "-")
    line(full, f"{organ_s / full.seconds():.2f}x")
    for row in deltas.values():
        line(row, f"{organ_s / row.seconds():.2f}x")
    line(organ_w, "1.00x")
    for row in (fetch, into, degraded):
        if not row.samples:
            continue
        s = row.seconds()
        line(row, f"{cold_s / s:.2f}x / {warm_s / s:.2f}x")
    line(cold, "1.00x")
    line(warm, "1.00x")
    print()
    for row in (wire, full, *deltas.values(), organ_w, fetch, into, degraded, cold, warm):
        if row.samples:
            print(f"{row.name} (s): {secs(row.samples)}")
    f_s, d_s = fetch.seconds(), degraded.seconds()
    auto = ", ".join(f"{deltas[what, 'auto'].seconds() / deltas[what, 'never'].seconds():.2f}x "
                     f"({what})" for what, _, _ in scenarios)
    print()
    print(f"goals: peer recovery {fetch.nbytes / f_s / lo_rate:.0%} of loopback (>= 80 %)"
          + (f", {into.nbytes / into.seconds() / lo_rate:.0%} into a reused buffer"
             if into.samples else "")
          + f"; {cold_s / f_s:.2f}x / {warm_s / f_s:.2f}x faster than read_organ cold / warm "
          f"(>= 2x); one peer lost {d_s / f_s:.2f}x the intact fetch (<= 1.3x); a put with "
          f"deltas: auto took {auto} the same put with deltas: never (<= 1x)")
    print(f"load average at end {loadavg()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--gb", type=float, default=1.0,
                        help="training state size in GB (params + AdamW moments)")
    parser.add_argument("--quick", action="store_true", help="the same run at --gb 0.1")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                        help=f"a temp dir is made (and removed) under it; default {DEFAULT_DIR}")
    parser.add_argument("--repeats", type=int, default=3,
                        help="repeats of every measurement (at least 1)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.quick:
        args.gb = 0.1
    # The client's warning on each parity rebuild would interleave with the tables.
    logging.getLogger("ckptpilot").setLevel(logging.ERROR)
    # SIGTERM unwinds like Ctrl-C, so the daemons are stopped and the scratch dir removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with scratch_dir(args.dir, "peer-") as workdir:
        run(args, workdir)


if __name__ == "__main__":
    main()
