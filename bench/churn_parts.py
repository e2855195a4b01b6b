"""The parts of ``bench/peer_churn.py`` (see its docstring): the daemon processes and their
cluster, the put/fetch timing, the registry watch, and the small model the pilot trains.

Every process is spawned on one long-lived thread with a death signal, so none outlives the
benchmark or the test that uses these parts (``tests/test_peer_churn.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

import numpy as np
import psutil
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ckptpilot.fit.peers import LISTENING  # noqa: E402
from ckptpilot.tiers.peer import PeerTier  # noqa: E402
from ckptpilot.tiers.peer.auth import load_secret  # noqa: E402
from ckptpilot.tiers.peer.registry import (  # noqa: E402
    HealthRegistry,
    NodeState,
    RegistryError,
    connect_registry,
)

REGISTRY_LISTENING = "ckptpilot peer registry listening on "
RESERVE_BYTES = 3 * 2**30  # left available to the other users of this host
DATA_SHARDS = 3
SYNTHETIC_WRITERS = 2


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the thread that spawned it ends (the
    cluster's spawner thread, which lives as long as this process or the cluster)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _spawn(cmd: list[str], log_path: Path) -> subprocess.Popen[str]:
    with open(log_path, "a") as out:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=out, text=True,
                                stdin=subprocess.DEVNULL, cwd=REPO,
                                preexec_fn=_die_with_parent,  # noqa: PLW1509
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _read_line(proc: subprocess.Popen[str], prefix: str, timeout: float, what: Path) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line.startswith(prefix):
                return line.strip()[len(prefix):]
            if not line:
                break
    tail = what.read_text(errors="replace").strip().splitlines()[-5:]
    raise RuntimeError(f"{what.stem} did not start; its log ends: " + " | ".join(tail))


# ----------------------------------------------------------------------------- cluster

@dataclass
class Slot:
    """Daemon of registry node ``node``; once started it keeps its port across restarts."""

    node: int
    log_path: Path
    port: int = 0
    proc: subprocess.Popen[str] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class HostFull(RuntimeError):
    """The next daemons would not fit in this host's available memory."""


class Cluster:
    """A ``ckptpilot peer registry`` of ``capacity`` daemon nodes (plus the synthetic
    writers' nodes) and the daemons. Every process is spawned on one spawner thread (their
    death signal follows the thread that spawned them), so the churn thread may start
    daemons too; :meth:`close` SIGKILLs them all. Start and stop from one thread at a time."""

    def __init__(self, workdir: Path, capacity: int, mem_limit_mib: int) -> None:
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawner")
        self.workdir = workdir
        self.mem_limit_mib = mem_limit_mib
        self.secret_file = workdir / "peer.secret"
        self.key = load_secret(self.secret_file, what="the benchmark's peer secret")
        self.slots: list[Slot] = []
        self.capacity = capacity
        log_path = workdir / "registry.log"
        self.registry = self._spawn([sys.executable, "-m", "ckptpilot", "peer", "registry",
                                "--host", "127.0.0.1", "--port", "0", "--nodes",
                                str(capacity + SYNTHETIC_WRITERS)], log_path)
        self.address = _read_line(self.registry, REGISTRY_LISTENING, 120, log_path)

    def _spawn(self, cmd: list[str], log_path: Path) -> subprocess.Popen[str]:
        return self._spawner.submit(_spawn, cmd, log_path).result()

    def _cmd(self, slot: Slot) -> list[str]:
        return [sys.executable, "-m", "ckptpilot", "peer", "serve", "--host", "127.0.0.1",
                "--port", str(slot.port), "--secret-file", str(self.secret_file),
                "--mem-limit", f"{self.mem_limit_mib}MiB", "--log-level", "WARNING",
                "--registry", self.address, "--node", str(slot.node), "--lazy-torch"]

    def start(self, slots: list[Slot]) -> float:
        """Start ``slots`` in parallel; the seconds until all listen."""
        t0 = time.perf_counter()
        for s in slots:
            s.proc = self._spawn(self._cmd(s), s.log_path)
        for s in slots:
            assert s.proc is not None
            s.port = int(_read_line(s.proc, LISTENING, 300, s.log_path).rsplit(":", 1)[1])
        return time.perf_counter() - t0

    def grow(self, n: int, *, batch: int = 8, reserve_bytes: int = RESERVE_BYTES) -> float:
        """Add daemons up to ``n``, ``batch`` at a time; before each batch, :class:`HostFull`
        if this host would be left with less than ``reserve_bytes`` of available memory (it
        is shared: others' use changes while the daemons start). Returns the seconds."""
        t0 = time.perf_counter()
        while len(self.slots) < n:
            k0 = len(self.slots)
            new = [Slot(k, self.workdir / f"daemon-{k}.log") for k in range(k0, min(n, k0 + batch))]
            need = len(new) * self.per_daemon_bytes() * 1.3 + reserve_bytes
            avail = psutil.virtual_memory().available
            if need > avail:
                raise HostFull(f"{n - k0} more daemons do not fit: the next {len(new)} need "
                               f"about {need / 2**30:.1f} GiB with the reserve, "
                               f"{avail / 2**30:.1f} GiB available")
            self.slots += new
            self.start(new)
        return time.perf_counter() - t0

    def per_daemon_bytes(self) -> int:
        """Unique memory of the largest running daemon (a first guess before any runs)."""
        sizes = []
        for s in self.slots:
            if s.up and s.proc is not None:
                with contextlib.suppress(psutil.Error):
                    sizes.append(psutil.Process(s.proc.pid).memory_full_info().uss)
        return max(sizes, default=64 * 2**20)

    def endpoints(self, n: int) -> list[str]:
        return [s.endpoint for s in self.slots[:n]]

    def stop(self, slot: Slot, sig: int) -> None:
        assert slot.proc is not None
        slot.proc.send_signal(sig)
        try:
            slot.proc.wait(15)
        except subprocess.TimeoutExpired:
            slot.proc.kill()
            slot.proc.wait()
        if slot.proc.stdout is not None:
            slot.proc.stdout.close()

    def close(self) -> None:
        procs = [s.proc for s in self.slots if s.proc is not None] + [self.registry]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
        self._spawner.shutdown()


# ----------------------------------------------------------------------------- scaling

@dataclass(frozen=True)
class Timing:
    n: int
    put: float
    fetch: float
    listing: float
    groups_ok: bool
    endpoints: int


def time_put_fetch(cluster: Cluster, n: int, image_mb: float, repeats: int,
                   endpoints: int | None = None) -> Timing:
    """Medians of put, fetch and list with all ``n`` daemons up (one untimed round first),
    through a tier over the first ``endpoints`` of them (default all): the same number of
    endpoints with more daemons running tells the host's contention from the fan-out."""
    endpoints = n if endpoints is None else endpoints
    rng = np.random.default_rng(n)
    image = rng.integers(0, 256, int(image_mb * 2**20), dtype=np.uint8)
    meta = b'{"bench": "peer_churn"}'
    puts, fetches, lists = [], [], []
    groups_ok = True
    nodes = {s.endpoint: s.node for s in cluster.slots}
    with PeerTier(cluster.endpoints(endpoints), run_id=f"timing-{n}-{endpoints}",
                  secret=cluster.key,
                  data_shards=DATA_SHARDS, registry=cluster.address, deltas="never",
                  probe_interval=0.5, timeout_seconds=10) as tier:
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            result = tier.put(i, image, meta)
            t1 = time.perf_counter()
            fetched = tier.fetch(i)
            t2 = time.perf_counter()
            tier.list()
            t3 = time.perf_counter()
            if not np.array_equal(fetched.image, image):
                raise AssertionError(f"N={n}: fetch {i} returned other bytes than put")
            groups_ok &= len({nodes[e] for e in result.endpoints}) == len(result.endpoints)
            if i:
                puts.append(t1 - t0)
                fetches.append(t2 - t1)
                lists.append(t3 - t2)
        tier.drop(repeats)
    return Timing(n, median(puts), median(fetches), median(lists), groups_ok, endpoints)


# ----------------------------------------------------------------------------- registry

@dataclass
class RegistryCheck:
    reads: int = 0
    torn: int = 0
    regressions: int = 0
    changed_same_version: int = 0
    wrong_endpoint: int = 0
    synthetic_writes: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.torn or self.regressions or self.changed_same_version
                    or self.wrong_endpoint)


def synthetic_state(node: int, i: int) -> NodeState:
    """Write ``i`` marks the status key (reason, status parity) and the info key (memory)."""
    return NodeState(node=node, status="up" if i % 2 == 0 else "draining", endpoint="",
                     mem_used_bytes=i, mem_limit_bytes=1 << 20, reason=f"w{i}")


def torn(state: NodeState) -> bool:
    i = state.mem_used_bytes
    return state.reason != f"w{i}" or state.status != ("up" if i % 2 == 0 else "draining")


class RegistryWatch:
    """Synthetic writers and one reader of the registry, on threads, until :meth:`stop`."""

    def __init__(self, address: str, capacity: int, endpoints: dict[int, str], *,
                 guarded: bool = True) -> None:
        self.guarded = guarded  # False: writers skip the protocol (the control: reads tear)
        self.address = address
        self.capacity = capacity
        self.endpoints = endpoints  # node -> the only endpoint it may publish (grows)
        self.check = RegistryCheck()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._write, args=(capacity + j,), daemon=True)
                         for j in range(SYNTHETIC_WRITERS)]
        self._threads.append(threading.Thread(target=self._read, daemon=True))
        for t in self._threads:
            t.start()

    def _write(self, node: int) -> None:
        reg = connect_registry(self.address, node=node, timeout_seconds=30)
        reg._between_keys = lambda: time.sleep(0.002)  # the tests' seams: widen each write,
        reg._guarded = self.guarded  # and (control only) skip the bit and the new version
        i = 0
        while not self._stop.wait(0.01):
            i += 1
            try:
                reg.publish(synthetic_state(node, i))
                self.check.synthetic_writes += 1
            except RegistryError as e:
                self.check.errors.append(f"writer {node}: {e}")

    def _read(self) -> None:
        reg: HealthRegistry = connect_registry(self.address, timeout_seconds=30)
        seen: dict[tuple[int, int], NodeState] = {}
        newest: dict[int, int] = {}
        while not self._stop.wait(0.02):
            try:
                states = reg.read_all()
            except RegistryError as e:
                self.check.errors.append(f"reader: {e}")
                continue
            for node, state in states.items():
                self.check.reads += 1
                if node >= self.capacity:
                    self.check.torn += torn(state)
                    continue
                if state.seq < newest.get(node, 0):
                    self.check.regressions += 1
                newest[node] = max(newest.get(node, 0), state.seq)
                first = seen.setdefault((node, state.seq), state)
                self.check.changed_same_version += first != state
                self.check.wrong_endpoint += state.endpoint != self.endpoints.get(node)

    def stop(self) -> RegistryCheck:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        return self.check


# ----------------------------------------------------------------------------- trainer

WIDTH = 256


def make_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.Tanh(),
                                torch.nn.Linear(4 * WIDTH, WIDTH))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> torch.Tensor:
    """Step ``step`` draws its batch from a generator seeded by the step: a resumed run
    recomputes the same states bit for bit."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, WIDTH, generator=g)
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), x.flip(1))
    loss.backward()
    opt.step()
    return loss.detach()


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"opt/{pid}/{k}"] = v.detach().clone()
    return out


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ in any bit (integer views), or that only one side has."""
    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k].reshape(-1), b[k].reshape(-1)
        if x.dtype != y.dtype or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            bad.append(k)
    return bad
