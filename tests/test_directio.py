"""Durable local writes skip the page cache for whole buffers and keep every byte; cold reads
skip it too, and read every byte, verified."""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptpilot.capture.state import TrainingComponents, capture
from ckptpilot.errors import IntegrityError
from ckptpilot.format.digest import is_chunked
from ckptpilot.hostmem import fresh_bytes
from ckptpilot.tiers.remote.archive import TENSORS_FILE, stage_organ
from ckptpilot.tiers.remote.directio import (
    ALIGN,
    BUFFER_BYTES,
    ZERO_COPY_BYTES,
    DirectReader,
    DirectWriter,
)
from ckptpilot.tiers.remote.store import RemoteTier, _read_each


def _direct_supported(directory: Path) -> bool:
    probe = directory / "probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0))
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return hasattr(os, "O_DIRECT")


def _payload() -> list[bytes]:
    """Pieces of odd sizes that straddle the buffer's edges, and a tail shorter than it."""
    pattern = hashlib.sha256(b"ckptpilot").digest() * 4096  # 128 KiB, not all zero
    sizes = [7, BUFFER_BYTES - 3, 5, BUFFER_BYTES + (1 << 20) + 11, 3 << 20, 1]
    return [(pattern * (size // len(pattern) + 1))[:size] for size in sizes]


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_every_byte_arrives_direct_or_buffered(where: str, tmp_path: Path) -> None:
    directory = tmp_path if where == "disk" else Path("/dev/shm")
    if not directory.is_dir():
        pytest.skip("no /dev/shm")
    target = directory / f"ckptpilot-directio-{os.getpid()}.bin"
    pieces = _payload()
    try:
        with open(target, "wb") as f:
            writer = DirectWriter(f)
            for piece in pieces:
                assert writer.write(memoryview(piece)) == len(piece)
            writer.flush()
            writer.close()
            os.fsync(f.fileno())
        assert target.read_bytes() == b"".join(pieces)
        total = sum(map(len, pieces))
        if _direct_supported(directory):
            assert writer.direct_bytes == total // BUFFER_BYTES * BUFFER_BYTES
        else:  # tmpfs refuses O_DIRECT: all buffered, nothing lost
            assert writer.direct_bytes == 0
    finally:
        target.unlink(missing_ok=True)


def test_a_small_file_never_goes_direct(tmp_path: Path) -> None:
    with open(tmp_path / "small", "wb") as f:
        writer = DirectWriter(f)
        writer.write(b"x" * 1000)
        writer.flush()
        writer.close()
    assert (tmp_path / "small").read_bytes() == b"x" * 1000
    assert writer.direct_bytes == 0


def test_the_remote_tier_writes_durable_records_direct_with_the_same_digests(
        tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    tier = RemoteTier(str(tmp_path / "ckpt"))
    pieces = _payload()
    record = tier.write_record("a.bin", pieces)
    data = b"".join(pieces)
    assert is_chunked(record) and record["bytes"] == len(data)
    assert (tmp_path / "ckpt" / "a.bin").read_bytes() == data
    tier.verify("a.bin", record)  # every chunk's SHA256 as recorded while writing
    size, sha = tier.write_file("b.bin", pieces)
    assert (size, sha) == (len(data), hashlib.sha256(data).hexdigest())


def test_a_piece_aligned_like_its_file_offset_goes_from_where_it_is(tmp_path: Path) -> None:
    """An arena in page-aligned memory, written at a page-aligned file offset (the organ's
    safetensors file): its bulk goes to the file with no copy, only the bytes around its
    ends through the buffer."""
    if not _direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    arena = fresh_bytes(3 * ZERO_COPY_BYTES + 5 * ALIGN + 123)
    arena[:] = np.frombuffer(hashlib.sha256(b"arena").digest(), np.uint8).repeat(
        -(-arena.size // 32))[:arena.size]
    header = b"h" * (2 * ALIGN)
    with open(tmp_path / "aligned", "wb") as f:
        writer = DirectWriter(f)
        for piece in (header, memoryview(arena)[:100], memoryview(arena)[100:]):
            writer.write(piece)
        writer.flush()
        writer.close()
    assert (tmp_path / "aligned").read_bytes() == header + arena.tobytes()
    assert writer.zero_copy_bytes == (arena.size - ALIGN) // ALIGN * ALIGN
    assert writer.direct_bytes == writer.zero_copy_bytes + 3 * ALIGN  # header + first page


def test_a_piece_not_aligned_like_its_file_offset_is_copied(tmp_path: Path) -> None:
    if not _direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    arena = fresh_bytes(3 * ZERO_COPY_BYTES)
    arena[::7] = 9
    with open(tmp_path / "shifted", "wb") as f:
        writer = DirectWriter(f)
        writer.write(b"x" * 100)
        writer.write(memoryview(arena))
        writer.flush()
        writer.close()
    assert (tmp_path / "shifted").read_bytes() == b"x" * 100 + arena.tobytes()
    assert writer.zero_copy_bytes == 0
    assert writer.direct_bytes == 0  # less than one whole buffer


def test_an_organ_is_laid_out_for_the_zero_copy_write(tmp_path: Path) -> None:
    """The two halves of the zero-copy write: a captured arena is page-aligned, and the
    safetensors file's tensor data starts at a page-aligned offset, in the arena's order."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 7), torch.nn.Linear(7, 1000))
    snapshot = capture(TrainingComponents(model), step=3)
    assert snapshot.arena is not None and snapshot.arena.data_ptr() % ALIGN == 0
    tier = RemoteTier(str(tmp_path / "ckpt"))
    staged = stage_organ(tier, snapshot)
    raw = (tmp_path / "ckpt" / staged.staging / TENSORS_FILE).read_bytes()
    (header_len,) = struct.unpack_from("<Q", raw)
    assert (8 + header_len) % ALIGN == 0
    assert raw[8 + header_len:] == snapshot.arena.numpy().tobytes()


def _cold_file(path: Path, data: bytes) -> None:
    """``data`` written, fsynced, and its pages dropped from the page cache, as a durable
    checkpoint's are."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _reads_direct(path: Path) -> bool:
    """Whether a reader would use O_DIRECT for ``path``: its file system takes it and some of
    its pages are not cached (never so on tmpfs, whose files live in the page cache)."""
    with DirectReader(str(path)) as reader:
        return reader.direct


def _pieces(size: int, step: int) -> list[tuple[int, int]]:
    return [(begin, min(begin + step, size)) for begin in range(0, size, step)]


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_a_cold_file_is_read_direct_and_every_byte_arrives(where: str, tmp_path: Path) -> None:
    """Pieces read by four threads at once, the last one ending off the block grid: on a disk the
    aligned bodies come with O_DIRECT, the tail buffered, and the buffer holds the file."""
    directory = tmp_path if where == "disk" else Path("/dev/shm")
    if not directory.is_dir():
        pytest.skip("no /dev/shm")
    target = directory / f"ckptpilot-directread-{os.getpid()}.bin"
    data = b"".join(_payload())  # 20 MiB + 21 bytes: not a whole number of blocks
    try:
        _cold_file(target, data)
        cold = _reads_direct(target)
        buf = fresh_bytes(len(data))
        with DirectReader(str(target)) as reader, ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda r: reader.read(memoryview(buf)[r[0]:r[1]], r[0]),
                          _pieces(len(data), 3 << 20)))
        assert buf.tobytes() == data
        if where == "disk" and cold:
            assert reader.direct_bytes == len(data) // ALIGN * ALIGN
        else:  # tmpfs: the file lives in the page cache, which nothing drops
            assert not cold and reader.direct_bytes == 0
    finally:
        target.unlink(missing_ok=True)


def test_a_file_in_the_page_cache_is_read_buffered(tmp_path: Path) -> None:
    """A file read moments ago is copied out of the page cache, not read from the disk again."""
    target = tmp_path / "warm.bin"
    data = b"".join(_payload())
    target.write_bytes(data)
    assert target.read_bytes() == data  # every page resident
    buf = fresh_bytes(len(data))
    with DirectReader(str(target)) as reader:
        reader.read(memoryview(buf), 0)
    assert buf.tobytes() == data
    assert reader.direct_bytes == 0 and not reader.direct


def test_memory_not_aligned_like_the_file_is_read_buffered(tmp_path: Path) -> None:
    target = tmp_path / "cold.bin"
    data = b"".join(_payload())
    _cold_file(target, data)
    if not _reads_direct(target):
        pytest.skip("no O_DIRECT reads on this file system")
    buf = fresh_bytes(len(data) + 1)
    with DirectReader(str(target)) as reader:
        assert reader.direct
        reader.read(memoryview(buf)[1:], 0)  # byte k of the file lands at address k + 1
        assert reader.direct_bytes == 0
        reader.read(memoryview(buf)[:len(data)], 0)
        assert reader.direct_bytes == len(data) // ALIGN * ALIGN
    assert buf[:len(data)].tobytes() == data


@pytest.mark.parametrize("direct", [True, False])
def test_a_file_shorter_than_the_piece_is_an_error_naming_it(direct: bool,
                                                             tmp_path: Path) -> None:
    target = tmp_path / "short.bin"
    _cold_file(target, b"s" * (5 * ALIGN + 100))
    cold = _reads_direct(target)
    buf = fresh_bytes(8 * ALIGN)
    with (DirectReader(str(target), direct=direct) as reader,
          pytest.raises(OSError, match=r"short\.bin: file ends 12188 bytes early")):
        reader.read(memoryview(buf), 0)
    assert buf[:5 * ALIGN + 100].tobytes() == b"s" * (5 * ALIGN + 100)
    assert reader.direct_bytes == (5 * ALIGN + 100 if direct and cold else 0)


def test_the_remote_tier_reads_a_cold_record_direct_and_still_finds_a_flipped_byte(
        tmp_path: Path) -> None:
    """read_verified and verify on a cold file: O_DIRECT reads (the file is still not in the
    page cache after each: a buffered read would have left it there), every chunk checked
    against the record; one byte changed on disk afterwards is an IntegrityError naming its
    chunk."""
    (tmp_path / "ckpt").mkdir()
    tier = RemoteTier(str(tmp_path / "ckpt"), verify_reads="xxh3")
    pieces = [os.urandom(3 << 20) for _ in range(7)] + [b"tail"]
    data = b"".join(pieces)
    record = tier.write_record("a.bin", pieces)
    where = tmp_path / "ckpt" / "a.bin"
    _cold_file(where, where.read_bytes())
    if not _reads_direct(where):
        pytest.skip("no O_DIRECT reads on this file system")
    assert tier.read_verified("a.bin", record).tobytes() == data
    assert _reads_direct(where)
    tier.verify("a.bin", record)
    assert _reads_direct(where)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    _cold_file(where, bytes(flipped))
    for check in (tier.read_verified, tier.verify):  # the byte is in the second 8 MiB chunk
        with pytest.raises(IntegrityError, match=r"a\.bin bytes \[8388608, 16777216\)"):
            check("a.bin", record)


def test_a_failed_chunk_returns_only_once_its_sibling_reads_are_done() -> None:
    """The reader's descriptors close when the read returns: a sibling chunk still reading then
    would read a closed, or reused, descriptor."""
    started, finished = threading.Event(), threading.Event()

    def read(r: tuple[int, int, str]) -> None:
        if r[0] == 0:
            assert started.wait(10)
            raise OSError("chunk 0 failed")
        started.set()
        time.sleep(0.2)
        finished.set()

    with pytest.raises(OSError, match="chunk 0 failed"):
        _read_each(read, [(0, 1, ""), (1, 2, "")])
    assert finished.is_set()
