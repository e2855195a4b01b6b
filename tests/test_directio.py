"""Durable local writes skip the page cache for whole buffers and keep every byte."""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptpilot.capture.state import TrainingComponents, capture
from ckptpilot.format.digest import is_chunked
from ckptpilot.hostmem import fresh_bytes
from ckptpilot.tiers.remote.archive import TENSORS_FILE, stage_organ
from ckptpilot.tiers.remote.directio import ALIGN, BUFFER_BYTES, ZERO_COPY_BYTES, DirectWriter
from ckptpilot.tiers.remote.store import RemoteTier


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
