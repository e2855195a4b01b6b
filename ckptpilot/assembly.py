"""Building the parts of one rank's pilot from its policy, and stopping them in order.

This module owns :func:`open_parts` and :class:`RunParts`: the one place that knows which
part needs which (the tiers and the catalog before the writer, the writer before the rollback
guard, the agreement before the restorer and the per-step decider). Every part that runs a
thread or holds a file registers its stop on the caller's ``ExitStack`` the moment it exists,
so a failure half-way through stops exactly what was started, and a normal close stops the
parts in the reverse order of their start (the writer before the telemetry it reports to, the
metadata store last).

It must not train, save or restore. Threading: the training thread, once per pilot.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ckptpilot.agreement import RankAgreement
from ckptpilot.catalog import Catalog
from ckptpilot.codecs.selector import CodecSelector
from ckptpilot.lifecycle import RunLifecycle
from ckptpilot.policy import Policy
from ckptpilot.probes.gpu import GpuHealthProvider
from ckptpilot.probes.monitor import HealthMonitor
from ckptpilot.restorer import Restorer
from ckptpilot.rollback import RollbackGuard
from ckptpilot.rundir import run_identity
from ckptpilot.scheduler.adaptive import AdaptiveCheckpointScheduler
from ckptpilot.state import HostBufferPool, TrainingComponents
from ckptpilot.steps import StepDecider
from ckptpilot.storage.heartbeat import HeartbeatWriter, read_latest
from ckptpilot.storage.ledger import FailureLedger
from ckptpilot.storage.metadata import MetadataStore
from ckptpilot.telemetry import Telemetry
from ckptpilot.tiers.memory import MemoryTier
from ckptpilot.tiers.peer import PeerTier
from ckptpilot.tiers.remote import RemoteTier
from ckptpilot.validation.postwrite import PostWriteValidator
from ckptpilot.writer import CheckpointWriter

__all__ = ["RunParts", "open_parts"]


@dataclass(frozen=True)
class RunParts:
    """The parts of one rank's pilot (see the README's "Layout" for what each does)."""

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


def open_parts(policy: Policy, components: TrainingComponents, *, rank: int, world_size: int,
               gpu_health: GpuHealthProvider | None, stops: contextlib.ExitStack) -> RunParts:
    """Start every part of a pilot for ``policy.run_dir``, registering each stop on
    ``stops`` as soon as the part exists."""
    run_dir = Path(policy.run_dir)
    remote = RemoteTier(policy.tiers.remote.url)
    run_id = run_identity(run_dir)
    store = MetadataStore(run_dir / "metadata.sqlite")
    stops.callback(store.close)
    # A directory whose rows are keyed by its folder's name (no run id yet) is re-keyed.
    store.adopt_run_id(run_dir.name, run_id)
    catalog = Catalog(store, run_id, rank, run_dir)
    validator = PostWriteValidator(policy.validation)
    stops.callback(validator.close)
    scheduler = AdaptiveCheckpointScheduler(policy.scheduler, policy.retention)
    max_pending = policy.async_.max_pending
    pool = HostBufferPool(max_pending)
    mem, peer = policy.tiers.memory, policy.tiers.peer
    memory = MemoryTier(mem.max_bytes, pool, max_sets=max_pending) if mem.enabled else None
    peers = None
    if peer.enabled:
        peers = PeerTier.from_policy(peer, run_id=f"{run_dir.name}-{run_id}.rank{rank:05d}")
        stops.callback(peers.close)
    obs = policy.observability
    telemetry = Telemetry(run_dir, rank=rank, tensorboard=obs.tensorboard,
                          decision_log=obs.decision_log)
    stops.callback(telemetry.close)
    codecs = policy.codecs
    pulse_codecs = CodecSelector(
        {"weights": codecs.weights, "optimizer": codecs.optimizer, "other": codecs.other},
        bandwidth_bytes_per_s=policy.tiers.remote.bandwidth, level=codecs.zstd_level,
        prefix_bits=codecs.prefix_bits, threads=codecs.threads)
    writer = CheckpointWriter(catalog=catalog, remote=remote, peers=peers, memory=memory,
                              pool=pool, validator=validator, pulse_codecs=pulse_codecs,
                              telemetry=telemetry, max_pending=max_pending)
    stops.callback(writer.shutdown)
    hb_path = run_dir / f"heartbeat_rank_{rank:05d}.ring"
    previous_heartbeat = read_latest(hb_path)
    heartbeat = HeartbeatWriter(hb_path)
    stops.callback(heartbeat.close)
    ledger = FailureLedger(run_dir / f"ledger_rank_{rank:05d}.jsonl")
    lifecycle = RunLifecycle(ledger, previous_heartbeat)
    rollback = RollbackGuard(policy.rollback, rank=rank, ledger=ledger, catalog=catalog,
                             writer=writer, data_state=components.data_state)
    health = None
    if policy.scheduler.weights.system > 0:
        health = HealthMonitor(run_dir, policy.scheduler.system, provider=gpu_health)
        health.start()
        stops.callback(health.stop)
    agreement = None
    if world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        agreement = RankAgreement(rank, world_size)
        stops.callback(agreement.drop)
    return RunParts(
        run_id=run_id, remote=remote, memory=memory, peers=peers, pool=pool, store=store,
        catalog=catalog, scheduler=scheduler, telemetry=telemetry, writer=writer,
        heartbeat=heartbeat, lifecycle=lifecycle, rollback=rollback, health=health,
        agreement=agreement, restorer=Restorer(catalog, remote, peers, memory, agreement),
        steps=StepDecider(policy, scheduler, health=health, agreement=agreement,
                          rollback=rollback))
