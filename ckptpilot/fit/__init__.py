"""``ckptpilot fit``: the fault-injection suite, run against the user's own policy and storage
before a long job is trusted with them (SPEC §9).

Every scenario trains a small real model in child processes, injects its fault, restarts
and checks that the recovery is the right one and that the continuation is bit-exact with
one uninterrupted reference run (shared by the scenarios of a job kind). ``run_fit`` runs
the chosen scenarios in order, prints a progress line as each finishes, then the table (or,
with ``--json``, the JSON document), and always writes ``fit.json`` and TensorBoard text and
scalars to the work directory. Exit code: 0 when every scenario that ran passed, 1 when one
failed, 2 on bad input (raised as ``FitError`` or the policy's ``PolicyError``).

The scenarios live in ``scenarios.py`` (one registry, ``SCENARIOS``), the child job in
``job.py``, the processes and comparisons in ``harness.py``, the output in ``report.py``.
``--launcher torchrun`` runs the incident campaign instead (``campaign.py``, its table in
``incidents.py``): every incident against a real ``torchrun --max-restarts`` job of N ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from ckptpilot.errors import CkptPilotError

if TYPE_CHECKING:
    from ckptpilot.fit.harness import Harness
    from ckptpilot.fit.report import Outcome
    from ckptpilot.fit.scenarios import Needs

__all__ = ["FitError", "list_scenarios", "run_fit"]

WORK_DIR_MARKER = ".ckptpilot-fit"
LAUNCHERS = ("process", "torchrun")


class FitError(CkptPilotError, ValueError):
    """Bad ``ckptpilot fit`` input: an unknown scenario, a work directory fit cannot use."""


def list_scenarios(out: TextIO, launcher: str = "process") -> int:
    """Print every scenario (or incident): name, what it needs, the fault and what passing
    means."""
    from ckptpilot.fit.incidents import INCIDENTS
    from ckptpilot.fit.scenarios import SCENARIOS

    if launcher == "torchrun":
        width = max(len(i.name) for i in INCIDENTS)
        for i in INCIDENTS:
            out.write(f"{i.name:<{width}}  [{i.needs.value}] {i.fault}: {i.passes}\n")
        return 0
    width = max(len(s.name) for s in SCENARIOS)
    for s in SCENARIOS:
        out.write(f"{s.name:<{width}}  [{s.needs.value}] {s.fault}: {s.passes}\n")
    return 0


def _select(names: Sequence[str] | None, launcher: str = "process") -> list[str]:
    from ckptpilot.fit.incidents import INCIDENTS
    from ckptpilot.fit.scenarios import SCENARIOS

    valid = [s.name for s in (INCIDENTS if launcher == "torchrun" else SCENARIOS)]
    if not names:
        return valid
    unknown = [n for n in names if n not in valid]
    if unknown:
        what = "incident" if launcher == "torchrun" else "scenario"
        raise FitError(f"unknown {what} {', '.join(map(repr, unknown))}; valid {what}s: "
                       f"{', '.join(valid)}")
    return list(dict.fromkeys(names))


def _skip_reason(needs: Needs, peers: bool) -> str | None:
    from ckptpilot.fit.scenarios import Needs

    if needs is Needs.PEERS and not peers:
        return "no peer tier in the policy (--with-peers runs it on local daemons)"
    if needs is Needs.DIST:
        import torch.distributed

        if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
            return "this torch has no torch.distributed with the gloo backend"
    return None


def _prepare_work_dir(work_dir: Path | None) -> Path:
    if work_dir is None:
        path = Path(tempfile.mkdtemp(prefix="ckptpilot-fit-"))
    else:
        path = work_dir.resolve()
        if path.exists() and any(path.iterdir()) and not (path / WORK_DIR_MARKER).exists():
            raise FitError(f"--work-dir {work_dir} is not empty and was not made by "
                           "`ckptpilot fit`; choose another directory")
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
    (path / WORK_DIR_MARKER).write_text("made by `ckptpilot fit`; emptied by its next run\n")
    return path


def run_fit(*, config: Path | None, scenarios: Sequence[str] | None = None,
            work_dir: Path | None = None, with_peers: bool = False, as_json: bool = False,
            keep: bool = False, out: TextIO | None = None, err: TextIO | None = None,
            launcher: str = "process", nproc: int = 2, json_path: Path | None = None,
            reference: Path | None = None) -> int:
    """Run the scenarios (all when ``scenarios`` is empty) against the policy ``config``
    (the reference policy when None); returns the exit code.

    ``launcher="torchrun"``: run the incidents of the campaign instead, each against a
    torchrun job of ``nproc`` ranks; ``reference``: the outputs of an earlier campaign's
    uninterrupted job (``<work>/reference-torchrun/out/uninterrupted``) to compare with,
    instead of running it again. ``json_path``: also write the JSON document there.

    ``work_dir``: where the scenarios' run directories go (default: a new temporary
    directory); a directory made by an earlier fit run is emptied first. A scenario that
    did not pass keeps its directory (named in the output); ``keep`` keeps every one.
    ``with_peers``: run the peer scenarios on local daemons although the policy has no peer
    tier (otherwise they are skipped).
    """
    from ckptpilot.fit.harness import Harness
    from ckptpilot.fit.report import (
        CAMPAIGN_COLUMNS,
        COLUMNS,
        Result,
        exit_code,
        progress_line,
        render_table,
        to_document,
        write_outputs,
    )
    from ckptpilot.policy import load_policy

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err

    def progress(line: str) -> None:
        err.write(line + "\n")
        err.flush()

    if launcher not in LAUNCHERS:
        raise FitError(f"unknown launcher {launcher!r}; valid launchers: {', '.join(LAUNCHERS)}")
    if launcher == "torchrun" and nproc < 2:
        raise FitError(f"--nproc {nproc}: a torchrun campaign needs at least 2 ranks")
    if reference is not None and launcher != "torchrun":
        raise FitError("--reference applies to --launcher torchrun only")
    names = _select(scenarios, launcher)
    policy = load_policy(config)
    work = _prepare_work_dir(work_dir)
    harness = Harness(work, policy, fit_id=uuid.uuid4().hex[:8], progress=progress)
    campaign = launcher == "torchrun"
    what = f"incidents under torchrun, {nproc} ranks" if campaign else "scenarios"
    progress(f"ckptpilot fit: {len(names)} {what}, policy {config or '(reference)'}, "
             f"work dir {work}")
    peers = policy.tiers.peer.enabled or with_peers
    t0 = time.monotonic()
    outcomes = []
    try:
        if campaign:
            from ckptpilot.fit.campaign import run_campaign

            outcomes = run_campaign(harness, names, nproc=nproc, keep=keep, peers=peers,
                                    reference_dir=reference, progress=progress)
        for index, name in enumerate([] if campaign else names, 1):
            outcomes.append(_run_scenario(harness, name, peers=peers, keep=keep))
            progress(progress_line(index, len(names), outcomes[-1]))
    finally:
        harness.close(keep=keep)
    wall = time.monotonic() - t0
    document = to_document(outcomes, config=None if config is None else os.fspath(config),
                           work_dir=work, wall_seconds=wall)
    document["launcher"] = launcher
    columns = CAMPAIGN_COLUMNS if campaign else COLUMNS
    if campaign:
        ran = [o for o in outcomes if o.result is not Result.SKIPPED]
        document.update(nproc=nproc, incident_types=len(ran),
                        incidents_passed=sum(o.result is Result.PASSED for o in ran))
    write_outputs(work, document, outcomes, columns)
    if json_path is not None:
        json_path.write_text(json.dumps(document, indent=1) + "\n")
    if as_json:
        out.write(json.dumps(document, indent=1) + "\n")
    else:
        out.write(render_table(outcomes, wall_seconds=wall, work_dir=work, columns=columns)
                  + "\n")
    return exit_code(outcomes)


def _run_scenario(harness: Harness, name: str, *, peers: bool, keep: bool) -> Outcome:
    """Run one scenario; whatever goes wrong inside it becomes its failed outcome."""
    from ckptpilot.fit.report import Outcome, Result
    from ckptpilot.fit.scenarios import BY_NAME, Observation, ScenarioFailed, ScenarioSkipped

    scenario = BY_NAME[name]
    obs = Observation()
    started = time.monotonic()
    result, detail = Result.PASSED, ""
    skip = _skip_reason(scenario.needs, peers)
    if skip is not None:
        result, detail = Result.SKIPPED, skip
    else:
        try:
            detail = scenario.check(harness, name, obs)
        except ScenarioSkipped as e:
            result, detail = Result.SKIPPED, str(e)
        except ScenarioFailed as e:
            result, detail = Result.FAILED, str(e)
        except Exception as e:  # a scenario fit cannot run fails; the others still run
            result, detail = Result.FAILED, f"fit could not run it: {type(e).__name__}: {e}"
    kept = harness.release(name, keep=keep or result is Result.FAILED)
    return Outcome(scenario=name, fault=scenario.fault, result=result, detail=detail,
                   seconds=time.monotonic() - started, recovered_step=obs.recovered_step,
                   source=obs.source, steps_lost=obs.steps_lost, bit_exact=obs.bit_exact,
                   restore_seconds=obs.restore_seconds,
                   run_dir=None if kept is None else str(kept))
