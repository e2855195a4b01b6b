"""Forged blobs and containers (SPEC §5): checksums catch accidents, not a hostile or buggy
writer. Headers rewritten with recomputed, valid checksums must raise CheckpointFormatError
naming the fault, at once, without allocating what they claim. The forging helpers here are
shared with ``test_fuzz.py``."""

from __future__ import annotations

import io
import json
import struct
import tracemalloc
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import xxhash

from ckptpilot.codecs import decode_blob, get_codec, read_container, write_container
from ckptpilot.codecs.base import Codec
from ckptpilot.errors import CheckpointFormatError

_FIXED = struct.Struct("<4sHI")
_ENTRIES = {1: struct.Struct("<QI"), 2: struct.Struct("<QQ")}
_CHECKSUMS: dict[int, Callable[[bytes], int]] = {1: zlib.crc32, 2: xxhash.xxh3_64_intdigest}
_TRAILER = struct.Struct("<8sQQI")
MiB = 1 << 20
TiB = 1 << 40


@dataclass
class Blob:
    """A codec blob taken apart; :meth:`build` puts it back with every checksum recomputed,
    so whatever was changed passes the checksums and reaches the structural checks."""

    version: int
    header: dict[str, Any]
    sections: list[bytes]
    lengths: list[int] | None = None  # table lengths to write instead of the true ones
    header_text: bytes | None = None  # raw JSON to write instead of ``header``

    @classmethod
    def parse(cls, blob: bytes) -> Blob:
        _, version, json_len = _FIXED.unpack_from(blob)
        at = _FIXED.size + json_len
        header = json.loads(blob[_FIXED.size : at])
        (count,) = struct.unpack_from("<I", blob, at)
        entry = _ENTRIES[version]
        lengths = [entry.unpack_from(blob, at + 4 + i * entry.size)[0] for i in range(count)]
        at += 4 + count * entry.size + 4
        sections = []
        for length in lengths:
            sections.append(blob[at : at + length])
            at += length
        return cls(version, header, sections)

    def build(self) -> bytes:
        text = self.header_text or json.dumps(
            self.header, sort_keys=True, separators=(",", ":")
        ).encode()
        head = bytearray(_FIXED.pack(b"CKPB", self.version, len(text))) + text
        head += struct.pack("<I", len(self.sections))
        lengths = self.lengths or [len(s) for s in self.sections]
        for length, section in zip(lengths, self.sections, strict=True):
            head += _ENTRIES[self.version].pack(length, _CHECKSUMS[self.version](section))
        head += struct.pack("<I", zlib.crc32(head))
        return bytes(head) + b"".join(self.sections)


@dataclass
class Container:
    """A container taken apart at its index; :meth:`build` re-seals the index and trailer
    (the blobs and meta before the index are kept as bytes, ``body``)."""

    body: bytes
    index: dict[str, Any]
    index_text: bytes | None = None  # raw JSON to write instead of ``index``

    @classmethod
    def parse(cls, data: bytes) -> Container:
        trailer = data[-(_TRAILER.size + 4) :]
        _, offset, length, _ = _TRAILER.unpack_from(trailer)
        return cls(data[:offset], json.loads(data[offset : offset + length]))

    def build(self) -> bytes:
        text = self.index_text or json.dumps(self.index).encode()
        trailer = _TRAILER.pack(b"CKPTTAIL", len(self.body), len(text), zlib.crc32(text))
        return self.body + text + trailer + struct.pack("<I", zlib.crc32(trailer))


def refused(decode: Callable[[], object], match: str) -> int:
    """Run ``decode``, which must raise CheckpointFormatError matching ``match``; returns the
    peak of memory allocated meanwhile (NumPy reports its arrays to tracemalloc)."""
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointFormatError, match=match):
            decode()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def encoded(name: str, tensor: torch.Tensor, base: torch.Tensor | None = None,
            **params: Any) -> Blob:
    threads = {} if name == "raw" else {"threads": 1}
    return Blob.parse(get_codec(name, **threads, **params).encode(tensor, base))


TENSOR = torch.linspace(-2.0, 2.0, 4096, dtype=torch.float32)
BASE = TENSOR + 1e-3


@pytest.mark.parametrize(("name", "match"), [
    ("raw", r"section 0 has 16384 bytes, which cannot be the stored form of 4398046511104"),
    ("zstd", r"section 0 has \d+ bytes, which cannot be the zstd-coded form of 4398046511104"),
    ("byteplane", r"expected 1099511627776 payload sections|cannot be the"),
    ("expplane", r"expected 1099511627776 payload sections|cannot be the"),
    ("xor_delta", r"xor_delta blob holds a tensor of shape \(1099511627776,\).*base has shape"),
    ("prefix_index", r"expected \d+ payload sections"),
])
def test_a_forged_four_tib_shape_is_refused_before_anything_is_allocated(
    name: str, match: str
) -> None:
    blob = encoded(name, TENSOR, BASE if name == "xor_delta" else None)
    blob.header["shape"], blob.header["nbytes"] = [TiB], 4 * TiB
    if name in ("byteplane", "expplane"):  # one chunk of 4 TiB: the section count then fits
        blob.header["params"]["chunk"] = TiB
    peak = refused(lambda: decode_blob(blob.build(), BASE, threads=1), match)
    assert peak < 4 * MiB


def test_a_byteplane_chunk_that_claims_more_than_its_sections_hold_is_refused() -> None:
    blob = encoded("byteplane", TENSOR)
    blob.header["shape"], blob.header["nbytes"] = [TiB], 4 * TiB
    blob.header["params"]["chunk"] = TiB
    assert len(blob.sections) == len(blob.header["params"]["segments"])  # one chunk
    peak = refused(lambda: decode_blob(blob.build(), threads=1),
                   r"byteplane blob: section 0 has \d+ bytes, which cannot be the")
    assert peak < 4 * MiB


def test_a_raw_size_mismatch_is_a_format_error_not_a_broadcast_error() -> None:
    blob = encoded("raw", TENSOR)
    blob.header["shape"], blob.header["nbytes"] = [2048], 8192
    refused(lambda: decode_blob(blob.build()),
            r"raw blob: section 0 has 16384 bytes, which cannot be the stored form of 8192 "
            r"bytes of the torch.float32 tensor of shape \[2048\]")


def test_a_zstd_frame_is_held_to_the_size_the_shape_gives() -> None:
    """Within zstd's ratio the section could hold 512 KiB, but its frame says how much it
    holds: refused before the claimed 512 KiB are allocated."""
    blob = encoded("zstd", torch.zeros(4096))
    claimed = 512 << 10
    assert len(blob.sections[0]) * (1 << 15) >= claimed
    blob.header["shape"], blob.header["nbytes"] = [claimed // 4], claimed
    peak = refused(lambda: decode_blob(blob.build()),
                   r"zstd blob, section 0: the zstd frame holds 16384 bytes, expected 524288")
    assert peak < claimed // 4


@pytest.mark.parametrize("entropy", [True, False])
def test_prefix_index_sections_must_fit_the_groups_the_shape_gives(entropy: bool) -> None:
    blob = encoded("prefix_index", TENSOR, entropy=entropy)
    assert blob.header["params"]["mode"] == "table"
    blob.header["params"]["group"] = 1 << 40  # one group, however big the shape
    blob.header["shape"], blob.header["nbytes"] = [1 << 30], 4 << 30
    peak = refused(lambda: decode_blob(blob.build(), threads=1),
                   r"prefix_index blob: section \d has \d+ bytes, which cannot be the")
    assert peak < 4 * MiB


@pytest.mark.parametrize("codec", ["auto", "no_such_codec"])
def test_a_blob_may_only_name_a_codec_that_writes_blobs(codec: str) -> None:
    blob = encoded("raw", TENSOR)
    blob.header["codec"] = codec
    match = ("names codec 'auto', which writes no blobs of its own" if codec == "auto"
             else "which this ckptpilot does not know")
    refused(lambda: decode_blob(blob.build()), match)
    refused(lambda: get_codec("auto").decode(blob.build()), match)


@pytest.mark.parametrize(("change", "match"), [
    ({"dtype": ["float32"]}, "codec blob header is malformed"),
    ({"shape": [1] * 65}, "bad shape"),
    ({"shape": [4096.0], "nbytes": 16384}, "bad shape"),
    ({"shape": [True] * 1}, "bad shape"),
    ({"nbytes": 16384.0}, "nbytes 16384.0 does not match"),
    ({"shape": [1 << 40] * 2, "nbytes": 4 << 80}, "more than the 281474976710656"),
])
def test_malformed_header_fields_are_format_errors(change: dict[str, Any], match: str) -> None:
    blob = encoded("raw", TENSOR)
    blob.header.update(change)
    refused(lambda: decode_blob(blob.build()), match)


@pytest.mark.parametrize("text", [
    b'{"codec": "raw", "params": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"codec": "raw", "nbytes": 1' + b"0" * 5000 + b"}",
])
def test_headers_python_cannot_parse_are_format_errors(text: bytes) -> None:
    blob = encoded("raw", TENSOR)
    blob.header_text = text
    refused(lambda: decode_blob(blob.build()), "codec blob header is not valid JSON")


@pytest.mark.parametrize("segment", [[0, 4.0, "raw"], [0.0, 4, "raw"], [0, True, "zstd"]])
def test_plane_segments_must_be_integers(segment: list[Any]) -> None:
    blob = encoded("byteplane", TENSOR)
    blob.header["params"]["segments"] = [segment]
    refused(lambda: decode_blob(blob.build()), "bad plane segment")


@pytest.mark.parametrize(("tensor", "rotated", "match"), [
    (torch.arange(1000, dtype=torch.int32), True, "elements of torch.int32 are never sign-"),
    (TENSOR, 1, "bad header parameter rotated=1"),
    (TENSOR, None, "bad header parameter rotated=None"),
])
def test_expplane_rotation_must_be_a_flag_and_only_on_floats(
    tensor: torch.Tensor, rotated: object, match: str
) -> None:
    blob = encoded("expplane", tensor)
    blob.header["params"]["rotated"] = rotated
    refused(lambda: decode_blob(blob.build()), match)


def test_a_delta_against_a_base_of_another_shape_is_a_format_error() -> None:
    blob = encoded("xor_delta", TENSOR, BASE)
    refused(lambda: decode_blob(blob.build(), BASE[:100]),
            r"holds a tensor of shape \(4096,\).*the base has shape \(100,\)")


# ------------------------------------------------------------------------------ containers

def container() -> bytes:
    def codec_for(name: str, tensor: torch.Tensor) -> tuple[Codec, torch.Tensor | None]:
        return get_codec("raw"), None

    out = io.BytesIO()
    write_container(out, {"w": TENSOR, "b": torch.arange(6, dtype=torch.int32)}, {"step": 1},
                    codec_for)
    return out.getvalue()


def read(data: bytes) -> object:
    return read_container(io.BytesIO(data), threads=1)


def test_a_negative_meta_length_is_refused_before_reading() -> None:
    forged = Container.parse(container())
    forged.index["tensors"][-1]["encoded_bytes"] += 1000
    forged.index["meta"]["offset"] += 1000
    forged.index["meta"]["length"] -= 1000
    assert forged.index["meta"]["length"] < 0
    refused(lambda: read(forged.build()), "container index is malformed: the meta section "
            "is misplaced")


@pytest.mark.parametrize(("change", "match"), [
    ({"shape": [1] * 65}, "entry 'w' has a bad shape"),
    ({"shape": [1 << 40, 1 << 40]}, "entry 'w' describes a tensor of"),
    ({"raw_bytes": 1 << 42}, "entry 'w' says raw_bytes 4398046511104, but its shape"),
    ({"dtype": "float99"}, "entry 'w' has an unknown dtype 'float99'"),
    ({"dtype": ["float32"]}, "expected str"),
])
def test_index_entries_must_agree_with_themselves(change: dict[str, Any], match: str) -> None:
    forged = Container.parse(container())
    forged.index["tensors"][0].update(change)
    refused(lambda: read(forged.build()), match)


def test_an_index_python_cannot_parse_is_a_format_error() -> None:
    forged = Container.parse(container())
    forged.index_text = b"[" * 100_000 + b"]" * 100_000
    refused(lambda: read(forged.build()), "container index is malformed")
