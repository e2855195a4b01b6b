"""`ckptpilot ls / recover / prune / validate` on a real run: real files, real SQLite."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import archive_tensors

from ckptpilot import CheckpointPilot, load_policy
from ckptpilot.cli import main
from ckptpilot.rundir import read_run_id
from ckptpilot.storage.metadata import MetadataStore
from ckptpilot.tiers.remote import archive


def policy_file(tmp_path: Path) -> Path:
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(textwrap.dedent("""\
        scheduler: {base_interval: 2, min_interval: 1, max_interval: 100, young_daly: false,
                    weights: {loss: 1.0, grad: 0.0, system: 0.0},
                    loss: {slope_threshold: 1000.0}}
        observability: {tensorboard: false, decision_log: false}
        retention: {best: {metric: val_loss, mode: min, keep: 1}, auto: false, keep_last: 1}
        validation: {load_test: none}
        """))  # no load-test worker per run: tests/test_loadcheck.py covers it
    return cfg


def make_pilot(cfg: Path, run_dir: Path) -> tuple[CheckpointPilot, torch.nn.Module,
                                                  torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return CheckpointPilot(load_policy(cfg, run_dir=run_dir), model=model, optimizer=opt), \
        model, opt


def train(pilot: CheckpointPilot, model: torch.nn.Module, opt: torch.optim.Optimizer,
          steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        pilot.observe(1.0)


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, Path]:
    """A run with saves at steps 2, 4, 6, 8, 10; step 4 carries the best val_loss."""
    cfg, run_dir = policy_file(tmp_path), tmp_path / "run"
    pilot, model, opt = make_pilot(cfg, run_dir)
    pilot.restore()
    train(pilot, model, opt, 4)
    pilot.report_metric("val_loss", 0.5)
    train(pilot, model, opt, 2)
    pilot.report_metric("val_loss", 0.9)
    train(pilot, model, opt, 4)
    pilot.close()
    assert all(r.status == "valid" for r in pilot.saves)
    return cfg, run_dir


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptpilot", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def table(stdout: str) -> list[dict[str, str]]:
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    header = lines[0].split()
    parts = [ln.split(None, len(header) - 1) for ln in lines[1:]]
    return [dict(zip(header, p, strict=True)) for p in parts
            if p[0].isdigit() and len(p) == len(header)]


def test_ls_lists_every_checkpoint(run: tuple[Path, Path]) -> None:
    cfg, run_dir = run
    out = cli("ls", "--run-dir", run_dir, "--config", cfg)
    assert out.returncode == 0, out.stderr
    rows = table(out.stdout)
    assert [int(r["step"]) for r in rows] == [10, 8, 6, 4, 2]
    assert {r["status"] for r in rows} == {"valid"}
    assert "val_loss=0.5" in out.stdout and "val_loss=0.9" in out.stdout


def test_prune_dry_run_changes_nothing_then_prune_keeps_newest_and_best(
        run: tuple[Path, Path]) -> None:
    cfg, run_dir = run
    before = tree_digest(run_dir)
    dry = cli("prune", "--dry-run", "--run-dir", run_dir, "--config", cfg)
    assert dry.returncode == 0, dry.stderr
    assert "dry run: would remove" in dry.stdout
    assert tree_digest(run_dir) == before

    out = cli("prune", "--run-dir", run_dir, "--config", cfg)
    assert out.returncode == 0, out.stderr
    left = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    # newest valid (10), best by val_loss (4); routine keep 1 is the newest anyway.
    assert left == [archive.checkpoint_name(s, 0) for s in (4, 10)]
    rows = table(cli("ls", "--run-dir", run_dir, "--config", cfg).stdout)
    assert {int(r["step"]): r["status"] for r in rows} == {
        10: "valid", 8: "expired", 6: "expired", 4: "valid", 2: "expired"}
    with sqlite3.connect(run_dir / "metadata.sqlite") as db:
        actions = [a for (a,) in db.execute("select action from audit")]
    assert actions.count("prune") == 3


def test_recover_dry_run_then_recover_sets_the_restore_point(run: tuple[Path, Path]) -> None:
    cfg, run_dir = run
    before = tree_digest(run_dir)
    dry = cli("recover", "--step", "6", "--dry-run", "--run-dir", run_dir, "--config", cfg)
    assert dry.returncode == 0, dry.stderr
    assert "would load" in dry.stdout and "step_00000006_rank_00000" in dry.stdout
    assert "would set aside 2 later checkpoint(s)" in dry.stdout
    assert tree_digest(run_dir) == before

    out = cli("recover", "--step", "6", "--run-dir", run_dir, "--config", cfg)
    assert out.returncode == 0, out.stderr
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert sum(".abandoned-by-recover-6-" in n for n in names) == 2
    pilot, _, _ = make_pilot(cfg, run_dir)
    assert pilot.restore() == 6
    pilot.close()
    with sqlite3.connect(run_dir / "metadata.sqlite") as db:
        audit = [(a, json.loads(d)) for a, d in db.execute("select action, details from audit")]
    assert ("recover", {"step": 6, "ranks": [0], "abandoned": audit[-1][1]["abandoned"]}
            ) in audit


def test_recover_of_a_corrupted_checkpoint_needs_force_and_is_audited(
        run: tuple[Path, Path]) -> None:
    cfg, run_dir = run
    db = sqlite3.connect(run_dir / "metadata.sqlite")
    with db:
        db.execute("update checkpoints set status='corrupted' where step=8")
    db.close()
    refused = cli("recover", "--step", "8", "--run-dir", run_dir, "--config", cfg)
    assert refused.returncode == 2
    assert refused.stderr.strip().endswith("is corrupted in the metadata; use --force to "
                                           "recover it anyway")
    forced = cli("recover", "--step", "8", "--force", "--run-dir", run_dir, "--config", cfg)
    assert forced.returncode == 0, forced.stderr
    pilot, _, _ = make_pilot(cfg, run_dir)
    assert pilot.restore() == 8  # the pin overrides the status
    pilot.close()
    assert not (run_dir / "recover.json").exists()
    with sqlite3.connect(run_dir / "metadata.sqlite") as db:
        actions = [a for (a,) in db.execute("select action from audit")]
    assert "recover-force" in actions and "recover-applied" in actions


def test_validate_marks_a_bit_flip_corrupted_and_restore_walks_back(
        run: tuple[Path, Path]) -> None:
    cfg, run_dir = run
    newest = archive_tensors(run_dir / "checkpoints" / archive.checkpoint_name(10, 0))
    data = bytearray(newest.read_bytes())
    data[len(data) - 5] ^= 0x04
    newest.write_bytes(bytes(data))
    out = cli("validate", "--run-dir", run_dir, "--config", cfg)
    assert out.returncode == 1
    assert [r["result"] for r in table(out.stdout)] == ["ok"] * 4 + ["CORRUPTED"]
    pilot, _, _ = make_pilot(cfg, run_dir)
    assert pilot.restore() == 8
    rec = pilot.last_recovery
    assert rec is not None and "marked corrupted in the metadata store" in rec.skipped[0].reason
    pilot.close()


def test_validate_rebuild_recreates_a_lost_database(run: tuple[Path, Path]) -> None:
    cfg, run_dir = run
    original = table(cli("ls", "--run-dir", run_dir, "--config", cfg).stdout)
    (run_dir / "metadata.sqlite").unlink()
    missing = cli("ls", "--run-dir", run_dir, "--config", cfg)
    assert missing.returncode == 2 and "validate --rebuild" in missing.stderr
    out = cli("validate", "--rebuild", "--run-dir", run_dir, "--config", cfg)
    assert out.returncode == 0, out.stderr
    rebuilt = table(cli("ls", "--run-dir", run_dir, "--config", cfg).stdout)
    keys = ("step", "rank", "level", "tier", "status", "class", "score", "size")
    assert [{k: r[k] for k in keys} for r in rebuilt] == \
        [{k: r[k] for k in keys} for r in original]


@pytest.mark.parametrize(("args", "message"), [
    (["ls", "--run-dir", "/nonexistent/run"], "run directory /nonexistent/run does not exist"),
    (["recover", "--run-dir", "RUN"], "the following arguments are required: --step"),
    (["recover", "--step", "-3", "--run-dir", "RUN"], "expected a step >= 0, got -3"),
    (["recover", "--step", "999", "--run-dir", "RUN"], "no published checkpoint of step 999"),
    (["prune", "--run-dir", "RUN", "--config", "/nope.yaml"], "/nope.yaml"),
])
def test_bad_input_is_one_line_exit_2(run: tuple[Path, Path], args: list[str], message: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """In this process (tests/test_cli.py checks that the command's process exits with
    main()'s status and argparse's)."""
    _, run_dir = run
    before = tree_digest(run_dir)
    capsys.readouterr()
    try:
        status = main([str(run_dir) if a == "RUN" else a for a in args])
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    assert (status, out) == (2, "")
    assert len(err.strip().splitlines()) == 1, err
    assert message in err
    assert tree_digest(run_dir) == before


# --- a damaged or unreachable metadata database: one line, exit 2; --rebuild recovers ---------


def run_cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """``ckptpilot ARGS`` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    status = main([str(a) for a in args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _garbage(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 40)


def _truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 3])


def _header_zeroed(path: Path) -> None:
    path.write_bytes(bytes(100) + path.read_bytes()[100:])


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "stray").write_text("not a database")


DAMAGE = {"garbage": _garbage, "truncated": _truncated, "header zeroed": _header_zeroed,
          "a directory": _directory}


def contents(path: Path) -> object:
    return {p.name: p.read_bytes() for p in path.iterdir()} if path.is_dir() \
        else path.read_bytes()


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_database_is_one_line_exit_2_and_rebuild_recovers_keeping_it(
        run: tuple[Path, Path], capsys: pytest.CaptureFixture[str], damage: str) -> None:
    cfg, run_dir = run
    db = run_dir / "metadata.sqlite"
    assert sorted(p.name for p in run_dir.glob("metadata.sqlite*")) == ["metadata.sqlite"]
    DAMAGE[damage](db)
    damaged = contents(db)
    for command in (["ls"], ["validate"]):
        status, out, err = run_cli(capsys, *command, "--run-dir", run_dir, "--config", cfg)
        assert (status, out) == (2, ""), (command, out, err)
        assert len(err.splitlines()) == 1, err
        assert err.startswith(f"ckptpilot {command[0]}: error: {db}"), err
        assert "`ckptpilot validate --rebuild` moves it aside (kept, not deleted)" in err

    status, out, err = run_cli(capsys, "validate", "--rebuild", "--run-dir", run_dir,
                               "--config", cfg)
    assert (status, err) == (0, ""), out
    [aside] = run_dir.glob("metadata.sqlite.damaged-*")
    assert f"kept the previous database as {aside}\n" in out
    assert contents(aside) == damaged
    status, out, _ = run_cli(capsys, "ls", "--run-dir", run_dir, "--config", cfg)
    assert status == 0
    assert [(int(r["step"]), r["status"]) for r in table(out)] == [
        (10, "valid"), (8, "valid"), (6, "valid"), (4, "valid"), (2, "valid")]


def test_validate_rebuild_keeps_a_healthy_database_under_its_own_name(
        run: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    cfg, run_dir = run
    before = (run_dir / "metadata.sqlite").read_bytes()
    status, out, _ = run_cli(capsys, "validate", "--rebuild", "--run-dir", run_dir,
                             "--config", cfg)
    assert status == 0
    [aside] = run_dir.glob("metadata.sqlite.before-rebuild-*")
    assert aside.read_bytes() == before and f"kept the previous database as {aside}" in out


def mtimes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


def test_read_only_commands_change_no_file_and_validate_dry_run_marks_nothing(
        run: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    cfg, run_dir = run
    newest = archive_tensors(run_dir / "checkpoints" / archive.checkpoint_name(10, 0))
    data = bytearray(newest.read_bytes())
    data[len(data) - 5] ^= 0x04
    newest.write_bytes(bytes(data))
    before, stamps = tree_digest(run_dir), mtimes(run_dir)

    status, out, err = run_cli(capsys, "validate", "--dry-run", "--run-dir", run_dir,
                               "--config", cfg)
    assert (status, err) == (1, "")
    assert [r["result"] for r in table(out)] == ["ok"] * 4 + ["CORRUPTED"]
    assert out.endswith("4 ok, 1 corrupted\ndry run: would mark 1 row(s) corrupted and 0 "
                        "pending row(s) valid; nothing changed\n")
    for command in (["ls"], ["recover", "--step", "6", "--dry-run"], ["prune", "--dry-run"]):
        status, out, err = run_cli(capsys, *command, "--run-dir", run_dir, "--config", cfg)
        assert (status, err) == (0, ""), command
    assert {r["status"] for r in table(out)} == {"valid"}  # prune's plan: nothing was marked
    assert tree_digest(run_dir) == before and mtimes(run_dir) == stamps


# --- the run's id: a copied or renamed directory keeps its history -----------------------------


def test_a_copied_run_dir_lists_and_prunes_its_history(
        run: tuple[Path, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg, run_dir = run
    with MetadataStore(run_dir / "metadata.sqlite", read_only=True) as store:
        assert store.run_ids() == {read_run_id(run_dir): 5}  # keyed by the id, not "run"
    copy = tmp_path / "pr"
    shutil.copytree(run_dir, copy)
    original = tree_digest(run_dir)

    status, out, _ = run_cli(capsys, "ls", "--run-dir", copy, "--config", cfg)
    assert status == 0
    assert [int(r["step"]) for r in table(out)] == [10, 8, 6, 4, 2]
    status, out, _ = run_cli(capsys, "prune", "--run-dir", copy, "--config", cfg)
    assert status == 0 and "removed 3 checkpoint(s)" in out
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == [
        archive.checkpoint_name(s, 0) for s in (4, 10)]
    assert tree_digest(run_dir) == original


def test_ls_says_when_the_rows_belong_to_another_run_id(
        run: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    cfg, run_dir = run
    recorded = read_run_id(run_dir)
    (run_dir / "run_id").write_text("0123456789abcdef")
    status, out, _ = run_cli(capsys, "ls", "--run-dir", run_dir, "--config", cfg)
    assert status == 0
    assert out.startswith(
        f"no checkpoints recorded for run id 0123456789abcdef; {run_dir / 'metadata.sqlite'} "
        f"has rows recorded under run id {recorded} (5 rows): it holds another run's history")
    assert "`ckptpilot validate --rebuild` records this run's published checkpoints" in out


def test_rows_keyed_by_the_folder_name_are_still_found(
        run: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """A directory whose rows predate its id: until its pilot re-keys them, they are the
    run's rows."""
    cfg, run_dir = run
    with MetadataStore(run_dir / "metadata.sqlite") as store:
        assert store.adopt_run_id(read_run_id(run_dir) or "", run_dir.name) == 5
    status, out, _ = run_cli(capsys, "ls", "--run-dir", run_dir, "--config", cfg)
    assert status == 0 and [int(r["step"]) for r in table(out)] == [10, 8, 6, 4, 2]
