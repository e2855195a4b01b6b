"""``ckptpilot fit --launcher torchrun``: the incident campaign against a real torchrun job.

One uninterrupted reference job of N gloo ranks, then one job per incident, each a real
``python -m torch.distributed.run --max-restarts R`` whose agent restarts the worker group
after the incident, as it would in production. Every job trains fit's small model for
``STEPS`` steps; its ranks stop at a quiet point after ``QUIET_STEP`` (saves in flight
finished, each rank's completed saves and pid reported, a barrier) so that what each rank
holds is known before the incident lands. The incident is then injected by the parent (it
damages storage, SIGKILLs ranks or peer daemons while the ranks wait for its go file) or by
a rank itself (a SIGKILL in a phase of its next save, a full disk, an unreachable store in
the restart ...).

An incident passes only when:

- torchrun restarted the worker group exactly the number of times the incident causes;
- in every restart every rank restored and all restored the same step (or, where the
  incident makes a restart fail, every rank refused), and that step is the one the ranks'
  own reports at the quiet point say they all hold, minus what the incident destroyed;
- the job then ran to its end, and every step trained in every start, and the final model,
  optimizer, schedule, data cursor and RNG states of every rank, equal the reference's bit
  for bit.

The incidents live in ``incidents.py`` (one table, ``INCIDENTS``), their vocabulary in
``incident.py``; this module runs them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptpilot.fit.checks import Needs, ScenarioFailed, ScenarioSkipped
from ckptpilot.fit.harness import (
    ChildRun,
    Harness,
    HarnessError,
    Reference,
    Trial,
    load_reference,
    read_events,
    read_losses,
)
from ckptpilot.fit.incident import (
    QUIET_STEP,
    QUIET_WAIT_SECONDS,
    REFERENCE,
    STEPS,
    CampaignTrial,
    Damage,
    Expect,
    Incident,
    Scene,
)
from ckptpilot.fit.report import Outcome, Result


class Starts:
    """The events of a finished job (of its launches, in order: a job launched again after
    its agent was stopped), by rank and start of the worker group. Starts are numbered
    across launches: ``attempt`` is the job's start, the events' own is the launch's."""

    def __init__(self, runs: list[ChildRun]) -> None:
        self.runs = runs
        self.run = runs[-1]
        self.events: dict[int, list[dict[str, Any]]] = {r: [] for r in range(self.run.ranks)}
        self.launch_of: dict[int, int] = {}
        offset = 0
        for index, run in enumerate(runs):
            last = 0
            for r in self.events:
                for e in read_events(run.out / f"events_rank{r:05d}.jsonl"):
                    last = max(last, e.get("attempt", 0))
                    self.events[r].append({**e, "attempt": offset + e.get("attempt", 0)})
            for attempt in range(offset, offset + last + 1):
                self.launch_of[attempt] = index
            offset += last + 1
        self.last = offset - 1

    def get(self, kind: str, rank: int, attempt: int) -> dict[str, Any] | None:
        return next((e for e in self.events[rank]
                     if e["event"] == kind and e["attempt"] == attempt), None)

    def reached(self, attempt: int, restored: dict[str, Any]) -> int:
        """The newest step trained before ``attempt`` (a job launched again starts a new
        losses file: the earlier launches' count too)."""
        earlier = [s for run in self.runs[:self.launch_of[attempt]]
                   for r in range(run.ranks)
                   for s, _ in read_losses(run.out / f"losses_rank{r:05d}.txt")]
        return max([restored["reached"], *earlier])

    def reap(self) -> None:
        """SIGKILL any worker still alive (a stopped rank the agent left behind): torchrun
        starts each in a session of its own, out of reach of the agent's process group."""
        for run in self.runs:
            for events in self.events.values():
                for pid in {e["pid"] for e in events if "pid" in e}:
                    _kill_worker(pid, run.out)

    def every(self, kind: str, attempt: int) -> dict[int, dict[str, Any]]:
        return {r: e for r in self.events if (e := self.get(kind, r, attempt)) is not None}


def _kill_worker(pid: int, out: Path) -> None:
    """SIGKILL ``pid`` if it still is a training child writing to ``out`` (never a process
    that reused the number)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return
    if os.fsencode(out) in cmdline:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def agreed_step(quiet: dict[int, dict[str, Any]], damage: Damage,
                lost_tiers: frozenset[str]) -> int:
    """The newest step every rank still holds a valid copy of after the incident, on a tier
    that outlives its process (peer, remote): what every rank must restore. 0: none."""
    down = {"memory"} | lost_tiers | damage.lost_tiers
    held = [{s["step"] for s in event["saves"] if s["status"] == "valid"
             and s["tier"] not in down and (rank, s["step"], s["tier"]) not in damage.lost}
            for rank, event in quiet.items()]
    return max(set.intersection(*held), default=0) if held else 0


def make_reference(h: Harness, nproc: int, reference_dir: Path | None,
                   progress: Callable[[str], None]) -> Reference:
    """The uninterrupted job (made now, or read from ``reference_dir``, an earlier
    campaign's ``<work>/reference-torchrun/out/uninterrupted``)."""
    if reference_dir is not None:
        found = load_reference(reference_dir, nproc, STEPS)
        if isinstance(found, HarnessError):
            raise HarnessError(f"--reference {reference_dir}: {found}")
        return found
    t0 = time.monotonic()
    trial = CampaignTrial(h, REFERENCE, nproc=nproc, max_restarts=0, peers=False, policy={})
    run = trial.run("uninterrupted")
    starts = Starts([run])
    if run.returncode != 0 or len(starts.every("done", 0)) != nproc:
        raise HarnessError(f"the uninterrupted reference job failed: {run.describe()}")
    found = load_reference(run.out, nproc, STEPS)
    if isinstance(found, HarnessError):
        raise found
    progress(f"reference: {STEPS} steps, {nproc} ranks under torchrun, uninterrupted: done "
             f"in {time.monotonic() - t0:.1f} s")
    return found


@dataclass
class Verdict:
    """What a job showed, filled as the checks go, so a failure still reports it."""

    restarts: int | None = None
    recovered_step: int | None = None
    source: str | None = None
    steps_lost: int | None = None
    bit_exact: bool | None = None
    restore_seconds: float | None = None


def run_incident(h: Harness, incident: Incident, ref: Reference, nproc: int,
                 verdict: Verdict) -> tuple[CampaignTrial, str]:
    """Run one incident's job and judge it; raises ``ScenarioFailed`` with the reason."""
    from ckptpilot.fit.incidents import rank_of

    if incident.job.get("fault") == "nvml-burst" and h.policy.scheduler.weights.system == 0:
        raise ScenarioSkipped("the policy gives the system signal no weight: no health probes")
    job = dict(incident.job)
    if job.get("fault_rank") is not None:
        job["fault_rank"] = rank_of(job["fault_rank"], nproc)
    trial = CampaignTrial(h, incident.name, nproc=nproc, max_restarts=incident.restarts,
                          peers=incident.needs is Needs.PEERS, policy=incident.policy)
    h.begin(trial)
    go = trial.dir / "go" if incident.act is not None else None
    running = trial.spawn("job", quiet_at_step=QUIET_STEP, go_file=go, **job)
    damage, quiet, published = Damage(""), None, None
    try:
        if incident.act is not None:
            assert go is not None
            quiet = _wait_quiet(running.out, nproc, running.proc)
            if quiet is not None:
                damage = incident.act(Scene(h, trial, quiet, running.proc.pid))
                go.touch()
    finally:
        if go is not None and not go.exists():  # the action failed: end the job at once
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(running.proc.pid, signal.SIGKILL)
        first = running.finish()
        trial.adopt(first)
        Starts([first]).reap()
    if incident.act is not None and quiet is None:
        raise ScenarioFailed(f"the ranks never reached the quiet point after step "
                             f"{QUIET_STEP}: {first.describe()}")
    runs = [first]
    try:
        if incident.relaunch:
            if first.returncode in (0, None):
                raise ScenarioFailed(f"the job was to be stopped, but {first.describe()}")
            published = common_published(trial)
            runs.append(trial.run("relaunched"))
    finally:
        Starts(runs).reap()
        if trial.peers is not None:
            trial.peers.revive()
    return trial, _judge(incident, trial, Starts(runs), damage, ref, verdict, published)


def common_published(trial: Trial) -> int:
    """The newest step every rank has published on the remote tier (0: none): what a job
    launched again must restore when nothing else says which saves completed."""
    from ckptpilot.tiers.remote.archive import list_archives

    remote = trial.remote()
    held = [{step for step, _ in list_archives(remote, r).published}
            for r in range(trial.ranks)]
    return max(set.intersection(*held), default=0)


def _wait_quiet(out: Path, nproc: int, proc: Any) -> dict[int, dict[str, Any]] | None:
    deadline = time.monotonic() + QUIET_WAIT_SECONDS
    while time.monotonic() < deadline:
        quiet = {}
        for r in range(nproc):
            found = next((e for e in read_events(out / f"events_rank{r:05d}.jsonl")
                          if e["event"] == "quiet"), None)
            if found is not None:
                quiet[r] = found
        if len(quiet) == nproc:
            return quiet
        if proc.poll() is not None:
            return None
        time.sleep(0.05)
    return None


def _judge(incident: Incident, trial: CampaignTrial, starts: Starts, damage: Damage,
           ref: Reference, verdict: Verdict, published: int | None) -> str:
    run, nproc = starts.run, trial.ranks
    quiet = starts.every("quiet", 0)
    if len(quiet) != nproc:
        raise ScenarioFailed(f"only ranks {sorted(quiet)} reached the quiet point after step "
                             f"{QUIET_STEP}: {run.describe()}")
    verdict.restarts = starts.last
    if starts.last != incident.restarts + int(incident.relaunch):
        raise ScenarioFailed(f"the worker group was started {starts.last + 1} times, expected "
                             f"{incident.restarts + int(incident.relaunch) + 1}: "
                             f"{run.describe()}")
    expected = _expected(incident, starts, quiet, damage, published)
    notes = []
    for attempt in range(1, starts.last + 1):
        which = (f"restart {attempt}" if starts.launch_of[attempt] == starts.launch_of[attempt - 1]
                 else "launched again")
        refused = starts.every("refused", attempt)
        restored = starts.every("restored", attempt)
        if attempt <= incident.refusals or (expected == 0 and _held_any(quiet)):
            if len(refused) != nproc:
                raise ScenarioFailed(f"{which}: every rank had to refuse; ranks "
                                     f"{sorted(refused)} refused, {_restored(restored)}")
            errors = sorted({e["error"] for e in refused.values()})
            notes.append(f"{which}: all {nproc} ranks refused ({', '.join(errors)})")
            continue
        if len(restored) != nproc:
            why = "; ".join(f"rank {r}: {e['error']}: {e['message']}"
                            for r, e in refused.items())
            raise ScenarioFailed(f"{which}: ranks {sorted(restored)} of {nproc} "
                                 f"restored{'; ' + why if why else ''}: {run.describe()}")
        steps = {e["step"] for e in restored.values()}
        sources = sorted({e["source"] for e in restored.values()})
        verdict.recovered_step = min(steps)
        verdict.source = "+".join(sources)
        verdict.steps_lost = max(starts.reached(attempt, e) for e in restored.values()) - min(steps)
        verdict.restore_seconds = max(e["seconds"] for e in restored.values())
        if len(steps) != 1:
            raise ScenarioFailed(f"{which}: the ranks restored different steps: "
                                 f"{_restored(restored)}")
        step = steps.pop()
        if step != expected:
            raise ScenarioFailed(f"{which}: every rank restored step {step}, but the "
                                 f"step every rank held after the incident is {expected} "
                                 f"({incident.expect.value})")
        notes.append(f"{which}: all {nproc} ranks restored step {step} from "
                     f"{'+'.join(sources)}")
    if incident.ledger_cause is not None:
        notes.append(_ledgers(incident, trial))
    head = "; ".join([*([damage.what] if damage.what else []), *_faults(starts),
                      *damage.notes])
    head = head + "; " if head else ""
    if expected == 0 and _held_any(quiet):
        if run.returncode == 0:
            raise ScenarioFailed(f"nothing loadable was left, yet {run.describe()}")
        return (f"{head}nothing loadable left on any rank; " + "; ".join(notes)
                + "; torchrun gave up, never a start from scratch")
    done = starts.every("done", starts.last)
    if run.returncode != 0 or len(done) != nproc:
        raise ScenarioFailed(f"the job did not finish after its restarts: {run.describe()}")
    ok, why = trial.compare(ref)
    verdict.bit_exact = ok
    if not ok:
        raise ScenarioFailed(f"the job is not bit-exact with the uninterrupted one: {why}")
    return head + "; ".join(notes) + ", bit-exact"


def _held_any(quiet: dict[int, dict[str, Any]]) -> bool:
    """Whether some rank had completed a save (so restoring nothing is no fresh start)."""
    return any(s["status"] == "valid" for e in quiet.values() for s in e["saves"])


def _ledgers(incident: Incident, trial: CampaignTrial) -> str:
    """Check that the ranks' failure ledgers recorded the stop with the incident's cause."""
    from ckptpilot.rundir import ledger_path

    ranks = incident.ledger_ranks or tuple(range(trial.ranks))
    log = (trial.runs[0].out / "child.log").read_text(errors="replace").splitlines()
    for r in ranks:
        if incident.logged is not None and not any(
                f"rank {r}:" in line and incident.logged in line for line in log):
            raise ScenarioFailed(f"rank {r} did not log '{incident.logged}' "
                                 f"({trial.runs[0].out / 'child.log'})")
        path = ledger_path(trial.run_dir, r)
        if not any(rec.get("kind") == "stop" and rec.get("cause") == incident.ledger_cause
                   for rec in read_events(path)):
            raise ScenarioFailed(f"{path}: rank {r}'s failure ledger has no stop record with "
                                 f"cause {incident.ledger_cause!r}")
    who = "every rank's" if len(ranks) == trial.ranks else f"rank {', '.join(map(str, ranks))}'s"
    logged = f", its log '{incident.logged}'" if incident.logged else ""
    return f"{who} ledger records a stop ({incident.ledger_cause}){logged}"


def _faults(starts: Starts) -> list[str]:
    """What the ranks reported of the incident in the first start."""
    said = []
    for r in range(starts.run.ranks):
        fault, error = starts.get("fault", r, 0), starts.get("error", r, 0)
        if fault is not None:
            phase, step = fault["phase"], fault["step"]
            said.append(f"rank {r}'s disk full from the save of step {step}"
                        if phase == "enospc" else f"rank {r} died {phase} of step {step}"
                        if phase.startswith("after") else f"rank {r} stopped in its {phase} "
                        f"at step {step}" if "SIGSTOP" in phase
                        else f"rank {r} died in the {phase} of step {step}")
        if error is not None:
            said.append(f"rank {r} stopped with {error['error']}")
    return said


def _restored(restored: dict[int, dict[str, Any]]) -> str:
    return ", ".join(f"rank {r} step {e['step']} from {e['source']}"
                     for r, e in sorted(restored.items())) or "none restored"


def _expected(incident: Incident, starts: Starts, quiet: dict[int, dict[str, Any]],
              damage: Damage, published: int | None) -> int:
    if incident.expect is Expect.QUIET:
        return agreed_step(quiet, damage, incident.lost_tiers)
    if incident.expect is Expect.PUBLISHED:
        assert published is not None
        return published
    if incident.expect is Expect.EXITED:
        exited = starts.every("exited", 0)
        if len(exited) != starts.run.ranks:
            raise ScenarioFailed(f"only ranks {sorted(exited)} exited through the pilot: "
                                 f"{starts.runs[0].describe()}")
        codes = {e["code"] for e in exited.values()}
        if codes != {incident.exit_code}:
            raise ScenarioFailed(f"the ranks exited with {sorted(codes, key=str)}, expected "
                                 f"{incident.exit_code}")
        damage.notes.append(f"every rank exited {incident.exit_code} through the pilot")
        return agreed_step(exited, damage, incident.lost_tiers)
    faults = [f for r in range(starts.run.ranks) if (f := starts.get("fault", r, 0))]
    if not faults:
        raise ScenarioFailed(f"no rank reported its fault: {starts.run.describe()}")
    if not all(f.get("waited", True) for f in faults):
        raise ScenarioFailed(f"the faulted rank waited in vain for the others to publish "
                             f"step {faults[0]['step']}")
    return min(f["step"] for f in faults)


def run_campaign(h: Harness, names: list[str], *, nproc: int, keep: bool, peers: bool,
                 reference_dir: Path | None, progress: Callable[[str], None]) -> list[Outcome]:
    """Run the incidents ``names`` in order (after the reference job); one outcome each."""
    from ckptpilot.fit.incidents import BY_NAME
    from ckptpilot.fit.report import progress_line

    ref: Reference | HarnessError
    try:
        ref = make_reference(h, nproc, reference_dir, progress)
    except HarnessError as e:
        ref = e
    outcomes = []
    for index, name in enumerate(names, 1):
        outcomes.append(_outcome(h, BY_NAME[name], ref, nproc, peers=peers, keep=keep))
        progress(progress_line(index, len(names), outcomes[-1]))
    return outcomes


def _outcome(h: Harness, incident: Incident, ref: Reference | HarnessError, nproc: int, *,
             peers: bool, keep: bool) -> Outcome:
    """One incident; whatever goes wrong inside it becomes its failed outcome."""
    started = time.monotonic()
    verdict = Verdict()
    result, detail = Result.PASSED, ""
    if incident.needs is Needs.PEERS and not peers:
        result, detail = Result.SKIPPED, ("no peer tier in the policy (--with-peers runs it "
                                          "on local daemons)")
    elif isinstance(ref, HarnessError):
        result, detail = Result.FAILED, str(ref)
    else:
        try:
            _, detail = run_incident(h, incident, ref, nproc, verdict)
        except ScenarioSkipped as e:
            result, detail = Result.SKIPPED, str(e)
        except ScenarioFailed as e:
            result, detail = Result.FAILED, str(e)
        except Exception as e:  # an incident fit cannot run fails; the others still run
            result, detail = Result.FAILED, f"fit could not run it: {type(e).__name__}: {e}"
    kept = h.release(incident.name, keep=keep or result is Result.FAILED)
    return Outcome(scenario=incident.name, fault=incident.fault, result=result, detail=detail,
                   seconds=time.monotonic() - started, recovered_step=verdict.recovered_step,
                   source=verdict.source, steps_lost=verdict.steps_lost,
                   bit_exact=verdict.bit_exact, restore_seconds=verdict.restore_seconds,
                   run_dir=None if kept is None else str(kept), restarts=verdict.restarts)
