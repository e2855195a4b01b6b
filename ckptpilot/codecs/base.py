"""The codec interface and the helpers every codec shares (SPEC §5).

Owns: the :class:`Codec` contract (encode/decode, threading, ``config``), :class:`FramedCodec`
(codecs that write their own blob), tensor <-> little-endian byte views, strided views of
element byte lanes (the fast split and join are ``lanes``), the per-call worker pool and
parameter validation. Must not: know any codec's payload, do I/O,
or keep state between calls.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from ckptpilot.codecs.blob import (
    DTYPE_NAMES,
    DTYPES,
    Buffer,
    Frame,
    Section,
    build_blob,
    parse_blob,
)
from ckptpilot.errors import CheckpointFormatError, CkptPilotError

_T = TypeVar("_T")
_R = TypeVar("_R")


class CodecParamError(CkptPilotError, ValueError):
    """A codec parameter is unknown, of the wrong type or out of range."""


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's elements as a flat uint8 array in C order (a view when already contiguous)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided or tensor.dtype not in DTYPE_NAMES:
        raise ValueError(
            f"cannot encode a tensor with layout {tensor.layout} and dtype {tensor.dtype}; "
            f"supported: dense tensors of {', '.join(DTYPES)}"
        )
    flat = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def tensor_from_bytes(raw: np.ndarray, frame: Frame) -> torch.Tensor:
    """Wrap a writable uint8 array of ``frame.nbytes`` as the frame's tensor (no copy)."""
    if raw.dtype != np.uint8 or raw.shape != (frame.nbytes,):
        raise CheckpointFormatError(
            f"{frame.codec} blob decoded to {raw.size} bytes, header says {frame.nbytes}"
        )
    if raw.size == 0:  # NumPy gives empty arrays stride 0, which torch cannot re-view
        return torch.empty(frame.shape, dtype=frame.dtype)
    return torch.from_numpy(raw).view(frame.dtype).reshape(frame.shape)


def lane(flat: np.ndarray, itemsize: int, lo: int, width: int) -> np.ndarray:
    """Bytes ``[lo, lo + width)`` of every element of the flat uint8 array, as a strided array
    of little-endian ``width``-byte words (``width`` in 1, 2, 4, 8 and ``lo % width == 0``)."""
    return flat.view(f"<u{width}").reshape(-1, itemsize // width)[:, lo // width]


def word_runs(lo: int, hi: int, itemsize: int) -> list[tuple[int, int]]:
    """Split the element bytes ``[lo, hi)`` into the fewest aligned words, as (lo, width)."""
    runs = []
    while lo < hi:
        width = next(w for w in (8, 4, 2, 1) if lo % w == 0 and itemsize % w == 0 and lo + w <= hi)
        runs.append((lo, width))
        lo += width
    return runs


def resolve_threads(threads: int) -> int:
    """``threads`` as a worker count: 0 means every core of this machine."""
    return threads if threads > 0 else os.cpu_count() or 1


def parallel_map(fn: Callable[[_T], _R], items: Sequence[_T], threads: int) -> list[_R]:
    """``[fn(x) for x in items]`` on up to ``threads`` worker threads (inline for one item).

    Worth it because the work inside (NumPy copies, zstd, crc32) releases the GIL. The pool
    lives for one call, so codecs stay stateless.
    """
    if threads <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(threads, len(items))) as pool:
        return list(pool.map(fn, items))


def check_int(codec: str, name: str, value: object, lo: int, hi: int | None = None) -> int:
    """``value`` if it is an int (not a bool) in ``[lo, hi]``, else :class:`CodecParamError`."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < lo
        or (hi is not None and value > hi)
    ):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise CodecParamError(f"{codec}: {name} must be an integer {bound}, got {value!r}")
    return value


def check_bool(codec: str, name: str, value: object) -> bool:
    """``value`` if it is a bool (not 0/1), else :class:`CodecParamError`."""
    if not isinstance(value, bool):
        raise CodecParamError(f"{codec}: {name} must be true or false, got {value!r}")
    return value


def check_positive(codec: str, name: str, value: object) -> float:
    """``value`` as a float if it is a finite number > 0, else :class:`CodecParamError`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise CodecParamError(f"{codec}: {name} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise CodecParamError(f"{codec}: {name} must be finite, got {value!r}")
    return float(value)


class Codec(ABC):
    """A lossless, stateless tensor codec.

    Lifecycle: built once by :func:`ckptpilot.codecs.get_codec` with validated parameters, then
    used from any number of threads at once: ``encode``/``encode_parts`` and ``decode`` keep no
    state between calls (zstd contexts and worker pools are created per call). ``encode_parts``
    returns the blob as a list of buffers, so a writer can stream it without joining (the
    buffers may alias the input tensor's memory: write them before mutating the tensor);
    ``encode`` returns the joined ``bytes``. ``decode`` returns a contiguous CPU tensor whose
    memory is owned by a NumPy array (huge-page backed, hence fast to fill; it cannot be
    resized in place). ``base`` is the reference tensor of delta codecs; others ignore it.
    """

    codec_id: ClassVar[str]

    @property
    @abstractmethod
    def config(self) -> dict[str, Any]:
        """JSON-able ``{"id": codec_id, **params}``; ``get_codec(**...)`` rebuilds the codec."""

    @abstractmethod
    def encode_parts(self, tensor: torch.Tensor, base: torch.Tensor | None = None) -> list[Buffer]:
        """The blob as buffers to write in order; ``b"".join`` of them is ``encode``'s result."""

    @abstractmethod
    def decode(self, blob: Buffer, base: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor, bit-exact; :class:`CheckpointFormatError` if the blob is damaged."""

    def encode(self, tensor: torch.Tensor, base: torch.Tensor | None = None) -> bytes:
        """The blob as one ``bytes`` (a copy of the parts; streaming writers use the parts)."""
        return b"".join(self.encode_parts(tensor, base))

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.config.items() if k != "id")
        return f"{type(self).__name__}({params})"


class FramedCodec(Codec):
    """A codec that writes its own blobs: subclasses implement ``_encode`` and ``_decode``."""

    def encode_parts(self, tensor: torch.Tensor, base: torch.Tensor | None = None) -> list[Buffer]:
        params, sections = self._encode(tensor, base)
        return build_blob(self.codec_id, tensor.dtype, tuple(tensor.shape), params, sections)

    def decode(self, blob: Buffer, base: torch.Tensor | None = None) -> torch.Tensor:
        frame = parse_blob(blob)
        if frame.codec != self.codec_id:
            raise CheckpointFormatError(
                f"this blob was written by codec {frame.codec!r}, not {self.codec_id!r}; decode "
                "it with get_codec('auto') or ckptpilot.codecs.decode_blob"
            )
        return tensor_from_bytes(self._decode(frame, base), frame)

    @abstractmethod
    def _encode(
        self, tensor: torch.Tensor, base: torch.Tensor | None
    ) -> tuple[dict[str, Any], list[Section]]:
        """Return the header params decode needs and the payload sections."""

    @abstractmethod
    def _decode(self, frame: Frame, base: torch.Tensor | None) -> np.ndarray:
        """Return the raw bytes as a fresh writable uint8 array of ``frame.nbytes``."""


class LevelThreadsCodec(FramedCodec):
    """A framed codec configured by a zstd ``level`` (1-22) and ``threads`` (0 = all cores)."""

    def __init__(self, *, level: int = 1, threads: int = 0) -> None:
        self.level = check_int(self.codec_id, "level", level, 1, 22)
        self.threads = check_int(self.codec_id, "threads", threads, 0)

    @property
    def config(self) -> dict[str, Any]:
        return {"id": self.codec_id, "level": self.level, "threads": self.threads}

