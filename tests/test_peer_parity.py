"""Striping and XOR parity (SPEC §6): shards are views of the image, the parity is produced a
chunk at a time, fetched shards land in place, and any one lost shard is rebuilt exactly, in
place, with the digest its put sent."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from ckptpilot.tiers.peer.digest import digest_of, digest_of_pieces
from ckptpilot.tiers.peer.parity import (
    CHUNK_BYTES,
    Shard,
    as_bytes,
    parity_chunks,
    parity_of,
    shard_size,
    split,
)


@pytest.mark.parametrize(("image_len", "n", "expected"), [
    (0, 3, 8), (1, 3, 8), (24, 3, 8), (25, 3, 16), (100, 1, 104), (4096, 4, 1024),
    (4097, 4, 1032),
])
def test_shard_size_is_a_multiple_of_8_covering_the_image(image_len: int, n: int,
                                                          expected: int) -> None:
    assert shard_size(image_len, n) == expected


def test_shard_size_rejects_bad_counts() -> None:
    with pytest.raises(ValueError, match="data_shards must be >= 1"):
        shard_size(10, 0)


def padded(data: bytes, n: int) -> list[bytes]:
    """The reference striping: zero padded to n shards of shard_size bytes."""
    size = shard_size(len(data), n)
    whole = data + bytes(size * n - len(data))
    return [whole[i * size:(i + 1) * size] for i in range(n)]


def xor(parts: list[bytes]) -> bytes:
    out = np.zeros(len(parts[0]), dtype=np.uint8)
    for p in parts:
        out ^= np.frombuffer(p, dtype=np.uint8)
    return out.tobytes()


def receive(shards: list[bytes], image_len: int, skip: int, parity: bytes
            ) -> tuple[np.ndarray, list[Shard]]:
    """What a fetch does: every shard but ``skip`` written through its place's views into
    one image of ``image_len`` bytes (the padding past its end into the shards' own arrays),
    and the parity into the place of ``skip``."""
    image = np.empty(image_len, dtype=np.uint8)
    places = [Shard.of_image(image, i, len(shards[0]), fill=False) for i in range(len(shards))]
    for i, (place, shard) in enumerate(zip(places, shards, strict=True)):
        source, at = (parity if i == skip else shard), 0
        for view in place.views():
            view[:] = source[at:at + view.nbytes]
            at += view.nbytes
    return image, places


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=3000), n=st.integers(1, 7), lost=st.integers(0, 7))
def test_split_parity_and_an_in_place_rebuild(data: bytes, n: int, lost: int) -> None:
    shards = split(data, n)
    reference = padded(data, n)
    assert [b"".join(s.views()) for s in shards] == reference
    assert b"".join(c.tobytes() for c in parity_chunks(shards)) == xor(reference)
    lost %= n
    image, places = receive(reference, len(data), skip=lost, parity=xor(reference))
    got = places[lost].rebuild_from_parity([p for i, p in enumerate(places) if i != lost])
    assert got == digest_of(reference[lost]) and image.tobytes() == data


def test_a_rebuild_across_many_chunks_matches_the_lost_shard() -> None:
    data = np.random.default_rng(3).bytes(3 * 2 * CHUNK_BYTES + 999)  # 2+ MiB shards
    reference = padded(data, 3)
    # The last shard: in the image and its padding; the parity lands in both.
    image, places = receive(reference, len(data), skip=2, parity=xor(reference))
    assert places[2].rebuild_from_parity(places[:2]) == digest_of(reference[2])
    assert image.tobytes() == data


def test_inner_shards_are_views_and_only_the_tail_is_padded() -> None:
    image = bytearray(range(256)) * 4  # 1024 bytes -> 3 shards of 344
    shards = split(image, 3)
    flat = np.frombuffer(image, np.uint8)
    assert all(np.shares_memory(s.pieces[0], flat) for s in shards)
    assert [len(s.pieces) for s in shards] == [1, 1, 2]
    assert shards[2].pieces[1].size == 3 * 344 - 1024 and not shards[2].pieces[1].any()
    assert shards[0].contiguous() is shards[0].pieces[0]  # no copy where none is needed


def test_the_parity_streams_in_chunks_through_one_buffer() -> None:
    data = np.random.default_rng(4).bytes(2 * 3 * CHUNK_BYTES + 40)
    shards = split(data, 2)
    chunks = parity_chunks(shards)
    first = next(chunks)
    address = first.ctypes.data
    rest = [c.ctypes.data for c in chunks]
    assert rest and all(a == address for a in rest)  # reused: valid until the next chunk
    assert digest_of_pieces(parity_chunks(shards)) == digest_of(xor(padded(data, 2)))
    assert parity_of(shards).contiguous().tobytes() == xor(padded(data, 2))


def test_a_sample_takes_ranges_across_the_padding() -> None:
    data = bytes(range(200))
    shard = split(data, 1)[0]  # 200 bytes: no padding; 3 shards of 72: the last padded
    assert shard.take([(0, 4), (196, 200)]).tobytes() == data[:4] + data[196:]
    last = split(data, 3)[2]
    assert last.take([(50, 60)]).tobytes() == data[194:200] + bytes(4)
    assert as_bytes(memoryview(data)[:3]).tobytes() == data[:3]


def test_parity_needs_shards_of_one_size() -> None:
    with pytest.raises(ValueError, match="share one size"):
        list(parity_chunks([Shard([np.zeros(8, np.uint8)]), Shard([np.zeros(16, np.uint8)])]))
    with pytest.raises(ValueError, match="at least one shard"):
        list(parity_chunks([]))
