"""The ``zstd`` codec: the tensor's bytes through one zstd frame (the general-purpose baseline).

Owns: whole-buffer zstd at a chosen level. Must not: look at the element structure (that is
``byteplane``). On float tensors ``byteplane`` is both faster and smaller (bench/RESULTS.md,
codecs.py: the ``zstd`` rows), so ``auto`` picks this codec only where it pays, e.g. for
small-integer tensors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ckptpilot.codecs.base import LevelThreadsCodec, resolve_threads, tensor_bytes
from ckptpilot.codecs.blob import Frame, Section
from ckptpilot.codecs.entropy import check_payload, compressor, decompress_into
from ckptpilot.codecs.registry import register_codec


@register_codec
class ZstdCodec(LevelThreadsCodec):
    """zstd at ``level`` (1 = the byte-plane profile, see ``entropy``; 2-22 = zstd's levels);
    ``threads`` > 1 (0 = all cores) lets zstd compress big tensors with worker threads."""

    codec_id = "zstd"

    def _encode(
        self, tensor: torch.Tensor, base: torch.Tensor | None
    ) -> tuple[dict[str, Any], list[Section]]:
        data = tensor_bytes(tensor)
        threads = resolve_threads(self.threads) if data.nbytes >= 8 << 20 else 1
        return {}, [Section.of(compressor(self.level, threads).compress(data))]

    def _decode(self, frame: Frame, base: torch.Tensor | None) -> np.ndarray:
        check_payload(frame, [(frame.nbytes, True)])
        out = np.empty(frame.nbytes, np.uint8)
        decompress_into(frame.section(0), out, "zstd blob")
        return out
