"""A resumable data cursor: the sampler whose state makes "which sample is next" checkpointable.

This module owns the index order of every epoch and the cursor (epoch, position) into it. The
order is a pure function of (seed, epoch, n), drawn from a private generator, so saving the
cursor is enough to resume bit-exactly and nothing here reads or advances the global RNG. It
does not load data and knows nothing of checkpoints beyond ``state_dict``/``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from ckptpilot.errors import StateError

__all__ = ["ResumableSampler"]


class ResumableSampler(Sampler[int]):
    """Shuffling sampler whose cursor is part of the training state.

    Epoch ``e`` visits ``torch.randperm(n, generator=torch.Generator().manual_seed(seed + e))``
    (``0..n-1`` in order when ``shuffle=False``). ``position`` counts the indices handed out so
    far in the current epoch; it is advanced *before* each index is yielded, so once a consumer
    holds k indices the state says exactly k were consumed, and a checkpoint taken between
    batches resumes on the next unseen sample. When an epoch is exhausted the iterator moves
    the cursor to the next epoch and stops, so ``for epoch ...: for i in sampler`` works as
    usual and a fresh ``iter()`` continues where the last one stopped.

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
        batch_size: int | None = None,
    ) -> None:
        super().__init__()
        n = data_source_or_len if isinstance(data_source_or_len, int) else len(data_source_or_len)
        if n < 1:
            raise ValueError(f"ResumableSampler needs at least one sample, got n={n}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"ResumableSampler batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.n = n
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.position = 0
        self._cached: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        if self.position >= self.n:
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
            if self.position >= self.n:
                self._next_epoch()
            stop = min(self.n, self.position + remaining)
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
            if self.position >= self.n:
                self._next_epoch()
            stop = min(self.n, self.position + remaining)
            remaining -= stop - self.position
            self.position = stop

    def state_dict(self) -> dict[str, Any]:
        """Return the cursor and the identity of the order, as JSON-able plain values."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "n": self.n,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the cursor; refuse a state taken with another data set size, seed or order.

        Resuming a cursor against a different order would silently skip or repeat samples,
        so a mismatch raises ``StateError`` (a ``ValueError``) naming the key.
        """
        for key in ("epoch", "position", "seed", "n", "shuffle"):
            if key not in state_dict:
                raise StateError(f"sampler state: missing key {key!r}")
        for key, mine in (("n", self.n), ("seed", self.seed), ("shuffle", self.shuffle)):
            if state_dict[key] != mine:
                raise StateError(
                    f"sampler state: {key} is {state_dict[key]!r} in the checkpoint but "
                    f"{mine!r} here; the data set or sampler settings changed since it was saved"
                )
        epoch, position = int(state_dict["epoch"]), int(state_dict["position"])
        if epoch < 0 or not 0 <= position <= self.n:
            raise StateError(
                f"sampler state: epoch={epoch}, position={position} out of range for n={self.n}"
            )
        self.epoch = epoch
        self.position = position

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.position = 0

    def _order(self, epoch: int) -> torch.Tensor:
        """The index order of ``epoch``; the current epoch's is cached."""
        if self._cached is None or self._cached[0] != epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.n, generator=generator)
            else:
                order = torch.arange(self.n)
            self._cached = (epoch, order)
        return self._cached[1]
