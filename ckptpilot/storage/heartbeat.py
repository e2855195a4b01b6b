"""Level-0 heartbeats: a preallocated, memory-mapped ring file of tiny JSON records (SPEC §2).

This module owns the heartbeat ring's writer and readers: the file, its mapping, its
durability and what to do with a damaged one. The bytes (header, slots, the torn-safe write
order, format versions 1 and 2) are ``ckptpilot.format.heartbeat_ring``'s. It knows nothing
about what a record means (the pilot fills it, the failure ledger reads it) and never pickles.

Threads: :meth:`HeartbeatWriter.write` runs on the training thread every heartbeat step and
only copies bytes into the shared mapping (no syscall; its cost is in bench/RESULTS.md,
scheduler.py); a background thread of the writer makes them durable (``fdatasync``) about
every ``flush_seconds``. Because the mapping is
shared, a record is in the page cache as soon as ``write`` returns, so it survives a SIGKILL of
the process even before the flush; the flush is what makes it survive a power loss.
:func:`read_latest` and :func:`read_all` may run in any process, while a writer is live or
after it died.

Versions: only the current format version is written; a writer reopening a version-1 ring
rewrites it as the current version, keeping its records.

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

import logging
import math
import mmap
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckptpilot.errors import CheckpointFormatError
from ckptpilot.format.heartbeat_ring import (
    HEADER_BYTES,
    RING_VERSION,
    SLOT_HEADER_BYTES,
    HeartbeatRecord,
    check_geometry,
    encode_payload,
    put_slot,
    ring_header,
    scan_ring,
)
from ckptpilot.storage.damaged import set_aside

__all__ = [
    "HEADER_BYTES",
    "SLOT_HEADER_BYTES",
    "HeartbeatRecord",
    "HeartbeatWriter",
    "read_all",
    "read_latest",
]

log = logging.getLogger("ckptpilot")

_LOST_ON_READ = "how far the previous run got is unknown (steps lost and its uptime)"
_LOST_ON_OPEN = "nothing in it is carried over"


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
        check_geometry(slots, record_bytes)
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
        payload = encode_payload(record)
        if len(payload) > self.max_payload_bytes:
            raise ValueError(
                f"heartbeat record is {len(payload)} bytes of JSON, over the "
                f"{self.max_payload_bytes} bytes a slot holds (record_bytes={self.record_bytes} "
                f"minus the {SLOT_HEADER_BYTES}-byte slot header); put less in the record or "
                "raise record_bytes"
            )
        seq = self._seq + 1
        offset = HEADER_BYTES + ((seq - 1) % self.slots) * self.record_bytes
        put_slot(self._map, offset, seq, wall, uptime, payload)
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
    return scan_ring(data, os.fspath(path))[1]


def _open_ring(path: Path, slots: int, record_bytes: int) -> int:
    """Make sure ``path`` is a ring of this geometry and version, setting a damaged file
    aside; return the newest valid sequence number."""
    try:
        data = path.read_bytes()
        header, records = scan_ring(data, os.fspath(path))
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
        RING_VERSION,
        slots,
        record_bytes,
    ):
        kept = [
            r for r in records if len(encode_payload(r.data)) <= record_bytes - SLOT_HEADER_BYTES
        ]
        _create_ring(path, slots, record_bytes, kept[-slots:])
        log.info(
            "heartbeat file %s rewritten from version %d, %d x %d to version %d, %d x %d bytes, "
            "%d record(s) kept",
            path,
            header.version,
            header.slots,
            header.record_bytes,
            RING_VERSION,
            slots,
            record_bytes,
            min(len(kept), slots),
        )
    return records[-1].seq if records else 0


def _create_ring(path: Path, slots: int, record_bytes: int, records: list[HeartbeatRecord]) -> None:
    """Write a fresh ring holding ``records`` to a temporary name, fsync it, rename it over."""
    buffer = bytearray(HEADER_BYTES + slots * record_bytes)
    header = ring_header(slots, record_bytes)
    buffer[: len(header)] = header
    for record in records:
        offset = HEADER_BYTES + ((record.seq - 1) % slots) * record_bytes
        uptime = math.nan if record.uptime_seconds is None else record.uptime_seconds
        put_slot(buffer, offset, record.seq, record.wall_time, uptime, encode_payload(record.data))
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
