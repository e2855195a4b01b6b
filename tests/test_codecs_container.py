"""The container format (SPEC §5): streaming round trips, index, damage named precisely."""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path

import pytest
import torch

from ckptpilot.codecs import Codec, get_codec, read_container, read_index, write_container
from ckptpilot.errors import CheckpointFormatError, IntegrityError

META = {"step": 12, "epoch": 1, "sampler": {"seed": 3, "position": [4, 5]}, "loss": 0.25}


def previous() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {"layer.weight": torch.randn(64, 48) * 0.02, "layer.bias": torch.zeros(64)}


def current(prev: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    torch.manual_seed(2)
    return {
        "layer.weight": prev["layer.weight"] + 1e-4 * torch.randn(64, 48),
        "layer.bias": prev["layer.bias"].clone(),  # frozen: the delta is all zeros
        "opt.exp_avg": torch.randn(64, 48) * 1e-3,
        "opt.exp_avg_sq": (torch.randn(64, 48) ** 2 * 1e-6).to(torch.bfloat16),
        "opt.step": torch.tensor(12.0),
        "mask": torch.rand(10) > 0.5,
        "empty": torch.zeros(0, 3, dtype=torch.float16),
        "transposed": torch.arange(12, dtype=torch.int32).reshape(3, 4).t(),
    }


def codec_for_pulse(prev: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    def codec_for(name: str, tensor: torch.Tensor) -> tuple[Codec, torch.Tensor | None]:
        if name in prev:
            return get_codec("xor_delta"), prev[name]
        if name.startswith("opt.exp"):
            return get_codec("prefix_index"), None
        return get_codec("auto", bandwidth_bytes_per_s=1e6), None

    return codec_for


def written(tensors: dict[str, torch.Tensor], prev: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    write_container(buffer, tensors, META, codec_for_pulse(prev))
    return buffer.getvalue()


def assert_same_state(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        expected_bits = tensor.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), expected_bits), name


def test_round_trip_through_a_file_with_bases_and_meta(tmp_path: Path) -> None:
    prev = previous()
    state = current(prev)
    path = tmp_path / "state.ckpc"
    with path.open("wb") as out:
        index = write_container(out, state, META, codec_for_pulse(prev))
    with path.open("rb") as src:
        tensors, meta = read_container(src, prev)
    assert meta == META
    assert_same_state(tensors, state)
    assert index.raw_bytes == sum(t.numel() * t.element_size() for t in state.values())
    assert index.encoded_bytes < path.stat().st_size
    with path.open("rb") as src:
        assert read_index(src) == index


def test_the_index_describes_every_tensor() -> None:
    prev = previous()
    state = current(prev)
    index = read_index(io.BytesIO(written(state, prev)))
    entries = {entry.name: entry for entry in index.tensors}
    assert list(entries) == list(state)
    weight = entries["layer.weight"]
    assert (weight.dtype, weight.shape, weight.codec) == (torch.float32, (64, 48), "xor_delta")
    assert weight.raw_bytes == 64 * 48 * 4 and weight.offset == 16
    assert len(weight.sha256) == 64 and "segments" in weight.params
    assert entries["layer.bias"].encoded_bytes < 400  # frozen tensor: nearly free
    assert entries["opt.exp_avg"].codec == "prefix_index"
    assert entries["transposed"].shape == (4, 3)
    offsets = [entry.offset for entry in index.tensors]
    assert offsets == sorted(offsets)


def test_streaming_write_needs_only_write_and_survives_short_writes() -> None:
    class Trickle:
        """A pipe-like sink: no seek, no tell, at most 1000 bytes accepted per call."""

        def __init__(self) -> None:
            self.data = bytearray()

        def write(self, chunk: memoryview) -> int:
            self.data += chunk[:1000]
            return min(len(chunk), 1000)

    prev = previous()
    state = current(prev)
    sink = Trickle()
    index = write_container(sink, state, META, codec_for_pulse(prev))  # type: ignore[arg-type]
    tensors, meta = read_container(io.BytesIO(bytes(sink.data)), prev)
    assert_same_state(tensors, state)
    assert meta == META and read_index(io.BytesIO(bytes(sink.data))) == index


def test_a_missing_base_names_the_tensor() -> None:
    prev = previous()
    data = written(current(prev), prev)
    with pytest.raises(ValueError, match=r"tensor 'layer.weight'.*pass its base in bases="):
        read_container(io.BytesIO(data))


def test_truncation_anywhere_is_rejected_as_a_whole() -> None:
    prev = previous()
    data = written(current(prev), prev)
    for cut in [0, 1, 15, 16, 17, 500, len(data) // 2, len(data) - 33, len(data) - 32,
                len(data) - 1]:
        with pytest.raises(CheckpointFormatError, match=r"truncated|trailer"):
            read_container(io.BytesIO(data[:cut]), prev)


def _damaged(data: bytes, position: int) -> io.BytesIO:
    damaged = bytearray(data)
    damaged[position] ^= 0x04
    return io.BytesIO(bytes(damaged))


def test_damage_is_reported_where_it_is() -> None:
    prev = previous()
    state = current(prev)
    data = written(state, prev)
    index = read_index(io.BytesIO(data))
    (index_offset,) = struct.unpack_from("<Q", data, len(data) - 24)
    cases = {
        3: "container",  # file header
        index.tensors[2].offset + 100: "tensor 'opt.exp_avg'",
        index.tensors[0].offset + 5: "tensor 'layer.weight'",
        index.meta_offset + 2: "meta",
        index_offset + 10: "index",
        len(data) - 20: "trailer",
    }
    for position, where in cases.items():
        with pytest.raises(CheckpointFormatError, match=where):
            read_container(_damaged(data, position), prev)


def test_every_bit_flip_in_the_index_and_trailer_is_caught() -> None:
    prev = previous()
    data = written({"w": current(prev)["layer.weight"]}, {})
    (index_offset,) = struct.unpack_from("<Q", data, len(data) - 24)
    for position in range(index_offset, len(data)):
        for bit in range(8):
            damaged = bytearray(data)
            damaged[position] ^= 1 << bit
            with pytest.raises(CheckpointFormatError, match=r"index|trailer"):
                read_index(io.BytesIO(bytes(damaged)))


def test_a_wrong_digest_in_a_consistent_index_is_an_integrity_error() -> None:
    """Bytes that decode fine but are not what was saved must still be refused."""
    prev = previous()
    data = bytearray(written(current(prev), prev))
    (index_offset, index_length) = struct.unpack_from("<QQ", data, len(data) - 24)
    index = json.loads(bytes(data[index_offset : index_offset + index_length]))
    index["tensors"][2]["sha256"] = "0" * 64
    forged = json.dumps(index).encode()
    trailer = struct.pack("<8sQQI", b"CKPTTAIL", index_offset, len(forged), zlib.crc32(forged))
    rebuilt = bytes(data[:index_offset]) + forged + trailer + struct.pack("<I", zlib.crc32(trailer))
    with pytest.raises(IntegrityError, match=r"tensor 'opt\.exp_avg': SHA256 mismatch"):
        read_container(io.BytesIO(rebuilt), prev)


def test_meta_that_is_not_json_is_refused_before_writing() -> None:
    buffer = io.BytesIO()
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        write_container(buffer, {}, {"bad": object()}, codec_for_pulse({}))
    assert buffer.getvalue() == b""


def test_an_encode_failure_stops_the_write_without_a_trailer() -> None:
    def codec_for(name: str, tensor: torch.Tensor) -> tuple[Codec, torch.Tensor | None]:
        if name == "b":
            raise RuntimeError("boom")
        return get_codec("raw"), None

    buffer = io.BytesIO()
    tensors = {name: torch.ones(1000) for name in "abcd"}
    with pytest.raises(RuntimeError, match="boom"):
        write_container(buffer, tensors, {}, codec_for)
    with pytest.raises(CheckpointFormatError, match="trailer"):
        read_index(io.BytesIO(buffer.getvalue()))


def test_an_empty_state_round_trips() -> None:
    buffer = io.BytesIO()
    index = write_container(buffer, {}, {}, codec_for_pulse({}))
    assert index.tensors == () and index.raw_bytes == 0
    buffer.seek(0)
    assert read_container(buffer) == ({}, {})
