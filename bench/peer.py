"""Peer tier: save throughput and recovery time, against an organ on disk and ``torch.load``.

The peer tier (SPEC §6) keeps a checkpoint as N data shards + 1 XOR parity shard in the memory
of N+1 ``ckptpilot peer serve`` daemons. This script measures it on a ~``--gb`` GB training
state (fp32 ``Linear`` layers; parameters + AdamW ``exp_avg`` + ``exp_avg_sq`` after one real
AdamW step, built as in bench/stall.py). What is put is what the pilot puts: the snapshot's
arena (``capture(...).arena``, one contiguous image) plus a small JSON meta in the pilot's peer
format. Five daemons run on 127.0.0.1 (random ports), started once; one run measures:

1. save throughput: ``PeerTier.put`` of the full image with N = 1, 2, 3, 4 data shards (+1
   parity each; the client picks N+1 of the five daemons), each repeat under a fresh run id,
   dropped on every daemon (``Op.DROP``) right after, so daemon memory never accumulates.
   GB/s = state bytes / put seconds (parity, SHA256 of every shard, transfer, COMMIT).
   Then a delta put for N=3: one more optimizer step, a second snapshot, ``put(..., base=)``
   against the first (what the pilot does for a pulse); bytes sent and seconds, plus how long
   the daemons took to fold the deltas in the background after ``put`` returned. In the same
   run, for the same (second) state: the organ written to a directory on the scratch disk
   (``stage_organ`` + ``publish``: safetensors with SHA256, fsync, atomic rename) and a
   ``torch.save`` of the model and optimizer state dicts + ``os.fsync`` — the baselines;
2. recovery of that second state into CPU tensors: ``PeerTier.fetch`` from a fresh
   ``PeerTier`` object (timed from its construction, as a restarted process would pay it)
   plus ``arena_views`` over the fetched image, against ``read_organ`` (reads and re-hashes the
   organ) and ``torch.load(weights_only=True)``, each from a cold page cache
   (``sync`` + ``/proc/sys/vm/drop_caches`` before every read, when this process may write
   it; otherwise said in the output) and again right after with the cache warm; then the
   fetch once more with the daemon holding data shard 0 SIGKILLed, so the shard is rebuilt
   from parity. No variant loads the tensors into a model (that cost is the same for all).
   Every variant's result is checked bit for bit against the saved state once (untimed).

Everything runs on one host over loopback: the client, five daemons and the disk baselines
share the same cores and memory bus, so the peer numbers are the CPU, memory and loopback cost
of the protocol (hashing, parity, socket copies), not a network's. Times are medians over
``--repeats``; ratios are baseline/variant, so above 1 means the variant is faster.

Usage: ``.venv/bin/python bench/peer.py [--gb 1.0] [--dir DIR] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import hashlib
import json
import logging
import os
import platform
import select
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np
import psutil
import torch
from scratch import DEFAULT_DIR, REPO, scratch_dir
from stall import Layout, State, build_state, state_nbytes

from ckptpilot.format.image import ImageMeta
from ckptpilot.state import Snapshot, TrainingComponents, arena_views, capture
from ckptpilot.storage.archive import read_organ, stage_organ
from ckptpilot.tiers.peer import PeerTier
from ckptpilot.tiers.peer.protocol import Op, call
from ckptpilot.tiers.remote import RemoteTier
from ckptpilot.vocab import Level, RetentionClass

DAEMONS = 5
DATA_SHARDS = (1, 2, 3, 4)
RECOVERY_SHARDS = 3
MEM_LIMIT = "6GiB"
TIMEOUT_SECONDS = 120.0  # per socket step; a 1 GB shard on a loaded 2-core box is seconds
LISTENING = "ckptpilot peer listening on "
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
_CHUNK = 64 << 20


# ----------------------------------------------------------------------------- daemons

class Daemon:
    """One ``ckptpilot peer serve`` process on a free port of 127.0.0.1."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.endpoint = ""
        cmd = [sys.executable, "-m", "ckptpilot", "peer", "serve", "--host", "127.0.0.1",
               "--port", "0", "--mem-limit", MEM_LIMIT, "--log-level", "WARNING"]
        with open(log_path, "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                         # Spawned before any thread of ours starts.
                                         cwd=REPO, preexec_fn=_die_with_parent,  # noqa: PLW1509
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_listening(self, timeout: float = 60.0) -> None:
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


def drop_run(endpoints: list[str], run_id: str) -> int:
    """Free ``run_id`` on every live daemon; returns the bytes they freed."""
    freed = 0
    for endpoint in endpoints:
        with contextlib.suppress(OSError):
            reply = call(endpoint, Op.DROP, {"run_id": run_id}, timeout_seconds=30)
            freed += int(reply.header.get("freed", 0))
    return freed


def held_bytes(endpoints: list[str]) -> int:
    """Shard bytes the live daemons hold in all (only one run is held at a time here)."""
    return sum(int(call(e, Op.PING, {}, timeout_seconds=30).header["mem_used"])
               for e in endpoints)


def wait_folded(endpoints: list[str], run_id: str, ckpt_id: int, timeout: float = 300.0) -> float:
    """Seconds until every shard of ``ckpt_id`` is ready and no older checkpoint is held."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        shards = [s for e in endpoints
                  for s in call(e, Op.LIST, {"run_id": run_id},
                                timeout_seconds=30).header.get("shards", [])]
        if shards and all(s["ckpt_id"] == ckpt_id and s["state"] == "ready" for s in shards):
            return time.perf_counter() - t0
        time.sleep(0.01)
    raise RuntimeError(f"the daemons did not fold checkpoint {ckpt_id} within {timeout} s")


# ------------------------------------------------------------------------------- state

def snapshot_of(state: State, step: int) -> Snapshot:
    model, opt = state
    return capture(TrainingComponents(model=model, optimizer=opt), step=step)


def peer_meta(snapshot: Snapshot) -> bytes:
    """The meta the pilot's writer puts next to the image."""
    return ImageMeta(step=snapshot.step, rank=0, level=Level.ORGAN, reason="bench",
                     retention_class=RetentionClass.ROUTINE, score=None,
                     created_unix=time.time(), layout=tuple(snapshot.layout),
                     state=snapshot.meta).encode()


def one_more_step(state: State, width: int) -> None:
    model, opt = state
    torch.manual_seed(1)
    model(torch.randn(4, width)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Equality without a state-sized temporary."""
    return a.size == b.size and all(np.array_equal(a[i:i + _CHUNK], b[i:i + _CHUNK])
                                    for i in range(0, a.size, _CHUNK))


def check_tensors(got: dict[str, torch.Tensor], snapshot: Snapshot, what: str) -> None:
    for key, ref in snapshot.tensors.items():
        if key.startswith(("model/", "optimizer/")) and not torch.equal(got[key], ref):
            raise AssertionError(f"{what}: {key} differs from the saved state")


def check_torch_load(loaded: dict[str, Any], state: State) -> None:
    model, opt = state
    for name, ref in model.state_dict().items():
        if not torch.equal(loaded["model"][name], ref):
            raise AssertionError(f"torch.load: model/{name} differs from the saved state")
    saved = opt.state_dict()["state"]
    for index, entry in loaded["optimizer"]["state"].items():
        for key, value in entry.items():
            if not torch.equal(value, saved[index][key]):
                raise AssertionError(f"torch.load: optimizer {index}/{key} differs")


def drop_page_cache() -> bool:
    """``sync`` + drop clean page cache; False when this process may not (needs root)."""
    os.sync()
    try:
        DROP_CACHES.write_text("1")
    except OSError:
        return False
    return True


# ------------------------------------------------------------------------------ timing

@dataclass
class PutStat:
    seconds: list[float]
    bytes_sent: int
    held: int


def full_puts(endpoints: list[str], snapshot: Snapshot, meta: bytes, data_shards: int,
              repeats: int) -> PutStat:
    """``repeats`` full puts of ``snapshot`` with ``data_shards``, each dropped right after."""
    assert snapshot.arena is not None
    image = snapshot.arena.numpy()
    seconds, sent, held = [], 0, 0
    for r in range(repeats):
        run_id = f"bench-n{data_shards}-r{r}"
        with PeerTier(endpoints, run_id=run_id, data_shards=data_shards,
                      timeout_seconds=TIMEOUT_SECONDS) as tier:
            gc.collect()
            t0 = time.perf_counter()
            result = tier.put(1, image, meta)
            seconds.append(time.perf_counter() - t0)
            sent = result.bytes_sent
            held = held_bytes(endpoints)
            drop_run(endpoints, run_id)
    return PutStat(seconds, sent, held)


def disk_saves(state: State, snapshot: Snapshot, workdir: Path, repeats: int
               ) -> tuple[list[float], list[float], RemoteTier, str, Path]:
    """Organ write and ``torch.save`` + fsync of the same state, ``repeats`` times each; the
    previous output of each is deleted (untimed) before the next. The last ones stay."""
    model, opt = state
    remote = RemoteTier(str(workdir / "remote"))
    pt = workdir / "state.pt"
    organ_s, torch_s, name = [], [], ""
    for _ in range(repeats):
        if name:
            remote.remove(name)
        os.sync()
        t0 = time.perf_counter()
        staged = stage_organ(remote, snapshot, reason="bench")
        remote.publish(staged.staging, staged.name)
        organ_s.append(time.perf_counter() - t0)
        name = staged.name

        pt.unlink(missing_ok=True)
        os.sync()
        t0 = time.perf_counter()
        with open(pt, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        torch_s.append(time.perf_counter() - t0)
    return organ_s, torch_s, remote, name, pt


@dataclass
class Recovered:
    seconds: float
    construct_seconds: float  # of ``seconds``: the PeerTier's construction (it probes peers)
    image: bytearray
    tensors: dict[str, torch.Tensor]  # views of ``image``
    rebuilt_shard: int | None
    bytes_fetched: int


def peer_recover(endpoints: list[str], run_id: str, ckpt_id: int) -> Recovered:
    """A restarted process's recovery: a fresh PeerTier, fetch, tensors as views of the
    image (the pilot's ``_restore_from_peer`` up to loading them into the live objects)."""
    gc.collect()
    t0 = time.perf_counter()
    tier = PeerTier(endpoints, run_id=run_id, data_shards=RECOVERY_SHARDS,
                    timeout_seconds=TIMEOUT_SECONDS)
    try:
        built = time.perf_counter() - t0
        fetched = tier.fetch(ckpt_id)
        layout = ImageMeta.decode(fetched.meta).layout
        tensors = arena_views(torch.frombuffer(fetched.image, dtype=torch.uint8), layout)
        seconds = time.perf_counter() - t0
    finally:
        tier.close()
    return Recovered(seconds, built, fetched.image, tensors, fetched.rebuilt_shard,
                     fetched.bytes_fetched)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def reference_speeds() -> tuple[float, float]:
    """Single-thread SHA256 and memcpy throughput (GB/s) on 256 MB, for reading the numbers."""
    buf = np.ones(256 << 20, dtype=np.uint8)
    out = np.empty_like(buf)
    t0 = time.perf_counter()
    hashlib.sha256(buf).hexdigest()
    sha = buf.size / (time.perf_counter() - t0) / 1e9
    np.copyto(out, buf)  # fault the pages in first
    t0 = time.perf_counter()
    np.copyto(out, buf)
    copy = buf.size / (time.perf_counter() - t0) / 1e9
    return sha, copy


# ------------------------------------------------------------------------------ output

def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def git_facts() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else "?"

    dirty = git("status", "--porcelain", "--", "ckptpilot").splitlines()
    changed = ", ".join(line[3:] for line in dirty) or "none"
    head = git("rev-parse", "--short", "HEAD").strip()
    return f"git HEAD {head}; uncommitted in ckptpilot/: {changed}"


def gb(v: float) -> str:
    return f"{v / 1e9:.3f} GB"


def ratio(baseline: float, value: float) -> str:
    return f"{baseline / value:.2f}x" if value > 0 else "n/a"


def run(args: argparse.Namespace, workdir: Path) -> None:
    layout = Layout.for_gb(args.gb)
    print(f"command: {shlex.join(sys.orig_argv)}")
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs (torch threads {torch.get_num_threads()}), "
          f"{psutil.virtual_memory().total / 2**30:.1f} GiB RAM, CUDA available: "
          f"{torch.cuda.is_available()}; load average at start {loadavg()}")
    print(git_facts())
    print(f"scratch dir: {workdir}")
    print(f"peers: {DAEMONS} `ckptpilot peer serve` daemons on 127.0.0.1 (--mem-limit "
          f"{MEM_LIMIT}), on this same host: loopback, no network; client, daemons and disk "
          "share the CPUs above")

    # Daemons first: they are forked before this process runs any thread (torch's pools).
    with daemons(workdir, DAEMONS) as procs:
        endpoints = [d.endpoint for d in procs]
        sha_gbs, copy_gbs = reference_speeds()
        print(f"reference on this machine: SHA256 {sha_gbs:.2f} GB/s, memcpy {copy_gbs:.2f} "
              "GB/s (one thread, 256 MB)")
        state = build_state(layout)
        nbytes = state_nbytes(state)
        print(f"state: {layout.layers} x Linear({layout.width}, {layout.width}) fp32 + AdamW "
              f"exp_avg/exp_avg_sq = {layout.params / 1e6:.1f} M params, {nbytes / 1e9:.3f} GB")
        first = snapshot_of(state, step=1)
        assert first.arena is not None
        meta1 = peer_meta(first)
        print(f"image: the snapshot arena, {first.arena.numel() / 1e9:.3f} GB, + "
              f"{len(meta1)} bytes of JSON meta")

        # 1. Full puts, N = 1..4.
        puts = {n: full_puts(endpoints, first, meta1, n, args.repeats) for n in DATA_SHARDS}

        # Delta put for N = 3: the base in full, one more step, the second snapshot as deltas.
        run_id = "bench-recovery"
        tier = PeerTier(endpoints, run_id=run_id, data_shards=RECOVERY_SHARDS,
                        timeout_seconds=TIMEOUT_SECONDS)
        try:
            tier.put(1, first.arena.numpy(), meta1)
            one_more_step(state, layout.width)
            second = snapshot_of(state, step=2)
            assert second.arena is not None
            gc.collect()
            t0 = time.perf_counter()
            delta = tier.put(2, second.arena.numpy(), peer_meta(second),
                             base=(1, first.arena.numpy()))
            delta_s = time.perf_counter() - t0
        finally:
            tier.close()
        fold_s = wait_folded(endpoints, run_id, 2)
        delta_held = held_bytes(endpoints)
        del first
        gc.collect()
        if delta.delta_shards != RECOVERY_SHARDS + 1:
            print(f"note: the delta put sent only {delta.delta_shards} of "
                  f"{RECOVERY_SHARDS + 1} shards as deltas ({delta.full_shards} full)")

        # Disk baselines for the second state (also the files the recovery reads).
        organ_s, torch_s, remote, organ_name, pt = disk_saves(state, second, workdir,
                                                              args.repeats)
        organ_bytes = sum(f["bytes"] for f in
                          json.loads(remote.read_bytes(f"{organ_name}/manifest.json"))
                          ["files"].values())
        torch_bytes = pt.stat().st_size

        # 2. Recovery rounds.
        cold_ok = drop_page_cache()
        rec: dict[str, list[float]] = {k: [] for k in (
            "peer", "peer_built", "organ_cold", "torch_cold", "organ_warm", "torch_warm")}
        fetched_bytes = 0
        arena2 = second.arena.numpy()
        for r in range(args.repeats):
            got = peer_recover(endpoints, run_id, 2)
            if got.rebuilt_shard is not None:
                raise AssertionError(f"peer fetch rebuilt shard {got.rebuilt_shard} with all "
                                     "peers up")
            if r == 0:
                if not same_bytes(np.frombuffer(got.image, dtype=np.uint8), arena2):
                    raise AssertionError("peer fetch: the image differs from the saved arena")
                check_tensors(got.tensors, second, "peer fetch")
            rec["peer"].append(got.seconds)
            rec["peer_built"].append(got.construct_seconds)
            fetched_bytes = got.bytes_fetched
            del got
            for kind, read in (("organ", lambda: read_organ(remote, organ_name)),
                               ("torch", lambda: torch.load(pt, weights_only=True))):
                if cold_ok:
                    drop_page_cache()
                seconds, out = timed(read)
                rec[f"{kind}_cold"].append(seconds)
                if r == 0:
                    if kind == "organ":
                        check_tensors(out.tensors, second, "read_organ")
                    else:
                        check_torch_load(out, state)
                del out
                seconds, out = timed(read)
                rec[f"{kind}_warm"].append(seconds)
                del out

        # The holder of data shard 0 is SIGKILLed: the fetch rebuilds it from parity.
        victim = next(d for d in procs if d.endpoint == delta.endpoints[0])
        victim.kill()
        degraded: list[float] = []
        for r in range(args.repeats):
            got = peer_recover(endpoints, run_id, 2)
            if got.rebuilt_shard != 0:
                raise AssertionError(f"expected shard 0 rebuilt from parity, got "
                                     f"{got.rebuilt_shard}")
            if r == 0:
                check_tensors(got.tensors, second, "peer fetch with parity rebuild")
            degraded.append(got.seconds)
            degraded_bytes = got.bytes_fetched
            del got
        drop_run([d.endpoint for d in procs if d is not victim], run_id)

    # ------------------------------------------------------------------ tables
    full3 = median(puts[RECOVERY_SHARDS].seconds)
    full3_sent = puts[RECOVERY_SHARDS].bytes_sent
    torch_save = median(torch_s)
    print()
    print(f"## Saves (state {gb(nbytes)}; times are medians of {args.repeats}; ratio = "
          "torch.save + fsync seconds / row seconds, above 1 = faster than torch.save)")
    print()
    print("| save | shards (data + parity) | bytes sent / written | held on peers | "
          "seconds | GB/s (state / s) | vs torch.save + fsync |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n, p in puts.items():
        s = median(p.seconds)
        print(f"| peer put, full, N={n} | {n} + 1 | {gb(p.bytes_sent)} | {gb(p.held)} | "
              f"{s:.3f} | {nbytes / s / 1e9:.2f} | {ratio(torch_save, s)} |")
    print(f"| peer put, delta after one AdamW step, N={RECOVERY_SHARDS} (1 run) | "
          f"{RECOVERY_SHARDS} + 1 | {gb(delta.bytes_sent)} | {gb(delta_held)} | "
          f"{delta_s:.3f} | {nbytes / delta_s / 1e9:.2f} | {ratio(torch_save, delta_s)} |")
    organ = median(organ_s)
    print(f"| organ to disk (stage_organ + publish: safetensors, SHA256, fsync) | - | "
          f"{gb(organ_bytes)} | - | {organ:.3f} | {nbytes / organ / 1e9:.2f} | "
          f"{ratio(torch_save, organ)} |")
    print(f"| torch.save + fsync (baseline) | - | {gb(torch_bytes)} | - | {torch_save:.3f} | "
          f"{nbytes / torch_save / 1e9:.2f} | 1.00x |")
    print()
    cache = ("cold = `sync` + `echo 1 > /proc/sys/vm/drop_caches` before each read"
             if cold_ok else "cold rows NOT cold: /proc/sys/vm/drop_caches is not writable "
             "here (needs root), so every read found the file in the page cache")
    print(f"## Recovery into CPU tensors (medians of {args.repeats}; {cache}; ratio = "
          "torch.load seconds / row seconds in the same cache state, above 1 = faster)")
    print()
    print("| recovery | bytes read | seconds | GB/s (state / s) | vs torch.load |")
    print("|---|---:|---:|---:|---:|")
    tc, tw = median(rec["torch_cold"]), median(rec["torch_warm"])
    rows = [
        (f"peer fetch, N={RECOVERY_SHARDS}, fresh PeerTier (no page cache involved)",
         fetched_bytes, median(rec["peer"]), tc, "cold"),
        (f"peer fetch, N={RECOVERY_SHARDS}, holder of shard 0 SIGKILLed (parity rebuild)",
         degraded_bytes, median(degraded), tc, "cold"),
        ("read_organ, cold cache", organ_bytes, median(rec["organ_cold"]), tc, "cold"),
        ("torch.load(weights_only=True), cold cache", torch_bytes, tc, tc, "cold"),
        ("read_organ, warm cache", organ_bytes, median(rec["organ_warm"]), tw, "warm"),
        ("torch.load(weights_only=True), warm cache", torch_bytes, tw, tw, "warm"),
    ]
    for name, read, s, base, which in rows:
        print(f"| {name} | {gb(read)} | {s:.3f} | {nbytes / s / 1e9:.2f} | "
              f"{ratio(base, s)} ({which}) |")
    print()

    def secs(values: list[float]) -> str:
        return ", ".join(f"{v:.3f}" for v in values)

    for n, p in puts.items():
        print(f"put N={n} (s): {secs(p.seconds)}")
    print(f"delta put N={RECOVERY_SHARDS}: {delta.delta_shards} delta + {delta.full_shards} full "
          f"shards, {gb(delta.bytes_sent)} sent ({delta.bytes_sent / full3_sent:.1%} of the "
          f"{gb(full3_sent)} a full N={RECOVERY_SHARDS} put sends), "
          f"{delta_s:.3f} s vs full {full3:.3f} s ({ratio(full3, delta_s)}); the daemons "
          f"finished folding {fold_s:.3f} s after put returned")
    print(f"organ write (s): {secs(organ_s)}; torch.save + fsync (s): {secs(torch_s)}")
    print(f"peer fetch (s): {secs(rec['peer'])}, of which PeerTier construction (probes): "
          f"{secs(rec['peer_built'])}; with parity rebuild (s): {secs(degraded)}")
    print(f"read_organ cold (s): {secs(rec['organ_cold'])}; warm: {secs(rec['organ_warm'])}")
    print(f"torch.load cold (s): {secs(rec['torch_cold'])}; warm: {secs(rec['torch_warm'])}")
    print(f"load average at end {loadavg()}")
    print()
    print(reading(nbytes, puts, delta_s, delta.bytes_sent, fold_s, torch_save, organ,
                  median(rec["peer"]), median(degraded), median(rec["organ_cold"]), tc,
                  cold_ok, sha_gbs))


def reading(nbytes: int, puts: dict[int, PutStat], delta_s: float, delta_sent: int,
            fold_s: float, torch_save: float, organ: float, fetch: float, degraded: float,
            organ_cold: float, torch_cold: float, cold_ok: bool, sha_gbs: float) -> str:
    """One paragraph on what the numbers say, worded from the numbers themselves."""
    rates = {n: nbytes / median(p.seconds) / 1e9 for n, p in puts.items()}
    best = max(rates, key=lambda n: rates[n])
    worst = min(rates, key=lambda n: rates[n])
    full3 = median(puts[RECOVERY_SHARDS].seconds)

    def faster(base: float, value: float) -> str:
        r = base / value
        return f"{r:.2f}x faster than" if r >= 1 else f"{1 / r:.2f}x slower than"

    full3_sent = puts[RECOVERY_SHARDS].bytes_sent
    why = (" (one AdamW step changes every weight and both moments, so few XOR bytes are "
           "zero)" if delta_sent > full3_sent / 2 else "")
    cold = "a cold page cache" if cold_ok else "the page cache (it could not be dropped)"
    return (
        f"Reading: all peers share this host's cores with the client, so a put is bounded by "
        f"CPU and memory bandwidth, not a link: the client XORs the parity and SHA256-hashes "
        f"every shard ({sha_gbs:.2f} GB/s per thread here), the kernel copies every byte "
        f"through loopback, and each daemon hashes what it receives. Full puts ran at "
        f"{rates[worst]:.2f}-{rates[best]:.2f} GB/s of state (best N={best}, worst "
        f"N={worst}); N=1 sends and holds 2x the state (the parity is a full copy), N=4 "
        f"1.25x. The best full put was {faster(torch_save, nbytes / rates[best] / 1e9)} "
        f"torch.save + fsync to the local disk ({torch_save:.3f} s) and "
        f"{faster(organ, nbytes / rates[best] / 1e9)} the organ write ({organ:.3f} s). The "
        f"delta put after one AdamW step sent {delta_sent / full3_sent:.0%} of the bytes of a "
        f"full N={RECOVERY_SHARDS} put{why} and "
        f"took {delta_s:.3f} s, {faster(full3, delta_s)} the full N={RECOVERY_SHARDS} put; "
        f"the daemons needed {fold_s:.3f} s more to fold it. Recovery from the peers took "
        f"{fetch:.3f} s, {faster(torch_cold, fetch)} torch.load from {cold} "
        f"({torch_cold:.3f} s) and {faster(organ_cold, fetch)} read_organ ({organ_cold:.3f} s); "
        f"with one daemon SIGKILLed the parity rebuild made it {degraded:.3f} s "
        f"({degraded / fetch:.2f}x the intact fetch). On a real cluster the shards would "
        f"travel over the network in parallel and each peer's hashing would run on its own "
        f"CPU, so these numbers are the protocol's local cost, not a network's throughput.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--gb", type=float, default=1.0,
                        help="training state size in GB (params + AdamW moments)")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                        help=f"a temp dir is made (and removed) under it; default {DEFAULT_DIR}")
    parser.add_argument("--repeats", type=int, default=3,
                        help="puts per shard count, saves and reads per baseline (at least 1)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    # The client's warning on each parity rebuild would interleave with the tables.
    logging.getLogger("ckptpilot").setLevel(logging.ERROR)
    # SIGTERM unwinds like Ctrl-C, so the daemons are stopped and the scratch dir removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with scratch_dir(args.dir, "peer-") as workdir:
        run(args, workdir)


if __name__ == "__main__":
    main()
