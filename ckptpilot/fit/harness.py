"""Running fit's training children and judging them against an uninterrupted reference.

This module owns the scratch directories of the scenarios (one ``Trial`` each: its policy,
run directory and the outputs of its children), how a child is started and bounded in time,
the reference runs, and the bit-for-bit comparison. It knows no scenario: which fault to
inject and what the outcome must be is ``scenarios.py``'s business.

The user's policy is used as given except for what a scratch run needs: ``run_dir`` (a fresh
directory per scenario), the scheduler's ``base_interval`` (short enough that the small model
saves several times), the remote URL (a ``{run_dir}``-relative URL follows the scratch
directory; any other gets a unique ``fit-<id>/<scenario>`` suffix, so nothing of the user's
is touched) and, where a scenario runs with peers, the endpoints of fit's own daemons.

Lifecycle: one ``Harness`` per ``ckptpilot fit`` run, used from one thread; ``close()`` stops
the peer daemons it started. Children run in their own session and whatever they leave behind
(a load-check worker of a killed job) is killed with their process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import yaml

from ckptpilot.fit.peers import PeerCluster
from ckptpilot.policy import Policy, load_policy
from ckptpilot.tiers.remote.store import RemoteTier

STEPS = 60
INTERVAL = 10
CHILD_TIMEOUT_SECONDS = 300.0
WORLD_SIZE = 2


class HarnessError(RuntimeError):
    """fit itself could not do what a scenario needs (a reference run failed, a child never
    reported); the scenario fails with this message."""


@dataclass(frozen=True)
class ChildRun:
    """One finished child (for ``--dist``: one torchrun with its ranks)."""

    label: str
    out: Path
    returncode: int | None  # None: it ran past its time limit and was killed
    seconds: float
    ranks: int

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    @property
    def killed(self) -> bool:
        return self.returncode == -signal.SIGKILL

    def events(self, rank: int = 0) -> list[dict[str, Any]]:
        return read_events(self.out / f"events_rank{rank:05d}.jsonl")

    def event(self, kind: str, rank: int = 0) -> dict[str, Any] | None:
        return next((e for e in self.events(rank) if e["event"] == kind), None)

    def log_tail(self, lines: int = 6) -> str:
        try:
            text = (self.out / "child.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return " | ".join(ln.strip() for ln in text.strip().splitlines()[-lines:])

    def describe(self) -> str:
        """How the child ended, for a failure message."""
        if self.timed_out:
            return f"the {self.label} run was still going after {CHILD_TIMEOUT_SECONDS:.0f} s"
        how = (f"was killed by signal {-self.returncode}" if self.returncode < 0
               else f"exited with {self.returncode}")
        tail = self.log_tail()
        return f"the {self.label} run {how}" + (f"; its log ends: {tail}" if tail else "")


def read_events(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the last line of a killed child may be torn
    return events


class Running:
    """A child started with ``Trial.spawn``: the parent acts while it trains."""

    def __init__(self, label: str, out: Path, proc: subprocess.Popen[bytes], ranks: int,
                 started: float) -> None:
        self.label = label
        self.out = out
        self.proc = proc
        self.ranks = ranks
        self._started = started

    def wait_event(self, kind: str, timeout_seconds: float = CHILD_TIMEOUT_SECONDS
                   ) -> dict[str, Any] | None:
        """The first ``kind`` event of rank 0, or None if the child ended (or the time ran
        out) without one."""
        deadline = time.monotonic() + timeout_seconds
        path = self.out / "events_rank00000.jsonl"
        while time.monotonic() < deadline:
            found = next((e for e in read_events(path) if e["event"] == kind), None)
            if found is not None or self.proc.poll() is not None:
                return found
            time.sleep(0.05)
        return None

    def finish(self) -> ChildRun:
        remaining = CHILD_TIMEOUT_SECONDS - (time.monotonic() - self._started)
        try:
            returncode: int | None = self.proc.wait(max(remaining, 0.1))
        except subprocess.TimeoutExpired:
            returncode = None
        _kill_group(self.proc)
        return ChildRun(self.label, self.out, returncode, time.monotonic() - self._started,
                        self.ranks)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's session (itself if still running, and what it left behind)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@dataclass(frozen=True)
class Reference:
    """The uninterrupted run: every step's loss and the final state, per rank."""

    losses: dict[int, dict[int, str]]
    tensors: dict[int, dict[str, torch.Tensor]]
    info: dict[int, dict[str, Any]]


def load_reference(out: Path, ranks: int, steps: int) -> Reference | HarnessError:
    """The reference an uninterrupted run left in ``out`` (its losses and final states)."""
    losses, tensors, info = {}, {}, {}
    for r in range(ranks):
        losses[r] = dict(read_losses(out / f"losses_rank{r:05d}.txt"))
        final = out / f"final_rank{r:05d}"
        if not Path(str(final) + ".json").exists():
            return HarnessError(f"{final}.json: the reference of rank {r} has no final state")
        tensors[r] = safetensors.torch.load_file(str(final) + ".safetensors")
        info[r] = json.loads(Path(str(final) + ".json").read_text())
        if sorted(losses[r]) != list(range(1, steps + 1)):
            return HarnessError(f"{out}: the reference run of rank {r} did not train steps "
                                f"1..{steps}")
    return Reference(losses, tensors, info)


def read_losses(path: Path) -> list[tuple[int, str]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    pairs = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            pairs.append((int(parts[0]), parts[1]))
    return pairs


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


class Trial:
    """One scenario's scratch directory: ``policy.yaml``, ``run/`` (the run directory),
    ``out/<label>/`` per child. Every child of a trial shares the run directory, as the
    restarts of one training job do."""

    extra_env: dict[str, str] = {}  # noqa: RUF012 - read only; a subclass replaces it

    def __init__(self, harness: Harness, name: str, *, peers: PeerCluster | None,
                 dist: bool) -> None:
        self.harness = harness
        self.name = name
        self.dir = harness.work_dir / name
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        self.run_dir = self.dir / "run"
        self.peers = peers
        self.dist = dist
        self.policy_path = self.dir / "policy.yaml"
        self.policy = harness.write_policy(self.policy_path, self.run_dir, name, peers)
        self.runs: list[ChildRun] = []

    @property
    def ranks(self) -> int:
        return WORLD_SIZE if self.dist else 1

    def remote(self) -> RemoteTier:
        """The run's remote tier, for faults that damage what is stored on it."""
        return RemoteTier(self.policy.tiers.remote.url,
                          self.policy.tiers.remote.storage_options)

    def job_args(self, out: Path, options: dict[str, Any], steps: int = STEPS) -> list[str]:
        """The training child's arguments: the scenario's policy, ``out`` and ``options``
        as flags (``at_step=25`` is ``--at-step 25``)."""
        job = ["--config", str(self.policy_path), "--steps", str(steps), "--out", str(out)]
        for key, value in options.items():
            if value is None or value is False:
                continue
            flag = "--" + key.replace("_", "-")
            job += [flag] if value is True else [flag, str(value)]
        return job

    def _command(self, out: Path, options: dict[str, Any]) -> list[str]:
        job = self.job_args(out, options)
        if not self.dist:
            return [sys.executable, "-m", "ckptpilot.fit.job", *job]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(WORLD_SIZE), "--max-restarts", "0",
                "--monitor-interval", "0.2", "-m", "ckptpilot.fit.job", "--dist", *job]

    def spawn(self, label: str, **options: Any) -> Running:
        """Start a child; ``options`` are the job's flags (``fault="kill-write"``,
        ``at_step=25``, ``exit_after_restore=True`` …)."""
        out = self.dir / "out" / label
        out.mkdir(parents=True)
        # torchrun's rendezvous leaves a temp directory per run: keep it in the trial's.
        tmp = out / "tmp"
        tmp.mkdir()
        with open(out / "child.log", "wb") as log:
            proc = subprocess.Popen(self._command(out, options), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True,
                                    env={**os.environ, **self.extra_env, "TMPDIR": str(tmp)})
        return Running(label, out, proc, self.ranks, time.monotonic())

    def run(self, label: str, **options: Any) -> ChildRun:
        """Run a child to its end (or its time limit)."""
        done = self.spawn(label, **options).finish()
        self.runs.append(done)
        return done

    def adopt(self, child: ChildRun) -> None:
        """Count a child started with ``spawn`` among the trial's runs."""
        self.runs.append(child)

    def reached(self, rank: int = 0) -> int:
        """The highest step any run of this trial trained so far."""
        steps = [s for run in self.runs
                 for s, _ in read_losses(run.out / f"losses_rank{rank:05d}.txt")]
        return max(steps, default=0)

    def remote_outside(self) -> bool:
        """Whether the remote tier lives outside the run directory (a URL without
        ``{run_dir}``): then it is copied and removed on its own."""
        return not _inside(self.policy.tiers.remote.url, self.run_dir)

    def discard(self) -> None:
        """Remove the trial's directory and its remote tier."""
        if self.remote_outside():
            tier = self.remote()
            with contextlib.suppress(FileNotFoundError):
                tier.fs.rm(tier.root, recursive=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def compare(self, ref: Reference | None = None) -> tuple[bool, str]:
        """Whether every step trained by every run, and the final state, equal the
        reference (default: the harness's of this kind of job) bit for bit; else what
        differs first."""
        ref = self.harness.reference(dist=self.dist) if ref is None else ref
        for rank in range(self.ranks):
            want = ref.losses[rank]
            seen: set[int] = set()
            for run in self.runs:
                for step, value in read_losses(run.out / f"losses_rank{rank:05d}.txt"):
                    seen.add(step)
                    if want.get(step) != value:
                        why = (f"rank {rank}: the loss of step {step} in the {run.label} run "
                               f"is {float.fromhex(value)!r}, the reference's "
                               f"{_float(want.get(step))}")
                        restored = run.event("restored", rank)
                        if restored is not None and restored["source"] == "none":
                            why += (" although that run restored nothing: training under the "
                                    "pilot is not reproducible (did something consume the "
                                    "job's random state?)")
                        return False, why
            missing = sorted(set(want) - seen)
            if missing:
                return False, f"rank {rank}: steps {missing[:5]} were never trained"
            final = next((run.out / f"final_rank{rank:05d}" for run in reversed(self.runs)
                          if (run.out / f"final_rank{rank:05d}.json").exists()), None)
            if final is None:
                return False, f"rank {rank}: no run finished training"
            tensors = safetensors.torch.load_file(str(final) + ".safetensors")
            if tensors.keys() != ref.tensors[rank].keys():
                return False, f"rank {rank}: the final state holds other tensors"
            for key, tensor in ref.tensors[rank].items():
                if not _same_bits(tensor, tensors[key]):
                    return False, f"rank {rank}: final {key} differs from the reference"
            info = json.loads(Path(str(final) + ".json").read_text())
            for key, value in ref.info[rank].items():
                if info.get(key) != value:
                    return False, f"rank {rank}: final {key} differs from the reference"
        return True, "bit-exact"


def _float(hexed: str | None) -> str:
    return "(none)" if hexed is None else repr(float.fromhex(hexed))


def _inside(path: str, directory: Path) -> bool:
    try:
        Path(path).resolve().relative_to(directory.resolve())
    except ValueError:
        return False
    return True


class Harness:
    """Shared state of one fit run: the work directory, the user's policy, the reference
    runs (made on first use, one per job kind) and the peer daemons (started on first use)."""

    def __init__(self, work_dir: Path, policy: Policy, *, fit_id: str,
                 progress: Callable[[str], None]) -> None:
        self.work_dir = work_dir
        self._progress = progress
        self.policy = policy
        self.fit_id = fit_id
        self._template = yaml.safe_load(policy.to_yaml())
        self._references: dict[bool, Reference | HarnessError] = {}
        self._cluster: PeerCluster | None = None
        self._shared: dict[str, _Pristine | HarnessError] = {}
        self._current: Trial | None = None

    @property
    def policy_has_peers(self) -> bool:
        return self.policy.tiers.peer.enabled

    def peers(self) -> PeerCluster:
        """fit's own peer daemons, every one up and running: N data shards + parity + one
        spare, so that one can die and saves still land."""
        if self._cluster is None:
            peer = self.policy.tiers.peer
            self._cluster = PeerCluster(self.work_dir / "peers",
                                        peer.data_shards + int(peer.parity) + 1)
        self._cluster.revive()
        return self._cluster

    def trial(self, name: str, *, peers: bool, dist: bool = False) -> Trial:
        """A fresh trial for the scenario running now (see ``release``)."""
        self._current = Trial(self, name, peers=self.peers() if peers else None, dist=dist)
        return self._current

    def begin(self, trial: Trial) -> Trial:
        """Make ``trial`` (built by the caller) the one running now (see ``release``)."""
        self._current = trial
        return trial

    def write_policy(self, path: Path, run_dir: Path, name: str,
                     peers: PeerCluster | None) -> Policy:
        data = json.loads(json.dumps(self._template))
        data["run_dir"] = str(run_dir)
        sched = data["scheduler"]
        sched["base_interval"] = INTERVAL
        sched["min_interval"] = min(sched["min_interval"], INTERVAL)
        sched["max_interval"] = max(sched["max_interval"], INTERVAL)
        remote = data["tiers"]["remote"]
        if "{run_dir}" not in remote["url"]:
            remote["url"] = f"{remote['url'].rstrip('/')}/fit-{self.fit_id}/{name}"
        peer = data["tiers"]["peer"]
        if peers is not None:
            peer.update(enabled=True, endpoints=peers.endpoints, registry=None,
                        secret_file=str(peers.secret_file))
        else:
            peer["enabled"] = False
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return load_policy(path)

    def shared(self, key: str, make: Callable[[Trial], None]) -> Trial:
        """A trial (without peers) in the state ``make`` brought it to: made once, then
        restored from a pristine copy for every later scenario that asks. Always at the same
        paths, so that what the run recorded (absolute locations) stays true."""
        found = self._shared.get(key)
        if isinstance(found, HarnessError):
            raise found
        if found is None:
            trial = self.trial(key, peers=False)
            try:
                make(trial)
            except HarnessError as e:
                self._shared[key] = e
                raise
            found = _Pristine(trial, self.work_dir / f".pristine-{key}")
            self._shared[key] = found
            return trial
        self._current = found.restore()
        return self._current

    def release(self, name: str, *, keep: bool) -> Path | None:
        """End the scenario ``name``: keep its trial's directory as ``<work>/<name>`` (the
        path is returned), or remove it."""
        trial, self._current = self._current, None
        if trial is None or not trial.dir.exists():
            return None
        if not keep:
            trial.discard()
            return None
        target = self.work_dir / name
        if trial.dir != target:
            trial.dir.rename(target)
        return target

    def reference(self, *, dist: bool) -> Reference:
        """The uninterrupted run of this kind of job, made on first use."""
        found = self._references.get(dist)
        if found is None:
            t0 = time.monotonic()
            found = self._make_reference(dist)
            self._references[dist] = found
            what = f"{WORLD_SIZE} ranks under torchrun" if dist else "one process"
            self._progress(f"reference: {STEPS} steps, {what}, uninterrupted: "
                           f"{'failed' if isinstance(found, HarnessError) else 'done'} in "
                           f"{time.monotonic() - t0:.1f} s")
        if isinstance(found, HarnessError):
            raise found
        return found

    def _make_reference(self, dist: bool) -> Reference | HarnessError:
        trial = Trial(self, "reference-dist" if dist else "reference", peers=None, dist=dist)
        run = trial.run("uninterrupted")
        if run.returncode != 0 or any(run.event("done", r) is None for r in range(run.ranks)):
            return HarnessError(f"the uninterrupted reference run failed: {run.describe()}")
        return load_reference(run.out, run.ranks, STEPS)

    def close(self, *, keep: bool) -> None:
        """Stop the peer daemons; remove the pristine copies unless ``keep``."""
        if self._cluster is not None:
            self._cluster.close()
        if not keep:
            for found in self._shared.values():
                if isinstance(found, _Pristine):
                    found.discard()


class _Pristine:
    """A copy of a trial's directory (and remote tier) taken right after it was made."""

    def __init__(self, trial: Trial, path: Path) -> None:
        self.trial = trial
        self.path = path
        self.runs = list(trial.runs)
        shutil.copytree(trial.dir, path / "trial")
        if trial.remote_outside():
            tier = trial.remote()
            tier.fs.copy(tier.root, self._remote_copy(tier), recursive=True)

    @staticmethod
    def _remote_copy(tier: RemoteTier) -> str:
        return tier.root.rstrip("/") + ".pristine"

    def restore(self) -> Trial:
        self.trial.discard()
        shutil.copytree(self.path / "trial", self.trial.dir)
        if self.trial.remote_outside():
            tier = self.trial.remote()
            tier.fs.rm(tier.root, recursive=True)
            tier.fs.copy(self._remote_copy(tier), tier.root, recursive=True)
        self.trial.runs = list(self.runs)
        return self.trial

    def discard(self) -> None:
        if self.trial.remote_outside():
            tier = RemoteTier(self.trial.policy.tiers.remote.url,
                              self.trial.policy.tiers.remote.storage_options)
            with contextlib.suppress(FileNotFoundError):
                tier.fs.rm(self._remote_copy(tier), recursive=True)
        shutil.rmtree(self.path, ignore_errors=True)
