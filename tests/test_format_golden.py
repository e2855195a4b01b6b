"""Golden files: every format ckptpilot persists outside the codecs must read back forever.

``tests/fixtures/format/`` holds one file (or archive directory) per persisted format and
version: the peer image meta, the remote archive (manifest, state, tensors; safetensors and
container kinds), the heartbeat ring (version 2 as written today, version 1 as still read) and
the failure ledger (one record of each kind). Each test checks both directions: today's
encoder reproduces the golden bytes exactly, and the golden decodes to the values it was made
from. A failure of the first kind is a format change: bump the format's version and keep a
golden of the old one.

Inputs are fixed values, never the clock, a host name or a pid: wall times, uptimes and
``created_unix`` are passed in. One field is left out: a ``run_end`` ledger record's
``uptime_seconds`` exists only when the ledger stamped the run's start and end itself on the
monotonic clock, so it cannot be pinned; the same field is pinned in the interruption record.

To add fixtures for a new format version, run ``python tests/test_format_golden.py``; it writes
only the files that are missing and never rewrites an existing one.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptpilot.capture.state import Snapshot
from ckptpilot.codecs import Codec, get_codec
from ckptpilot.errors import CheckpointFormatError, IntegrityError
from ckptpilot.format.digest import READ_DIGESTS, ReadDigest
from ckptpilot.format.image import ImageMeta
from ckptpilot.format.ledger_line import parse_line
from ckptpilot.format.manifest import build_manifest, decode_manifest, encode_manifest
from ckptpilot.storage.heartbeat import HeartbeatWriter, read_all
from ckptpilot.storage.ledger import FailureLedger, Interruption, Rollback
from ckptpilot.tiers.remote import archive
from ckptpilot.tiers.remote.store import RemoteTier
from ckptpilot.vocab import Level, RetentionClass

FIXTURES = Path(__file__).parent / "fixtures" / "format"
PEER_IMAGE = FIXTURES / "peer_image.v1.json"
ARCHIVE_ROOT = FIXTURES / "archive.v4"
ARCHIVE_V3 = FIXTURES / "archive.v3"  # tensor data at a multiple of 8 bytes: still read
ARCHIVE_V2 = FIXTURES / "archive.v2"  # chunk SHA256s without XXH3-128s: no writer makes them
ARCHIVE_V1 = FIXTURES / "archive.v1"  # whole-file SHA256s: no writer makes them, still read
ARCHIVES = {4: ARCHIVE_ROOT, 3: ARCHIVE_V3, 2: ARCHIVE_V2, 1: ARCHIVE_V1}
SAFETENSORS_ARCHIVE = "step_00000007_rank_00000"
CONTAINER_ARCHIVE = "step_00000008_rank_00000"
RING_V2 = FIXTURES / "heartbeat.v2.ring"
RING_V1 = FIXTURES / "heartbeat.v1.ring"
LEDGER = FIXTURES / "ledger.v1.jsonl"

CREATED_UNIX = 1700000000.25
RING_SLOTS = 4
RING_RECORD_BYTES = 128
# (payload, wall time, uptime seconds) of the ring's records, seq 1..3.
RING_RECORDS = (
    ({"step": 7, "loss": 0.5}, 1700000000.25, 0.5),
    ({"step": 8, "epoch": 0, "cursor": {"position": 8}}, 1700000001.5, 1.75),
    ({"step": 9, "loss": float("nan")}, 1700000002.75, 3.0),
)


def golden_snapshot(step: int) -> Snapshot:
    """Two tensors of different widths and a small state tree; values are plain arithmetic."""
    tensors = {
        "model/w": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 8,
        "model/count": torch.tensor([42, -1], dtype=torch.int16),
    }
    meta = {
        "format_version": 1, "step": step, "rank": 0, "world_size": 1, "epoch": 2,
        "model_keys": ["w", "count"], "extras": {"note": "golden"}, "lr": 0.125,
    }
    return Snapshot(step=step, tensors=tensors, meta=meta)


def raw_codec_for(name: str, tensor: torch.Tensor) -> tuple[Codec, torch.Tensor | None]:
    return get_codec("raw"), None


GOLDEN_IMAGE = ImageMeta(
    step=7, rank=0, level=Level.PULSE, reason="interval", retention_class=RetentionClass.ROUTINE,
    score=0.5, created_unix=CREATED_UNIX, layout=golden_snapshot(7).layout,
    state=golden_snapshot(7).meta)


def stage_golden_archives(tier: RemoteTier) -> None:
    """Both archive kinds, published: safetensors (step 7) and codec container (step 8)."""
    for step, codec_for in ((7, None), (8, raw_codec_for)):
        staged = archive.stage_organ(
            tier, golden_snapshot(step), level="organ", reason="golden",
            retention_class="milestone", score=1.5, codec_for=codec_for,
            created_unix=CREATED_UNIX)
        tier.publish(staged.staging, staged.name)


def write_ring_v2(path: Path) -> None:
    with HeartbeatWriter(path, slots=RING_SLOTS, record_bytes=RING_RECORD_BYTES) as writer:
        for data, wall, uptime in RING_RECORDS:
            writer.write(data, wall_time=wall, uptime_seconds=uptime)


def ring_v1_bytes() -> bytes:
    """A version-1 ring of the same records, built from the layout in ``heartbeat.py``'s
    docstring: no writer makes version 1 any more, but the reader still reads it."""
    fields = struct.pack("<8sHHII", b"CKPHBEAT", 1, 4096, RING_SLOTS, RING_RECORD_BYTES)
    ring = bytearray(4096 + RING_SLOTS * RING_RECORD_BYTES)
    ring[:24] = fields + struct.pack("<I", zlib.crc32(fields))
    for seq, (data, wall, _) in enumerate(RING_RECORDS, 1):
        payload = json.dumps(data, separators=(",", ":")).encode()
        crc = zlib.crc32(payload, zlib.crc32(struct.pack("<QdI", seq, wall, len(payload))))
        slot = struct.pack("<4sIIIQd", b"HBS1", len(payload), crc, 0, seq, wall) + payload
        offset = 4096 + (seq - 1) * RING_RECORD_BYTES
        ring[offset:offset + len(slot)] = slot
    return bytes(ring)


GOLDEN_INTERRUPTION = Interruption(
    wall_time=1500.0, failed_at=1400.0, last_step=420, recovered_step=400, steps_lost=20,
    source="peer", recovery_seconds=3.25, uptime_seconds=390.5)
GOLDEN_ROLLBACK = Rollback(wall_time=1600.0, step=450, onset=440, to_step=430,
                           skipped_batches=20, reason="loss spike: 9.5 over a median of 2.0")


def write_ledger(path: Path) -> None:
    """One record of every kind, in the order a resumed run writes them."""
    ledger = FailureLedger(path)
    ledger.record_run_start(0, wall_time=1000.0)
    i = GOLDEN_INTERRUPTION
    ledger.record_interruption(
        failed_at=i.failed_at, last_step=i.last_step, recovered_step=i.recovered_step,
        source=i.source, recovery_seconds=i.recovery_seconds, uptime_seconds=i.uptime_seconds,
        wall_time=i.wall_time)
    ledger.record_run_start(400, wall_time=1500.0)
    r = GOLDEN_ROLLBACK
    ledger.record_rollback(step=r.step, onset=r.onset, to_step=r.to_step,
                           skipped_batches=r.skipped_batches, reason=r.reason,
                           wall_time=r.wall_time)
    ledger.record_run_end(500, wall_time=1700.0)


def write_missing_fixtures() -> list[Path]:
    """Write the fixtures that do not exist yet; returns the paths written."""
    FIXTURES.mkdir(parents=True, exist_ok=True)
    created: list[Path] = []
    if not PEER_IMAGE.exists():
        PEER_IMAGE.write_bytes(GOLDEN_IMAGE.encode())
        created.append(PEER_IMAGE)
    if not ARCHIVE_ROOT.exists():
        stage_golden_archives(RemoteTier(str(ARCHIVE_ROOT)))
        created.append(ARCHIVE_ROOT)
    if not RING_V2.exists():
        write_ring_v2(RING_V2)
        created.append(RING_V2)
    if not RING_V1.exists():
        RING_V1.write_bytes(ring_v1_bytes())
        created.append(RING_V1)
    if not LEDGER.exists():
        write_ledger(LEDGER)
        created.append(LEDGER)
    return created


if __name__ == "__main__":
    written = write_missing_fixtures()
    json.dump([str(p) for p in written], sys.stdout, indent=1)
    print()


def archive_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def golden_tier(tmp_path: Path, root: Path = ARCHIVE_ROOT,
                verify_reads: ReadDigest = "sha256") -> RemoteTier:
    """A copy of the golden archives: reading must not depend on the fixtures being writable."""
    shutil.copytree(root, tmp_path / "remote")
    return RemoteTier(str(tmp_path / "remote"), verify_reads=verify_reads)


# -- peer image meta --------------------------------------------------------------------------


def test_the_peer_image_meta_encodes_byte_for_byte_as_the_golden() -> None:
    assert GOLDEN_IMAGE.encode() == PEER_IMAGE.read_bytes()


def test_the_golden_peer_image_meta_decodes_to_what_it_was_made_from() -> None:
    meta = ImageMeta.decode(PEER_IMAGE.read_bytes(), step=7, rank=0)
    assert meta == GOLDEN_IMAGE
    assert meta.layout == (("model/w", torch.float32, (2, 3)), ("model/count", torch.int16, (2,)))


def golden_image_with(**changes: Any) -> bytes:
    doc = json.loads(PEER_IMAGE.read_bytes())
    doc.update(changes)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(("raw", "message"), [
    (golden_image_with(format="ckptpilot-peer-image-2"),
     r"peer:run/7: holds format 'ckptpilot-peer-image-2', not 'ckptpilot-peer-image-1' .*"
     "upgrade ckptpilot"),
    (golden_image_with(level="daily"), r"field 'level' is 'daily', not one of heartbeat, pulse"),
    (golden_image_with(step="7"), r"field 'step' is '7', not a int"),
    (golden_image_with(score=True), r"field 'score' is True, not a int or float or null"),
    (golden_image_with(layout=[["model/w", "float33", [2, 3]]]),
     r"field 'layout' entry 0 is \['model/w', 'float33', \[2, 3\]\]"),
    (golden_image_with(layout=[["model/w", "float32", [-2]]]), r"field 'layout' entry 0"),
    (json.dumps({k: v for k, v in json.loads(PEER_IMAGE.read_bytes()).items()
                 if k != "state"}).encode(), r"meta lacks the field 'state'"),
    (b"[1, 2]", r"meta is a JSON list, not an object"),
    (b'{"format": ', r"peer:run/7: meta is not valid JSON"),
    (golden_image_with(step=6), r"holds 'ckptpilot-peer-image-1' of step 6, rank 0, not step 7"),
], ids=["format", "level", "step-type", "score-bool", "dtype", "shape", "missing", "list",
        "json", "another-step"])
def test_a_bad_peer_image_meta_is_refused_naming_the_field(raw: bytes, message: str) -> None:
    with pytest.raises(CheckpointFormatError, match=message):
        ImageMeta.decode(raw, where="peer:run/7", step=7, rank=0)


def test_a_tensor_whose_dtype_the_image_cannot_name_is_refused_on_encode() -> None:
    meta = dataclasses.replace(GOLDEN_IMAGE, layout=(("model/z", torch.quint8, (2,)),))
    with pytest.raises(CheckpointFormatError, match=r"tensor 'model/z' has dtype torch.quint8"):
        meta.encode()


# -- remote archive -----------------------------------------------------------------------------


def test_todays_archive_writer_reproduces_the_golden_archives(tmp_path: Path) -> None:
    stage_golden_archives(RemoteTier(str(tmp_path / "remote")))
    assert archive_files(tmp_path / "remote") == archive_files(ARCHIVE_ROOT)


@pytest.mark.parametrize("verify_reads", READ_DIGESTS)
@pytest.mark.parametrize("version", [4, 3, 2, 1])
@pytest.mark.parametrize("name", [SAFETENSORS_ARCHIVE, CONTAINER_ARCHIVE])
def test_a_golden_archive_reads_back_bit_exact(tmp_path: Path, name: str, version: int,
                                               verify_reads: ReadDigest) -> None:
    tier = golden_tier(tmp_path, ARCHIVES[version], verify_reads)
    manifest = archive.read_manifest(tier, name)
    step = 7 if name == SAFETENSORS_ARCHIVE else 8
    assert {k: manifest[k] for k in ("format", "format_version", "name", "step", "level",
                                     "retention_class", "score", "created_unix")} == {
        "format": "ckptpilot-organ", "format_version": version, "name": name, "step": step,
        "level": "organ", "retention_class": "milestone", "score": 1.5,
        "created_unix": CREATED_UNIX}
    loaded = archive.read_organ(tier, name, manifest_sha256=manifest["self_sha256"])
    expected = golden_snapshot(step)
    assert loaded.meta == expected.meta
    assert set(loaded.tensors) == set(expected.tensors)
    for key, tensor in expected.tensors.items():
        got = loaded.tensor(key)
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), key


def test_a_golden_manifest_decodes_and_rebuilds_to_the_same_bytes() -> None:
    raw = (ARCHIVE_ROOT / CONTAINER_ARCHIVE / archive.MANIFEST_FILE).read_bytes()
    manifest = decode_manifest(raw, "golden")
    assert encode_manifest(manifest) == raw
    fields = {k: v for k, v in manifest.items()
              if k not in ("format", "format_version", "self_sha256")}
    assert build_manifest(**fields) == manifest


def test_a_golden_manifest_with_one_changed_byte_is_refused(tmp_path: Path) -> None:
    tier = golden_tier(tmp_path)
    path = tmp_path / "remote" / SAFETENSORS_ARCHIVE / archive.MANIFEST_FILE
    path.write_bytes(path.read_bytes().replace(b'"golden"', b'"g0lden"'))
    with pytest.raises(IntegrityError, match=r"manifest\.json: SHA256 mismatch \(expected ad97"):
        archive.read_manifest(tier, SAFETENSORS_ARCHIVE)


# -- heartbeat ring -----------------------------------------------------------------------------


def test_todays_heartbeat_writer_reproduces_the_golden_ring(tmp_path: Path) -> None:
    write_ring_v2(tmp_path / "heartbeat")
    assert (tmp_path / "heartbeat").read_bytes() == RING_V2.read_bytes()


@pytest.mark.parametrize("ring", [RING_V2, RING_V1], ids=["v2", "v1"])
def test_a_golden_ring_reads_back_every_record(ring: Path) -> None:
    records = read_all(ring)
    assert [r.seq for r in records] == [1, 2, 3]
    assert [r.wall_time for r in records] == [wall for _, wall, _ in RING_RECORDS]
    expected_uptimes = [up for _, _, up in RING_RECORDS] if ring == RING_V2 else [None] * 3
    assert [r.uptime_seconds for r in records] == expected_uptimes
    assert [r.data["step"] for r in records] == [7, 8, 9]
    assert records[1].data == RING_RECORDS[1][0]
    assert str(records[2].data["loss"]) == "nan"  # a NaN loss is kept, not dropped


# -- failure ledger -----------------------------------------------------------------------------


def test_todays_ledger_writes_the_golden_lines(tmp_path: Path) -> None:
    write_ledger(tmp_path / "failures.jsonl")
    assert (tmp_path / "failures.jsonl").read_bytes() == LEDGER.read_bytes()


def test_the_golden_ledger_reads_back_every_record_kind(tmp_path: Path) -> None:
    path = tmp_path / "failures.jsonl"
    path.write_bytes(LEDGER.read_bytes())
    ledger = FailureLedger(path)
    assert ledger.interruptions() == [GOLDEN_INTERRUPTION]
    assert ledger.rollbacks() == [GOLDEN_ROLLBACK]
    assert ledger.last_kind() == "run_end"
    assert ledger.mtbf_seconds(now=1700.0) == 390.5 + 200.0
    kinds = [json.loads(line)["kind"] for line in LEDGER.read_text().splitlines()]
    assert kinds == ["run_start", "interruption", "run_start", "rollback", "run_end"]


def test_a_ledger_line_whose_kind_is_not_a_string_sets_the_file_aside_keeping_the_rest(
        tmp_path: Path) -> None:
    path = tmp_path / "failures.jsonl"
    good = LEDGER.read_bytes()
    path.write_bytes(b'{"v": 1, "kind": ["run_start"]}\n' + good)
    assert FailureLedger(path).last_kind() == "run_end"
    assert path.read_bytes() == good
    [aside] = tmp_path.glob("failures.jsonl.damaged-*")
    assert aside.read_bytes().startswith(b'{"v": 1, "kind": ["run_start"]}')
    with pytest.raises(CheckpointFormatError, match=r"line 3: unknown record kind \['run'\]"):
        parse_line(b'{"v": 1, "kind": ["run"]}', 3)
