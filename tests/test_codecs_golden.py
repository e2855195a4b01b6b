"""Golden files: blobs and a container written by an earlier ckptpilot must decode forever.

The tests only read ``tests/fixtures/codecs/`` and compare with tensors rebuilt from integer
arithmetic (no RNG or float library whose output could drift between versions). To add
fixtures for a new codec or format version, run ``python tests/test_codecs_golden.py``; it
writes only the files that are missing and never rewrites an existing one. The version-1
blobs of codecs newer than version 2 (``expplane``) were written by the same code with the
version-1 section table (``blob.FORMAT_VERSION`` set to 1), so that every codec is read in
both versions here and in ``test_fuzz.py``.
"""

from __future__ import annotations

import io
import json
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptpilot.codecs import (
    Codec,
    blob_info,
    byteplane,
    decode_blob,
    get_codec,
    read_container,
    write_container,
)
from ckptpilot.codecs.blob import FORMAT_VERSION
from ckptpilot.codecs.container import CodecFor
from ckptpilot.errors import CheckpointFormatError

FIXTURES = Path(__file__).parent / "fixtures" / "codecs"
BLOB_VERSIONS = (1, 2)  # blob format versions with fixtures; 1: crc32 sections, 2: XXH3-64


def fixture(stem: str, version: int, suffix: str) -> Path:
    """``raw.blob`` for version 1 (written before versions had names), ``raw.v2.blob`` on."""
    return FIXTURES / (f"{stem}{suffix}" if version == 1 else f"{stem}.v{version}{suffix}")
_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def words(n: int, seed: int) -> np.ndarray:
    """``n`` pseudo-random uint64 words (splitmix64), defined by integer arithmetic alone."""
    with np.errstate(over="ignore"):
        z = (np.arange(1, n + 1, dtype=np.uint64) + np.uint64(seed)) * np.uint64(
            0x9E3779B97F4A7C15
        )
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) & _MASK


def trained_fp32(n: int, seed: int) -> torch.Tensor:
    """Weight-like fp32 bit patterns: random sign and mantissa, exponents 2^-9 .. 2^-4."""
    w = words(n, seed)
    sign = (w >> np.uint64(63)) << np.uint64(31)
    exponent = (np.uint64(118) + (w >> np.uint64(40)) % np.uint64(6)) << np.uint64(23)
    mantissa = w & np.uint64(0x7FFFFF)
    value = (sign | exponent | mantissa).astype(np.uint32)
    value[::17] = 0x7FC00001  # a NaN with a payload
    value[5::19] = 0x80000000  # -0.0
    value[7::23] = 0x00000003  # a subnormal
    return torch.from_numpy(value.view(np.int32).copy()).view(torch.float32)


def nudged(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    """The tensor with a few low mantissa bits flipped, like one small optimizer step."""
    flips = (words(tensor.numel(), seed) & np.uint64(0x1F)).astype(np.int32)
    bits = tensor.reshape(-1).view(torch.int32) ^ torch.from_numpy(flips)
    return bits.view(torch.float32).reshape(tensor.shape)


def counters(n: int) -> torch.Tensor:
    return torch.from_numpy((np.arange(n, dtype=np.int64) * 3) // 7)


def golden_cases() -> dict[str, tuple[Codec, torch.Tensor, torch.Tensor | None]]:
    """File stem -> (codec, tensor, base)."""
    base = trained_fp32(600, 7).reshape(20, 30)
    bf16 = torch.from_numpy((words(301, 3) >> np.uint64(48)).astype(np.int16)).view(
        torch.bfloat16
    )
    return {
        "raw": (get_codec("raw"), trained_fp32(15, 1).reshape(3, 5), None),
        "zstd": (get_codec("zstd"), counters(400), None),
        "byteplane": (get_codec("byteplane"), trained_fp32(1000, 2).reshape(10, 100), None),
        "byteplane_bf16": (get_codec("byteplane"), bf16, None),
        "byteplane_chunked": (get_codec("byteplane"), trained_fp32(333, 4), None),
        "xor_delta": (get_codec("xor_delta"), nudged(base, 8), base),
        "prefix_index": (get_codec("prefix_index"), trained_fp32(2000, 5), None),
        "prefix_index_fixed": (
            get_codec("prefix_index", entropy=False, groups=4), trained_fp32(2000, 6), None
        ),
        "prefix_index_fallback": (get_codec("prefix_index"), counters(50).double(), None),
        "auto": (get_codec("auto", bandwidth_bytes_per_s=1e6), counters(3000), None),
        "expplane": (get_codec("expplane"), trained_fp32(1000, 9).reshape(10, 100), None),
        "expplane_bf16": (get_codec("expplane"), non_negative_bf16(3000, 10), None),
    }


def non_negative_bf16(n: int, seed: int) -> torch.Tensor:
    """Adam ``exp_avg_sq``-like bfloat16: weight-like exponents, the sign bit always clear."""
    halves = (trained_fp32(n, seed).view(torch.int32) >> 16).to(torch.int16) & 0x7FFF
    return halves.view(torch.bfloat16)


def golden_container_state() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    base = {"w": trained_fp32(256, 11).reshape(16, 16)}
    state = {
        "w": nudged(base["w"], 12),
        "exp_avg": trained_fp32(256, 13),
        "step": torch.tensor(42, dtype=torch.int64),
        "mask": torch.from_numpy((words(9, 14) & np.uint64(1)).astype(np.bool_)),
    }
    return state, base


GOLDEN_META = {"step": 42, "epoch": 3, "rng": {"python": [1, 2, 3]}, "note": "golden v1"}


def container_codec_for(base: dict[str, torch.Tensor]) -> CodecFor:
    def codec_for(name: str, tensor: torch.Tensor) -> tuple[Codec, torch.Tensor | None]:
        if name in base:
            return get_codec("xor_delta"), base[name]
        return get_codec("prefix_index" if name == "exp_avg" else "byteplane"), None

    return codec_for


def assert_bit_equal(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("version", BLOB_VERSIONS)
@pytest.mark.parametrize("name", sorted(golden_cases()))
def test_golden_blob_decodes_to_the_same_tensor(name: str, version: int) -> None:
    codec, tensor, base = golden_cases()[name]
    blob = fixture(name, version, ".blob").read_bytes()
    assert blob_info(blob).version == version
    assert blob_info(blob).codec in name or name == "auto"
    assert_bit_equal(codec.decode(blob, base), tensor)
    assert_bit_equal(decode_blob(blob, base), tensor)


@pytest.mark.parametrize("version", BLOB_VERSIONS)
def test_golden_blobs_cover_the_layouts_they_claim(version: int) -> None:
    def params(name: str) -> dict[str, object]:
        return blob_info(fixture(name, version, ".blob").read_bytes()).params

    assert params("byteplane_chunked")["chunk"] == 16
    assert params("prefix_index")["mode"] == "table" and params("prefix_index")["entropy"]
    assert params("prefix_index_fixed")["entropy"] is False
    assert params("prefix_index_fallback")["mode"] == "byteplane"
    assert params("expplane")["rotated"] and params("expplane_bf16")["rotated"]
    assert [mode for _, _, mode in params("expplane_bf16")["segments"]] == ["zstd", "zstd"]


@pytest.mark.parametrize("version", BLOB_VERSIONS)
def test_golden_container_reads_back(version: int) -> None:
    state, base = golden_container_state()
    with fixture("container", version, ".ckpc").open("rb") as src:
        tensors, meta = read_container(src, base)
    assert meta == GOLDEN_META
    assert list(tensors) == list(state)
    for name, tensor in state.items():
        assert_bit_equal(tensors[name], tensor)


def encode_as_the_fixtures_were(codec: Codec, name: str, tensor: torch.Tensor,
                                base: torch.Tensor | None) -> bytes:
    """``codec.encode`` with the chunk size the fixture ``name`` was written with."""
    chunk = 64 if name.endswith("_chunked") else byteplane.CHUNK_BYTES
    saved, byteplane.CHUNK_BYTES = byteplane.CHUNK_BYTES, chunk
    try:
        return codec.encode(tensor, base)
    finally:
        byteplane.CHUNK_BYTES = saved


def pin_cases() -> dict[str, tuple[Codec, torch.Tensor, torch.Tensor | None]]:
    """Inputs whose encoding is pinned byte for byte (``PINS``): every lane layout the plane
    codecs split and join (2-, 4- and 8-byte elements, raw and coded lanes, a base, chunks,
    worker threads), so that a faster implementation provably writes the same blobs."""
    base = trained_fp32(3000, 21)
    w = words(3000, 22)
    two_coded = ((w >> np.uint64(62)) << np.uint64(31)  # sign
                 | (np.uint64(120) + w % np.uint64(3)) << np.uint64(23)  # 3 exponents
                 | ((w >> np.uint64(8)) % np.uint64(5)) << np.uint64(16)  # 5 top mantissas
                 | (w >> np.uint64(32)) & np.uint64(0xFFFF)).astype(np.uint32)
    top_halves = (trained_fp32(3000, 23).view(torch.int32) >> 16).to(torch.int16)
    bf16 = top_halves.view(torch.bfloat16)  # weight-like: a few exponents, random mantissas
    bf16_moved = (top_halves ^ torch.from_numpy((w & np.uint64(0xFF)).astype(np.int16))).view(
        torch.bfloat16)  # a random low byte: a raw lane under the base
    fp16 = torch.from_numpy(((w >> np.uint64(63)) << np.uint64(15)  # sign
                             | (np.uint64(9) + w % np.uint64(4)) << np.uint64(10)  # 4 exponents
                             | (w >> np.uint64(20)) & np.uint64(0x3FF)).astype(np.uint16).view(
        np.int16)).view(torch.float16)
    moved = (base.view(torch.int32) ^ torch.from_numpy(
        (w & np.uint64(0xFFFFFF)).astype(np.int32))).view(torch.float32)  # random low 3 bytes
    return {
        "byteplane_fp32": (get_codec("byteplane"), trained_fp32(3000, 24), None),
        "byteplane_fp32_two_coded": (
            get_codec("byteplane"), torch.from_numpy(two_coded.view(np.float32)), None),
        "byteplane_fp32_level3": (get_codec("byteplane", level=3), trained_fp32(3000, 25), None),
        "byteplane_fp32_threads_chunked": (
            get_codec("byteplane", threads=2), trained_fp32(3000, 26), None),
        "byteplane_fp64": (get_codec("byteplane"), trained_fp32(1500, 27).double(), None),
        "byteplane_fp16": (get_codec("byteplane"), fp16, None),
        "byteplane_bf16": (get_codec("byteplane"), bf16, None),
        "byteplane_int64": (get_codec("byteplane"), counters(3000), None),
        "byteplane_uint8": (get_codec("byteplane"), torch.from_numpy(
            (w & np.uint64(0xFF)).astype(np.uint8)), None),
        "byteplane_bool": (get_codec("byteplane"), torch.from_numpy(
            (w % np.uint64(7) == 0).astype(np.bool_)), None),
        "xor_delta_fp32": (get_codec("xor_delta"), nudged(base, 28), base),
        "xor_delta_fp32_chunked": (get_codec("xor_delta", threads=2), nudged(base, 29), base),
        "xor_delta_fp32_slow_tier": (
            get_codec("xor_delta", min_plane_ratio=1.01), nudged(base, 30), base),
        "xor_delta_fp32_raw_lanes": (get_codec("xor_delta"), moved, base),
        "xor_delta_bf16": (get_codec("xor_delta"), bf16_moved, bf16),
        "prefix_index_fp32": (get_codec("prefix_index"), trained_fp32(3000, 31), None),
        "prefix_index_bf16": (get_codec("prefix_index"), bf16, None),
    }


def pin(name: str) -> Path:
    return FIXTURES / "pins" / f"{name}.v{FORMAT_VERSION}.blob"


@pytest.mark.parametrize("name", sorted(pin_cases()))
def test_encoding_today_reproduces_the_pinned_bytes(name: str) -> None:
    # A faster implementation of the coding must not change one byte of what it writes.
    codec, tensor, base = pin_cases()[name]
    expected = pin(name).read_bytes()
    assert encode_as_the_fixtures_were(codec, name, tensor, base) == expected
    assert_bit_equal(decode_blob(expected, base), tensor)


@pytest.mark.parametrize("name", ["byteplane", "byteplane_bf16", "byteplane_chunked", "raw",
                                  "zstd", "prefix_index", "prefix_index_fixed",
                                  "prefix_index_fallback", "expplane", "expplane_bf16"])
def test_encoding_today_reproduces_the_golden_bytes(name: str) -> None:
    # The golden blobs whose coder choices have not changed since they were written (the
    # xor_delta and container ones predate the literals profile).
    codec, tensor, base = golden_cases()[name]
    expected = fixture(name, FORMAT_VERSION, ".blob").read_bytes()
    assert encode_as_the_fixtures_were(codec, name, tensor, base) == expected


def write_missing_fixtures() -> list[Path]:
    """Write the fixtures that do not exist yet; returns the paths written."""
    FIXTURES.mkdir(parents=True, exist_ok=True)
    created = []
    for name, (codec, tensor, base) in golden_cases().items():
        path = fixture(name, FORMAT_VERSION, ".blob")
        if not path.exists():
            path.write_bytes(encode_as_the_fixtures_were(codec, name, tensor, base))
            created.append(path)
    for name, (codec, tensor, base) in pin_cases().items():
        path = pin(name)
        if not path.exists():
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(encode_as_the_fixtures_were(codec, name, tensor, base))
            created.append(path)
    path = fixture("container", FORMAT_VERSION, ".ckpc")
    if not path.exists():
        state, base = golden_container_state()
        buffer = io.BytesIO()
        write_container(buffer, state, GOLDEN_META, container_codec_for(base))
        path.write_bytes(buffer.getvalue())
        created.append(path)
    return created


if __name__ == "__main__":
    written = write_missing_fixtures()
    json.dump([str(p) for p in written], sys.stdout, indent=1)
    print()


def test_a_flipped_payload_byte_is_caught_in_either_version() -> None:
    for version in BLOB_VERSIONS:
        blob = bytearray(fixture("byteplane", version, ".blob").read_bytes())
        blob[-5] ^= 0x10
        with pytest.raises(CheckpointFormatError, match="checksum mismatch in section"):
            decode_blob(bytes(blob))


def test_an_unknown_blob_version_is_refused_by_name() -> None:
    blob = bytearray(fixture("raw", 2, ".blob").read_bytes())
    struct.pack_into("<H", blob, 4, 3)
    head = blob_info(fixture("raw", 2, ".blob").read_bytes()).header_bytes
    struct.pack_into("<I", blob, head - 4, zlib.crc32(blob[:head - 4]))
    with pytest.raises(CheckpointFormatError, match="format version 3 is not supported"):
        decode_blob(bytes(blob))
