"""The ``xor_delta`` codec: the bitwise XOR against a base tensor, then ``byteplane``.

Owns: the XOR of integer views (on the tensors' device: a GPU does the XOR and only the delta
crosses to the host), the base checks, and the base fingerprint. Must not: keep or find bases
(the caller passes the previous state) or interpret the delta beyond byte planes.

Unchanged bits XOR to zero, so a barely moving or frozen tensor becomes planes of zeros that
zstd shrinks to almost nothing. Header params: the ``byteplane`` params plus
``"base_crc"``: the crc32 of a sample of the base's bytes (64 stripes of 1 KiB evenly spread
over it, or all of it when smaller). Decoding against another base raises instead of returning
a wrong tensor; the sample keeps this check ~free, and the container's SHA256 of the decoded
bytes covers the rest.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import torch

from ckptpilot.codecs.base import resolve_threads, tensor_bytes
from ckptpilot.codecs.blob import Frame, Section
from ckptpilot.codecs.byteplane import PlaneCodec, decode_planes, encode_planes
from ckptpilot.codecs.registry import register_codec
from ckptpilot.errors import CheckpointFormatError

_STRIPES = 64
_STRIPE_BYTES = 1024
_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def check_base(
    tensor_dtype: torch.dtype, tensor_shape: tuple[int, ...], base: torch.Tensor | None
) -> torch.Tensor:
    """The base, or a ``ValueError`` naming both shapes and dtypes when it does not fit."""
    if base is None:
        raise ValueError(
            "xor_delta needs base=: the tensor it was (or is to be) encoded against, the "
            "previous state of the same tensor"
        )
    if not isinstance(base, torch.Tensor):
        raise TypeError(f"xor_delta: base must be a torch.Tensor, got {type(base).__name__}")
    if base.dtype != tensor_dtype or tuple(base.shape) != tensor_shape:
        raise ValueError(
            f"xor_delta: the base has shape {tuple(base.shape)} and dtype {base.dtype}, but the "
            f"tensor has shape {tensor_shape} and dtype {tensor_dtype}; pass the previous state "
            "of the same tensor"
        )
    return base


def base_crc(base: torch.Tensor) -> int:
    """crc32 of a fixed sample of the base's bytes, gathered where the base lives.

    Stripe ``i`` starts at byte ``i * (nbytes - 1024) // 63``: integer arithmetic, so the host
    path here and :func:`_device_base_crc` pick the same bytes.
    """
    if base.device.type != "cpu":
        return _device_base_crc(base)
    flat = tensor_bytes(base)
    if flat.size <= _STRIPES * _STRIPE_BYTES:
        return zlib.crc32(flat)
    starts = np.arange(_STRIPES, dtype=np.int64) * (flat.size - _STRIPE_BYTES) // (_STRIPES - 1)
    return zlib.crc32(flat[(starts[:, None] + np.arange(_STRIPE_BYTES)).reshape(-1)])


def _device_base_crc(base: torch.Tensor) -> int:
    flat = base.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
    if flat.numel() > _STRIPES * _STRIPE_BYTES:
        starts = torch.arange(_STRIPES, device=flat.device) * (flat.numel() - _STRIPE_BYTES)
        starts = starts // (_STRIPES - 1)
        flat = flat[(starts[:, None] + torch.arange(_STRIPE_BYTES, device=flat.device)).reshape(-1)]
    return zlib.crc32(tensor_bytes(flat))


def _device_xor(tensor: torch.Tensor, base: torch.Tensor) -> np.ndarray:
    """``bits(tensor) XOR bits(base)`` computed on the tensor's (non-CPU) device, then fetched."""
    view = _INT_VIEWS.get(tensor.dtype.itemsize, torch.uint8)
    a = tensor.detach().contiguous().reshape(-1).view(torch.uint8).view(view)
    b = base.detach().to(tensor.device).contiguous().reshape(-1).view(torch.uint8).view(view)
    return tensor_bytes(torch.bitwise_xor(a, b))


@register_codec
class XorDeltaCodec(PlaneCodec):
    """XOR against ``base``, then byte planes (params as in ``byteplane``)."""

    codec_id = "xor_delta"

    def _encode(
        self, tensor: torch.Tensor, base: torch.Tensor | None
    ) -> tuple[dict[str, Any], list[Section]]:
        base = check_base(tensor.dtype, tuple(tensor.shape), base)
        itemsize, threads = tensor.dtype.itemsize, resolve_threads(self.threads)
        if tensor.device.type == "cpu":  # XOR chunk by chunk inside the plane coder
            flat, other = tensor_bytes(tensor), tensor_bytes(base)
            params, sections = encode_planes(
                flat, itemsize, self.level, threads, other, self.min_plane_ratio
            )
        else:
            delta = _device_xor(tensor, base)
            params, sections = encode_planes(
                delta, itemsize, self.level, threads, min_ratio=self.min_plane_ratio
            )
        return {**params, "base_crc": base_crc(base)}, sections

    def _decode(self, frame: Frame, base: torch.Tensor | None) -> np.ndarray:
        if isinstance(base, torch.Tensor) and (base.dtype, tuple(base.shape)) != (
            frame.dtype, frame.shape
        ):  # the blob's header or the base is not what it should be: the blob cannot decode
            raise CheckpointFormatError(
                f"xor_delta blob holds a tensor of shape {frame.shape} and dtype {frame.dtype}, "
                f"but the base has shape {tuple(base.shape)} and dtype {base.dtype}; decode it "
                "with the state it was saved against"
            )
        base = check_base(frame.dtype, frame.shape, base)
        if base_crc(base) != frame.param("base_crc", int, lo=0):
            raise CheckpointFormatError(
                "xor_delta blob was encoded against a different base (base fingerprint "
                "mismatch); decode it with the state it was saved against"
            )
        return decode_planes(frame, resolve_threads(self.threads), tensor_bytes(base))
