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

File layout (little-endian, version 1)::

    offset 0     file header: magic b"CKPHBEAT", u16 version, u16 header_bytes (4096),
                 u32 slot count, u32 slot bytes, u32 CRC32 of the preceding 20 bytes
    offset 4096  slot 0, slot 1, ... each ``slot_bytes`` long; record ``seq`` lives in
                 slot (seq - 1) % slot count
    slot         b"HBS1", u32 payload length, u32 CRC32, u32 zero, u64 seq, f64 wall time,
                 then the UTF-8 JSON payload

The CRC covers seq, wall time, length and payload. A record is written payload first, then
length and CRC, then wall time, and ``seq`` last: a slot caught in the middle of an overwrite
carries fields of two records and fails its CRC, so a reader drops it instead of returning a
torn record. Slots start on a 4 KiB boundary, so a slot whose size divides 4 KiB never straddles
a page.
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
FORMAT_VERSION = 1
HEADER_BYTES = 4096
SLOT_MAGIC = b"HBS1"

_FILE_HEADER = struct.Struct("<8sHHII")  # magic, version, header_bytes, slots, slot_bytes
_FILE_HEADER_CRC = struct.Struct("<I")
_SLOT_PREFIX = struct.Struct("<4sIII")  # magic, length, crc, reserved
_SLOT_SEQ = struct.Struct("<Q")
_SLOT_WALL = struct.Struct("<d")
_CRC_PREFIX = struct.Struct("<QdI")  # seq, wall time, length: the CRC covers these, then payload
_SEQ_OFFSET = _SLOT_PREFIX.size
_WALL_OFFSET = _SEQ_OFFSET + _SLOT_SEQ.size
SLOT_HEADER_BYTES = _WALL_OFFSET + _SLOT_WALL.size

_MIN_SLOT_BYTES = 64
_MAX_SLOT_BYTES = 1 << 20
_MAX_SLOTS = 1 << 20

_ENCODER = json.JSONEncoder(separators=(",", ":"))


@dataclass(frozen=True)
class HeartbeatRecord:
    """One heartbeat read back: its sequence number, the writer's wall time and the payload."""

    seq: int
    wall_time: float
    data: dict[str, Any]

    @property
    def step(self) -> int | None:
        """The ``step`` the caller put in the record, if any."""
        step = self.data.get("step")
        return step if isinstance(step, int) else None


class HeartbeatWriter:
    """Appends heartbeat records to the ring file at ``path``.

    Lifecycle: construct (creates the file, or reopens it and continues the sequence after its
    newest valid record, so a resumed run's heartbeats sort after the dead run's) →
    :meth:`write` once per heartbeat step → :meth:`close` (a final ``fdatasync``).
    ``write`` and ``close`` belong to one owning thread (the training thread); the writer
    starts and stops its own flush thread; :meth:`flush` may be called from any thread. One
    writer per file: two live writers on one path would interleave their sequences.

    ``slots`` records are kept; ``record_bytes`` is the size of one slot, its
    :data:`SLOT_HEADER_BYTES`-byte header included. Reopening a file made with another
    geometry rewrites it with the new one, keeping the newest records that fit.
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

    def write(self, record: Mapping[str, Any], *, wall_time: float | None = None) -> int:
        """Serialise ``record`` as JSON into the next slot; return its sequence number.

        Training thread. Values must be JSON-serialisable (``TypeError`` otherwise); floats
        such as a NaN loss are kept (Python's JSON dialect). ``wall_time`` defaults to
        ``time.time()``. A record over :attr:`max_payload_bytes` raises ``ValueError``.
        """
        if self._closed:
            raise ValueError(f"heartbeat writer for {self.path} is closed")
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
        _put_slot(self._map, offset, seq, time.time() if wall_time is None else wall_time, payload)
        self._seq = seq
        return seq

    def flush(self) -> None:
        """Make every record written so far durable now.

        ``fdatasync`` on the file writes back the mapping's dirty pages too (on Linux the
        mapping *is* the page cache), and unlike ``mmap.flush()`` — an ``msync`` that CPython
        runs holding the GIL, ~135 µs every flush — it releases the GIL, so the training
        thread never waits on it.
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

    Torn or corrupt slots are skipped. A file that is not a heartbeat file, or of an unknown
    format version, raises :class:`~ckptpilot.errors.CheckpointFormatError`.
    """
    records = read_all(path)
    return records[-1] if records else None


def read_all(path: str | os.PathLike[str]) -> list[HeartbeatRecord]:
    """Every complete record in the heartbeat file at ``path``, oldest first (newest last).

    An absent file gives ``[]``; errors as :func:`read_latest`.
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    return _scan(data, os.fspath(path))


def _scan(data: bytes, where: str) -> list[HeartbeatRecord]:
    slots, record_bytes = _parse_header(data, where)
    records = []
    for index in range(slots):
        offset = HEADER_BYTES + index * record_bytes
        if offset + record_bytes > len(data):
            break
        record = _get_slot(data, offset, record_bytes)
        if record is not None:
            records.append(record)
    records.sort(key=lambda record: record.seq)
    return records


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


def _put_slot(buffer: Any, offset: int, seq: int, wall_time: float, payload: bytes) -> None:
    """Write one record into ``buffer`` (the mapping, or a bytearray) in the torn-safe order."""
    length = len(payload)
    start = offset + SLOT_HEADER_BYTES
    buffer[start : start + length] = payload
    crc = zlib.crc32(payload, zlib.crc32(_CRC_PREFIX.pack(seq, wall_time, length)))
    _SLOT_PREFIX.pack_into(buffer, offset, SLOT_MAGIC, length, crc, 0)
    _SLOT_WALL.pack_into(buffer, offset + _WALL_OFFSET, wall_time)
    _SLOT_SEQ.pack_into(buffer, offset + _SEQ_OFFSET, seq)


def _get_slot(data: bytes, offset: int, record_bytes: int) -> HeartbeatRecord | None:
    """The record in the slot at ``offset``, or None when it is empty, torn or corrupt."""
    magic, length, crc, _ = _SLOT_PREFIX.unpack_from(data, offset)
    if magic != SLOT_MAGIC or length > record_bytes - SLOT_HEADER_BYTES:
        return None
    (seq,) = _SLOT_SEQ.unpack_from(data, offset + _SEQ_OFFSET)
    (wall_time,) = _SLOT_WALL.unpack_from(data, offset + _WALL_OFFSET)
    start = offset + SLOT_HEADER_BYTES
    payload = data[start : start + length]
    if seq == 0 or zlib.crc32(payload, zlib.crc32(_CRC_PREFIX.pack(seq, wall_time, length))) != crc:
        return None
    try:
        value = json.loads(payload)
    except ValueError:  # a CRC collision on garbage; UnicodeDecodeError is a ValueError too
        return None
    if not isinstance(value, dict):
        return None
    return HeartbeatRecord(seq=seq, wall_time=wall_time, data=value)


def _header_bytes(slots: int, record_bytes: int) -> bytes:
    fields = _FILE_HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, slots, record_bytes)
    return fields + _FILE_HEADER_CRC.pack(zlib.crc32(fields))


def _parse_header(data: bytes, where: str) -> tuple[int, int]:
    size = _FILE_HEADER.size + _FILE_HEADER_CRC.size
    if len(data) < size or data[: len(MAGIC)] != MAGIC:
        raise CheckpointFormatError(
            f"{where}: not a ckptpilot heartbeat file (bad magic); move it out of the way"
        )
    _, version, header_bytes, slots, record_bytes = _FILE_HEADER.unpack_from(data)
    (crc,) = _FILE_HEADER_CRC.unpack_from(data, _FILE_HEADER.size)
    if zlib.crc32(data[: _FILE_HEADER.size]) != crc:
        raise CheckpointFormatError(f"{where}: heartbeat file header is corrupt (CRC mismatch)")
    if version != FORMAT_VERSION:
        raise CheckpointFormatError(
            f"{where}: heartbeat format version {version} is not supported (this ckptpilot "
            f"reads version {FORMAT_VERSION}); upgrade ckptpilot"
        )
    if header_bytes != HEADER_BYTES:
        raise CheckpointFormatError(f"{where}: heartbeat header size {header_bytes} is invalid")
    try:
        _check_geometry(slots, record_bytes)
    except ValueError as exc:
        raise CheckpointFormatError(f"{where}: heartbeat file header is invalid: {exc}") from exc
    return slots, record_bytes


def _open_ring(path: Path, slots: int, record_bytes: int) -> int:
    """Make sure ``path`` is a ring of this geometry; return the newest valid sequence number."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        _create_ring(path, slots, record_bytes, [])
        return 0
    records = _scan(data, os.fspath(path))
    old_slots, old_record_bytes = _parse_header(data, os.fspath(path))
    expected_size = HEADER_BYTES + old_slots * old_record_bytes
    if (old_slots, old_record_bytes) != (slots, record_bytes) or len(data) != expected_size:
        kept = [r for r in records if len(_encode(r.data)) <= record_bytes - SLOT_HEADER_BYTES]
        _create_ring(path, slots, record_bytes, kept[-slots:])
        log.info(
            "heartbeat file %s rewritten from %d x %d to %d x %d bytes, %d record(s) kept",
            path,
            old_slots,
            old_record_bytes,
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
        _put_slot(buffer, offset, record.seq, record.wall_time, _encode(record.data))
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
