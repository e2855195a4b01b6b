"""The ``auto`` codec: per tensor, the codec that makes encode + transfer fastest.

Owns: the choice among ``raw``, ``byteplane``, ``zstd`` (integer and bool tensors: on floats
byte planes are both faster and smaller, bench/RESULTS.md, codecs.py), ``prefix_index``
(16/32-bit floats) and ``xor_delta`` (when a fitting base is given), from timed trials on
samples. The byte-plane candidates code the planes that pay at the given bandwidth
(``paying_plane_ratio``). Must not: write its own blob format (the blob is the chosen codec's,
whose id is in the header, so decoding dispatches on it) or remember choices between calls.

Cost model, per candidate: ``encode seconds + encoded bytes / bandwidth_bytes_per_s``, or with
``overlap=True`` (the container encodes tensor i while tensor i-1 is being written) the larger
of the two: a codec then pays only if it encodes faster than the tier takes raw bytes; the
encode is then credited with two cores fewer (the writer hashes and writes, another thread
hashes the raw bytes, at the same time). A tensor whose raw transfer takes under
``MIN_TRIAL_SECONDS`` (1 ms) is sent raw untried: no codec could save more than that, and the
trials would cost more. A tensor of at most ``sample_bytes`` is encoded whole by every candidate
(best of two timed runs) and the winner's blob is returned as is. A bigger one is tried on 8
evenly spaced stripes of ``sample_bytes / 4`` and of ``sample_bytes`` (best of two runs each):
the difference of the two times gives the per-byte cost without the per-call overheads, which is
scaled to the rest of the tensor and divided by the worker threads the full encode will use; the
size is scaled from the bigger sample. ``raw`` is a candidate, so the pick is never slower than
``raw`` on this estimate. The trials encode at most 2.5 ``sample_bytes`` per candidate whatever
the tensor's size, a fixed cost per call; a caller that saves the same tensors again and again
may keep ``choose``'s answer.
Timing makes the choice machine- and load-dependent; every choice decodes the same.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ckptpilot.codecs.base import (
    Codec,
    CodecParamError,
    check_int,
    check_positive,
    resolve_threads,
)
from ckptpilot.codecs.blob import Buffer
from ckptpilot.codecs.byteplane import CHUNK_BYTES, paying_plane_ratio
from ckptpilot.codecs.registry import decode_blob, get_codec, register_codec

_STRIPES = 8
MIN_TRIAL_SECONDS = 1e-3
_PREFIX_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@register_codec
class AutoCodec(Codec):
    """Pick per tensor; ``level``, ``prefix_bits`` and ``threads`` go to the candidates."""

    codec_id = "auto"

    def __init__(
        self,
        *,
        bandwidth_bytes_per_s: float = 2e9,
        sample_bytes: int = 256 << 10,
        level: int = 1,
        prefix_bits: int = 12,
        threads: int = 0,
        overlap: bool = False,
    ) -> None:
        name = self.codec_id
        self.bandwidth_bytes_per_s = check_positive(
            name, "bandwidth_bytes_per_s", bandwidth_bytes_per_s
        )
        self.sample_bytes = check_int(name, "sample_bytes", sample_bytes, 1024)
        self.level = check_int(name, "level", level, 1, 22)
        self.prefix_bits = check_int(name, "prefix_bits", prefix_bits, 1, 31)
        self.threads = check_int(name, "threads", threads, 0)
        if not isinstance(overlap, bool):
            raise CodecParamError(f"auto: overlap must be a bool, got {overlap!r}")
        self.overlap = overlap

    @property
    def config(self) -> dict[str, Any]:
        return {
            "id": self.codec_id,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "sample_bytes": self.sample_bytes,
            "level": self.level,
            "prefix_bits": self.prefix_bits,
            "threads": self.threads,
            "overlap": self.overlap,
        }

    def candidates(self, tensor: torch.Tensor, base: torch.Tensor | None) -> list[Codec]:
        """The codecs tried for this tensor (``raw`` first, always)."""
        entropy = {"level": self.level, "threads": self.threads}
        planes = {**entropy, "min_plane_ratio": paying_plane_ratio(self.bandwidth_bytes_per_s)}
        codecs = [get_codec("raw"), get_codec("byteplane", **planes)]
        if not tensor.dtype.is_floating_point:
            codecs.append(get_codec("zstd", **entropy))
        if tensor.dtype in _PREFIX_DTYPES:
            codecs.append(get_codec("prefix_index", prefix_bits=self.prefix_bits, **entropy))
        if _fits(tensor, base):
            codecs.append(get_codec("xor_delta", **planes))
        return codecs

    def choose(
        self, tensor: torch.Tensor, base: torch.Tensor | None = None
    ) -> tuple[Codec, list[Buffer] | None]:
        """The cheapest codec, and its blob when the trial already encoded the whole tensor."""
        codec, parts, _ = self.trial(tensor, base)
        return codec, parts

    def trial(
        self, tensor: torch.Tensor, base: torch.Tensor | None = None
    ) -> tuple[Codec, list[Buffer] | None, float]:
        """``choose``, plus the encoded size the winner is expected to reach (bytes)."""
        nbytes = tensor.numel() * tensor.dtype.itemsize
        if nbytes < MIN_TRIAL_SECONDS * self.bandwidth_bytes_per_s:
            return get_codec("raw"), None, float(nbytes)
        whole = nbytes <= self.sample_bytes
        cores = resolve_threads(self.threads)
        if self.overlap:  # the writer's and the hasher's threads take two cores meanwhile
            cores = max(1, cores - 2)
        workers = min(cores, max(1, nbytes // CHUNK_BYTES))
        if not whole:
            small, small_base = self._sample(tensor, base, self.sample_bytes // 4)
            sample, sample_base = self._sample(tensor, base, self.sample_bytes)
        trials = []
        for codec in self.candidates(tensor, base):
            delta = codec.codec_id == "xor_delta"
            if whole:  # the real thing, timed twice to damp noise: no scaling needed
                encode_s, parts = _best_of_two(codec, tensor, base if delta else None)
                size = _size(parts)
            else:  # per-byte cost from two sample sizes, so fixed costs cancel out
                small_s, _ = _best_of_two(codec, small, small_base if delta else None)
                sample_s, parts = _best_of_two(codec, sample, sample_base if delta else None)
                per_byte = max(sample_s - small_s, 0.0) / (_nbytes(sample) - _nbytes(small))
                rest = per_byte * (nbytes - _nbytes(sample))
                encode_s = sample_s + (rest if codec.codec_id == "raw" else rest / workers)
                size = _size(parts) * nbytes / _nbytes(sample)
            transfer_s = size / self.bandwidth_bytes_per_s
            cost = max(encode_s, transfer_s) if self.overlap else encode_s + transfer_s
            trials.append((cost, codec, parts, size))
        _, codec, parts, size = min(trials, key=lambda trial: trial[0])
        return codec, parts if whole else None, float(size)

    def encode_parts(self, tensor: torch.Tensor, base: torch.Tensor | None = None) -> list[Buffer]:
        codec, parts = self.choose(tensor, base)
        if parts is not None:
            return parts
        return codec.encode_parts(tensor, base if codec.codec_id == "xor_delta" else None)

    def decode(self, blob: Buffer, base: torch.Tensor | None = None) -> torch.Tensor:
        return decode_blob(blob, base, threads=self.threads)

    def _sample(
        self, tensor: torch.Tensor, base: torch.Tensor | None, sample_bytes: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        flat = tensor.detach().reshape(-1)
        stripe = max(1, sample_bytes // (_STRIPES * tensor.dtype.itemsize))
        starts = torch.linspace(0, flat.numel() - stripe, _STRIPES).long().tolist()
        index = torch.cat([torch.arange(s, s + stripe) for s in starts]).to(flat.device)
        if base is None or not _fits(tensor, base):
            return flat[index], None
        return flat[index], base.detach().reshape(-1).to(flat.device)[index]


def _fits(tensor: torch.Tensor, base: torch.Tensor | None) -> bool:
    return base is not None and base.dtype == tensor.dtype and base.shape == tensor.shape


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.dtype.itemsize


def _size(parts: list[Buffer]) -> int:
    return sum(len(memoryview(part)) for part in parts)


def _best_of_two(
    codec: Codec, tensor: torch.Tensor, base: torch.Tensor | None
) -> tuple[float, list[Buffer]]:
    """The shorter of two timed encodes (the first may pay for cold caches), and its parts."""
    runs = []
    for _ in range(2):
        start = time.perf_counter()
        parts = codec.encode_parts(tensor, base)
        runs.append((time.perf_counter() - start, parts))
    return min(runs, key=lambda run: run[0])
