"""Restore under attack: a second pilot on one run dir, a checkpoint under another step's name,
read errors, missing data, a copied run dir, and ranks that hold different steps."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from test_pilot import Job

from ckptpilot import CheckpointPilot, NoCheckpointError, RecoverySource, StateError
from ckptpilot.cli import main as cli_main
from ckptpilot.rundir import RUN_ID_FILE, RunDirBusyError, RunLease
from ckptpilot.storage.metadata import MetadataStore, Status
from ckptpilot.tiers.remote import archive

HERE = Path(__file__).parent


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def model_bits(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: as_bits(v).clone() for k, v in model.state_dict().items()}


def trained(tmp_path: Path, steps: int = 12, interval: int = 3) -> tuple[Job, dict[int, dict]]:
    """A closed run with checkpoints every ``interval`` steps, and the model's bits at each."""
    job = Job(tmp_path, interval=interval)
    bits = {}
    for _ in range(steps):
        job.step()
        bits[job.pilot.step] = model_bits(job.model)
    job.pilot.close()
    return job, bits


def ckpt_dir(job: Job, step: int, rank: int = 0) -> Path:
    return job.run_dir / "checkpoints" / archive.checkpoint_name(step, rank)


def test_a_second_pilot_on_the_same_rank_refuses_to_start_naming_the_holder(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = Job(tmp_path)
    with pytest.raises(RunDirBusyError, match=rf"rank 0 is held by pid {os.getpid()} on host "
                       rf"{socket.gethostname()}"):
        Job(tmp_path)
    # Another rank of the same run, and read-only operations, are not blocked.
    other = CheckpointPilot(job.pilot.policy, model=torch.nn.Linear(2, 2), rank=1,
                            world_size=2)
    other.close()
    assert cli_main(["ls", "--run-dir", str(job.run_dir)]) == 0
    job.pilot.close()
    Job(tmp_path).pilot.close()  # released on close


def test_the_lease_of_a_killed_pilot_is_released_by_the_kernel(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""\
            import sys, time
            from pathlib import Path
            from ckptpilot.rundir import RunLease
            lease = RunLease(Path({str(run_dir)!r}), 0)
            print("held", flush=True)
            time.sleep(600)
            """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusyError, match=f"pid {holder.pid}"):
            RunLease(run_dir, 0)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    finally:
        holder.kill()
    lease = RunLease(run_dir, 0)
    assert lease.held
    assert json.loads(lease.path.read_text())["pid"] == os.getpid()
    lease.release()


def test_a_copy_of_an_older_step_under_a_newer_name_is_not_loaded_as_that_step(
        tmp_path: Path) -> None:
    job, bits = trained(tmp_path)
    assert job.published() == [3, 6, 9, 12]
    shutil.rmtree(ckpt_dir(job, 12))
    shutil.copytree(ckpt_dir(job, 6), ckpt_dir(job, 12))
    again = Job(tmp_path, interval=3)
    assert again.pilot.restore() == 9
    rec = again.pilot.last_recovery
    assert rec is not None and [s.location for s in rec.skipped] == [
        str(ckpt_dir(job, 12))]
    assert "holds 'step_00000006_rank_00000' (step 6, rank 0), not step_00000012_rank_00000" \
        in rec.skipped[0].reason
    assert model_bits(again.model).keys() == bits[9].keys()
    assert all(torch.equal(model_bits(again.model)[k], bits[9][k]) for k in bits[9])
    again.pilot.close()


def test_an_archive_other_than_the_one_recorded_is_refused_by_its_digest(
        tmp_path: Path) -> None:
    """Same name, step and rank in the manifest, yet not what the metadata recorded (a copy
    from another run or an earlier continuation): the row's digest tells them apart."""
    job, bits = trained(tmp_path)
    (tmp_path / "other").mkdir()
    other = Job(tmp_path / "other", interval=3)
    for _ in range(12):
        other.step()
        other.x.mul_(1.5)  # another run: different data from step 2 on
    other.pilot.close()
    shutil.rmtree(ckpt_dir(job, 12))
    shutil.copytree(ckpt_dir(other, 12), ckpt_dir(job, 12))
    again = Job(tmp_path, interval=3)
    assert again.pilot.restore() == 9
    rec = again.pilot.last_recovery
    assert rec is not None and "not the archive the metadata recorded" in rec.skipped[0].reason
    assert all(torch.equal(model_bits(again.model)[k], bits[9][k]) for k in bits[9])
    again.pilot.close()


def test_a_read_error_skips_the_checkpoint_and_walks_back(tmp_path: Path) -> None:
    """An I/O error skips the copy without condemning it (it may pass: a flaky mount);
    wrong bytes mark it corrupted."""
    job, bits = trained(tmp_path)
    manifest = ckpt_dir(job, 12) / archive.MANIFEST_FILE
    manifest.unlink()
    manifest.mkdir()  # reading it raises IsADirectoryError
    (ckpt_dir(job, 9) / archive.STATE_FILE).write_text("{}")
    again = Job(tmp_path, interval=3)
    assert again.pilot.restore() == 6
    rec = again.pilot.last_recovery
    assert rec is not None and [s.location for s in rec.skipped] == [
        str(ckpt_dir(job, 12)), str(ckpt_dir(job, 9))]
    assert "Is a directory" in rec.skipped[0].reason
    assert "truncated" in rec.skipped[1].reason
    assert all(torch.equal(model_bits(again.model)[k], bits[6][k]) for k in bits[6])
    again.pilot.close()
    with MetadataStore(job.run_dir / "metadata.sqlite") as store:
        statuses = {r.step: r.status for r in store.rows(store_run_id(job.run_dir))}
    # 12 and 9 are expired by the restore to 6 (an abandoned continuation), 12 never corrupted
    assert statuses == {3: Status.VALID, 6: Status.VALID, 9: Status.CORRUPTED,
                        12: Status.EXPIRED}


def test_a_state_that_does_not_fit_the_model_is_raised_and_marks_nothing(
        tmp_path: Path) -> None:
    job, _ = trained(tmp_path)
    policy = job.pilot.policy
    wrong = CheckpointPilot(policy, model=torch.nn.Linear(3, 3), run_dir=job.run_dir)
    with pytest.raises(StateError):
        wrong.restore()
    wrong.close()
    with MetadataStore(job.run_dir / "metadata.sqlite") as store:
        assert {r.status for r in store.rows(store_run_id(job.run_dir))} == {Status.VALID}
    again = Job(tmp_path, interval=3)
    assert again.pilot.restore() == 12
    again.pilot.close()


def store_run_id(run_dir: Path) -> str:
    return (run_dir / RUN_ID_FILE).read_text().strip()


def test_recorded_checkpoints_whose_data_is_gone_are_an_error_not_a_fresh_start(
        tmp_path: Path) -> None:
    job, _ = trained(tmp_path)
    shutil.rmtree(job.run_dir / "checkpoints")
    again = Job(tmp_path, interval=3)
    with pytest.raises(NoCheckpointError, match=r"none of the 4 checkpoints .* newest: .*"
                       r"step_00000012_rank_00000: recorded valid but its data is missing"):
        again.pilot.restore()
    again.pilot.close()


def test_a_deleted_newest_checkpoint_is_reported_and_the_previous_one_restored(
        tmp_path: Path) -> None:
    job, _ = trained(tmp_path)
    shutil.rmtree(ckpt_dir(job, 12))
    again = Job(tmp_path, interval=3)
    assert again.pilot.restore() == 9
    rec = again.pilot.last_recovery
    assert rec is not None and rec.source is RecoverySource.REMOTE
    assert [s.location for s in rec.skipped] == [str(ckpt_dir(job, 12))]
    assert "data is missing" in rec.skipped[0].reason
    again.pilot.close()


def test_a_copied_run_dir_keeps_its_history(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    job, bits = trained(tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(job.run_dir, copy)
    capsys.readouterr()
    assert cli_main(["ls", "--run-dir", str(copy)]) == 0
    listed = capsys.readouterr().out
    assert "no checkpoints recorded" not in listed and listed.count(" valid ") == 4
    again = Job(tmp_path, interval=3)
    again.pilot.close()
    pilot = CheckpointPilot(again.pilot.policy, model=again.model, optimizer=again.opt,
                            lr_scheduler=again.sched, data_state=again.sampler, run_dir=copy)
    assert pilot.restore() == 12
    assert all(torch.equal(model_bits(again.model)[k], bits[12][k]) for k in bits[12])
    pilot.close()


def test_rows_of_a_run_dir_from_before_run_ids_are_adopted(tmp_path: Path) -> None:
    job, _ = trained(tmp_path)
    run_id = store_run_id(job.run_dir)
    with MetadataStore(job.run_dir / "metadata.sqlite") as store:
        assert store.adopt_run_id(run_id, job.run_dir.name) == 4  # as keyed before
    (job.run_dir / RUN_ID_FILE).unlink()
    again = Job(tmp_path, interval=3)
    assert again.pilot.restore() == 12
    assert again.pilot.last_recovery is not None and not again.pilot.last_recovery.skipped
    again.pilot.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks(run_dir: Path, phase: str) -> list[dict]:
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(HERE / "rankjob.py"), "--rank", str(r), "--port", str(port),
         "--run-dir", str(run_dir), "--phase", phase], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


@pytest.mark.crash
def test_ranks_restore_the_newest_step_that_every_rank_can_load(tmp_path: Path) -> None:
    trained_dir = tmp_path / "trained"
    finished = ranks(trained_dir, "train")
    published = finished[0]["published"]
    assert finished[1]["published"] == published and published[-1] == 15
    before = published[-2]  # 10, or a step the scheduler chose on its own
    missing, damaged = tmp_path / "missing", tmp_path / "damaged"
    shutil.copytree(trained_dir, missing)
    shutil.copytree(trained_dir, damaged)
    # One rank's newest checkpoint deleted; in the other copy, bit-flipped.
    shutil.rmtree(missing / "checkpoints" / archive.checkpoint_name(15, 1))
    tensors = damaged / "checkpoints" / archive.checkpoint_name(15, 1) / archive.TENSORS_FILE
    data = bytearray(tensors.read_bytes())
    data[-5] ^= 0x10
    tensors.write_bytes(bytes(data))
    for run_dir in (missing, damaged):
        restored = ranks(run_dir, "restore")
        assert [r["step"] for r in restored] == [before, before], restored
        # Every rank holds exactly the state it had at that step of the uninterrupted run.
        assert [r["digest"] for r in restored] == [f["digests"][str(before)] for f in finished]
        assert any("step 15" in s or "step_00000015" in s for s in restored[0]["skipped"])
    # An exception on one rank (its model does not fit) stops every rank: none resumes
    # alone, none waits forever in a collective.
    errors = ranks(trained_dir, "restore-misfit")
    assert [e["error"] for e in errors] == ["AnotherRankFailed", "StateError"], errors
    assert "another rank failed while restoring" in errors[0]["message"]


def test_a_restart_after_the_clock_jumped_back_resumes_and_observes(tmp_path: Path) -> None:
    """The dead run's records lie a day in the future (the clock went back across the crash):
    MTBF is unknown or positive, never 0, and the first observe() does not raise."""
    job = Job(tmp_path, interval=3)
    job.pilot.restore()
    for _ in range(7):
        job.step()
    job.pilot.flush()
    job.pilot._heartbeat.close()  # as if SIGKILLed: no clean end in the ledger
    job.pilot._closed = True
    job.pilot._lease.release()
    ledger = job.run_dir / "ledger_rank_00000.jsonl"
    records = [json.loads(line) for line in ledger.read_text().splitlines()]
    for r in records:
        r["wall_time"] += 86400.0
    ledger.write_text("".join(json.dumps(r) + "\n" for r in records))
    for restart in range(2):  # every restart after it too
        again = Job(tmp_path, interval=3)
        assert again.pilot.restore() == 6 + restart
        again.step()
        mtbf = again.pilot.stats()["mtbf_seconds"]
        assert mtbf is None or mtbf > 0
        again.pilot.save("organ")
        again.pilot.close()


def test_damaged_heartbeat_ring_and_ledger_are_set_aside_and_the_run_resumes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    job, bits = trained(tmp_path)
    ring = job.run_dir / "heartbeat_rank_00000.ring"
    ring.write_bytes(os.urandom(333))
    ledger = job.run_dir / "ledger_rank_00000.jsonl"
    lines = ledger.read_text().splitlines()
    ledger.write_text("\n".join([lines[0], "garbage {", *lines[1:]]) + "\n")
    again = Job(tmp_path, interval=3)
    assert again.pilot.restore() == 12
    rec = again.pilot.last_recovery
    assert rec is not None and rec.steps_lost is None
    assert all(torch.equal(model_bits(again.model)[k], bits[12][k]) for k in bits[12])
    again.step()
    again.pilot.close()
    aside = sorted(p.name for p in job.run_dir.iterdir() if ".damaged-" in p.name)
    assert [n.split(".damaged-")[0] for n in aside] == [ring.name, ledger.name]
    assert any("heartbeat_rank_00000.ring" in r.message for r in caplog.records)


def test_rebuilding_the_database_is_refused_while_a_pilot_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = Job(tmp_path, interval=3)
    for _ in range(3):
        job.step()
    job.pilot.flush()
    db = (job.run_dir / "metadata.sqlite").read_bytes()
    assert cli_main(["validate", "--rebuild", "--run-dir", str(job.run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"held by pid {os.getpid()}" in err[0]
    assert (job.run_dir / "metadata.sqlite").read_bytes() == db
    job.pilot.close()
    assert cli_main(["validate", "--rebuild", "--run-dir", str(job.run_dir)]) == 0


def test_reading_a_run_creates_no_remote_directory(tmp_path: Path) -> None:
    """A mistyped or unmounted remote URL must not appear as an empty tier."""
    job, _ = trained(tmp_path)
    shutil.rmtree(job.run_dir / "checkpoints")
    assert cli_main(["ls", "--run-dir", str(job.run_dir)]) == 0
    assert cli_main(["validate", "--dry-run", "--run-dir", str(job.run_dir)]) == 0
    again = Job(tmp_path, interval=3)
    with pytest.raises(NoCheckpointError):
        again.pilot.restore()
    again.pilot.close()
    assert not (job.run_dir / "checkpoints").exists()


def test_waiting_for_the_metadata_lock_leaves_the_training_rng_alone(tmp_path: Path) -> None:
    """The back-off jitter must not draw from the global ``random``: that is the training
    job's RNG, saved in every checkpoint, and a resume would no longer be bit-exact."""
    path = tmp_path / "metadata.sqlite"
    MetadataStore(path).close()
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    release = threading.Timer(0.5, holder.rollback)
    release.start()
    before = random.getstate()
    with MetadataStore(path) as store:
        store.audit("probe", {"x": 1})  # waits on the held write lock, polling with jitter
    release.join()
    holder.close()
    assert random.getstate() == before


def test_no_library_module_draws_from_the_global_python_rng() -> None:
    import ast

    import ckptpilot

    root = Path(ckptpilot.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if path.parts[-2] == "fit" or path.name == "demo.py":
            continue  # training jobs of their own
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "random" and node.attr not in {
                        "Random", "getstate", "setstate"}):
                offenders.append(f"{path.relative_to(root)}:{node.lineno} random.{node.attr}")
    assert offenders == []


def test_close_releases_the_run_even_when_a_step_of_it_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = Job(tmp_path, interval=3)
    job.step()

    def disk_full(step: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(job.pilot._lifecycle, "end", disk_full)
    with pytest.raises(OSError, match="No space left"):
        job.pilot.close()
    Job(tmp_path, interval=3).pilot.close()  # the lease went with the failed close


def test_a_pilot_that_fails_to_start_stops_what_it_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ledger is opened after the writer, telemetry and heartbeat threads started."""
    import ckptpilot.assembly as assembly_module

    def unreadable(path: Path) -> None:
        raise OSError(5, "Input/output error", str(path))

    monkeypatch.setattr(assembly_module, "FailureLedger", unreadable)
    before = set(threading.enumerate())
    with pytest.raises(OSError, match="Input/output error"):
        Job(tmp_path, interval=3)
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []
    monkeypatch.undo()
    Job(tmp_path, interval=3).pilot.close()  # and the lease is free


def test_a_pilot_that_fails_after_its_parts_started_stops_them_and_frees_the_run(
        tmp_path: Path) -> None:
    """The optimizer hook is registered last, after every thread started: an optimizer
    whose ``register_step_post_hook`` fails must not leave those threads or the lease
    behind."""

    class NoHooks(torch.optim.SGD):  # an optimizer that refuses torch's hook API
        def register_step_post_hook(self, hook: object) -> object:
            raise AttributeError("register_step_post_hook is not supported here")

    job = Job(tmp_path, interval=3)
    job.pilot.close()
    before = set(threading.enumerate())
    with pytest.raises(AttributeError, match="register_step_post_hook"):
        CheckpointPilot(job.pilot.policy, model=job.model,
                        optimizer=NoHooks(job.model.parameters(), lr=0.1))
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []
    Job(tmp_path, interval=3).pilot.close()  # the lease was released


def test_close_stops_the_writer_before_the_clean_end_and_the_store_last(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The clean end goes into the ledger only once nothing more can be written, so a close
    that hangs or dies earlier leaves the run an interruption, never a clean end."""
    from ckptpilot.lifecycle import RunLifecycle
    from ckptpilot.save.writer import CheckpointWriter

    order: list[str] = []

    def recording(cls: type, name: str) -> None:
        original = getattr(cls, name)

        def wrapper(self: object, *args: object) -> object:
            order.append(f"{cls.__name__}.{name}")
            return original(self, *args)

        monkeypatch.setattr(cls, name, wrapper)

    recording(CheckpointWriter, "shutdown")
    recording(RunLifecycle, "end")
    recording(MetadataStore, "close")
    job = Job(tmp_path, interval=3)
    for _ in range(4):
        job.step()
    job.pilot.close()
    assert order == ["CheckpointWriter.shutdown", "RunLifecycle.end", "MetadataStore.close"]


@pytest.mark.crash
def test_a_spike_on_one_rank_rolls_every_rank_back_to_the_same_step(tmp_path: Path) -> None:
    """Rank 0 confirms a spike at step 23 (onset 22); the ranks agree on it one step later
    and both go back to the newest save before step 21 that both hold, 20."""
    outs = ranks(tmp_path / "run", "rollback")
    for out in outs:
        assert out == {"at": 24, "onset": 22, "to": 20, "step": 20, "restored": True}, outs



HOSTILE_JSON = {
    "deep-nesting": b"[" * 100_000 + b"]" * 100_000,
    "5000-digit-number": b'{"format": ' + b"9" * 5000 + b"}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_JSON))
@pytest.mark.parametrize("catalogue", ["kept", "deleted"])
def test_a_manifest_of_hostile_json_is_skipped_with_a_format_error(
        tmp_path: Path, name: str, catalogue: str) -> None:
    """Checkpoint bytes are the attacker's: a manifest that makes json raise RecursionError
    or ValueError (int digit limit) is one skipped checkpoint naming it, not a crash."""
    job, bits = trained(tmp_path)
    (ckpt_dir(job, 12) / archive.MANIFEST_FILE).write_bytes(HOSTILE_JSON[name])
    if catalogue == "deleted":
        for suffix in ("", "-wal", "-shm"):
            (job.run_dir / f"metadata.sqlite{suffix}").unlink(missing_ok=True)
    again = Job(tmp_path, interval=3)
    assert again.pilot.restore() == 9
    rec = again.pilot.last_recovery
    assert rec is not None and rec.skipped[0].location == str(ckpt_dir(job, 12))
    assert "not valid JSON" in rec.skipped[0].reason
    assert all(torch.equal(model_bits(again.model)[k], bits[9][k]) for k in bits[9])
    again.pilot.close()
