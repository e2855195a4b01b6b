"""The remote tier: persistent storage behind an fsspec URL (local dir, NFS, S3, GCS, memory).

It owns durability and atomic publication, nothing about checkpoint contents: files are
written into a staging directory, fsynced, and the directory is published under its final
name in one rename (on a local file system an atomic ``rename(2)`` followed by an fsync of the
parent; on object stores fsspec's ``mv``, where the manifest-written-last rule of the archive
is what makes a half-published checkpoint detectable).

One rank's view of it as a :class:`~ckptpilot.tiers.base.CheckpointTier` is
``tiers.archive.RemoteCheckpointTier`` (it needs ``storage.archive``, which needs this module).

Threading: one writer thread and any number of readers; methods hold no shared state.
"""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import IO

import fsspec
from fsspec.implementations.local import LocalFileSystem

log = logging.getLogger(__name__)

STAGING_MARK = ".staging-"
_READ_CHUNK = 16 << 20


class RemoteTier:
    """A directory tree under an fsspec URL, written with fsync + atomic publish."""

    name = "remote"

    def __init__(self, url: str) -> None:
        self.url = str(url)
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        # The root is created by the first save (``new_staging``), not here: reading a run
        # (``ls``, a restore, a dry run) must change nothing, and a mistyped URL must not
        # appear as an empty tier.
        self.is_local = isinstance(self.fs, LocalFileSystem)

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def new_staging(self, name: str) -> str:
        """Reserve a staging directory for checkpoint ``name``; returns its relative name."""
        staging = f"{name}{STAGING_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.fs.makedirs(self.path(staging), exist_ok=True)
        return staging

    def write_file(self, relpath: str, chunks: Iterable[bytes | memoryview]) -> tuple[int, str]:
        """Write ``chunks`` to ``relpath`` durably; returns (bytes written, SHA256 hex).

        The digest is computed from the very buffers handed to the file, so it certifies what
        was written, not a second reading of the source.
        """
        with self.open_write(relpath) as out:
            for chunk in chunks:
                out.write(chunk)
        return out.size, out.sha256

    @contextmanager
    def open_write(self, relpath: str) -> Iterator[HashingWriter]:
        """A file object for a producer that writes by itself (the codec container); hashed
        like ``write_file`` and made durable when the block ends without an error."""
        target = self.path(relpath)
        if self.is_local:
            with open(target, "wb") as f:
                out = HashingWriter(f)
                yield out
                f.flush()
                os.fsync(f.fileno())
        else:
            with self.fs.open(target, "wb") as f:
                out = HashingWriter(f)
                yield out

    def publish(self, staging: str, final: str) -> None:
        """Make ``staging`` visible as ``final``; an existing ``final`` is set aside, not lost."""
        if self.fs.exists(self.path(final)):
            aside = self.set_aside(final, "replaced")
            log.warning("checkpoint %s already exists; moved it aside to %s", final, aside)
        self._rename(self.path(staging), self.path(final))

    def set_aside(self, name: str, why: str, *, label: str | None = None) -> str:
        """Rename ``name`` to ``{label or name}.{why}-{random}``, a name no listing takes for
        a checkpoint (nor for staging debris); returns the new name. Keeps evidence instead
        of deleting it."""
        aside = f"{label or name}.{why}-{uuid.uuid4().hex[:8]}"
        self._rename(self.path(name), self.path(aside))
        return aside

    def _rename(self, src: str, dst: str) -> None:
        if self.is_local:
            _fsync_dir(src)
            os.rename(src, dst)
            _fsync_dir(os.path.dirname(dst))
        else:
            self.fs.mv(src, dst, recursive=True)

    def list(self) -> list[str]:
        """Names of the entries directly under the root."""
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def exists(self, relpath: str) -> bool:
        return bool(self.fs.exists(self.path(relpath)))

    def open_read(self, relpath: str) -> IO[bytes]:
        return self.fs.open(self.path(relpath), "rb")

    def read_bytes(self, relpath: str) -> bytes:
        return bytes(self.fs.cat_file(self.path(relpath)))

    def size(self, relpath: str) -> int:
        return int(self.fs.size(self.path(relpath)))

    def read_into(self, relpath: str, size: int) -> bytearray:
        """The first ``size`` bytes of a file in a fresh buffer, read once (no mmap)."""
        buf = bytearray(size)
        view = memoryview(buf)
        got = 0
        with self.open_read(relpath) as f:
            while got < size:
                n = f.readinto(view[got:got + _READ_CHUNK])
                if not n:
                    break
                got += n
        if got != size:
            raise OSError(f"{self.path(relpath)}: read {got} of {size} bytes")
        return buf

    def digest(self, relpath: str) -> tuple[int, str]:
        """Stream a stored file once; returns (size, SHA256 hex)."""
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

    def remove(self, relpath: str) -> None:
        self.fs.rm(self.path(relpath), recursive=True)


class HashingWriter:
    """``write`` that feeds SHA256 and counts bytes on the way to the file."""

    def __init__(self, fileobj: IO[bytes]) -> None:
        self._file = fileobj
        self._digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        self._digest.update(view)
        self._file.write(view)
        self.size += len(view)
        return len(view)

    @property
    def sha256(self) -> str:
        return self._digest.hexdigest()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
