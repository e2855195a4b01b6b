"""What a restore checks its reads against (``tiers.remote.verify_reads``): SHA256 or XXH3-128
per chunk, bit-exact either way, every damaged chunk named, older checkpoints by SHA256."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_format_golden import ARCHIVE_V2, SAFETENSORS_ARCHIVE
from test_pilot import policy_file
from test_restore_hardening import ckpt_dir, model_bits, trained

from ckptpilot import CheckpointPilot, NoCheckpointError
from ckptpilot.capture.state import Snapshot
from ckptpilot.errors import CheckpointFormatError, IntegrityError
from ckptpilot.format.digest import CHUNK_BYTES, READ_DIGESTS, ReadDigest
from ckptpilot.format.manifest import encode_manifest, manifest_digest
from ckptpilot.tiers.remote import archive
from ckptpilot.tiers.remote.store import RemoteTier

NAMES = {"sha256": "SHA256", "xxh3": "XXH3-128"}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def big_snapshot() -> Snapshot:
    """Three chunks of tensors (two full, one short) and mixed widths."""
    g = torch.Generator().manual_seed(3)
    tensors = {
        "model/w": torch.randn(CHUNK_BYTES // 8 + 1000, generator=g),
        "model/h": torch.randn(CHUNK_BYTES // 4 + 7, generator=g).to(torch.bfloat16),
        "optim/m": torch.randint(-2**31, 2**31 - 1, (CHUNK_BYTES // 8 + 3,), generator=g,
                                 dtype=torch.int64),
    }
    meta = {"format_version": 1, "step": 5, "rank": 0, "world_size": 1, "model_keys": ["w"]}
    return Snapshot(step=5, tensors=tensors, meta=meta)


def written(tmp_path: Path, verify_reads: ReadDigest) -> tuple[RemoteTier, str, Snapshot]:
    tier = RemoteTier(str(tmp_path / "remote"), verify_reads=verify_reads)
    snap = big_snapshot()
    return tier, archive.write_organ(tier, snap).name, snap


@pytest.mark.parametrize("verify_reads", READ_DIGESTS)
def test_a_restore_reads_every_tensor_bit_exact(tmp_path: Path,
                                                verify_reads: ReadDigest) -> None:
    tier, name, snap = written(tmp_path, verify_reads)
    rec = archive.read_manifest(tier, name)["files"][archive.TENSORS_FILE]
    assert len(rec["sha256_chunks"]) == len(rec["xxh3_128_chunks"]) == 3
    loaded = archive.read_organ(tier, name)
    assert loaded.meta == snap.meta
    for key, tensor in snap.tensors.items():
        got = loaded.tensor(key)
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, key
        assert torch.equal(bits(got), bits(tensor)), key


@pytest.mark.parametrize("verify_reads", READ_DIGESTS)
@pytest.mark.parametrize("chunk", [0, 1, 2])
def test_a_flipped_byte_in_any_chunk_is_caught_naming_the_file_and_range(
        tmp_path: Path, verify_reads: ReadDigest, chunk: int) -> None:
    tier, name, _ = written(tmp_path, verify_reads)
    path = tmp_path / "remote" / name / archive.TENSORS_FILE
    size = path.stat().st_size
    begin, end = chunk * CHUNK_BYTES, min(size, (chunk + 1) * CHUNK_BYTES)
    with open(path, "r+b") as f:
        f.seek(end - 9)
        byte = f.read(1)
        f.seek(end - 9)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(IntegrityError, match=(
            rf"{archive.TENSORS_FILE} bytes \[{begin}, {end}\): {NAMES[verify_reads]} "
            r"mismatch \(expected [0-9a-f]+, got [0-9a-f]+\)")):
        archive.read_organ(tier, name)


@pytest.mark.parametrize("verify_reads", READ_DIGESTS)
def test_a_truncated_file_is_refused_before_it_is_read(tmp_path: Path,
                                                       verify_reads: ReadDigest) -> None:
    tier, name, _ = written(tmp_path, verify_reads)
    path = tmp_path / "remote" / name / archive.TENSORS_FILE
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 1)
    with pytest.raises(CheckpointFormatError,
                       match=rf"{archive.TENSORS_FILE}: {size - 1} bytes, manifest says {size}"):
        archive.read_organ(tier, name)


def test_a_version_2_checkpoint_is_checked_by_sha256_in_xxh3_mode(tmp_path: Path) -> None:
    """No XXH3 digests recorded: the read falls back to SHA256, so damage is still caught."""
    shutil.copytree(ARCHIVE_V2, tmp_path / "remote")
    tier = RemoteTier(str(tmp_path / "remote"), verify_reads="xxh3")
    path = tmp_path / "remote" / SAFETENSORS_ARCHIVE / archive.TENSORS_FILE
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match=(
            rf"{archive.TENSORS_FILE} bytes \[0, {len(raw)}\): SHA256 mismatch")):
        archive.read_organ(tier, SAFETENSORS_ARCHIVE)


def test_xxh3_digests_edited_in_the_manifest_are_refused_by_its_sha256(tmp_path: Path) -> None:
    """The XXH3 list is as trustworthy as the manifest: bytes forged to match a changed list
    need the manifest's self-digest changed too, and then the catalogue's digest of it."""
    tier, name, _ = written(tmp_path, "xxh3")
    path = tmp_path / "remote" / name / archive.MANIFEST_FILE
    manifest = json.loads(path.read_bytes())
    recorded = manifest["self_sha256"]
    manifest["files"][archive.TENSORS_FILE]["xxh3_128_chunks"][0] = "0" * 32
    path.write_bytes(encode_manifest(manifest))
    with pytest.raises(IntegrityError, match=r"manifest\.json: SHA256 mismatch"):
        archive.read_organ(tier, name)
    manifest["self_sha256"] = manifest_digest(manifest)
    path.write_bytes(encode_manifest(manifest))
    with pytest.raises(IntegrityError, match=r"not the archive the metadata recorded"):
        archive.read_organ(tier, name, manifest_sha256=recorded)


def test_an_unknown_verify_reads_is_refused() -> None:
    with pytest.raises(ValueError, match=r"verify_reads: 'md5' is not one of"):
        RemoteTier("/nonexistent", verify_reads="md5")  # type: ignore[arg-type]


def xxh3_pilot(tmp_path: Path, model: torch.nn.Module,
               optimizer: torch.optim.Optimizer) -> CheckpointPilot:
    cfg = policy_file(tmp_path, interval=3)
    cfg.write_text(cfg.read_text() + "tiers: {remote: {verify_reads: xxh3}}\n")
    return CheckpointPilot(cfg, model=model, optimizer=optimizer, run_dir=tmp_path / "run")


def flip_last_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x80
    path.write_bytes(bytes(raw))


def fresh_objects() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(7)  # other values than the run's
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_a_pilot_in_xxh3_mode_walks_back_over_damage_and_restores_bit_exact(
        tmp_path: Path) -> None:
    job, saved = trained(tmp_path)
    flip_last_byte(ckpt_dir(job, 12) / archive.TENSORS_FILE)
    model, opt = fresh_objects()
    pilot = xxh3_pilot(tmp_path, model, opt)
    assert pilot.restore() == 9
    rec = pilot.last_recovery
    assert rec is not None and [s.location for s in rec.skipped] == [str(ckpt_dir(job, 12))]
    assert f"{archive.TENSORS_FILE} bytes [0, " in rec.skipped[0].reason
    assert "XXH3-128 mismatch" in rec.skipped[0].reason
    got = model_bits(model)
    assert got.keys() == saved[9].keys()
    assert all(torch.equal(got[k], saved[9][k]) for k in saved[9])
    pilot.close(save=False)


def test_a_pilot_in_xxh3_mode_leaves_the_live_model_untouched_when_nothing_verifies(
        tmp_path: Path) -> None:
    job, _ = trained(tmp_path)
    for step in job.published():  # organs and pulses (a container: checked as decoded)
        kind = archive.TENSORS_FILE
        if not (ckpt_dir(job, step) / kind).exists():
            kind = archive.CONTAINER_FILE
        flip_last_byte(ckpt_dir(job, step) / kind)
    model, opt = fresh_objects()
    before = model_bits(model)
    pilot = xxh3_pilot(tmp_path, model, opt)
    with pytest.raises(NoCheckpointError):
        pilot.restore()
    after = model_bits(model)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert opt.state_dict()["state"] == {}
    pilot.close(save=False)
