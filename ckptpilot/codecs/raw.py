"""The ``raw`` codec: the tensor's bytes as they are, framed and checksummed.

Owns: the identity encoding, the baseline every other codec must beat. Must not: transform the
bytes. Encoding copies nothing (the one section aliases the tensor's memory); decoding makes
the one copy that gives the tensor its own memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ckptpilot.codecs.base import FramedCodec, tensor_bytes
from ckptpilot.codecs.blob import Frame, Section
from ckptpilot.codecs.registry import register_codec


@register_codec
class RawCodec(FramedCodec):
    """No compression; one section holding the little-endian element bytes."""

    codec_id = "raw"

    @property
    def config(self) -> dict[str, Any]:
        return {"id": self.codec_id}

    def _encode(
        self, tensor: torch.Tensor, base: torch.Tensor | None
    ) -> tuple[dict[str, Any], list[Section]]:
        return {}, [Section.of(tensor_bytes(tensor))]

    def _decode(self, frame: Frame, base: torch.Tensor | None) -> np.ndarray:
        frame.check_sections([(frame.nbytes, False)])
        out = np.empty(frame.nbytes, np.uint8)
        out[:] = np.frombuffer(frame.section(0), np.uint8)
        return out
