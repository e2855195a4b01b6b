"""Nothing but a checkpoint is ever deleted (issue 28, point 1): every deleting path ends in
``RemoteTier.remove``, which removes only an entry of the tier that has a checkpoint's name
and holds that checkpoint's manifest (``tiers.remote.entries``), renamed out of its name before its
files go. Real run directories, real SQLite tampered with ``sqlite3``, the real CLI in a
subprocess, real links and immutable files (``chattr +i``, which stops root too)."""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
import os
import re
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from test_autoprune import Run, write_policy
from test_runops import cli, make_pilot, policy_file, train, tree_digest

from ckptpilot.capture.state import TrainingComponents, capture
from ckptpilot.dcp.format import DCP_METADATA_FILE, dcp_name, parse_dcp_name
from ckptpilot.errors import CheckpointFormatError, RemovalRefusedError
from ckptpilot.storage.metadata import MetadataStore
from ckptpilot.tiers.remote import archive, entries
from ckptpilot.tiers.remote.store import RemoteTier

PACKAGE = Path(__file__).resolve().parent.parent / "ckptpilot"


@pytest.fixture
def trained(tmp_path: Path) -> tuple[Path, Path]:
    """Saves at steps 2, 4, 6, 8, 10; a prune keeps 4 (best val_loss) and 10 (newest)."""
    cfg, run_dir = policy_file(tmp_path), tmp_path / "run"
    pilot, model, opt = make_pilot(cfg, run_dir)
    pilot.restore()
    train(pilot, model, opt, 4)
    pilot.report_metric("val_loss", 0.5)
    train(pilot, model, opt, 2)
    pilot.report_metric("val_loss", 0.9)
    train(pilot, model, opt, 4)
    pilot.close()
    return cfg, run_dir


def ckpt(run_dir: Path, step: int, rank: int = 0) -> Path:
    return run_dir / "checkpoints" / archive.checkpoint_name(step, rank)


def set_location(run_dir: Path, step: int, location: str | Path) -> None:
    """Tamper with the metadata the way a damaged row or a buggy writer would."""
    with sqlite3.connect(run_dir / "metadata.sqlite") as db:
        changed = db.execute("update checkpoints set location = ? where step = ?",
                             (str(location), step)).rowcount
    assert changed == 1


def statuses(run_dir: Path) -> dict[int, str]:
    with MetadataStore(run_dir / "metadata.sqlite", read_only=True) as store:
        return {r.step: r.status.value for r in store.rows()}


def digests(*paths: Path) -> dict[Path, str]:
    return {p: tree_digest(p) for p in paths}


def prune(cfg: Path, run_dir: Path) -> subprocess.CompletedProcess[str]:
    return cli("prune", "--run-dir", run_dir, "--config", cfg)


# --- a row whose location is not its checkpoint ------------------------------------------------


def test_a_row_pointing_at_the_checkpoints_parent_is_refused_and_nothing_is_deleted(
        trained: tuple[Path, Path]) -> None:
    cfg, run_dir = trained
    tampered = f"{run_dir}/checkpoints/.."
    set_location(run_dir, 2, tampered)
    kept = digests(ckpt(run_dir, 2), ckpt(run_dir, 4), ckpt(run_dir, 10))
    ledger = (run_dir / "ledger_rank_00000.jsonl").read_bytes()

    out = prune(cfg, run_dir)

    assert out.returncode == 1, out.stderr
    refused = [line for line in out.stdout.splitlines() if "refused:" in line]
    assert len(refused) == 1
    assert (f"step 2, rank 0, remote, location {tampered}: {tampered}: has a '.' or '..' "
            "component" in refused[0] and refused[0].endswith("nothing was deleted"))
    assert "refused 1" in out.stdout
    assert run_dir.is_dir() and (run_dir / "metadata.sqlite").is_file()
    assert (run_dir / "ledger_rank_00000.jsonl").read_bytes() == ledger
    assert digests(*kept) == kept  # the refused row's checkpoint and the kept ones
    assert statuses(run_dir) == {10: "valid", 8: "expired", 6: "expired", 4: "valid",
                                 2: "valid"}  # the others were pruned; row 2 is as it was
    assert not ckpt(run_dir, 6).exists() and not ckpt(run_dir, 8).exists()

    again = prune(cfg, run_dir)  # refused again, never silently forgotten
    assert again.returncode == 1 and "refused 1" in again.stdout
    assert digests(*kept) == kept


def test_a_row_pointing_outside_the_run_never_reaches_outside(
        trained: tuple[Path, Path], tmp_path: Path) -> None:
    cfg, run_dir = trained
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data.bin").write_bytes(b"not a checkpoint")
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(ckpt(run_dir, 6), elsewhere / archive.checkpoint_name(6, 0))
    set_location(run_dir, 2, outside)
    set_location(run_dir, 6, elsewhere / archive.checkpoint_name(6, 0))
    before = digests(outside, elsewhere, ckpt(run_dir, 2))

    out = prune(cfg, run_dir)

    assert out.returncode == 1
    assert (f"step 2, rank 0, remote, location {outside}: {run_dir / 'checkpoints'}/precious: "
            "'precious' is not a checkpoint's name") in out.stdout
    assert digests(*before) == before
    # A location is resolved by its name inside the tier's root, as every reader does (a
    # copied run's rows keep their old prefix): step 6's own checkpoint went, the copy
    # outside did not.
    assert not ckpt(run_dir, 6).exists()
    assert statuses(run_dir)[6] == "expired" and statuses(run_dir)[2] == "valid"


def test_a_row_pointing_at_a_sibling_runs_checkpoint_never_touches_it(
        trained: tuple[Path, Path], tmp_path: Path) -> None:
    cfg, run_dir = trained
    sibling = tmp_path / "sibling"
    shutil.copytree(run_dir, sibling)
    before = tree_digest(sibling)
    set_location(run_dir, 2, ckpt(sibling, 10))

    out = prune(cfg, run_dir)

    assert out.returncode == 1
    assert ("the name is of step 10, rank 0, not of step 2, rank 0; nothing was deleted"
            in out.stdout)
    assert tree_digest(sibling) == before
    assert ckpt(run_dir, 2).is_dir() and ckpt(run_dir, 10).is_dir()


@pytest.mark.parametrize("name", ["notes", "step_00000002_rank_00000.bak",
                                  "step_2_rank_0", "step_00000002_rank_00000.staging-x"])
def test_a_name_that_is_not_a_checkpoints_is_refused(trained: tuple[Path, Path],
                                                     name: str) -> None:
    cfg, run_dir = trained
    target = run_dir / "checkpoints" / name
    shutil.copytree(ckpt(run_dir, 2), target)
    set_location(run_dir, 2, target)
    before = digests(target, ckpt(run_dir, 2))

    out = prune(cfg, run_dir)

    assert out.returncode == 1
    assert f"{target}: {name!r} is not a checkpoint's name" in out.stdout
    assert digests(*before) == before


def test_a_manifest_naming_another_step_is_refused(trained: tuple[Path, Path]) -> None:
    """Step 10's bytes under step 2's name (a copy gone wrong): the name fits the row, the
    manifest does not, so nothing is deleted."""
    cfg, run_dir = trained
    shutil.rmtree(ckpt(run_dir, 2))
    shutil.copytree(ckpt(run_dir, 10), ckpt(run_dir, 2))
    before = digests(ckpt(run_dir, 2), ckpt(run_dir, 10))

    out = prune(cfg, run_dir)

    assert out.returncode == 1
    assert (f"{ckpt(run_dir, 2)}: its manifest.json names 'step_00000010_rank_00000' "
            "(step 10, rank 0), not step_00000002_rank_00000" in out.stdout)
    assert digests(*before) == before


def test_a_manifest_naming_another_rank_is_refused(tmp_path: Path) -> None:
    tier = RemoteTier(str(tmp_path / "ckpt"))
    snap = archive.write_organ(tier, _snapshot(4, rank=0))
    path = Path(tier.path(snap.name))
    manifest = json.loads((path / archive.MANIFEST_FILE).read_text())
    (path / archive.MANIFEST_FILE).write_text(json.dumps({**manifest, "rank": 1}))
    before = tree_digest(path)
    with pytest.raises(RemovalRefusedError, match=r"names 'step_00000004_rank_00000' "
                       r"\(step 4, rank 1\), not step_00000004_rank_00000"):
        tier.remove(snap.name, step=4, rank=0)
    with pytest.raises(RemovalRefusedError, match="not of step 4, rank 1"):
        tier.remove(snap.name, step=4, rank=1)
    assert tree_digest(path) == before


# --- links -------------------------------------------------------------------------------------


def test_a_symlinked_step_directory_is_never_read_and_pruning_removes_only_the_link(
        trained: tuple[Path, Path], tmp_path: Path) -> None:
    cfg, run_dir = trained
    target = tmp_path / "elsewhere"
    shutil.move(ckpt(run_dir, 2), target)
    ckpt(run_dir, 2).symlink_to(target, target_is_directory=True)
    before = tree_digest(target)

    out = cli("validate", "--run-dir", run_dir, "--config", cfg)
    assert out.returncode == 1
    assert (f"{ckpt(run_dir, 2)}: a symbolic link (to {target}); a checkpoint is never read "
            "through a link") in out.stdout
    assert statuses(run_dir)[2] == "corrupted"

    out = prune(cfg, run_dir)
    assert out.returncode == 0, out.stdout
    assert not os.path.lexists(ckpt(run_dir, 2))
    assert tree_digest(target) == before
    assert statuses(run_dir)[2] == "expired"


def test_a_symlink_inside_a_checkpoint_is_refused_for_read_and_validate(
        trained: tuple[Path, Path], tmp_path: Path) -> None:
    """The link points at an identical copy, so only the link check can catch it."""
    cfg, run_dir = trained
    state = ckpt(run_dir, 10) / archive.STATE_FILE
    outside = tmp_path / "state-elsewhere.json"
    shutil.copy(state, outside)
    state.unlink()
    state.symlink_to(outside)
    tier = RemoteTier(str(run_dir / "checkpoints"))
    name = archive.checkpoint_name(10, 0)
    message = f"{state}: a symbolic link (to {outside}); a checkpoint is never read through"
    with pytest.raises(CheckpointFormatError, match=_re(message)):
        archive.read_organ(tier, name)
    with pytest.raises(CheckpointFormatError, match=_re(message)):
        archive.read_manifest(tier, name)

    out = cli("validate", "--run-dir", run_dir, "--config", cfg)
    assert out.returncode == 1 and message in out.stdout
    assert statuses(run_dir)[10] == "corrupted"
    pilot, _, _ = make_pilot(cfg, run_dir)
    assert pilot.restore() == 8  # walked back past the linked checkpoint
    pilot.close(save=False)

    before = outside.read_bytes()
    out = prune(cfg, run_dir)
    assert out.returncode == 0, out.stdout
    assert not ckpt(run_dir, 10).exists() and outside.read_bytes() == before


def test_debris_holding_a_link_is_refused_and_the_link_target_kept(tmp_path: Path) -> None:
    tier = RemoteTier(str(tmp_path / "ckpt"))
    staging = tier.new_staging(archive.checkpoint_name(3, 0))
    outside = tmp_path / "victim.bin"
    outside.write_bytes(b"x" * 100)
    (Path(tier.path(staging)) / archive.TENSORS_FILE).symlink_to(outside)
    with pytest.raises(RemovalRefusedError, match=_re(
            "holds a link 'tensors.safetensors' and no readable manifest.json")):
        tier.remove(staging)
    assert outside.read_bytes() == b"x" * 100 and os.path.lexists(tier.path(staging))


# --- the order: out of the published name first -----------------------------------------------


@contextmanager
def immutable(path: Path) -> Iterator[None]:
    """``chattr +i``: the one permission root cannot write through (chmod does not stop
    root). Skips where the file system has no such attribute (tmpfs, overlay)."""
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"chattr +i unsupported here: {done.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=path.exists())


def test_pruning_an_immutable_checkpoints_dir_never_leaves_a_half_removed_published_step(
        trained: tuple[Path, Path]) -> None:
    cfg, run_dir = trained
    root = run_dir / "checkpoints"
    before = tree_digest(root)
    with immutable(root):
        out = prune(cfg, run_dir)
        assert out.returncode == 1
        assert (f"cannot remove {ckpt(run_dir, 2)}: moving it out of its name failed "
                "(Operation not permitted); nothing was removed") in out.stdout
        assert tree_digest(root) == before  # every step whole, manifest and data
    out = prune(cfg, run_dir)  # the failed rows were left expired: this prune finishes them
    assert out.returncode == 0, out.stdout
    assert sorted(p.name for p in root.iterdir()) == [
        archive.checkpoint_name(s, 0) for s in (4, 10)]


def test_a_removal_cut_short_leaves_debris_that_the_next_prune_removes(
        trained: tuple[Path, Path]) -> None:
    """A file that cannot be unlinked stops the removal after the rename: what is left has
    a name every listing takes for debris, never step 2's published name."""
    cfg, run_dir = trained
    root = run_dir / "checkpoints"
    stuck = next(p for p in ckpt(run_dir, 2).iterdir() if p.name.startswith("tensors."))
    with immutable(stuck):
        try:
            out = prune(cfg, run_dir)
        finally:  # the file moved with its directory: take the attribute off where it is
            left = [p.name for p in root.iterdir() if p.name.startswith("step_00000002")]
            for name in left:
                subprocess.run(["chattr", "-i", str(root / name / stuck.name)], check=False)
            stuck = root / left[0] / stuck.name
        assert out.returncode == 1
        assert len(left) == 1 and left[0].startswith(
            f"step_00000002_rank_00000{entries.REMOVING_MARK}")
        assert (f"{ckpt(run_dir, 2)}: moved to {root / left[0]}, then removing it failed "
                "(Operation not permitted") in out.stdout
    tier = RemoteTier(str(root))
    listing = archive.list_archives(tier, 0)
    assert 2 not in [s for s, _ in listing.published] and left[0] in listing.staging
    shown = cli("validate", "--run-dir", run_dir, "--config", cfg)
    assert f"unfinished save(s) left by killed writers: {left[0]}" in shown.stdout
    out = prune(cfg, run_dir)
    assert out.returncode == 0, out.stdout
    assert "removed 1 leftover(s) of interrupted removals" in out.stdout
    assert sorted(p.name for p in root.iterdir()) == [
        archive.checkpoint_name(s, 0) for s in (4, 10)]
    assert statuses(run_dir)[2] == "expired"


def test_on_an_object_store_the_manifest_goes_first(tmp_path: Path) -> None:
    """No rename there: the commit file is the publication, so removing it first unpublishes
    the checkpoint; a removal cut short after it leaves an unfinished save."""
    tier = RemoteTier(f"memory://{tmp_path.name}/objects")
    name = archive.write_organ(tier, _snapshot(5)).name
    deleted: list[str] = []
    real_rm = tier.fs.rm

    def cut_short(path: str, recursive: bool = False, **kw: object) -> None:
        deleted.append(path.rsplit("/", 1)[-1])
        if recursive:
            raise OSError("connection reset")
        real_rm(path, recursive=recursive, **kw)

    tier.fs.rm = cut_short  # type: ignore[method-assign]
    with pytest.raises(OSError, match="connection reset"):
        tier.remove(name, step=5, rank=0)
    tier.fs.rm = real_rm  # type: ignore[method-assign]
    assert deleted == [archive.MANIFEST_FILE, name]
    listing = archive.list_archives(tier, 0)
    assert listing.published == [] and listing.staging == [name]
    tier.remove(name)  # the debris rule: only files a writer writes, no manifest
    assert not tier.exists(name)
    with pytest.raises(RemovalRefusedError, match=_re("has a '.' or '..' component")):
        entries.location_entry(f"{tier.root}/..")
    with pytest.raises(RemovalRefusedError, match=_re("'..' is not a checkpoint's name")):
        tier.remove("..")


# --- the same rule on every deleting path ------------------------------------------------------


def test_retention_during_training_refuses_a_tampered_row(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    policy, run_dir = write_policy(tmp_path / "p.yaml", auto=False), tmp_path / "run"
    run = Run(policy, run_dir)
    for _ in range(12):
        run.step()
    run.pilot.close()
    first = min(statuses(run_dir))
    tampered = f"{run_dir}/checkpoints/.."
    set_location(run_dir, first, tampered)
    victim = tree_digest(ckpt(run_dir, first))

    caplog.set_level(logging.WARNING, logger="ckptpilot")
    auto = write_policy(tmp_path / "auto.yaml", auto=True)
    again = Run(auto, run_dir)
    again.pilot.restore()
    for _ in range(6):
        again.step()
    again.pilot.close()

    assert tree_digest(ckpt(run_dir, first)) == victim
    assert (run_dir / "metadata.sqlite").is_file()
    assert (run_dir / "ledger_rank_00000.jsonl").is_file()
    assert statuses(run_dir)[first] == "valid"
    refusals = [r.getMessage() for r in caplog.records if "refused:" in r.getMessage()]
    assert refusals and all(f"step {first}, rank 0, remote, location {tampered}" in m
                            for m in refusals)
    assert len(again.on_disk()) < len(statuses(run_dir))  # the other rows were pruned


def test_recover_then_prune_removes_what_recover_set_aside_and_refuses_a_tampered_row(
        trained: tuple[Path, Path]) -> None:
    cfg, run_dir = trained
    root = run_dir / "checkpoints"
    out = cli("recover", "--step", "6", "--run-dir", run_dir, "--config", cfg)
    assert out.returncode == 0, out.stderr
    aside = {int(p.name[5:13]): p for p in root.iterdir()
             if ".abandoned-by-recover-6-" in p.name}
    assert sorted(aside) == [8, 10]
    set_location(run_dir, 8, root / "..")
    before = tree_digest(aside[8])

    out = prune(cfg, run_dir)

    assert out.returncode == 1
    assert f"step 8, rank 0, remote, location {root / '..'}" in out.stdout
    assert not aside[10].exists()  # the set-aside name form is a checkpoint's
    assert tree_digest(aside[8]) == before and run_dir.is_dir()


def test_the_restorer_removes_only_debris_that_is_a_checkpoints(tmp_path: Path) -> None:
    """Staging directories a killed writer left go on the next restore; a directory under
    a staging-like name holding anything else stays (and the restore goes on)."""
    cfg, run_dir = policy_file(tmp_path), tmp_path / "run"
    pilot, model, opt = make_pilot(cfg, run_dir)
    pilot.restore()
    train(pilot, model, opt, 4)
    pilot.close()
    tier = RemoteTier(str(run_dir / "checkpoints"))
    real = tier.new_staging(archive.checkpoint_name(5, 0))
    (Path(tier.path(real)) / archive.STATE_FILE).write_text("{}")
    strange = Path(tier.path(tier.new_staging(archive.checkpoint_name(6, 0))))
    (strange / "thesis.tex").write_text("not a checkpoint's file")
    again, _, _ = make_pilot(cfg, run_dir)
    assert again.restore() == 4
    again.close(save=False)
    assert not os.path.lexists(tier.path(real))
    assert (strange / "thesis.tex").read_text() == "not a checkpoint's file"


def test_a_dcp_directory_is_removed_only_for_a_rank_its_manifest_has(tmp_path: Path) -> None:
    tier = RemoteTier(str(tmp_path / "ckpt"))
    name = dcp_name(4)
    path = Path(tier.path(name))
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"0" * 10)
    (path / DCP_METADATA_FILE).write_bytes(b"m")
    (path / archive.MANIFEST_FILE).write_text(json.dumps(
        {"name": name, "step": 4, "world_size": 1, "parts": {"0": "ab"}}))
    with pytest.raises(RemovalRefusedError, match="has no part of rank 3"):
        tier.remove(name, step=4, rank=3)
    with pytest.raises(RemovalRefusedError, match="not of step 6, rank 0"):
        tier.remove(name, step=6, rank=0)
    tier.remove(name, step=4, rank=0)
    assert not path.exists()


# --- one rule, one place -----------------------------------------------------------------------


def test_every_name_the_writers_make_is_one_the_removal_knows(tmp_path: Path) -> None:
    tier = RemoteTier(str(tmp_path / "ckpt"))
    names = [archive.checkpoint_name(12, 3), dcp_name(12)]
    for base in list(names):
        staging = tier.new_staging(base)
        names.append(staging)
        for why in ("replaced", "superseded", "corrupted", "abandoned-by-recover-7"):
            names.append(f"{base}.{why}-0123abcd")
            names.append(f"{staging}.{why}-0123abcd")  # retire_step sets staging aside
        names.append(f"{base}{entries.REMOVING_MARK}0123abcd")
    for name in names:
        entry = entries.parse_entry(name)
        assert entry is not None, name
        base = name.split(".", 1)[0]
        assert (entry.base, entry.published) == (base, name == base), name
        # The same step and rank as the readers' own parsers find in the base name.
        readers = archive.parse_checkpoint_name(base) or (parse_dcp_name(base), None)
        assert (entry.step, entry.rank) == readers == (12, 3 if entry.rank is not None
                                                       else None), name
    staged = Path(tier.path(tier.new_staging(archive.checkpoint_name(1, 0))))
    assert entries.is_debris(staged.name)
    aside = tier.set_aside(staged.name, "corrupted", label=archive.checkpoint_name(1, 0))
    assert entries.parse_entry(aside) is not None and not entries.is_debris(aside)
    with pytest.raises(ValueError, match=_re("'kept' is not a reason tiers.remote.entries knows")):
        tier.set_aside(aside, "kept")
    for written in (archive.TENSORS_FILE, archive.CONTAINER_FILE, archive.STATE_FILE,
                    archive.MANIFEST_FILE, DCP_METADATA_FILE, "__0_0.distcp", "__17_0.distcp"):
        assert entries.WRITTEN_FILES.match(written), written


DELETERS = {("shutil", "rmtree"), ("os", "remove"), ("os", "unlink"), ("os", "rmdir"),
            ("os", "removedirs")}
DELETING_METHODS = {"rm", "rm_file", "rmdir", "unlink", "delete", "rmtree"}
NOT_CHECKPOINTS = {
    "ckptpilot.tiers.remote.entries": "the one place checkpoints are deleted",
    "ckptpilot.probes.fsync": "its own probe file",
    "ckptpilot.rundir": "the temporary file of the run id's atomic creation",
    "ckptpilot.catalog": "the recover pin file",
    "ckptpilot.cli.demo": "the demo's own run directory, marked by it",
    "ckptpilot.fit": "fault injection in the scratch runs `ckptpilot fit` made",
    "ckptpilot.fit.harness": "the scratch runs and tiers `ckptpilot fit` made",
    "ckptpilot.fit.scenarios": "fault injection in the scratch runs `ckptpilot fit` made",
    "ckptpilot.fit.attacks": "the scratch run's metadata database, deleted by a scenario",
    "ckptpilot.fit.incidents": "the torchrun campaign's incidents destroy a scratch run's "
                               "checkpoints and database on purpose",
    "ckptpilot.tiers.peer.auth": "the temporary file of the peer secret's atomic creation",
}


def test_nothing_but_tiers_entries_deletes_checkpoint_files() -> None:
    """Every other deletion in the package is of a file that is no checkpoint's (the
    reasons above); a new one must go through ``RemoteTier.remove`` or be listed here.
    (``sa.delete`` builds an SQL statement: rows, never files.)"""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            owner = node.func.value
            base = owner.id if isinstance(owner, ast.Name) else None
            if (base, node.func.attr) in DELETERS or (
                    node.func.attr in DELETING_METHODS and base not in ("os", "shutil", "sa")):
                found.setdefault(module, []).append(f"{path.name}:{node.lineno}")
    unexplained = {m: where for m, where in found.items() if m not in NOT_CHECKPOINTS}
    assert unexplained == {}, unexplained
    assert "ckptpilot.tiers.remote.entries" in found  # the scan sees deletions at all


def _snapshot(step: int, rank: int = 0):  # type: ignore[no-untyped-def]
    torch.manual_seed(step)
    snap = capture(TrainingComponents(torch.nn.Linear(4, 2)), step=step)
    return dataclasses.replace(snap, meta={**snap.meta, "rank": rank})


def _re(text: str) -> str:
    return re.escape(text)
