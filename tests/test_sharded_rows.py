"""The rows every rank shares on the sharded tier, under the orders of events the ranks do not
control: a restore right after a save, while another rank's writer still publishes its row.

Real gloo ranks (``test_sharded``'s job pieces). Where an order must happen for the test to
mean anything, the job waits for an observable sign of it (a file another rank writes), never
for a time; the waits have a deadline only as a safety net."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from test_sharded import (
    BATCH,
    JOIN_SECONDS,
    POLICY,
    SAMPLES,
    SEED,
    _build,
    _mesh,
    _pilot,
    _run,
    _statuses,
    _step,
    _write,
)

from ckptpilot.agreement import RankAgreement
from ckptpilot.sampler import ResumableSampler
from ckptpilot.tiers.sharded import ShardedTier
from ckptpilot.vocab import Status

SAVED = 2  # the step saved right before the restore


def _wait_for(path: Path, why: str) -> None:
    deadline = time.monotonic() + JOIN_SECONDS  # a safety net, never a speed assertion
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} never appeared: {why}")
        time.sleep(0.01)


def _restore_after_save_job(rank: int, world: int, port: int, out: Path) -> None:
    """Saves step 2 and restores at once, every rank. Rank 1's writer publishes its row
    only once rank 0 has reached the restore's first vote: before the fix, rank 0 had
    settled by then (finding rank 1's row ``pending`` of a published step), and rank 1's
    own publication of that row failed, so the restore failed on every rank."""
    mesh = _mesh(rank, world, port)
    model, opt, sched = _build(mesh)
    sampler = ResumableSampler(SAMPLES, seed=SEED, num_replicas=world, rank=rank)
    pilot = _pilot(out, model, opt, sched, sampler)
    assert pilot.restore() == 0
    voting = out / "rank0_voting"
    if rank == 0:
        vote = RankAgreement.vote

        def vote_and_say_so(self: RankAgreement, value: int) -> int:
            voting.touch()
            return vote(self, value)

        RankAgreement.vote = vote_and_say_so  # type: ignore[method-assign]
    else:
        publish = ShardedTier.publish

        def publish_late(self: ShardedTier, staged: Any) -> Any:
            receipt = publish(self, staged)
            _wait_for(voting, "rank 0 never reached the restore's vote")
            return receipt

        ShardedTier.publish = publish_late  # type: ignore[method-assign]
    for _ in range(SAVED):
        pilot.observe(_step(model, opt, sched, sampler.take(BATCH)))
    assert pilot.save()
    restored = pilot.restore()
    _write(out / f"restored_{rank}.json", {"step": restored,
                                           "saves": [s.step for s in pilot.saves]})
    pilot.close(save=False)
    dist.destroy_process_group()


def test_a_restore_right_after_a_save_waits_for_every_ranks_row_before_settling(
        tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text(POLICY)
    _run(_restore_after_save_job, 2, tmp_path)

    results = [json.loads((tmp_path / f"restored_{r}.json").read_text()) for r in range(2)]
    assert results == [{"step": SAVED, "saves": [SAVED]}] * 2
    assert (tmp_path / "rank0_voting").exists()
    statuses = _statuses(tmp_path)
    assert {statuses[SAVED, r] for r in range(2)} == {Status.VALID}
