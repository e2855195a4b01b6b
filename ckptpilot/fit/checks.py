"""What every ``ckptpilot fit`` scenario shares: the outcome types, the registry entry and
reading a trial's children (which save each reported, what each restored, whether the
continuation is bit-exact with the reference).

The expected recovered step comes from the interrupted run itself: just before its fault
the child reports the saves it had completed (step, level, tier, status).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ckptpilot.fit.harness import ChildRun, Harness, HarnessError, Trial
from ckptpilot.fit.job import EXIT_ERROR

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

def faulted(run: ChildRun, rank: int = 0, *, may_not_fire: bool = False) -> dict[str, Any]:
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


def valid_steps(saves: list[dict[str, Any]], tier: str | None = None) -> list[int]:
    return sorted(s["step"] for s in saves
                  if s["status"] == "valid" and (tier is None or s["tier"] == tier))


def newest_save(saves: list[dict[str, Any]], tier: str | None = None) -> int | None:
    steps = valid_steps(saves, tier)
    return steps[-1] if steps else None


def restored(trial: Trial, run: ChildRun, obs: Observation, *, reached: int,
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


def finished(run: ChildRun) -> None:
    for rank in range(run.ranks):
        if run.returncode != 0 or run.event("done", rank) is None:
            error = run.event("error", rank)
            if error is not None:
                raise ScenarioFailed(f"training after the restore stopped (rank {rank}): "
                                     f"{error['error']}: {error['message']}")
            raise ScenarioFailed(f"training after the restore did not finish: "
                                 f"{run.describe()}")


def resume(trial: Trial, obs: Observation, *, expect: int | None, label: str = "resumed",
            **options: Any) -> dict[str, Any]:
    """Restart the job, which must restore ``expect`` (when given) and train to the end
    bit-exactly."""
    reached = trial.reached()
    run = trial.run(label, **options)
    rec = restored(trial, run, obs, reached=reached)
    if expect is not None and rec["step"] != expect:
        raise ScenarioFailed(f"restored step {rec['step']} from {rec['source']}, expected "
                             f"step {expect}{skipped_note(rec)}")
    finished(run)
    bit_exact(trial, obs)
    return rec


def bit_exact(trial: Trial, obs: Observation) -> None:
    ok, why = trial.compare()
    obs.bit_exact = ok
    if not ok:
        raise ScenarioFailed(f"the continuation is not bit-exact: {why}")


def skipped_note(rec: dict[str, Any]) -> str:
    if not rec["skipped"]:
        return ""
    location, reason = rec["skipped"][0]
    return f" (skipped {location}: {reason})"


def passed(rec: dict[str, Any], what: str) -> str:
    return f"{what}; restored step {rec['step']} from {rec['source']}, bit-exact"


def refusal(run: ChildRun, error: str | None) -> str:
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


def killed_between(h: Harness, name: str) -> tuple[Trial, dict[str, Any]]:
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
