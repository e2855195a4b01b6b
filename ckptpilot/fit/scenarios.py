"""The fault-injection scenarios of ``ckptpilot fit`` and their registry.

Each scenario is one function: it trains the small job in a ``Trial``, injects its fault
(the child kills or hurts itself at a phase of a save; or the parent damages storage, kills
or stops a peer daemon, locks or deletes the metadata database between runs), restarts, and
checks the outcome. The pass is stated in the registry entry; it is normally "restored step
S from source X and the continuation is bit-exact with the uninterrupted reference", and for
a fault that leaves nothing loadable "refused with NoCheckpointError" — never a silent start
from scratch. A scenario raises ``ScenarioFailed`` or ``ScenarioSkipped`` with the reason,
and fills an ``Observation`` as it learns things, so that a failure still shows how far the
recovery got.

The expected recovered step comes from the interrupted run itself: just before its fault
the child reports the saves it had completed (step, level, tier, status).
"""

from __future__ import annotations

import errno
import os
import sqlite3
import time
from collections.abc import Callable

from ckptpilot.fit.attacks import (
    abandoned_then_rebuilt,
    forged_peer_shards,
    hostile_peer_clients,
    peer_fault,
    symlinked_step,
    tampered_location,
)
from ckptpilot.fit.checks import (
    BETWEEN_STEP,
    CLOCK_JUMP_SECONDS,
    FAULT_STEP,
    LOCK_FROM_STEP,
    LOCK_SECONDS,
    SECOND_KILL_STEP,
    Check,
    Needs,
    Observation,
    Scenario,
    ScenarioFailed,
    ScenarioSkipped,
    bit_exact,
    faulted,
    finished,
    killed_between,
    newest_save,
    passed,
    refusal,
    restored,
    resume,
    skipped_note,
    valid_steps,
)
from ckptpilot.fit.harness import Harness, Trial
from ckptpilot.fit.job import EXIT_ERROR
from ckptpilot.rundir import metadata_path
from ckptpilot.tiers.remote.archive import (
    CONTAINER_FILE,
    TENSORS_FILE,
    checkpoint_name,
)
from ckptpilot.tiers.remote.store import RemoteTier

# -- SIGKILL of the training process -------------------------------------------------------

def _kill_in_save(phase: str) -> Check:
    def check(h: Harness, name: str, obs: Observation) -> str:
        trial = h.trial(name, peers=h.policy_has_peers)
        fault = faulted(trial.run("faulted", fault=f"kill-{phase}", at_step=FAULT_STEP),
                         may_not_fire=True)
        step, done = fault["step"], newest_save(fault["saves"]) or 0
        rec = resume(trial, obs, expect=None)
        got = rec["step"]
        if phase == "publish":
            ok = got == step  # renamed into place before the kill: complete, and it verifies
        elif phase == "capture":
            ok = done <= got < step  # a save before it may have been in flight
        else:  # the writer is sequential: every save before this one had completed
            ok = got == done or (got == step and rec["source"] == "peer"
                                 and fault["tier"] == "remote")
        if not ok:
            raise ScenarioFailed(f"killed in the {phase} of step {step} (newest complete save:"
                                 f" {done}); restored step {got} from {rec['source']}")
        return passed(rec, f"killed in the {phase} of step {step}")
    return check


def _kill_between(h: Harness, name: str, obs: Observation) -> str:
    trial, fault = killed_between(h, name)
    rec = resume(trial, obs, expect=newest_save(fault["saves"]) or 0)
    return passed(rec, f"killed after step {BETWEEN_STEP}")


# -- damaged storage -----------------------------------------------------------------------

def _tensors_file(trial: Trial, step: int, rank: int) -> tuple[str, str]:
    """The path of a checkpoint's tensors file, and how to name it in a message."""
    tier = trial.remote()
    name = checkpoint_name(step, rank)
    for fname in (TENSORS_FILE, CONTAINER_FILE):
        if tier.exists(f"{name}/{fname}"):
            return tier.path(name, fname), f"{name}/{fname}"
    raise ScenarioFailed(f"{tier.path(name)} holds no tensors file")


def truncate_tensors(trial: Trial, step: int, rank: int = 0) -> str:
    path, shown = _tensors_file(trial, step, rank)
    fs = trial.remote().fs
    data = fs.cat_file(path)
    fs.pipe_file(path, data[: len(data) // 2])
    return f"{shown} cut to {len(data) // 2} of {len(data)} bytes"


def empty_tensors(trial: Trial, step: int, rank: int = 0) -> str:
    path, shown = _tensors_file(trial, step, rank)
    trial.remote().fs.pipe_file(path, b"")
    return f"{shown} emptied"


def flip_tensors_bit(trial: Trial, step: int, rank: int = 0) -> str:
    path, shown = _tensors_file(trial, step, rank)
    fs = trial.remote().fs
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x10
    fs.pipe_file(path, bytes(data))
    return f"one bit flipped in {shown}"


def _damaged_newest(damage: Callable[[Trial, int], str]) -> Check:
    def check(h: Harness, name: str, obs: Observation) -> str:
        trial, fault = killed_between(h, name)
        remote = valid_steps(fault["saves"], "remote")
        if not remote:
            raise ScenarioSkipped(f"no checkpoint reached the remote tier by step "
                                  f"{BETWEEN_STEP}")
        victim = remote[-1]
        what = damage(trial, victim)
        candidates = [s for s in (newest_save(fault["saves"], "peer"),
                                  remote[-2] if len(remote) > 1 else None) if s is not None]
        if not candidates:
            return "refused: " + refusal(trial.run("resumed"), "NoCheckpointError")
        rec = resume(trial, obs, expect=max(candidates))
        if rec["source"] == "remote" and not any(
                checkpoint_name(victim, 0) in loc for loc, _ in rec["skipped"]):
            raise ScenarioFailed(f"the damaged step {victim} is not among the skipped "
                                 f"checkpoints: {rec['skipped']}")
        return passed(rec, what)
    return check


def _stale_copy(h: Harness, name: str, obs: Observation) -> str:
    """An older complete checkpoint directory copied over the newest one's name."""
    trial, fault = killed_between(h, name)
    remote = valid_steps(fault["saves"], "remote")
    if len(remote) < 2:
        raise ScenarioSkipped(f"fewer than two checkpoints on the remote tier by step "
                              f"{BETWEEN_STEP}")
    older, newest = remote[-2], remote[-1]
    tier = trial.remote()
    src, dst = tier.path(checkpoint_name(older, 0)), tier.path(checkpoint_name(newest, 0))
    tier.fs.rm(dst, recursive=True)
    tier.fs.copy(src, dst, recursive=True)
    peer = newest_save(fault["saves"], "peer")
    rec = resume(trial, obs, expect=max(older, peer or 0))
    return passed(rec, f"step {older} copied over step {newest}; not taken for "
                               f"step {newest}")


def _every_copy_damaged(h: Harness, name: str, obs: Observation) -> str:
    trial, fault = killed_between(h, name)
    remote = valid_steps(fault["saves"], "remote")
    if not remote:
        raise ScenarioSkipped(f"no checkpoint reached the remote tier by step {BETWEEN_STEP}")
    for step in remote:
        flip_tensors_bit(trial, step)
    peer = newest_save(fault["saves"], "peer")
    if peer is not None:
        rec = resume(trial, obs, expect=peer)
        return passed(rec, f"{len(remote)} remote checkpoints bit-flipped")
    why = refusal(trial.run("resumed"), "NoCheckpointError")
    return f"{len(remote)} checkpoints bit-flipped; refused: {why}"


# -- failures of the disk, the store and the metadata ----------------------------------------

def _enospc(h: Harness, name: str, obs: Observation) -> str:
    trial = h.trial(name, peers=h.policy_has_peers)
    first = trial.run("faulted", fault="enospc", at_step=FAULT_STEP)
    fault = first.event("fault")
    if fault is None:
        if first.returncode == 0:
            raise ScenarioSkipped(f"no save wrote to the remote tier from step {FAULT_STEP}")
        raise ScenarioFailed(f"before the disk filled up, {first.describe()}")
    error = first.event("error")
    done_event = first.event("done")
    if error is not None and first.returncode == EXIT_ERROR:
        enospc = os.strerror(errno.ENOSPC)
        if error["error"] != "CheckpointWriteError" or enospc not in error["message"]:
            raise ScenarioFailed(f"stopped with {error['error']}: {error['message']}; "
                                 f"expected a CheckpointWriteError naming '{enospc}'")
        saves, how = error["saves"], f"stopped with CheckpointWriteError ({enospc})"
    elif done_event is not None and first.returncode == 0:
        saves, how = done_event["saves"], "training went on"
    else:
        raise ScenarioFailed(f"with the disk full, {first.describe()}")
    rec = resume(trial, obs, expect=newest_save(saves) or 0)
    return passed(rec, f"disk full from the save of step {fault['step']}: {how}")


def _remote_unreachable(h: Harness, name: str, obs: Observation) -> str:
    trial, fault = killed_between(h, name)
    done = newest_save(fault["saves"]) or 0
    down = trial.run("remote-down", fault="remote-down", exit_after_restore=True)
    if newest_save(fault["saves"], "peer") == done and done > 0:
        rec = restored(trial, down, obs, reached=trial.reached())
        if rec["step"] != done or rec["source"] != "peer":
            raise ScenarioFailed(f"with the remote tier down, restored step {rec['step']} "
                                 f"from {rec['source']}, expected step {done} from peer")
        while_down = f"while down: restored step {done} from peer"
    else:
        while_down = "while down: refused (" + refusal(down, None) + ")"
    rec = resume(trial, obs, expect=done)
    return passed(rec, while_down + "; back up")


def _remote_flaky(h: Harness, name: str, obs: Observation) -> str:
    """The object store resets the first call of every operation during the restart: the
    restore and the saves after it must go through on the tier's retries."""
    remote = h.policy.tiers.remote
    if RemoteTier(remote.url, remote.storage_options).is_local:
        raise ScenarioSkipped("the remote tier is a local directory, whose errors are "
                              "answers (not retried); give a policy on an object store")
    trial, fault = killed_between(h, name)
    rec = resume(trial, obs, expect=newest_save(fault["saves"]) or 0, fault="remote-flaky")
    return passed(rec, "every object-store call reset once")


def _metadata_locked(h: Harness, name: str, obs: Observation) -> str:
    trial = h.trial(name, peers=h.policy_has_peers)
    go = trial.dir / "go"
    running = trial.spawn("faulted", fault="kill-between", at_step=SECOND_KILL_STEP,
                          pause_at_step=LOCK_FROM_STEP, go_file=go)
    paused = running.wait_event("paused")
    if paused is not None:
        db = sqlite3.connect(metadata_path(trial.run_dir), timeout=60,
                             isolation_level=None)
        try:
            db.execute("BEGIN IMMEDIATE")
            go.touch()
            time.sleep(LOCK_SECONDS)
            db.execute("ROLLBACK")
        finally:
            db.close()
    first = running.finish()
    trial.adopt(first)
    if paused is None:
        raise ScenarioFailed(f"the job never reached step {LOCK_FROM_STEP}: {first.describe()}")
    fault = faulted(first)
    waited = max((s["persist_seconds"] for s in fault["saves"]), default=0.0)
    rec = resume(trial, obs, expect=newest_save(fault["saves"]) or 0)
    return passed(rec, f"metadata.sqlite write-locked for {LOCK_SECONDS:.0f} s from "
                               f"step {LOCK_FROM_STEP} (longest save {waited:.1f} s)")


def _metadata_lost(h: Harness, name: str, obs: Observation) -> str:
    trial, fault = killed_between(h, name)
    removed = 0
    for suffix in ("", "-wal", "-shm"):
        path = trial.run_dir / f"metadata.sqlite{suffix}"
        if path.exists():
            path.unlink()
            removed += 1
    if removed == 0:
        raise ScenarioFailed(f"{trial.run_dir / 'metadata.sqlite'} does not exist")
    rec = resume(trial, obs, expect=newest_save(fault["saves"]) or 0)
    return passed(rec, "metadata.sqlite deleted")


def _clock_skew(h: Harness, name: str, obs: Observation) -> str:
    """The wall clock jumps back a day (the first run's heartbeats and ledger records now lie
    in the future), then forward again."""
    trial, fault = killed_between(h, name)
    reached = trial.reached()
    second = trial.run("clock-back", fault="kill-between", at_step=SECOND_KILL_STEP,
                       clock_offset_seconds=CLOCK_JUMP_SECONDS)
    rec = restored(trial, second, obs, reached=reached)
    first_done = newest_save(fault["saves"]) or 0
    if rec["step"] != first_done:
        raise ScenarioFailed(f"with the clock a day back, restored step {rec['step']}, "
                             f"expected {first_done}{skipped_note(rec)}")
    again = faulted(second)
    rec = resume(trial, obs, expect=newest_save(again["saves"]) or 0, label="clock-forward")
    return passed(rec, "clock set back a day, then forward again")


def _nvml_burst(h: Harness, name: str, obs: Observation) -> str:
    if h.policy.scheduler.weights.system == 0:
        raise ScenarioSkipped("the policy gives the system signal no weight: no health probes")
    trial = h.trial(name, peers=h.policy_has_peers)
    fault = faulted(trial.run("faulted", fault="nvml-burst", at_step=FAULT_STEP))
    step = fault["step"]
    organ = [s for s in fault["saves"] if s["step"] == step and s["status"] == "valid"]
    if fault.get("level") != "organ" or not organ:
        raise ScenarioFailed(f"the emergency save of step {step} is not a valid organ: "
                             f"{fault.get('level')}, {organ}")
    rec = resume(trial, obs, expect=step)
    if rec["level"] != "organ":
        raise ScenarioFailed(f"restored a {rec['level']} of step {step}, expected the organ")
    return passed(rec, f"GPU error burst at step {FAULT_STEP}: emergency organ of "
                               f"step {step}")


# -- distributed -------------------------------------------------------------------------------

def _dist_kill(fault_name: str, fault_rank: int | None) -> Check:
    """``fault_rank``: only that rank dies in its write (after rank 0 published the same
    step), torchrun then stops the other; None: every rank dies in its own write once all
    are writing (a rank torchrun stops first reports no fault)."""
    def check(h: Harness, name: str, obs: Observation) -> str:
        trial = h.trial(name, peers=h.policy_has_peers, dist=True)
        first = trial.run("faulted", fault=fault_name, fault_rank=fault_rank,
                          at_step=FAULT_STEP)
        hit = {r: f for r in range(first.ranks) if (f := first.event("fault", r)) is not None}
        if fault_rank is not None or not hit:
            hit = {fault_rank or 0: faulted(first, fault_rank or 0)}
        step = min(f["step"] for f in hit.values())
        if first.returncode in (0, None):
            raise ScenarioFailed(f"after the fault, {first.describe()}")
        if not all(f.get("waited") for f in hit.values()):
            raise ScenarioFailed(f"the other rank never got to step {step} while rank "
                                 f"{next(iter(hit))} waited to die in its write")
        reached = trial.reached()
        second = trial.run("resumed")
        steps = [restored(trial, second, obs, reached=reached, rank=r)["step"]
                 for r in range(second.ranks)]
        if len(set(steps)) != 1:
            raise ScenarioFailed(f"the ranks restored different steps: {steps}")
        # Every rank got to the write of ``step`` (the waits above), so each had completed
        # the same saves before it; the ranks that reported them agree.
        newest = min(newest_save(f["saves"]) or 0 for f in hit.values())
        if steps[0] != newest:
            raise ScenarioFailed(f"restored step {steps[0]}; the newest step complete on "
                                 f"every rank was {newest}")
        finished(second)
        bit_exact(trial, obs)
        if fault_rank is not None:
            killed = (f"rank {fault_rank} killed in the write of step {step} after rank 0 "
                      "published it")
        elif len(hit) == second.ranks:
            killed = f"every rank killed in the write of step {step}"
        else:
            killed = (f"rank {next(iter(hit))} killed in the write of step {step}, the other "
                      "stopped by torchrun in its own")
        return f"{killed}; both ranks restored step {steps[0]}, bit-exact"
    return check


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("kill-capture", "SIGKILL during capture",
             "restores a save older than the one captured (the newest complete, or one in "
             "flight at the kill); bit-exact", Needs.SINGLE, _kill_in_save("capture")),
    Scenario("kill-write", "SIGKILL during write",
             "the half-written save is never loaded; restores the newest complete one; "
             "bit-exact", Needs.SINGLE, _kill_in_save("write")),
    Scenario("kill-validate", "SIGKILL during validation",
             "the unvalidated save is never loaded; restores the newest complete one; "
             "bit-exact", Needs.SINGLE, _kill_in_save("validate")),
    Scenario("kill-publish", "SIGKILL during publish",
             "killed right after the atomic rename: restores that step (complete, it "
             "verifies); bit-exact", Needs.SINGLE, _kill_in_save("publish")),
    Scenario("kill-between", "SIGKILL between saves",
             "restores the newest save; bit-exact", Needs.SINGLE, _kill_between),
    Scenario("truncated-newest", "newest truncated",
             "skips the newest with its reason, restores the one before; bit-exact",
             Needs.SINGLE, _damaged_newest(truncate_tensors)),
    Scenario("zero-byte-newest", "newest 0-byte",
             "skips the newest with its reason, restores the one before; bit-exact",
             Needs.SINGLE, _damaged_newest(empty_tensors)),
    Scenario("bitflip-newest", "newest bit-flipped",
             "skips the newest with its reason, restores the one before; bit-exact",
             Needs.SINGLE, _damaged_newest(flip_tensors_bit)),
    Scenario("stale-copy", "stale copy, newer name",
             "never loads the old state as the newer step; restores the real newest valid "
             "state; bit-exact", Needs.SINGLE, _stale_copy),
    Scenario("every-copy-damaged", "every copy bit-flipped",
             "refuses with NoCheckpointError (or restores an undamaged peer copy)",
             Needs.SINGLE, _every_copy_damaged),
    Scenario("enospc", "disk full (ENOSPC)",
             "training stops with a CheckpointWriteError naming ENOSPC (or goes on); the last "
             "valid checkpoint restores; bit-exact", Needs.SINGLE, _enospc),
    Scenario("remote-unreachable", "remote tier unreachable",
             "while down: restores from a faster tier or refuses with a ckptpilot error; back "
             "up: restores the newest; bit-exact", Needs.SINGLE, _remote_unreachable),
    Scenario("flaky-remote", "object store resets connections",
             "every call's first attempt reset: the restore and the saves after it retry; "
             "restores the newest; bit-exact (object stores only)", Needs.SINGLE,
             _remote_flaky),
    Scenario("metadata-locked", "metadata DB locked",
             "saves wait for the lock instead of failing; restores the newest; bit-exact",
             Needs.SINGLE, _metadata_locked),
    Scenario("metadata-lost", "metadata DB deleted",
             "restores the newest save from its manifest; bit-exact", Needs.SINGLE,
             _metadata_lost),
    Scenario("tampered-location", "a row pointing at the run dir",
             "prune refuses the row naming it and deletes nothing; restores the newest; "
             "bit-exact", Needs.SINGLE, tampered_location),
    Scenario("symlinked-step", "newest step replaced by a symlink",
             "the link is not followed (the save before it restores) and its target is never "
             "deleted; bit-exact", Needs.SINGLE, symlinked_step),
    Scenario("abandoned-rebuilt", "catalogue rebuilt after a recover",
             "restores the newest step of the continuation `recover` started, never a step it "
             "abandoned, after metadata.sqlite is deleted and `validate --rebuild` runs; "
             "bit-exact", Needs.SINGLE, abandoned_then_rebuilt),
    Scenario("clock-skew", "wall clock jumps",
             "restarts with the clock a day back and forward again restore the newest save; "
             "bit-exact", Needs.SINGLE, _clock_skew),
    Scenario("nvml-burst", "NVML error burst (fake)",
             "an emergency organ is saved at once and restores; bit-exact", Needs.SINGLE,
             _nvml_burst),
    Scenario("peer-lost-1", "one peer killed",
             "rebuilds the newest pulse from parity on the peers; bit-exact", Needs.PEERS,
             peer_fault("kill")),
    Scenario("peer-lost-2", "two peers killed",
             "falls back to the remote tier (or refuses with NoCheckpointError when it holds "
             "nothing); bit-exact", Needs.PEERS, peer_fault("kill", "kill")),
    Scenario("slow-peer", "peer stopped (SIGSTOP)",
             "restores the newest pulse from the other peers; training goes on; bit-exact",
             Needs.PEERS, peer_fault("stop")),
    Scenario("slow-peers-2", "two peers stopped (SIGSTOP)",
             "falls back to the remote tier (or refuses with NoCheckpointError when it holds "
             "nothing) within the peers' timeouts; bit-exact", Needs.PEERS,
             peer_fault("stop", "stop")),
    Scenario("peer-lost-slow", "one peer killed, one stopped",
             "falls back to the remote tier (or refuses with NoCheckpointError when it holds "
             "nothing) within the peers' timeouts; bit-exact", Needs.PEERS,
             peer_fault("kill", "stop")),
    Scenario("peers-lost-3", "three peers killed",
             "falls back to the remote tier (or refuses with NoCheckpointError when it holds "
             "nothing); bit-exact", Needs.PEERS, peer_fault("kill", "kill", "kill")),
    Scenario("forged-peer-shards", "peer shards forged",
             "a client without the job's secret is refused; shards replaced with the secret "
             "are skipped by the row's digest and the remote tier restores; bit-exact",
             Needs.PEERS, forged_peer_shards),
    Scenario("hostile-peer-clients", "peer daemons flooded",
             "300 idle and half-frame connections per daemon do not stop the trainer "
             "restoring from the peers; bit-exact", Needs.PEERS, hostile_peer_clients),
    Scenario("ranks-peers-lost-2", "two peers killed under two ranks",
             "both ranks fall back to the same remote step (or refuse together); bit-exact",
             Needs.DIST, peer_fault("kill", "kill", dist=True)),
    Scenario("rank-killed", "one rank of two killed",
             "both ranks restore the same step, the newest complete on both; bit-exact",
             Needs.DIST, _dist_kill("kill-write-after-rank0", 1)),
    Scenario("ranks-killed", "both ranks killed mid-save",
             "both ranks restore the same step, before the interrupted save; bit-exact",
             Needs.DIST, _dist_kill("kill-write-every-rank", None)),
)

BY_NAME = {s.name: s for s in SCENARIOS}
