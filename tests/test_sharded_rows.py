"""The rows every rank shares on the sharded tier, under the orders of events the ranks do not
control: a restore right after a save, while another rank's writer still publishes its row.

Real gloo ranks (``test_sharded``'s job pieces). Where an order must happen for the test to
mean anything, the job waits for an observable sign of it (a file another rank writes), never
for a time; the waits have a deadline only as a safety net."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from test_sharded import (
    BATCH,
    JOIN_SECONDS,
    POLICY,
    SAMPLES,
    SEED,
    _assert_bit_equal,
    _build,
    _full,
    _mesh,
    _pilot,
    _run,
    _statuses,
    _step,
    _write,
)

from ckptpilot.agreement import RankAgreement
from ckptpilot.assembly import sharded_tier
from ckptpilot.catalog import Catalog
from ckptpilot.cli import main as cli_main
from ckptpilot.dcp import Writer as DcpWriter
from ckptpilot.dcp import dcp_name
from ckptpilot.dcp.storage import read_manifest
from ckptpilot.errors import CheckpointWriteError
from ckptpilot.policy import Policy
from ckptpilot.rundir import lineage_path
from ckptpilot.sampler import ResumableSampler
from ckptpilot.storage.lineage import read_lineage
from ckptpilot.tiers.base import CheckpointImage
from ckptpilot.tiers.remote.store import RemoteTier
from ckptpilot.tiers.sharded import ShardedTier
from ckptpilot.tiers.sharded import tier as tier_module
from ckptpilot.vocab import Level, RetentionClass, Status

SAVED = 2  # the step saved right before the restore


def _wait_for(path: Path, why: str) -> None:
    deadline = time.monotonic() + JOIN_SECONDS  # a safety net, never a speed assertion
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} never appeared: {why}")
        time.sleep(0.01)


def _restore_after_save_job(rank: int, world: int, port: int, out: Path, how: str) -> None:
    """Saves step 2 and restores at once, every rank: ``restore()``, or the restore an
    instability rollback makes (the newest step below 3). Rank 1's writer publishes its row
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
    restored = pilot.restore() if how == "restore" else pilot._restore_before(SAVED + 1)
    _write(out / f"restored_{rank}.json", {"step": restored,
                                           "saves": [s.step for s in pilot.saves]})
    pilot.close(save=False)
    dist.destroy_process_group()


@pytest.mark.parametrize("how", ["restore", "rollback"])
def test_a_restore_right_after_a_save_waits_for_every_ranks_row_before_settling(
        tmp_path: Path, how: str) -> None:
    (tmp_path / "policy.yaml").write_text(POLICY)
    _run(_restore_after_save_job, 2, tmp_path, how)

    results = [json.loads((tmp_path / f"restored_{r}.json").read_text()) for r in range(2)]
    assert results == [{"step": SAVED, "saves": [SAVED]}] * 2
    assert (tmp_path / "rank0_voting").exists()
    statuses = _statuses(tmp_path)
    assert {statuses[SAVED, r] for r in range(2)} == {Status.VALID}


# -- a restore without rows: the commit file says which continuation each part is on ----------


def _continuation_job(rank: int, world: int, port: int, out: Path, phase: str) -> None:
    """``first``: saves steps 2 and 4. ``fork``: restores step 2 (a new continuation, step 4
    abandoned) and saves step 3 on it. ``restore``: restores, and leaves the step, what
    was skipped, and the state checked against step 3's when it is step 3; ``flaky``: the
    same, rank 1 reading a changed commit file of step 4."""
    mesh = _mesh(rank, world, port)
    model, opt, sched = _build(mesh)
    sampler = ResumableSampler(SAMPLES, seed=SEED, num_replicas=world, rank=rank)
    pilot = _pilot(out, model, opt, sched, sampler)
    if phase == "first":
        assert pilot.restore() == 0
        for step in range(1, 5):
            pilot.observe(_step(model, opt, sched, sampler.take(BATCH)))
            if step in (2, 4):
                assert pilot.save()
                pilot.flush()
    elif phase == "fork":
        assert pilot.restore(2) == 2
        pilot.observe(_step(model, opt, sched, sampler.take(BATCH)))
        assert pilot.save()
        pilot.flush()
        full = _full(model, opt)
        if rank == 0:
            safetensors.torch.save_file(full, out / "full_3.safetensors")
    else:
        if phase == "flaky" and rank == 1:  # this rank's storage returns a wrong commit file
            read_bytes = RemoteTier.read_bytes

            def read_bytes_changed(self: RemoteTier, relpath: str) -> bytes:
                data = read_bytes(self, relpath)
                if relpath == f"{dcp_name(4)}/manifest.json":
                    changed = data.replace(b'"reason": "manual"', b'"reason": "manuaL"')
                    assert changed != data
                    return changed
                return data

            RemoteTier.read_bytes = read_bytes_changed  # type: ignore[method-assign]
        restored = pilot.restore()
        report = pilot.last_recovery
        assert report is not None
        full = _full(model, opt)
        if restored == 3:
            _assert_bit_equal(full, safetensors.torch.load_file(out / "full_3.safetensors"))
        _write(out / f"restored_{rank}.json", {
            "step": restored, "skipped": [[s.location, s.reason] for s in report.skipped]})
    pilot.close(save=False)
    dist.destroy_process_group()


def test_a_lost_database_restores_the_newest_step_of_the_current_continuation(
        tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text(POLICY)
    run = tmp_path / "run"
    _run(_continuation_job, 2, tmp_path, "first")
    _run(_continuation_job, 2, tmp_path, "fork")
    manifest = read_manifest(RemoteTier(str(run / "checkpoints")), dcp_name(3))
    assert manifest["branches"] == {str(r): read_lineage(lineage_path(run, r)).current
                                    for r in range(2)}
    assert "branches" not in read_manifest(RemoteTier(str(run / "checkpoints")), dcp_name(2))
    # (Step 4's directory went with its abandoned rows, at the next save's retention.)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [dcp_name(2), dcp_name(3)]
    for path in run.glob("metadata.sqlite*"):
        path.unlink()

    _run(_continuation_job, 2, tmp_path, "restore")

    for rank in range(2):
        result = json.loads((tmp_path / f"restored_{rank}.json").read_text())
        assert result == {"step": 3, "skipped": []}


def test_a_rebuilt_database_expires_the_sharded_step_a_restore_abandoned(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "policy.yaml").write_text(POLICY)
    run = tmp_path / "run"
    _run(_continuation_job, 2, tmp_path, "first")
    kept = tmp_path / "kept"  # step 4 as a run killed before the fork's retention leaves it
    shutil.copytree(run / "checkpoints" / dcp_name(4), kept)
    _run(_continuation_job, 2, tmp_path, "fork")
    shutil.copytree(kept, run / "checkpoints" / dcp_name(4))
    for path in run.glob("metadata.sqlite*"):
        path.unlink()
    capsys.readouterr()

    assert cli_main(["validate", "--rebuild", "--run-dir", str(run),
                     "--config", str(tmp_path / "policy.yaml")]) == 0

    out = capsys.readouterr().out
    assert out.count("abandoned, row expired: step 4 belongs to a continuation abandoned when "
                     "the run was restored to step 2") == 2, out
    statuses = _statuses(tmp_path)
    assert statuses == {(s, r): Status.EXPIRED if s == 4 else Status.VALID
                        for s in (2, 3, 4) for r in range(2)}
    _run(_continuation_job, 2, tmp_path, "restore")  # checks step 3's state bit for bit
    for rank in range(2):
        result = json.loads((tmp_path / f"restored_{rank}.json").read_text())
        assert result == {"step": 3, "skipped": [[str(run / "checkpoints" / dcp_name(4)),
                                                  "marked expired in the metadata store"]]}


def test_wrong_bytes_one_rank_alone_reads_condemn_the_step_in_every_ranks_row(
        tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text(POLICY)
    _run(_continuation_job, 2, tmp_path, "first")

    _run(_continuation_job, 2, tmp_path, "flaky")

    results = [json.loads((tmp_path / f"restored_{r}.json").read_text()) for r in range(2)]
    assert [r["step"] for r in results] == [2, 2]
    for rank, result in enumerate(results):
        (location, reason), = result["skipped"]
        assert location.endswith(dcp_name(4))
        assert ("another rank read wrong bytes of step 4" if rank == 0
                else f"{dcp_name(4)}/manifest.json") in reason, reason
    statuses = _statuses(tmp_path)
    assert {statuses[4, r] for r in range(2)} == {Status.CORRUPTED}
    assert {statuses[2, r] for r in range(2)} == {Status.VALID}

# -- one rank fails before the put: every rank gives the step up, and saves on together --------


def _retire_fails_job(rank: int, world: int, port: int, out: Path) -> None:
    """Saves steps 1, 2 and 3; rank 1's catalogue fails to retire step 2 (injected). Every
    rank's save of step 2 fails, with its own reason, and step 3 is saved by both."""
    mesh = _mesh(rank, world, port)
    model, opt, sched = _build(mesh)
    sampler = ResumableSampler(SAMPLES, seed=SEED, num_replicas=world, rank=rank)
    pilot = _pilot(out, model, opt, sched, sampler)
    assert pilot.restore() == 0
    if rank == 1:
        retire = Catalog.retire

        def retire_or_fail(self: Catalog, key: Any, set_aside: Any) -> None:
            if key.step == 2:
                raise OSError("injected: the catalogue cannot be read")
            retire(self, key, set_aside)

        Catalog.retire = retire_or_fail  # type: ignore[method-assign]
    errors = []
    for step in range(1, 4):
        pilot.observe(_step(model, opt, sched, sampler.take(BATCH)))
        assert pilot.save()
        try:
            pilot.flush()
        except CheckpointWriteError as e:
            errors.append([step, str(e)])
    _write(out / f"retire_{rank}.json", {"errors": errors,
                                         "saves": [s.step for s in pilot.saves]})
    pilot.close(save=False)
    dist.destroy_process_group()


def test_a_rank_that_cannot_retire_a_step_gives_it_up_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text(POLICY)
    _run(_retire_fails_job, 2, tmp_path)

    results = [json.loads((tmp_path / f"retire_{r}.json").read_text()) for r in range(2)]
    assert [r["saves"] for r in results] == [[1, 3]] * 2
    assert [[step for step, _ in r["errors"]] for r in results] == [[2]] * 2
    assert "another rank could not set aside" in results[0]["errors"][0][1]
    assert "injected: the catalogue cannot be read" in results[1]["errors"][0][1]
    assert all("step 2" in r["errors"][0][1] for r in results)
    statuses = _statuses(tmp_path)
    assert sorted(statuses) == [(s, r) for s in (1, 3) for r in range(2)]
    assert set(statuses.values()) == {Status.VALID}


def _tier_faults_job(rank: int, world: int, port: int, out: Path) -> None:
    """Puts steps 5 to 8 through the tier itself (paranoid validation), each of the first
    three failing on one rank only: rank 1's meta of step 5 has no JSON form, rank 1's
    read-back of step 6 raises (injected), rank 0's commit of step 7 raises (injected).
    Leaves what each put raised on this rank, and the steps published."""
    _mesh(rank, world, port)
    group = dist.new_group(backend="gloo")
    policy = Policy().with_run_dir(out / "run")
    policy = policy.model_copy(update={"validation": policy.validation.model_copy(
        update={"paranoid": True, "sha256": True})})
    tier = sharded_tier(policy, RemoteTier(f"file://{out}/dcp"), rank=rank,
                        world_size=world, group=group)
    read_back, commit = tier_module.read_back, DcpWriter.commit

    def read_back_or_fail(remote: RemoteTier, part: Any) -> None:
        if rank == 1 and part.step == 6:
            raise KeyError("injected: the read-back lost its way")
        read_back(remote, part)

    def commit_or_fail(self: DcpWriter) -> None:
        if self.step == 7:
            raise ValueError("injected: the commit file cannot be written")
        commit(self)

    tier_module.read_back = read_back_or_fail  # type: ignore[assignment]
    DcpWriter.commit = commit_or_fail  # type: ignore[method-assign]
    outcomes = []
    for step in (5, 6, 7, 8):
        meta = {"unencodable": {1, 2}} if rank == 1 and step == 5 else {}
        image = CheckpointImage.copied(step, {"step": step, "rank": rank, **meta},
                                       {"model/w": torch.arange(8, dtype=torch.float32)},
                                       level=Level.ORGAN, reason="test",
                                       retention_class=RetentionClass.ROUTINE, score=None)
        try:
            outcomes.append(f"put {tier.put(image).step}")
        except Exception as e:
            outcomes.append(f"{type(e).__name__}: {e}")
    _write(out / f"faults_{rank}.json", {"outcomes": outcomes, "steps": tier.steps()})
    dist.destroy_process_group()


def test_a_tier_step_one_rank_raises_in_raises_on_every_rank_and_the_next_goes_through(
        tmp_path: Path) -> None:
    _run(_tier_faults_job, 2, tmp_path)

    first, second = (json.loads((tmp_path / f"faults_{r}.json").read_text())
                     for r in range(2))
    assert first["steps"] == second["steps"] == [8]
    assert first["outcomes"][3] == second["outcomes"][3] == "put 8"
    stage, validate, publish = zip(first["outcomes"][:3], second["outcomes"][:3],
                                   strict=True)
    assert stage[0].startswith("RuntimeError: ") and "rank(s) [1] could not stage step 5" \
        in stage[0]
    assert stage[1].startswith("TypeError: ") and "not JSON serializable" in stage[1]
    assert validate[0].startswith("RuntimeError: ")
    assert "another rank failed to validate step 6" in validate[0]
    assert validate[1] == "KeyError: 'injected: the read-back lost its way'"
    assert publish[0] == "ValueError: injected: the commit file cannot be written"
    assert publish[1].startswith("OSError: ") and "rank 0 could not publish step 7" \
        in publish[1]
