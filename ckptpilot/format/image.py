"""The peer image meta: the JSON that travels beside a checkpoint's arena on the peer tier.

A peer holds one training state as two parts: the arena (every tensor's bytes, back to back,
in the order of the layout) and this meta, which says what the arena holds (the layout) and
everything else needed to resume (the state tree, level, retention class). The meta's bytes
are the format: ``encode`` writes exactly the compact JSON every earlier version wrote, keys
in this order, and ``decode`` reads it back or says which field is at fault.

Owns the meta's fields, their JSON spelling and the format name ``IMAGE_FORMAT`` (its
version is the trailing number). Must not do I/O, shard or hash: the peer tier moves the
bytes and checks their digests; the writer and restorer decide what goes in and what a
decoded image means for recovery.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from ckptpilot.codecs.blob import DTYPE_NAMES, DTYPES
from ckptpilot.errors import CheckpointFormatError
from ckptpilot.vocab import Level, RetentionClass

__all__ = ["IMAGE_FORMAT", "ImageMeta", "Layout"]

IMAGE_FORMAT = "ckptpilot-peer-image-1"

Layout = tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]
"""(name, dtype, shape) per tensor, in arena order (``Snapshot.layout``)."""


@dataclass(frozen=True)
class ImageMeta:
    """What a peer image holds besides its arena bytes.

    ``created_unix`` is a wall stamp for people reading listings, never used to order
    checkpoints (the step does that). ``state`` is the snapshot's JSON-able meta tree.
    """

    step: int
    rank: int
    level: Level
    reason: str
    retention_class: RetentionClass
    score: float | None
    created_unix: float
    layout: Layout
    state: dict[str, Any]

    def encode(self) -> bytes:
        """The meta as compact JSON bytes, exactly as every version of this format wrote it."""
        layout = []
        for name, dtype, shape in self.layout:
            if dtype not in DTYPE_NAMES:
                raise CheckpointFormatError(
                    f"peer image of step {self.step}: tensor {name!r} has dtype {dtype}, which "
                    "the image format cannot name; convert it before checkpointing")
            layout.append([name, DTYPE_NAMES[dtype], list(shape)])
        return json.dumps({
            "format": IMAGE_FORMAT, "step": self.step, "rank": self.rank,
            "level": Level(self.level).value, "reason": self.reason,
            "retention_class": RetentionClass(self.retention_class).value, "score": self.score,
            "created_unix": self.created_unix, "layout": layout, "state": self.state,
        }, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes, *, where: str = "peer image meta", step: int | None = None,
               rank: int | None = None) -> ImageMeta:
        """Parse and check meta bytes; ``CheckpointFormatError`` names ``where`` and the field.

        With ``step`` and ``rank``, a meta of another checkpoint is refused too: a peer that
        answers for step 12 with step 6's image must not restore as step 12.
        """
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e:  # JSON, UTF-8
            raise CheckpointFormatError(f"{where}: meta is not valid JSON ({e})") from e
        if not isinstance(doc, dict):
            raise CheckpointFormatError(
                f"{where}: meta is a JSON {type(doc).__name__}, not an object")
        if doc.get("format") != IMAGE_FORMAT:
            raise CheckpointFormatError(
                f"{where}: holds format {doc.get('format')!r:.80}, not {IMAGE_FORMAT!r} (written "
                "by a newer ckptpilot or another program: upgrade ckptpilot to read it)")
        meta = cls(
            step=_field(doc, "step", int, where),
            rank=_field(doc, "rank", int, where),
            level=_choice(doc, "level", Level, where),
            reason=_field(doc, "reason", str, where),
            retention_class=_choice(doc, "retention_class", RetentionClass, where),
            score=_field(doc, "score", (int, float, type(None)), where),
            created_unix=_field(doc, "created_unix", (int, float), where),
            layout=_layout(_field(doc, "layout", list, where), where),
            state=_field(doc, "state", dict, where),
        )
        if (step is not None and meta.step != step) or (rank is not None and meta.rank != rank):
            raise CheckpointFormatError(
                f"{where}: holds {IMAGE_FORMAT!r} of step {meta.step}, rank {meta.rank}, not "
                f"step {step}, rank {rank} (a peer answered with another checkpoint's image)")
        return meta


def _field(doc: dict[str, Any], name: str, types: type | tuple[type, ...], where: str) -> Any:
    if name not in doc:
        raise CheckpointFormatError(f"{where}: meta lacks the field {name!r}")
    value = doc[name]
    if isinstance(value, bool) or not isinstance(value, types):
        kinds = types if isinstance(types, tuple) else (types,)
        raise CheckpointFormatError(
            f"{where}: meta field {name!r} is {value!r:.80}, not a "
            f"{' or '.join('null' if t is type(None) else t.__name__ for t in kinds)}")
    return value


def _choice(doc: dict[str, Any], name: str, kind: type[Level] | type[RetentionClass],
            where: str) -> Any:
    value = _field(doc, name, str, where)
    try:
        return kind(value)
    except ValueError:
        raise CheckpointFormatError(
            f"{where}: meta field {name!r} is {value!r:.80}, not one of "
            f"{', '.join(m.value for m in kind)}") from None


def _layout(entries: list[Any], where: str) -> Layout:
    layout = []
    for index, entry in enumerate(entries):
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and entry[1] in DTYPES and isinstance(entry[2], list)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                        for d in entry[2])):
            raise CheckpointFormatError(
                f"{where}: meta field 'layout' entry {index} is {entry!r:.80}, not "
                "[name, dtype name, [non-negative sizes]]")
        layout.append((entry[0], DTYPES[entry[1]], tuple(entry[2])))
    return tuple(layout)
