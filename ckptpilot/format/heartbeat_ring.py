"""The heartbeat ring file: its header, its slots and one record's bytes (SPEC §2).

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
time, length and payload) is still read; only version 2 is written.

Owns these bytes: building a header, putting a record into a slot of a buffer (the writer's
mapping or a fresh ring's bytearray) in the torn-safe order, and reading a whole ring's bytes
back. Must not open, map, flush or replace files, nor decide what to do with a damaged ring:
``storage/heartbeat.py`` does that, and the pilot fills the records.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptpilot.errors import CheckpointFormatError

__all__ = [
    "HEADER_BYTES",
    "RING_VERSION",
    "SLOT_HEADER_BYTES",
    "HeartbeatRecord",
    "RingHeader",
    "check_geometry",
    "encode_payload",
    "put_slot",
    "ring_header",
    "scan_ring",
]

MAGIC = b"CKPHBEAT"
RING_VERSION = 2
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
_WRITE_LAYOUT = _LAYOUTS[RING_VERSION]
SLOT_HEADER_BYTES = _WRITE_LAYOUT.header_bytes

_MIN_SLOT_BYTES = 64
_MAX_SLOT_BYTES = 1 << 20
_MAX_SLOTS = 1 << 20

_ENCODER = json.JSONEncoder(separators=(",", ":"))


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


@dataclass(frozen=True)
class RingHeader:
    """What an intact ring's header says: its format version and geometry."""

    version: int
    slots: int
    record_bytes: int


def scan_ring(data: bytes, where: str) -> tuple[RingHeader, list[HeartbeatRecord]]:
    """The header and every complete record of a whole ring's bytes, oldest first.

    Torn, empty or corrupt slots are skipped (a kill mid-write leaves them); a ring that is
    damaged as a whole raises ``CheckpointFormatError`` starting with ``where``.
    """
    header = _parse_header(data, where)
    layout = _LAYOUTS[header.version]
    records = []
    for index in range(header.slots):
        record = _get_slot(data, HEADER_BYTES + index * header.record_bytes, header, layout)
        if record is not None:
            records.append(record)
    records.sort(key=lambda record: record.seq)
    return header, records


def check_geometry(slots: int, record_bytes: int) -> None:
    """``ValueError`` unless a ring of ``slots`` slots of ``record_bytes`` bytes is valid."""
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


def put_slot(
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
    data: bytes, offset: int, header: RingHeader, layout: _SlotLayout
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


def ring_header(slots: int, record_bytes: int) -> bytes:
    """A current-version file header (its first bytes; the rest of the 4 KiB stays zero)."""
    fields = _FILE_HEADER.pack(MAGIC, RING_VERSION, HEADER_BYTES, slots, record_bytes)
    return fields + _FILE_HEADER_CRC.pack(zlib.crc32(fields))


def _parse_header(data: bytes, where: str) -> RingHeader:
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
        check_geometry(slots, record_bytes)
    except ValueError as exc:
        raise CheckpointFormatError(f"{where}: heartbeat file header is invalid: {exc}") from exc
    expected = HEADER_BYTES + slots * record_bytes
    if len(data) != expected:
        raise CheckpointFormatError(
            f"{where}: {len(data)} bytes, but its header describes {slots} slots of "
            f"{record_bytes} bytes ({expected} bytes in all): truncated or overwritten"
        )
    return RingHeader(version, slots, record_bytes)


def encode_payload(data: Mapping[str, Any]) -> bytes:
    """A record's JSON payload: compact, NaN kept (a NaN loss is worth recording)."""
    return _ENCODER.encode(data).encode("utf-8")
