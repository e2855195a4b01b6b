"""Retention during training and the disk budget (issue 16, points 1 and 2): a real pilot,
real files, real SQLite; a child killed with SIGKILL half-way through a background prune; a
budget on a small file system (a tmpfs when this process may mount one)."""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from helpers import assert_states_bit_equal

from ckptpilot import CheckpointPilot, load_policy
from ckptpilot.retention.plan import plan_room
from ckptpilot.storage.metadata import MetadataStore
from ckptpilot.tiers.remote import archive
from ckptpilot.tiers.remote.store import RemoteTier

SCHEDULER = {"base_interval": 2, "min_interval": 1, "max_interval": 100, "young_daly": False,
             "organ_every": 3, "weights": {"loss": 1.0, "grad": 0.0, "system": 0.0},
             "loss": {"slope_threshold": 1000.0}}


def write_policy(path: Path, **retention: object) -> Path:
    path.write_text(yaml.safe_dump({
        "scheduler": SCHEDULER,
        "observability": {"tensorboard": False, "decision_log": False},
        "validation": {"load_test": "none"},
        "tiers": {"memory": {"enabled": False}},
        "retention": {"routine_keep": 1, "important_keep": 1, **retention},
    }))
    return path


class Run:
    """A tiny model trained through a pilot; ``width`` sets the checkpoint size."""

    def __init__(self, policy: Path, run_dir: Path, width: int = 16) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
                                         torch.nn.Linear(width, 2))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.gen = torch.Generator().manual_seed(3)
        self.pilot = CheckpointPilot(load_policy(policy, run_dir=run_dir), model=self.model,
                                     optimizer=self.opt)
        self.remote = RemoteTier(str(run_dir / "checkpoints"))

    def step(self) -> None:
        self.opt.zero_grad()
        loss = self.model(torch.randn(4, 8, generator=self.gen)).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.pilot.observe(loss)

    def on_disk(self) -> list[int]:
        return sorted(s for s, _ in archive.list_archives(self.remote, 0).published)

    def disk_bytes(self) -> int:
        root = Path(self.remote.root)
        return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) \
            if root.exists() else 0

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def rows(run_dir: Path) -> dict[int, str]:
    with MetadataStore(run_dir / "metadata.sqlite", read_only=True) as store:
        return {r.step: r.status.value for r in store.rows()}


def test_checkpoints_on_disk_stay_within_the_policy_while_training(tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "p.yaml", best={"metric": "val", "mode": "min", "keep": 1})
    run = Run(policy, tmp_path / "run")
    # Per level (pulse, organ): one routine + one important; plus the best; plus the one
    # before the newest (keep_last 2); plus the save in flight, which its own prune removes
    # the previous of.
    bound = 2 * (1 + 1) + 1 + 1 + 1
    seen = []
    for step in range(1, 41):
        run.step()
        if step == 6:
            run.pilot.report_metric("val", 0.1)  # the best: must survive to the end
        elif step % 10 == 0:
            run.pilot.report_metric("val", 1.0 + step)
        run.pilot.flush()  # the background prune of this step's save has run
        seen.append(len(run.on_disk()))
        assert seen[-1] <= bound, (step, run.on_disk())
    run.pilot.close()
    saved = [r.step for r in run.pilot.saves]
    assert len(saved) >= 20 and max(seen) <= bound < len(saved)
    kept = run.on_disk()
    assert 6 in kept and 40 in kept  # best-N and the newest survive
    statuses = rows(tmp_path / "run")
    assert all(statuses[s] == "valid" for s in kept)
    assert all(statuses[s] == "expired" for s in saved if s not in kept)


def test_auto_off_keeps_everything(tmp_path: Path) -> None:
    run = Run(write_policy(tmp_path / "p.yaml", auto=False), tmp_path / "run")
    for _ in range(12):
        run.step()
    run.pilot.close()
    assert run.on_disk() == sorted({r.step for r in run.pilot.saves})


CHILD = textwrap.dedent("""\
    import os, signal, sys
    sys.path.insert(0, sys.argv[3])
    from test_autoprune import Run
    from ckptpilot.tiers.remote import store as remote_module

    real = remote_module.RemoteTier.remove
    def killed_mid_prune(self, name, **checkpoint):
        # The row is already expired (committed); the files are not removed yet.
        os.kill(os.getpid(), signal.SIGKILL)

    from pathlib import Path
    run = Run(Path(sys.argv[1]), Path(sys.argv[2]))
    for step in range(1, 5):
        run.step()
        run.pilot.flush()
    remote_module.RemoteTier.remove = killed_mid_prune
    for step in range(5, 30):
        run.step()
        run.pilot.flush()
    """)


def test_a_prune_killed_half_way_loses_nothing_and_the_next_finishes_it(tmp_path: Path) -> None:
    policy, run_dir = write_policy(tmp_path / "p.yaml"), tmp_path / "run"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    child = subprocess.run([sys.executable, str(script), str(policy), str(run_dir),
                            str(Path(__file__).parent)], capture_output=True, timeout=600)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    statuses = rows(run_dir)
    with MetadataStore(run_dir / "metadata.sqlite", read_only=True) as store:
        half_done = [r.step for r in store.rows(status="expired") if r.removed_at is None]
    assert len(half_done) == 1  # marked expired, then killed before its files went
    remote = RemoteTier(str(run_dir / "checkpoints"))
    name = archive.checkpoint_name(half_done[0], 0)
    assert remote.exists(name)
    newest_valid = max(s for s, st in statuses.items() if st == "valid")

    run = Run(policy, run_dir)
    assert run.pilot.restore() == newest_valid  # nothing valid was lost
    for _ in range(4):
        run.step()
    run.pilot.close()
    assert not remote.exists(name)  # the next prune finished the removal
    with MetadataStore(run_dir / "metadata.sqlite", read_only=True) as store:
        repaired = [e for e in store.audit_log("repair")
                    if e.details.get("step") == half_done[0]]
    assert repaired and repaired[0].details["file_was_present"] is True
    for step, status in rows(run_dir).items():
        assert remote.exists(archive.checkpoint_name(step, 0)) == (status == "valid"), step


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs where this process may mount one (root), else a plain directory: the
    assertions hold for both, the tmpfs also proves there is no ENOSPC."""
    target = tmp_path / "small"
    target.mkdir()
    mounted = shutil.which("mount") is not None and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(target)],
        capture_output=True).returncode == 0
    try:
        yield target
    finally:
        if mounted:
            subprocess.run(["umount", str(target)], check=True)


def test_a_disk_budget_trains_far_beyond_the_disk_and_restores_bit_exact(
        tmp_path: Path, small_fs: Path) -> None:
    budget = 6 << 20  # the newest two checkpoints (keep_last), the one being written, a margin
    policy = write_policy(tmp_path / "p.yaml", max_bytes=budget)
    run_dir = tmp_path / "run"
    policy_data = yaml.safe_load(policy.read_text())
    policy_data["tiers"]["remote"] = {"url": str(small_fs / "checkpoints")}
    policy.write_text(yaml.safe_dump(policy_data))
    run = Run(policy, run_dir, width=10_000)  # 0.44 MB of model + 0.88 MB of AdamW moments
    for _ in range(40):
        run.step()
        run.pilot.flush()
        assert run.disk_bytes() <= budget
    run.pilot.close()
    written = sum(r.bytes for r in run.pilot.saves)
    assert written > 2.5 * (8 << 20)  # far more than the file system holds
    assert all(r.status == "valid" for r in run.pilot.saves)
    final = run.state()

    again = Run(policy, run_dir, width=10_000)
    assert again.pilot.restore() == 40
    assert_states_bit_equal(again.state(), final)
    again.pilot.close(save=False)


def test_a_save_that_cannot_fit_is_refused_and_training_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    policy = write_policy(tmp_path / "p.yaml", max_bytes=1 << 20)
    run = Run(policy, tmp_path / "run", width=4000)  # one save is over 1 MiB
    with caplog.at_level(logging.ERROR, logger="ckptpilot"):
        for _ in range(6):
            run.step()
        run.pilot.close()
    assert run.pilot.saves == []
    root = Path(run.remote.root)
    assert not root.exists() or not any(root.iterdir())  # not a byte of a refused save
    refusals = [r.message for r in caplog.records if "was not saved" in r.message]
    assert refusals and "retention.max_bytes 1048576" in refusals[0]
    with MetadataStore(tmp_path / "run" / "metadata.sqlite", read_only=True) as store:
        assert [e.details["step"] for e in store.audit_log("save-refused")] == [2, 4, 6]
        assert store.rows() == []


class _Row:
    def __init__(self, id: int, step: int, cls: str, *, rank: int = 0, level: str = "pulse",
                 status: str = "valid", size: int = 10, base: int | None = None,
                 metric: float | None = None) -> None:
        self.id, self.step, self.rank, self.level = id, step, rank, level
        self.run_id, self.tier, self.location = "r", "remote", f"s{step}"
        self.status, self.retention_class, self.base_step = status, cls, base
        self.metric_name = None if metric is None else "val"
        self.metric_value, self.bytes_encoded = metric, size


def test_plan_room_removes_in_retention_order_and_never_what_is_protected() -> None:
    policy = load_policy(None).retention.model_copy(update={"important_keep": 9,
                                                            "routine_keep": 9, "keep_last": 1})
    rows = [_Row(1, 10, "important"), _Row(2, 20, "routine"), _Row(3, 30, "critical"),
            _Row(4, 40, "routine"), _Row(5, 50, "milestone"), _Row(6, 60, "routine"),
            _Row(7, 70, "routine", status="pending"), _Row(8, 80, "routine")]
    names = lambda plan: sorted(r.step for r, _ in plan.remove)  # noqa: E731
    assert names(plan_room(rows, policy, 0)) == []
    assert names(plan_room(rows, policy, 15)) == [20, 40]  # routine, oldest first
    assert names(plan_room(rows, policy, 35)) == [10, 20, 40, 60]  # then important
    # then critical; never the milestone, the pending save nor the newest valid (80)
    assert names(plan_room(rows, policy, 10_000)) == [10, 20, 30, 40, 60]
    last_two = policy.model_copy(update={"keep_last": 2})
    assert names(plan_room(rows, last_two, 10_000)) == [10, 20, 30, 40]  # 60 is a fallback
    with_base = [*rows, _Row(9, 90, "routine", base=20, level="delta")]
    assert 20 not in names(plan_room(with_base, policy, 15))  # a delta's base stays


def test_plan_room_takes_every_rank_of_a_step_together() -> None:
    policy = load_policy(None).retention.model_copy(update={"routine_keep": 9})
    rows = [_Row(1, 10, "routine", rank=0), _Row(2, 10, "routine", rank=1),
            _Row(3, 20, "routine", rank=0), _Row(4, 20, "routine", rank=1),
            _Row(5, 30, "routine", rank=0), _Row(6, 30, "routine", rank=1)]
    plan = plan_room(rows, policy, 5)
    assert sorted((r.step, r.rank) for r, _ in plan.remove) == [(10, 0), (10, 1)]
