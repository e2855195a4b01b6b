"""Nothing but a checkpoint is deleted on an object store either (issue 28, point 1): a real
S3-compatible server (the ``moto`` server process of ``test_s3``), rows tampered with
``sqlite3``, the prune of ``ckptpilot prune``."""

from __future__ import annotations

import io
import sqlite3
from pathlib import Path

import pytest
from test_s3 import _model, _options, _policy_file, _train, bucket, s3_endpoint

from ckptpilot import CheckpointPilot, load_policy
from ckptpilot.cli import ops
from ckptpilot.tiers.remote import archive

pytestmark = pytest.mark.integration
s3fs = pytest.importorskip("s3fs")
__all__ = ["bucket", "s3_endpoint"]  # the fixtures, used by name


def _objects(fs: object, prefix: str) -> dict[str, bytes]:
    return {p: fs.cat_file(p) for p in fs.find(prefix)}  # type: ignore[attr-defined]


def test_a_row_pointing_at_the_prefixs_parent_on_s3_is_refused_and_nothing_is_deleted(
        tmp_path: Path, s3_endpoint: str, bucket: str) -> None:
    cfg = _policy_file(tmp_path, s3_endpoint, bucket)
    policy = load_policy(cfg, run_dir=tmp_path / "run")
    model, opt = _model()
    with CheckpointPilot(policy, model=model, optimizer=opt) as pilot:
        _train(pilot, model, opt, 10)
    steps = sorted(r.step for r in pilot.saves)
    fs = s3fs.S3FileSystem(**_options(s3_endpoint), skip_instance_cache=True)
    assert steps == [3, 6, 9, 10]  # a prune removes 3 (routine beyond newest 1), keeps the rest
    sibling = f"{bucket}/runs/sibling/{archive.checkpoint_name(6, 0)}"
    fs.pipe(f"{sibling}/state.json", b"{}")
    fs.pipe(f"{bucket}/runs/notes.txt", b"keep me")
    everything = _objects(fs, bucket)
    db_path = tmp_path / "run" / "metadata.sqlite"
    with sqlite3.connect(db_path) as db:
        (true_location,) = db.execute(
            "select location from checkpoints where step = 3").fetchone()

    def prune_with_location(location: str) -> tuple[int, str]:
        with sqlite3.connect(db_path) as db:
            db.execute("update checkpoints set location = ? where step = 3", (location,))
        out = io.StringIO()
        status = ops.prune(policy, dry_run=False, out=out)
        fs.invalidate_cache()
        return status, out.getvalue()

    tampered = f"{bucket}/runs/exp1/.."
    status, text = prune_with_location(tampered)
    assert status == 1
    assert (f"step 3, rank 0, remote, location {tampered}: {tampered}: has a '.' or '..' "
            "component") in text and text.rstrip().endswith("nothing was deleted")
    assert _objects(fs, bucket) == everything

    status, text = prune_with_location(sibling)
    assert status == 1
    assert "the name is of step 6, rank 0, not of step 3, rank 0; nothing was deleted" in text
    assert _objects(fs, bucket) == everything

    status, text = prune_with_location(true_location)
    assert status == 0, text
    left = _objects(fs, bucket)
    first = f"{bucket}/runs/exp1/{archive.checkpoint_name(3, 0)}/"
    assert left == {p: b for p, b in everything.items() if not p.startswith(first)}
