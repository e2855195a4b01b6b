"""Pulses through the codecs on the remote tier, and the memory tier (in-process restore)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import assert_states_bit_equal

from ckptpilot import CheckpointPilot, RecoverySource
from ckptpilot.capture.state import HostBufferPool, Snapshot
from ckptpilot.codecs import read_index
from ckptpilot.rundir import read_run_id
from ckptpilot.storage.metadata import MetadataStore
from ckptpilot.tiers.base import CheckpointImage
from ckptpilot.tiers.memory import MemoryTier
from ckptpilot.tiers.remote import archive
from ckptpilot.tiers.remote.store import RemoteTier


def policy_file(tmp_path: Path, *, memory: bool = True, memory_max: str = "1GiB",
                weights: str = "xor_delta", bandwidth: str = "1MB", organ_every: int = 1000,
                pulse_fsync: bool = False) -> Path:
    """Every step saved, every save a pulse. A slow remote (1 MB/s) makes ``auto`` weigh
    codecs even for these small tensors (at 2 GB/s it sends anything under 2 MB raw)."""
    cfg = tmp_path / "policy.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        scheduler: {{base_interval: 1, min_interval: 1, max_interval: 100000,
                    young_daly: false, organ_every: {organ_every},
                    weights: {{loss: 1.0, grad: 0.0, system: 0.0}},
                    loss: {{slope_threshold: 1000.0}}}}
        codecs: {{weights: {weights}}}
        tiers: {{memory: {{enabled: {str(memory).lower()}, max_bytes: {memory_max}}},
                remote: {{bandwidth: {bandwidth}}}}}
        observability: {{tensorboard: false, decision_log: false}}
        retention: {{auto: false}}
        levels: {{pulse: {{fsync: {str(pulse_fsync).lower()}}}}}
        """))  # every save stays on disk to be inspected; see test_autoprune.py
    return cfg


class Job:
    def __init__(self, cfg: Path, run_dir: Path) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(),
                                         torch.nn.Linear(256, 8))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(128, 32, generator=torch.Generator().manual_seed(3))
        self.pilot = CheckpointPilot(cfg, model=self.model, optimizer=self.opt, run_dir=run_dir)
        self.t = 0

    def step(self, observe: bool = True) -> None:
        idx = torch.arange(self.t * 16, self.t * 16 + 16) % 128
        self.t += 1
        self.opt.zero_grad()
        self.model(self.x[idx]).pow(2).mean().backward()
        self.opt.step()
        if observe:
            self.pilot.observe()

    def state(self) -> dict[str, torch.Tensor]:
        out = {f"model/{k}": v.clone() for k, v in self.model.state_dict().items()}
        for pid, st in self.opt.state_dict()["state"].items():
            out.update({f"opt/{pid}/{k}": v.clone() for k, v in st.items()})
        return out


def test_fifty_pulses_then_a_restore_reads_one_state_bit_exactly(tmp_path: Path) -> None:
    cfg, run_dir = policy_file(tmp_path), tmp_path / "run"
    job = Job(cfg, run_dir)
    for _ in range(50):
        job.step()
    job.pilot.close()
    expected = job.state()
    saves = job.pilot.saves
    assert [r.level for r in saves] == ["pulse"] * 50 and saves[-1].step == 50

    newest = run_dir / "checkpoints" / archive.checkpoint_name(50, 0)
    assert (newest / archive.CONTAINER_FILE).exists()
    assert not (newest / archive.TENSORS_FILE).exists()
    with open(newest / archive.CONTAINER_FILE, "rb") as f:
        codecs = {e.name: e.codec for e in read_index(f).tensors}
    # To a slow tier the big float tensors compress; a pulse on a passive store is
    # self-contained, so the weights too go through auto, never a delta needing a base.
    assert codecs["model/0.weight"] in ("byteplane", "prefix_index")
    assert codecs["optimizer/state/0/exp_avg_sq"] in ("byteplane", "prefix_index")
    assert "xor_delta" not in codecs.values()
    with MetadataStore(run_dir / "metadata.sqlite") as store:
        row = store.get((read_run_id(run_dir), 50, 0, "remote"))
    assert row is not None and ("byteplane" in row.codec or "prefix_index" in row.codec)
    assert row.bytes_encoded < row.bytes_raw

    again = Job(cfg, run_dir)
    assert again.pilot.restore() == 50
    rec = again.pilot.last_recovery
    assert rec is not None and rec.source is RecoverySource.REMOTE and rec.level == "pulse"
    # Exactly one state was read — the newest pulse — no chain of deltas behind it.
    one_state = saves[-1].bytes_raw + (newest / archive.STATE_FILE).stat().st_size
    assert rec.bytes_read == saves[-1].bytes <= one_state
    assert_states_bit_equal(again.state(), expected)
    again.pilot.close()


def test_an_in_process_restore_comes_from_memory_and_aliases_nothing(tmp_path: Path) -> None:
    cfg, run_dir = policy_file(tmp_path), tmp_path / "run"
    job = Job(cfg, run_dir)
    for _ in range(6):
        job.step()
    job.pilot.flush()
    at_6 = job.state()
    for _ in range(3):  # diverge (e.g. a loss spike) without reaching a step boundary
        job.step(observe=False)
    assert job.pilot.restore() == 6
    rec = job.pilot.last_recovery
    assert rec is not None and rec.source is RecoverySource.MEMORY and rec.level == "pulse"
    assert rec.bytes_read == job.pilot.saves[-1].bytes_raw
    assert_states_bit_equal(job.state(), at_6)

    # The restored optimizer state must not share memory with the tier's buffers, which the
    # next captures reuse: train on, saving every step, and compare with a run that never
    # diverged nor restored, trained on the same batches.
    for _ in range(4):
        job.step()
    job.pilot.close()
    ref = Job(cfg, tmp_path / "ref")
    for _ in range(6):
        ref.step()
    ref.t = job.t - 4
    for _ in range(4):
        ref.step()
    ref.pilot.close()
    assert_states_bit_equal(job.state(), ref.state())


def test_a_state_over_max_bytes_is_not_kept_in_memory(tmp_path: Path) -> None:
    cfg, run_dir = policy_file(tmp_path, memory_max="1KiB"), tmp_path / "run"
    job = Job(cfg, run_dir)
    for _ in range(3):
        job.step()
    job.pilot.flush()
    assert job.pilot.memory is not None and job.pilot.memory.newest() is None
    assert job.pilot.restore() == 3
    rec = job.pilot.last_recovery
    assert rec is not None and rec.source is RecoverySource.REMOTE
    job.pilot.close()


def test_weights_with_a_fixed_codec_and_no_memory_tier(tmp_path: Path) -> None:
    cfg = policy_file(tmp_path, memory=False, weights="zstd", bandwidth="2GB")
    job = Job(cfg, tmp_path / "run")
    for _ in range(2):
        job.step()
    job.pilot.close()
    assert job.pilot.memory is None
    with open(tmp_path / "run" / "checkpoints" / archive.checkpoint_name(2, 0) /
              archive.CONTAINER_FILE, "rb") as f:
        codecs = {e.name: e.codec for e in read_index(f).tensors}
    assert {c for n, c in codecs.items() if n.startswith("model/")} == {"zstd"}
    # At 2 GB/s, tensors this small (< 2 MB) are not worth a trial: auto sends them raw.
    assert {c for n, c in codecs.items() if not n.startswith("model/")} == {"raw"}


def test_saves_over_max_bytes_under_back_pressure_stay_intact(tmp_path: Path) -> None:
    """Every save refused by the memory tier, two in flight: each published checkpoint still
    holds exactly its own step's weights (a buffer set handed out twice would mix them)."""
    cfg, run_dir = policy_file(tmp_path, memory_max="1KiB", bandwidth="2GB"), tmp_path / "run"
    job = Job(cfg, run_dir)
    expected = {}
    for step in range(1, 9):
        job.step()
        expected[step] = job.model[0].weight.detach().clone()
    job.pilot.close()
    tier = RemoteTier(str(run_dir / "checkpoints"))
    for step, weight in expected.items():
        loaded = archive.read_organ(tier, archive.checkpoint_name(step, 0))
        got = loaded.tensor("model/0.weight")
        assert torch.equal(got.view(torch.int32), weight.view(torch.int32)), step


def test_memory_tier_pins_the_base_and_drops_a_stale_entry() -> None:
    def snap(step: int, n: int = 4) -> Snapshot:
        arena = torch.zeros(n * 4, dtype=torch.uint8)
        return Snapshot(step=step, tensors={"model/w": arena.view(torch.float32)}, meta={},
                        arena=arena)

    pool = HostBufferPool(2)
    tier = MemoryTier(1024, pool)
    assert pool.take() is None and pool.take() is None  # two sets may be allocated
    first = snap(1)
    assert tier.put(CheckpointImage.of(first, level="pulse")).kept
    pool.pin()
    base = tier.base_for(1, first.layout)
    assert base is not None and base.snapshot() is first
    assert tier.base_for(2, first.layout) is None
    assert pool.take() is None, "a pinned base is never handed to a capture"
    pool.unpin()
    assert pool.take() is first  # at max_sets, unpinned: the held set is reused
    assert tier.newest() is None
    second = snap(2)
    assert tier.put(CheckpointImage.of(second, level="pulse")).kept
    big = Snapshot(step=3, tensors={"model/w": torch.zeros(1024)}, meta={},
                   arena=torch.zeros(4096, dtype=torch.uint8))
    assert not tier.put(CheckpointImage.of(big, level="pulse")).kept  # over max_bytes: not kept...
    assert tier.newest() is None  # ...and the older entry is not the newest any more
    assert pool.take() is second and pool.take() is None  # its buffers went back
    pool.give_back(first)
    pool.give_back(first)
    assert pool.take() is first and pool.take() is None  # given back twice, held once


@pytest.mark.parametrize("pulse_fsync", [False, True])
def test_pulses_on_the_remote_tier_skip_the_fsync_unless_asked_organs_never(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pulse_fsync: bool) -> None:
    """A pulse stands in for the memory and peer tiers: by default its files reach the page
    cache (safe from a crash of the process) without an fsync; an organ is always fsynced.
    Observed by recording which files ``os.fsync`` was called on."""
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    run_dir = tmp_path / "run"
    job = Job(policy_file(tmp_path, organ_every=3, pulse_fsync=pulse_fsync), run_dir)
    for _ in range(3):
        job.step()
    job.pilot.close(save=False)
    levels = {r.step: r.level.value for r in job.pilot.saves}
    assert levels == {1: "pulse", 2: "pulse", 3: "organ"}
    for step, level in levels.items():
        name = archive.checkpoint_name(step, 0)
        tensors = archive.TENSORS_FILE if level == "organ" else archive.CONTAINER_FILE
        fsynced = any(f"/{name}." in path and path.endswith(f"/{tensors}") for path in synced)
        assert fsynced == (level == "organ" or pulse_fsync), (step, level, synced)
    restored = Job(policy_file(tmp_path, organ_every=3), run_dir)
    assert restored.pilot.restore() == 3
    restored.pilot.close(save=False)
