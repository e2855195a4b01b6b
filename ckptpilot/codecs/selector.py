"""Which codec encodes each tensor of a training state, for one target tier.

Owns: the tensor families of the policy's ``codecs`` section (``weights`` = the model's
tensors, ``optimizer``, ``other``) and the memory of ``auto``'s choices. ``auto`` times trials
on samples, a few milliseconds per large tensor; a pilot saves the same tensors again and
again, so a choice is kept per tensor (name, dtype, shape) and tried afresh only every
``retry_every`` saves (the data drift; a tensor that compressed well at step 100 may not at
step 10 000). Must not: do I/O or know the container's layout.

``xor_delta`` needs a base; a tensor given none (a self-contained pulse on a passive store,
the first save, a changed shape) goes through ``auto`` like the other families: without a base
the XOR saves nothing, and ``auto`` keeps ``byteplane`` (xor_delta's non-delta half) only
where it pays against the tier's bandwidth.

Threading: ``codec_for`` may be called from the container's encoder thread while the writer
thread calls ``new_save``; a lock guards the memory of choices.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch

from ckptpilot.codecs.auto import AutoCodec
from ckptpilot.codecs.base import Codec
from ckptpilot.codecs.byteplane import paying_plane_ratio
from ckptpilot.codecs.registry import get_codec

FAMILIES = ("weights", "optimizer", "other")
HASH_BYTES_PER_S = 1.9e9
"""SHA256 bytes per second on one core: the price of the container's extra hashing pass. From
the SHA256 reference line of bench/RESULTS.md (peer.py), rounded down."""


def family(name: str) -> str:
    """The policy family of a state tensor, from its capture path."""
    if name.startswith("model/"):
        return "weights"
    if name.startswith("optimizer/"):
        return "optimizer"
    return "other"


class CodecSelector:
    """``codec_for(name, tensor) -> (codec, base)`` for ``write_container``."""

    def __init__(self, names: Mapping[str, str], *, bandwidth_bytes_per_s: float,
                 level: int = 1, prefix_bits: int = 12, threads: int = 0,
                 retry_every: int = 20) -> None:
        unknown = set(names) - set(FAMILIES)
        if unknown:
            raise ValueError(f"unknown tensor families {sorted(unknown)}; known: {FAMILIES}")
        entropy = {"level": level, "threads": threads}
        self._codecs: dict[str, Codec] = {}
        for fam in FAMILIES:
            codec_name = names.get(fam, "auto")
            if codec_name == "auto":
                self._codecs[fam] = AutoCodec(bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                                              prefix_bits=prefix_bits, overlap=True, **entropy)
            else:
                self._codecs[fam] = _build(codec_name, prefix_bits=prefix_bits,
                                           bandwidth=bandwidth_bytes_per_s, **entropy)
        self._no_base = AutoCodec(bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                                  prefix_bits=prefix_bits, overlap=True, **entropy)
        self._retry_every = retry_every
        self._saves = 0
        self._bandwidth = bandwidth_bytes_per_s
        # (name, dtype, shape, has base) -> (codec, save it was chosen at, expected bytes)
        self._chosen: dict[tuple[str, torch.dtype, tuple[int, ...], bool],
                           tuple[Codec, int, float]] = {}
        self._lock = threading.Lock()

    def new_save(self) -> None:
        """Count a save: choices older than ``retry_every`` saves are tried again."""
        with self._lock:
            self._saves += 1

    def codec_for(self, name: str, tensor: torch.Tensor,
                  base: torch.Tensor | None = None) -> tuple[Codec, torch.Tensor | None]:
        codec = self._codecs[family(name)]
        fits = base is not None and base.dtype == tensor.dtype and base.shape == tensor.shape
        if codec.codec_id == "xor_delta":
            if fits:
                return codec, base
            codec = self._no_base
        if not isinstance(codec, AutoCodec):
            return codec, None
        key = (name, tensor.dtype, tuple(tensor.shape), fits)
        with self._lock:
            known = self._chosen.get(key)
            saves = self._saves
        if known is None or saves - known[1] >= self._retry_every:
            chosen, _, size = codec.trial(tensor, base if fits else None)
            with self._lock:
                self._chosen[key] = (chosen, saves, size)
        else:
            chosen = known[0]
        return chosen, (base if chosen.codec_id == "xor_delta" else None)

    def plain_pays(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """True when writing these tensors as they are beats the container: every tensor has
        a remembered, current choice (no base given), and the transfer time the codecs would
        save is less than the container's extra pass (it hashes each raw tensor on top of the
        file, at ``HASH_BYTES_PER_S``). A codec that merely breaks even per tensor does not pay
        for that pass."""
        saved = 0.0
        total = 0
        with self._lock:
            saves = self._saves
            for name, tensor in tensors.items():
                nbytes = tensor.numel() * tensor.element_size()
                total += nbytes
                codec = self._codecs[family(name)]
                if codec.codec_id == "xor_delta":
                    codec = self._no_base
                if not isinstance(codec, AutoCodec):
                    if codec.codec_id != "raw":
                        return False
                    continue
                known = self._chosen.get((name, tensor.dtype, tuple(tensor.shape), False))
                if known is None or saves - known[1] >= self._retry_every:
                    return False
                saved += max(0.0, nbytes - known[2])
        return saved / self._bandwidth < total / HASH_BYTES_PER_S

    def choices(self) -> dict[str, str]:
        """Tensor name -> the codec last chosen for it (for logs and benchmarks)."""
        with self._lock:
            return {key[0]: codec.codec_id for key, (codec, _, _) in self._chosen.items()}


def _build(name: str, *, prefix_bits: int, bandwidth: float, level: int, threads: int) -> Codec:
    params: dict[str, Any] = {}
    if name in ("zstd", "byteplane", "xor_delta", "prefix_index"):
        params = {"level": level, "threads": threads}
    if name == "prefix_index":
        params["prefix_bits"] = prefix_bits
    if name in ("byteplane", "xor_delta"):
        params["min_plane_ratio"] = paying_plane_ratio(bandwidth)
    return get_codec(name, **params)
