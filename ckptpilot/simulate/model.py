"""The discrete-event model of a G-GPU job that checkpoints, fails and recovers.

This module owns :func:`simulate` (the event loop), :class:`Outcome` (where the wall time
went) and the pure rules it applies: :func:`peer_restore_kind` (the parity-group rule) and
the choice of the restore source. It takes its costs (:class:`TierCosts`), its saves
(:class:`Schedule`) and its failures (a :class:`FailureModel` with a seed, or a list of
:class:`Failure`) as data, and does no I/O.

The loop. The job trains; at each save point of the schedule it stalls for the snapshot,
and the save becomes durable on its tier (pulse → peers, organ → remote) after the tier's
time to durable, in a background pipeline per tier with at most ``max_pending`` saves in
flight (a save due while the pipeline is full stalls until the oldest is durable). A failure
at wall time t rolls the job back to the newest checkpoint durable by t that survives the
failure: a remote one always; a peer one unless a parity group lost two or more of its nodes
since it was written (one lost node is rebuilt from parity: the slower
``peer_rebuild_seconds``). Process crashes and hangs leave every peer shard in place; a
preemption first tries an emergency save inside its notice. Down time is the relaunch, plus
the detection timeout after a hang, plus a node swap after a node loss, plus the restore.
A failure that would fall in down time is drawn from the end of it (the renewal restarts).

Accounting, exact by construction: ``wall = productive + overhead + Σ lost work + Σ down``,
productive being the progress the job holds at the end, overhead every stall, lost work the
training rolled back, and down the time without training.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ckptpilot.simulate.costs import TierCosts
from ckptpilot.simulate.failures import Failure, FailureKind, FailureModel
from ckptpilot.simulate.schedules import SaveLevel, Schedule

__all__ = ["Outcome", "ettr_ceiling", "peer_restore_kind", "simulate"]

_PEER, _REMOTE = "peer", "remote"


@dataclass
class _Checkpoint:
    progress: float
    tier: str
    written_at: float
    durable_at: float


@dataclass
class Outcome:
    """Where a simulated job's wall time went, in seconds; counts by kind and source."""

    gpus: int
    wall_seconds: float
    productive_seconds: float = 0.0
    overhead_seconds: float = 0.0
    lost_work_seconds: dict[str, float] = field(default_factory=dict)
    down_seconds: dict[str, float] = field(default_factory=dict)
    failures: Counter[str] = field(default_factory=Counter)
    restores: Counter[str] = field(default_factory=Counter)
    saves: Counter[str] = field(default_factory=Counter)
    kept_stalls: list[float] = field(default_factory=list)
    """The stall of each save of the final timeline (saves in rolled-back work left out):
    what a run's records hold, one row per step."""

    @property
    def ettr(self) -> float:
        """Effective training time ratio: productive time over wall time."""
        return self.productive_seconds / self.wall_seconds

    @property
    def lost_seconds(self) -> float:
        return sum(self.lost_work_seconds.values()) + sum(self.down_seconds.values())

    def lost_gpu_hours_by_cause(self) -> dict[str, float]:
        """Rolled-back work + down time of each failure kind, and the stalls, in GPU-hours."""
        causes = sorted(set(self.lost_work_seconds) | set(self.down_seconds))
        hours = {c: (self.lost_work_seconds.get(c, 0.0) + self.down_seconds.get(c, 0.0))
                 * self.gpus / 3600 for c in causes}
        hours["checkpoint_overhead"] = self.overhead_seconds * self.gpus / 3600
        return hours

    @property
    def mean_recovery_seconds(self) -> float:
        """Mean down time per failure (relaunch, detection, swap, restore)."""
        n = sum(self.failures.values())
        return sum(self.down_seconds.values()) / n if n else 0.0


def peer_restore_kind(lost_nodes: Iterable[int], group_size: int) -> str | None:
    """Whether the peer tier still holds a checkpoint whose holders lost ``lost_nodes``.

    Nodes ``k·group_size … (k+1)·group_size − 1`` hold one parity group (N data shards + 1
    parity). Returns ``"intact"`` with no node lost, ``"rebuild"`` when every group lost at
    most one (its shard is rebuilt from the others) and None when a group lost two or more:
    the checkpoint must come from the remote tier.
    """
    per_group = Counter(node // group_size for node in set(lost_nodes))
    if not per_group:
        return "intact"
    return "rebuild" if max(per_group.values()) < 2 else None


def ettr_ceiling(costs: TierCosts, failures: FailureModel) -> float:
    """The ETTR of this job if its checkpoints cost nothing and lost nothing: every failure
    still takes the relaunch, a hang its detection and a lost node its swap (the model's own
    charges, restore aside), and failures are counted from the end of each recovery, so a
    failure's mean cycle is ``mtbf_seconds`` of training and that down time. No checkpoint
    policy can pass it: a goal above it asks something of the cluster, not of checkpointing."""
    down = costs.relaunch_seconds
    down += failures.mix.get(FailureKind.HANG, 0.0) * costs.hang_detect_seconds
    takes_nodes = (failures.mix.get(FailureKind.NODE_LOSS, 0.0)
                   + failures.mix.get(FailureKind.PREEMPTION, 0.0))
    down += takes_nodes * costs.node_replace_seconds
    return failures.mtbf_seconds / (failures.mtbf_seconds + down)


class _Run:
    """One job's state while the loop runs; the methods are the loop's steps."""

    def __init__(self, costs: TierCosts, schedule: Schedule, *, peer: bool, max_pending: int,
                 horizon: float) -> None:
        if peer and costs.nodes < costs.group_size:
            raise ValueError(f"the peer tier needs {costs.group_size} nodes (N data shards + 1 "
                             f"parity), the job has {costs.nodes}")
        self.costs, self.schedule, self.peer = costs, schedule, peer
        self.max_pending, self.horizon = max_pending, horizon
        self.out = Outcome(gpus=costs.gpus, wall_seconds=horizon)
        self.t = 0.0
        self.progress = 0.0
        self.newest: dict[str, _Checkpoint] = {}
        self.pending: dict[str, deque[_Checkpoint]] = {_PEER: deque(), _REMOTE: deque()}
        self.node_losses: list[tuple[float, tuple[int, ...]]] = []
        self.timeline: list[tuple[float, float]] = []  # (progress, stall) of each save
        self._restart_schedule()

    def _restart_schedule(self) -> None:
        self.first_save = True
        self.plan = self.schedule.play()
        self._next_save()

    def _next_save(self) -> None:
        gap, self.level = next(self.plan)
        self.save_at = self.progress + gap

    def _settle(self, tier: str, now: float) -> None:
        queue = self.pending[tier]
        while queue and queue[0].durable_at <= now:
            self.newest[tier] = queue.popleft()

    def train_until(self, limit: float) -> None:
        """Train and save until wall time ``limit`` (a failure or the horizon)."""
        c = self.costs
        while True:
            dt = self.save_at - self.progress
            if self.t + dt >= limit:
                self.progress += limit - self.t
                self.t = limit
                return
            self.t += dt
            self.progress = self.save_at
            tier = _PEER if self.level is SaveLevel.PULSE else _REMOTE
            stall, durable = ((c.pulse_stall_seconds, c.peer_durable_seconds) if tier == _PEER
                              else (c.organ_stall_seconds, c.remote_durable_seconds))
            self._settle(tier, self.t)
            queue = self.pending[tier]
            wait = queue[0].durable_at - self.t if len(queue) >= self.max_pending else 0.0
            if self.t + wait + stall >= limit:
                self.out.overhead_seconds += limit - self.t
                self.t = limit
                return
            self.t += wait + stall
            self.out.overhead_seconds += wait + stall
            start = max(self.t, queue[-1].durable_at) if queue else self.t
            if self.first_save:
                durable += c.first_save_extra_seconds
                self.first_save = False
            queue.append(_Checkpoint(self.progress, tier, self.t - stall,
                                     start + durable - stall))
            self.out.saves[tier] += 1
            self.timeline.append((self.progress, wait + stall))
            self._next_save()

    def _emergency_save(self, failure: Failure) -> None:
        """A preemption's notice: save now if the whole save fits in it, to the tier it fits."""
        c = self.costs
        options = [(_REMOTE, c.organ_stall_seconds, c.remote_durable_seconds)]
        if self.peer:
            options.insert(0, (_PEER, c.pulse_stall_seconds, c.peer_durable_seconds))
        for tier, stall, durable in options:
            self._settle(tier, self.t)
            backlog = max((p.durable_at for p in self.pending[tier]), default=self.t) - self.t
            if backlog + durable <= c.preemption_notice_seconds:
                taken = min(stall, self.horizon - self.t)
                self.t += taken
                self.out.overhead_seconds += taken
                self.pending[tier].append(_Checkpoint(self.progress, tier, self.t - taken,
                                                      self.t - taken + backlog + durable))
                self.out.saves[tier] += 1
                return

    def _restore_point(self, failure: Failure, ready_at: float) -> tuple[_Checkpoint | None, str]:
        for tier in (_PEER, _REMOTE):
            self._settle(tier, ready_at)
            self.pending[tier].clear()
        best: tuple[_Checkpoint | None, str] = (None, "none")
        remote = self.newest.get(_REMOTE)
        if remote is not None:
            best = (remote, "remote")
        peer = self.newest.get(_PEER)
        if peer is not None:
            lost = [n for at, nodes in self.node_losses if at >= peer.written_at for n in nodes]
            kind = peer_restore_kind(lost, self.costs.group_size)
            if kind is not None and (best[0] is None or peer.progress >= best[0].progress):
                best = (peer, "peer" if kind == "intact" else "peer_rebuild")
            if kind is None:
                del self.newest[_PEER]
        return best

    def fail(self, failure: Failure) -> None:
        """Roll back to the best surviving checkpoint and charge the down time."""
        c, out = self.costs, self.out
        kind = failure.kind.value
        out.failures[kind] += 1
        if failure.kind is FailureKind.PREEMPTION:
            self._emergency_save(failure)
        ready_at = (self.t + c.preemption_notice_seconds
                    if failure.kind is FailureKind.PREEMPTION else self.t)
        if failure.nodes:
            self.node_losses.append((self.t, failure.nodes))
        checkpoint, source = self._restore_point(failure, ready_at)
        restored = checkpoint.progress if checkpoint is not None else 0.0
        out.restores[source] += 1
        out.lost_work_seconds[kind] = out.lost_work_seconds.get(kind, 0.0) + (
            self.progress - restored)
        down = c.relaunch_seconds + {
            "peer": c.peer_restore_seconds, "peer_rebuild": c.peer_rebuild_seconds,
            "remote": c.remote_restore_seconds, "none": 0.0}[source]
        if failure.kind is FailureKind.HANG:
            down += c.hang_detect_seconds
        if failure.nodes:
            down += c.node_replace_seconds
        down = min(down, self.horizon - self.t)
        out.down_seconds[kind] = out.down_seconds.get(kind, 0.0) + down
        self.t += down
        self.progress = restored
        self.timeline = [(p, st) for p, st in self.timeline if p <= restored]
        keep_from = min((ck.written_at for ck in self.newest.values()), default=self.t)
        self.node_losses = [(at, n) for at, n in self.node_losses if at >= keep_from]
        self._restart_schedule()


def simulate(costs: TierCosts, schedule: Schedule, failures: FailureModel | Sequence[Failure],
             *, horizon_seconds: float, peer: bool, seed: int = 0,
             max_pending: int = 2) -> Outcome:
    """Run one job for ``horizon_seconds`` of wall time; see the module docstring.

    ``failures`` is a model (gaps drawn with ``random.Random(seed)``, each counted from the
    end of the previous recovery) or an explicit list in wall-time order (one that falls in
    down time strikes when the job is back). The same inputs give the same outcome.
    """
    if horizon_seconds <= 0:
        raise ValueError(f"horizon_seconds must be positive, got {horizon_seconds}")
    run = _Run(costs, schedule, peer=peer, max_pending=max_pending, horizon=horizon_seconds)
    rng = random.Random(seed)
    given = iter(failures) if not isinstance(failures, FailureModel) else None
    while run.t < horizon_seconds:
        if given is None:
            assert isinstance(failures, FailureModel)
            at = run.t + failures.gap_seconds(rng)
            failure = failures.draw(at, costs.nodes, rng) if at < horizon_seconds else None
        else:
            failure = next(given, None)
            if failure is not None and failure.at_seconds < run.t:
                failure = Failure(run.t, failure.kind, failure.nodes)
        run.train_until(horizon_seconds if failure is None else
                        min(failure.at_seconds, horizon_seconds))
        if failure is None or run.t >= horizon_seconds:
            break
        run.fail(failure)
    run.out.productive_seconds = run.progress
    run.out.kept_stalls = [st for _, st in run.timeline]
    return run.out
