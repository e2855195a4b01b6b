"""Striping and XOR parity (SPEC §6): split, shards received in place, and any one lost shard
is rebuilt exactly, in place, with the digest the put computed."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from ckptpilot.tiers.peer.digest import digest_of
from ckptpilot.tiers.peer.parity import (
    ShardPlace,
    parity,
    parity_and_digests,
    rebuild,
    shard_size,
    split,
    xor_of,
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


def receive(shards: list[np.ndarray], image_len: int, skip: int | None = None
            ) -> tuple[np.ndarray, list[ShardPlace]]:
    """What a fetch does: every shard but ``skip`` written through its place's views into
    one image of ``image_len`` bytes (the padding past its end into the places' own arrays)."""
    image = np.empty(image_len, dtype=np.uint8)
    places = [ShardPlace.in_image(image, i, shards[0].size) for i in range(len(shards))]
    for i, (place, shard) in enumerate(zip(places, shards, strict=True)):
        if i == skip:
            continue
        at = 0
        for view in place.views():
            view[:] = shard[at:at + view.nbytes].tobytes()
            at += view.nbytes
    return image, places


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=3000), n=st.integers(1, 7), lost=st.integers(0, 7))
def test_split_parity_rebuild_in_place(data: bytes, n: int, lost: int) -> None:
    shards = split(data, n)
    size = shard_size(len(data), n)
    assert len(shards) == n and all(s.size == size for s in shards)
    par = np.empty(size, dtype=np.uint8)
    digests = parity_and_digests(shards, par)
    assert digests == [digest_of(s) for s in [*shards, par]]
    assert np.array_equal(par, parity(shards))
    image, _ = receive(shards, len(data))
    assert image.tobytes() == data
    lost %= n
    damaged: list[np.ndarray | None] = list(shards)
    damaged[lost] = None
    assert np.array_equal(rebuild(damaged, par), shards[lost])
    image, places = receive(shards, len(data), skip=lost)
    scratch = ShardPlace.scratch(size)
    scratch.views()[0][:] = par.tobytes()
    got = places[lost].rebuild(scratch, [p for i, p in enumerate(places) if i != lost])
    assert got == digests[lost] and image.tobytes() == data


def test_a_rebuild_across_many_chunks_matches_the_lost_shard() -> None:
    data = np.random.default_rng(3).bytes(3 * (1 << 20) * 2 + 999)  # 2+ MiB shards, odd tail
    shards = split(data, 3)
    par = np.empty(shards[0].size, dtype=np.uint8)
    digests = parity_and_digests(shards, par)
    image, places = receive(shards, len(data), skip=2)  # the last: in the image and padding
    scratch = ShardPlace.scratch(par.size)
    scratch.views()[0][:] = par.tobytes()
    assert places[2].rebuild(scratch, places[:2]) == digests[2]
    assert image.tobytes() == data


def test_parity_itself_is_rebuilt_by_xor_of_the_data() -> None:
    shards = split(np.random.default_rng(1).bytes(1001), 3)
    assert np.array_equal(xor_of(shards), parity(shards))
    assert not xor_of([*shards, parity(shards)]).any()


def test_split_keeps_inner_shards_as_views_and_pads_the_tail() -> None:
    image = bytearray(range(256)) * 4  # 1024 bytes -> 3 shards of 344
    shards = split(image, 3)
    assert np.shares_memory(shards[0], np.frombuffer(image, np.uint8))
    assert shards[2].size == 344 and not shards[2][1024 - 688:].any()


def test_xor_is_linear_so_parity_deltas_compose() -> None:
    rng = np.random.default_rng(2)
    old, new = rng.bytes(999), rng.bytes(999)
    delta = [a ^ b for a, b in zip(split(old, 3), split(new, 3), strict=True)]
    assert np.array_equal(parity(split(old, 3)) ^ parity(delta), parity(split(new, 3)))


def test_unaligned_views_work() -> None:
    buf = np.zeros(8 * 4 + 1, np.uint8)[1:]  # a buffer starting at an odd address
    buf[:] = np.arange(32, dtype=np.uint8)
    shards = [buf[:16], buf[16:]]
    assert np.array_equal(xor_of(shards), buf[:16] ^ buf[16:])


def test_rebuild_needs_exactly_one_missing_shard() -> None:
    shards = split(b"abcdefgh" * 10, 2)
    with pytest.raises(ValueError, match="exactly one missing"):
        rebuild([None, None], parity(shards))
    with pytest.raises(ValueError, match="exactly one missing"):
        rebuild(shards, parity(shards))
    with pytest.raises(ValueError, match="share one size"):
        xor_of([np.zeros(8, np.uint8), np.zeros(16, np.uint8)])
