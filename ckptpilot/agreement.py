"""How the ranks of a distributed run agree: on each step's signals, and on what to restore.

This module owns :class:`RankAgreement`, the pilot's only collectives. Per step, one tiny
non-blocking all-reduce (element-wise max of the signals and costs, whether any rank got a
preemption notice, and the earliest spike onset any rank confirmed) is started at step t and
consumed at step t + 1, so all ranks take the same decision without a barrier; a policy whose
extra signals combine by sum adds a second one, for those. Which signals there are, and how
each combines, is the scheduler's :class:`~ckptpilot.scheduler.signal.SignalLayout`: nothing
here names a signal. At restore,
one all-gather of each rank's newest candidate steps and one all-reduce (minimum) per step
tried, so every rank loads the same step or every rank raises.

It must not decide anything: it only combines what each rank brings. Threading: the training
thread only (collectives are issued in the same order on every rank).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ckptpilot.errors import CkptPilotError
from ckptpilot.scheduler.signal import SignalLayout
from ckptpilot.scheduler.spike import Spike

__all__ = ["COST_KEYS", "AnotherRankFailed", "RankAgreement", "process_rank_world"]

COST_KEYS = ("save_seconds", "mtbf_seconds", "step_seconds")
"""The scheduler's cost model, agreed as the max over ranks (the slowest rank sets the pace)."""

_NO_ONSET = -1e18  # the agreed "minus onset" of a step where no rank confirmed a spike
_FAILED = -2  # sent instead of a step by a rank whose restore planning raised
_AGREE_STEPS = 32  # candidates per rank exchanged at restore (a walk tries at most ~12)


class AnotherRankFailed(CkptPilotError, RuntimeError):
    """Raised on every rank whose own restore went fine when another rank's raised: all
    ranks stop together rather than one resuming alone or waiting in a collective."""


def process_rank_world() -> tuple[int, int]:
    """This process's rank and the world size; (0, 1) without a process group."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def collective_device() -> torch.device:
    """Where the small agreement tensors live: NCCL reduces only CUDA tensors; gloo, and a
    group with a CPU backend beside NCCL (``cpu:gloo,cuda:nccl``), CPU ones."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class RankAgreement:
    """The collectives of one rank; ``world_size > 1`` and an initialised process group."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._device = collective_device()
        self._buffer: torch.Tensor | None = None
        self._work: Any = None
        self._summed: torch.Tensor | None = None  # the pending sum, for signals that add up
        self._summed_work: Any = None
        self._local_spike: tuple[int, str] | None = None  # sent in the pending reduction
        self.notice = False  # whether any rank had a preemption notice at the step taken last

    # -- per step --------------------------------------------------------------------------

    def start(self, layout: SignalLayout, signals: Mapping[str, float],
              costs: Mapping[str, float | None], spike: Spike | None,
              notice: bool = False) -> None:
        """Start this step's reduction of ``signals`` (keyed as ``layout`` says, the same on
        every rank) and of this rank's preemption ``notice``; :meth:`take` consumes it at the
        next step."""
        values = [signals[k] for k in layout.maxed]
        values += [-1.0 if costs[k] is None else float(costs[k]) for k in COST_KEYS]  # type: ignore[arg-type]
        values.append(1.0 if notice else 0.0)
        values.append(_NO_ONSET if spike is None else -float(spike.onset))
        self._local_spike = None if spike is None else (spike.onset, spike.reason)
        self._buffer = torch.tensor(values, dtype=torch.float64, device=self._device)
        self._work = torch.distributed.all_reduce(
            self._buffer, op=torch.distributed.ReduceOp.MAX, async_op=True)
        if layout.summed:
            self._summed = torch.tensor([signals[k] for k in layout.summed],
                                        dtype=torch.float64, device=self._device)
            self._summed_work = torch.distributed.all_reduce(
                self._summed, op=torch.distributed.ReduceOp.SUM, async_op=True)

    def take(self, layout: SignalLayout
             ) -> tuple[dict[str, float], dict[str, float | None], tuple[int, str] | None]:
        """The previous step's signals combined over ranks (the max, or the sum for the keys
        ``layout`` sums), the max of its costs, and the earliest onset of a spike any rank
        confirmed then (zeros and no spike right after a start, a restore or :meth:`drop`,
        on every rank alike); :attr:`notice` says whether any rank had a preemption notice."""
        n = len(layout.maxed)
        m = n + len(COST_KEYS)
        self.notice = False
        if self._work is None:
            return (dict.fromkeys(layout.maxed + layout.summed, 0.0), dict.fromkeys(COST_KEYS),
                    None)
        self._work.wait()
        agreed = self._buffer.tolist()  # type: ignore[union-attr]
        signals = dict(zip(layout.maxed, agreed[:n], strict=True))
        if self._summed_work is not None:
            self._summed_work.wait()
            signals.update(zip(layout.summed, self._summed.tolist(), strict=True))  # type: ignore[union-attr]
        costs = {k: (v if v > 0 else None) for k, v in zip(COST_KEYS, agreed[n:m], strict=True)}
        self.notice = agreed[m] > 0
        spike = None
        if agreed[m + 1] > _NO_ONSET:
            onset = int(-agreed[m + 1])
            mine = self._local_spike
            spike = (onset, mine[1] if mine is not None and mine[0] == onset
                     else f"a loss spike since step {onset} on another rank")
        return signals, costs, spike

    def drop(self) -> None:
        """Finish and discard the pending reduction (every rank does, at the same step)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._summed_work is not None:
            self._summed_work.wait()
            self._summed_work = None

    # -- restore ---------------------------------------------------------------------------

    def common_steps(self, steps: list[int], failure: BaseException | None) -> list[int]:
        """The steps (newest first) that every rank has a source for: one all-gather of each
        rank's newest few candidates, so all ranks walk the same list. A rank whose planning
        raised sends a mark instead, and every rank raises."""
        local = (steps[:_AGREE_STEPS] + [-1] * _AGREE_STEPS)[:_AGREE_STEPS]
        if failure is not None:
            local[0] = _FAILED
        mine = torch.tensor(local, dtype=torch.int64, device=self._device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        torch.distributed.all_gather(every, mine)
        failed = [rank for rank, t in enumerate(every) if int(t[0]) == _FAILED]
        self.raise_if_failed(-1 if failed else 1, failure,
                             f"planning on rank(s) {', '.join(map(str, failed))}")
        common = set.intersection(*({s for s in t.tolist() if s >= 0} for t in every))
        return sorted(common, reverse=True)

    def vote(self, value: int) -> int:
        """The minimum over ranks of ``value`` (1 yes, 0 no, -1 this rank failed)."""
        flag = torch.tensor([value], dtype=torch.int64, device=self._device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return int(flag.item())

    def raise_if_failed(self, vote: int, failure: BaseException | None, where: str) -> None:
        if failure is not None:
            raise failure
        if vote < 0:
            raise AnotherRankFailed(
                f"rank {self.rank}: another rank failed while restoring ({where}; its log "
                "says why); every rank stops so that none resumes alone")
