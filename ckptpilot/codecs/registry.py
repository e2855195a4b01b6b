"""The codec registry: names to codec classes, and dispatch of a blob to the codec that wrote it.

Owns: the table of registered codecs, :func:`get_codec` (name + parameters to an instance,
with clear errors), :func:`decode_blob` (decode any blob by the codec id in its header) and
:func:`blob_info`. Must not: import codec modules (each registers itself with
:func:`register_codec` when ``ckptpilot.codecs`` is imported) or hold codec instances.
"""

from __future__ import annotations

import inspect
from typing import Any, TypeVar

import torch

from ckptpilot.codecs.base import Codec, CodecParamError, FramedCodec
from ckptpilot.codecs.blob import BlobHeader, Buffer, read_header
from ckptpilot.errors import CheckpointFormatError, CkptPilotError

_CODECS: dict[str, type[Codec]] = {}
_C = TypeVar("_C", bound=type[Codec])


class UnknownCodecError(CkptPilotError, ValueError):
    """No codec is registered under this name."""

    def __init__(self, name: object) -> None:
        self.name = name
        super().__init__(f"unknown codec {name!r}; valid codecs: {', '.join(codec_names())}")


def register_codec(cls: _C) -> _C:
    """Class decorator: make ``cls`` available as ``get_codec(cls.codec_id)``."""
    if cls.codec_id in _CODECS and _CODECS[cls.codec_id] is not cls:
        raise ValueError(f"codec id {cls.codec_id!r} is already registered")
    _CODECS[cls.codec_id] = cls
    return cls


def codec_names() -> tuple[str, ...]:
    """The registered codec ids, sorted."""
    return tuple(sorted(_CODECS))


def _leaf_codec_names() -> tuple[str, ...]:
    """The registered codecs that write blobs of their own (the ids a blob may name), sorted."""
    return tuple(name for name in codec_names() if issubclass(_CODECS[name], FramedCodec))


def codec_class(name: str) -> type[Codec]:
    """The class registered as ``name``; :class:`UnknownCodecError` if there is none."""
    try:
        return _CODECS[name]
    except (KeyError, TypeError):
        raise UnknownCodecError(name) from None


def get_codec(name: str, **params: Any) -> Codec:
    """A codec instance; unknown names and parameters raise ``ValueError`` subclasses."""
    cls = codec_class(name)
    allowed = [
        p.name for p in inspect.signature(cls).parameters.values() if p.kind is p.KEYWORD_ONLY
    ]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise CodecParamError(
            f"{name}: unknown parameter(s) {', '.join(map(repr, unknown))}; valid parameters: "
            f"{', '.join(allowed) or '(none)'}"
        )
    return cls(**params)


def blob_info(blob: Buffer) -> BlobHeader:
    """The header of a blob (checked), without decoding its payload."""
    return read_header(blob)


def decode_blob(
    blob: Buffer, base: torch.Tensor | None = None, *, threads: int = 0
) -> torch.Tensor:
    """Decode any blob with the codec named in its header (``base`` for delta codecs;
    ``threads`` workers for codecs that use them, 0 = all cores).

    Only codecs that write blobs of their own can be named there: a blob naming ``auto``
    (which delegates, and would dispatch back here without end) is refused as forged.
    """
    name = read_header(blob).codec
    if name not in _CODECS:
        raise CheckpointFormatError(
            f"blob written by codec {name!r}, which this ckptpilot does not know; valid codecs: "
            f"{', '.join(codec_names())}"
        )
    cls = _CODECS[name]
    if not issubclass(cls, FramedCodec):
        raise CheckpointFormatError(
            f"blob names codec {name!r}, which writes no blobs of its own (blobs name the "
            f"codec that wrote them: {', '.join(_leaf_codec_names())}); the blob is forged "
            "or corrupt"
        )
    params = {"threads": threads} if "threads" in inspect.signature(cls).parameters else {}
    return cls(**params).decode(blob, base)
