"""Heartbeat ring file: round trip, wrap-around, torn slots, a real SIGKILL, reopen."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ckptpilot.errors import CheckpointFormatError
from ckptpilot.scheduler.heartbeat import (
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


def test_not_a_heartbeat_file(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat"
    path.write_bytes(b"something else entirely" * 10)
    with pytest.raises(CheckpointFormatError, match="not a ckptpilot heartbeat file"):
        read_latest(path)
    with pytest.raises(CheckpointFormatError, match="not a ckptpilot heartbeat file"):
        HeartbeatWriter(path)


def test_background_flush_runs_and_write_is_cheap(tmp_path: Path) -> None:
    with HeartbeatWriter(tmp_path / "heartbeat", flush_seconds=0.01) as writer:
        record = _record(0)
        count = 20_000
        started = time.perf_counter()
        for step in range(count):
            record["step"] = step
            writer.write(record)
        per_write_us = (time.perf_counter() - started) / count * 1e6
        deadline = time.monotonic() + 2.0
        while writer.flushed_seq != writer.last_seq and time.monotonic() < deadline:
            time.sleep(0.01)
        assert writer.flushed_seq == writer.last_seq
    print(f"heartbeat write: {per_write_us:.2f} us per record")
    assert per_write_us < 200  # generous: a loaded CI box; typically a few µs


_CHILD = textwrap.dedent(
    """
    import sys
    from ckptpilot.scheduler.heartbeat import HeartbeatWriter

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


# Format version 1, frozen: slots=2, record_bytes=64, records step 7, 8, 9 (seq 1-3; seq 3
# overwrote seq 1 in slot 0, leaving one stale byte after its payload). Any change to these
# bytes is a format change: bump FORMAT_VERSION and keep reading version 1.
_GOLDEN_HEADER = "434b504842454154010000100200000040000000160b70f6"
_GOLDEN_SLOTS = (
    "4842533114000000640829350000000003000000000000000000b040fc54d9417b2273746570223a392c"
    "2265706f6368223a317d7d0000000000000000000000"
    "484253310a000000fb1b959300000000020000000000000000006040fc54d9417b2273746570223a387d"
    "00000000000000000000000000000000000000000000"
)


def _golden() -> bytes:
    header = bytes.fromhex(_GOLDEN_HEADER)
    return header + bytes(HEADER_BYTES - len(header)) + bytes.fromhex(_GOLDEN_SLOTS)


def test_golden_v1_bytes(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat"
    with HeartbeatWriter(path, slots=2, record_bytes=64) as writer:
        writer.write({"step": 7, "loss": 0.5}, wall_time=1700000000.25)
        writer.write({"step": 8}, wall_time=1700000001.5)
        writer.write({"step": 9, "epoch": 1}, wall_time=1700000002.75)
    assert path.read_bytes() == _golden()

    golden = tmp_path / "golden"
    golden.write_bytes(_golden())
    records = read_all(golden)
    assert [(r.seq, r.wall_time, r.data) for r in records] == [
        (2, 1700000001.5, {"step": 8}),
        (3, 1700000002.75, {"step": 9, "epoch": 1}),
    ]
