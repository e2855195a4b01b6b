"""CheckpointPilot: the one object a training loop talks to.

Data path of one save: ``observe`` (training thread) measures the signals → the adaptive
scheduler decides → ``state.capture`` copies the complete state into host memory (the only
cost training pays) → a background writer thread writes and publishes the archive on the
remote tier. Recovery runs the path backwards. Heartbeats (level 0) are written every
``levels.heartbeat.every`` steps into a memory-mapped ring, flushed by their own thread.

Threading and lifecycle:

1. construct on the training thread (registers a post-step hook on the optimizer, starts the
   health-probe, telemetry and heartbeat-flush threads);
2. ``restore()`` once, before the loop;
3. per step, ``observe()`` after ``optimizer.step()``, ``lr_scheduler.step()`` and after the
   data cursor moved — that is the step boundary at which every part of the state belongs to
   the same step;
4. ``close()`` (or leave the ``with`` block): waits for every pending save, surfaces errors,
   records a clean end in the failure ledger.

Only the writer thread touches checkpoint storage. At most ``async.max_pending`` snapshots
exist at once; a save requested while that many are in flight waits (back-pressure) rather
than allocating more host memory. An exception in the writer is raised on the training thread
at the next ``observe``/``save``/``close`` as ``CheckpointWriteError``; it is never swallowed.

Distributed runs: every rank runs a pilot. The ranks agree on each decision through one tiny
non-blocking collective per step (element-wise max of the signals, started at step t and
consumed at step t+1), so all ranks save at the same global steps without a barrier.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import json
import logging
import math
import os
import statistics
import threading
import time
import zlib
from collections import Counter, deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ckptpilot.codecs.blob import DTYPE_NAMES, DTYPES
from ckptpilot.codecs.selector import CodecSelector
from ckptpilot.errors import (
    CheckpointFormatError,
    CheckpointWriteError,
    CkptPilotError,
    NoCheckpointError,
    PolicyError,
    RollbackLimitError,
)
from ckptpilot.policy import Policy, load_policy
from ckptpilot.probes.gpu import GpuHealthProvider
from ckptpilot.probes.monitor import FROM_POLICY, HealthMonitor
from ckptpilot.rundir import RunLease, run_identity
from ckptpilot.scheduler.adaptive import SIGNAL_KEYS, AdaptiveCheckpointScheduler
from ckptpilot.scheduler.decision import CheckpointDecision
from ckptpilot.scheduler.spike import Spike, SpikeDetector
from ckptpilot.state import (
    HostBufferPool,
    Snapshot,
    Stateful,
    TrainingComponents,
    apply,
    arena_views,
    capture,
)
from ckptpilot.storage.archive import (
    ArchiveListing,
    StagedArchive,
    checkpoint_name,
    list_archives,
    model_layout,
    read_manifest,
    read_organ,
    stage_organ,
)
from ckptpilot.storage.heartbeat import HeartbeatRecord, HeartbeatWriter, read_latest
from ckptpilot.storage.ledger import FailureLedger, Rollback
from ckptpilot.storage.metadata import CheckpointRow, MetadataStore
from ckptpilot.telemetry import Telemetry
from ckptpilot.tiers.memory import MemoryEntry, MemoryTier
from ckptpilot.tiers.peer import PeerTier
from ckptpilot.tiers.remote import RemoteTier
from ckptpilot.validation.postwrite import PostWriteValidator
from ckptpilot.validation.recovery import Candidate, RecoveryPlan, plan_recovery
from ckptpilot.vocab import CheckpointKey, Level, RecoverySource, RetentionClass, Status, Tier

log = logging.getLogger("ckptpilot")

_COST_KEYS = ("save_seconds", "mtbf_seconds", "step_seconds")
_STEP_TIME_ALPHA = 0.05


@dataclass(frozen=True)
class SkippedCheckpoint:
    location: str
    reason: str


@dataclass(frozen=True)
class RecoveryReport:
    """What ``restore()`` did. ``steps_lost`` compares the dead run's newest heartbeat with the
    recovered step (None when no heartbeat of an earlier run exists); ``bytes_read`` counts
    what was read from the source (for the memory tier: copied) to restore it."""

    source: RecoverySource
    step: int
    level: str | None
    seconds: float
    steps_lost: int | None
    location: str | None
    skipped: tuple[SkippedCheckpoint, ...] = ()
    bytes_read: int = 0


@dataclass(frozen=True)
class SaveRecord:
    """One published checkpoint. ``stall_seconds`` is what the training thread paid for it
    (back-pressure wait + snapshot copy); ``persist_seconds`` ran in the background."""

    step: int
    level: Level
    reason: str
    retention_class: RetentionClass
    stall_seconds: float
    persist_seconds: float
    validate_seconds: float
    bytes: int
    location: str
    status: Status  # valid, or corrupted when post-write validation refused it
    bytes_raw: int = 0  # the snapshot's tensor bytes before the codecs
    write_seconds: float = 0.0  # encode + write + fsync (peers: the put), before validation
    tier: Tier = Tier.REMOTE  # where it went (peer: the peers; an organ also to the remote)


@dataclass(eq=False)
class _InFlight:
    """One job queued on the writer thread, in submission order. ``tier`` is the tier the
    writer is writing to at the moment: the writer thread sets it before each tier's write
    and the training thread reads it once ``future`` is done, so a failure names the tier it
    happened in. None while the job touches no tier (metadata rows only)."""

    step: int
    what: str
    future: Future[Any] = field(init=False)
    tier: Tier | None = None


@dataclass(frozen=True)
class _Read:
    """One checkpoint read and verified, not yet applied to the live objects."""

    source: RecoverySource
    level: Level
    location: str
    bytes_read: int
    meta: Mapping[str, Any]
    get_tensor: Callable[[str], torch.Tensor]


@dataclass(frozen=True)
class _RestoreOption:
    """One source of one step. ``read`` raises one of ``unreadable`` when this copy cannot
    be read (the walk goes on to the next); ``on_fail`` records why."""

    where: str
    read: Callable[[], _Read]
    unreadable: tuple[type[BaseException], ...]
    on_fail: Callable[[BaseException], None]


@dataclass
class _RestorePlan:
    """What this rank could restore: the sources of each step (newest first in ``steps``),
    and what was excluded or is missing, with reasons."""

    step: int | None
    forced: bool
    pinned: bool
    options: dict[int, list[_RestoreOption]]
    steps: list[int]
    missing: list[tuple[int, SkippedCheckpoint]]
    skipped: list[SkippedCheckpoint]


class _AnotherRankFailed(CkptPilotError, RuntimeError):
    """Raised on every rank whose own restore went fine when another rank's raised: all
    ranks stop together rather than one resuming alone or waiting in a collective."""


@dataclass(frozen=True)
class _SaveRequest:
    level: str
    reason: str
    retention_class: str
    score: float | None = None
    metric: tuple[str, float] | None = None


RECOVER_PIN = "recover.json"
# What a misbehaving peer tier can raise: never a reason to fail a save or a restore that
# another tier can serve (a daemon of another version, a garbled reply, a dead socket).
_PEER_ERRORS = (CkptPilotError, OSError, ValueError, KeyError, TypeError)
PEER_FORMAT = "ckptpilot-peer-image-1"
MAX_RECOVERY_WALK = 5
_FAILED = -2  # sent instead of a step by a rank whose restore planning raised
_ALWAYS_REPORTED = 1 << 62  # a "missing" entry newer than any step: reported on every outcome
_AGREE_STEPS = 32  # candidates per rank exchanged at restore (a walk tries at most ~12)
_NO_ONSET = -1e18  # the agreed "minus onset" of a step where no rank confirmed a spike


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_MALLOC_TRIM = _load_malloc_trim()


def _trim_heap() -> None:
    """Give the heap that encoding freed back to the system (glibc keeps freed heap memory
    of its worker-thread arenas; measured, a 100 MB state's pulses then grew the process by
    a further ~0.8 state). A few milliseconds per pulse, on the writer thread."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _codec_summary(staged: StagedArchive) -> str:
    """``raw`` for safetensors; else how many tensors each codec took, e.g.
    ``byteplane:12,raw:30``."""
    if staged.index is None:
        return "raw"
    counts = Counter(entry.codec for entry in staged.index.tensors)
    return ",".join(f"{codec}:{n}" for codec, n in sorted(counts.items()))


def _collective_device() -> torch.device:
    """Where the pilot's small agreement tensors live: NCCL reduces only CUDA tensors; gloo,
    and a group with a CPU backend beside NCCL (``cpu:gloo,cuda:nccl``), CPU ones."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class CheckpointPilot:
    """Keeps a training run resumable: decides when to save, saves off-thread, restores.

    ``extras`` is a dict the caller may fill with JSON-able values (or tensors); it is saved
    with every checkpoint and replaced by the stored one on ``restore()``. ``gpu_health``
    replaces the NVML provider of the health probes (another accelerator's telemetry).
    """

    def __init__(self, policy: Policy | str | os.PathLike[str] | None = None, *,
                 model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 lr_scheduler: Stateful | None = None, scaler: Stateful | None = None,
                 data_state: Stateful | None = None, run_dir: str | os.PathLike[str] | None = None,
                 rank: int | None = None, world_size: int | None = None,
                 gpu_health: GpuHealthProvider | None = FROM_POLICY) -> None:
        if isinstance(policy, Policy):
            self.policy = policy.with_run_dir(run_dir) if run_dir is not None else policy
        else:
            self.policy = load_policy(policy, run_dir=run_dir)
        self.run_dir = Path(self.policy.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        dist_rank, dist_world = _dist_rank_world()
        self.rank = dist_rank if rank is None else rank
        self.world_size = dist_world if world_size is None else world_size
        self.components = TrainingComponents(model=model, optimizer=optimizer,
                                             lr_scheduler=lr_scheduler, scaler=scaler,
                                             data_state=data_state)
        self._closed = True  # until _open() finished: close() then has nothing to undo
        # First, before any file of the run is touched: a second pilot for this rank refuses.
        self._lease = RunLease(self.run_dir, self.rank)
        try:
            self._open(model=model, optimizer=optimizer, gpu_health=gpu_health)
        except BaseException:
            try:
                self._teardown().close()
            except Exception:
                log.exception("while stopping what a pilot that failed to start had started")
            raise

    def _open(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
              gpu_health: GpuHealthProvider | None) -> None:
        self.remote = RemoteTier(self.policy.tiers.remote.url)
        self.run_id = run_identity(self.run_dir)
        self.store = MetadataStore(self.run_dir / "metadata.sqlite")
        # A directory whose rows are keyed by its folder's name (no run id yet) is re-keyed.
        self.store.adopt_run_id(self.run_dir.name, self.run_id)
        self._validator = PostWriteValidator(self.policy.validation)
        self.scheduler = AdaptiveCheckpointScheduler(self.policy.scheduler, self.policy.retention)
        self.extras: dict[str, Any] = {}
        self.step = 0
        self.epoch: int | None = None
        self.last_loss: float | None = None
        self.last_decision: CheckpointDecision | None = None
        self.last_recovery: RecoveryReport | None = None
        self.saves: list[SaveRecord] = []

        max_pending = self.policy.async_.max_pending
        self._slots = threading.BoundedSemaphore(max_pending)
        self._pool = HostBufferPool(max_pending)
        mem = self.policy.tiers.memory
        self.memory = (MemoryTier(mem.max_bytes, self._pool, max_sets=max_pending)
                       if mem.enabled else None)
        peer = self.policy.tiers.peer
        self.peers = (PeerTier.from_policy(
            peer, run_id=f"{self.run_dir.name}-{self.run_id}.rank{self.rank:05d}")
            if peer.enabled else None)
        self._peer_step: int | None = None  # the newest checkpoint the peers took from us
        codecs = self.policy.codecs
        self._pulse_codecs = CodecSelector(
            {"weights": codecs.weights, "optimizer": codecs.optimizer, "other": codecs.other},
            bandwidth_bytes_per_s=self.policy.tiers.remote.bandwidth, level=codecs.zstd_level,
            prefix_bits=codecs.prefix_bits, threads=codecs.threads)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptpilot-writer")
        self._inflight: deque[_InFlight] = deque()
        obs = self.policy.observability
        self._telemetry = Telemetry(self.run_dir, rank=self.rank, tensorboard=obs.tensorboard,
                                    decision_log=obs.decision_log)
        hb_path = self.run_dir / f"heartbeat_rank_{self.rank:05d}.ring"
        self._previous_heartbeat: HeartbeatRecord | None = read_latest(hb_path)
        self._heartbeat = HeartbeatWriter(hb_path)
        self._ledger = FailureLedger(self.run_dir / f"ledger_rank_{self.rank:05d}.jsonl")
        self._check_rollback_setup()
        self._rollbacks = self._ledger.rollbacks()
        self._spikes = SpikeDetector(self.policy.rollback)
        self._spike: tuple[int, str] | None = None  # (onset, reason) agreed at this step
        self._protected_onset: int | None = None
        self._local_spike: tuple[int, str] | None = None  # sent in the last agreement
        self._run_started = False
        self._health: HealthMonitor | None = None
        if self.policy.scheduler.weights.system > 0:
            self._health = HealthMonitor(self.run_dir, self.policy.scheduler.system,
                                         provider=gpu_health)
            self._health.start()
        self._distributed = (self.world_size > 1 and torch.distributed.is_available()
                             and torch.distributed.is_initialized())
        self._collective_device = (_collective_device() if self._distributed
                                   else torch.device("cpu"))
        self._agree_buffer: torch.Tensor | None = None
        self._agree_work: Any = None
        self._stalls: deque[float] = deque(maxlen=16)
        self._save_cost: float | None = None  # median of the recent stalls, per save
        self._mtbf_seconds: float | None = None
        self._step_seconds: float | None = None
        self._last_observe: float | None = None
        self._non_finite_steps = 0
        self._last_save_step: int | None = None
        self._base_step = 0
        self._optimizer_steps = 0
        self._observed = False
        self._closed = False
        self._grad_norm: torch.Tensor | None = None
        self._grad_probe_pending = False
        self._caller_grad_norm = False
        self._hook = (optimizer.register_step_post_hook(self._after_optimizer_step)
                      if optimizer is not None else None)

    # -- training thread -------------------------------------------------------------------

    def observe(self, loss: Any = None, *, step: int | None = None, epoch: int | None = None,
                grad_norm: Any = None) -> CheckpointDecision:
        """Mark a step boundary; returns the scheduler's decision for this step.

        ``step`` defaults to one more than the previous step (the pilot counts completed
        iterations; after ``restore()`` it continues from the restored step). ``loss`` may be
        a float or a one-element tensor (read with ``float()``, which synchronises a GPU).
        ``grad_norm``: the global gradient norm when the loop computes it anyway (e.g. the
        return value of ``clip_grad_norm_``); once given, the optimizer hook stops computing
        its own probe and this value is used every ``grad.probe_every`` steps.
        """
        self._check_open()
        self._raise_background_errors()
        if grad_norm is not None:
            self._caller_grad_norm = True
            if self._optimizer_steps % self.policy.scheduler.grad.probe_every == 0:
                self._grad_norm = (grad_norm.detach() if isinstance(grad_norm, torch.Tensor)
                                   else torch.tensor(float(grad_norm)))
                self._grad_probe_pending = True
        if step is None:
            step = self.step + 1 if self._observed else self._base_step + 1
        self._observed = True
        self.step = step
        if epoch is not None:
            self.epoch = epoch
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().item()
        self.last_loss = None if loss is None else float(loss)
        self._time_step()
        decision = self._decide()
        if step % self.policy.levels.heartbeat.every == 0:
            self._write_heartbeat()
        if self._spike is not None:
            decision = self._on_spike(decision, *self._spike)
        self.last_decision = decision
        self._telemetry.decision(decision)
        if decision.save and decision.level is not None:
            self._save(_SaveRequest(decision.level.value, decision.reason,
                                    decision.retention_class.value, decision.score))
        return decision

    def save(self, level: str = "organ", reason: str = "manual") -> bool:
        """Force a save of the current step; False if this step is already saved."""
        self._check_open()
        self._raise_background_errors()
        lvl = Level(level)
        if lvl is Level.HEARTBEAT:
            raise ValueError("a heartbeat is written every step; force a 'pulse' or 'organ'")
        if not self._save(_SaveRequest(lvl.value, reason, "important")):
            return False
        self.scheduler.note_save(self.step, lvl)
        return True

    def report_metric(self, name: str, value: float) -> None:
        """Attach a metric (e.g. a validation loss) to the checkpoint of the current step.

        Best-N retention (``retention.best``) ranks checkpoints by it, so the state it was
        measured on must exist: if the current step has no checkpoint yet, a pulse is saved.
        """
        self._check_open()
        self._raise_background_errors()
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"metric {name!r} at step {self.step}: {value} is not finite")
        if self._save(_SaveRequest("pulse", f"metric {name} reported", "important",
                                   metric=(name, value))):
            self.scheduler.note_save(self.step, Level.PULSE)
            return
        job = _InFlight(self.step, "metric update")
        job.future = self._executor.submit(self._set_metric, self.step, name, value)
        self._inflight.append(job)

    def _set_metric(self, step: int, name: str, value: float) -> None:
        """On the writer thread, after the save of ``step``: on its row in every tier."""
        keys = [CheckpointKey(self.run_id, step, self.rank, tier)
                for tier in (Tier.PEER, Tier.REMOTE)]
        found = [key for key in keys if self.store.get(key) is not None]
        if not found:
            raise NoCheckpointError(f"metric {name!r}: step {step} has no checkpoint row")
        for key in found:
            self.store.set_metric(key, name, value)

    @property
    def last_grad_norm(self) -> float | None:
        """Global L2 norm of the gradients at the last probe (every ``grad.probe_every``)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any,
                              kwargs: Any) -> None:
        self._optimizer_steps += 1
        if (not self._caller_grad_norm
                and self._optimizer_steps % self.policy.scheduler.grad.probe_every == 0):
            grads = [p.grad for g in optimizer.param_groups for p in g["params"]
                     if p.grad is not None]
            self._grad_norm = torch.nn.utils.get_total_norm(grads) if grads else None
            self._grad_probe_pending = self._grad_norm is not None
        # Without observe() the hook is the step boundary. The first optimizer step cannot
        # tell the two modes apart, so hook-time decisions start at the second one.
        if not self._observed:
            self.step = self._base_step + self._optimizer_steps
            if self._optimizer_steps >= 2:
                decision = self._decide()
                self.last_decision = decision
                self._telemetry.decision(decision)
                if decision.save and decision.level is not None:
                    self._save(_SaveRequest(decision.level.value, decision.reason,
                                            decision.retention_class.value, decision.score))

    def _time_step(self) -> None:
        now = time.perf_counter()
        if self._last_observe is not None:
            dt = now - self._last_observe
            self._step_seconds = dt if self._step_seconds is None else (
                _STEP_TIME_ALPHA * dt + (1 - _STEP_TIME_ALPHA) * self._step_seconds)
        self._last_observe = now

    def _decide(self) -> CheckpointDecision:
        if not self._run_started:
            self._ledger.record_run_start(self._base_step)
            self._run_started = True
        grad = None
        if self._grad_probe_pending:
            grad = float(self._grad_norm)  # type: ignore[arg-type]
            self._grad_probe_pending = False
        system = self._health.snapshot() if self._health is not None else None
        costs = {"save_seconds": self._save_cost,
                 "mtbf_seconds": self._mtbf_seconds, "step_seconds": self._step_seconds}
        spike = (None if self.last_loss is None
                 else self._spikes.update(self.step, self.last_loss))
        if self._distributed:
            # Decide from the signals agreed over the previous step, then measure this one
            # and start its reduction: measuring after deciding lets an emergency decision
            # reset the hard-error reference before the next reduction carries it again.
            signals, agreed_costs, self._spike = self._agreed()
            self.scheduler.set_cost_model(**agreed_costs)
            decision = self.scheduler.decide_from(self.step, signals)
            self._start_agreement(
                self.scheduler.measure(self.step, self.last_loss, grad, system), costs, spike)
        else:
            local = self.scheduler.measure(self.step, self.last_loss, grad, system)
            self.scheduler.set_cost_model(**costs)
            decision = self.scheduler.decide_from(self.step, local)
            self._spike = None if spike is None else (spike.onset, spike.reason)
        if decision.non_finite:
            self._non_finite_steps += 1
            if self._non_finite_steps == 1 or self._non_finite_steps % 100 == 0:
                log.warning("%s (%d non-finite steps so far); no checkpoint is taken of it",
                            decision.reason, self._non_finite_steps)
        return decision

    def _agreed(self) -> tuple[dict[str, float], dict[str, float | None],
                               tuple[int, str] | None]:
        """The element-wise max over ranks of the previous step's signals and costs, and the
        earliest onset of a spike any rank confirmed then (zeros and no spike right after a
        start or restore, on every rank alike)."""
        n, m = len(SIGNAL_KEYS), len(SIGNAL_KEYS) + len(_COST_KEYS)
        if self._agree_work is None:
            return dict.fromkeys(SIGNAL_KEYS, 0.0), dict.fromkeys(_COST_KEYS), None
        self._agree_work.wait()
        agreed = self._agree_buffer.tolist()  # type: ignore[union-attr]
        signals = dict(zip(SIGNAL_KEYS, agreed[:n], strict=True))
        costs = {k: (v if v > 0 else None) for k, v in zip(_COST_KEYS, agreed[n:m], strict=True)}
        spike = None
        if agreed[m] > _NO_ONSET:
            onset = int(-agreed[m])
            mine = self._local_spike
            spike = (onset, mine[1] if mine is not None and mine[0] == onset
                     else f"a loss spike since step {onset} on another rank")
        return signals, costs, spike

    def _start_agreement(self, local: Mapping[str, float],
                         costs: Mapping[str, float | None], spike: Spike | None) -> None:
        """One tiny non-blocking collective per step; consumed at the next step."""
        values = [local[k] for k in SIGNAL_KEYS]
        values += [-1.0 if costs[k] is None else float(costs[k]) for k in _COST_KEYS]  # type: ignore[arg-type]
        values.append(_NO_ONSET if spike is None else -float(spike.onset))
        self._local_spike = None if spike is None else (spike.onset, spike.reason)
        self._agree_buffer = torch.tensor(values, dtype=torch.float64,
                                          device=self._collective_device)
        self._agree_work = torch.distributed.all_reduce(
            self._agree_buffer, op=torch.distributed.ReduceOp.MAX, async_op=True)

    def _write_heartbeat(self) -> None:
        c = self.components
        record: dict[str, Any] = {"step": self.step, "epoch": self._current_epoch(),
                                  "loss": self.last_loss}
        if c.data_state is not None:
            record["cursor"] = c.data_state.state_dict()
        if c.optimizer is not None:
            record["lr"] = [float(g["lr"]) for g in c.optimizer.param_groups]
        if c.lr_scheduler is not None:
            record["lr_scheduler_step"] = getattr(c.lr_scheduler, "last_epoch", None)
        if c.scaler is not None:
            record["scaler"] = c.scaler.state_dict()
        # A fingerprint of the torch RNG (dropout masks) tells whether a replay from the
        # last checkpoint follows the same path; the python/numpy states cost ~35 µs a step
        # to read and live in full in every pulse and organ instead.
        record["torch_rng_crc32"] = zlib.crc32(torch.get_rng_state().numpy())
        self._heartbeat.write(record)

    def _save(self, request: _SaveRequest) -> bool:
        if self._last_save_step == self.step:
            return False
        t0 = time.perf_counter()
        self._slots.acquire()
        try:
            snapshot = capture(self.components, step=self.step, epoch=self._current_epoch(),
                               extras=self.extras, rank=self.rank, world_size=self.world_size,
                               pool=self.memory or self._pool)
        except BaseException:
            self._slots.release()
            raise
        stall = time.perf_counter() - t0
        self._stalls.append(stall)
        self._save_cost = statistics.median(self._stalls)
        job = _InFlight(self.step, "save")
        job.future = self._executor.submit(self._persist, snapshot, request, stall, job)
        self._inflight.append(job)
        self._last_save_step = self.step
        return True

    def _current_epoch(self) -> int | None:
        if self.epoch is not None:
            return self.epoch
        epoch = getattr(self.components.data_state, "epoch", None)
        return epoch if isinstance(epoch, int) else None

    def _raise_background_errors(self) -> None:
        while self._inflight and self._inflight[0].future.done():
            job = self._inflight.popleft()
            error = job.future.exception()
            if error is not None:
                raise CheckpointWriteError(
                    f"background {job.what} of step {job.step}{self._tier_words(job.tier)} "
                    f"failed: {error}") from error

    def _tier_words(self, tier: Tier | None) -> str:
        if tier is Tier.REMOTE:
            return f" to the remote tier {self.remote.url}"
        if tier is Tier.PEER and self.peers is not None:
            return f" to the peer tier ({', '.join(self.peers.endpoints)})"
        return "" if tier is None else f" to the {tier.value} tier"

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this CheckpointPilot is closed")

    # -- writer thread ---------------------------------------------------------------------

    def _persist(self, snapshot: Snapshot, request: _SaveRequest, stall: float,
                 job: _InFlight) -> SaveRecord:
        """Write one save to its tiers; a valid snapshot's buffers then stay in the memory
        tier (the base of the next peer deltas).

        With the peer tier: a pulse goes to the peers only, an organ to the peers and the
        remote tier. A pulse the peers cannot take (too few reachable) goes to the remote tier
        instead, with a warning: nothing is dropped."""
        kept = False
        try:
            record = None
            if self.peers is not None:
                job.tier = Tier.PEER
                record = self._persist_to_peers(snapshot, request, stall)
            if record is None or request.level == Level.ORGAN.value:
                job.tier = Tier.REMOTE
                record = self._persist_to_remote(snapshot, request, stall)
            job.tier = None
            self.saves.append(record)
            self._telemetry.save(snapshot.step, {
                "checkpoint/save_seconds": record.persist_seconds,
                "checkpoint/stall_seconds": stall,
                "checkpoint/validate_seconds": record.validate_seconds,
                "checkpoint/bytes": float(record.bytes),
                "checkpoint/ratio": snapshot.nbytes / max(record.bytes, 1),
            })
            if record.status is Status.VALID and self.memory is not None:
                job.tier = Tier.MEMORY
                kept = self.memory.hold(snapshot, request.level)
            return record
        except Exception:
            log.exception("background save of step %d failed", snapshot.step)
            raise
        finally:
            if not kept:
                self._pool.give_back(snapshot)
            self._slots.release()

    def _persist_to_peers(self, snapshot: Snapshot, request: _SaveRequest,
                          stall: float) -> SaveRecord | None:
        """Put the snapshot's arena on the peers, as XOR deltas against the memory tier's
        snapshot when the peers hold that one. Validation is the SHA256 chain: every shard's
        digest, computed before sending, is checked by its peer on receipt and after each
        fold, and again by the client on fetch; the layout comes from the live state itself.
        Folds run after the put returns, so the row is valid before they finish: a fold that
        fails makes this checkpoint unfetchable and recovery falls back to the next tier.
        None when the peers could not take it."""
        assert self.peers is not None and snapshot.arena is not None
        t0 = time.perf_counter()
        meta = json.dumps({
            "format": PEER_FORMAT, "step": snapshot.step, "rank": self.rank,
            "level": request.level, "reason": request.reason,
            "retention_class": request.retention_class, "score": request.score,
            "created_unix": time.time(),
            "layout": [[k, DTYPE_NAMES[d], list(shape)] for k, d, shape in snapshot.layout],
            "state": snapshot.meta,
        }, separators=(",", ":")).encode()
        base = None
        held = (self.memory.base_for(self._peer_step, snapshot.layout)
                if self.memory is not None else None)
        if held is not None and held.arena is not None:
            base = (held.step, held.arena.numpy())
        try:
            return self._put_to_peers(snapshot, request, stall, t0, meta, base)
        finally:
            if self.memory is not None:
                self.memory.unpin()

    def _put_to_peers(self, snapshot: Snapshot, request: _SaveRequest, stall: float, t0: float,
                      meta: bytes, base: tuple[int, Any] | None) -> SaveRecord | None:
        assert self.peers is not None and snapshot.arena is not None
        key = CheckpointKey(self.run_id, snapshot.step, self.rank, Tier.PEER)
        self._retire_existing(key, None)
        metric_name, metric_value = request.metric or (None, None)
        self.store.add_pending(
            run_id=self.run_id, step=snapshot.step, rank=self.rank, level=request.level,
            tier=Tier.PEER, location=f"peer:{self.peers.run_id}/{snapshot.step}",
            sha256=hashlib.sha256(meta).hexdigest(), retention_class=request.retention_class,
            score=request.score, metric_name=metric_name, metric_value=metric_value,
            bytes_raw=snapshot.nbytes, codec="raw", seconds_snapshot=stall,
            reason=request.reason)
        try:
            result = self.peers.put(snapshot.step, snapshot.arena.numpy(), meta, base=base)
        except _PEER_ERRORS as e:
            self.store.mark(key, Status.CORRUPTED, note=f"peer put failed: {e}"[:2000])
            log.warning("the peer tier could not take the %s of step %d (%s)%s", request.level,
                        snapshot.step, e, "; writing it to the remote tier instead"
                        if request.level == Level.PULSE.value else "")
            return None
        self._peer_step = snapshot.step
        for row in self.store.rows(self.run_id, rank=self.rank, tier=Tier.PEER):
            if row.step < snapshot.step and row.status is Status.VALID:
                # The peers dropped it on this commit: they keep one state per run.
                self.store.mark(row.key, Status.EXPIRED,
                                note=f"superseded on the peers by step {snapshot.step}")
        location = f"peer:{self.peers.run_id}/{snapshot.step}@{','.join(result.endpoints)}"
        self.store.mark(key, Status.VALID, location=location, bytes_encoded=result.bytes_sent,
                        codec="xor_delta" if result.delta_shards else "raw",
                        seconds_write=result.seconds)
        seconds = time.perf_counter() - t0
        log.info("saved %s step %d to %d peers: %.1f MB sent (%d delta, %d full shards) for "
                 "%.1f MB, stall %.1f ms, %.2f s (%s)", request.level, snapshot.step,
                 len(result.endpoints), result.bytes_sent / 1e6, result.delta_shards,
                 result.full_shards, snapshot.nbytes / 1e6, stall * 1e3, seconds,
                 request.reason)
        return SaveRecord(step=snapshot.step, level=Level(request.level), reason=request.reason,
                          retention_class=RetentionClass(request.retention_class),
                          stall_seconds=stall, persist_seconds=seconds, validate_seconds=0.0,
                          bytes=result.bytes_sent, location=location, status=Status.VALID,
                          bytes_raw=snapshot.nbytes, write_seconds=result.seconds,
                          tier=Tier.PEER)

    def _persist_to_remote(self, snapshot: Snapshot, request: _SaveRequest,
                           stall: float) -> SaveRecord:
        """Stage → record ``pending`` → validate → publish and mark ``valid`` (or set aside
        and mark ``corrupted``, with an alert: the previous valid checkpoint stays the
        recovery point).

        An organ is written as safetensors; a pulse through the codecs (``codecs`` policy),
        self-contained (see ``storage.archive``) — or as safetensors too when the codecs would
        save less transfer time at this tier's bandwidth than the container's extra hash pass
        costs."""
        t0 = time.perf_counter()
        codec_for = None
        if request.level == Level.PULSE.value:
            self._pulse_codecs.new_save()
            if not self._pulse_codecs.plain_pays(snapshot.tensors):
                codec_for = self._pulse_codecs.codec_for
        staged = stage_organ(self.remote, snapshot, level=request.level,
                             reason=request.reason, retention_class=request.retention_class,
                             score=request.score, codec_for=codec_for)
        write_seconds = time.perf_counter() - t0
        if codec_for is not None:
            _trim_heap()
        key = CheckpointKey(self.run_id, snapshot.step, self.rank, Tier.REMOTE)
        self._retire_existing(key, staged.name)
        metric_name, metric_value = request.metric or (None, None)
        self.store.add_pending(
            run_id=self.run_id, step=snapshot.step, rank=self.rank, level=request.level,
            tier=Tier.REMOTE, location=self.remote.path(staged.staging),
            sha256=staged.manifest["self_sha256"], retention_class=request.retention_class,
            score=request.score, metric_name=metric_name, metric_value=metric_value,
            bytes_raw=snapshot.nbytes, bytes_encoded=staged.bytes,
            codec=_codec_summary(staged), seconds_snapshot=stall,
            seconds_write=write_seconds, reason=request.reason)
        check = self._validator.validate(self.remote, staged.staging, staged.manifest,
                                         model_layout(snapshot))
        if check.ok:
            self.remote.publish(staged.staging, staged.name)
            location, status = self.remote.path(staged.name), Status.VALID
            self.store.mark(key, status, location=location, seconds_validate=check.seconds)
        else:
            location = self.remote.path(self.remote.set_aside(
                staged.staging, "corrupted", label=staged.name))
            status = Status.CORRUPTED
            self.store.mark(key, status, location=location, seconds_validate=check.seconds,
                            note=check.reason)
            log.error("ALERT: the checkpoint of step %d failed validation and is kept as "
                      "%s: %s. The previous valid checkpoint stays the recovery point.",
                      snapshot.step, location, check.reason)
        seconds = time.perf_counter() - t0
        record = SaveRecord(step=snapshot.step, level=Level(request.level),
                            reason=request.reason,
                            retention_class=RetentionClass(request.retention_class),
                            stall_seconds=stall, persist_seconds=seconds,
                            validate_seconds=check.seconds, bytes=staged.bytes,
                            location=location, status=status, bytes_raw=snapshot.nbytes,
                            write_seconds=write_seconds, tier=Tier.REMOTE)
        log.info("saved %s step %d: %.1f MB (%.1f MB raw), stall %.1f ms, persisted in "
                 "%.2f s (write %.2f s, validation %.2f s), %s (%s)", request.level,
                 snapshot.step, staged.bytes / 1e6, snapshot.nbytes / 1e6, stall * 1e3,
                 seconds, write_seconds, check.seconds, status.value, request.reason)
        return record

    def _retire_existing(self, key: CheckpointKey, name: str | None) -> None:
        """A run resumed from an earlier step saves a step again: the old copy (from the
        abandoned continuation) is set aside and its row expired, never silently replaced."""
        row = self.store.get(key)
        if row is None or row.status not in (Status.PENDING, Status.VALID):
            return
        note = f"superseded by a new save of step {key.step} after resuming from an earlier step"
        location = row.location
        if name is not None and self.remote.exists(name):
            location = self.remote.path(self.remote.set_aside(name, "superseded"))
        if row.status is Status.PENDING:
            self.store.mark(key, Status.CORRUPTED, location=location, note=note)
        else:
            self.store.mark(key, Status.EXPIRED, location=location, note=note)

    # -- recovery --------------------------------------------------------------------------

    def restore(self, step: int | None = None) -> int:
        """Load the newest checkpoint that verifies (or exactly ``step``); returns the step
        to resume from, 0 when the run has no checkpoint yet.

        Recovery order (SPEC §7): newest ``valid`` first, from the fastest tier that holds it
        (memory → peer → remote), re-verified on read. A copy that cannot be read is skipped
        with its reason and the chain is walked back (up to 5), then the newest organ; one
        whose bytes are wrong (format, digest) is also marked ``corrupted``, one that met an
        I/O error is not (the error may pass). ``last_recovery.skipped`` lists what was
        passed over and why, including rows whose data is missing. If checkpoints exist (or
        are recorded) but none loads, this raises rather than silently restarting the run
        from scratch. A state that reads fine but does not fit the live objects
        (``StateError``) is raised as it is and marks nothing: the checkpoint is good, the
        model is not the one it came from.

        In a distributed run every rank restores the same step: the newest one that every
        rank can load (one all-gather of the candidates, one all-reduce per step tried). An
        exception on one rank is raised there after the collectives, and every other rank
        raises too, so that no rank resumes alone or waits forever in a collective.

        A pin left by ``ckptpilot recover --step N`` selects step N (any status with
        ``--force``) and is consumed. When the previous run of this ``run_dir`` died, the
        interruption goes into the failure ledger (it feeds the Young–Daly bound).

        Restoring the step an instability rollback returned to skips again the batches that
        rollback skipped (the checkpoint's data cursor predates the skip), so a crash right
        after a rollback resumes on the same data as the run it interrupted.
        """
        self._check_open()
        restored = self._restore(step)
        assert restored is not None
        return restored

    def _restore(self, step: int | None, before: int | None = None) -> int | None:
        """``restore()``; with ``before`` (a rollback): the newest step below it, no pin, no
        ledger lifecycle records, and None, with nothing changed, when no such step loads."""
        t0 = time.perf_counter()
        failure: BaseException | None = None
        plan: _RestorePlan | None = None
        try:
            self.flush()
            plan = self._plan_restore(step, before)
        except BaseException as e:
            if not self._distributed:
                raise
            failure = e
        steps = plan.steps if plan is not None else []
        if self._distributed:
            common = self._steps_every_rank_has(steps, failure)
            assert plan is not None
            plan.missing += [(s, SkippedCheckpoint(plan.options[s][0].where,
                                                   f"step {s} is not held by every rank"))
                             for s in steps if s not in common]
            steps = common
        assert plan is not None
        skipped = plan.skipped
        for target in steps:
            read = None
            try:
                read = self._read_first(plan.options[target], skipped)
                if read is not None:
                    self._apply(read.meta, read.get_tensor)
            except BaseException as e:
                if not self._distributed:
                    raise
                failure = e
            if self._distributed:
                vote = self._vote(-1 if failure is not None else int(read is not None))
                self._raise_if_failed(vote, failure, f"step {target}")
                if vote == 0:
                    if read is not None:
                        skipped.append(SkippedCheckpoint(
                            read.location, f"another rank cannot load step {target}"))
                    continue
            if read is None:
                continue
            skipped += [m for s, m in plan.missing if s > target]
            self._after_restore(target, read.level)
            self.last_recovery = self._report(read.source, target, read.level.value, t0,
                                              read.location, skipped, read.bytes_read,
                                              lifecycle=before is None)
            if before is None:
                self._skip_again_after(target)
            if plan.pinned:
                self._consume_pin(target, plan.forced)
            log.info("restored step %d from %s in %.2f s", target, read.location,
                     self.last_recovery.seconds)
            return target
        skipped += [m for _, m in plan.missing]
        if before is not None:
            for item in skipped:
                log.warning("cannot roll back to %s: %s", item.location, item.reason)
            return None
        refuse = bool(skipped) or plan.step is not None
        if self._distributed:
            refuse = self._vote(int(not refuse)) == 0
        if refuse:
            raise NoCheckpointError(self._nothing_loads(plan.step, skipped))
        self._after_restore(0, None)
        self.last_recovery = self._report(RecoverySource.NONE, 0, None, t0, None, skipped)
        return 0

    def _plan_restore(self, step: int | None, before: int | None = None) -> _RestorePlan:
        """This rank's candidates (all below ``before`` if given), per step and fastest
        source first (rank-local: no collective)."""
        forced = pinned = False
        pin = self.run_dir / RECOVER_PIN
        if step is None and before is None and pin.exists():
            pinned_step = json.loads(pin.read_text())
            step, forced = int(pinned_step["step"]), bool(pinned_step.get("force", False))
            pinned = True
            log.warning("restoring step %d as pinned by `ckptpilot recover`%s", step,
                        " --force" if forced else "")
        candidates, missing, digests = self._recovery_candidates()
        if before is not None:
            candidates = [c for c in candidates if c.step < before]
            missing = [(s, m) for s, m in missing if s < before]
        if forced:
            candidates = [Candidate(c.step, c.level, c.tier, c.name, None) for c in candidates]
        plan = plan_recovery(candidates, max_walk=MAX_RECOVERY_WALK, step=step)
        options = self._restore_options(plan, step, forced, digests, before)
        return _RestorePlan(
            step=step, forced=forced, pinned=pinned, options=options,
            steps=sorted(options, reverse=True), missing=missing,
            skipped=[SkippedCheckpoint(self.remote.path(c.name), why)
                     for c, why in plan.excluded])

    def _nothing_loads(self, step: int | None, skipped: list[SkippedCheckpoint]) -> str:
        what = f"step {step}" if step is not None else "any step"
        if not skipped:
            return (f"no usable checkpoint of {what} for rank {self.rank} in "
                    f"{self.remote.url}" + (" on every rank" if self._distributed else ""))
        first = skipped[0]
        return (f"rank {self.rank} cannot load {what}: none of the {len(skipped)} checkpoints "
                f"recorded or found in {self.remote.url} loads; newest: {first.location}: "
                f"{first.reason}")

    def _restore_options(self, plan: RecoveryPlan, step: int | None, forced: bool,
                         digests: Mapping[int, str], before: int | None
                         ) -> dict[int, list[_RestoreOption]]:
        """For each step this rank could restore, its sources, fastest first."""
        options: dict[int, list[_RestoreOption]] = {}
        below = math.inf if before is None else before
        held = self.memory.newest() if self.memory is not None and not forced else None
        if held is not None and held.step < below and (step is None or held.step == step):
            options.setdefault(held.step, []).append(_RestoreOption(
                f"memory:step {held.step}", partial(self._read_memory, held), (),
                lambda error: None))
        newest_remote = plan.attempts[0].step if plan.attempts else -1
        peer_steps = self._peer_targets(step, newest_remote) if not forced else []
        for target in (t for t in peer_steps if t < below):
            assert self.peers is not None
            options.setdefault(target, []).append(_RestoreOption(
                f"peer:{self.peers.run_id}/{target}", partial(self._read_peer, target),
                (*_PEER_ERRORS, RuntimeError),
                partial(self._mark_failed_on_restore, target, Tier.PEER)))
        for cand in plan.attempts:
            expected = digests.get(cand.step) if cand.status is not None else None
            options.setdefault(cand.step, []).append(_RestoreOption(
                self.remote.path(cand.name), partial(self._read_remote, cand.name, expected),
                (CheckpointFormatError, OSError),
                partial(self._mark_damaged_on_restore, cand.step)))
        return options

    def _read_first(self, options: list[_RestoreOption], skipped: list[SkippedCheckpoint]
                    ) -> _Read | None:
        """The first source of one step that reads and verifies; each one that cannot is
        skipped with its reason."""
        for option in options:
            try:
                return option.read()
            except option.unreadable as e:
                log.warning("skipping checkpoint %s: %s", option.where, e)
                skipped.append(SkippedCheckpoint(option.where, str(e)))
                option.on_fail(e)
        return None

    def _steps_every_rank_has(self, steps: list[int], failure: BaseException | None
                              ) -> list[int]:
        """The steps (newest first) that every rank has a source for: one all-gather of each
        rank's newest few candidates, so all ranks walk the same list. A rank whose planning
        raised sends a mark instead, and every rank raises."""
        local = (steps[:_AGREE_STEPS] + [-1] * _AGREE_STEPS)[:_AGREE_STEPS]
        if failure is not None:
            local[0] = _FAILED
        mine = torch.tensor(local, dtype=torch.int64, device=self._collective_device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        torch.distributed.all_gather(every, mine)
        failed = [rank for rank, t in enumerate(every) if int(t[0]) == _FAILED]
        self._raise_if_failed(-1 if failed else 1, failure,
                              f"planning on rank(s) {', '.join(map(str, failed))}")
        common = set.intersection(*({s for s in t.tolist() if s >= 0} for t in every))
        return sorted(common, reverse=True)

    def _vote(self, value: int) -> int:
        """The minimum over ranks of ``value`` (1 yes, 0 no, -1 this rank failed)."""
        flag = torch.tensor([value], dtype=torch.int64, device=self._collective_device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return int(flag.item())

    def _raise_if_failed(self, vote: int, failure: BaseException | None, where: str) -> None:
        if failure is not None:
            raise failure
        if vote < 0:
            raise _AnotherRankFailed(
                f"rank {self.rank}: another rank failed while restoring ({where}; its log "
                "says why); every rank stops so that none resumes alone")

    def _peer_targets(self, step: int | None, newest_remote: int) -> list[int]:
        """Peer checkpoints to try, newest first: ``step`` if it is a valid peer row, else
        the valid peer rows (or, with no metadata, what the peers hold) at least as new as
        the newest remote candidate. The peers keep one state per run, so this is normally
        one checkpoint."""
        if self.peers is None:
            return []
        rows = self.store.rows(self.run_id, rank=self.rank, tier=Tier.PEER)
        if rows:
            steps = {r.step for r in rows if r.status is Status.VALID}
        else:
            try:
                steps = set(self.peers.list())
            except _PEER_ERRORS as e:
                log.warning("cannot list the peer tier: %s", e)
                return []
        if step is not None:
            return [step] if step in steps else []
        newer = sorted((s for s in steps if s >= newest_remote), reverse=True)
        return newer[:MAX_RECOVERY_WALK]

    def _read_remote(self, name: str, manifest_sha256: str | None) -> _Read:
        loaded = read_organ(self.remote, name, manifest_sha256=manifest_sha256)
        read = sum(int(f["bytes"]) for f in loaded.manifest["files"].values())
        return _Read(RecoverySource.REMOTE, Level(loaded.manifest["level"]), loaded.location,
                     read, loaded.meta, loaded.tensor)

    def _read_peer(self, step: int) -> _Read:
        assert self.peers is not None
        fetched = self.peers.fetch(step)
        where = f"peer:{self.peers.run_id}/{step}"
        try:
            meta = json.loads(fetched.meta)
            if meta.get("format") != PEER_FORMAT or (meta.get("step"), meta.get("rank")) != (
                    step, self.rank):
                raise CheckpointFormatError(
                    f"{where}: holds {meta.get('format')!r} of step {meta.get('step')!r}, "
                    f"rank {meta.get('rank')!r}")
            layout = [(name, DTYPES[dtype], shape) for name, dtype, shape in meta["layout"]]
            level = Level(meta["level"])
            state = meta["state"]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointFormatError(f"{where}: bad meta: {e}") from e
        arena = (torch.frombuffer(fetched.image, dtype=torch.uint8) if fetched.image
                 else torch.empty(0, dtype=torch.uint8))
        tensors = arena_views(arena, layout)

        def get_tensor(key: str) -> torch.Tensor:
            try:
                return tensors[key]
            except KeyError:
                raise CheckpointFormatError(
                    f"{where}: state refers to tensor {key!r}, absent from the image") from None

        if fetched.rebuilt_shard is not None:
            where += f" (shard {fetched.rebuilt_shard} rebuilt from parity)"
        return _Read(RecoverySource.PEER, level, where, fetched.bytes_fetched, state,
                     get_tensor)

    def _consume_pin(self, step: int, forced: bool) -> None:
        self.store.audit("recover-applied", {"step": step, "rank": self.rank,
                                             "forced": forced})
        # Every rank consumes it; the first one removes it.
        (self.run_dir / RECOVER_PIN).unlink(missing_ok=True)

    def _read_memory(self, held: MemoryEntry) -> _Read:
        # Clones: an optimizer's load_state_dict may keep the very tensors it is given, and
        # these buffers go back to the snapshot pool for the next capture.
        snap = held.snapshot
        return _Read(RecoverySource.MEMORY, Level(held.level), f"memory:step {held.step}",
                     snap.nbytes, snap.meta, lambda key: snap.tensors[key].clone())

    def _apply(self, meta: Mapping[str, Any], get_tensor: Callable[[str], torch.Tensor]
               ) -> None:
        restored_extras = apply(self.components, meta, get_tensor)
        self.extras.clear()
        self.extras.update(restored_extras)
        self.epoch = meta.get("epoch")

    def _recovery_candidates(self) -> tuple[list[Candidate],
                                            list[tuple[int, SkippedCheckpoint]],
                                            dict[int, str]]:
        """Published archives of this rank with their metadata status, and the ``valid`` rows
        whose archive is missing (deleted, a wrong mount or ``tiers.remote.url``): those count
        as checkpoints that exist, so losing them is never a silent restart from scratch.
        Repairs the traces a killed writer left (staging directories, rows still
        ``pending``). Also returns the manifest digest each step's row recorded."""
        try:
            listing = list_archives(self.remote, self.rank)
        except OSError as e:
            log.warning("cannot list the remote tier %s: %s", self.remote.url, e)
            listing, unlisted = ArchiveListing(published=[], staging=[]), str(e)
        else:
            unlisted = None
        for debris in listing.staging:
            log.warning("removing %s: a save that never finished (writer killed)",
                        self.remote.path(debris))
            try:
                self.remote.remove(debris)
            except OSError as e:
                log.warning("cannot remove %s: %s", self.remote.path(debris), e)
        published = dict((name, s) for s, name in listing.published)
        rows = self._rows_by_step()
        for row in rows.values():
            if row.status is not Status.PENDING:
                continue
            name = checkpoint_name(row.step, self.rank)
            if name in published:  # validated, published, killed before the row was marked
                rows[row.step] = self.store.mark(row.key, Status.VALID,
                                                 location=self.remote.path(name))
            else:
                rows[row.step] = self.store.mark(
                    row.key, Status.CORRUPTED,
                    note="the writer died before the checkpoint was published")
        candidates = []
        for name, step in published.items():
            row = rows.get(step)
            if row is not None:
                candidates.append(Candidate(step, row.level, Tier.REMOTE, name, row.status))
                continue
            try:  # no metadata (database lost or rebuilt): the manifest says what it is
                level = read_manifest(self.remote, name)["level"]
            except (CheckpointFormatError, OSError):
                level = "unknown"
            candidates.append(Candidate(step, level, Tier.REMOTE, name, None))
        missing = [
            (row.step, SkippedCheckpoint(row.location, (
                f"recorded valid but cannot list {self.remote.url}: {unlisted}" if unlisted
                else f"recorded valid but its data is missing from {self.remote.url} "
                "(deleted, or a wrong mount / tiers.remote.url?)")))
            for row in sorted(rows.values(), key=lambda r: -r.step)
            if row.status is Status.VALID and checkpoint_name(row.step, self.rank)
            not in published]
        if unlisted is not None and not missing:  # nothing recorded, nothing listable
            missing.append((_ALWAYS_REPORTED, SkippedCheckpoint(
                self.remote.url, f"cannot list the remote tier: {unlisted}")))
        return candidates, missing, {step: row.sha256 for step, row in rows.items()}

    def _rows_by_step(self) -> dict[int, CheckpointRow]:
        """This rank's remote rows, the newest row of each step."""
        rows: dict[int, CheckpointRow] = {}
        for row in self.store.rows(self.run_id, rank=self.rank, tier=Tier.REMOTE):
            rows.setdefault(row.step, row)
        return rows

    def _mark_failed_on_restore(self, step: int, tier: Tier, error: BaseException) -> None:
        row = self.store.get(CheckpointKey(self.run_id, step, self.rank, tier))
        if row is not None and row.status in (Status.VALID, Status.PENDING):
            self.store.mark(row.key, Status.CORRUPTED, note=f"failed on restore: {error}"[:2000])

    def _mark_damaged_on_restore(self, step: int, error: BaseException) -> None:
        """Only wrong bytes mark a remote copy corrupted; an I/O error may pass (a flaky
        mount) and must not condemn a good checkpoint to the next prune."""
        if isinstance(error, CheckpointFormatError):
            self._mark_failed_on_restore(step, Tier.REMOTE, error)

    # -- instability rollback --------------------------------------------------------------

    @property
    def rollbacks(self) -> tuple[Rollback, ...]:
        """The instability rollbacks this rank of the run has made, oldest first (from the
        failure ledger: they survive a restart)."""
        return tuple(self._rollbacks)

    def _check_rollback_setup(self) -> None:
        """Rollback skips batches through the data state: refuse, before training, a setup
        where that cannot happen rather than fail at the first spike."""
        rollback = self.policy.rollback
        if not rollback.enabled or rollback.skip_batches == 0:
            return
        data = self.components.data_state
        if data is None or not callable(getattr(data, "skip_batches", None)):
            what = "no data_state" if data is None else f"a {type(data).__name__}"
            raise PolicyError(
                "rollback.skip_batches",
                f"rollback is enabled and skips batches, but the pilot has {what}, without "
                "skip_batches(n); pass data_state=ResumableSampler(..., batch_size=B) (or a "
                "data state with skip_batches), or set rollback.skip_batches: 0")
        if getattr(data, "batch_size", 0) is None:
            raise PolicyError(
                "rollback.skip_batches",
                "rollback is enabled and skips batches, but the data_state sampler has no "
                "batch size; build it as ResumableSampler(..., batch_size=B)")

    def _on_spike(self, decision: CheckpointDecision, onset: int,
                  reason: str) -> CheckpointDecision:
        """A confirmed loss spike: keep the newest save before it, and roll back to it when
        rollback is enabled (the decision then saves nothing: the live state is damaged).

        "Before it" means before step ``onset − 1``: the loss of step t is computed with the
        weights of checkpoint t − 1, so the onset's high loss already indicts the state saved
        at the step before it; the checkpoint of ``onset − 2`` produced a normal loss.
        """
        suspect = onset - 1
        if self._protected_onset != onset:
            self._protected_onset = onset
            job = _InFlight(self.step, "rollback protection")
            job.future = self._executor.submit(self._protect_before, suspect)
            self._inflight.append(job)
        if not self.policy.rollback.enabled:
            log.warning("loss spike at step %d: %s; the newest checkpoint before step %d is "
                        "kept for good as critical (rollback is off)", self.step, reason,
                        suspect)
            return replace(decision, spike_onset=onset)
        target = self._rollback(onset, reason)
        if target is None:
            return replace(decision, spike_onset=onset,
                           reason=f"{decision.reason}; spike since step {onset} not rolled "
                                  f"back: no checkpoint before step {suspect} loads")
        return replace(decision, save=False, level=None, spike_onset=onset, rollback_to=target,
                       reason=f"rollback to step {target}: {reason}")

    def _protect_before(self, suspect: int) -> None:
        """On the writer thread, after every save queued before it: class the newest save
        before ``suspect`` (the rollback point) ``critical``, so that no prune ever removes
        it — as ``important`` it would compete with the next spikes' points for
        ``important_keep`` places — and the other saves within ``baseline_window`` steps
        before it ``important`` at least."""
        rows = [row for row in self.store.rows(self.run_id, rank=self.rank,
                                               status=(Status.VALID, Status.PENDING))
                if row.step < suspect]
        if not rows:
            return
        newest = max(row.step for row in rows)
        first = suspect - self.policy.rollback.baseline_window
        for row in rows:
            if row.step == newest and row.retention_class is not RetentionClass.CRITICAL:
                promoted = RetentionClass.CRITICAL
            elif row.step >= first and row.retention_class is RetentionClass.ROUTINE:
                promoted = RetentionClass.IMPORTANT
            else:
                continue
            self.store.mark(row.key, row.status, retention_class=promoted.value,
                            note=f"kept: saved before the loss spike of step {suspect + 1}")

    def _rollback(self, onset: int, reason: str) -> int | None:
        """Restore the newest checkpoint before ``onset − 1`` (see :meth:`_on_spike`), skip
        the configured batches and record it; None (nothing changed) when none loads."""
        rollback = self.policy.rollback
        detected = self.step
        # A resume after a rollback skips its batches again (see restore()), so it never
        # meets the same spike twice: every recorded rollback counts.
        count = 1 + sum(event.step > detected - rollback.window_steps
                        for event in self._rollbacks)
        if count > rollback.max_rollbacks:
            raise RollbackLimitError(
                f"rank {self.rank}: loss spike at step {detected} ({reason}) would be rollback "
                f"{count} within {rollback.window_steps} steps (rollback.max_rollbacks = "
                f"{rollback.max_rollbacks}): the instability keeps coming back; lower the "
                "learning rate or inspect the data, then resume (`ckptpilot ls` shows the "
                "checkpoints before the spikes)")
        target = self._restore(None, before=onset - 1)
        if target is None:
            log.warning("loss spike at step %d (%s): no checkpoint before step %d loads; "
                        "training goes on without a rollback", detected, reason, onset - 1)
            return None
        skip = (detected - target) if rollback.skip_batches is None else rollback.skip_batches
        if skip:
            self.components.data_state.skip_batches(skip)  # type: ignore[union-attr]
        self._rollbacks.append(self._ledger.record_rollback(
            step=detected, onset=onset, to_step=target, skipped_batches=skip, reason=reason))
        self._spikes.forget_excursion()
        if self._agree_work is not None:
            # The reduction started at this step may carry the same spike from a rank that
            # confirmed it a step later: every rank drops it, and starts afresh.
            self._agree_work.wait()
            self._agree_work = None
        log.warning("rolled back from step %d to step %d (%s); skipped %d batches", detected,
                    target, reason, skip)
        return target

    def _skip_again_after(self, step: int) -> None:
        """After restoring the step a rollback returned to, skip the batches it skipped."""
        for event in reversed(self._rollbacks):
            if event.to_step == step:
                if event.skipped_batches and self.components.data_state is not None:
                    self.components.data_state.skip_batches(event.skipped_batches)  # type: ignore[attr-defined]
                    log.info("step %d is where the rollback of step %d returned to: skipped "
                             "its %d batches again", step, event.step, event.skipped_batches)
                return

    def _after_restore(self, step: int, level: Level | None) -> None:
        if self.memory is not None:
            self.memory.drop_after(step)
        for row in self.store.rows(self.run_id, rank=self.rank):
            # Restoring an earlier step abandons the continuation saved after it (in any
            # tier); expiring its rows keeps a later restore, after a crash, from going back
            # to it. (Re-saving one of those steps would set its files aside anyway.)
            if row.step > step and row.status in (Status.VALID, Status.PENDING):
                target = Status.CORRUPTED if row.status is Status.PENDING else Status.EXPIRED
                self.store.mark(row.key, target,
                                note=f"abandoned: the run was restored to step {step}")
        self.scheduler.restart(step)
        self.step = self._base_step = step
        self._optimizer_steps = 0
        self._last_save_step = step
        if level is not None:
            self.scheduler.note_save(step, level)

    def _report(self, source: RecoverySource, step: int, level: str | None, t0: float,
                location: str | None, skipped: list[SkippedCheckpoint],
                bytes_read: int = 0, *, lifecycle: bool = True) -> RecoveryReport:
        """The report of a restore; with ``lifecycle`` (not a rollback) the ledger also gets
        the dead run's interruption, if there was one, and this run's start."""
        seconds = time.perf_counter() - t0
        if not lifecycle:
            return RecoveryReport(source=source, step=step, level=level, seconds=seconds,
                                  steps_lost=None, location=location, skipped=tuple(skipped),
                                  bytes_read=bytes_read)
        hb = self._previous_heartbeat
        steps_lost = None
        if hb is not None and hb.step is not None:
            steps_lost = max(0, hb.step - step)
            if self._ledger.last_kind() == "run_start":
                self._ledger.record_interruption(
                    failed_at=hb.wall_time, last_step=hb.step, recovered_step=step,
                    source=source.value, recovery_seconds=seconds,
                    uptime_seconds=hb.uptime_seconds)
        self._ledger.record_run_start(step)
        self._run_started = True
        self._mtbf_seconds = self._ledger.mtbf_seconds()
        return RecoveryReport(source=source, step=step, level=level, seconds=seconds,
                              steps_lost=steps_lost, location=location, skipped=tuple(skipped),
                              bytes_read=bytes_read)

    # -- lifecycle -------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait for every pending save; raises the first background error."""
        for job in list(self._inflight):
            job.future.exception()
        self._raise_background_errors()

    def close(self) -> None:
        """Wait for every pending save, then stop every thread and release the run (the
        lease last); every step runs even when an earlier one raised, and the first error
        is raised after them."""
        if self._closed:
            return
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
        with self._teardown():
            self.flush()

    def _teardown(self) -> contextlib.ExitStack:
        """The stops and releases of a pilot, in order, as one stack whose every callback
        runs; safe on a pilot whose construction failed part-way."""
        stack = contextlib.ExitStack()
        stack.callback(self._lease.release)

        def then(name: str, method: str) -> None:
            part = getattr(self, name, None)
            if part is not None:
                stack.callback(getattr(part, method))

        then("store", "close")
        if getattr(self, "_run_started", False):
            stack.callback(lambda: self._ledger.record_run_end(self.step))
        then("peers", "close")
        then("_validator", "close")
        then("_telemetry", "close")
        then("_health", "stop")
        then("_heartbeat", "close")
        then("_agree_work", "wait")
        then("_executor", "shutdown")
        return stack

    def __enter__(self) -> CheckpointPilot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> Mapping[str, Any]:
        """Totals over the saves this process completed."""
        stalls = [r.stall_seconds for r in self.saves]
        return {
            "saves": len(self.saves),
            "bytes": sum(r.bytes for r in self.saves),
            "median_stall_seconds": statistics.median(stalls) if stalls else None,
            "non_finite_steps": self._non_finite_steps,
            "interval": self.last_decision.interval if self.last_decision else None,
            "base_interval": self.scheduler.base_interval,
            "step_seconds": self._step_seconds,
            "mtbf_seconds": self._mtbf_seconds,
        }
