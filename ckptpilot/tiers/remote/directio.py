"""Durable local writes that bypass the page cache (``O_DIRECT``), for the bulk of a file.

A checkpoint is written once and read only after a failure, so caching it buys nothing, and
the page cache is where a buffered write spends most of its time on a VM: the kernel finds and
zeroes a fresh page for every 4 KiB written (bench/RESULTS.md, "Where a save's time goes"),
then the fsync writes them out. With ``O_DIRECT`` the device reads straight from our buffer.

:class:`DirectWriter` wraps a file opened for writing: bytes gather in one page-aligned buffer
(``O_DIRECT`` needs aligned memory, lengths and offsets) that goes to the file in whole
buffers with ``O_DIRECT`` switched on (``fcntl``); the tail, shorter than a buffer, is written
with ``O_DIRECT`` off again, so the file needs no padding. Files smaller than one buffer never
use it. A file system that refuses ``O_DIRECT`` (tmpfs, some FUSE and network mounts) gets
ordinary buffered writes. Durability is unchanged: the caller still fsyncs (the tail and the
file's size are in the page cache until then).

Threading: one writer per file, used by one thread.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
from typing import IO

log = logging.getLogger("ckptpilot")

__all__ = ["BUFFER_BYTES", "DirectWriter"]

BUFFER_BYTES = 8 << 20
"""The aligned buffer: a multiple of every logical block size (512 B, 4 KiB)."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)


class DirectWriter:
    """A write-only file object over ``fileobj`` (opened ``"wb"``, nothing written to it
    before) that writes whole buffers with ``O_DIRECT``; :meth:`flush` writes the tail."""

    def __init__(self, fileobj: IO[bytes]) -> None:
        self._file = fileobj
        self._fd = fileobj.fileno()
        self._buffer: mmap.mmap | None = None
        self._filled = 0
        self._direct = bool(_O_DIRECT)
        self.direct_bytes = 0
        """How many bytes went to the file with ``O_DIRECT`` (for tests and benchmarks)."""

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        if not self._direct:
            self._write_all(view)
            return len(view)
        if self._buffer is None:
            self._buffer = mmap.mmap(-1, BUFFER_BYTES)  # page-aligned, as O_DIRECT needs
        done = 0
        while done < len(view):
            n = min(len(view) - done, BUFFER_BYTES - self._filled)
            self._buffer[self._filled:self._filled + n] = view[done:done + n]
            self._filled += n
            done += n
            if self._filled == BUFFER_BYTES:
                self._flush_direct()
        return len(view)

    def flush(self) -> None:
        """Write the tail (buffered); the caller fsyncs."""
        if self._buffer is not None and self._filled:
            self._set_direct(False)
            self._write_all(memoryview(self._buffer)[:self._filled])
            self._filled = 0
        self._file.flush()

    def close(self) -> None:
        """Free the buffer; what :meth:`flush` did not write is dropped (a failed write's
        file is discarded anyway)."""
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None

    def fileno(self) -> int:
        return self._fd

    def _flush_direct(self) -> None:
        assert self._buffer is not None
        view = memoryview(self._buffer)
        if self._set_direct(True):
            try:
                written = os.write(self._fd, view)
            except OSError as e:  # accepted by fcntl, refused by the write: nothing written
                if e.errno != errno.EINVAL:
                    raise
                written = 0
            self.direct_bytes += written
            view = view[written:]
        if view:  # refused, or a short write: buffered from here on
            self._direct = False
            self._set_direct(False)
            self._write_all(view)
        self._filled = 0

    def _set_direct(self, on: bool) -> bool:
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        wanted = flags | _O_DIRECT if on else flags & ~_O_DIRECT
        if wanted == flags:
            return True
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, wanted)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            log.debug("O_DIRECT refused on fd %d: buffered writes", self._fd)
            return False
        return True

    def _write_all(self, view: memoryview) -> None:
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
