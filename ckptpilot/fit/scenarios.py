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
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ckptpilot.fit.harness import ChildRun, Harness, HarnessError, Trial
from ckptpilot.fit.job import EXIT_ERROR
from ckptpilot.rundir import metadata_path
from ckptpilot.storage.archive import CONTAINER_FILE, TENSORS_FILE, checkpoint_name

FAULT_STEP = 25  # in-save faults hit the first save of this step or later
BETWEEN_STEP = 34  # "between saves" kills land after this step, nothing in flight
SECOND_KILL_STEP = 44
LOCK_FROM_STEP = 15
LOCK_SECONDS = 4.0
CLOCK_JUMP_SECONDS = -86400.0
RESTORE_BOUND_SECONDS = 60.0  # a safety net: restoring this model takes well under a second


class ScenarioFailed(Exception):
    """The fault was not survived as the scenario requires; the message says how."""


class ScenarioSkipped(Exception):
    """The scenario does not apply to this policy; the message says why."""


class Needs(str, Enum):
    SINGLE = "single process"
    PEERS = "peer tier"
    DIST = "torchrun, 2 ranks"


@dataclass
class Observation:
    recovered_step: int | None = None
    source: str | None = None
    steps_lost: int | None = None
    bit_exact: bool | None = None
    restore_seconds: float | None = None


Check = Callable[[Harness, str, Observation], str]
"""Runs a scenario in the trial of the scenario's name; returns what passed."""


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: str
    passes: str
    needs: Needs
    check: Check


# -- reading the children ------------------------------------------------------------------

def _faulted(run: ChildRun, rank: int = 0, *, may_not_fire: bool = False) -> dict[str, Any]:
    """The fault event of a run that was to kill itself; fails the scenario otherwise.
    ``may_not_fire``: a run that finished without reaching the fault point skips it (the
    policy made no save where the fault waits)."""
    fault = run.event("fault", rank)
    if fault is None:
        if run.returncode == 0 and may_not_fire:
            raise ScenarioSkipped(f"the {run.label} run finished without reaching the fault "
                                  f"point: no save from step {FAULT_STEP} on went that way "
                                  "under this policy")
        raise ScenarioFailed(f"before its fault, {run.describe()}")
    if not run.killed and not (run.ranks > 1 and run.returncode not in (0, None)):
        raise ScenarioFailed(f"after its fault, {run.describe()}")
    return fault


def _valid(saves: list[dict[str, Any]], tier: str | None = None) -> list[int]:
    return sorted(s["step"] for s in saves
                  if s["status"] == "valid" and (tier is None or s["tier"] == tier))


def _newest(saves: list[dict[str, Any]], tier: str | None = None) -> int | None:
    steps = _valid(saves, tier)
    return steps[-1] if steps else None


def _restored(trial: Trial, run: ChildRun, obs: Observation, *, reached: int,
              rank: int = 0) -> dict[str, Any]:
    """The restore of a run that must restore; fills ``obs``."""
    refused = run.event("refused", rank)
    if refused is not None:
        raise ScenarioFailed(f"restore refused in the {run.label} run: {refused['error']}: "
                             f"{refused['message']}")
    rec = run.event("restored", rank)
    if rec is None:
        raise ScenarioFailed(f"no restore: {run.describe()}")
    obs.recovered_step, obs.source = rec["step"], rec["source"]
    obs.restore_seconds = rec["seconds"]
    obs.steps_lost = max(0, reached - rec["step"])
    bound = RESTORE_BOUND_SECONDS + 3 * trial.policy.tiers.peer.timeout_seconds
    if rec["seconds"] > bound:
        raise ScenarioFailed(f"restoring took {rec['seconds']:.1f} s (bound {bound:.0f} s)")
    return rec


def _finished(run: ChildRun) -> None:
    for rank in range(run.ranks):
        if run.returncode != 0 or run.event("done", rank) is None:
            error = run.event("error", rank)
            if error is not None:
                raise ScenarioFailed(f"training after the restore stopped (rank {rank}): "
                                     f"{error['error']}: {error['message']}")
            raise ScenarioFailed(f"training after the restore did not finish: "
                                 f"{run.describe()}")


def _resume(trial: Trial, obs: Observation, *, expect: int | None, label: str = "resumed",
            **options: Any) -> dict[str, Any]:
    """Restart the job, which must restore ``expect`` (when given) and train to the end
    bit-exactly."""
    reached = trial.reached()
    run = trial.run(label, **options)
    rec = _restored(trial, run, obs, reached=reached)
    if expect is not None and rec["step"] != expect:
        raise ScenarioFailed(f"restored step {rec['step']} from {rec['source']}, expected "
                             f"step {expect}{_skipped(rec)}")
    _finished(run)
    _bit_exact(trial, obs)
    return rec


def _bit_exact(trial: Trial, obs: Observation) -> None:
    ok, why = trial.compare()
    obs.bit_exact = ok
    if not ok:
        raise ScenarioFailed(f"the continuation is not bit-exact: {why}")


def _skipped(rec: dict[str, Any]) -> str:
    if not rec["skipped"]:
        return ""
    location, reason = rec["skipped"][0]
    return f" (skipped {location}: {reason})"


def _passed(rec: dict[str, Any], what: str) -> str:
    return f"{what}; restored step {rec['step']} from {rec['source']}, bit-exact"


def _refusal(run: ChildRun, error: str | None) -> str:
    """The run must have refused to restore (``error``: that class; None: any ckptpilot
    error) instead of crashing or starting over."""
    refused = run.event("refused")
    if refused is not None and run.returncode == EXIT_ERROR and error in (None,
                                                                          refused["error"]):
        return f"{refused['error']}: {refused['message']}"
    rec = run.event("restored")
    if rec is not None:
        raise ScenarioFailed(f"restored step {rec['step']} from {rec['source']} where "
                             f"nothing loadable was left; expected a refusal")
    if refused is not None:
        raise ScenarioFailed(f"refused with {refused['error']}, expected {error}: "
                             f"{refused['message']}")
    raise ScenarioFailed(f"expected a clear refusal, but {run.describe()}")


# -- SIGKILL of the training process -------------------------------------------------------

def _kill_in_save(phase: str) -> Check:
    def check(h: Harness, name: str, obs: Observation) -> str:
        trial = h.trial(name, peers=h.policy_has_peers)
        fault = _faulted(trial.run("faulted", fault=f"kill-{phase}", at_step=FAULT_STEP),
                         may_not_fire=True)
        step, done = fault["step"], _newest(fault["saves"]) or 0
        rec = _resume(trial, obs, expect=None)
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
        return _passed(rec, f"killed in the {phase} of step {step}")
    return check


def _kill_between(h: Harness, name: str, obs: Observation) -> str:
    trial, fault = _killed_between(h, name)
    rec = _resume(trial, obs, expect=_newest(fault["saves"]) or 0)
    return _passed(rec, f"killed after step {BETWEEN_STEP}")


def _killed_between(h: Harness, name: str) -> tuple[Trial, dict[str, Any]]:
    """A trial whose job was killed after ``BETWEEN_STEP`` with nothing in flight; without
    peers it is a copy of one such run shared by the scenarios that damage its state."""
    def make(trial: Trial) -> None:
        run = trial.run("faulted", fault="kill-between", at_step=BETWEEN_STEP)
        if run.event("fault") is None or not run.killed:
            raise HarnessError(f"the job to be killed after step {BETWEEN_STEP} failed: "
                               f"{run.describe()}")

    if h.policy_has_peers:
        trial = h.trial(name, peers=True)
        make(trial)
    else:
        trial = h.shared("killed-between", make)
    fault = trial.runs[0].event("fault")
    if fault is None:
        raise HarnessError(f"{trial.runs[0].out}: the killed job's fault event is missing")
    return trial, fault


# -- damaged storage -----------------------------------------------------------------------

def _tensors_file(trial: Trial, step: int) -> tuple[str, str]:
    """The path of a checkpoint's tensors file, and how to name it in a message."""
    tier = trial.remote()
    name = checkpoint_name(step, 0)
    for fname in (TENSORS_FILE, CONTAINER_FILE):
        if tier.exists(f"{name}/{fname}"):
            return tier.path(name, fname), f"{name}/{fname}"
    raise ScenarioFailed(f"{tier.path(name)} holds no tensors file")


def _truncate(trial: Trial, step: int) -> str:
    path, shown = _tensors_file(trial, step)
    fs = trial.remote().fs
    data = fs.cat_file(path)
    fs.pipe_file(path, data[: len(data) // 2])
    return f"{shown} cut to {len(data) // 2} of {len(data)} bytes"


def _zero(trial: Trial, step: int) -> str:
    path, shown = _tensors_file(trial, step)
    trial.remote().fs.pipe_file(path, b"")
    return f"{shown} emptied"


def _flip(trial: Trial, step: int) -> str:
    path, shown = _tensors_file(trial, step)
    fs = trial.remote().fs
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x10
    fs.pipe_file(path, bytes(data))
    return f"one bit flipped in {shown}"


def _damaged_newest(damage: Callable[[Trial, int], str]) -> Check:
    def check(h: Harness, name: str, obs: Observation) -> str:
        trial, fault = _killed_between(h, name)
        remote = _valid(fault["saves"], "remote")
        if not remote:
            raise ScenarioSkipped(f"no checkpoint reached the remote tier by step "
                                  f"{BETWEEN_STEP}")
        victim = remote[-1]
        what = damage(trial, victim)
        candidates = [s for s in (_newest(fault["saves"], "peer"),
                                  remote[-2] if len(remote) > 1 else None) if s is not None]
        if not candidates:
            return "refused: " + _refusal(trial.run("resumed"), "NoCheckpointError")
        rec = _resume(trial, obs, expect=max(candidates))
        if rec["source"] == "remote" and not any(
                checkpoint_name(victim, 0) in loc for loc, _ in rec["skipped"]):
            raise ScenarioFailed(f"the damaged step {victim} is not among the skipped "
                                 f"checkpoints: {rec['skipped']}")
        return _passed(rec, what)
    return check


def _stale_copy(h: Harness, name: str, obs: Observation) -> str:
    """An older complete checkpoint directory copied over the newest one's name."""
    trial, fault = _killed_between(h, name)
    remote = _valid(fault["saves"], "remote")
    if len(remote) < 2:
        raise ScenarioSkipped(f"fewer than two checkpoints on the remote tier by step "
                              f"{BETWEEN_STEP}")
    older, newest = remote[-2], remote[-1]
    tier = trial.remote()
    src, dst = tier.path(checkpoint_name(older, 0)), tier.path(checkpoint_name(newest, 0))
    tier.fs.rm(dst, recursive=True)
    tier.fs.copy(src, dst, recursive=True)
    peer = _newest(fault["saves"], "peer")
    rec = _resume(trial, obs, expect=max(older, peer or 0))
    return _passed(rec, f"step {older} copied over step {newest}; not taken for "
                               f"step {newest}")


def _every_copy_damaged(h: Harness, name: str, obs: Observation) -> str:
    trial, fault = _killed_between(h, name)
    remote = _valid(fault["saves"], "remote")
    if not remote:
        raise ScenarioSkipped(f"no checkpoint reached the remote tier by step {BETWEEN_STEP}")
    for step in remote:
        _flip(trial, step)
    peer = _newest(fault["saves"], "peer")
    if peer is not None:
        rec = _resume(trial, obs, expect=peer)
        return _passed(rec, f"{len(remote)} remote checkpoints bit-flipped")
    why = _refusal(trial.run("resumed"), "NoCheckpointError")
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
    rec = _resume(trial, obs, expect=_newest(saves) or 0)
    return _passed(rec, f"disk full from the save of step {fault['step']}: {how}")


def _remote_unreachable(h: Harness, name: str, obs: Observation) -> str:
    trial, fault = _killed_between(h, name)
    done = _newest(fault["saves"]) or 0
    down = trial.run("remote-down", fault="remote-down", exit_after_restore=True)
    if _newest(fault["saves"], "peer") == done and done > 0:
        rec = _restored(trial, down, obs, reached=trial.reached())
        if rec["step"] != done or rec["source"] != "peer":
            raise ScenarioFailed(f"with the remote tier down, restored step {rec['step']} "
                                 f"from {rec['source']}, expected step {done} from peer")
        while_down = f"while down: restored step {done} from peer"
    else:
        while_down = "while down: refused (" + _refusal(down, None) + ")"
    rec = _resume(trial, obs, expect=done)
    return _passed(rec, while_down + "; back up")


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
    fault = _faulted(first)
    waited = max((s["persist_seconds"] for s in fault["saves"]), default=0.0)
    rec = _resume(trial, obs, expect=_newest(fault["saves"]) or 0)
    return _passed(rec, f"metadata.sqlite write-locked for {LOCK_SECONDS:.0f} s from "
                               f"step {LOCK_FROM_STEP} (longest save {waited:.1f} s)")


def _metadata_lost(h: Harness, name: str, obs: Observation) -> str:
    trial, fault = _killed_between(h, name)
    removed = 0
    for suffix in ("", "-wal", "-shm"):
        path = trial.run_dir / f"metadata.sqlite{suffix}"
        if path.exists():
            path.unlink()
            removed += 1
    if removed == 0:
        raise ScenarioFailed(f"{trial.run_dir / 'metadata.sqlite'} does not exist")
    rec = _resume(trial, obs, expect=_newest(fault["saves"]) or 0)
    return _passed(rec, "metadata.sqlite deleted")


def _clock_skew(h: Harness, name: str, obs: Observation) -> str:
    """The wall clock jumps back a day (the first run's heartbeats and ledger records now lie
    in the future), then forward again."""
    trial, fault = _killed_between(h, name)
    reached = trial.reached()
    second = trial.run("clock-back", fault="kill-between", at_step=SECOND_KILL_STEP,
                       clock_offset_seconds=CLOCK_JUMP_SECONDS)
    rec = _restored(trial, second, obs, reached=reached)
    first_done = _newest(fault["saves"]) or 0
    if rec["step"] != first_done:
        raise ScenarioFailed(f"with the clock a day back, restored step {rec['step']}, "
                             f"expected {first_done}{_skipped(rec)}")
    again = _faulted(second)
    rec = _resume(trial, obs, expect=_newest(again["saves"]) or 0, label="clock-forward")
    return _passed(rec, "clock set back a day, then forward again")


def _nvml_burst(h: Harness, name: str, obs: Observation) -> str:
    if h.policy.scheduler.weights.system == 0:
        raise ScenarioSkipped("the policy gives the system signal no weight: no health probes")
    trial = h.trial(name, peers=h.policy_has_peers)
    fault = _faulted(trial.run("faulted", fault="nvml-burst", at_step=FAULT_STEP))
    step = fault["step"]
    organ = [s for s in fault["saves"] if s["step"] == step and s["status"] == "valid"]
    if fault.get("level") != "organ" or not organ:
        raise ScenarioFailed(f"the emergency save of step {step} is not a valid organ: "
                             f"{fault.get('level')}, {organ}")
    rec = _resume(trial, obs, expect=step)
    if rec["level"] != "organ":
        raise ScenarioFailed(f"restored a {rec['level']} of step {step}, expected the organ")
    return _passed(rec, f"GPU error burst at step {FAULT_STEP}: emergency organ of "
                               f"step {step}")


# -- peers ---------------------------------------------------------------------------------

def _holders(saves: list[dict[str, Any]], step: int) -> list[str]:
    location = next(s["location"] for s in saves if s["step"] == step and s["tier"] == "peer")
    return location.rsplit("@", 1)[1].split(",") if "@" in location else []


def _peer_fault(lost: int, *, stop: bool = False) -> Check:
    def check(h: Harness, name: str, obs: Observation) -> str:
        trial = h.trial(name, peers=True)
        assert trial.peers is not None
        fault = _faulted(trial.run("faulted", fault="kill-between", at_step=BETWEEN_STEP))
        peer = _newest(fault["saves"], "peer")
        if peer is None:
            raise ScenarioFailed(f"no checkpoint reached the peer tier by step {BETWEEN_STEP}")
        holders = _holders(fault["saves"], peer)
        if len(holders) < lost:
            raise ScenarioFailed(f"step {peer} is held by {len(holders)} peers only")
        for endpoint in holders[:lost]:
            if stop:
                trial.peers.stop(endpoint)
            else:
                trial.peers.kill(endpoint)
        what = (f"peer {holders[0]} stopped (SIGSTOP)" if stop else
                f"{lost} of the {len(holders)} peers holding step {peer} killed")
        parity = 1 if h.policy.tiers.peer.parity else 0
        try:
            if lost <= parity:
                rec = _resume(trial, obs, expect=peer)
                if rec["source"] != "peer":
                    raise ScenarioFailed(f"restored step {peer} from {rec['source']}, "
                                         "expected the peer tier")
                return _passed(rec, what)
            remote = _newest(fault["saves"], "remote")
            if remote is None:
                why = _refusal(trial.run("resumed"), "NoCheckpointError")
                return f"{what}; nothing on the remote tier; refused: {why}"
            rec = _resume(trial, obs, expect=remote)
            return _passed(rec, what)
        finally:
            trial.peers.revive()
    return check


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
            hit = {fault_rank or 0: _faulted(first, fault_rank or 0)}
        step = min(f["step"] for f in hit.values())
        if first.returncode in (0, None):
            raise ScenarioFailed(f"after the fault, {first.describe()}")
        if not all(f.get("waited") for f in hit.values()):
            raise ScenarioFailed(f"the other rank never got to step {step} while rank "
                                 f"{next(iter(hit))} waited to die in its write")
        reached = trial.reached()
        second = trial.run("resumed")
        steps = [_restored(trial, second, obs, reached=reached, rank=r)["step"]
                 for r in range(second.ranks)]
        if len(set(steps)) != 1:
            raise ScenarioFailed(f"the ranks restored different steps: {steps}")
        # Every rank got to the write of ``step`` (the waits above), so each had completed
        # the same saves before it; the ranks that reported them agree.
        newest = min(_newest(f["saves"]) or 0 for f in hit.values())
        if steps[0] != newest:
            raise ScenarioFailed(f"restored step {steps[0]}; the newest step complete on "
                                 f"every rank was {newest}")
        _finished(second)
        _bit_exact(trial, obs)
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
             Needs.SINGLE, _damaged_newest(_truncate)),
    Scenario("zero-byte-newest", "newest 0-byte",
             "skips the newest with its reason, restores the one before; bit-exact",
             Needs.SINGLE, _damaged_newest(_zero)),
    Scenario("bitflip-newest", "newest bit-flipped",
             "skips the newest with its reason, restores the one before; bit-exact",
             Needs.SINGLE, _damaged_newest(_flip)),
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
    Scenario("metadata-locked", "metadata DB locked",
             "saves wait for the lock instead of failing; restores the newest; bit-exact",
             Needs.SINGLE, _metadata_locked),
    Scenario("metadata-lost", "metadata DB deleted",
             "restores the newest save from its manifest; bit-exact", Needs.SINGLE,
             _metadata_lost),
    Scenario("clock-skew", "wall clock jumps",
             "restarts with the clock a day back and forward again restore the newest save; "
             "bit-exact", Needs.SINGLE, _clock_skew),
    Scenario("nvml-burst", "NVML error burst (fake)",
             "an emergency organ is saved at once and restores; bit-exact", Needs.SINGLE,
             _nvml_burst),
    Scenario("peer-lost-1", "one peer killed",
             "rebuilds the newest pulse from parity on the peers; bit-exact", Needs.PEERS,
             _peer_fault(1)),
    Scenario("peer-lost-2", "two peers killed",
             "falls back to the remote tier (or refuses with NoCheckpointError when it holds "
             "nothing); bit-exact", Needs.PEERS, _peer_fault(2)),
    Scenario("slow-peer", "peer stopped (SIGSTOP)",
             "restores the newest pulse from the other peers; training goes on; bit-exact",
             Needs.PEERS, _peer_fault(1, stop=True)),
    Scenario("rank-killed", "one rank of two killed",
             "both ranks restore the same step, the newest complete on both; bit-exact",
             Needs.DIST, _dist_kill("kill-write-after-rank0", 1)),
    Scenario("ranks-killed", "both ranks killed mid-save",
             "both ranks restore the same step, before the interrupted save; bit-exact",
             Needs.DIST, _dist_kill("kill-write-every-rank", None)),
)

BY_NAME = {s.name: s for s in SCENARIOS}
