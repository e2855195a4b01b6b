"""The zstd entropy stage shared by the codecs: compressor profiles and exact decompression.

Owns: which zstd parameters a level means for byte planes and index streams, the
literals-only profile for planes without repeated strings, decoding a zstd frame into a
caller's buffer that it must fill exactly, and refusing (:func:`check_payload`) coded
sections that cannot decode to the size the blob's header gives, before it is allocated.
Must not: decide what to compress (the codecs do) or share zstd contexts between calls (they
are not thread-safe; one is made per call, a cost small next to the coding itself).

Byte planes of float tensors carry their redundancy in the symbol distribution, not in repeated
strings, so zstd gains from Huffman-coding literals and loses time hunting matches. Two profiles:

- ``compressor(1)``, the *match* profile: the fast strategy with a tiny hash table (hash_log 6),
  min_match 7 and target_length 0: on most exponent planes it is both faster than zstd's
  level 1 and smaller (bench/RESULTS.md, codecs.py, per-plane table: "matches" against
  "zstd-1"). It still walks every position for matches, and on planes dominated by one symbol
  (the top plane of an XOR delta, Adam's exp_avg_sq) it finds short ones and slows down to a
  fraction of that speed.
- :func:`literal_compressor`, the *literals* profile: matches practically never searched
  (target_length at its maximum) and Huffman coding of literals forced on. zstd switches
  literal coding off for exactly this setting (its negative levels), so it sets the experimental
  ``ZSTD_c_literalCompressionMode``, which python-zstandard does not expose; it comes from
  ``compression.zstd`` (Python 3.14) or its backport ``backports.zstd``. On the one-symbol
  planes it runs much faster than the match profile at about the same ratio, and on
  the other coded planes no slower (bench/RESULTS.md, codecs.py: the per-plane table and its
  interpretation).

Both write plain zstd frames: decoding needs neither profile, so every blob ever written decodes
with python-zstandard. Levels 2-22 are zstd's standard levels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import zstandard

from ckptpilot.codecs.blob import Frame
from ckptpilot.errors import CheckpointFormatError

try:
    from compression import zstd as _stdzstd  # type: ignore[import-not-found]  # Python 3.14+
except ImportError:
    from backports import zstd as _stdzstd

_MATCH_PROFILE = {
    "strategy": zstandard.STRATEGY_FAST,
    "window_log": 17,
    "hash_log": 6,
    "chain_log": 6,
    "search_log": 1,
    "min_match": 7,
    "target_length": 0,
}
# ZSTD_c_literalCompressionMode = ZSTD_c_experimentalParam5 in zstd.h; value 1 is
# ZSTD_ps_enable. Experimental parameters keep their numbers; tests check that it takes effect.
LITERAL_COMPRESSION_MODE, PS_ENABLE = 1002, 1
_P = _stdzstd.CompressionParameter
_LITERAL_PROFILE = {
    _P.strategy: 1,  # ZSTD_fast
    _P.window_log: 17,
    _P.hash_log: 6,
    _P.chain_log: 6,
    _P.search_log: 1,
    _P.min_match: 7,
    _P.target_length: 1 << 17,  # the maximum: sample matches once per 128 KiB block
    LITERAL_COMPRESSION_MODE: PS_ENABLE,
}


class Compressor(Protocol):
    """What the codecs call: one complete zstd frame per ``compress``."""

    def compress(self, data: np.ndarray | bytes) -> bytes: ...


class _LiteralCompressor:
    def compress(self, data: np.ndarray | bytes) -> bytes:
        return _stdzstd.ZstdCompressor(options=_LITERAL_PROFILE).compress(
            data, _stdzstd.ZstdCompressor.FLUSH_FRAME
        )


def compressor(level: int, threads: int = 1) -> Compressor:
    """A fresh compressor (level 1 = the match profile); ``threads`` > 1 lets zstd split jobs."""
    workers = threads if threads > 1 else 0
    if level == 1:
        params = zstandard.ZstdCompressionParameters(threads=workers, **_MATCH_PROFILE)
    else:
        params = zstandard.ZstdCompressionParameters.from_level(level, threads=workers)
    return zstandard.ZstdCompressor(compression_params=params)


def literal_compressor() -> Compressor:
    """A compressor for the literals profile (byte planes whose symbols, not strings, repeat)."""
    return _LiteralCompressor()


def check_payload(frame: Frame, parts: Sequence[tuple[int, bool]]) -> None:
    """:meth:`Frame.check_sections`, and each zstd-coded part's frame must record its exact
    size (``(nbytes, coded)`` per section): called before the tensor is allocated, so a
    forged size is refused before anything of it is allocated."""
    frame.check_sections(parts)
    for index, (nbytes, coded) in enumerate(parts):
        if coded:
            where = f"{frame.codec} blob, section {index}"
            check_frame(frame.unverified_section(index), nbytes, where)


def check_frame(data: memoryview | bytes, nbytes: int, what: str) -> None:
    """Raise unless the zstd frame in ``data`` may decompress to exactly ``nbytes``: its
    header's content size (every frame the codecs write records it) must be ``nbytes``.

    Called before the caller allocates ``nbytes``, so that a forged size is refused first.
    """
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise CheckpointFormatError(f"{what}: zstd data is corrupt: {exc}") from exc
    if declared not in (-1, nbytes):  # -1: not recorded (frames of other writers)
        raise CheckpointFormatError(
            f"{what}: the zstd frame holds {declared} bytes, expected {nbytes}"
        )


def decompress_into(data: memoryview | bytes, out: np.ndarray, what: str) -> None:
    """Decompress one zstd frame into the contiguous array ``out``, which it must fill exactly.

    Writing into ``out`` (instead of a new ``bytes``) spares an allocation and a copy.
    """
    view = memoryview(out.reshape(-1).view(np.uint8))
    check_frame(data, len(view), what)
    filled = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=False) as reader:
            while filled < len(view):
                got = reader.readinto(view[filled:])
                if not got:
                    break
                filled += got
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise CheckpointFormatError(f"{what}: zstd data is corrupt: {exc}") from exc
    if filled != len(view) or extra:
        raise CheckpointFormatError(
            f"{what}: zstd data decompresses to {'more' if extra else filled} bytes, "
            f"expected {len(view)}"
        )
