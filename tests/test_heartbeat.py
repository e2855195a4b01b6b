"""Heartbeat ring file: round trip, wrap-around, torn slots, damage, uptime, a real SIGKILL,
reopen, golden bytes."""

from __future__ import annotations

import logging
import math
import os
import random
import re
import signal
import struct
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from ckptpilot.errors import CheckpointFormatError
from ckptpilot.storage.heartbeat import (
    HEADER_BYTES,
    SLOT_HEADER_BYTES,
    HeartbeatWriter,
    read_all,
    read_latest,
)

ROOT = Path(__file__).resolve().parents[1]


def _record(step: int) -> dict[str, object]:
    return {
        "step": step,
        "epoch": step // 100,
        "cursor": {"epoch": step // 100, "position": step % 100, "seed": 7},
        "rng": "c0ffee",
        "lr": 3e-4,
        "scaler": {"scale": 65536.0, "growth_tracker": step % 2000},
        "loss": 1.0 / (step + 1),
    }


def _slot_offset(seq: int, slots: int, record_bytes: int) -> int:
    return HEADER_BYTES + ((seq - 1) % slots) * record_bytes


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat"
    assert read_latest(path) is None
    with HeartbeatWriter(path, slots=8, record_bytes=512) as writer:
        assert writer.write(_record(1), wall_time=1234.5) == 1
        assert writer.write({**_record(2), "loss": math.nan}) == 2
    latest = read_latest(path)
    assert latest is not None
    assert latest.seq == 2 and latest.step == 2
    assert math.isnan(latest.data["loss"])
    first = read_all(path)[0]
    assert first.data == _record(1) and first.wall_time == 1234.5
    assert path.stat().st_size == HEADER_BYTES + 8 * 512


def test_wrap_around_keeps_the_last_slots(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat"
    with HeartbeatWriter(path, slots=4, record_bytes=256) as writer:
        for step in range(11):
            writer.write(_record(step))
    records = read_all(path)
    assert [record.step for record in records] == [7, 8, 9, 10]
    assert [record.seq for record in records] == [8, 9, 10, 11]


def test_torn_newest_record_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat"
    slots, record_bytes = 4, 256
    with HeartbeatWriter(path, slots=slots, record_bytes=record_bytes) as writer:
        for step in range(6):
            writer.write(_record(step))
    newest = _slot_offset(6, slots, record_bytes)
    data = bytearray(path.read_bytes())
    data[newest + SLOT_HEADER_BYTES + 3] ^= 0x01  # one flipped payload bit
    path.write_bytes(data)
    latest = read_latest(path)
    assert latest is not None and latest.seq == 5 and latest.step == 4

    data[_slot_offset(5, slots, record_bytes)] = ord("X")  # bad slot magic
    path.write_bytes(data)
    latest = read_latest(path)
    assert latest is not None and latest.step == 3


def test_overwrite_stopped_halfway_is_not_valid(tmp_path: Path) -> None:
    """A kill after the payload of a new record, before its header: neither record is valid."""
    path = tmp_path / "heartbeat"
    slots, record_bytes = 2, 256
    with HeartbeatWriter(path, slots=slots, record_bytes=record_bytes) as writer:
        writer.write(_record(1))
        writer.write(_record(2))
    data = bytearray(path.read_bytes())
    start = _slot_offset(3, slots, record_bytes) + SLOT_HEADER_BYTES
    payload = b'{"step":3}'
    data[start : start + len(payload)] = payload  # seq 3 goes where seq 1 was
    path.write_bytes(data)
    assert [record.step for record in read_all(path)] == [2]


def test_oversized_record_is_rejected(tmp_path: Path) -> None:
    with HeartbeatWriter(tmp_path / "heartbeat", slots=2, record_bytes=128) as writer:
        limit = 128 - SLOT_HEADER_BYTES
        with pytest.raises(ValueError, match=rf"record is \d+ bytes of JSON, over the {limit}"):
            writer.write({"blob": "x" * 200})
        assert writer.last_seq == 0


def test_reopen_continues_the_sequence(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat"
    with HeartbeatWriter(path, slots=4, record_bytes=256) as writer:
        for step in range(6):
            writer.write(_record(step))
    with HeartbeatWriter(path, slots=4, record_bytes=256) as writer:
        assert writer.last_seq == 6
        assert writer.write(_record(100)) == 7
    assert [record.step for record in read_all(path)] == [3, 4, 5, 100]

    with HeartbeatWriter(path, slots=8, record_bytes=512) as writer:  # new geometry
        assert writer.write(_record(101)) == 8
    assert [record.step for record in read_all(path)] == [3, 4, 5, 100, 101]
    assert path.stat().st_size == HEADER_BYTES + 8 * 512


def _ring(path: Path, steps: int = 6) -> bytes:
    with HeartbeatWriter(path, slots=4, record_bytes=256) as writer:
        for step in range(steps):
            writer.write(_record(step))
    return path.read_bytes()


def _random_bytes(path: Path) -> None:
    path.write_bytes(random.Random(7).randbytes(HEADER_BYTES + 4 * 256))


def _truncated(path: Path) -> None:
    path.write_bytes(_ring(path)[: HEADER_BYTES + 2 * 256 + 17])


def _wrong_magic(path: Path) -> None:
    path.write_bytes(b"X" + _ring(path)[1:])


def _header_crc_mismatch(path: Path) -> None:
    data = bytearray(_ring(path))
    data[12] ^= 0x01  # the slot count
    path.write_bytes(bytes(data))


def _newer_version(path: Path) -> None:
    data = bytearray(_ring(path))
    fields = struct.pack("<8sHHII", b"CKPHBEAT", 99, HEADER_BYTES, 4, 256)
    data[:24] = fields + struct.pack("<I", zlib.crc32(fields))
    path.write_bytes(bytes(data))


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _directory(path: Path) -> None:
    path.mkdir()
    (path / "inside").write_bytes(b"kept")


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (_random_bytes, "bad magic"),
        (_truncated, r"4625 bytes, but its header describes 4 slots of 256 bytes"),
        (_wrong_magic, "bad magic"),
        (_header_crc_mismatch, r"header is corrupt \(CRC mismatch\)"),
        (_newer_version, "format version 99 is not supported"),
        (_empty, "0 bytes, too short for a ckptpilot heartbeat file header"),
        (_directory, "a directory"),
    ],
    ids=[
        "random-bytes",
        "truncated",
        "wrong-magic",
        "header-crc",
        "newer-version",
        "empty",
        "directory",
    ],
)
def test_a_damaged_ring_reads_as_unknown_and_is_set_aside_for_a_fresh_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Any, problem: str
) -> None:
    path = tmp_path / "heartbeat"
    damage(path)
    before = sorted(p.name for p in path.iterdir()) if path.is_dir() else path.read_bytes()
    with pytest.raises(CheckpointFormatError, match=problem):
        read_all(path)

    with caplog.at_level(logging.WARNING, logger="ckptpilot"):
        assert read_latest(path) is None
    assert re.search(problem, caplog.text) and "how far the previous run got is unknown" in (
        caplog.text
    )
    assert str(path) in caplog.text
    caplog.clear()

    with (
        caplog.at_level(logging.WARNING, logger="ckptpilot"),
        HeartbeatWriter(path, slots=4, record_bytes=256) as writer,
    ):
        assert writer.last_seq == 0
        assert writer.write(_record(42)) == 1
    [aside] = tmp_path.glob("heartbeat.damaged-*")
    after = sorted(p.name for p in aside.iterdir()) if aside.is_dir() else aside.read_bytes()
    assert after == before  # kept as it was, for inspection
    assert re.search(problem, caplog.text) and f"kept it as {aside.name}" in caplog.text
    latest = read_latest(path)
    assert latest is not None and (latest.seq, latest.step) == (1, 42)


def test_each_damaged_ring_set_aside_keeps_its_own_name(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat"
    for attempt in range(3):
        path.write_bytes(f"garbage {attempt}".encode())
        HeartbeatWriter(path, slots=4, record_bytes=256).close()
    kept = sorted(p.read_bytes() for p in tmp_path.glob("heartbeat.damaged-*"))
    assert kept == [b"garbage 0", b"garbage 1", b"garbage 2"]
    assert read_latest(path) is None  # a fresh, empty ring


def test_a_torn_slot_is_not_damage(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "heartbeat"
    data = bytearray(_ring(path))
    data[_slot_offset(6, 4, 256) + SLOT_HEADER_BYTES] ^= 0x01
    path.write_bytes(bytes(data))
    with (
        caplog.at_level(logging.WARNING, logger="ckptpilot"),
        HeartbeatWriter(path, slots=4, record_bytes=256) as writer,
    ):
        assert writer.last_seq == 5
    assert caplog.text == ""
    assert list(tmp_path.glob("heartbeat.damaged-*")) == []


def test_uptime_is_monotonic_time_since_the_writer_opened(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat"
    opened = time.monotonic()
    with HeartbeatWriter(path, slots=4, record_bytes=256) as writer:
        writer.write(_record(1), wall_time=5_000_000_000.0)  # a wall clock far ahead
        writer.write(_record(2), wall_time=1.0)  # ...stepped back to 1970
        bound = time.monotonic() - opened
    first, second = read_all(path)
    assert first.uptime_seconds is not None and second.uptime_seconds is not None
    assert 0 <= first.uptime_seconds <= second.uptime_seconds <= bound
    assert (first.wall_time, second.wall_time) == (5_000_000_000.0, 1.0)


@pytest.mark.parametrize(
    "times",
    [
        {"wall_time": math.nan},
        {"wall_time": math.inf},
        {"uptime_seconds": -1.0},
        {"uptime_seconds": math.nan},
    ],
)
def test_nonsense_times_are_refused_on_write(tmp_path: Path, times: dict[str, float]) -> None:
    with HeartbeatWriter(tmp_path / "heartbeat", slots=2, record_bytes=128) as writer:
        with pytest.raises(ValueError, match="heartbeat times must be finite"):
            writer.write({"step": 1}, **times)
        assert writer.last_seq == 0


def test_a_slot_with_a_non_finite_wall_time_is_skipped(tmp_path: Path) -> None:
    """A CRC-valid slot no writer of ours makes: a record's wall time is always finite."""
    path = tmp_path / "heartbeat"
    data = bytearray(_ring(path, steps=2))
    payload = b'{"step":99}'
    offset = _slot_offset(3, 4, 256)
    crc = zlib.crc32(payload, zlib.crc32(struct.pack("<QddI", 3, math.inf, 1.0, len(payload))))
    data[offset : offset + SLOT_HEADER_BYTES + len(payload)] = (
        struct.pack("<4sIIIQdd", b"HBS2", len(payload), crc, 0, 3, math.inf, 1.0) + payload
    )
    path.write_bytes(bytes(data))
    assert [record.step for record in read_all(path)] == [0, 1]


def test_background_flush_makes_every_write_durable(tmp_path: Path) -> None:
    with HeartbeatWriter(tmp_path / "heartbeat", flush_seconds=0.01) as writer:
        record = _record(0)
        for step in range(2_000):
            record["step"] = step
            writer.write(record)
        deadline = time.monotonic() + 60.0  # a safety net only; it flushes every 10 ms
        while writer.flushed_seq != writer.last_seq and time.monotonic() < deadline:
            time.sleep(0.01)
        assert writer.flushed_seq == writer.last_seq == 2_000


_CHILD = textwrap.dedent(
    """
    import sys
    from ckptpilot.storage.heartbeat import HeartbeatWriter

    writer = HeartbeatWriter(sys.argv[1], slots=64, record_bytes=512)
    for step in range(50_000_000):
        writer.write({"step": step, "epoch": 0, "loss": 1.0 / (step + 1), "rng": "ab"})
        if step % 50 == 0:
            print(step, flush=True)
    """
)


@pytest.mark.crash
def test_sigkill_keeps_the_newest_written_record(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert child.stdout is not None
        reported = -1
        for line in child.stdout:
            reported = int(line)
            if reported >= 200:
                break
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=10)
    assert child.returncode == -signal.SIGKILL
    assert reported >= 200
    latest = read_latest(path)  # read_all checks every CRC
    assert latest is not None
    assert latest.step is not None and latest.step >= reported
    assert latest.seq == latest.step + 1


# Format version 2, frozen: slots=2, record_bytes=64, records step 7, 8, 9 (seq 1-3, uptimes
# 0.5, 1.75, 3.0 s; seq 3 overwrote seq 1 in slot 0, leaving one stale byte after its
# payload). Any change to these bytes is a format change: bump FORMAT_VERSION and keep reading
# versions 1 and 2.
_GOLDEN_V2_HEADER = "434b504842454154020000100200000040000000e6d9ee81"
_GOLDEN_V2_SLOTS = (
    "4842533214000000694b77a30000000003000000000000000000b040fc54d9410000000000000840"
    "7b2273746570223a392c2265706f6368223a317d7d000000"
    "484253320a000000e3b137e100000000020000000000000000006040fc54d941000000000000fc3f"
    "7b2273746570223a387d0000000000000000000000000000"
)

# Format version 1 (read only), the same three records without uptimes.
_GOLDEN_V1_HEADER = "434b504842454154010000100200000040000000160b70f6"
_GOLDEN_V1_SLOTS = (
    "4842533114000000640829350000000003000000000000000000b040fc54d9417b2273746570223a392c"
    "2265706f6368223a317d7d0000000000000000000000"
    "484253310a000000fb1b959300000000020000000000000000006040fc54d9417b2273746570223a387d"
    "00000000000000000000000000000000000000000000"
)


def _golden(header: str, slots: str) -> bytes:
    fields = bytes.fromhex(header)
    return fields + bytes(HEADER_BYTES - len(fields)) + bytes.fromhex(slots)


def test_golden_v2_bytes(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat"
    with HeartbeatWriter(path, slots=2, record_bytes=64) as writer:
        writer.write({"step": 7, "loss": 0.5}, wall_time=1700000000.25, uptime_seconds=0.5)
        writer.write({"step": 8}, wall_time=1700000001.5, uptime_seconds=1.75)
        writer.write({"step": 9, "epoch": 1}, wall_time=1700000002.75, uptime_seconds=3.0)
    assert path.read_bytes() == _golden(_GOLDEN_V2_HEADER, _GOLDEN_V2_SLOTS)
    assert [(r.seq, r.wall_time, r.uptime_seconds, r.data) for r in read_all(path)] == [
        (2, 1700000001.5, 1.75, {"step": 8}),
        (3, 1700000002.75, 3.0, {"step": 9, "epoch": 1}),
    ]


def test_golden_v1_bytes_stay_readable(tmp_path: Path) -> None:
    golden = tmp_path / "golden"
    golden.write_bytes(_golden(_GOLDEN_V1_HEADER, _GOLDEN_V1_SLOTS))
    records = read_all(golden)
    assert [(r.seq, r.wall_time, r.uptime_seconds, r.data) for r in records] == [
        (2, 1700000001.5, None, {"step": 8}),
        (3, 1700000002.75, None, {"step": 9, "epoch": 1}),
    ]


def test_a_version_1_ring_reopened_is_rewritten_as_version_2_keeping_its_records(
    tmp_path: Path,
) -> None:
    path = tmp_path / "heartbeat"
    path.write_bytes(_golden(_GOLDEN_V1_HEADER, _GOLDEN_V1_SLOTS))
    with HeartbeatWriter(path, slots=2, record_bytes=64) as writer:
        assert writer.last_seq == 3
        writer.write({"step": 10}, wall_time=1700000003.0, uptime_seconds=0.25)
    assert path.read_bytes()[8:10] == struct.pack("<H", 2)
    assert [(r.seq, r.uptime_seconds, r.data) for r in read_all(path)] == [
        (3, None, {"step": 9, "epoch": 1}),
        (4, 0.25, {"step": 10}),
    ]
    assert list(tmp_path.glob("heartbeat.damaged-*")) == []
