"""The organ archive on the remote tier: layout, verification, corruption, no pickle."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import pickle
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from ckptpilot import CheckpointFormatError, IntegrityError
from ckptpilot.capture.state import TrainingComponents, capture
from ckptpilot.tiers.remote import archive
from ckptpilot.tiers.remote.store import RemoteTier


@pytest.fixture(params=["local", "memory"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> RemoteTier:
    if request.param == "local":
        return RemoteTier(str(tmp_path / "ckpt"))
    return RemoteTier(f"memory://ckptpilot-test-{uuid.uuid4().hex}/ckpt")


def snapshot(step: int = 7):  # type: ignore[no-untyped-def]
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    model.register_buffer("fp16", torch.randn(3, dtype=torch.float16))
    model.register_buffer("bf", torch.randn(2, 2, dtype=torch.bfloat16))
    model.register_buffer("flags", torch.tensor([True, False]))
    model.register_buffer("scalar", torch.tensor(3.5))
    model.register_buffer("empty", torch.zeros(0, 4))
    return capture(TrainingComponents(model), step=step, extras={"note": "x"})


def test_round_trip_is_bit_exact(tier: RemoteTier) -> None:
    snap = snapshot()
    written = archive.write_organ(tier, snap, level="organ", reason="test")
    assert written.name == "step_00000007_rank_00000"
    assert sorted(tier.list()) == [written.name]
    loaded = archive.read_organ(tier, written.name)
    assert loaded.manifest["level"] == "organ" and loaded.manifest["reason"] == "test"
    assert loaded.meta == json.loads(json.dumps(snap.meta))
    assert loaded.tensors.keys() == snap.tensors.keys()
    for k, v in snap.tensors.items():
        got = loaded.tensors[k]
        assert got.dtype == v.dtype and got.shape == v.shape, k
        assert torch.equal(got.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
    assert written.bytes == sum(f["bytes"] for f in written.manifest["files"].values())


def test_files_are_plain_safetensors_and_json(tier: RemoteTier) -> None:
    written = archive.write_organ(tier, snapshot())
    files = set(written.manifest["files"]) | {archive.MANIFEST_FILE}
    assert files == {archive.TENSORS_FILE, archive.STATE_FILE, archive.MANIFEST_FILE}
    raw = tier.read_bytes(f"{written.name}/{archive.TENSORS_FILE}")
    import safetensors.torch

    assert set(safetensors.torch.load(raw)) == set(snapshot().tensors)


def test_load_path_never_unpickles(tier: RemoteTier, monkeypatch: pytest.MonkeyPatch) -> None:
    name = archive.write_organ(tier, snapshot()).name

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("pickle used on the load path")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    assert archive.read_organ(tier, name).manifest["step"] == 7


def _corrupt(tier: RemoteTier, rel: str, mutate) -> None:  # type: ignore[no-untyped-def]
    data = bytearray(tier.read_bytes(rel))
    with tier.fs.open(tier.path(rel), "wb") as f:
        f.write(bytes(mutate(data)))


def _flip(data: bytearray) -> bytearray:
    data[len(data) // 2] ^= 0x10
    return data


@pytest.mark.parametrize(("fname", "mutate", "error", "match"), [
    (archive.TENSORS_FILE, _flip, IntegrityError,
     r"tensors.safetensors bytes \[0, \d+\): SHA256 mismatch"),
    (archive.TENSORS_FILE, lambda d: d[: len(d) // 2], CheckpointFormatError, "truncated"),
    (archive.TENSORS_FILE, lambda d: bytearray(), CheckpointFormatError, "truncated"),
    (archive.STATE_FILE, _flip, IntegrityError, r"state.json bytes \[0, \d+\): SHA256 mismatch"),
    (archive.MANIFEST_FILE, lambda d: d.replace(b'"step": 7', b'"step": 8'), IntegrityError,
     "manifest.json: SHA256 mismatch"),
    (archive.MANIFEST_FILE, lambda d: d[:10], CheckpointFormatError, "not valid JSON"),
])
def test_corruption_is_detected_never_loaded(tier: RemoteTier, fname: str, mutate, error,  # type: ignore[no-untyped-def]
                                             match: str) -> None:
    name = archive.write_organ(tier, snapshot()).name
    _corrupt(tier, f"{name}/{fname}", mutate)
    with pytest.raises(error, match=match):
        archive.read_organ(tier, name)


def test_missing_manifest_means_incomplete(tier: RemoteTier) -> None:
    name = archive.write_organ(tier, snapshot()).name
    tier.fs.rm(tier.path(name, archive.MANIFEST_FILE))  # the writer never wrote it
    with pytest.raises(CheckpointFormatError, match=r"missing \(the writer did not finish\)"):
        archive.read_organ(tier, name)


def test_unknown_format_version_is_refused(tier: RemoteTier) -> None:
    name = archive.write_organ(tier, snapshot()).name
    rel = f"{name}/{archive.MANIFEST_FILE}"
    manifest = json.loads(tier.read_bytes(rel))
    manifest["format_version"] = 99
    with tier.fs.open(tier.path(rel), "wb") as f:
        f.write(json.dumps(manifest).encode())
    with pytest.raises(CheckpointFormatError, match="format version 99 is not supported"):
        archive.read_organ(tier, name)


def test_listing_separates_published_staging_and_other_ranks(tier: RemoteTier) -> None:
    for step in (3, 12, 5):
        archive.write_organ(tier, snapshot(step))
    staging = tier.new_staging(archive.checkpoint_name(20, 0))
    tier.write_file(f"{staging}/{archive.TENSORS_FILE}", [b"partial"])
    other_rank = archive.checkpoint_name(30, 1)
    tier.fs.makedirs(tier.path(other_rank), exist_ok=True)
    tier.write_file(f"{other_rank}/{archive.MANIFEST_FILE}", [b"{}"])
    tier.fs.makedirs(tier.path("unrelated"), exist_ok=True)
    listing = archive.list_archives(tier, rank=0)
    assert [s for s, _ in listing.published] == [12, 5, 3]
    # An object store writes in place (the staging is the checkpoint's name until its
    # manifest commits it); a local directory is staged beside it.
    assert listing.staging == [staging]
    assert [s for s, _ in archive.list_archives(tier, rank=1).published] == [30]


def test_republishing_a_step_sets_the_old_one_aside(tier: RemoteTier) -> None:
    archive.write_organ(tier, snapshot(4))
    archive.write_organ(tier, snapshot(4))
    entries = tier.list()
    assert "step_00000004_rank_00000" in entries
    assert any(e.startswith("step_00000004_rank_00000.replaced-") for e in entries)


def test_uncheckpointable_dtype_is_named() -> None:
    from ckptpilot.capture.state import Snapshot

    snap = Snapshot(step=1, tensors={"model/c": torch.zeros(2, dtype=torch.complex64)},
                    meta={"rank": 0, "world_size": 1})
    with pytest.raises(CheckpointFormatError, match=r"model/c: dtype torch\.complex64"):
        list(archive._safetensors_chunks(snap.tensors))


def test_loaded_tensors_own_their_memory_and_are_aligned(tmp_path: Path) -> None:
    tier = RemoteTier(str(tmp_path / "ckpt"))
    snap = snapshot()
    name = archive.write_organ(tier, snap).name
    loaded = archive.read_organ(tier, name)
    for t in loaded.tensors.values():
        assert t.data_ptr() % t.element_size() == 0
    tier.remove(name)  # nothing may still map or read the file
    for k, v in snap.tensors.items():
        assert torch.equal(loaded.tensors[k].reshape(-1).view(torch.uint8),
                           v.reshape(-1).view(torch.uint8)), k


def test_a_header_claiming_more_than_the_file_holds_is_refused() -> None:
    import struct

    header = json.dumps({"w": {"dtype": "F32", "shape": [1 << 20, 1 << 18],
                               "data_offsets": [0, 1 << 40]}}).encode()
    buf = bytearray(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(CheckpointFormatError, match=r"w: header claims 1099511627776 bytes"):
        archive.parse_safetensors(buf, "x")


def test_a_file_of_many_chunks_is_hashed_per_chunk_and_a_bad_chunk_is_named(
        tier: RemoteTier) -> None:
    """Every 8 MiB of a file has its own SHA256 (hashed on several threads while writing and
    reading); a flipped byte in the third chunk is reported with that chunk's byte range, on
    read and on verify, and nothing is loaded."""
    torch.manual_seed(0)
    big = torch.randn(5 << 20)  # 20 MiB of fp32: three chunks and a bit
    snap = capture(TrainingComponents(torch.nn.Module()), step=3, extras={"big": big})
    written = archive.write_organ(tier, snap)
    rec = written.manifest["files"][archive.TENSORS_FILE]
    assert rec["chunk_bytes"] == 8 << 20
    assert len(rec["sha256_chunks"]) == -(-rec["bytes"] // (8 << 20)) == 3
    key = next(k for k, t in snap.tensors.items() if t.numel() == big.numel())
    loaded = archive.read_organ(tier, written.name)
    assert torch.equal(loaded.tensor(key).view(torch.int32), big.view(torch.int32))

    def flip_third_chunk(data: bytearray) -> bytearray:
        data[(16 << 20) + 5] ^= 0x01
        return data

    _corrupt(tier, f"{written.name}/{archive.TENSORS_FILE}", flip_third_chunk)
    at = rf"tensors.safetensors bytes \[{16 << 20}, {rec['bytes']}\): SHA256 mismatch"
    with pytest.raises(IntegrityError, match=at):
        archive.read_organ(tier, written.name)
    with pytest.raises(IntegrityError, match=at):
        archive.verify_organ(tier, written.name)


def _resident_share(path: Path) -> float:
    """The share of ``path``'s pages in the page cache (``mincore`` on a mapping)."""
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), "mmap failed"
        try:
            vec = (ctypes.c_ubyte * pages)()
            assert libc.mincore(addr, size, vec) == 0, "mincore failed"
            return sum(v & 1 for v in vec) / pages
        finally:
            libc.munmap(addr, size)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or not sys.platform.startswith("linux"),
                    reason="POSIX_FADV_DONTNEED and mincore as Linux has them")
def test_a_durable_file_leaves_the_page_cache_and_an_unsynced_one_stays(tmp_path: Path) -> None:
    kind = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True,
                          text=True, check=False).stdout.strip()
    if kind in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on {kind}: its pages are the file, never dropped")
    tier = RemoteTier(str(tmp_path))
    data = [bytes(range(256)) * 4096 * 8]  # 8 MiB
    tier.write_record("durable.bin", data, fsync=True)
    tier.write_record("cached.bin", data, fsync=False)
    assert _resident_share(tmp_path / "durable.bin") < 0.1
    assert _resident_share(tmp_path / "cached.bin") > 0.9
    assert (tmp_path / "durable.bin").read_bytes() == data[0]  # read back from the disk


def test_the_torch_free_header_checks_know_every_dtype_the_archive_and_the_codecs_write(
        ) -> None:
    from ckptpilot.codecs.blob import DTYPES
    from ckptpilot.format.container_index import ITEM_BYTES, SAFETENSORS_NAMES
    from ckptpilot.format.safetensors_header import ELEMENT_BYTES

    written = archive._SAFETENSORS_DTYPES
    assert set(ELEMENT_BYTES) == set(written.values())
    for dtype, name in written.items():
        assert ELEMENT_BYTES[name] == torch.empty((), dtype=dtype).element_size(), name
    assert set(ITEM_BYTES) == set(DTYPES)
    for name, dtype in DTYPES.items():
        assert ITEM_BYTES[name] == dtype.itemsize, name
        assert SAFETENSORS_NAMES.get(name) == written.get(dtype), name
