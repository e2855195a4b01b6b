"""The incidents of ``ckptpilot fit --launcher torchrun`` and their table, ``INCIDENTS``.

An incident is the fault options of the training child (a rank kills itself in a phase of its
next save, fills its disk, loses the store or the clock in a restart) and/or the parent's
action at the quiet point (``Act``: damage a rank's newest checkpoint, its manifest or its
catalogue row, SIGKILL ranks or peer daemons), and what the restart must restore (``Expect``).
``LAST`` names the highest rank, whatever N is. The mechanics (damaging a file, killing a
daemon) are the single-process scenarios'; only the choice of rank and the oracle are new.
"""

from __future__ import annotations

import os
import signal
import sqlite3
from collections.abc import Callable

from ckptpilot.fit.attacks import holders_of
from ckptpilot.fit.checks import Needs
from ckptpilot.fit.harness import Trial
from ckptpilot.fit.incident import FAULT_STEP, Act, Damage, Expect, Incident, Scene
from ckptpilot.fit.scenarios import empty_tensors, flip_tensors_bit, truncate_tensors
from ckptpilot.rundir import metadata_path
from ckptpilot.tiers.remote.archive import MANIFEST_FILE, checkpoint_name

LAST = -1
"""A rank number in an incident: the highest rank of the job."""


def rank_of(rank: int, nproc: int) -> int:
    return nproc - 1 if rank == LAST else rank


# -- the parent's actions at the quiet point -------------------------------------------------

def _kill(*ranks: int) -> Act:
    """SIGKILL these ranks (none: every rank) while they wait at the quiet point."""
    def act(scene: Scene) -> Damage:
        chosen = [rank_of(r, scene.ranks) for r in ranks] or list(range(scene.ranks))
        scene.kill(*chosen)
        who = ("every rank" if len(chosen) == scene.ranks
               else "rank " + ", ".join(map(str, chosen)))
        return Damage(f"{who} SIGKILLed after step {scene.quiet[chosen[0]]['step']}")
    return act


Damager = Callable[[Trial, int, int], str]


def _damaged(damage: Damager, rank: int = LAST) -> Act:
    """Damage ``rank``'s newest remote checkpoint, then SIGKILL that rank."""
    def act(scene: Scene) -> Damage:
        victim = rank_of(rank, scene.ranks)
        step = scene.newest(victim)
        what = damage(scene.trial, step, victim)
        scene.kill(victim)
        return Damage(f"rank {victim}: {what}, then SIGKILLed",
                      lost=frozenset({(victim, step, "remote")}))
    return act


def stale_copy(trial: Trial, step: int, rank: int) -> str:
    """The rank's previous checkpoint copied over its newest one's name."""
    tier = trial.remote()
    older = max((s for s in _published(trial, rank) if s < step), default=None)
    if older is None:
        raise ValueError(f"rank {rank} has no checkpoint older than step {step}")
    src, dst = tier.path(checkpoint_name(older, rank)), tier.path(checkpoint_name(step, rank))
    tier.fs.rm(dst, recursive=True)
    tier.fs.copy(src, dst, recursive=True)
    return f"step {older} copied over step {step}"


def _published(trial: Trial, rank: int) -> list[int]:
    from ckptpilot.tiers.remote.archive import list_archives

    return [s for s, _ in list_archives(trial.remote(), rank).published]


def truncated_manifest(trial: Trial, step: int, rank: int) -> str:
    tier = trial.remote()
    path = tier.path(checkpoint_name(step, rank), MANIFEST_FILE)
    data = tier.fs.cat_file(path)
    tier.fs.pipe_file(path, data[: len(data) // 2])
    return f"{checkpoint_name(step, rank)}/{MANIFEST_FILE} cut to {len(data) // 2} bytes"


def removed_checkpoint(trial: Trial, step: int, rank: int) -> str:
    tier = trial.remote()
    tier.fs.rm(tier.path(checkpoint_name(step, rank)), recursive=True)
    return f"{checkpoint_name(step, rank)} deleted"


def forged_row_digest(trial: Trial, step: int, rank: int) -> str:
    """The catalogue row of the checkpoint records another manifest digest."""
    db = sqlite3.connect(metadata_path(trial.run_dir), timeout=60, isolation_level=None)
    try:
        changed = db.execute("UPDATE checkpoints SET sha256 = ? WHERE step = ? AND rank = ? "
                             "AND tier = 'remote'", ("0" * 64, step, rank)).rowcount
    finally:
        db.close()
    if changed == 0:
        raise ValueError(f"no catalogue row for step {step} of rank {rank}")
    return f"the catalogue row of step {step} records a forged digest"


def _metadata_lost(scene: Scene) -> Damage:
    removed = 0
    for suffix in ("", "-wal", "-shm"):
        path = scene.trial.run_dir / f"metadata.sqlite{suffix}"
        if path.exists():
            path.unlink()
            removed += 1
    if removed == 0:
        raise ValueError(f"{scene.trial.run_dir / 'metadata.sqlite'} does not exist")
    victim = scene.ranks - 1
    scene.kill(victim)
    return Damage(f"metadata.sqlite deleted, rank {victim} SIGKILLed")


def _node_lost(scene: Scene) -> Damage:
    os.kill(scene.agent_pid, signal.SIGKILL)
    scene.kill(*range(scene.ranks))
    return Damage("the torchrun agent and every rank SIGKILLed (the node lost)")


def _signal(sig: signal.Signals, rank: int) -> Act:
    """Send ``sig`` to one rank waiting at the quiet point (a preemption notice)."""
    def act(scene: Scene) -> Damage:
        victim = rank_of(rank, scene.ranks)
        scene.kill(victim, sig=sig)
        return Damage(f"{sig.name} to rank {victim} after step {scene.quiet[victim]['step']}")
    return act


def _signal_agent(sig: signal.Signals) -> Act:
    """Send ``sig`` to the torchrun agent, which stops every rank with SIGTERM and exits."""
    def act(scene: Scene) -> Damage:
        os.kill(scene.agent_pid, sig)
        return Damage(f"{sig.name} to the torchrun agent after step {scene.quiet[0]['step']}")
    return act


def _peers(*faults: str) -> Act:
    """One fault per holder of rank 0's newest peer checkpoint (``kill`` or ``stop``), then
    the highest rank SIGKILLed. Past the parity count the peer tier is lost."""
    def act(scene: Scene) -> Damage:
        peers = scene.trial.peers
        assert peers is not None
        step = scene.newest(0, "peer")
        holders = holders_of(scene.quiet[0]["saves"], step)
        if len(holders) < len(faults):
            raise ValueError(f"step {step} is held by {len(holders)} peers only")
        for endpoint, kind in zip(holders, faults, strict=False):
            (peers.stop if kind == "stop" else peers.kill)(endpoint)
        victim = scene.ranks - 1
        scene.kill(victim)
        parity = 1 if scene.harness.policy.tiers.peer.parity else 0
        return Damage(f"{' + '.join(faults)} of the peers holding step {step}, rank "
                      f"{victim} SIGKILLed",
                      lost_tiers=frozenset({"peer"}) if len(faults) > parity else frozenset())
    return act


_PREEMPTED = ("every rank saves the emergency organ of the step after the notice, records a "
              "preemption and exits 75 (PREEMPTED); ")


# -- the table -------------------------------------------------------------------------------

_NEWEST = "every rank restores the newest step all ranks held at the incident; bit-exact"
_BEFORE = ("every rank restores the newest step all ranks still hold (the one before the "
           "damaged one); bit-exact")


def _in_save(name: str, fault: str, phase: str, **job: object) -> Incident:
    return Incident(name, f"last rank SIGKILLed {phase}",
                    "the interrupted save is never loaded; " + _NEWEST,
                    job={"fault": fault, "fault_rank": LAST, "at_step": FAULT_STEP, **job})


INCIDENTS: tuple[Incident, ...] = (
    Incident("rank-killed", "last rank SIGKILLed between saves", _NEWEST, act=_kill(LAST)),
    Incident("rank0-killed", "rank 0 SIGKILLed between saves", _NEWEST, act=_kill(0)),
    Incident("all-ranks-killed", "every rank SIGKILLed", _NEWEST, act=_kill()),
    Incident("node-lost", "torchrun agent and every rank SIGKILLed",
             "the job launched again: " + _NEWEST, act=_node_lost, restarts=0, relaunch=True),
    _in_save("kill-capture", "kill-capture", "during capture"),
    _in_save("kill-write", "kill-write", "mid-write"),
    Incident("kill-fsync", "last rank SIGKILLed in a write's fsync window",
             "written but not durable: never loaded; " + _NEWEST,
             job={"fault": "kill-fsync", "fault_rank": LAST, "at_step": FAULT_STEP},
             policy={"levels": {"pulse": {"fsync": True}}}),
    _in_save("kill-validate", "kill-validate", "during validation"),
    _in_save("kill-staged", "kill-staged", "staged, before publish"),
    Incident("kill-publish", "last rank SIGKILLed after publish",
             "every rank published the step before the kill: every rank restores it; "
             "bit-exact", job={"fault": "kill-publish-all", "fault_rank": LAST,
                               "at_step": FAULT_STEP}, expect=Expect.FAULTED),
    Incident("ranks-killed-mid-save", "every rank SIGKILLed mid-write",
             "no rank's interrupted save is loaded; " + _NEWEST,
             job={"fault": "kill-write-every-rank", "at_step": FAULT_STEP}),
    Incident("enospc", "last rank's disk full (ENOSPC)",
             "the rank stops with CheckpointWriteError; " + _NEWEST,
             job={"fault": "enospc", "fault_rank": LAST, "at_step": FAULT_STEP}),
    Incident("nvml-burst", "GPU error burst on the last rank (fake NVML)",
             "every rank saves the emergency organ, then the rank dies: every rank restores "
             "the organ; bit-exact", job={"fault": "nvml-burst", "fault_rank": LAST,
                                          "at_step": FAULT_STEP}, expect=Expect.FAULTED),
    Incident("remote-down-on-restart", "rank killed, store down in the restart",
             "the first restart: every rank refuses together; the second: " + _NEWEST,
             job={"fault": "remote-down", "fault_attempt": 1}, act=_kill(LAST), restarts=2,
             refusals=1),
    Incident("clock-back-on-restart", "rank killed, clock a day back in the restart",
             _NEWEST, job={"fault": "clock-back", "fault_attempt": 1}, act=_kill(LAST)),
    Incident("truncated-newest", "last rank's newest truncated", _BEFORE,
             act=_damaged(truncate_tensors)),
    Incident("zero-byte-newest", "last rank's newest 0-byte", _BEFORE,
             act=_damaged(empty_tensors)),
    Incident("bitflip-newest", "last rank's newest bit-flipped", _BEFORE,
             act=_damaged(flip_tensors_bit)),
    Incident("bitflip-newest-rank0", "rank 0's newest bit-flipped", _BEFORE,
             act=_damaged(flip_tensors_bit, 0)),
    Incident("stale-copy", "last rank's older copy under the newest name", _BEFORE,
             act=_damaged(stale_copy)),
    Incident("newest-deleted", "last rank's newest deleted", _BEFORE,
             act=_damaged(removed_checkpoint)),
    Incident("manifest-truncated", "last rank's newest manifest truncated", _BEFORE,
             act=_damaged(truncated_manifest)),
    Incident("catalogue-row-forged", "last rank's newest catalogue row forged", _BEFORE,
             act=_damaged(forged_row_digest)),
    Incident("metadata-lost", "metadata DB deleted", "restores from the manifests; " + _NEWEST,
             act=_metadata_lost),
    Incident("preempt-rank-sigterm", "SIGTERM to the last rank (preemption notice)",
             _PREEMPTED + "the restart restores that organ; bit-exact",
             act=_signal(signal.SIGTERM, LAST), expect=Expect.EXITED, exit_code=75,
             ledger_cause="preemption"),
    Incident("preempt-rank0-sigusr1", "SIGUSR1 to rank 0 (Slurm's notice)",
             _PREEMPTED + "the restart restores that organ; bit-exact",
             act=_signal(signal.SIGUSR1, 0), expect=Expect.EXITED, exit_code=75,
             ledger_cause="preemption"),
    Incident("preempt-agent-sigterm", "SIGTERM to the torchrun agent (every rank)",
             "the agent stops every rank with SIGTERM: " + _PREEMPTED + "the job launched "
             "again restores that organ; bit-exact", act=_signal_agent(signal.SIGTERM),
             restarts=0, relaunch=True, expect=Expect.EXITED, exit_code=75,
             ledger_cause="preemption"),
    Incident("preempt-short-grace", "SIGTERM to the agent, grace_seconds too short",
             "the organ is not durable in time: every rank records a preemption and exits 76 "
             "(PREEMPTED_UNSAVED); the job launched again restores the newest step every rank "
             "published; bit-exact", act=_signal_agent(signal.SIGTERM), restarts=0,
             relaunch=True, expect=Expect.PUBLISHED, ledger_cause="preemption",
             logged="exiting with status 76", policy={"preemption": {"grace_seconds": 0.001}}),
    Incident("hang-sigstop", "the last rank SIGSTOPped mid-step (a hang)",
             "rank 0's watchdog records a hang and exits 77 (HANG); torchrun restarts the job: "
             + _NEWEST, job={"fault": "stop-mid-step", "fault_rank": LAST, "at_step": FAULT_STEP},
             policy={"watchdog": {"enabled": True, "min_seconds": 20.0,
                                  "step_time_multiple": 2.0}},
             ledger_cause="hang", ledger_ranks=(0,), logged="Exiting with status 77"),
    Incident("peer-lost-1", "one peer daemon killed", "rebuilt from parity; " + _NEWEST,
             act=_peers("kill"), needs=Needs.PEERS),
    Incident("peer-lost-2", "two peer daemons killed",
             "the peer tier is lost: every rank restores the newest step all hold on the "
             "remote tier, bit-exact (or, where it holds none, every rank refuses in every "
             "restart)", act=_peers("kill", "kill"), needs=Needs.PEERS),
    Incident("slow-peer", "one peer daemon stopped (SIGSTOP)",
             "the other peers answer within their timeouts; " + _NEWEST,
             act=_peers("stop"), needs=Needs.PEERS),
)

BY_NAME = {i.name: i for i in INCIDENTS}
