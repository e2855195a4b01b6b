"""The failure ledger (JSON lines, torn tails, damage, clocks, MTBF)."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from enum import Enum
from pathlib import Path

import pytest

from ckptpilot.storage.heartbeat import HeartbeatWriter, read_latest
from ckptpilot.storage.ledger import (
    FUTURE_SLACK_SECONDS,
    FailureLedger,
    Interruption,
)

HOUR = 3600.0


# -- ledger ---------------------------------------------------------------------------------


class Source(str, Enum):
    REMOTE = "remote"


def synthetic_ledger(path: Path) -> FailureLedger:
    """Three runs: up 1 h then killed; up 2 h then killed; up 30 min, clean end. MTBF 1.75 h."""
    ledger = FailureLedger(path)
    ledger.record_run_start(0, wall_time=0.0)
    ledger.record_interruption(
        failed_at=HOUR,
        last_step=3600,
        recovered_step=3500,
        source="memory",
        recovery_seconds=4.0,
        wall_time=HOUR + 60,
    )
    ledger.record_run_start(3500, wall_time=HOUR + 60)
    ledger.record_interruption(
        failed_at=3 * HOUR + 60,
        last_step=10_800,
        recovered_step=10_000,
        source=Source.REMOTE,
        recovery_seconds=30.5,
        wall_time=3 * HOUR + 600,
    )
    ledger.record_run_start(10_000, wall_time=3 * HOUR + 600)
    ledger.record_run_end(11_800, wall_time=3.5 * HOUR + 600)
    return ledger


def test_rollbacks_are_read_back_and_change_neither_the_mtbf_nor_the_last_kind(
        tmp_path: Path) -> None:
    """A rollback keeps the run going: a run still counts as unclosed after it (so a crash
    is still recorded as an interruption) and the MTBF is the same with or without it."""
    path = tmp_path / "failures.jsonl"
    ledger = synthetic_ledger(path)
    mtbf = ledger.mtbf_seconds()
    ledger.record_run_start(11_800, wall_time=4 * HOUR)
    event = ledger.record_rollback(step=12_050, onset=12_040, to_step=12_000,
                                   skipped_batches=50, reason="loss 9 above 2 x 3",
                                   wall_time=4 * HOUR + 60)
    assert FailureLedger(path).rollbacks() == [event]
    assert (event.to_step, event.onset, event.skipped_batches) == (12_000, 12_040, 50)
    assert ledger.last_kind() == "run_start"
    ledger.record_run_end(12_100, wall_time=4.5 * HOUR)
    assert ledger.mtbf_seconds() == pytest.approx(mtbf + 0.5 * HOUR / 2)
    assert json.loads(path.read_text().splitlines()[-2])["kind"] == "rollback"


def test_mtbf_is_uptime_over_interruptions(tmp_path: Path) -> None:
    ledger = synthetic_ledger(tmp_path / "failures.jsonl")
    assert ledger.mtbf_seconds() == pytest.approx((1 + 2 + 0.5) * HOUR / 2)


def test_interruptions_are_read_back_with_steps_lost(tmp_path: Path) -> None:
    ledger = synthetic_ledger(tmp_path / "failures.jsonl")
    first, second = FailureLedger(ledger.path).interruptions()
    assert first == Interruption(
        wall_time=HOUR + 60,
        failed_at=HOUR,
        last_step=3600,
        recovered_step=3500,
        steps_lost=100,
        source="memory",
        recovery_seconds=4.0,
    )
    assert (second.steps_lost, second.source) == (800, "remote")


def test_mtbf_counts_a_running_run_only_when_told_now(tmp_path: Path) -> None:
    ledger = FailureLedger(tmp_path / "failures.jsonl")
    ledger.record_run_start(0, wall_time=0.0)
    ledger.record_interruption(
        failed_at=100.0, last_step=10, recovered_step=5, source="remote", recovery_seconds=1.0
    )
    ledger.record_run_start(5, wall_time=200.0)
    assert ledger.mtbf_seconds() == 100.0
    assert ledger.mtbf_seconds(now=500.0) == 400.0


def test_mtbf_is_none_without_interruptions(tmp_path: Path) -> None:
    ledger = FailureLedger(tmp_path / "missing" / "failures.jsonl")
    assert ledger.interruptions() == []
    assert ledger.mtbf_seconds() is None
    ledger.record_run_start(0, wall_time=0.0)
    ledger.record_run_end(100, wall_time=50.0)
    assert ledger.mtbf_seconds(now=1e6) is None


def test_a_run_with_an_unknown_end_counts_no_uptime(tmp_path: Path) -> None:
    ledger = FailureLedger(tmp_path / "failures.jsonl")
    ledger.record_run_start(0, wall_time=0.0)
    ledger.record_run_start(50, wall_time=1000.0)  # the first run's end was never recorded
    ledger.record_interruption(
        failed_at=1100.0, last_step=60, recovered_step=50, source="peer", recovery_seconds=2.0
    )
    assert ledger.mtbf_seconds() == 100.0


def test_each_append_is_one_fsynced_json_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    ledger = FailureLedger(tmp_path / "failures.jsonl")
    ledger.record_run_start(0, wall_time=1.0)  # file + directory entry
    ledger.record_run_end(5, wall_time=2.0)
    assert len(synced) == 3
    lines = ledger.path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == [
        {"v": 1, "kind": "run_start", "wall_time": 1.0, "step": 0},
        {"v": 1, "kind": "run_end", "wall_time": 2.0, "step": 5},
    ]


GOLDEN_V1 = (
    '{"v": 1, "kind": "run_start", "wall_time": 1000.0, "step": 0}\n'
    '{"v": 1, "kind": "interruption", "wall_time": 1500.0, "failed_at": 1400.0, '
    '"last_step": 420, "recovered_step": 400, "steps_lost": 20, "source": "peer", '
    '"recovery_seconds": 3.25}\n'
    '{"v": 1, "kind": "run_start", "wall_time": 1500.0, "step": 400}\n'
)


def test_version_1_records_stay_readable(tmp_path: Path) -> None:
    path = tmp_path / "failures.jsonl"
    path.write_text(GOLDEN_V1, encoding="utf-8")
    ledger = FailureLedger(path)
    assert ledger.interruptions() == [Interruption(1500.0, 1400.0, 420, 400, 20, "peer", 3.25)]
    assert ledger.mtbf_seconds() == 400.0


@pytest.mark.parametrize(
    "torn",
    [b'{"v": 1, "kind": "interruption", "wall_ti', b"\x00" * 64, b"{"],
    ids=["cut-record", "nul-bytes", "one-byte"],
)
def test_torn_last_line_is_skipped_then_cut_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, torn: bytes
) -> None:
    path = tmp_path / "failures.jsonl"
    path.write_text(GOLDEN_V1, encoding="utf-8")
    with path.open("ab") as file:
        file.write(torn)
    ledger = FailureLedger(path)
    with caplog.at_level(logging.WARNING, logger="ckptpilot"):
        assert len(ledger.interruptions()) == 1
    assert "torn last line" in caplog.text

    caplog.clear()
    ledger.record_run_end(500, wall_time=2000.0)
    assert path.read_text(encoding="utf-8") == (
        GOLDEN_V1 + '{"v": 1, "kind": "run_end", "wall_time": 2000.0, "step": 500}\n'
    )
    assert "cutting off a torn last line" in caplog.text
    caplog.clear()
    assert ledger.mtbf_seconds() == 900.0
    assert caplog.text == ""


def test_complete_last_record_without_newline_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "failures.jsonl"
    path.write_text(GOLDEN_V1.rstrip("\n"), encoding="utf-8")
    ledger = FailureLedger(path)
    assert ledger.mtbf_seconds(now=1600.0) == 500.0  # the last run_start was read
    ledger.record_run_end(500, wall_time=1700.0)
    assert path.read_text(encoding="utf-8").count("\n") == 4
    assert ledger.mtbf_seconds() == 600.0


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "line 2: not a JSON record"),
        ('{"v": 2, "kind": "run_start"}', "line 2: not a version-1 ledger record"),
        ('{"v": 1, "kind": "reboot", "wall_time": 1}', "line 2: unknown record kind 'reboot'"),
        ('{"v": 1, "kind": "run_end", "step": 3}', "line 2: run_end record lacks wall_time"),
        (
            '{"v": 1, "kind": "run_start", "wall_time": "noon", "step": 0}',
            "line 2: run_start record has wall_time='noon', not a int or float",
        ),
        (
            '{"v": 1, "kind": "run_end", "wall_time": 1.0, "step": true}',
            "line 2: run_end record has step=True, not a int",
        ),
        ("\x00\xff\x13 binary junk", "line 2: not a JSON record"),
        ('{"v": 1, "kind": "run_start", "wall_time": ' + "9" * 400 + ', "step": 0}',
         "line 2: run_start record has wall_time beyond ±2**53"),
        ('{"v": 1, "kind": "run_end", "wall_time": 1.0, "step": ' + "9" * 5000 + "}",
         "line 2: not a JSON record"),
    ],
)
def test_a_bad_line_before_the_end_sets_the_file_aside_and_keeps_the_valid_records(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, line: str, message: str
) -> None:
    lines = GOLDEN_V1.splitlines()
    path = tmp_path / "failures.jsonl"
    damaged = "\n".join([lines[0], line, *lines[1:]]) + "\n"
    path.write_bytes(damaged.encode("utf-8", "surrogateescape"))
    ledger = FailureLedger(path)
    with caplog.at_level(logging.WARNING, logger="ckptpilot"):
        assert ledger.last_kind() == "run_start"
    [aside] = tmp_path.glob("failures.jsonl.damaged-*")
    assert aside.read_bytes() == damaged.encode("utf-8", "surrogateescape")
    assert f"{path} is damaged ({message}" in caplog.text
    assert f"kept it as {aside.name}" in caplog.text
    assert path.read_text(encoding="utf-8") == GOLDEN_V1  # the valid records, unchanged

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckptpilot"):
        assert ledger.mtbf_seconds() == 400.0
        assert ledger.interruptions() == [Interruption(1500.0, 1400.0, 420, 400, 20, "peer", 3.25)]
        ledger.record_run_end(500, wall_time=1600.0)
    assert caplog.text == ""
    assert list(tmp_path.glob("failures.jsonl.damaged-*")) == [aside]
    assert ledger.mtbf_seconds() == 500.0


def test_a_file_of_garbage_is_set_aside_and_the_ledger_starts_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "failures.jsonl"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) + b"\n")
    ledger = FailureLedger(path)
    with caplog.at_level(logging.WARNING, logger="ckptpilot"):
        assert ledger.mtbf_seconds() is None
    assert re.search(r"is damaged \(line 1: not a JSON record .*, and 3 more bad line", caplog.text)
    assert path.read_bytes() == b""
    assert ledger.last_kind() is None
    ledger.record_run_start(0, wall_time=10.0)
    assert ledger.last_kind() == "run_start"
    assert len(list(tmp_path.glob("failures.jsonl.damaged-*"))) == 1


# -- ledger: clocks -------------------------------------------------------------------------


def test_a_clock_stepped_back_during_a_run_leaves_its_uptime_unknown_never_zero(
    tmp_path: Path,
) -> None:
    """The run started at 5000 on a clock running ahead; its last heartbeat says 4000."""
    ledger = FailureLedger(tmp_path / "failures.jsonl")
    ledger.record_run_start(0, wall_time=5000.0)
    ledger.record_interruption(
        failed_at=4000.0, last_step=90, recovered_step=80, source="remote", recovery_seconds=1.0
    )
    ledger.record_run_start(80, wall_time=4100.0)
    assert ledger.mtbf_seconds() is None
    assert ledger.mtbf_seconds(now=4200.0) is None
    ledger.record_interruption(
        failed_at=4100.0, last_step=85, recovered_step=80, source="remote", recovery_seconds=1.0
    )  # zero seconds up: unknown too
    assert ledger.mtbf_seconds() is None

    ledger.record_run_start(80, wall_time=4200.0)
    ledger.record_interruption(
        failed_at=4500.0, last_step=95, recovered_step=90, source="remote", recovery_seconds=1.0
    )
    assert ledger.mtbf_seconds() == 300.0  # only the run of known duration counts
    assert len(ledger.interruptions()) == 3  # every interruption is still on record


def test_stamps_in_the_future_are_unknown(tmp_path: Path) -> None:
    ahead = time.time() + 86_400.0  # written while the clock ran a day ahead
    ledger = FailureLedger(tmp_path / "failures.jsonl")
    ledger.record_run_start(0, wall_time=ahead)
    ledger.record_interruption(
        failed_at=ahead + 100.0, last_step=9, recovered_step=5, source="peer", recovery_seconds=1
    )
    assert ledger.mtbf_seconds() is None
    assert ledger.mtbf_seconds(now=ahead + 200.0) == 100.0  # seen from that day, it is fine
    ledger.record_run_start(5)
    assert ledger.mtbf_seconds() is None
    ledger.record_interruption(
        failed_at=time.time() + FUTURE_SLACK_SECONDS / 2,  # a little ahead: another host
        last_step=9,
        recovered_step=5,
        source="peer",
        recovery_seconds=1,
    )
    mtbf = ledger.mtbf_seconds()
    assert mtbf is not None and 0 < mtbf <= FUTURE_SLACK_SECONDS


def test_a_recorded_uptime_wins_over_the_wall_clock(tmp_path: Path) -> None:
    ledger = FailureLedger(tmp_path / "failures.jsonl")
    ledger.record_run_start(0, wall_time=5000.0)
    record = ledger.record_interruption(
        failed_at=4000.0,  # the wall clock went back an hour and more
        last_step=90,
        recovered_step=80,
        source="memory",
        recovery_seconds=1.0,
        uptime_seconds=3600.0,  # the dead run's heartbeat: up an hour on the monotonic clock
    )
    assert record.uptime_seconds == 3600.0
    assert FailureLedger(ledger.path).interruptions()[0].uptime_seconds == 3600.0
    assert ledger.mtbf_seconds() == 3600.0
    ledger.record_interruption(  # an interruption without a start record: its uptime counts
        failed_at=1.0,
        last_step=1,
        recovered_step=0,
        source="memory",
        recovery_seconds=1.0,
        uptime_seconds=1800.0,
    )
    assert ledger.mtbf_seconds() == 2700.0


@pytest.mark.parametrize("bad", [0.0, -5.0, math.nan, math.inf])
def test_a_nonsense_uptime_is_recorded_as_unknown(tmp_path: Path, bad: float) -> None:
    ledger = FailureLedger(tmp_path / "failures.jsonl")
    ledger.record_run_start(0, wall_time=1000.0)
    record = ledger.record_interruption(
        failed_at=1100.0,
        last_step=9,
        recovered_step=5,
        source="peer",
        recovery_seconds=1,
        uptime_seconds=bad,
    )
    assert record.uptime_seconds is None
    assert "uptime_seconds" not in json.loads(ledger.path.read_text().splitlines()[-1])
    assert ledger.mtbf_seconds() == 100.0  # the wall clock's answer, which is sane here


def test_a_run_the_ledger_saw_start_and_end_is_timed_on_the_monotonic_clock(
    tmp_path: Path,
) -> None:
    ledger = FailureLedger(tmp_path / "failures.jsonl")
    ledger.record_run_start(0, wall_time=1000.0)
    ledger.record_interruption(
        failed_at=1100.0, last_step=9, recovered_step=5, source="peer", recovery_seconds=1
    )
    before = time.monotonic()
    ledger.record_run_start(5)
    ledger.record_run_end(50)
    bound = time.monotonic() - before
    end = json.loads(ledger.path.read_text().splitlines()[-1])
    assert end["kind"] == "run_end" and 0 <= end["uptime_seconds"] <= bound
    mtbf = ledger.mtbf_seconds()
    assert mtbf is not None and 100.0 <= mtbf <= 100.0 + bound


def test_invalid_interruption_values_are_refused(tmp_path: Path) -> None:
    ledger = FailureLedger(tmp_path / "failures.jsonl")
    with pytest.raises(ValueError, match="recovery_seconds"):
        ledger.record_interruption(
            failed_at=1.0, last_step=1, recovered_step=0, source="remote", recovery_seconds=-1
        )
    with pytest.raises(ValueError, match="failed_at"):
        ledger.record_interruption(
            failed_at=math.nan, last_step=1, recovered_step=0, source="remote", recovery_seconds=1
        )
    assert not ledger.path.exists()


def test_steps_lost_never_negative(tmp_path: Path) -> None:
    ledger = FailureLedger(tmp_path / "failures.jsonl")
    record = ledger.record_interruption(
        failed_at=1.0, last_step=90, recovered_step=100, source="remote", recovery_seconds=1.0
    )
    assert record.steps_lost == 0


def test_the_pilots_restart_calls_survive_a_clock_stepped_back_during_the_dead_run(
    tmp_path: Path,
) -> None:
    """Run 1 started on a clock an hour ahead, which was stepped back before its last
    heartbeat; run 2 restarts with the pilot's calls: read_latest, last_kind,
    record_interruption, record_run_start, mtbf_seconds."""
    ring, path = tmp_path / "heartbeat.ring", tmp_path / "failures.jsonl"
    FailureLedger(path).record_run_start(0, wall_time=time.time() + HOUR)
    with HeartbeatWriter(ring, slots=4, record_bytes=256) as writer:
        writer.write({"step": 40}, uptime_seconds=1800.0)

    last = read_latest(ring)
    assert last is not None and last.step == 40 and last.uptime_seconds == 1800.0
    ledger = FailureLedger(path)
    assert ledger.last_kind() == "run_start"
    wall_only = {
        "failed_at": last.wall_time,
        "last_step": 40,
        "recovered_step": 30,
        "source": "remote",
        "recovery_seconds": 0.5,
    }
    ledger.record_interruption(**wall_only)
    ledger.record_run_start(30)
    assert ledger.mtbf_seconds() is None  # the wall clock alone: unknown, not 0

    ledger.record_run_start(30, wall_time=time.time() + HOUR)  # the same again, with uptime
    ledger.record_interruption(**wall_only, uptime_seconds=last.uptime_seconds)
    ledger.record_run_start(30)
    assert ledger.mtbf_seconds() == 1800.0
