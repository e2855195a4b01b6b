"""Local writes and reads that bypass the page cache (``O_DIRECT``), for the bulk of a file.

A checkpoint is written once and read only after a failure, so caching it buys nothing, and
the page cache is where a buffered write spends most of its time on a VM: the kernel finds and
zeroes a fresh page for every 4 KiB written (bench/RESULTS.md, "Where a save's time goes"),
then the fsync writes them out. With ``O_DIRECT`` the device reads straight from our buffer.

:class:`DirectWriter` wraps a file opened for writing. ``O_DIRECT`` needs aligned memory,
lengths and file offsets (:data:`ALIGN`). A piece of at least :data:`ZERO_COPY_BYTES` whose
address is congruent with its file offset (a page-aligned arena whose bytes start at a
page-aligned offset of the file: the organ's safetensors file, ``tiers.remote.archive``) goes
to the file straight from the caller's memory, its aligned body in one write, no copy; the
rest gathers in one page-aligned buffer that goes to the file with ``O_DIRECT`` whenever it is
full, or before such a piece once it ends on an aligned offset. The tail, shorter than
:data:`ALIGN` or than a buffer, is written with ``O_DIRECT`` switched off again (``fcntl``), so
the file needs no padding. The buffer is mapped on first use and only the pages a write
touches take memory. A file system that refuses ``O_DIRECT`` (tmpfs, some FUSE and network
mounts) gets ordinary buffered writes. Durability is unchanged: the caller still fsyncs (the
tail and the file's size are in the page cache until then).

:class:`DirectReader` is the read side. A restore reads a checkpoint cold (its pages were
dropped after the write), and a buffered read of a cold file has the kernel fill page-cache
pages and then copy them into the caller's buffer, on the restore's critical path; with
``O_DIRECT`` the device fills the caller's buffer itself. A file read moments ago is faster to
copy out of the page cache, so the reader asks once, as it opens the file, which of its pages
are resident (``mincore(2)`` on a mapping that touches none), and reads a piece with ``O_DIRECT``
only where some of its pages are not (bench/RESULTS.md, "restore.py — cold reads with
O_DIRECT"). Linux answers ``mincore`` truthfully only for a file the process owns or could open
for writing; for another user's read-only checkpoint it says every page is cached, and the
reads stay buffered: correct, only not faster. A buffered ``RWF_NOWAIT`` probe would not do:
on a miss it starts the readahead, and the file is read twice.

Threading: one writer per file, used by one thread; one reader per file, used by any number
of threads at once (each reading its own pieces).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import threading
from typing import IO

import numpy as np

log = logging.getLogger("ckptpilot")

__all__ = ["ALIGN", "BUFFER_BYTES", "ZERO_COPY_BYTES", "DirectReader", "DirectWriter"]

ALIGN = 4096
"""What ``O_DIRECT`` needs of addresses, lengths and offsets: a multiple of every logical block
size (512 B, 4 KiB)."""

BUFFER_BYTES = 8 << 20
"""The aligned buffer (a multiple of :data:`ALIGN`)."""

ZERO_COPY_BYTES = 1 << 20
"""The least piece written from the caller's memory: below it, one more write to the device
costs more than copying the piece into the buffer."""

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
        self._written = 0  # bytes in the file; a multiple of ALIGN while ``_direct``
        self.direct_bytes = 0
        """How many bytes went to the file with ``O_DIRECT`` (for tests and benchmarks)."""
        self.zero_copy_bytes = 0
        """Of them, how many went straight from the caller's memory (no copy)."""

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        if not self._direct:
            self._write_all(view)
            self._written += len(view)
            return len(view)
        done = 0
        while done < len(view):
            rest = view[done:]
            if self._congruent(rest):
                head = -(self._written + self._filled) % ALIGN
                self._gather(rest[:head])
                if self._filled:
                    self._flush_direct()
                body = (len(rest) - head) // ALIGN * ALIGN
                direct = self._write_direct(rest[head:head + body])
                if direct:
                    self.zero_copy_bytes += direct
                    done += head + body
                    continue
                done += head
                rest = view[done:]
            done += self._gather(rest[:BUFFER_BYTES - self._filled])
            if self._filled == BUFFER_BYTES:
                self._flush_direct()
        return len(view)

    def _congruent(self, view: memoryview) -> bool:
        """Whether ``view`` is worth writing from where it is: long enough, and its address
        congruent with its offset in the file modulo :data:`ALIGN`."""
        if not self._direct or len(view) < ZERO_COPY_BYTES + ALIGN:
            return False
        address = _address(view)
        return address is not None and (address - self._written - self._filled) % ALIGN == 0

    def _gather(self, view: memoryview) -> int:
        """Copy ``view`` into the buffer (room for it is the caller's business)."""
        if not view:
            return 0
        if self._buffer is None:
            self._buffer = mmap.mmap(-1, BUFFER_BYTES)  # page-aligned, as O_DIRECT needs
        self._buffer[self._filled:self._filled + len(view)] = view
        self._filled += len(view)
        return len(view)

    def flush(self) -> None:
        """Write the tail (buffered); the caller fsyncs."""
        if self._buffer is not None and self._filled:
            self._set_direct(False)
            self._write_all(memoryview(self._buffer)[:self._filled])
            self._written += self._filled
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
        """Write the buffer's :data:`ALIGN`-multiple fill (whole, or ending where a piece
        written from the caller's memory starts)."""
        assert self._buffer is not None and self._filled % ALIGN == 0
        view = memoryview(self._buffer)[:self._filled]
        self._filled = 0
        if not self._write_direct(view):
            self._write_all(view)
            self._written += len(view)

    def _write_direct(self, view: memoryview) -> int:
        """Write ``view`` (aligned); returns how much of it went with ``O_DIRECT``: 0, with
        nothing written, where the file system refuses it (buffered from then on). A short
        write's rest goes buffered."""
        if not self._direct:
            return 0
        if not self._set_direct(True):
            self._direct = False
            return 0
        try:
            written = os.write(self._fd, view)
        except OSError as e:  # accepted by fcntl, refused by the write: nothing written
            if e.errno != errno.EINVAL:
                raise
            written = 0
        if written == 0:
            self._direct = False
            self._set_direct(False)
            return 0
        self.direct_bytes += written
        self._written += written
        if written < len(view):  # a short write: the rest buffered, and so on after it
            self._direct = False
            self._set_direct(False)
            self._write_all(view[written:])
            self._written += len(view) - written
        return written

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


class DirectReader:
    """Reads pieces of the local file ``path`` into memory congruent with it (:meth:`read`);
    use as a context manager. ``direct=False``: buffered reads only (the caller's choice, and
    what a file system that refuses ``O_DIRECT`` gets)."""

    def __init__(self, path: str, *, direct: bool = True) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        self._direct_fd: int | None = None
        self._resident: np.ndarray | None = None
        self._use_direct = False
        self._lock = threading.Lock()
        self.direct_bytes = 0
        """How many bytes came with ``O_DIRECT`` (for tests and benchmarks)."""
        try:
            if direct and _O_DIRECT and _LIBC is not None:
                self._resident = _resident_pages(self._fd, os.fstat(self._fd).st_size)
                if self._resident is not None and not self._resident.all():
                    self._direct_fd = _open_direct(path)
            self._use_direct = self._direct_fd is not None
        except BaseException:
            self.close()
            raise

    @property
    def direct(self) -> bool:
        """Whether pieces not in the page cache go with ``O_DIRECT``."""
        return self._use_direct

    def __enter__(self) -> DirectReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fileno(self) -> int:
        """The buffered descriptor (for ``posix_fadvise``)."""
        return self._fd

    def close(self) -> None:
        self._use_direct = False
        for fd in (self._fd, self._direct_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self._fd, self._direct_fd = -1, None

    def read(self, piece: memoryview, offset: int) -> None:
        """Fill ``piece`` with the file's bytes from ``offset``; ``OSError`` naming the file when
        it ends first. The aligned body of a piece whose address is congruent with ``offset``
        modulo :data:`ALIGN` and whose pages are not all resident comes with ``O_DIRECT``; its
        unaligned head and tail, and every other piece, with ordinary reads."""
        head, body = self._direct_span(piece, offset)
        done = 0
        if body:
            done = head + self._read_direct(piece[head:head + body], offset + head)
            self._read_buffered(piece[:head], offset)
        self._read_buffered(piece[done:], offset + done)

    def _direct_span(self, piece: memoryview, offset: int) -> tuple[int, int]:
        """(head, body): the piece's bytes before its first aligned offset, and the length of
        its aligned body; body 0 when the piece goes buffered."""
        if not self._use_direct or self._resident is None or len(piece) < 2 * ALIGN:
            return 0, 0
        page = mmap.PAGESIZE
        if self._resident[offset // page:(offset + len(piece) - 1) // page + 1].all():
            return 0, 0
        address = _address(piece)
        if address is None or (address - offset) % ALIGN:
            return 0, 0
        head = -offset % ALIGN
        return head, (len(piece) - head) // ALIGN * ALIGN

    def _read_direct(self, view: memoryview, offset: int) -> int:
        """Read ``view`` (aligned) with ``O_DIRECT``; how much of it arrived (less at the end
        of the file, 0 when the file system refuses it: buffered from then on)."""
        assert self._direct_fd is not None
        got = 0
        try:
            while got < len(view):
                n = os.preadv(self._direct_fd, [view[got:]], offset + got)
                got += n
                if not n or n % ALIGN:  # the end of the file
                    break
        except OSError as e:  # accepted by open(2), refused by the read
            if e.errno != errno.EINVAL:
                raise
            log.debug("O_DIRECT reads refused for %s: buffered reads", self.path)
            self._use_direct = False
        with self._lock:
            self.direct_bytes += got
        return got

    def _read_buffered(self, view: memoryview, offset: int) -> None:
        got = 0
        while got < len(view):
            n = os.preadv(self._fd, [view[got:]], offset + got)
            if not n:
                raise OSError(f"{self.path}: file ends {len(view) - got} bytes early")
            got += n


def _open_direct(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | _O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return None


def _load_libc() -> ctypes.CDLL | None:
    """The C library the interpreter runs on (its symbols are the process's: no search, which
    ``ctypes.util.find_library`` would do by running ``ldconfig``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "mincore"):
        return None
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


_LIBC = _load_libc() if _O_DIRECT else None


def _resident_pages(fd: int, size: int) -> np.ndarray | None:
    """One flag per page of the file (1: in the page cache); None where it cannot be known
    (an empty file, a file system that cannot map it, a failed ``mincore``). The read-only
    shared mapping is only looked at: it reads no page and commits no memory."""
    if size == 0 or _LIBC is None:
        return None
    pages = np.zeros(-(-size // mmap.PAGESIZE), np.uint8)
    try:
        area = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    except OSError as e:
        log.debug("cannot map fd %d to ask which pages are cached (%s): buffered reads", fd, e)
        return None
    try:
        start = np.frombuffer(area, np.uint8)  # for its address; no byte is read
        failed = _LIBC.mincore(start.ctypes.data, size, pages.ctypes.data)
        del start  # the mapping cannot close while an array holds it
    finally:
        area.close()
    return None if failed else pages & 1


def _address(view: memoryview) -> int | None:
    """The address of ``view``'s first byte; None for memory that ctypes cannot see (a
    read-only ``bytes``)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except TypeError:
        return None
