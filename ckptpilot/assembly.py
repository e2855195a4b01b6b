"""Building the parts of one rank's pilot from its policy, and stopping them in order.

This module owns :func:`open_parts` and :class:`RunParts`: the one place that knows which
part needs which (the tiers and the catalog before the writer, the writer before the rollback
guard, the agreement before the restorer and the per-step decider), and in which order their
stops run (:data:`STOP_ORDER`). A failure half-way through stops exactly what was started;
once every part runs, their stops go on the caller's ``ExitStack``.

It is also the one module above ``tiers/`` that knows the concrete tiers: :func:`memory_tier`,
:func:`peer_tier`, :func:`remote_tier` and :func:`sharded_tier` build the
:class:`~ckptpilot.tiers.base.CheckpointTier` objects the writer and the restorer are given,
and the tier conformance suite (``tests/tiers/``) builds the objects it certifies through the
same functions.

And it chooses, once, how this run's state is handled (:class:`StateHandling`): a replicated
state is captured into one arena (``capture.state``) and goes to the memory, peer and remote
tiers; a sharded one (a model of DTensors) is captured as DTensors (``capture.sharded``),
goes to the DCP-backed sharded tier alone. The writer's and the restorer's loops, the pilot
and its save and restore calls are the same for both.

It must not train, save or restore. Threading: the training thread, once per pilot.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ckptpilot import background
from ckptpilot.agreement import RankAgreement
from ckptpilot.capture import devicecopy
from ckptpilot.capture.state import (
    HostBufferPool,
    Snapshot,
    TrainingComponents,
    apply,
    capture,
    holds_dtensors,
)
from ckptpilot.catalog import Catalog, SaveIntent
from ckptpilot.codecs.selector import CodecSelector
from ckptpilot.errors import PolicyError
from ckptpilot.guards.preemption import PreemptionGuard
from ckptpilot.guards.rollback import RollbackGuard
from ckptpilot.guards.watchdog import HangWatchdog
from ckptpilot.lifecycle import RunLifecycle
from ckptpilot.policy import Policy
from ckptpilot.probes.gpu import GpuHealthProvider
from ckptpilot.probes.monitor import HealthMonitor
from ckptpilot.restorer import Restorer
from ckptpilot.retention.auto import AutoPruner
from ckptpilot.rundir import heartbeat_path, ledger_path, metadata_path, run_identity
from ckptpilot.save.plan import SavePlan, plan_save
from ckptpilot.save.writer import CheckpointWriter
from ckptpilot.scheduler.adaptive import AdaptiveCheckpointScheduler
from ckptpilot.steps import StepDecider
from ckptpilot.storage.heartbeat import HeartbeatWriter, read_latest
from ckptpilot.storage.ledger import FailureLedger
from ckptpilot.storage.metadata import MetadataStore
from ckptpilot.telemetry import Telemetry
from ckptpilot.tiers.base import CheckpointTier
from ckptpilot.tiers.memory import MemoryTier
from ckptpilot.tiers.peer import PeerCheckpointTier, PeerTier
from ckptpilot.tiers.remote.store import RemoteTier
from ckptpilot.tiers.remote.tier import RemoteCheckpointTier
from ckptpilot.validation.postwrite import PostWriteValidator

if TYPE_CHECKING:
    import torch.distributed as dist

    from ckptpilot.tiers.sharded.load import LiveTensors

__all__ = ["STOP_ORDER", "RunParts", "StateHandling", "codec_selector", "memory_tier",
           "open_parts", "peer_tier", "remote_tier", "sharded_tier"]

log = logging.getLogger("ckptpilot")

STOP_ORDER = ("watchdog", "preemption", "writer", "copier", "agreement", "heartbeat", "health",
              "telemetry", "validator", "peers", "run_end", "store")
"""The order the parts stop in: the hang watchdog and the signal handlers first (a closing
pilot has no steps to watch and takes no notice), the writer next (nothing is written after),
then the step hooks of the device copies (no copy is pending once the writer stopped), the pending
all-reduce before the clean end goes into the ledger, the metadata store last."""


@dataclass(frozen=True)
class StateHandling:
    """How this run's state is captured, planned and applied: ``capture(step=, epoch=,
    extras=)`` takes a snapshot on the training thread; ``plan(intent)`` the tiers it goes
    to; ``apply(components, meta, get_tensor)`` loads a read step into the live objects and
    returns the extras."""

    capture: Callable[..., Snapshot]
    plan: Callable[[SaveIntent], SavePlan]
    apply: Callable[[TrainingComponents, Mapping[str, Any], Callable[[str], torch.Tensor]],
                    dict[str, Any]]


@dataclass(frozen=True)
class RunParts:
    """The parts of one rank's pilot (docs/reference/layout.md says what each does)."""

    run_id: str
    remote: RemoteTier
    memory: MemoryTier | None
    peers: PeerTier | None
    pool: HostBufferPool
    store: MetadataStore
    catalog: Catalog
    scheduler: AdaptiveCheckpointScheduler
    telemetry: Telemetry
    writer: CheckpointWriter
    heartbeat: HeartbeatWriter
    lifecycle: RunLifecycle
    rollback: RollbackGuard
    health: HealthMonitor | None
    agreement: RankAgreement | None
    restorer: Restorer
    steps: StepDecider
    state: StateHandling  # replicated or sharded (a model of DTensors: through DCP)
    copier: devicecopy.StepFences | None  # device tensors: captures overlap the next steps
    preemption: PreemptionGuard
    watchdog: HangWatchdog


def memory_tier(max_bytes: int, pool: HostBufferPool) -> MemoryTier:
    """The memory tier of one rank: its newest valid save, held in the snapshot pool's own
    buffers (``tiers.memory.max_bytes`` bounds it)."""
    return MemoryTier(max_bytes, pool)


def peer_tier(peers: PeerTier, *, rank: int) -> CheckpointTier:
    """Rank ``rank``'s images on the peer tier ``peers`` (closing it closes ``peers``)."""
    return PeerCheckpointTier(peers, rank=rank)


def codec_selector(policy: Policy) -> CodecSelector:
    """The codecs a pulse goes through on the remote tier (``codecs`` policy), chosen at the
    tier's ``bandwidth``."""
    codecs = policy.codecs
    return CodecSelector(
        {"weights": codecs.weights, "optimizer": codecs.optimizer, "other": codecs.other},
        bandwidth_bytes_per_s=policy.tiers.remote.bandwidth, level=codecs.zstd_level,
        prefix_bits=codecs.prefix_bits, threads=codecs.threads)


def remote_tier(remote: RemoteTier, *, rank: int, validator: PostWriteValidator | None = None,
                codecs: CodecSelector | None = None) -> CheckpointTier:
    """Rank ``rank``'s archives on ``remote``, validated by ``validator`` before publication
    and encoded by ``codecs`` when a save asks for codecs (see ``tiers.remote.tier``)."""
    return RemoteCheckpointTier(remote, rank=rank, validator=validator, codecs=codecs)


def sharded_tier(policy: Policy, remote: RemoteTier, *, rank: int, world_size: int,
                 group: dist.ProcessGroup | None, live: LiveTensors | None = None,
                 codecs: CodecSelector | None = None) -> CheckpointTier:
    """Rank ``rank``'s part of the run's sharded checkpoints (DCP) on ``remote``, its
    collectives on ``group`` (None: one process); a load reshards into ``live`` (see
    ``tiers.sharded.tier``)."""
    from ckptpilot.tiers.sharded import ShardedTier  # DCP: seconds of imports dense runs skip

    return ShardedTier(policy, remote, rank=rank, world_size=world_size, group=group,
                       live=live, codecs=codecs)


def open_parts(policy: Policy, components: TrainingComponents, *, rank: int, world_size: int,
               gpu_health: GpuHealthProvider | None, stops: contextlib.ExitStack,
               step_now: Callable[[], int]) -> RunParts:
    """Start every part of a pilot for ``policy.run_dir`` and put their stops on ``stops``
    (in :data:`STOP_ORDER`; the ledger's clean end records ``step_now()``). If a part fails
    to start, the ones already started are stopped, in that order, and the error raised."""
    started: dict[str, Callable[[], object]] = {}
    try:
        parts = _start(policy, components, rank, world_size, gpu_health, started)
    except BaseException:
        partial = contextlib.ExitStack()
        _push(partial, started)
        try:
            partial.close()
        except Exception:
            log.exception("while stopping what a pilot that failed to start had started")
        raise
    started["run_end"] = lambda: parts.lifecycle.end(step_now())
    _push(stops, started)
    return parts


def _push(stack: contextlib.ExitStack, started: dict[str, Callable[[], object]]) -> None:
    for name in reversed(STOP_ORDER):  # an ExitStack runs the last pushed first
        if name in started:
            stack.callback(started[name])


def _start(policy: Policy, components: TrainingComponents, rank: int, world_size: int,
           gpu_health: GpuHealthProvider | None,
           started: dict[str, Callable[[], object]]) -> RunParts:
    run_dir = Path(policy.run_dir)
    remote = RemoteTier(policy.tiers.remote.url, policy.tiers.remote.storage_options,
                        retries=policy.tiers.remote.retries,
                        verify_reads=policy.tiers.remote.verify_reads)
    if not remote.durable:
        raise PolicyError("tiers.remote.url", f"{remote.url} does not outlive this process, "
                          "so it cannot hold recovery points; use a directory or an object "
                          "store (file://, s3://, gs://)")
    run_id = run_identity(run_dir)
    store = MetadataStore(metadata_path(run_dir))
    started["store"] = store.close
    # A directory whose rows are keyed by its folder's name (no run id yet) is re-keyed.
    store.adopt_run_id(run_dir.name, run_id)
    catalog = Catalog(store, run_id, rank, run_dir)
    validator = PostWriteValidator(policy.validation)
    started["validator"] = validator.close
    scheduler = AdaptiveCheckpointScheduler(policy.scheduler, policy.retention)
    max_pending = policy.async_.max_pending
    background.use_idle_priority(policy.async_.background_priority == "idle")
    pool = HostBufferPool(max_pending)
    mem, peer = policy.tiers.memory, policy.tiers.peer
    sharded = holds_dtensors(components)
    if sharded and (mem.enabled or peer.enabled):
        log.info("sharded state: saves go to the remote tier only (ckptpilot.dcp); the "
                 "memory and peer tiers hold one rank's replicated state")
    memory = memory_tier(mem.max_bytes, pool) if mem.enabled and not sharded else None
    peers = None
    if peer.enabled and not sharded:
        peers = PeerTier.from_policy(peer, run_id=f"{run_dir.name}-{run_id}.rank{rank:05d}")
        started["peers"] = peers.close
    obs = policy.observability
    telemetry = Telemetry(run_dir, rank=rank, tensorboard=obs.tensorboard,
                          decision_log=obs.decision_log)
    started["telemetry"] = telemetry.close
    pulse_codecs = codec_selector(policy)
    retention = policy.retention
    pruner = (AutoPruner(store, run_id, remote, retention, world_size=world_size)
              if rank == 0 and (retention.auto or retention.budgeted) else None)
    agreement = None
    if world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        agreement = RankAgreement(rank, world_size)
        started["agreement"] = agreement.drop
    if sharded:
        tiers, state = _sharded(policy, components, remote, pool, rank, world_size,
                                pulse_codecs)
    else:
        tiers = [remote_tier(remote, rank=rank, validator=validator, codecs=pulse_codecs)]
        if peers is not None:
            tiers.append(peer_tier(peers, rank=rank))
    writer = CheckpointWriter(catalog=catalog, tiers={t.kind: t for t in tiers}, keeper=memory,
                              pool=pool, telemetry=telemetry, max_pending=max_pending,
                              pruner=pruner)
    started["writer"] = writer.shutdown
    hb_path = heartbeat_path(run_dir, rank)
    previous_heartbeat = read_latest(hb_path)
    heartbeat = HeartbeatWriter(hb_path)
    started["heartbeat"] = heartbeat.close
    ledger = FailureLedger(ledger_path(run_dir, rank))
    lifecycle = RunLifecycle(ledger, previous_heartbeat)
    watchdog = HangWatchdog(policy.watchdog, rank=rank, heartbeat=heartbeat,
                            heartbeat_path=hb_path, lifecycle=lifecycle, drain=writer.wait)
    started["watchdog"] = watchdog.close
    preemption = PreemptionGuard(policy.preemption, rank=rank, catalog=catalog, writer=writer,
                                 lifecycle=lifecycle)
    started["preemption"] = preemption.close
    rollback = RollbackGuard(policy.rollback, rank=rank, ledger=ledger, catalog=catalog,
                             writer=writer, data_state=components.data_state)
    health = None
    if policy.scheduler.weights.system > 0:
        health = HealthMonitor(run_dir, policy.scheduler.system, provider=gpu_health)
        started["health"] = health.stop  # also when start() fails half-way
        health.start()
    copier = None
    # A sharded model's capture copies and synchronises on its own (capture.sharded): no hooks.
    device = devicecopy.copier_for(components.model) if not sharded else None
    if device is not None:
        copier = devicecopy.StepFences(device, components.model, components.optimizer)
        started["copier"] = copier.remove
    if not sharded:
        state = StateHandling(
            capture=functools.partial(capture, components, rank=rank, world_size=world_size,
                                      pool=pool, copier=copier),
            plan=functools.partial(plan_save, policy=policy), apply=apply)
    return RunParts(
        run_id=run_id, remote=remote, memory=memory, peers=peers, pool=pool, store=store,
        catalog=catalog, scheduler=scheduler, telemetry=telemetry, writer=writer,
        heartbeat=heartbeat, lifecycle=lifecycle, rollback=rollback, health=health,
        agreement=agreement, restorer=Restorer(catalog, tiers, memory, agreement, world_size),
        steps=StepDecider(policy, scheduler, health=health, agreement=agreement,
                          rollback=rollback, notice=lambda: preemption.pending),
        state=state, copier=copier, preemption=preemption, watchdog=watchdog)


def _sharded(policy: Policy, components: TrainingComponents, remote: RemoteTier,
             pool: HostBufferPool, rank: int, world_size: int, codecs: CodecSelector
             ) -> tuple[list[CheckpointTier], StateHandling]:
    """The parts that handle a sharded state: the DCP-backed tier on a gloo process group of
    its own (DCP's collectives run on the writer thread while training runs its own: on one
    group they could interleave differently on different ranks), its capture and apply."""
    import torch.distributed as dist  # DCP: seconds of imports dense runs skip

    from ckptpilot.capture.sharded import ShardedCapture, apply_sharded, live_tensors

    def live() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        _, optim_tree, model, optim = live_tensors(components)
        return model, (optim if optim_tree is not None else None)

    group = dist.new_group(backend="gloo") if dist.is_initialized() else None
    tier = sharded_tier(policy, remote, rank=rank, world_size=world_size, group=group,
                        live=live, codecs=codecs)
    state = StateHandling(
        capture=ShardedCapture(components, rank=rank, world_size=world_size, pool=pool),
        plan=functools.partial(plan_save, policy=policy, rank_local=False),
        apply=functools.partial(apply_sharded, rank=rank, world_size=world_size))
    return [tier], state
