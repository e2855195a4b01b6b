"""The remote tier: persistent storage behind an fsspec URL (local dir, NFS, S3, GCS).

It owns durability and atomic publication, nothing about checkpoint contents beyond one
name: the commit file (``manifest.json``), which the archive writes last.

- On a local file system files are written into a staging directory, fsynced, and the
  directory is published under its final name in one ``rename(2)`` followed by an fsync of
  the parent.
- An object store has no rename (a "move" is a copy of every byte, then a delete): files are
  written straight under the final name, streamed (multipart for large ones), and the
  checkpoint is committed by writing its commit file last — one PUT, atomic on S3, GCS and
  Azure. A directory without its commit file is an unfinished save: listings show it as
  staging debris, never as a checkpoint. Setting a checkpoint aside (superseded, corrupted)
  copies it file by file and then deletes it, commit file first.

Nothing is deleted but through :meth:`RemoteTier.remove`, and it deletes only a checkpoint
(its name, its manifest), in an order that never leaves a published checkpoint with files
missing: ``tiers.remote.entries`` has the rule and the order.

``storage_options`` go to fsspec as they are (endpoint, credentials, region); they are never
logged — only the URL is.

Off a local file system every operation that can be repeated as it is (a read of one object or
a range of it, a listing, an ``exists``, the write of one object from bytes in hand) is retried
on the errors of a network that fails and comes back (``tiers.remote.retries``, one log line a
retry), then fails as ``RemoteIOError`` naming the URL and the cause (``tiers/remote/retry.py``).

One rank's view of it as a :class:`~ckptpilot.tiers.base.CheckpointTier` is
``tiers.remote.tier.RemoteCheckpointTier`` (it needs ``tiers.remote.archive``, which needs this
module).

Threading: one writer thread and any number of readers; methods hold no shared state.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import IO, Any

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from ckptpilot.errors import IntegrityError
from ckptpilot.format.digest import (
    READ_DIGESTS,
    ChunkDigest,
    ReadDigest,
    check_chunk,
    chunk_ranges,
    hash_pool,
    is_chunked,
    read_digest,
)
from ckptpilot.hostmem import fresh_bytes
from ckptpilot.tiers.remote import entries
from ckptpilot.tiers.remote.directio import DirectReader, DirectWriter
from ckptpilot.tiers.remote.entries import COMMIT_FILE, STAGING_MARK
from ckptpilot.tiers.remote.retry import (
    NO_RETRIES,
    Retries,
    fs_options,
    gave_up,
    inside_retry,
    retrying,
    transient,
)

log = logging.getLogger(__name__)

_READ_CHUNK = 16 << 20
_READ_AHEAD_BYTES = 256 << 20
"""How far ahead of the chunks being read a local chunked read asks the kernel for pages
(``_will_need``): enough to keep the disk busy, bounded so that a file larger than memory
does not push its own next chunks out of the page cache."""
_NOT_DURABLE = frozenset({"memory"})


class RemoteTier:
    """A directory tree under an fsspec URL, written with fsync + atomic publish."""

    name = "remote"

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None,
                 retries: Retries | None = None, *, verify_reads: ReadDigest = "sha256") -> None:
        if verify_reads not in READ_DIGESTS:
            raise ValueError(f"verify_reads: {verify_reads!r} is not one of {READ_DIGESTS}")
        self.url = str(url)
        # Which chunk digests ``read_verified`` checks (``format.digest`` says what each one
        # guarantees); ``verify`` always checks SHA256.
        self.verify_reads: ReadDigest = verify_reads
        retries = retries or NO_RETRIES
        options, library_retries = fs_options(self.url, storage_options, retries)
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        if library_retries is not None:
            self.fs.retries = library_retries
        # The root is created by the first save (``new_staging``), not here: reading a run
        # (``ls``, a restore, a dry run) must change nothing, and a mistyped URL must not
        # appear as an empty tier.
        self.is_local = isinstance(self.fs, LocalFileSystem)
        # Publication by directory rename is atomic on a local file system only.
        self.renames = self.is_local
        protocols = self.fs.protocol
        protocols = (protocols,) if isinstance(protocols, str) else tuple(protocols)
        # Data that does not outlive this process cannot be a recovery point.
        self.durable = not _NOT_DURABLE.intersection(protocols)
        # A local file system's errors are its answer, not weather: tried once.
        self.retries = NO_RETRIES if self.is_local else retries

    def _retry(self, what: str, relpath: str, fn: Any, *args: Any) -> Any:
        if self.retries is NO_RETRIES:
            return fn(*args)
        return retrying(self.retries, f"{what} {self.fs.unstrip_protocol(self.path(relpath))}",
                        fn, *args)

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def new_staging(self, name: str) -> str:
        """Reserve where checkpoint ``name`` is written before it is published; returns its
        relative name. Locally a fresh directory beside ``name``. On an object store
        ``name`` itself (see the module docstring): a committed checkpoint already there is
        set aside (``*.replaced-*``), the files of an unfinished save are removed."""
        if not self.renames:
            if self.exists(name):
                if self.exists(f"{name}/{COMMIT_FILE}"):
                    aside = self.set_aside(name, "replaced")
                    log.warning("checkpoint %s already exists; moved it aside to %s", name,
                                aside)
                else:
                    self.remove(name)
            return name
        staging = f"{name}{STAGING_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.fs.makedirs(self.path(staging), exist_ok=True)
        return staging

    def committed(self, name: str) -> bool:
        """Whether the directory ``name`` is a published checkpoint rather than an unfinished
        save: always for a listed name on a local file system (publication is its rename);
        on an object store when its commit file is there."""
        return self.renames or self.exists(f"{name}/{COMMIT_FILE}")

    def write_file(self, relpath: str, chunks: Iterable[bytes | memoryview]) -> tuple[int, str]:
        """Write ``chunks`` to ``relpath`` durably; returns (bytes written, SHA256 hex).

        The digest is computed from the very buffers handed to the file, so it certifies what
        was written, not a second reading of the source.
        """
        def once(parts: Iterable[bytes | memoryview]) -> tuple[int, str]:
            with self.open_write(relpath) as out:
                for chunk in parts:
                    out.write(chunk)
            return out.size, out.sha256
        if isinstance(chunks, list | tuple):  # in hand: the write can be made again
            return self._retry("write", relpath, once, chunks)  # type: ignore[no-any-return]
        return once(chunks)

    def write_record(self, relpath: str, chunks: Iterable[bytes | memoryview], *,
                     fsync: bool = True) -> dict[str, Any]:
        """``write_file`` with chunk digests (``format.digest``): returns the file record,
        hashed on several threads while the bytes are written."""
        def once(parts: Iterable[bytes | memoryview]) -> dict[str, Any]:
            with self.open_write(relpath, chunked=True, fsync=fsync) as out:
                for chunk in parts:
                    out.write(chunk)
            return out.record
        if isinstance(chunks, list | tuple):  # in hand: the write can be made again
            return self._retry("write", relpath, once, chunks)  # type: ignore[no-any-return]
        return once(chunks)

    @contextmanager
    def open_write(self, relpath: str, *, digest: bool = True, chunked: bool = False,
                   fsync: bool = True) -> Iterator[HashingWriter]:
        """A file object for a producer that writes by itself (the codec container); hashed
        like ``write_file`` (``chunked``: like ``write_record``) and, with ``fsync``, made
        durable when the block ends without an error (else it is in the page cache: safe from
        a crash of this process, not of the machine)."""
        target = self.path(relpath)
        if self.is_local:
            with open(target, "wb") as f:
                sink = DirectWriter(f) if fsync else f  # durable anyway: skip the page cache
                try:
                    out = HashingWriter(sink, digest=digest, chunked=chunked)
                    yield out
                    sink.flush()
                finally:
                    if sink is not f:
                        sink.close()
                if fsync:
                    os.fsync(f.fileno())
                    _drop_from_page_cache(f.fileno())
        else:
            try:
                with self.fs.open(target, "wb") as f:
                    out = HashingWriter(f, digest=digest, chunked=chunked)
                    yield out
            except Exception as e:
                # A producer's stream cannot be replayed: one attempt (s3fs still retries
                # each part's request).
                if inside_retry() or not transient(e):
                    raise
                raise gave_up(f"write {self.fs.unstrip_protocol(target)}", 1, e) from e

    def publish(self, staging: str, final: str) -> None:
        """Make ``staging`` visible as ``final``; an existing ``final`` is set aside, not lost.
        Locally one rename; on an object store a copy of every file — the archive commits
        there in place instead (``tiers.remote.archive.publish_organ``)."""
        if self.fs.exists(self.path(final)):
            aside = self.set_aside(final, "replaced")
            log.warning("checkpoint %s already exists; moved it aside to %s", final, aside)
        self._rename(self.path(staging), self.path(final))

    def set_aside(self, name: str, why: str, *, label: str | None = None) -> str:
        """Rename ``name`` to ``{label or name}.{why}-{random}``, a name no listing takes for
        a checkpoint (nor for staging debris); returns the new name. Keeps evidence instead
        of deleting it. ``why`` is one of ``tiers.remote.entries.SET_ASIDE_WHY``: a name whose
        reason the removal rule does not know could never be pruned."""
        if not entries.SET_ASIDE_WHY.match(why):
            raise ValueError(f"set_aside: {why!r} is not a reason tiers.remote.entries knows")
        aside = f"{label or name}.{why}-{uuid.uuid4().hex[:8]}"
        self._rename(self.path(name), self.path(aside))
        return aside

    def _rename(self, src: str, dst: str) -> None:
        if self.is_local:
            entries.fsync_dir(src)
            os.rename(src, dst)
            entries.fsync_dir(os.path.dirname(dst))
            return
        # No rename on an object store: copy every file (server side), then delete the
        # source, commit file first so that it stops being a checkpoint before it is partial.
        files = sorted(self.fs.find(src), key=lambda f: f.endswith(f"/{COMMIT_FILE}"))
        for file in files:
            self.fs.copy(file, dst + file[len(src):])
        self.remove(src[len(self.root.rstrip("/")) + 1:])

    def list(self) -> list[str]:
        """Names of the entries directly under the root."""
        self.fs.invalidate_cache(self.root)  # another process (a rank, the CLI) may write
        try:
            entries = self._retry("list", "", self.fs.ls, self.root, False)
        except FileNotFoundError:
            return []
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def exists(self, relpath: str) -> bool:
        if self.is_local:
            return bool(self.fs.exists(self.path(relpath)))
        # fsspec's ``exists`` answers False to any error: a server that is down would read as
        # a checkpoint that is gone. ``info`` tells the two apart; asked of the store, not of
        # the listing cache (another process may have written or removed it since).
        def probe() -> bool:
            self.fs.invalidate_cache(self.path(relpath))
            try:
                self.fs.info(self.path(relpath))
            except FileNotFoundError:
                return False
            return True
        return bool(self._retry("stat", relpath, probe))

    def open_read(self, relpath: str) -> IO[bytes]:
        return self._retry("open", relpath, self.fs.open, self.path(relpath), "rb")  # type: ignore[no-any-return]

    def read_bytes(self, relpath: str) -> bytes:
        return bytes(self._retry("read", relpath, self.fs.cat_file, self.path(relpath)))

    def size(self, relpath: str) -> int:
        return int(self._retry("stat", relpath, self.fs.size, self.path(relpath)))

    def read_verified(self, relpath: str, rec: Mapping[str, Any]) -> np.ndarray:
        """The file's ``rec["bytes"]`` bytes in a fresh buffer, read once (no mmap) and checked
        against the record's digests as they arrive; raises ``IntegrityError`` naming the byte
        range that differs.

        The buffer is never zero-filled first. Chunk digests (``format.digest``), by the
        tier's ``verify_reads`` where the record holds them, else SHA256: on a local file
        system each chunk is read with ``pread`` and hashed on the hashing threads, several in
        flight; elsewhere the stream is read in order while the chunks already read are
        hashed. A whole-file digest (version 1) is computed on one thread behind the reads.
        A read the network breaks is made again from the start (into a fresh buffer).
        """
        return self._retry("read", relpath, self._read_verified, relpath, rec)  # type: ignore[no-any-return]

    def _read_verified(self, relpath: str, rec: Mapping[str, Any]) -> np.ndarray:
        where = self.path(relpath)
        buf = fresh_bytes(int(rec["bytes"]))
        view = memoryview(buf)
        if is_chunked(rec):
            digest = read_digest(rec, self.verify_reads)
            ranges = chunk_ranges(rec, where, digest)
            if self.is_local:
                with DirectReader(where) as reader:
                    _will_need(reader, 0, min(len(view), _READ_AHEAD_BYTES))
                    _read_each(lambda r: _pread_checked(reader, view, *r, where, digest=digest,
                                                        ahead=len(view)), ranges)
                return buf
            with self.open_read(relpath) as f:
                pending = []
                for begin, end, expected in ranges:
                    _readinto_exact(f, view[begin:end], where)
                    pending.append(_readers().submit(check_chunk, view[begin:end], begin, end,
                                                      expected, where, digest))
                for future in pending:
                    future.result()
            return buf
        h = hashlib.sha256()
        last = None
        with self.open_read(relpath) as f:
            for begin in range(0, len(view), _READ_CHUNK):
                piece = view[begin:begin + _READ_CHUNK]
                _readinto_exact(f, piece, where)
                if last is not None:
                    last.result()
                last = _readers().submit(h.update, piece)
        if last is not None:
            last.result()
        if h.hexdigest() != rec["sha256"]:
            raise IntegrityError(where, str(rec["sha256"]), h.hexdigest())
        return buf

    def verify(self, relpath: str, rec: Mapping[str, Any]) -> None:
        """Check a stored file against its record without keeping its bytes (chunks hashed
        in parallel as in :meth:`read_verified`, a few chunks of memory at a time)."""
        self._retry("read", relpath, self._verify, relpath, rec)

    def _verify(self, relpath: str, rec: Mapping[str, Any]) -> None:
        where = self.path(relpath)
        if not is_chunked(rec):
            _, sha = self._digest(relpath)
            if sha != rec["sha256"]:
                raise IntegrityError(where, str(rec["sha256"]), sha)
            return
        ranges = chunk_ranges(rec, where)
        if self.is_local:
            with DirectReader(where) as reader:
                _will_need(reader, 0, min(int(rec["bytes"]), _READ_AHEAD_BYTES))

                def one(r: tuple[int, int, str]) -> None:
                    begin, end, sha = r
                    scratch = memoryview(fresh_bytes(end - begin))
                    _pread_checked(reader, scratch, 0, end - begin, sha, where, at=begin,
                                   ahead=int(rec["bytes"]))
                _read_each(one, ranges)
            return
        with self.open_read(relpath) as f:
            pending: list[Any] = []
            for begin, end, sha in ranges:
                data = memoryview(fresh_bytes(end - begin))
                _readinto_exact(f, data, where)
                pending.append(_readers().submit(check_chunk, data, begin, end, sha, where))
                if len(pending) >= 4:
                    pending.pop(0).result()
            for future in pending:
                future.result()

    def digest(self, relpath: str) -> tuple[int, str]:
        """Stream a stored file once; returns (size, SHA256 hex)."""
        return self._retry("read", relpath, self._digest, relpath)  # type: ignore[no-any-return]

    def _digest(self, relpath: str) -> tuple[int, str]:
        h = hashlib.sha256()
        size = 0
        with self.open_read(relpath) as f:
            while chunk := f.read(_READ_CHUNK):
                h.update(chunk)
                size += len(chunk)
        return size, h.hexdigest()

    def local_path(self, relpath: str) -> str | None:
        """A file-system path when the tier is local (lets readers mmap), else None."""
        return self.path(relpath) if self.is_local else None

    def free_bytes(self) -> int | None:
        """Free space on the file system that holds the tier; None where it cannot be known
        (an object store)."""
        if not self.is_local:
            return None
        path = self.root
        while not os.path.isdir(path) and os.path.dirname(path) != path:
            path = os.path.dirname(path)  # the root is created by the first save
        return shutil.disk_usage(path).free

    def download(self, relpath: str, local: str) -> None:
        """Copy a stored file to the local path ``local``, streamed."""
        self._retry("download", relpath, self.fs.get_file, self.path(relpath), local)

    def remove(self, name: str, *, step: int | None = None, rank: int | None = None) -> None:
        """Remove the checkpoint entry ``name`` (a published checkpoint, a staging or
        set-aside directory) — only when ``tiers.remote.entries`` finds it is one, else
        ``RemovalRefusedError`` and nothing is touched. ``step`` and ``rank``: the checkpoint
        the caller means to remove (a metadata row's), checked against the name and the
        manifest. Locally the directory leaves its name by a rename before its files go; on
        an object store the commit file goes first. ``FileNotFoundError`` when it is not
        there."""
        entries.remove_entry(self, name, step=step, rank=rank)

    def vet_removal(self, name: str, *, step: int | None = None,
                    rank: int | None = None) -> None:
        """Raise what :meth:`remove` would refuse with, touching nothing."""
        entries.vet(self, name, step=step, rank=rank)


class HashingWriter:
    """``write`` that feeds SHA256 and counts bytes on the way to the file; with
    ``digest=False`` it only counts (a producer that hashes its own items); with ``chunked``
    the chunk digests of ``format.digest`` run on the hashing threads while the same bytes go
    to the file, and ``write`` returns once both are done (the caller may then reuse its
    buffer)."""

    def __init__(self, fileobj: IO[bytes], *, digest: bool = True,
                 chunked: bool = False) -> None:
        self._file = fileobj
        self._digest = hashlib.sha256() if digest and not chunked else None
        self._chunks = ChunkDigest() if chunked else None
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        if self._chunks is not None:
            pending = self._chunks.update(view)
            try:
                self._file.write(view)
            finally:
                for future in pending:
                    future.result()
        else:
            if self._digest is not None:
                self._digest.update(view)
            self._file.write(view)
        self.size += len(view)
        return len(view)

    @property
    def sha256(self) -> str:
        if self._digest is None:
            raise ValueError("this file was written without a whole-file digest")
        return self._digest.hexdigest()

    @property
    def record(self) -> dict[str, Any]:
        """The chunked file record (``format.digest``) of what was written."""
        if self._chunks is None:
            raise ValueError("this file was written without chunk digests")
        return self._chunks.record()


def _drop_from_page_cache(fd: int) -> None:
    """Let the kernel reuse a durable file's pages at once (``POSIX_FADV_DONTNEED``, where
    the OS has it): a checkpoint is written once and read after a failure, so keeping it
    cached only crowds out what training reads, and the next save would have to find fresh
    pages instead of recycling these (bench/RESULTS.md, "Where a save's time goes")."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _readers() -> ThreadPoolExecutor:
    """Reads are waited for (a restore, a validation): they hash at the caller's priority."""
    return hash_pool(background=False)


def _read_each(read: Callable[[tuple[int, int, str]], None],
               ranges: list[tuple[int, int, str]]) -> None:
    """``read`` every chunk on the read threads; returns, or raises the first chunk's error,
    only once no read is running, so that the caller's ``DirectReader`` closes its descriptors
    after the last read of them (a failed chunk cancels the reads not started)."""
    futures = [_readers().submit(read, r) for r in ranges]
    wait(futures, return_when=FIRST_EXCEPTION)
    for future in futures:
        future.cancel()
    wait(futures)
    for future in futures:
        if not future.cancelled():
            future.result()


def _readinto_exact(f: IO[bytes], view: memoryview, where: str) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise OSError(f"{where}: file ends {len(view) - got} bytes early")
        got += n


def _will_need(reader: DirectReader, begin: int, end: int) -> None:
    """Ask the kernel to start reading file bytes ``[begin, end)`` into the page cache
    (``POSIX_FADV_WILLNEED``, where the OS has it), unless ``reader`` reads the pages that are
    not there with ``O_DIRECT`` (``tiers/remote/directio.py``), which needs no readahead.

    A local chunked read asks for the first ``_READ_AHEAD_BYTES`` as it opens the file, and
    each chunk's read for the chunk that far further on. Chunks read by several threads at once
    reach the file out of order, which its readahead takes for random access: without this a
    file not in the page cache (every durable checkpoint: ``_drop_from_page_cache``) is read
    in small synchronous pieces, each ``pread`` waiting on the disk (bench/RESULTS.md,
    "Restore: where its time goes")."""
    if hasattr(os, "posix_fadvise") and begin < end and not reader.direct:
        os.posix_fadvise(reader.fileno(), begin, end - begin, os.POSIX_FADV_WILLNEED)


def _pread_checked(reader: DirectReader, view: memoryview, begin: int, end: int,
                   expected: str, where: str, *, at: int | None = None,
                   digest: ReadDigest = "sha256", ahead: int | None = None) -> None:
    """Read file bytes ``[at, at + end - begin)`` (``at`` defaults to ``begin``) into
    ``view[begin:end]`` and check them against ``expected``, a ``digest`` hex digest. With
    ``ahead`` (the file's size), first ask for the bytes ``_READ_AHEAD_BYTES`` further on
    (:func:`_will_need`)."""
    offset = begin if at is None else at
    if ahead is not None:
        far = offset + _READ_AHEAD_BYTES
        _will_need(reader, far, min(ahead, far + end - begin))
    piece = view[begin:end]
    reader.read(piece, offset)
    check_chunk(piece, offset, offset + len(piece), expected, where, digest)
