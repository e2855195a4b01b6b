"""The campaign's vocabulary: an incident, what its action sees and destroys, which step a
restart must restore, and the torchrun trial it runs in. ``incidents.py`` defines the
incidents with these; ``campaign.py`` runs and judges them."""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from ckptpilot.fit.checks import Needs, ScenarioSkipped
from ckptpilot.fit.harness import Harness, Trial
from ckptpilot.policy import load_policy

STEPS = 40
QUIET_STEP = 24  # the quiet point: after the save of step 20 under fit's 10-step interval
FAULT_STEP = QUIET_STEP + 1  # in-save faults hit the first save after the quiet point
QUIET_WAIT_SECONDS = 300.0  # a safety net: the ranks get there in seconds
MONITOR_INTERVAL_SECONDS = 0.2
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""With the agent's store shared (torch's default since 2.5), a restarted rank can read the
previous start's gloo/NCCL addresses from it and fail to connect (pytorch/pytorch#135712):
each start gets a store of its own."""
REFERENCE = "reference-torchrun"


class Expect(str, Enum):
    """Which step the restart must restore."""

    QUIET = "newest common at the quiet point"  # minus what the incident destroyed
    FAULTED = "the step the faulted rank died in"  # it died after every rank published it
    EXITED = "newest common when the ranks exited"  # through the pilot, with exit_code
    PUBLISHED = "newest published on every rank when the job ended"  # read between launches


@dataclass
class Damage:
    """What the parent's action did: a description, the (rank, step, tier) copies it
    destroyed, and the tiers it took down as a whole."""

    what: str
    lost: frozenset[tuple[int, int, str]] = frozenset()
    lost_tiers: frozenset[str] = frozenset()
    notes: list[str] = field(default_factory=list)  # what the judging learnt of the incident


@dataclass
class Scene:
    """What an incident's action sees at the quiet point: the trial and each rank's quiet
    report (``pid``, ``saves``)."""

    harness: Harness
    trial: CampaignTrial
    quiet: dict[int, dict[str, Any]]
    agent_pid: int  # the torchrun process

    @property
    def ranks(self) -> int:
        return self.trial.ranks

    def newest(self, rank: int, tier: str = "remote", *, before: int | None = None) -> int:
        """The newest valid save of ``rank`` on ``tier`` (older than ``before``)."""
        steps = [s["step"] for s in self.quiet[rank]["saves"]
                 if s["status"] == "valid" and s["tier"] == tier
                 and (before is None or s["step"] < before)]
        if not steps:
            raise ScenarioSkipped(f"rank {rank} completed no save on the {tier} tier "
                                  f"{'before step ' + str(before) if before else ''} by step "
                                  f"{QUIET_STEP}")
        return max(steps)

    def kill(self, *ranks: int, sig: int = signal.SIGKILL) -> None:
        for rank in ranks:
            os.kill(self.quiet[rank]["pid"], sig)


Act = Callable[[Scene], Damage]


@dataclass(frozen=True)
class Incident:
    """One row of the campaign: the child's fault options (``job``), the parent's action at
    the quiet point (``act``), and what the outcome must be."""

    name: str
    fault: str
    passes: str
    job: dict[str, Any] = field(default_factory=dict)
    act: Act | None = None
    needs: Needs = Needs.DIST
    restarts: int = 1  # torchrun's --max-restarts: the restarts the incident causes
    relaunch: bool = False  # the incident stops the agent: the job is launched again
    refusals: int = 0  # the first restarts in which every rank must refuse to restore
    expect: Expect = Expect.QUIET
    lost_tiers: frozenset[str] = frozenset()
    policy: dict[str, Any] = field(default_factory=dict)  # overrides, e.g. pulses fsynced
    exit_code: int | None = None  # Expect.EXITED: the status every rank exits with
    ledger_cause: str | None = None  # the cause of the stop record the ranks' ledgers hold
    ledger_ranks: tuple[int, ...] = ()  # the ranks that must record it (empty: every rank)
    logged: str | None = None  # what the pilot of each of those ranks logs as it exits


def free_port() -> int:
    """A port on 127.0.0.1 the kernel just gave out, for torchrun's rendezvous store."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _merge(data: dict[str, Any], overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        if isinstance(value, dict):
            _merge(data.setdefault(key, {}), value)
        else:
            data[key] = value


class CampaignTrial(Trial):
    """A trial whose one child is a torchrun job of ``nproc`` ranks restarted up to
    ``max_restarts`` times by its agent; the starts share ``out`` (events carry their start)."""

    extra_env = TORCHRUN_ENV

    def __init__(self, harness: Harness, name: str, *, nproc: int, max_restarts: int,
                 peers: bool, policy: dict[str, Any]) -> None:
        super().__init__(harness, name, peers=harness.peers() if peers else None, dist=True)
        self.nproc = nproc
        self.max_restarts = max_restarts
        if policy:
            data = yaml.safe_load(self.policy_path.read_text())
            _merge(data, policy)
            self.policy_path.write_text(yaml.safe_dump(data, sort_keys=False))
            self.policy = load_policy(self.policy_path)

    @property
    def ranks(self) -> int:
        return self.nproc

    def _command(self, out: Path, options: dict[str, Any]) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                "--nproc-per-node", str(self.nproc), "--max-restarts", str(self.max_restarts),
                "--monitor-interval", str(MONITOR_INTERVAL_SECONDS), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", self.name,
                "-m", "ckptpilot.fit.job", "--dist",
                *self.job_args(out, options, steps=STEPS)]
