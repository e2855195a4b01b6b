"""The one interface every tier implements: :class:`CheckpointTier`, and what it stores, the
:class:`CheckpointImage`.

An image is one rank's checkpoint at one step as the tiers see it: the snapshot's JSON-able
``meta``, its flat ``arena`` of bytes and the ``layout`` that cuts the arena into tensors
(``Snapshot.layout``), plus the labels the on-disk formats record (level, reason, retention
class, score). A tier stores and returns images; it must not interpret the meta, choose
codecs, decide what to save or restore, or record rows: the pilot does, through this
interface only.

This module owns the contract and imports no tier, so the pilot, the conformance suite
(``tests/tiers/``) and any new tier depend on it and not on one another.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ckptpilot.capture.state import Snapshot, arena_views
from ckptpilot.format.image import Layout
from ckptpilot.vocab import Level, RetentionClass, Tier

__all__ = ["CheckpointImage", "CheckpointTier", "Layout", "PutReceipt", "TierCapabilities"]



@dataclass(frozen=True)
class CheckpointImage:
    """One rank's checkpoint at ``step``; ``arena`` is a flat, contiguous uint8 CPU tensor.

    ``meta`` must be JSON-able and hold the ``rank`` and ``world_size`` of the snapshot: the
    remote archive's manifest and the peer image's meta name them. ``source`` and
    ``bytes_read`` are set by ``get``: where the image was read from (e.g. which peer shard
    was rebuilt from parity) and how many bytes that read moved, for the restore's report.
    """

    step: int
    meta: Mapping[str, Any]
    arena: torch.Tensor
    layout: Layout
    level: Level = Level.ORGAN
    reason: str = ""
    retention_class: RetentionClass = RetentionClass.ROUTINE
    score: float | None = None
    source: str = ""
    bytes_read: int = 0

    @classmethod
    def of(cls, snapshot: Snapshot, *, level: Level | str = Level.ORGAN, reason: str = "",
           retention_class: RetentionClass | str = RetentionClass.ROUTINE,
           score: float | None = None) -> CheckpointImage:
        """The image of a captured snapshot, sharing its arena (no copy)."""
        if snapshot.arena is None:
            raise ValueError(f"step {snapshot.step}: the snapshot has no arena; take it from "
                             "state.capture, which lays every tensor out in one")
        return cls(snapshot.step, snapshot.meta, snapshot.arena, snapshot.layout, Level(level),
                   reason, RetentionClass(retention_class), score)

    @classmethod
    def copied(cls, step: int, meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], *,
               level: Level, reason: str, retention_class: RetentionClass,
               score: float | None) -> CheckpointImage:
        """An image over a fresh arena holding byte copies of ``tensors``, in their order:
        what a tier returns from memory it keeps using (a held snapshot, a read buffer)."""
        layout = tuple((k, t.dtype, tuple(t.shape)) for k, t in tensors.items())
        arena = torch.empty(sum(t.numel() * t.element_size() for t in tensors.values()),
                            dtype=torch.uint8)
        for key, view in arena_views(arena, layout).items():
            # As bytes: a typed copy would normalise what it may (a bool byte of 7 to 1).
            view.reshape(-1).view(torch.uint8).copy_(tensors[key].reshape(-1).view(torch.uint8))
        return cls(step, meta, arena, layout, level, reason, retention_class, score)

    @property
    def nbytes(self) -> int:
        return int(self.arena.numel())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors as views of the arena; raises ``StateError`` when the arena and the
        layout disagree (every tier checks this before it writes anything)."""
        return arena_views(self.arena, self.layout)

    def snapshot(self) -> Snapshot:
        """A snapshot over the same memory (what ``state.apply`` and the archive read)."""
        return Snapshot(step=self.step, tensors=self.tensors(), meta=dict(self.meta),
                        arena=self.arena)


@dataclass(frozen=True)
class TierCapabilities:
    """What a tier promises, so the pilot can choose tiers from data instead of by name.

    ``durable``: an image outlives every process of the job. ``survives_node_loss``: losing
    any one node (this one included) loses no image. ``folds_deltas``: a put with a ``base``
    may send only the difference. ``speed``: ``Tier.speed`` of its kind, 0 fastest.
    ``keeps_older``: older images stay until discarded; False means a put supersedes every
    older image (the tier holds the newest only).
    """

    durable: bool
    survives_node_loss: bool
    folds_deltas: bool
    speed: int
    keeps_older: bool


@dataclass(frozen=True)
class PutReceipt:
    """What a put stored: ``bytes_stored`` counts what went to the tier (deltas count as
    sent), ``delta`` whether any of it was a delta against the base. ``kept`` is False only
    from a tier that may decline an image (the memory tier, over its budget or older than
    its newest): nothing was stored and the caller still owns the image's buffers."""

    step: int
    location: str
    bytes_stored: int
    delta: bool = False
    kept: bool = True


@runtime_checkable
class CheckpointTier(Protocol):
    """A place that stores checkpoint images of one rank.

    Lifecycle and call order (one writer thread calls ``put`` and ``discard``; ``get`` and
    ``steps`` may come from another thread, e.g. a restore while the writer is idle):

    1. Construct; this touches no storage that a read-only caller must not change.
    2. ``put(image, base=None) -> PutReceipt``, any number of times, steps ascending (after
       a restore to an earlier step, ``discard`` the abandoned newer steps first). Atomic:
       after a failure or a crash mid-put, ``get`` never returns a half image and the images
       stored before are untouched. A put of a step already held replaces it. ``base`` is an
       earlier image of this rank that the tier may still hold: a tier that folds deltas
       sends only the difference from it, the others ignore it. The tier may keep the
       image's arena without copying it (the memory tier does): the caller must not change
       it after a kept put.
    3. ``get(step) -> CheckpointImage``: the image, verified against the digests recorded at
       put, in memory the caller owns. Raises ``NoCheckpointError`` naming the step when the
       tier does not hold it, ``IntegrityError`` naming the step when its bytes are not the
       ones put; other failures (a dead link, a full disk) propagate as the tier's own
       errors.
    4. ``steps() -> list[int]``: the steps ``get`` can return, ascending.
    5. ``discard(step)``: forget ``step``; discarding a step not held does nothing.
    6. ``close()``: release connections, threads and held memory; idempotent. Nothing else
       is called after it.
    """

    kind: Tier
    capabilities: TierCapabilities

    def put(self, image: CheckpointImage, base: CheckpointImage | None = None) -> PutReceipt:
        ...

    def get(self, step: int) -> CheckpointImage: ...

    def steps(self) -> list[int]: ...

    def discard(self, step: int) -> None: ...

    def close(self) -> None: ...
