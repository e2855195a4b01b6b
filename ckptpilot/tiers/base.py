"""The one interface every tier implements: :class:`CheckpointTier`, and what it stores, the
:class:`CheckpointImage`.

An image is one rank's checkpoint at one step as the tiers see it: the snapshot's JSON-able
``meta``, its flat ``arena`` of bytes and the ``layout`` that cuts the arena into tensors
(``Snapshot.layout``), plus the labels the on-disk formats record (level, reason, retention
class, score); or, of a sharded state, its DTensor shards (``CheckpointImage.shards``), which
only a :class:`Collective` tier stores (every rank's part makes one checkpoint). A tier
stores and returns images; it must not interpret the meta, choose codecs, decide what to
save or restore, or record rows: the pilot does, through this interface only (a stage that
is a collective reports its written bytes through ``StageOptions.written``, for the pilot's
row).

This module owns the contract and imports no tier, so the pilot, the conformance suite
(``tests/tiers/``) and any new tier depend on it and not on one another.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ckptpilot.capture.state import Snapshot, arena_views, local_nbytes
from ckptpilot.errors import CheckpointFormatError
from ckptpilot.format.image import Layout
from ckptpilot.vocab import Level, RetentionClass, Tier

__all__ = ["PLAIN", "BaseKeeper", "Check", "CheckpointImage", "CheckpointTier", "Collective",
           "Layout",
           "OpenedImage", "PutReceipt", "StageOptions", "Staged", "Survey", "Surveyed",
           "TierCapabilities", "put_in_two_phases"]


@dataclass(frozen=True)
class CheckpointImage:
    """One rank's checkpoint at ``step``; ``arena`` is a flat, contiguous uint8 CPU tensor.

    ``meta`` must be JSON-able and hold the ``rank`` and ``world_size`` of the snapshot: the
    remote archive's manifest and the peer image's meta name them. ``source`` and
    ``bytes_read`` are set by ``get``: where the image was read from (e.g. which peer shard
    was rebuilt from parity) and how many bytes that read moved, for the restore's report.

    ``shards``: the image of a sharded snapshot (``Snapshot.sharded``), whose tensors are
    DTensors that only a DCP-backed tier can lay out (each rank writes its part of one
    checkpoint): ``arena`` is then empty and ``layout`` ``()``. The same image type keeps the
    writer's one loop for both kinds; a tier that cannot store shards never gets one (the
    assembly gives a sharded run's writer the DCP-backed tier alone).
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
    origin: Snapshot | None = field(default=None, compare=False, repr=False)
    shards: Mapping[str, torch.Tensor] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, snapshot: Snapshot, *, level: Level | str = Level.ORGAN, reason: str = "",
           retention_class: RetentionClass | str = RetentionClass.ROUTINE,
           score: float | None = None) -> CheckpointImage:
        """The image of a captured snapshot, sharing its arena (no copy); ``snapshot()``
        gives that snapshot itself back (``origin``), so a tier that keeps it (the memory
        tier) hands the snapshot pool the very set of buffers it lent. A sharded snapshot's
        image holds its tensors as ``shards``."""
        if snapshot.sharded:
            return cls(snapshot.step, snapshot.meta, torch.empty(0, dtype=torch.uint8), (),
                       Level(level), reason, RetentionClass(retention_class), score,
                       origin=snapshot, shards=snapshot.tensors)
        if snapshot.arena is None:
            raise ValueError(f"step {snapshot.step}: the snapshot has no arena; take it from "
                             "state.capture, which lays every tensor out in one")
        return cls(snapshot.step, snapshot.meta, snapshot.arena, snapshot.layout, Level(level),
                   reason, RetentionClass(retention_class), score, origin=snapshot)

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
        """The bytes of the image this rank holds (of a sharded one: its part)."""
        if self.shards is not None:
            return local_nbytes(self.shards)
        return int(self.arena.numel())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors as views of the arena (of a sharded image: its shards); raises
        ``StateError`` when the arena and the layout disagree (every tier checks this before
        it writes anything)."""
        if self.shards is not None:
            return dict(self.shards)
        return arena_views(self.arena, self.layout)

    def snapshot(self) -> Snapshot:
        """A snapshot over the same memory (what ``state.apply`` and the archive read): the
        captured one itself for an image made by :meth:`of`."""
        origin = self.origin
        if origin is not None and origin.arena is self.arena and origin.step == self.step:
            return origin
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
    its newest): nothing was stored and the caller still owns the image's buffers.

    ``digest`` is what proves the stored copy on a later ``open(step, expect=...)``: the
    pilot records it in the checkpoint's row at publication (the peers': the digests this
    process computed as it sent, never one the peers report). ``codec`` and
    ``write_seconds`` are the row's (how the bytes were encoded, how long writing them
    took)."""

    step: int
    location: str
    bytes_stored: int
    delta: bool = False
    kept: bool = True
    digest: str = ""
    codec: str = "raw"
    write_seconds: float = 0.0


@dataclass(frozen=True)
class StageOptions:
    """How the pilot wants one image written. ``codecs``: encode through the tier's codec
    selector where that pays at the tier's bandwidth (a tier without one ignores it);
    ``fsync``: make the staged bytes durable before publication (a durable tier).

    ``written``: what the pilot does with a :class:`Staged` once its bytes are written (it
    records the ``pending`` row). A tier calls it, once, when its bytes are written before
    ``stage`` returns: a collective stage (the DCP-backed tier: every rank writes its part,
    then the coordinator finishes) returns only once every rank is done, and a rank killed
    in between must leave its ``pending`` row as a killed save of any tier does. The pilot
    calls it after ``stage`` for a tier that did not."""

    codecs: bool = False
    fsync: bool = True
    written: Callable[[Staged], None] | None = field(default=None, compare=False)


PLAIN = StageOptions()
"""No codecs, fsynced: an organ's options, and every put's."""


@dataclass(frozen=True)
class Staged:
    """An image written (or ready to be written) to a tier and not yet visible there: the
    first phase of a two-phase put. The pilot records a ``pending`` row from it —
    ``location`` (where the staged bytes are), ``digest`` (what the row records before the
    publication), ``bytes_stored`` and ``codec`` — then validates, then publishes or
    aborts it. ``write_seconds`` is None when the tier writes at publication (the peers
    send and commit in one step). ``handle`` is the tier's own and is only read by it."""

    step: int
    kind: Tier
    location: str
    digest: str
    bytes_raw: int
    bytes_stored: int | None
    codec: str
    write_seconds: float | None
    image: CheckpointImage = field(repr=False, compare=False)
    base: CheckpointImage | None = field(default=None, repr=False, compare=False)
    handle: Any = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Check:
    """A staged image's validation: ``ok``, and why not (or how it was checked); ``seconds``
    the check took, None when nothing was read back (a tier whose copies are checked as they
    are stored): its row then records no validation time."""

    ok: bool
    reason: str = ""
    seconds: float | None = None


@dataclass(frozen=True)
class OpenedImage:
    """A stored image opened for reading: ``tensor(key)`` gives one tensor, in memory the
    caller owns. A tier may defer reading (and checking) a tensor until it is asked for; the
    three tiers of the package read and verify the whole image in ``open`` (the remote
    archive streams each file once, hashing as it reads). ``source`` and ``bytes_read`` are
    where it came from and what reading it moved."""

    step: int
    meta: Mapping[str, Any]
    level: Level
    source: str
    bytes_read: int
    tensor: Callable[[str], torch.Tensor]

    @classmethod
    def of(cls, image: CheckpointImage) -> OpenedImage:
        """An image already in memory, opened: a key it lacks is a format error naming it."""
        tensors = image.tensors()
        where = image.source

        def tensor(key: str) -> torch.Tensor:
            try:
                return tensors[key]
            except KeyError:
                raise CheckpointFormatError(
                    f"{where}: state refers to tensor {key!r}, absent from the image") from None

        return cls(image.step, image.meta, image.level, where, image.bytes_read, tensor)


@runtime_checkable
class CheckpointTier(Protocol):
    """A place that stores checkpoint images of one rank.

    Lifecycle and call order (one writer thread stages, publishes and discards; ``open``,
    ``get`` and ``steps`` may come from another thread, e.g. a restore while the writer is
    idle):

    1. Construct; this touches no storage that a read-only caller must not change.
    2. A put in two phases, steps ascending (after a restore to an earlier step, ``discard``
       the abandoned newer steps first):

       - ``stage(image, base=None, *, options) -> Staged``: write what can be written
         without making it visible (or, for a tier whose publication is its write, only
         prepare it). ``base`` is an earlier image of this rank that the tier may still hold:
         a tier that folds deltas sends only the difference from it, the others ignore it.
         The tier may keep the image's arena without copying it (the memory tier does): the
         caller must not change it after a kept put.
       - ``validate(staged) -> Check``: is the staged copy what was meant (the remote tier:
         the post-write validator it was built with, a load test in another process).
       - ``publish(staged) -> PutReceipt``: make it the step's image, atomically (a put of a
         step already held replaces it). After a failure or a crash mid-put, ``open`` never
         returns a half image and the images stored before are untouched.
       - ``abort(staged, why) -> str | None``: give up a staged image that failed validation;
         where its bytes were set aside for inspection (None: nothing was kept).

       ``put(image, base=None)`` is the three in a row (abort when the validation fails).
    3. ``open(step, *, expect=None, at=None) -> OpenedImage``: the image, verified against
       the digests recorded at put and, with ``expect``, against the ``PutReceipt.digest`` the
       caller kept (the row's); read lazily where the tier can. ``at`` is the
       ``PutReceipt.location`` the caller kept: a tier may look there first (the peers: the
       daemons the shards went to, rather than asking every daemon); the digest, never the
       location, is what proves the copy. Raises ``NoCheckpointError`` naming the
       step when the tier does not hold it, ``IntegrityError`` naming the step when its bytes
       are not the ones put; other failures (a dead link, a full disk) propagate as the
       tier's own errors, all of them in ``failures``. ``get(step)`` is ``open`` read whole
       into one arena.
    4. ``steps() -> list[int]``: the steps ``open`` can return, ascending; ``locate(step)``:
       where ``open`` reads ``step`` from (for messages; nothing is checked).
    5. ``set_aside(step, why) -> str | None``: move a held step out of the way before it is
       put again (a run resumed from an earlier step), keeping it for inspection; where it
       went (None: nothing to move, or the next put replaces it in place).
    6. ``discard(step)``: forget ``step``; discarding a step not held does nothing.
    7. ``close()``: release connections, threads and held memory; idempotent. Nothing else
       is called after it.

    ``where`` names the tier in messages; ``failures`` are the errors meaning "this tier
    cannot take or give this image now", which the pilot survives with another tier.
    """

    kind: Tier
    capabilities: TierCapabilities
    where: str
    failures: tuple[type[BaseException], ...]

    def stage(self, image: CheckpointImage, base: CheckpointImage | None = None, *,
              options: StageOptions = PLAIN) -> Staged: ...

    def validate(self, staged: Staged) -> Check: ...

    def publish(self, staged: Staged) -> PutReceipt: ...

    def abort(self, staged: Staged, why: str) -> str | None: ...

    def put(self, image: CheckpointImage, base: CheckpointImage | None = None) -> PutReceipt:
        ...

    def open(self, step: int, *, expect: str | None = None,
             at: str | None = None) -> OpenedImage: ...

    def get(self, step: int) -> CheckpointImage: ...

    def steps(self) -> list[int]: ...

    def locate(self, step: int) -> str: ...

    def set_aside(self, step: int, why: str) -> str | None: ...

    def discard(self, step: int) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Survey:
    """What a durable tier holds of this rank: ``published`` images by step (their
    locations) and the ``unfinished`` saves a killed writer left (their locations)."""

    published: dict[int, str]
    unfinished: list[str]


@runtime_checkable
class Surveyed(Protocol):
    """A durable tier whose own listing a restore repairs and chooses from, rows or not (the
    remote tier: the metadata may be lost while the archives are not). ``survey`` raises
    ``OSError`` when the tier cannot be listed; ``clear`` removes an unfinished save;
    ``labels(step)`` reads the image's own labels (``level``, ``branch``) without loading
    it; ``owns(location)`` says whether a row's location is one of this tier's images (and
    not, say, a DCP checkpoint in the same place)."""

    url: str

    def survey(self) -> Survey: ...

    def clear(self, location: str) -> None: ...

    def labels(self, step: int) -> Mapping[str, Any]: ...

    def owns(self, location: str) -> bool: ...


@runtime_checkable
class Collective(Protocol):
    """A tier whose put is one collective of every rank (the DCP-backed sharded tier: one
    checkpoint, each rank writing its part): a save that one rank refuses must be refused by
    every rank before any of them starts it, or the others would wait in it for ever.
    ``first_rank_refuses(refused)`` (collective) gives every rank the first rank's answer:
    the first rank alone decides the disk budget; ``any_rank_fails(failed)`` (collective)
    tells every rank whether any failed, so that a step one rank raised in before the put is
    given up by every rank."""

    def first_rank_refuses(self, refused: bool) -> bool: ...

    def any_rank_fails(self, failed: bool) -> bool: ...


@runtime_checkable
class BaseKeeper(Protocol):
    """A tier that keeps images in this process and lends one as a delta base, no copy (the
    memory tier): what the pilot gives a tier that folds deltas."""

    def base_for(self, step: int | None, layout: Layout) -> CheckpointImage | None: ...


def put_in_two_phases(tier: CheckpointTier, image: CheckpointImage,
                      base: CheckpointImage | None = None,
                      options: StageOptions = PLAIN) -> PutReceipt:
    """``stage`` → ``validate`` → ``publish``, or ``abort`` and raise when the validation
    fails: a tier's ``put``, the path the pilot's writer takes with a row in between."""
    t0 = time.perf_counter()
    staged = tier.stage(image, base, options=options)
    check = tier.validate(staged)
    if not check.ok:
        where = tier.abort(staged, check.reason)
        raise CheckpointFormatError(
            f"{tier.where}: step {image.step} failed validation after "
            f"{time.perf_counter() - t0:.2f} s: {check.reason}"
            + (f"; kept as {where}" if where else ""))
    return tier.publish(staged)
