"""ResumableSampler: deterministic per-epoch order, exact cursor, resume without the global RNG."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import BatchSampler

from ckptpilot.sampler import ResumableSampler


def expected_order(n: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def test_order_is_the_seeded_permutation_of_each_epoch() -> None:
    sampler = ResumableSampler(10, seed=7)
    assert list(sampler) == expected_order(10, 7, 0)
    assert list(sampler) == expected_order(10, 7, 1)
    assert sampler.epoch == 2
    assert sampler.position == 0


def test_same_seed_same_order_and_epochs_differ() -> None:
    first = list(ResumableSampler(50, seed=3))
    assert first == list(ResumableSampler(50, seed=3))
    sampler = ResumableSampler(50, seed=3)
    epoch0, epoch1 = list(sampler), list(sampler)
    assert epoch0 != epoch1
    assert sorted(epoch0) == sorted(epoch1) == list(range(50))
    assert list(ResumableSampler(50, seed=4)) != first


def test_no_shuffle_is_identity_order() -> None:
    assert list(ResumableSampler(range(5), shuffle=False)) == [0, 1, 2, 3, 4]


def test_len_and_sized_source() -> None:
    assert len(ResumableSampler([10, 20, 30])) == 3
    assert len(ResumableSampler(12)) == 12


def test_empty_data_set_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least one sample"):
        ResumableSampler(0)


def test_take_matches_iteration_across_epochs() -> None:
    iterated = ResumableSampler(7, seed=1)
    stream = list(iterated) + list(iterated) + list(iterated)
    taken = ResumableSampler(7, seed=1)
    chunks = [taken.take(k) for k in (3, 5, 0, 13)]
    assert all(chunk.dtype == torch.long for chunk in chunks)
    assert torch.cat(chunks).tolist() == stream[:21]
    assert taken.state_dict() == iterated.state_dict() | {"epoch": 2, "position": 7}


def test_take_result_does_not_alias_the_cached_order() -> None:
    sampler = ResumableSampler(6, seed=2)
    first = sampler.take(3)
    first.fill_(-1)
    sampler.load_state_dict(sampler.state_dict() | {"position": 0})
    assert sampler.take(3).tolist() == expected_order(6, 2, 0)[:3]


def test_take_rejects_negative_k() -> None:
    with pytest.raises(ValueError, match="k >= 0"):
        ResumableSampler(3).take(-1)


def test_state_round_trip_mid_epoch_resumes_across_the_epoch_boundary() -> None:
    original = ResumableSampler(10, seed=11)
    it = iter(original)
    for _ in range(4):
        next(it)
    state = json.loads(json.dumps(original.state_dict()))
    assert state == {"epoch": 0, "position": 4, "seed": 11, "n": 10, "shuffle": True}
    rest_original = list(it) + list(original)

    resumed = ResumableSampler(10, seed=11)
    resumed.load_state_dict(state)
    rest_resumed = list(resumed) + list(resumed)
    assert rest_resumed == rest_original
    assert rest_resumed == expected_order(10, 11, 0)[4:] + expected_order(10, 11, 1)


def test_exhausted_epoch_rolls_over_on_the_next_iter() -> None:
    sampler = ResumableSampler(4, seed=0)
    sampler.take(4)
    assert (sampler.epoch, sampler.position) == (0, 4)
    assert list(sampler) == expected_order(4, 0, 1)
    assert sampler.epoch == 2


def test_iteration_and_take_leave_the_global_rng_alone() -> None:
    before = torch.get_rng_state()
    sampler = ResumableSampler(100, seed=5)
    list(sampler)
    sampler.take(250)
    sampler.load_state_dict(sampler.state_dict())
    list(sampler)
    assert torch.equal(torch.get_rng_state(), before)


def test_order_does_not_depend_on_the_global_rng() -> None:
    torch.manual_seed(0)
    first = list(ResumableSampler(20, seed=9))
    torch.manual_seed(12345)
    assert list(ResumableSampler(20, seed=9)) == first


@pytest.mark.parametrize(("key", "value"), [("n", 11), ("seed", 1), ("shuffle", False)])
def test_mismatched_state_is_rejected_naming_the_key(key: str, value: object) -> None:
    state = ResumableSampler(10, seed=0).state_dict() | {key: value}
    with pytest.raises(ValueError, match=f"{key} is {value!r} in the checkpoint"):
        ResumableSampler(10, seed=0).load_state_dict(state)


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"epoch": 0, "position": 0, "seed": 0, "n": 10}, "missing key 'shuffle'"),
        ({"epoch": 0, "position": 11, "seed": 0, "n": 10, "shuffle": True}, "position=11"),
        ({"epoch": -1, "position": 0, "seed": 0, "n": 10, "shuffle": True}, "epoch=-1"),
    ],
)
def test_malformed_state_is_rejected(state: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ResumableSampler(10).load_state_dict(state)


@pytest.mark.parametrize("drop_last", [False, True])
def test_position_counts_exactly_the_indices_of_the_batches_drawn(drop_last: bool) -> None:
    sampler = ResumableSampler(10, seed=4)
    batches = iter(BatchSampler(sampler, batch_size=4, drop_last=drop_last))
    first = next(batches)
    assert sampler.position == 4
    next(batches)
    assert sampler.position == 8

    resumed = ResumableSampler(10, seed=4)
    resumed.load_state_dict(sampler.state_dict())
    order = expected_order(10, 4, 0)
    remaining = [i for batch in batches for i in batch]
    assert remaining == ([] if drop_last else order[8:])
    assert list(resumed) == order[8:]
    assert first == order[:4]
    assert sampler.state_dict() == resumed.state_dict() == sampler.state_dict() | {"epoch": 1}


def test_skip_batches_lands_where_taking_those_batches_would_across_epochs() -> None:
    skipped = ResumableSampler(10, seed=3, batch_size=4)
    taken = ResumableSampler(10, seed=3, batch_size=4)
    skipped.take(2)
    taken.take(2)
    skipped.skip_batches(5)  # 20 indices: the rest of epoch 0, all of epoch 1, 2 of epoch 2
    taken.take(20)
    assert skipped.state_dict() == taken.state_dict() == {
        "epoch": 2, "position": 2, "seed": 3, "n": 10, "shuffle": True}
    assert torch.equal(skipped.take(8), taken.take(8))


def test_skip_batches_needs_a_batch_size_and_a_count() -> None:
    with pytest.raises(ValueError, match="batch_size=B"):
        ResumableSampler(10).skip_batches(1)
    with pytest.raises(ValueError, match="batches >= 0"):
        ResumableSampler(10, batch_size=2).skip_batches(-1)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        ResumableSampler(10, batch_size=0)
