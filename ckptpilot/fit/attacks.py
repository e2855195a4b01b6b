"""The ``ckptpilot fit`` scenarios that attack the job from outside its process: peer daemons
killed or hung (SIGSTOP) under one or two ranks; an operator's catalogue rebuilt after a
restore abandoned newer steps.

Each is a ``checks.Check`` built here and registered in ``scenarios.SCENARIOS``; the
vocabulary (outcomes, reading the children) is ``checks``'.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from ckptpilot.fit.checks import (
    BETWEEN_STEP,
    SECOND_KILL_STEP,
    Check,
    Observation,
    ScenarioFailed,
    faulted,
    newest_save,
    passed,
    refusal,
    restored,
    resume,
    valid_steps,
)
from ckptpilot.fit.harness import Harness, Trial
from ckptpilot.storage.archive import list_archives
from ckptpilot.tiers.remote import RemoteTier


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



def _cli(trial: Trial, *args: str) -> str:
    """Run one ``ckptpilot`` command on the trial's run, as an operator would."""
    done = subprocess.run([sys.executable, "-m", "ckptpilot", *args, "--config",
                           str(trial.policy_path)], capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
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
