"""RayTrainPilot on a real local Ray cluster (tests/integrations/ray_job.py: two gloo workers,
one of them SIGKILLed once, ``FailureConfig(max_failures=1)``), and the pointer files Ray
stores, parsed and checked against the pilot's catalogue as the untrusted input they are."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers

from helpers import assert_states_bit_equal

from ckptpilot import (
    CheckpointFormatError,
    CheckpointPilot,
    IntegrityError,
    NoCheckpointError,
    StateError,
)
from ckptpilot.integrations.ray import (
    POINTER_FORMAT,
    CheckpointPointer,
    pointer_file,
    read_pointer,
    verify_pointer,
    write_pointer,
)
from ckptpilot.storage.metadata import MetadataStore
from ckptpilot.vocab import Status, Tier

JOB = Path(__file__).with_name("ray_job.py")
STEPS = 30  # ray_job.STEPS
KILL_AT = 17  # the newest checkpoint then is step 10 (one every 10 steps)
RANKS = (0, 1)
TIMEOUT_SECONDS = 1800  # a safety net against a hung cluster, not a speed requirement

POLICY = (
    "scheduler: {base_interval: 10, min_interval: 1, max_interval: 500, young_daly: false,\n"
    "  weights: {loss: 1.0, grad: 0.0, system: 0.0}, loss: {slope_threshold: 1000.0},\n"
    "  organ_every: 100}\n"
    # The load test is covered elsewhere; skipping it keeps the workers quick.
    "validation: {load_test: none}\n"
    "observability: {tensorboard: false, decision_log: false}\n")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The four fits of ray_job.py, run once. Ray's own temporary directory sits right under
    /tmp: its sockets live there, a Unix socket path has at most 107 bytes, and pytest's
    per-worker base directories (pytest-xdist) are too deep for it."""
    work = tmp_path_factory.mktemp("ray")
    (work / "policy.yaml").write_text(POLICY)
    ray_temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    proc = subprocess.Popen(
        [sys.executable, str(JOB), "--work", str(work), "--policy", str(work / "policy.yaml"),
         "--kill-at", str(KILL_AT), "--ray-temp", str(ray_temp)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, err = proc.communicate(timeout=TIMEOUT_SECONDS)
    finally:
        _kill_session(proc.pid)
        shutil.rmtree(ray_temp, ignore_errors=True)  # Ray's logs and dead sockets
    assert proc.returncode == 0, out[-3000:] + err[-6000:]
    return work


def _kill_session(sid: int) -> None:
    """SIGKILL what is left of the session the job started in: the driver's ``ray.shutdown()``
    stops the cluster, but a Ray process that missed it (a train controller, seen here once)
    would outlive the test."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[3]) == sid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(stat.parent.name), signal.SIGKILL)


def _summary(work: Path) -> dict[str, dict[str, object]]:
    return json.loads((work / "summary.json").read_text())


def _events(work: Path, fit: str, rank: int) -> list[list[str]]:
    path = work / "events" / fit / f"rank{rank}.txt"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def _losses(work: Path, fit: str, rank: int) -> list[tuple[int, str]]:
    return [(int(e[1]), e[2]) for e in _events(work, fit, rank) if e[0] == "LOSS"]


def _resumed(work: Path, fit: str, rank: int) -> list[tuple[int, str]]:
    return [(int(e[1]), e[2]) for e in _events(work, fit, rank) if e[0] == "RESUMED"]


def _assert_final_equal(work: Path, fit: str) -> None:
    for rank in RANKS:
        ref = work / "final" / "reference" / f"rank{rank}.safetensors"
        got = work / "final" / fit / f"rank{rank}.safetensors"
        assert_states_bit_equal(safetensors.torch.load_file(ref),
                                safetensors.torch.load_file(got))
        # Optimizer hyper-parameters, LR schedule, torch RNG.
        assert (json.loads(Path(f"{got}.json").read_text())
                == json.loads(Path(f"{ref}.json").read_text()))


# -- on a real cluster -------------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.crash
def test_a_killed_worker_resumes_bit_exactly_from_the_step_both_ranks_agree_on(
        jobs: Path) -> None:
    for rank in RANKS:
        assert [s for s, _ in _losses(jobs, "reference", rank)] == list(range(1, STEPS + 1))
        # Killed after step 17 (every rank's saves valid); Ray restarted both workers, which
        # restored step 10 and trained on. Ray may hand step 10's pointer back, or none: it
        # loses the reports it had not registered when a worker died.
        first, second = _resumed(jobs, "killed", rank)
        assert first == (0, "None")
        assert second[0] == 10 and second[1] in ("10", "None")
        ref = dict(_losses(jobs, "reference", rank))
        seen = _losses(jobs, "killed", rank)
        assert [s for s, _ in seen] == [*range(1, KILL_AT + 1), *range(11, STEPS + 1)]
        mismatched = [(s, v, ref[s]) for s, v in seen if ref[s] != v]
        assert not mismatched, f"rank {rank}: losses differ after the restart: {mismatched[:3]}"
    _assert_final_equal(jobs, "killed")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.crash
def test_ray_stores_pointers_to_the_final_step_that_the_catalogue_confirms(jobs: Path) -> None:
    killed = _summary(jobs)["killed"]
    assert killed["metrics"] == {**killed["metrics"], "step": STEPS, "checkpoint_step": STEPS}
    directory = Path(str(killed["checkpoint"]))
    assert sorted(p.name for p in directory.iterdir()) == [
        pointer_file(directory, rank).name for rank in RANKS]
    with MetadataStore(jobs / "run" / "metadata.sqlite", read_only=True) as store:
        for rank in RANKS:
            pointer = read_pointer(directory, rank)
            assert (pointer.step, pointer.rank) == (STEPS, rank)
            [row] = [r for r in store.rows(pointer.run_id, rank=rank, tier=Tier.REMOTE,
                                           status=Status.VALID) if r.step == STEPS]
            assert (pointer.sha256, pointer.location) == (row.sha256, row.location)
    # Ray copied pointers into its storage, never checkpoint bytes.
    stored = [p for p in (jobs / "ray_storage").glob("*/checkpoint_*/*")]
    assert stored
    assert {p.name for p in stored} == {pointer_file(directory, r).name for r in RANKS}
    assert all(p.stat().st_size < 1024 for p in stored)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.crash
def test_a_finished_job_started_again_from_rays_checkpoint_trains_no_step(jobs: Path) -> None:
    for rank in RANKS:
        assert _resumed(jobs, "again", rank) == [(STEPS, str(STEPS))]
        assert _losses(jobs, "again", rank) == []
    _assert_final_equal(jobs, "again")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.crash
def test_rays_checkpoint_for_a_pilot_of_another_run_fails_the_job(jobs: Path) -> None:
    error = str(_summary(jobs)["stranger"]["error"])
    assert "StateError" in error
    assert f"points at step {STEPS} of run" in error
    assert f"this pilot's run_dir {jobs / 'other'} holds run" in error
    assert "ckptpilot_rank_0000" in error
    for rank in RANKS:
        assert _events(jobs, "stranger", rank) == []  # refused before training a step


# -- the pointer as untrusted input (no cluster) -----------------------------------------------

def _pilot(tmp: Path, run_dir: str = "run") -> CheckpointPilot:
    (tmp / "policy.yaml").write_text(POLICY)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return CheckpointPilot(tmp / "policy.yaml", model=model,
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                           run_dir=tmp / run_dir)


def _saved(pilot: CheckpointPilot, steps: int) -> CheckpointPointer:
    """Observe ``steps`` steps, save the last one, and return the pointer to it."""
    for _ in range(steps):
        pilot.observe(1.0)
    pilot.save()
    pilot.flush()
    row = next(r for r in pilot.store.rows(pilot.run_id, rank=0, tier=Tier.REMOTE,
                                           status=Status.VALID) if r.step == steps)
    return CheckpointPointer(run_id=pilot.run_id, run_dir=str(pilot.run_dir), step=steps,
                             rank=0, sha256=row.sha256, location=row.location)


@pytest.mark.integration
def test_a_pointer_round_trips_and_verifies_against_the_catalogue(tmp_path: Path) -> None:
    with _pilot(tmp_path) as pilot:
        pointer = _saved(pilot, 3)
        path = write_pointer(tmp_path, pointer)
        assert path == tmp_path / "ckptpilot_rank_00000.json"
        assert json.loads(path.read_text())["format"] == POINTER_FORMAT
        assert read_pointer(tmp_path, 0) == pointer
        row = verify_pointer(pointer, pilot, source=path)
        assert (row.step, row.sha256) == (3, pointer.sha256)


@pytest.mark.integration
def test_a_pointer_the_catalogue_does_not_confirm_is_refused(tmp_path: Path) -> None:
    with _pilot(tmp_path) as pilot:
        pointer = _saved(pilot, 3)
        flipped = pointer.model_copy(update={"sha256": "0" * 64})
        with pytest.raises(IntegrityError, match=r"p\.json \(step 3, rank 0\): SHA256 mismatch"):
            verify_pointer(flipped, pilot, source="p.json")
        later = pointer.model_copy(update={"step": 4})
        with pytest.raises(NoCheckpointError, match="no remote checkpoint of step 4 for rank 0"):
            verify_pointer(later, pilot, source="p.json")
        stranger = pointer.model_copy(update={"run_id": "0123456789abcdef"})
        with pytest.raises(StateError, match="points at step 3 of run 0123456789abcdef"):
            verify_pointer(stranger, pilot, source="p.json")


@pytest.mark.parametrize(("content", "message"), [
    (None, "no pointer for rank 0"),
    (b"\x00\xff", "not JSON"),
    (b"[1, 2]", "format 'list', expected"),
    (b'{"format": "ckptpilot-ray-pointer/9"}', "format 'ckptpilot-ray-pointer/9'"),
    (b" " * (64 * 1024 + 1), "larger than 65536 bytes"),
    ("extra", "surprise: Extra inputs are not permitted"),
    ("bool_step", "step: Input should be a valid integer"),
    ("short_sha", "sha256: String should match pattern"),
    ("other_rank", "names rank 1; the file of rank 0"),
])
@pytest.mark.integration
def test_a_malformed_pointer_file_is_refused_naming_it(tmp_path: Path, content: object,
                                                       message: str) -> None:
    good = {"format": POINTER_FORMAT, "run_id": "r", "run_dir": "/d", "step": 3, "rank": 0,
            "sha256": "a" * 64, "location": "x"}
    broken = {"extra": {**good, "surprise": 1}, "bool_step": {**good, "step": True},
              "short_sha": {**good, "sha256": "abc"}, "other_rank": {**good, "rank": 1}}
    path = pointer_file(tmp_path, 0)
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(json.dumps(broken[content]))
    with pytest.raises(CheckpointFormatError, match=message) as caught:
        read_pointer(tmp_path, 0)
    assert str(path) in str(caught.value)
