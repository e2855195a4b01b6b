"""CheckpointPilot in process: interval saves, hook mode, back-pressure, errors, recovery."""

from __future__ import annotations

import contextlib
import json
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import archive_tensors

from ckptpilot import (
    CheckpointPilot,
    CheckpointWriteError,
    NoCheckpointError,
    RecoverySource,
    ResumableSampler,
)
from ckptpilot.tiers.remote import archive
from ckptpilot.tiers.remote.store import RemoteTier


def policy_file(tmp_path: Path, interval: int = 5, max_pending: int = 2, tb: bool = False,
                organ_every: int = 10, paranoid: bool = False) -> Path:
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        scheduler: {{base_interval: {interval}, min_interval: 1, max_interval: 100000,
                    grad: {{probe_every: 2}}, young_daly: false, organ_every: {organ_every},
                    weights: {{loss: 1.0, grad: 0.0, system: 0.0}},
                    loss: {{slope_threshold: 1000.0}}}}
        async: {{max_pending: {max_pending}}}
        observability: {{tensorboard: {str(tb).lower()}, decision_log: {str(tb).lower()}}}
        retention: {{auto: false}}
        validation: {{paranoid: {str(paranoid).lower()}}}
        """))  # these tests count and walk back over every save; see test_autoprune.py
    return cfg


class Job:
    def __init__(self, tmp_path: Path, width: int = 8, **policy: int | bool) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(),
                                         torch.nn.Linear(width, 1))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, 3)
        self.sampler = ResumableSampler(64, seed=1)
        self.x = torch.randn(64, 4, generator=torch.Generator().manual_seed(2))
        self.run_dir = tmp_path / "run"
        self.pilot = CheckpointPilot(policy_file(tmp_path, **policy), model=self.model,
                                     optimizer=self.opt, lr_scheduler=self.sched,
                                     data_state=self.sampler, run_dir=self.run_dir)

    def step(self, observe: bool = True) -> torch.Tensor:
        idx = self.sampler.take(8)
        self.opt.zero_grad()
        loss = self.model(self.x[idx]).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.sched.step()
        if observe:
            self.pilot.observe(loss)
        return loss

    def published(self) -> list[int]:
        tier = RemoteTier(str(self.run_dir / "checkpoints"))
        return sorted(s for s, _ in archive.list_archives(tier, 0).published)


def test_saves_on_the_base_interval_and_restores_the_newest(tmp_path: Path) -> None:
    job = Job(tmp_path, interval=5)
    assert job.pilot.restore() == 0
    assert job.pilot.last_recovery is not None
    assert job.pilot.last_recovery.source == RecoverySource.NONE
    for _ in range(12):
        job.step()
    job.pilot.close(save=False)  # the scheduler's saves only (close() would save step 12)
    assert job.published() == [5, 10]
    assert [r.step for r in job.pilot.saves] == [5, 10]
    assert all(r.bytes > 0 for r in job.pilot.saves)
    assert [r.level for r in job.pilot.saves] == ["pulse", "pulse"]  # organ_every: 10
    expected = {k: v.clone() for k, v in job.model.state_dict().items()}

    again = Job(tmp_path, interval=5)
    assert again.pilot.restore() == 10
    rec = again.pilot.last_recovery
    assert rec is not None and rec.source == "remote" and rec.step == 10
    assert rec.level == "pulse" and rec.location is not None and rec.location.endswith(
        "step_00000010_rank_00000")
    assert again.sampler.state_dict()["position"] == 80 % 64 and again.sampler.epoch == 1
    assert again.sched.last_epoch == 10
    for _ in range(2):
        again.step()
    for k, v in expected.items():
        assert torch.equal(v, again.model.state_dict()[k]), k
    again.pilot.close()


def test_hook_mode_saves_without_observe(tmp_path: Path) -> None:
    job = Job(tmp_path, interval=4)
    for _ in range(9):
        job.step(observe=False)
    job.pilot.close(save=False)
    assert job.published() == [4, 8]
    assert job.pilot.last_grad_norm is not None


def test_grad_norm_is_probed_in_the_hook(tmp_path: Path) -> None:
    job = Job(tmp_path, interval=100)
    job.step()
    assert job.pilot.last_grad_norm is None  # probe_every = 2
    idx = job.sampler.take(8)
    job.opt.zero_grad()
    job.model(job.x[idx]).pow(2).mean().backward()
    grads = [p.grad.clone() for p in job.model.parameters()]  # type: ignore[union-attr]
    job.opt.step()
    expected = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])).item()
    assert job.pilot.last_grad_norm == pytest.approx(expected, rel=1e-6)
    job.pilot.close()


def test_forced_save_is_decoupled_from_later_in_place_updates(tmp_path: Path) -> None:
    job = Job(tmp_path, width=2048, interval=1000)
    job.step()
    before = {k: v.clone() for k, v in job.model.state_dict().items()}
    assert job.pilot.save(reason="before surgery")
    assert not job.pilot.save()  # same step: nothing new to save
    with torch.no_grad():  # while the writer is (likely) still persisting
        for p in job.model.parameters():
            p.mul_(-3.0)
    job.pilot.close()
    fresh = Job(tmp_path, width=2048, interval=1000)
    assert fresh.pilot.restore() == 1
    for k, v in before.items():
        assert torch.equal(v, fresh.model.state_dict()[k]), k
    fresh.pilot.close()


def test_background_failure_surfaces_on_the_next_observe(tmp_path: Path) -> None:
    job = Job(tmp_path, interval=2)
    ckpt = job.run_dir / "checkpoints"
    assert not ckpt.exists()  # the first save creates it
    ckpt.write_text("not a directory")
    job.step()
    job.step()  # starts a save that fails in the background
    with pytest.raises(CheckpointWriteError, match=r"background save of step 2 .* failed"):
        for _ in range(50):
            time.sleep(0.01)
            job.step()
    # Saves queued after the failing one (a slow or niced writer thread lets training run
    # ahead) fail the same way; close() raises the first of them.
    with contextlib.suppress(CheckpointWriteError):
        job.pilot.close()
    with pytest.raises(RuntimeError, match="closed"):
        job.step()


def test_background_failure_surfaces_on_close(tmp_path: Path) -> None:
    job = Job(tmp_path, interval=1)
    (job.run_dir / "checkpoints").write_text("x")
    job.step()
    with pytest.raises(CheckpointWriteError, match="step 1"):
        job.pilot.close()


def test_a_background_failure_names_the_tier_it_happened_in(tmp_path: Path) -> None:
    """A save that fails on its way to the peers blames the peer tier, not the remote URL.
    The metadata database refuses peer rows (a trigger), so the failure happens before any
    byte is sent and needs no daemon."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        scheduler: {{base_interval: 500, young_daly: false}}
        tiers: {{peer: {{enabled: true, endpoints: ["{endpoint}"], data_shards: 1,
                        parity: false, timeout_seconds: 1, probe_interval: 0.2}}}}
        observability: {{tensorboard: false, decision_log: false}}
        """))
    model = torch.nn.Linear(4, 4)
    pilot = CheckpointPilot(cfg, model=model, run_dir=tmp_path / "run")
    with sqlite3.connect(tmp_path / "run" / "metadata.sqlite") as db:
        db.execute("CREATE TRIGGER no_peer_rows BEFORE INSERT ON checkpoints "
                   "WHEN NEW.tier = 'peer' BEGIN SELECT RAISE(ABORT, 'peer rows refused'); END")
    assert pilot.save("pulse")
    with pytest.raises(CheckpointWriteError,
                       match=rf"background save of step 0 to the peer tier \({endpoint}\) "
                             r"failed: .*peer rows refused") as caught:
        pilot.flush()
    assert pilot.remote.url not in str(caught.value)
    pilot.close()


def test_back_pressure_blocks_instead_of_queueing(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    original = RemoteTier.publish

    def slow_publish(self: RemoteTier, staging: str, final: str) -> None:
        release.wait(10)
        original(self, staging, final)

    monkeypatch.setattr(RemoteTier, "publish", slow_publish)
    job = Job(tmp_path, interval=1, max_pending=1)
    job.step()  # save 1 in flight, stuck in publish
    blocked = threading.Thread(target=job.step)  # save 2 must wait for a free slot
    blocked.start()
    blocked.join(0.5)
    assert blocked.is_alive(), "a second save started while max_pending=1 was in flight"
    release.set()
    blocked.join(120)  # a safety net: a busy box may take seconds
    assert not blocked.is_alive()
    job.pilot.close(save=False)
    assert [r.step for r in job.pilot.saves] == [1, 2]
    assert job.pilot.saves[1].stall_seconds >= 0.4


def test_recovery_walks_back_over_a_corrupt_newest(tmp_path: Path) -> None:
    job = Job(tmp_path, interval=3)
    for _ in range(9):
        job.step()
    job.pilot.close()
    newest = archive_tensors(job.run_dir / "checkpoints" / "step_00000009_rank_00000")
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))

    again = Job(tmp_path, interval=3)
    assert again.pilot.restore() == 6
    rec = again.pilot.last_recovery
    assert rec is not None and len(rec.skipped) == 1
    assert "step_00000009" in rec.skipped[0].location
    assert "mismatch" in rec.skipped[0].reason, rec.skipped[0].reason
    assert again.pilot.restore(step=3) == 3
    with pytest.raises(NoCheckpointError, match="no usable checkpoint of step 4"):
        again.pilot.restore(step=4)
    again.pilot.close()


def test_all_checkpoints_corrupt_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    job = Job(tmp_path, interval=2)
    for _ in range(4):
        job.step()
    job.pilot.close()
    for d in (job.run_dir / "checkpoints").iterdir():
        (d / archive.STATE_FILE).write_text("{}")
    again = Job(tmp_path, interval=2)
    with pytest.raises(NoCheckpointError, match="none of the 2 checkpoints"):
        again.pilot.restore()
    again.pilot.close()


def test_tensorboard_scalars_and_decision_log_are_written(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = Job(tmp_path, interval=2, tb=True)
    for _ in range(4):
        job.step()
    job.pilot.close()
    acc = EventAccumulator(str(job.run_dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"checkpoint/save_seconds", "checkpoint/bytes", "checkpoint/stall_seconds",
            "checkpoint/score", "checkpoint/interval", "checkpoint/level",
            "checkpoint/signal_loss", "checkpoint/signal_grad",
            "checkpoint/signal_system"} <= tags
    assert [e.step for e in acc.Scalars("checkpoint/bytes")] == [2, 4]
    assert all(e.value > 0 for e in acc.Scalars("checkpoint/bytes"))
    assert [(e.step, e.value) for e in acc.Scalars("checkpoint/level")
            if e.value > 0] == [(2, 1.0), (4, 1.0)]  # pulses
    decisions = [json.loads(line) for line in
                 (job.run_dir / "decisions_rank_00000.jsonl").read_text().splitlines()]
    assert [d["step"] for d in decisions] == [1, 2, 3, 4]
    assert [d["save"] for d in decisions] == [False, True, False, True]
    assert set(decisions[0]) == {"step", "save", "level", "interval", "score", "signals",
                                 "retention_class", "reason"}


MEMORY_PROBE = """
import resource, sys, time, torch
from ckptpilot import CheckpointPilot, load_policy
cfg, run_dir = sys.argv[1], sys.argv[2]
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)])  # ~100 MB
state = sum(p.numel() * 4 for p in model.parameters())
pilot = CheckpointPilot(load_policy(cfg), model=model, run_dir=run_dir)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
for step in range(1, 9):
    with torch.no_grad():
        model[0].weight.add_(1.0)
    pilot.observe(step=step)
pilot.close()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(state, peak - base, len(pilot.saves))
"""


@pytest.mark.parametrize("level", ["organ", "pulse"])
def test_peak_host_memory_stays_within_the_in_flight_bound(tmp_path: Path, level: str) -> None:
    max_pending = 2
    cfg = policy_file(tmp_path, interval=1, max_pending=max_pending,
                      organ_every=1 if level == "organ" else 1000)
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(cfg), str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    state, growth, saves = map(int, out.stdout.split())
    assert saves == 8
    # The live model is already counted in the baseline: the pilot may add at most
    # max_pending snapshots, and the bound of the issue, (max_pending + 1) x state, in total.
    # The memory tier holds the newest snapshot's own buffers, so it adds nothing. A pulse's
    # encoder also holds the encoded form of up to three tensors in flight (one sixth of the
    # state each here).
    bound = max_pending * state + (32 << 20)
    if level == "pulse":
        bound += 3 * state // 6
    assert growth <= bound, (growth / state)


def rot_after_writing(monkeypatch: pytest.MonkeyPatch, *, step: int) -> None:
    """The disk flips a bit of ``step``'s tensors file after the write returned."""
    import ckptpilot.tiers.remote.tier as tier_module

    original = tier_module.stage_organ

    def stage_then_rot(tier, snapshot, **kw):  # type: ignore[no-untyped-def]
        staged = original(tier, snapshot, **kw)
        if snapshot.step == step:
            path = archive_tensors(Path(tier.path(staged.staging)))
            data = bytearray(path.read_bytes())
            data[-2] ^= 0x20
            path.write_bytes(bytes(data))
        return staged

    monkeypatch.setattr(tier_module, "stage_organ", stage_then_rot)


def test_a_save_failing_validation_is_corrupted_and_never_the_recovery_point(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from ckptpilot.storage.metadata import MetadataStore

    rot_after_writing(monkeypatch, step=4)
    job = Job(tmp_path, interval=2, paranoid=True)  # re-reads what it wrote
    for _ in range(5):
        job.step()
    job.pilot.close(save=False)
    assert [(r.step, r.status) for r in job.pilot.saves] == [(2, "valid"), (4, "corrupted")]
    assert any("ALERT" in r.message and "step 4" in r.message for r in caplog.records)
    assert job.published() == [2]
    assert any(p.name.startswith("step_00000004_rank_00000.corrupted-")
               for p in (job.run_dir / "checkpoints").iterdir())
    with MetadataStore(job.run_dir / "metadata.sqlite") as store:
        row = store.get((job.pilot.run_id, 4, 0, "remote"))
        assert row is not None and row.status.value == "corrupted"
        assert "SHA256" in row.note
    again = Job(tmp_path, interval=2)
    assert again.pilot.restore() == 2
    again.pilot.close()


def test_rot_after_the_write_is_caught_by_the_restore_without_the_paranoid_mode(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """By default validation trusts the digests computed from the buffers written (no
    re-read): a bit flipped on disk after the write is found when the checkpoint is read,
    which walks back to the previous one and marks the rotten one corrupted."""
    from ckptpilot.storage.metadata import MetadataStore

    rot_after_writing(monkeypatch, step=4)
    job = Job(tmp_path, interval=2)
    for _ in range(5):
        job.step()
    job.pilot.close(save=False)
    assert [(r.step, r.status) for r in job.pilot.saves] == [(2, "valid"), (4, "valid")]
    again = Job(tmp_path, interval=2)
    assert again.pilot.restore() == 2
    skipped = again.pilot.last_recovery.skipped
    assert any("step_00000004" in s.location and "SHA256 mismatch" in s.reason
               for s in skipped), skipped
    again.pilot.close(save=False)
    with MetadataStore(job.run_dir / "metadata.sqlite") as store:
        row = store.get((job.pilot.run_id, 4, 0, "remote"))
        assert row is not None and row.status.value == "corrupted"
