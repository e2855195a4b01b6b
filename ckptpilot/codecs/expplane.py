"""The ``expplane`` codec: byte planes of float elements whose top byte is exponent bits only.

Owns: the choice to sign-rotate float elements before their planes are split
(``lanes.rotate_sign``: the top 16 bits of each element rotated left by one bit) and the
header flag that records it. Must not: change ``byteplane``'s blobs (a blob names its codec, so
an older ckptpilot refuses an ``expplane`` blob instead of decoding it unrotated) or code
planes itself (``byteplane.encode_planes`` / ``decode_planes`` do).

Why: in ``byteplane`` a float's top byte is the sign and the top seven exponent bits, and the
lowest exponent bit goes with the mantissa into the next plane, which is stored raw: the
entropy coder sees a random sign bit and never the exponent's last bit. Rotated, the top byte
of a ``float32`` or ``bfloat16`` is the whole 8-bit exponent (``float64``: its top eight bits;
``float16``: its five bits and three mantissa bits) and the sign is one more noise bit below.
A tensor whose sign never changes (Adam's ``exp_avg_sq``) then leaves a plane of seven noise
bits and a constant one, which shrinks by about 8/7 when coded: the default
``min_plane_ratio`` (``MIN_PLANE_RATIO``) is set just below that so such planes are coded.
The ratios this reaches against ``byteplane`` and zipnn (which Huffman-codes the same way)
are in bench/RESULTS.md, codecs.py.

Header params: ``byteplane``'s, plus ``"rotated"``: whether the planes are of rotated
elements. Integer and complex tensors, 1-byte floats, and tensors none of whose rotated planes
pays are stored unrotated (``false``), exactly as ``byteplane`` would store them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ckptpilot.codecs.base import resolve_threads, tensor_bytes
from ckptpilot.codecs.blob import Frame, Section
from ckptpilot.codecs.byteplane import PlaneCodec, decode_planes, encode_planes
from ckptpilot.codecs.registry import register_codec
from ckptpilot.errors import CheckpointFormatError

MIN_PLANE_RATIO = 1.1
"""Below 8/7: a rotated plane of seven noise bits and a constant sign bit is coded."""


def rotates(dtype: torch.dtype) -> bool:
    """Whether elements of ``dtype`` are sign-rotated: floats of 2 bytes or more."""
    return dtype.is_floating_point and dtype.itemsize >= 2


@register_codec
class ExpPlaneCodec(PlaneCodec):
    """Byte planes of sign-rotated floats; otherwise as ``byteplane`` (see :class:`PlaneCodec`).

    ``threads`` (0 = all cores) code chunks of big tensors in parallel.
    """

    codec_id = "expplane"

    def __init__(
        self, *, level: int = 1, threads: int = 0, min_plane_ratio: float = MIN_PLANE_RATIO
    ) -> None:
        super().__init__(level=level, threads=threads, min_plane_ratio=min_plane_ratio)

    def _encode(
        self, tensor: torch.Tensor, base: torch.Tensor | None
    ) -> tuple[dict[str, Any], list[Section]]:
        return encode_planes(
            tensor_bytes(tensor),
            tensor.dtype.itemsize,
            self.level,
            resolve_threads(self.threads),
            min_ratio=self.min_plane_ratio,
            rotate=rotates(tensor.dtype),
        )

    def _decode(self, frame: Frame, base: torch.Tensor | None) -> np.ndarray:
        rotated = frame.param("rotated", bool)
        if rotated and not rotates(frame.dtype):
            raise CheckpointFormatError(
                f"{frame.codec} blob: elements of {frame.dtype} are never sign-rotated"
            )
        return decode_planes(frame, resolve_threads(self.threads), rotated=rotated)
