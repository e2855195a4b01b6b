"""A restore to an earlier step abandons what came after it, and the files say so (issue 23,
point 3): losing the metadata database, or rebuilding it, never brings the abandoned
continuation back. And a damaged ``run_id`` file is repaired or named (point 5).

Real pilots, real archives, real SQLite; the CLI runs as ``python -m ckptpilot``."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_distributed import free_port
from test_pilot import Job
from test_restore_hardening import model_bits

from ckptpilot import NoCheckpointError
from ckptpilot.cli import main as cli_main
from ckptpilot.errors import LineageError, RunIdError
from ckptpilot.rundir import RUN_ID_FILE, lineage_path
from ckptpilot.storage.lineage import fork, read_lineage
from ckptpilot.tiers.remote import archive

HERE = Path(__file__).parent
DB_FILES = ("metadata.sqlite", "metadata.sqlite-wal", "metadata.sqlite-shm")


def abandoned_at_25(tmp_path: Path, continue_to: int | None) -> tuple[Job, dict[int, dict]]:
    """Saves at 5, 10, …, 30; ``restore(step=25)``; then, with ``continue_to``, training on
    to that step (closing saves it); the model's bits at every step of the live timeline."""
    job = Job(tmp_path, interval=5)
    bits = {}
    for _ in range(30):
        job.step()
        bits[job.pilot.step] = model_bits(job.model)
    job.pilot.flush()
    assert job.pilot.restore(step=25) == 25
    if continue_to is None:
        job.pilot.close(save=False)
        return job, bits
    while job.pilot.step < continue_to:
        job.step()
        bits[job.pilot.step] = model_bits(job.model)
    job.pilot.close()
    return job, bits


def delete_db(run_dir: Path) -> None:
    for name in DB_FILES:
        (run_dir / name).unlink(missing_ok=True)


def ckptpilot(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptpilot", *map(str, args)],
                          capture_output=True, text=True, timeout=300, check=False)


def restored_step(tmp_path: Path, bits: dict[int, dict]) -> int:
    again = Job(tmp_path, interval=5)
    try:
        step = again.pilot.restore()
        assert all(torch.equal(model_bits(again.model)[k], bits[step][k]) for k in bits[step])
        return step
    finally:
        again.pilot.close(save=False)


def statuses(run_dir: Path) -> dict[int, str]:
    with sqlite3.connect(run_dir / "metadata.sqlite") as db:
        return dict(db.execute("select step, status from checkpoints where tier = 'remote'"))


@pytest.mark.parametrize("continue_to", [None, 27])
def test_rebuilt_catalogue_does_not_resurrect_an_abandoned_continuation(
        tmp_path: Path, continue_to: int | None) -> None:
    job, bits = abandoned_at_25(tmp_path, continue_to)
    expected = continue_to or 25
    assert job.published() == sorted({5, 10, 15, 20, 25, 30, expected})
    saved_again = archive.read_manifest(
        archive.RemoteTier(str(job.run_dir / "checkpoints")), archive.checkpoint_name(expected, 0))
    lineage = read_lineage(lineage_path(job.run_dir, 0))
    assert [(f.parent, f.step) for f in lineage.forks] == [("", 25)]
    if continue_to is not None:  # the new continuation's checkpoint names it
        assert saved_again["branch"] == lineage.current
    else:
        assert "branch" not in saved_again  # step 25 itself, of the first continuation

    delete_db(job.run_dir)  # no catalogue at all
    assert restored_step(tmp_path, bits) == expected

    (job.run_dir / "metadata.sqlite").write_bytes(b"damaged " * 512)
    for name in DB_FILES[1:]:
        (job.run_dir / name).unlink(missing_ok=True)
    done = ckptpilot("validate", "--rebuild", "--run-dir", job.run_dir,
                     "--config", tmp_path / "policy.yaml")
    assert done.returncode == 0, done.stderr
    assert "abandoned, row expired: step 30 belongs to a continuation abandoned when the run " \
           "was restored to step 25 (pilot restore, rank 0)" in done.stdout
    assert statuses(job.run_dir)[30] == "expired"
    assert statuses(job.run_dir)[expected] == "valid"
    assert restored_step(tmp_path, bits) == expected
    assert cli_main(["ls", "--run-dir", str(job.run_dir),
                     "--config", str(tmp_path / "policy.yaml")]) == 0
    # A prune removes the abandoned checkpoint, as it would have with the original rows.
    assert cli_main(["prune", "--run-dir", str(job.run_dir),
                     "--config", str(tmp_path / "policy.yaml")]) == 0
    assert 30 not in job.published()


def test_no_catalogue_at_all_still_refuses_the_abandoned_steps(tmp_path: Path) -> None:
    job, _ = abandoned_at_25(tmp_path, None)
    delete_db(job.run_dir)
    again = Job(tmp_path, interval=5)
    with pytest.raises(NoCheckpointError) as caught:
        again.pilot.restore(step=30)
    assert str(caught.value).startswith(
        f"rank 0 cannot load step 30: none of the 1 checkpoints recorded or found in "
        f"{job.run_dir / 'checkpoints'} loads; newest: "
        f"{job.run_dir / 'checkpoints' / archive.checkpoint_name(30, 0)}: step 30 belongs to "
        "a continuation abandoned when the run was restored to step 25 (pilot restore, rank 0)")
    assert f"recorded in {lineage_path(job.run_dir, 0)} line 1" in str(caught.value)
    assert again.pilot.restore() == 25
    rec = again.pilot.last_recovery
    assert rec is not None and [s.location for s in rec.skipped] == [
        str(job.run_dir / "checkpoints" / archive.checkpoint_name(30, 0))]
    assert "abandoned when the run was restored to step 25" in rec.skipped[0].reason
    again.pilot.close(save=False)
    assert job.published() == [5, 10, 15, 20, 25, 30]  # abandoned is not corrupted: kept


def test_a_restore_of_the_new_continuation_forks_again_and_still_refuses_the_old(
        tmp_path: Path) -> None:
    """Two restores to earlier steps: 25 (abandons 30), then, on the new continuation at 27,
    20 (abandons 25 and 27 too)."""
    job, bits = abandoned_at_25(tmp_path, 27)
    again = Job(tmp_path, interval=5)
    assert again.pilot.restore(step=20) == 20
    again.pilot.close(save=False)
    forks = read_lineage(lineage_path(job.run_dir, 0)).forks
    assert [(f.step, f.parent) for f in forks] == [(25, ""), (20, forks[0].branch)]
    delete_db(job.run_dir)
    assert restored_step(tmp_path, bits) == 20


def test_a_torn_last_lineage_line_is_a_fork_that_never_completed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "lineage_rank_00000.jsonl"
    first = fork(path, 25, "test")
    whole = path.read_bytes()
    second = fork(path, 20, "test")
    cut = path.read_bytes()[:len(whole) + 30]  # killed in the middle of the second write
    path.write_bytes(cut)
    with caplog.at_level(logging.WARNING, "ckptpilot"):
        assert read_lineage(path).forks == first.forks
    assert "ignoring a last line without its newline (30 bytes)" in caplog.text
    third = fork(path, 22, "test")  # cuts the torn fragment off first
    assert [f.step for f in third.forks] == [25, 22] and third.current != second.current
    assert read_lineage(path).forks == third.forks
    assert path.read_bytes().count(b"\n") == 2


@pytest.mark.parametrize("damage", ["bitflip", "dropped"])
def test_a_damaged_lineage_record_is_named_and_recover_force_sets_it_aside(
        tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]) -> None:
    job, bits = abandoned_at_25(tmp_path, 27)
    path = lineage_path(job.run_dir, 0)
    fork(path, 27, "test")  # a second line, whose parent is the first
    lines = path.read_bytes().splitlines(keepends=True)
    if damage == "bitflip":
        path.write_bytes(lines[0].replace(b'"step": 25', b'"step": 35') + lines[1])
        problem = f"{path} line 1: SHA256 mismatch (the line was altered or damaged)"
    else:
        path.write_bytes(lines[1])
        problem = f"{path} line 1: its parent {json.loads(lines[1])['parent']!r} is not the " \
                  "continuation before it ('the first'): lines are missing or out of order"
    fix = "`ckptpilot recover --step N --force` sets it aside and records where the run goes on"
    with pytest.raises(LineageError) as caught:
        Job(tmp_path, interval=5)
    assert str(caught.value) == f"{problem}; {fix}"
    cfg = str(tmp_path / "policy.yaml")
    capsys.readouterr()
    assert cli_main(["recover", "--step", "27", "--run-dir", str(job.run_dir),
                     "--config", cfg]) == 2
    assert capsys.readouterr().err == f"ckptpilot recover: error: {problem}; {fix}\n"
    assert job.published() == [5, 10, 15, 20, 25, 27, 30]  # nothing changed
    assert cli_main(["recover", "--step", "27", "--force", "--run-dir", str(job.run_dir),
                     "--config", cfg]) == 0
    aside = [p.name for p in job.run_dir.glob("lineage_rank_00000.jsonl.damaged-*")]
    assert len(aside) == 1
    assert [(f.parent, f.step) for f in read_lineage(path).forks] == [("*", 27)]
    assert restored_step(tmp_path, bits) == 27


def test_a_deleted_lineage_record_is_detected_not_guessed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With the record gone, step 30 (abandoned) looks like the newest state; the new
    continuation's step 27 names a continuation nobody records, so restore refuses to guess;
    ``ckptpilot recover --step 27`` states where the run goes on."""
    job, bits = abandoned_at_25(tmp_path, 27)
    lineage_path(job.run_dir, 0).unlink()
    delete_db(job.run_dir)
    again = Job(tmp_path, interval=5)
    with pytest.raises(LineageError, match=(
            rf"saved on continuation [0-9a-f]{{16}}, which {lineage_path(job.run_dir, 0)} does "
            r"not record \(the file was deleted, replaced by another run's or restored from an "
            r"older copy\): which saved steps a restore abandoned cannot be told. Put the file "
            r"back, or state where the run goes on with `ckptpilot recover --step N`")):
        again.pilot.restore()
    again.pilot.close(save=False)
    cfg = str(tmp_path / "policy.yaml")
    capsys.readouterr()
    assert cli_main(["validate", "--rebuild", "--run-dir", str(job.run_dir),
                     "--config", cfg]) == 0
    assert "1 checkpoint(s) name a continuation their lineage record does not know; " \
           "restore() refuses to guess: step_00000027_rank_00000: saved on continuation" \
           in capsys.readouterr().out
    assert cli_main(["recover", "--step", "27", "--run-dir", str(job.run_dir),
                     "--config", cfg]) == 0
    assert restored_step(tmp_path, bits) == 27


@pytest.mark.crash
def test_two_ranks_without_a_catalogue_restore_the_same_step_not_the_abandoned_one(
        tmp_path: Path) -> None:
    """Two gloo ranks save 5, 10, 15 and restore step 10. Without the database both restore
    10; so they do when one rank's record was lost before its fork (it offers 15, the other
    rank refuses it)."""
    run_dir = tmp_path / "run"
    trained = ranks(run_dir, "train")
    assert [r["restored"] for r in trained] == [10, 10]
    delete_db(run_dir)
    lost = tmp_path / "lost"
    shutil.copytree(run_dir, lost)
    lineage_path(lost, 1).unlink()  # rank 1 was killed before appending its fork
    for where in (run_dir, lost):
        restored = ranks(where, "restore")
        assert [r["step"] for r in restored] == [10, 10], restored
        assert [r["digest"] for r in restored] == [t["digests"]["10"] for t in trained]
    assert any("abandoned when the run was restored to step 10" in s
               for s in restored[0]["skipped"]), restored
    assert any("step 15 is not held by every rank" in s for s in restored[1]["skipped"])


def ranks(run_dir: Path, phase: str) -> list[dict]:
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(HERE / "lineagejob.py"), "--rank", str(r), "--port", str(port),
         "--run-dir", str(run_dir), "--phase", phase], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


# -- point 5: a damaged run id -----------------------------------------------------------------

DAMAGED_IDS = {"empty": b"", "blank": b"  \n", "garbage": b"\xff\xfe\x00garbage",
               "truncated": b"0123456789ab"}


def damaged_problem(kind: str) -> str:
    return {"empty": "empty", "blank": "only white space",
            "garbage": "not text: b'\\xff\\xfe\\x00garbage'",
            "truncated": "'0123456789ab' is not a run id of 16 hex digits"}[kind]


@pytest.mark.parametrize("kind", sorted(DAMAGED_IDS))
def test_an_empty_run_id_file_is_repaired_or_named(
        tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    job = Job(tmp_path, interval=5)
    for _ in range(10):
        job.step()
    job.pilot.close()
    id_file = job.run_dir / RUN_ID_FILE
    run_id = id_file.read_text()
    cfg = str(tmp_path / "policy.yaml")
    id_file.write_bytes(DAMAGED_IDS[kind])
    problem = damaged_problem(kind)

    # ls only reads: it uses the id the rows carry and leaves the file as it is.
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, "ckptpilot"):
        assert cli_main(["ls", "--run-dir", str(job.run_dir), "--config", cfg]) == 0
    assert "no checkpoints recorded" not in capsys.readouterr().out
    assert f"{id_file} is damaged ({problem}); using run id {run_id}, which the rows of " \
           f"{job.run_dir / 'metadata.sqlite'} carry" in caplog.text
    assert id_file.read_bytes() == DAMAGED_IDS[kind]

    # The pilot repairs it from the rows, says so, and restores as before.
    caplog.clear()
    with caplog.at_level(logging.WARNING, "ckptpilot"):
        again = Job(tmp_path, interval=5)
    assert f"{id_file} was damaged ({problem}); repaired it to run id {run_id}, which the " \
           f"rows of {job.run_dir / 'metadata.sqlite'} carry" in caplog.text
    assert id_file.read_text() == run_id and again.pilot.run_id == run_id
    assert again.pilot.restore() == 10
    again.pilot.close(save=False)

    # With no database left, nothing says what it was: one clear error, nothing changed.
    delete_db(job.run_dir)
    id_file.write_bytes(DAMAGED_IDS[kind])
    expected = (f"{id_file} is damaged ({problem}) and nothing records the run's id: there is "
                f"no {job.run_dir / 'metadata.sqlite'}. Write the run's 16-hex-digit id into "
                "the file (from a backup, or the run_id column of a copy of metadata.sqlite); "
                "or, if no recorded history of this run must be kept, remove the file: the "
                "next pilot start makes a new id")
    with pytest.raises(RunIdError) as caught:
        Job(tmp_path, interval=5)
    assert str(caught.value) == expected
    done = ckptpilot("ls", "--run-dir", job.run_dir, "--config", cfg)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"ckptpilot ls: error: {expected}\n"
    assert id_file.read_bytes() == DAMAGED_IDS[kind]
    assert sorted(p.name for p in job.run_dir.iterdir() if p.name.startswith("metadata")) == []


def test_a_missing_run_id_file_is_still_made_anew(tmp_path: Path) -> None:
    job = Job(tmp_path, interval=5)
    run_id = (job.run_dir / RUN_ID_FILE).read_text()
    job.pilot.close(save=False)
    assert len(run_id) == 16 and int(run_id, 16) >= 0
    os.unlink(job.run_dir / RUN_ID_FILE)
    Job(tmp_path, interval=5).pilot.close(save=False)
    assert (job.run_dir / RUN_ID_FILE).read_text() != run_id
