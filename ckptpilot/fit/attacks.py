"""The ``ckptpilot fit`` scenarios that attack the job from outside its process: peer daemons
killed or hung (SIGSTOP) under one or two ranks; shards forged on the peers, and a flood of
idle connections to them; an operator's catalogue rebuilt after a
restore abandoned newer steps; a metadata row pointing outside the checkpoints and a step
directory replaced by a symlink, both met by ``ckptpilot prune`` and the restore.

Each is a ``checks.Check`` built here and registered in ``scenarios.SCENARIOS``; the
vocabulary (outcomes, reading the children) is ``checks``'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

from ckptpilot.fit.checks import (
    BETWEEN_STEP,
    SECOND_KILL_STEP,
    Check,
    Observation,
    ScenarioFailed,
    ScenarioSkipped,
    faulted,
    killed_between,
    newest_save,
    passed,
    refusal,
    restored,
    resume,
    valid_steps,
)
from ckptpilot.fit.harness import Harness, Trial
from ckptpilot.rundir import metadata_path
from ckptpilot.tiers.peer import PEER_ERRORS, PeerCheckpointTier, PeerTier
from ckptpilot.tiers.peer.auth import load_secret
from ckptpilot.tiers.remote.archive import checkpoint_name, list_archives
from ckptpilot.tiers.remote.store import RemoteTier


def holders_of(saves: list[dict[str, Any]], step: int) -> list[str]:
    location = next(s["location"] for s in saves if s["step"] == step and s["tier"] == "peer")
    return location.rsplit("@", 1)[1].split(",") if "@" in location else []


def peer_fault(*faults: str, dist: bool = False) -> Check:
    """One fault per holder of the newest peer checkpoint, in holder order: ``kill``
    (SIGKILL, a node lost with its memory) or ``stop`` (SIGSTOP, a hung node that keeps its
    sockets). Up to the parity count the peers still rebuild it; past that the restore falls
    back to the remote tier, or refuses when that holds nothing. ``dist``: a job of two
    ranks; the faults hit the holders of rank 0's stripe, which the other rank's stripe
    shares, and both ranks must restore the same step."""
    def check(h: Harness, name: str, obs: Observation) -> str:
        trial = h.trial(name, peers=True, dist=dist)
        assert trial.peers is not None
        # Under torchrun rank 0 dies between saves and torchrun stops the other.
        fault = faulted(trial.run("faulted", fault="kill-between", at_step=BETWEEN_STEP,
                                   **({"fault_rank": 0} if dist else {})))
        peer = newest_save(fault["saves"], "peer")
        if peer is None:
            raise ScenarioFailed(f"no checkpoint reached the peer tier by step {BETWEEN_STEP}")
        holders = holders_of(fault["saves"], peer)
        if len(holders) < len(faults):
            raise ScenarioFailed(f"step {peer} is held by {len(holders)} peers only")
        for endpoint, kind in zip(holders, faults, strict=False):
            if kind == "stop":
                trial.peers.stop(endpoint)
            else:
                trial.peers.kill(endpoint)
        what = (f"{' + '.join(faults)} of the {len(holders)} peers holding step {peer}")
        parity = 1 if h.policy.tiers.peer.parity else 0
        try:
            if len(faults) <= parity:
                rec = resume(trial, obs, expect=peer)
                if rec["source"] != "peer":
                    raise ScenarioFailed(f"restored step {peer} from {rec['source']}, "
                                         "expected the peer tier")
                return passed(rec, what)
            remote = newest_save(fault["saves"], "remote") if not dist else common_remote(trial)
            if remote is None:
                why = refusal(trial.run("resumed"), "NoCheckpointError")
                return f"{what}; nothing on the remote tier; refused: {why}"
            rec = resume(trial, obs, expect=remote)
            return passed(rec, what)
        finally:
            trial.peers.revive()
    return check


def common_remote(trial: Trial) -> int | None:
    """The newest step every rank published on the remote tier (the one both ranks must
    restore): torchrun stops the other rank wherever its writer is, so only the published
    archives, not rank 0's saves, say which steps both hold."""
    remote = RemoteTier(trial.policy.tiers.remote.url)
    held = [{step for step, _ in list_archives(remote, rank).published} for rank in range(2)]
    common = held[0] & held[1]
    return max(common) if common else None



FLOOD_CONNECTIONS = 300  # idle connections to one daemon: the attack


def _newest_on_peers(h: Harness, name: str) -> tuple[Trial, dict[str, Any], int, str,
                                                     list[str]]:
    """A job killed between saves whose newest save is on the peers: the trial, its fault
    event, that step, the peers' run id and the endpoints holding it."""
    trial = h.trial(name, peers=True)
    fault = faulted(trial.run("faulted", fault="kill-between", at_step=BETWEEN_STEP))
    step = newest_save(fault["saves"], "peer")
    if step is None:
        raise ScenarioFailed(f"no checkpoint reached the peer tier by step {BETWEEN_STEP}")
    location = next(s["location"] for s in fault["saves"]
                    if s["step"] == step and s["tier"] == "peer")
    run_id = location.removeprefix("peer:").rsplit("/", 1)[0]
    return trial, fault, step, run_id, holders_of(fault["saves"], step)


def forged_peer_shards(h: Harness, name: str, obs: Observation) -> str:
    """A client without the job's secret is refused by every daemon; one with it (leaked, or
    a compromised node) replaces the newest peer checkpoint by other bytes with their digests
    recomputed: the restore must skip it by the digest its own metadata row recorded and
    load the remote tier's newest step instead."""
    trial, fault, step, run_id, endpoints = _newest_on_peers(h, name)
    assert trial.peers is not None
    peer = trial.policy.tiers.peer
    try:
        with contextlib.closing(PeerTier(endpoints, run_id=run_id, secret=os.urandom(32),
                                         data_shards=peer.data_shards, parity=peer.parity,
                                         timeout_seconds=5)) as outsider:
            outsider.fetch(step)
        raise ScenarioFailed(f"a client without the secret fetched step {step}")
    except PEER_ERRORS as e:
        if "HMAC" not in str(e):
            raise ScenarioFailed(f"a client without the secret got: {e}") from e
    secret = load_secret(trial.peers.secret_file, what="fit's peer secret")
    with contextlib.closing(PeerCheckpointTier(
            PeerTier(endpoints, run_id=run_id, secret=secret, data_shards=peer.data_shards,
                     parity=peer.parity, timeout_seconds=5), rank=0)) as attacker:
        real = attacker.get(step)
        forged = real.arena.clone()
        forged[: forged.numel() // 2] ^= 0x5A
        attacker.put(dataclasses.replace(real, arena=forged))
    what = f"an outsider refused (HMAC); step {step} forged with the secret"
    remote = newest_save(fault["saves"], "remote")
    if remote is None:
        why = refusal(trial.run("resumed"), "NoCheckpointError")
        if "not the one this trainer put" not in why:
            raise ScenarioFailed(f"the forged step {step} was not refused for its digest: "
                                 f"{why}")
        return f"{what}; nothing on the remote tier; refused: {why}"
    rec = resume(trial, obs, expect=remote)
    reasons = [reason for _, reason in rec["skipped"]]
    if not any("not the one this trainer put" in r for r in reasons):
        raise ScenarioFailed(f"the forged step {step} was not skipped for its digest: {reasons}")
    return passed(rec, f"{what} and skipped by its row's digest")


def hostile_peer_clients(h: Harness, name: str, obs: Observation) -> str:
    """300 idle connections to every daemon holding the newest peer checkpoint, and as many
    that send half a frame, held open while the job restarts: the daemons must still serve
    the trainer, which restores that step from the peers."""
    trial, _, step, _, endpoints = _newest_on_peers(h, name)
    flood: list[socket.socket] = []
    try:
        for endpoint in endpoints:
            host, port = endpoint.rsplit(":", 1)
            for i in range(FLOOD_CONNECTIONS):
                with contextlib.suppress(OSError):  # refused once the daemon is full: fine
                    sock = socket.create_connection((host, int(port)), timeout=5)
                    flood.append(sock)
                    if i % 2:
                        sock.sendall(b"\x00\x01")  # the first bytes of a frame, never more
        rec = resume(trial, obs, expect=step)
    finally:
        for sock in flood:
            sock.close()
    if rec["source"] != "peer":
        raise ScenarioFailed(f"restored step {step} from {rec['source']}, expected the peers")
    return passed(rec, f"{len(flood)} idle and half-frame connections held to "
                       f"{len(endpoints)} daemons")


def _run_cli(trial: Trial, *args: str) -> subprocess.CompletedProcess[str]:
    """One ``ckptpilot`` command on the trial's run, as an operator would run it."""
    return subprocess.run([sys.executable, "-m", "ckptpilot", *args, "--config",
                           str(trial.policy_path)], capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)


def _cli(trial: Trial, *args: str) -> str:
    """``_run_cli`` that must succeed; its output."""
    done = _run_cli(trial, *args)
    if done.returncode != 0:
        raise ScenarioFailed(f"`ckptpilot {' '.join(args)}` exited {done.returncode}: "
                             f"{(done.stderr or done.stdout).strip()[-300:]}")
    return done.stdout


def abandoned_then_rebuilt(h: Harness, name: str, obs: Observation) -> str:
    """Saves past step 40, ``ckptpilot recover`` back to the save before the newest, the
    continuation it starts killed before its next save, then the catalogue deleted and
    rebuilt (``validate --rebuild``): the restore must take the recovered step (or a newer
    save of the new continuation), never the abandoned newest step."""
    trial = h.trial(name, peers=False)
    first = faulted(trial.run("faulted", fault="kill-between", at_step=SECOND_KILL_STEP))
    steps = valid_steps(first["saves"], "remote")
    if len(steps) < 2:
        raise ScenarioFailed(f"fewer than two saves on the remote tier by step "
                             f"{SECOND_KILL_STEP}: {steps}")
    back, abandoned = steps[-2], steps[-1]
    _cli(trial, "recover", "--step", str(back))
    again = trial.run("continued", fault="kill-between", at_step=back + 1)
    rec = restored(trial, again, obs, reached=trial.reached())
    if rec["step"] != back:
        raise ScenarioFailed(f"after `recover --step {back}` restored step {rec['step']}")
    new = [s for s in valid_steps(faulted(again)["saves"], "remote") if s > back]
    for suffix in ("", "-wal", "-shm"):
        (trial.run_dir / f"metadata.sqlite{suffix}").unlink(missing_ok=True)
    _cli(trial, "validate", "--rebuild")
    rec = resume(trial, obs, expect=max([back, *new]))
    return passed(rec, f"recover --step {back} abandoned step {abandoned}, metadata.sqlite "
                       "deleted and rebuilt")


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (links not followed) with its SHA256: what must survive."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            found[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def tampered_location(h: Harness, name: str, obs: Observation) -> str:
    """The oldest remote row rewritten to point at ``<checkpoints>/..`` (the run directory)
    and made valid again: ``ckptpilot prune`` must refuse that row, naming it, and delete
    nothing of the run; the restore then takes the newest save."""
    trial, fault = killed_between(h, name)
    if trial.remote().fs.protocol not in ("file", ("file", "local")):
        raise ScenarioSkipped("the remote tier is not a local directory")
    checkpoints = Path(trial.remote().root)
    with sqlite3.connect(metadata_path(trial.run_dir)) as db:
        row = db.execute("SELECT id, step FROM checkpoints WHERE tier = 'remote' "
                         "ORDER BY step LIMIT 1").fetchone()
        if row is None:
            raise ScenarioFailed("no remote row to tamper with")
        db.execute("UPDATE checkpoints SET location = ?, status = 'valid', removed_at = NULL "
                   "WHERE id = ?",
                   (f"{checkpoints}/..", row[0]))
    kept = {p: d for p, d in _tree(trial.run_dir).items() if not p.startswith("metadata.")}
    pruned = _run_cli(trial, "prune")
    said = pruned.stdout + pruned.stderr
    if pruned.returncode == 0 or f"step {row[1]}" not in said:
        raise ScenarioFailed(f"`ckptpilot prune` exited {pruned.returncode} without naming "
                             f"the tampered row of step {row[1]}: {said.strip()[-300:]}")
    after = _tree(trial.run_dir)
    lost = sorted(p for p in kept if after.get(p) != kept[p])
    if lost or not metadata_path(trial.run_dir).exists():
        raise ScenarioFailed(f"prune of a row pointing at {checkpoints}/.. changed or deleted "
                             f"{lost[:5] or 'metadata.sqlite'}")
    rec = resume(trial, obs, expect=newest_save(fault["saves"]) or 0)
    return passed(rec, f"step {row[1]}'s row pointed at {checkpoints}/..; prune refused it "
                       "and deleted nothing")


def symlinked_step(h: Harness, name: str, obs: Observation) -> str:
    """The newest step directory moved out of the checkpoints and a symlink left under its
    name: the restore must not follow it (the save before it restores), and ``prune`` may
    remove the link but never what it points at."""
    trial, fault = killed_between(h, name)
    remote = trial.remote()
    if remote.fs.protocol not in ("file", ("file", "local")):
        raise ScenarioSkipped("the remote tier is not a local directory")
    steps = valid_steps(fault["saves"], "remote")
    if len(steps) < 2:
        raise ScenarioSkipped(f"fewer than two checkpoints on the remote tier by step "
                              f"{BETWEEN_STEP}")
    link = Path(remote.path(checkpoint_name(steps[-1], 0)))
    target = trial.dir / "elsewhere" / link.name
    target.parent.mkdir(exist_ok=True)
    shutil.move(link, target)
    os.symlink(target, link, target_is_directory=True)
    kept = _tree(target)
    peer = newest_save(fault["saves"], "peer")
    rec = resume(trial, obs, expect=max(steps[-2], peer or 0))
    _run_cli(trial, "prune")
    if _tree(target) != kept:
        raise ScenarioFailed(f"{target}, which the symlink {link} pointed at, was changed")
    return passed(rec, f"step {steps[-1]} replaced by a symlink to {target}; not followed, "
                       "its target untouched")
