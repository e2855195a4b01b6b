"""Level-0 heartbeats: a preallocated, memory-mapped ring file of tiny JSON records (SPEC §2).

This module owns the heartbeat file format and its writer and readers; it knows nothing about
what a record means (the pilot fills it, the failure ledger reads it) and never pickles.

Threads: :meth:`HeartbeatWriter.write` runs on the training thread every heartbeat step and
only copies bytes into the shared mapping (a few µs); a background thread of the writer makes
them durable (``fdatasync``) about every ``flush_seconds``. Because the mapping is
shared, a record is in the page cache as soon as ``write`` returns, so it survives a SIGKILL of
the process even before the flush; the flush is what makes it survive a power loss.
:func:`read_latest` and :func:`read_all` may run in any process, while a writer is live or
after it died.

File layout (little-endian, version 2)::

    offset 0     file header: magic b"CKPHBEAT", u16 version, u16 header_bytes (4096),
                 u32 slot count, u32 slot bytes, u32 CRC32 of the preceding 20 bytes
    offset 4096  slot 0, slot 1, ... each ``slot_bytes`` long; record ``seq`` lives in
                 slot (seq - 1) % slot count
    slot         b"HBS2", u32 payload length, u32 CRC32, u32 zero, u64 seq, f64 wall time,
                 f64 uptime (NaN: unknown), then the UTF-8 JSON payload

The CRC covers seq, wall time, uptime, length and payload. A record is written payload first,
then length and CRC, then the times, and ``seq`` last: a slot caught in the middle of an
overwrite carries fields of two records and fails its CRC, so a reader drops it instead of
returning a torn record. Slots start on a 4 KiB boundary, so a slot whose size divides 4 KiB
never straddles a page. Version 1 (slot magic b"HBS1", no uptime; the CRC covers seq, wall
time, length and payload) is still read, and a writer reopening such a file rewrites it as
version 2, keeping its records.

Time: the wall time only stamps a record. How long the run had been up is the uptime, taken
on the monotonic clock from the writer's opening, so a wall clock stepped back or forward
while the run lived (NTP, a fixed RTC) cannot turn it into nonsense; the failure ledger counts
a dead run's uptime from its last heartbeat's.

Damage: a ring is preallocated at its full size and only ever replaced whole, by rename. A
file at the path that is not such a ring (wrong magic, header CRC, size, an unknown version, a
directory) tells a restart nothing about the dead run, so it must not stop one:
:func:`read_latest` logs a WARNING and answers None (unknown), and :class:`HeartbeatWriter`
sets the file aside (``damaged.py``) and starts a fresh ring. A torn or corrupt slot is not
damage: it is what a kill mid-write leaves, and readers skip it.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import struct
import threading
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptpilot.errors import CheckpointFormatError
from ckptpilot.storage.damaged import set_aside

__all__ = [
    "FORMAT_VERSION",
    "SLOT_HEADER_BYTES",
    "HeartbeatRecord",
    "HeartbeatWriter",
    "read_all",
    "read_latest",
]

log = logging.getLogger("ckptpilot")

MAGIC = b"CKPHBEAT"
FORMAT_VERSION = 2
HEADER_BYTES = 4096

_FILE_HEADER = struct.Struct("<8sHHII")  # magic, version, header_bytes, slots, slot_bytes
_FILE_HEADER_CRC = struct.Struct("<I")
_SLOT_PREFIX = struct.Struct("<4sIII")  # magic, length, crc, reserved
_SLOT_SEQ = struct.Struct("<Q")
_SEQ_OFFSET = _SLOT_PREFIX.size
_TIMES_OFFSET = _SEQ_OFFSET + _SLOT_SEQ.size


@dataclass(frozen=True)
class _SlotLayout:
    """What differs between format versions: the slot magic and the times after ``seq``."""

    magic: bytes
    times: struct.Struct  # wall time, then (version 2) uptime
    crc_prefix: struct.Struct  # seq, the times, length: the CRC covers these, then the payload

    @property
    def header_bytes(self) -> int:
        return _TIMES_OFFSET + self.times.size


_LAYOUTS = {
    1: _SlotLayout(b"HBS1", struct.Struct("<d"), struct.Struct("<QdI")),
    2: _SlotLayout(b"HBS2", struct.Struct("<dd"), struct.Struct("<QddI")),
}
_WRITE_LAYOUT = _LAYOUTS[FORMAT_VERSION]
SLOT_HEADER_BYTES = _WRITE_LAYOUT.header_bytes

_MIN_SLOT_BYTES = 64
_MAX_SLOT_BYTES = 1 << 20
_MAX_SLOTS = 1 << 20

_ENCODER = json.JSONEncoder(separators=(",", ":"))

_LOST_ON_READ = "how far the previous run got is unknown (steps lost and its uptime)"
_LOST_ON_OPEN = "nothing in it is carried over"


@dataclass(frozen=True)
class HeartbeatRecord:
    """One heartbeat read back: its sequence number, the writer's wall time, the payload, and
    how long the writer had been open (seconds on the monotonic clock; None when unknown: a
    record written in format version 1)."""

    seq: int
    wall_time: float
    data: dict[str, Any]
    uptime_seconds: float | None = None

    @property
    def step(self) -> int | None:
        """The ``step`` the caller put in the record, if any."""
        step = self.data.get("step")
        return step if isinstance(step, int) else None


class HeartbeatWriter:
    """Appends heartbeat records to the ring file at ``path``.

    Lifecycle: construct (creates the file, or reopens it and continues the sequence after its
    newest valid record, so a resumed run's heartbeats sort after the dead run's; a damaged
    file is set aside with a WARNING and a fresh ring started) → :meth:`write` once per
    heartbeat step → :meth:`close` (a final ``fdatasync``). The uptime each record carries
    counts from the construction. ``write`` and ``close`` belong to one owning thread (the
    training thread); the writer starts and stops its own flush thread; :meth:`flush` may be
    called from any thread. One writer per file: two live writers on one path would
    interleave their sequences.

    ``slots`` records are kept; ``record_bytes`` is the size of one slot, its
    :data:`SLOT_HEADER_BYTES`-byte header included. Reopening a file made with another
    geometry or format version rewrites it with this one, keeping the newest records that fit.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        slots: int = 128,
        record_bytes: int = 4096,
        flush_seconds: float = 0.2,
    ) -> None:
        _check_geometry(slots, record_bytes)
        if not (flush_seconds > 0 and math.isfinite(flush_seconds)):
            raise ValueError(f"flush_seconds must be a positive number, got {flush_seconds!r}")
        self.path = Path(path)
        self.slots = slots
        self.record_bytes = record_bytes
        self.max_payload_bytes = record_bytes - SLOT_HEADER_BYTES
        self._flush_seconds = flush_seconds
        self._seq = _open_ring(self.path, slots, record_bytes)
        self._opened_monotonic = time.monotonic()
        self._flushed_seq = self._seq
        self._file = open(self.path, "r+b")  # noqa: SIM115 - held open for the writer's life
        self._map = mmap.mmap(self._file.fileno(), 0)
        self._closed = False
        self._flush_errors: set[str] = set()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._flusher = threading.Thread(
            target=self._flush_loop, name="ckptpilot-heartbeat-flush", daemon=True
        )
        self._flusher.start()

    @property
    def last_seq(self) -> int:
        """Sequence number of the newest record written (0 for a new, empty file)."""
        return self._seq

    @property
    def flushed_seq(self) -> int:
        """Sequence number of the newest record known to be on disk (fdatasync done)."""
        return self._flushed_seq

    def write(
        self,
        record: Mapping[str, Any],
        *,
        wall_time: float | None = None,
        uptime_seconds: float | None = None,
    ) -> int:
        """Serialise ``record`` as JSON into the next slot; return its sequence number.

        Training thread. Values must be JSON-serialisable (``TypeError`` otherwise); floats
        such as a NaN loss are kept (Python's JSON dialect). ``wall_time`` defaults to
        ``time.time()``, ``uptime_seconds`` to the monotonic seconds since the writer opened;
        a given one must be finite (and the uptime >= 0), else ``ValueError``. A record over
        :attr:`max_payload_bytes` raises ``ValueError``.
        """
        if self._closed:
            raise ValueError(f"heartbeat writer for {self.path} is closed")
        wall = time.time() if wall_time is None else float(wall_time)
        if uptime_seconds is None:
            uptime = time.monotonic() - self._opened_monotonic
        else:
            uptime = float(uptime_seconds)
        if not (math.isfinite(wall) and math.isfinite(uptime) and uptime >= 0):
            raise ValueError(
                f"heartbeat times must be finite and the uptime >= 0, got wall_time={wall!r}, "
                f"uptime_seconds={uptime!r}"
            )
        payload = _encode(record)
        if len(payload) > self.max_payload_bytes:
            raise ValueError(
                f"heartbeat record is {len(payload)} bytes of JSON, over the "
                f"{self.max_payload_bytes} bytes a slot holds (record_bytes={self.record_bytes} "
                f"minus the {SLOT_HEADER_BYTES}-byte slot header); put less in the record or "
                "raise record_bytes"
            )
        seq = self._seq + 1
        offset = HEADER_BYTES + ((seq - 1) % self.slots) * self.record_bytes
        _put_slot(self._map, offset, seq, wall, uptime, payload)
        self._seq = seq
        return seq

    def flush(self) -> None:
        """Make every record written so far durable now.

        ``fdatasync`` on the file writes back the mapping's dirty pages too (on Linux the
        mapping *is* the page cache), and unlike ``mmap.flush()`` — an ``msync`` that CPython
        runs holding the GIL — it releases the GIL, so the training thread never waits on it.
        """
        with self._flush_lock:
            seq = self._seq
            os.fdatasync(self._file.fileno())
            self._flushed_seq = seq

    def close(self) -> None:
        """Stop the flush thread, flush a last time and release the file. Idempotent.

        An ``OSError`` from the final flush propagates (the records stay in the page cache).
        """
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._flusher.join()
        try:
            if self._flushed_seq != self._seq:
                self.flush()
        finally:
            self._map.close()
            self._file.close()

    def __enter__(self) -> HeartbeatWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _flush_loop(self) -> None:
        while not self._stop.wait(self._flush_seconds):
            if self._flushed_seq == self._seq:
                continue
            try:
                self.flush()
            except OSError as exc:
                message = f"{type(exc).__name__}: {exc}"
                if message not in self._flush_errors:
                    self._flush_errors.add(message)
                    log.warning("heartbeat flush of %s failed: %s", self.path, message)


def read_latest(path: str | os.PathLike[str]) -> HeartbeatRecord | None:
    """The newest complete record in the heartbeat file at ``path``; None if none or no file.

    This is what a restart asks to learn how far the dead run got, and the answer is never
    worth refusing the restart over: a damaged file (see the module docstring) is reported as
    a WARNING and answers None, the same unknown as no file. The file is left where it is;
    the next :class:`HeartbeatWriter` on the path sets it aside. Torn or corrupt slots are
    skipped. Any other ``OSError`` (permission denied, say) propagates.
    """
    try:
        records = read_all(path)
    except CheckpointFormatError as exc:
        log.warning("%s; %s", exc, _LOST_ON_READ)
        return None
    return records[-1] if records else None


def read_all(path: str | os.PathLike[str]) -> list[HeartbeatRecord]:
    """Every complete record in the heartbeat file at ``path``, oldest first (newest last).

    An absent file gives ``[]``. Unlike :func:`read_latest`, a damaged file raises
    :class:`~ckptpilot.errors.CheckpointFormatError` saying what is wrong with it.
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    except IsADirectoryError as exc:
        raise CheckpointFormatError(
            f"{os.fspath(path)}: a directory, not a ckptpilot heartbeat file"
        ) from exc
    return _scan(data, os.fspath(path))[1]


@dataclass(frozen=True)
class _Header:
    version: int
    slots: int
    record_bytes: int


def _scan(data: bytes, where: str) -> tuple[_Header, list[HeartbeatRecord]]:
    header = _parse_header(data, where)
    layout = _LAYOUTS[header.version]
    records = []
    for index in range(header.slots):
        record = _get_slot(data, HEADER_BYTES + index * header.record_bytes, header, layout)
        if record is not None:
            records.append(record)
    records.sort(key=lambda record: record.seq)
    return header, records


def _check_geometry(slots: int, record_bytes: int) -> None:
    if not isinstance(slots, int) or not 1 <= slots <= _MAX_SLOTS:
        raise ValueError(f"slots must be an integer in [1, {_MAX_SLOTS}], got {slots!r}")
    if (
        not isinstance(record_bytes, int)
        or not _MIN_SLOT_BYTES <= record_bytes <= _MAX_SLOT_BYTES
        or record_bytes % 8
    ):
        raise ValueError(
            f"record_bytes must be a multiple of 8 in [{_MIN_SLOT_BYTES}, {_MAX_SLOT_BYTES}] "
            f"(it includes the {SLOT_HEADER_BYTES}-byte slot header), got {record_bytes!r}"
        )


def _put_slot(
    buffer: Any, offset: int, seq: int, wall_time: float, uptime: float, payload: bytes
) -> None:
    """Write one record into ``buffer`` (the mapping, or a bytearray) in the torn-safe order."""
    layout = _WRITE_LAYOUT
    length = len(payload)
    start = offset + layout.header_bytes
    buffer[start : start + length] = payload
    crc = zlib.crc32(payload, zlib.crc32(layout.crc_prefix.pack(seq, wall_time, uptime, length)))
    _SLOT_PREFIX.pack_into(buffer, offset, layout.magic, length, crc, 0)
    layout.times.pack_into(buffer, offset + _TIMES_OFFSET, wall_time, uptime)
    _SLOT_SEQ.pack_into(buffer, offset + _SEQ_OFFSET, seq)


def _get_slot(
    data: bytes, offset: int, header: _Header, layout: _SlotLayout
) -> HeartbeatRecord | None:
    """The record in the slot at ``offset``, or None when it is empty, torn or corrupt."""
    magic, length, crc, _ = _SLOT_PREFIX.unpack_from(data, offset)
    if magic != layout.magic or length > header.record_bytes - layout.header_bytes:
        return None
    (seq,) = _SLOT_SEQ.unpack_from(data, offset + _SEQ_OFFSET)
    times = layout.times.unpack_from(data, offset + _TIMES_OFFSET)
    start = offset + layout.header_bytes
    payload = data[start : start + length]
    expected = zlib.crc32(payload, zlib.crc32(layout.crc_prefix.pack(seq, *times, length)))
    if seq == 0 or expected != crc or not math.isfinite(times[0]):
        return None
    try:
        value = json.loads(payload)
    except ValueError:  # a CRC collision on garbage; UnicodeDecodeError is a ValueError too
        return None
    if not isinstance(value, dict):
        return None
    uptime = times[1] if len(times) > 1 and math.isfinite(times[1]) and times[1] >= 0 else None
    return HeartbeatRecord(seq=seq, wall_time=times[0], data=value, uptime_seconds=uptime)


def _header_bytes(slots: int, record_bytes: int) -> bytes:
    fields = _FILE_HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, slots, record_bytes)
    return fields + _FILE_HEADER_CRC.pack(zlib.crc32(fields))


def _parse_header(data: bytes, where: str) -> _Header:
    """The header of an intact ring; :class:`CheckpointFormatError` saying what is wrong."""
    size = _FILE_HEADER.size + _FILE_HEADER_CRC.size
    if len(data) < size:
        raise CheckpointFormatError(
            f"{where}: {len(data)} bytes, too short for a ckptpilot heartbeat file header"
        )
    if data[: len(MAGIC)] != MAGIC:
        raise CheckpointFormatError(f"{where}: not a ckptpilot heartbeat file (bad magic)")
    _, version, header_bytes, slots, record_bytes = _FILE_HEADER.unpack_from(data)
    (crc,) = _FILE_HEADER_CRC.unpack_from(data, _FILE_HEADER.size)
    if zlib.crc32(data[: _FILE_HEADER.size]) != crc:
        raise CheckpointFormatError(f"{where}: heartbeat file header is corrupt (CRC mismatch)")
    if version not in _LAYOUTS:
        raise CheckpointFormatError(
            f"{where}: heartbeat format version {version} is not supported (this ckptpilot "
            f"reads versions {', '.join(map(str, _LAYOUTS))}); upgrade ckptpilot"
        )
    if header_bytes != HEADER_BYTES:
        raise CheckpointFormatError(f"{where}: heartbeat header size {header_bytes} is invalid")
    try:
        _check_geometry(slots, record_bytes)
    except ValueError as exc:
        raise CheckpointFormatError(f"{where}: heartbeat file header is invalid: {exc}") from exc
    expected = HEADER_BYTES + slots * record_bytes
    if len(data) != expected:
        raise CheckpointFormatError(
            f"{where}: {len(data)} bytes, but its header describes {slots} slots of "
            f"{record_bytes} bytes ({expected} bytes in all): truncated or overwritten"
        )
    return _Header(version, slots, record_bytes)


def _open_ring(path: Path, slots: int, record_bytes: int) -> int:
    """Make sure ``path`` is a ring of this geometry and version, setting a damaged file
    aside; return the newest valid sequence number."""
    try:
        data = path.read_bytes()
        header, records = _scan(data, os.fspath(path))
    except FileNotFoundError:
        _create_ring(path, slots, record_bytes, [])
        return 0
    except IsADirectoryError:
        set_aside(path, "a directory is in its place", _LOST_ON_OPEN)
        _create_ring(path, slots, record_bytes, [])
        return 0
    except CheckpointFormatError as exc:
        set_aside(path, str(exc).removeprefix(f"{path}: "), _LOST_ON_OPEN)
        _create_ring(path, slots, record_bytes, [])
        return 0
    if (header.version, header.slots, header.record_bytes) != (
        FORMAT_VERSION,
        slots,
        record_bytes,
    ):
        kept = [r for r in records if len(_encode(r.data)) <= record_bytes - SLOT_HEADER_BYTES]
        _create_ring(path, slots, record_bytes, kept[-slots:])
        log.info(
            "heartbeat file %s rewritten from version %d, %d x %d to version %d, %d x %d bytes, "
            "%d record(s) kept",
            path,
            header.version,
            header.slots,
            header.record_bytes,
            FORMAT_VERSION,
            slots,
            record_bytes,
            min(len(kept), slots),
        )
    return records[-1].seq if records else 0


def _encode(data: Mapping[str, Any]) -> bytes:
    return _ENCODER.encode(data).encode("utf-8")


def _create_ring(path: Path, slots: int, record_bytes: int, records: list[HeartbeatRecord]) -> None:
    """Write a fresh ring holding ``records`` to a temporary name, fsync it, rename it over."""
    buffer = bytearray(HEADER_BYTES + slots * record_bytes)
    header = _header_bytes(slots, record_bytes)
    buffer[: len(header)] = header
    for record in records:
        offset = HEADER_BYTES + ((record.seq - 1) % slots) * record_bytes
        uptime = math.nan if record.uptime_seconds is None else record.uptime_seconds
        _put_slot(buffer, offset, record.seq, record.wall_time, uptime, _encode(record.data))
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(temporary, "wb") as file:
        file.write(buffer)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
