"""A resumable data cursor: the sampler whose state makes "which sample is next" checkpointable.

This module owns the index order of every epoch and the cursor (epoch, position) into it, and,
when the data is split across data-parallel ranks, which rank gets which sample and how the
samples left in an epoch are dealt out again when the number of ranks changes. The order is a
pure function of (seed, epoch, n), drawn from a private generator, so saving the cursor is
enough to resume bit-exactly and nothing here reads or advances the global RNG. It does not
load data and knows nothing of checkpoints beyond ``state_dict``/``load_state_dict`` and
``load_resharded``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from ckptpilot.errors import StateError

__all__ = ["ResumableSampler"]

_SPLIT_DEFAULTS = {"num_replicas": 1, "rank": 0, "start": 0}


class ResumableSampler(Sampler[int]):
    """Shuffling sampler whose cursor is part of the training state.

    Epoch ``e`` visits ``torch.randperm(n, generator=torch.Generator().manual_seed(seed + e))``
    (``0..n-1`` in order when ``shuffle=False``). ``position`` counts the indices handed out so
    far in the current epoch; it is advanced *before* each index is yielded, so once a consumer
    holds k indices the state says exactly k were consumed, and a checkpoint taken between
    batches resumes on the next unseen sample. When an epoch is exhausted the iterator moves
    the cursor to the next epoch and stops, so ``for epoch ...: for i in sampler`` works as
    usual and a fresh ``iter()`` continues where the last one stopped.

    Split across data-parallel ranks (``num_replicas=D, rank=d``): the epochs, one after the
    other, form one stream of samples, and rank ``d`` takes every D-th of it, starting at the
    d-th. When every rank takes the same number of samples per step (``take(k)`` with one k,
    as a data-parallel loop does), what the ranks together consumed is always a prefix of the
    stream: an epoch's samples are each seen exactly once, and an epoch may end in the middle
    of a step (some ranks already draw from the next one, so ``epoch`` and ``len()`` — this
    rank's share of the current epoch — can differ by one between ranks). On a change of D,
    :meth:`load_resharded` deals the rest of the stream out among the new ranks from where the
    old ones stopped (``start`` in the state: where the current split begins).

    Lifecycle and threading: one consumer at a time, on the training thread. Two live iterators
    share (and both advance) the one cursor. ``state_dict``/``load_state_dict`` are called by
    the pilot at step boundaries, between batches.

    DataLoader caveats (bit-exact resume):

    - with ``num_workers > 0`` the DataLoader prefetches, so ``position`` runs ahead of the
      batches the model has seen by up to ``prefetch_factor * num_workers`` batches; resuming
      from that state skips them. Use ``num_workers=0``, or draw indices with :meth:`take`
      and fetch the samples yourself.
    - creating a DataLoader iterator draws a base seed from the global torch RNG unless the
      DataLoader has its own ``generator=``; that draw makes the global RNG state differ
      between a run and its resume. Iterate this sampler directly / use :meth:`take`, or give
      the DataLoader its own generator.
    - the permutation comes from ``torch.randperm``; a torch release that changes its
      algorithm changes the order, so resume with the same torch version.
    """

    def __init__(
        self, data_source_or_len: Sized | int, *, seed: int = 0, shuffle: bool = True,
        batch_size: int | None = None, num_replicas: int = 1, rank: int = 0,
    ) -> None:
        super().__init__()
        n = data_source_or_len if isinstance(data_source_or_len, int) else len(data_source_or_len)
        if n < 1:
            raise ValueError(f"ResumableSampler needs at least one sample, got n={n}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"ResumableSampler batch_size must be >= 1, got {batch_size}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"ResumableSampler needs num_replicas >= 1 and 0 <= rank < "
                             f"num_replicas, got num_replicas={num_replicas}, rank={rank}")
        self.batch_size = batch_size
        self.n = n
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.num_replicas = num_replicas
        self.rank = rank
        self.start = 0  # the stream position where the current split across ranks begins
        self.epoch = 0
        self.position = 0
        self._cached: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return self._count(self.epoch)

    def __iter__(self) -> Iterator[int]:
        if self.position >= self._count(self.epoch):
            self._next_epoch()
        order = self._order(self.epoch)[self.position :].tolist()
        for index in order:
            self.position += 1
            yield index
        self._next_epoch()

    def take(self, k: int) -> torch.Tensor:
        """Return the next ``k`` indices as an int64 tensor, crossing epochs as needed.

        The vectorised path for loops that index a tensor data set directly: it slices the
        cached permutation instead of stepping a Python iterator once per sample. The cursor
        ends exactly ``k`` indices further on (an epoch that is used up exactly is rolled over
        at the next call, as with iteration).
        """
        if k < 0:
            raise ValueError(f"take(k) needs k >= 0, got {k}")
        chunks: list[torch.Tensor] = []
        remaining = k
        while remaining > 0:
            if self.position >= self._count(self.epoch):
                self._next_epoch()
            stop = min(self._count(self.epoch), self.position + remaining)
            chunks.append(self._order(self.epoch)[self.position : stop])
            remaining -= stop - self.position
            self.position = stop
        if not chunks:
            return torch.empty(0, dtype=torch.long)
        return torch.cat(chunks) if len(chunks) > 1 else chunks[0].clone()

    def skip_batches(self, batches: int) -> None:
        """Move the cursor ``batches`` × ``batch_size`` indices on, crossing epochs like
        :meth:`take`: the instability rollback skips the data around a loss spike this way.

        Raises ``ValueError`` when the sampler was built without ``batch_size`` (a batch has
        no size to skip by) or for a negative count.
        """
        if self.batch_size is None:
            raise ValueError(
                "ResumableSampler.skip_batches needs the batch size: build the sampler with "
                "ResumableSampler(..., batch_size=B)")
        if batches < 0:
            raise ValueError(f"skip_batches needs batches >= 0, got {batches}")
        remaining = batches * self.batch_size
        while remaining > 0:
            if self.position >= self._count(self.epoch):
                self._next_epoch()
            stop = min(self._count(self.epoch), self.position + remaining)
            remaining -= stop - self.position
            self.position = stop

    def state_dict(self) -> dict[str, Any]:
        """Return the cursor and the identity of the order, as JSON-able plain values; a
        split cursor adds ``num_replicas``, ``rank`` and ``start``."""
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "n": self.n,
            "shuffle": self.shuffle,
        }
        split = {"num_replicas": self.num_replicas, "rank": self.rank, "start": self.start}
        if split != _SPLIT_DEFAULTS:
            state.update(split)
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the cursor; refuse a state taken with another data set size, seed, order
        or split across ranks.

        Resuming a cursor against a different order would silently skip or repeat samples,
        so a mismatch raises ``StateError`` (a ``ValueError``) naming the key; a state of
        another data-parallel rank or degree names :meth:`load_resharded`.
        """
        self._check_identity(state_dict, "sampler state")
        for key in ("num_replicas", "rank"):
            saved = int(state_dict.get(key, _SPLIT_DEFAULTS[key]))
            if saved != getattr(self, key):
                raise StateError(
                    f"sampler state: saved by data-parallel rank {state_dict.get('rank', 0)} "
                    f"of {state_dict.get('num_replicas', 1)}, this sampler is rank {self.rank} "
                    f"of {self.num_replicas}; load the states of every saved rank with "
                    "load_resharded(states) (CheckpointPilot does on a sharded restore)")
        start = int(state_dict.get("start", 0))
        epoch, position = int(state_dict["epoch"]), int(state_dict["position"])
        if start < 0 or epoch < 0:
            raise StateError(f"sampler state: epoch={epoch}, start={start} out of range")
        count = (_first_index(epoch + 1, self.n, start, self.rank, self.num_replicas)
                 - _first_index(epoch, self.n, start, self.rank, self.num_replicas))
        if not 0 <= position <= count:
            raise StateError(
                f"sampler state: epoch={epoch}, position={position} out of range for n={self.n}"
                + (f" (this rank's share of the epoch: {count})" if count != self.n else ""))
        if start != self.start:
            self.start, self._cached = start, None
        self.epoch = epoch
        self.position = position

    def load_resharded(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Continue from the saved cursors of *every* data-parallel rank of a run that had
        ``len(states)`` of them (``states[d]`` saved by rank ``d``), dealing the samples left
        in the stream out among this sampler's ``num_replicas`` ranks: no sample of an epoch
        is seen twice or skipped.

        Refuses (``StateError``) when the saved ranks did not all take the same number of
        samples (then what is left is not the rest of one stream, and no split of it would be
        exact), or when a state is not one of a full set of ranks of this data set and order.
        """
        degree = len(states)
        if degree < 1:
            raise StateError("load_resharded needs the saved cursor of at least one rank")
        starts = set()
        consumed = []
        for d, state in enumerate(states):
            where = f"saved cursor of data-parallel rank {d}"
            self._check_identity(state, where)
            split = {k: int(state.get(k, v)) for k, v in _SPLIT_DEFAULTS.items()}
            if (split["num_replicas"], split["rank"]) != (degree, d):
                raise StateError(
                    f"{where}: it says rank {split['rank']} of {split['num_replicas']}, not "
                    f"rank {d} of {degree}; pass every saved rank's state, in rank order")
            starts.add(split["start"])
            consumed.append(_first_index(int(state["epoch"]), self.n, split["start"], d,
                                         degree) + int(state["position"]))
        if len(starts) != 1:
            raise StateError(f"the saved cursors start their split at different stream "
                             f"positions {sorted(starts)}: they are not one run's ranks")
        taken = sum(consumed)
        expected = [-(-(taken - d) // degree) for d in range(degree)]
        if consumed != expected:
            raise StateError(
                f"the {degree} data-parallel ranks took {consumed} samples each; an exact "
                f"split of the rest needs the counts of a common prefix, {expected}: take "
                "the same number of samples on every rank at every step")
        self.start = starts.pop() + taken
        self.epoch = (self.start + self.rank) // self.n
        self.position = 0
        self._cached = None

    def _check_identity(self, state: Mapping[str, Any], where: str) -> None:
        for key in ("epoch", "position", "seed", "n", "shuffle"):
            if key not in state:
                raise StateError(f"{where}: missing key {key!r}")
        for key, mine in (("n", self.n), ("seed", self.seed), ("shuffle", self.shuffle)):
            if state[key] != mine:
                raise StateError(
                    f"{where}: {key} is {state[key]!r} in the checkpoint but "
                    f"{mine!r} here; the data set or sampler settings changed since it was saved"
                )

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.position = 0

    def _count(self, epoch: int) -> int:
        """How many samples of ``epoch`` this rank takes."""
        first = _first_index(epoch, self.n, self.start, self.rank, self.num_replicas)
        return _first_index(epoch + 1, self.n, self.start, self.rank, self.num_replicas) - first

    def _order(self, epoch: int) -> torch.Tensor:
        """This rank's indices of ``epoch``, in order; the current epoch's are cached."""
        if self._cached is None or self._cached[0] != epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.n, generator=generator)
            else:
                order = torch.arange(self.n)
            if self.num_replicas > 1 or self.start:
                first = _first_index(epoch, self.n, self.start, self.rank, self.num_replicas)
                offset = self.start + self.rank + self.num_replicas * first - epoch * self.n
                order = order[offset :: self.num_replicas][: self._count(epoch)]
            self._cached = (epoch, order)
        return self._cached[1]


def _first_index(epoch: int, n: int, start: int, rank: int, replicas: int) -> int:
    """How many samples rank ``rank`` of ``replicas`` takes before ``epoch``: it takes the
    stream positions ``start + rank + replicas * i``, epoch ``e`` being ``[e*n, (e+1)*n)``."""
    return max(0, -(-(epoch * n - start - rank) // replicas))
