"""Codecs (SPEC §5): bit-exact round trips, damage detection, parameter errors, ratios."""

from __future__ import annotations

import threading

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from ckptpilot.codecs import (
    CodecParamError,
    UnknownCodecError,
    blob_info,
    byteplane,
    codec_names,
    decode_blob,
    get_codec,
    prefix_index,
    xor_delta,
)
from ckptpilot.codecs.base import tensor_bytes
from ckptpilot.codecs.entropy import decompress_into, literal_compressor
from ckptpilot.errors import CheckpointFormatError

DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool,
]
# Bit patterns every float codec must keep: NaNs with distinct payloads (quiet, signalling,
# negative), +-0, +-inf, the smallest and largest subnormals, the extremes.
SPECIAL_BITS = {
    torch.float32: [0x7FC00000, 0x7FC00001, 0x7F800001, 0xFFFFFFFF, 0x7FBADBEE, 0x00000000,
                    0x80000000, 0x7F800000, 0xFF800000, 0x00000001, 0x807FFFFF, 0x7F7FFFFF],
    torch.float16: [0x7E00, 0x7C01, 0xFE42, 0x7FFF, 0x0000, 0x8000, 0x7C00, 0xFC00, 0x0001,
                    0x83FF, 0x7BFF],
    torch.bfloat16: [0x7FC0, 0x7F81, 0xFFC1, 0x7FFF, 0x0000, 0x8000, 0x7F80, 0xFF80, 0x0001,
                     0x807F, 0x7F7F],
    torch.float64: [0x7FF8000000000000, 0x7FF0000000000001, 0xFFF8DEADBEEF0001, 0x0,
                    0x8000000000000000, 0x7FF0000000000000, 0xFFF0000000000000, 0x1,
                    0x800FFFFFFFFFFFFF],
}
FAST = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's element bytes, for bit-exact comparison (NaN == NaN here)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def assert_same(decoded: torch.Tensor, original: torch.Tensor) -> None:
    assert decoded.dtype == original.dtype
    assert decoded.shape == original.shape
    assert decoded.device.type == "cpu" and decoded.is_contiguous()
    assert torch.equal(bits(decoded), bits(original))


def make_tensor(dtype: torch.dtype, n: int, seed: int, style: str) -> torch.Tensor:
    """``n`` elements: random bit patterns, "trained-like" small values, or few distinct bytes;
    float tensors get special bit patterns sprinkled in."""
    rng = np.random.default_rng(seed)
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, n).astype(np.bool_))
    if dtype.is_floating_point and style == "trained":
        return (torch.from_numpy(rng.standard_normal(n)) * 0.02).to(dtype)
    raw = rng.integers(0, 3 if style == "few" else 256, n * dtype.itemsize, dtype=np.uint8)
    if dtype in SPECIAL_BITS and n:
        words = raw.view(f"<u{dtype.itemsize}")
        special = np.array(SPECIAL_BITS[dtype], dtype=np.uint64).astype(words.dtype)
        count = max(1, n // 4)
        words[rng.integers(0, n, count)] = special[rng.integers(0, len(special), count)]
    return torch.from_numpy(raw).view(dtype) if n else torch.empty(0, dtype=dtype)


@st.composite
def tensors(draw: st.DrawFn, dtypes: list[torch.dtype] = DTYPES) -> torch.Tensor:
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(st.sampled_from([(), (0,), (1,), (7,), (33,), (4, 9), (0, 5), (3, 1, 5)]))
    shape = draw(st.sampled_from([shape, (draw(st.integers(1, 700)),)]))
    n = int(np.prod(shape))
    style = draw(st.sampled_from(["bits", "trained", "few"]))
    tensor = make_tensor(dtype, n, draw(st.integers(0, 2**32 - 1)), style).reshape(shape)
    view = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    if view == "transposed" and tensor.dim() >= 2:
        return tensor.transpose(0, 1)
    if view == "strided" and tensor.dim() >= 1 and tensor.shape[0] > 2:
        return tensor[::2]
    return tensor


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny chunks, samples and groups, so small tensors take the multi-chunk paths."""
    monkeypatch.setattr(byteplane, "CHUNK_BYTES", 64)
    monkeypatch.setattr(byteplane, "SAMPLE_ELEMENTS", 64)
    monkeypatch.setattr(prefix_index, "MIN_GROUP", 16)


CODECS = [
    ("raw", {}),
    ("zstd", {}),
    ("zstd", {"level": 5, "threads": 2}),
    ("byteplane", {"threads": 2}),
    ("byteplane", {"level": 3, "threads": 1}),
    ("expplane", {"threads": 2}),
    ("prefix_index", {"threads": 2}),
    ("prefix_index", {"entropy": False, "groups": 3}),
    ("prefix_index", {"prefix_bits": 16, "groups": 2}),
    ("prefix_index", {"prefix_bits": 20, "entropy": False}),
    ("prefix_index", {"prefix_bits": 1}),
    ("auto", {"bandwidth_bytes_per_s": 1e3, "sample_bytes": 1024}),
    ("auto", {}),
]


@pytest.mark.parametrize(("name", "params"), CODECS, ids=str)
@FAST
@given(tensor=tensors())
def test_round_trip_is_bit_exact(
    small_chunks: None, name: str, params: dict[str, object], tensor: torch.Tensor
) -> None:
    codec = get_codec(name, **params)
    blob = codec.encode(tensor)
    assert isinstance(blob, bytes)
    assert_same(codec.decode(blob), tensor)
    assert_same(decode_blob(blob), tensor)


@pytest.mark.parametrize("name", ["xor_delta", "auto"])
@FAST
@given(tensor=tensors(), seed=st.integers(0, 2**32 - 1), change=st.sampled_from([0, 1, 5, 100]))
def test_delta_round_trip_against_a_base(
    small_chunks: None, name: str, tensor: torch.Tensor, seed: int, change: int
) -> None:
    """The base differs from the tensor in ``change`` percent of its elements."""
    flat = tensor.reshape(-1).clone()
    n = flat.numel()
    if n:
        flip = torch.from_numpy(np.random.default_rng(seed).random(n) < change / 100)
        flat[flip] = make_tensor(tensor.dtype, n, seed, "bits")[flip]
    base = flat.reshape(tensor.shape)
    codec = get_codec(name, bandwidth_bytes_per_s=1e3) if name == "auto" else get_codec(name)
    blob = codec.encode(tensor, base)
    assert_same(codec.decode(blob, base), tensor)


def test_unchanged_tensor_costs_almost_nothing_as_xor_delta() -> None:
    weights = torch.randn(256, 1024) * 0.02
    blob = get_codec("xor_delta").encode(weights, weights.clone())
    assert len(blob) < weights.numel() * 4 / 100


def test_multi_chunk_big_tensors_round_trip_with_threads() -> None:
    weights = torch.randn(1_100_000) * 0.02  # just over one 4 MiB chunk of fp32
    moved = weights + 1e-4 * torch.randn_like(weights)
    for name in ("byteplane", "prefix_index"):
        assert_same(get_codec(name, threads=2).decode(get_codec(name).encode(moved)), moved)
    codec = get_codec("xor_delta", threads=2)
    assert_same(codec.decode(codec.encode(moved, weights), weights), moved)


def test_byteplane_codes_only_the_planes_that_pay() -> None:
    header = blob_info(get_codec("byteplane").encode(torch.randn(100_000) * 0.02))
    assert header.params["segments"] == [[0, 2, "raw"], [2, 1, "raw"], [3, 1, "zstd"]]
    header = blob_info(get_codec("byteplane").encode(torch.randint(0, 256, (50_000,))))
    modes = [mode for _, _, mode in header.params["segments"]]
    assert modes[0] == "raw" and set(modes[1:]) == {"zstd"}  # int64 high bytes are zeros


def test_expplane_codes_whole_exponents_and_keeps_byteplanes_layout_otherwise() -> None:
    torch.manual_seed(0)
    weights = torch.randn(100_000) * 0.02
    for dtype in (torch.float32, torch.bfloat16):
        tensor = weights.to(dtype)
        blob = get_codec("expplane").encode(tensor)
        assert blob_info(blob).params["rotated"] is True
        assert len(blob) < len(get_codec("byteplane").encode(tensor))  # the sign goes raw
        assert_same(decode_blob(blob), tensor)
    squares = (weights**2).to(torch.bfloat16)  # the sign bit never set: 7 noise bits below
    header = blob_info(get_codec("expplane").encode(squares))
    assert [mode for _, _, mode in header.params["segments"]] == ["zstd", "zstd"]
    noise = torch.from_numpy(np.random.default_rng(3).integers(0, 256, 200_000, np.uint8))
    for tensor in (torch.arange(50_000), noise.view(torch.float32)):  # integers; nothing pays
        header = blob_info(get_codec("expplane").encode(tensor))
        assert header.params["rotated"] is False
        plain = blob_info(get_codec("byteplane").encode(tensor))
        assert header.params["segments"] == plain.params["segments"]


def plane_data(rng: np.random.Generator, n: int, skewed: bool) -> np.ndarray:
    """One byte plane: few symbols with a skew (compresses ~3x) or uniform noise."""
    if skewed:
        return rng.choice(np.arange(4, dtype=np.uint8), n, p=[0.7, 0.1, 0.1, 0.1])
    return rng.integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32]
)
def test_every_plane_layout_round_trips(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """Each mix of coded and raw planes, in chunks, plain and as an XOR delta; the header codes
    exactly the skewed planes."""
    monkeypatch.setattr(byteplane, "CHUNK_BYTES", 4096)
    itemsize, n = dtype.itemsize, 20_000
    rng = np.random.default_rng(itemsize)
    masks = range(1 << itemsize) if itemsize <= 4 else [0, 0x80, 0xC0, 0x81, 0x55, 0xFF]
    for mask in masks:
        planes = [plane_data(rng, n, bool(mask >> p & 1)) for p in range(itemsize)]
        raw = np.stack(planes, axis=1).reshape(-1)
        tensor = torch.from_numpy(raw).view(dtype)
        base = torch.from_numpy(rng.integers(0, 256, n * itemsize, dtype=np.uint8)).view(dtype)
        moved = torch.from_numpy(raw ^ tensor_bytes(base)).view(dtype)
        for codec, value, against in (
            (get_codec("byteplane", threads=2), tensor, None),
            (get_codec("xor_delta", threads=2), moved, base),
        ):
            blob = codec.encode(value, against)
            coded = [lo for lo, _, mode in blob_info(blob).params["segments"] if mode == "zstd"]
            assert coded == [p for p in range(itemsize) if mask >> p & 1], (mask, codec)
            assert_same(codec.decode(blob, against), value)


def test_the_literals_profile_huffman_codes_and_matches_win_on_repeats() -> None:
    rng = np.random.default_rng(0)
    symbols = rng.integers(0, 8, 1 << 20, dtype=np.uint8)  # 3 bits of entropy per byte
    frame = literal_compressor().compress(symbols)
    assert len(symbols) / len(frame) > 2.5  # literal Huffman coding really is on
    back = np.empty_like(symbols)
    decompress_into(frame, back, "test")
    assert np.array_equal(back, symbols)
    counter = (np.arange(1 << 14) % 251).astype(np.uint8)  # repeats, but every byte as often
    sample = np.stack([counter, plane_data(rng, 1 << 14, True)], axis=1)
    plans = byteplane.plan_segments(sample, 1, byteplane.MIN_PLANE_RATIO)
    assert [(lo, mode, pick) for lo, _, mode, pick in plans] == [(0, "zstd", 1), (1, "zstd", 0)]


def test_a_plane_gets_the_coder_that_pays() -> None:
    pick = byteplane.pick_coder
    assert pick(1000, [900, 900], 1.2) is None  # neither shrinks it by 1.2x: raw
    assert pick(1000, [500, 450], 1.2) == 0  # literals pay; matches not 1.25x better
    assert pick(1000, [500, 300], 1.2) == 1  # matches 1.25x better
    assert pick(1000, [990, 800], 1.2) == 1  # only matches pay, though by less than 1.25x
    assert pick(1000, [700], 1.2) == 0 and pick(0, [], 1.2) is None


def test_min_plane_ratio_decides_which_planes_pay() -> None:
    rng = np.random.default_rng(1)
    n = 200_000
    top = plane_data(rng, n, True)
    weak = np.minimum(rng.integers(0, 256, n), rng.integers(0, 256, n)).astype(np.uint8)
    raw = np.stack([rng.integers(0, 256, n, dtype=np.uint8), weak, top, top], axis=1)
    tensor = torch.from_numpy(raw.reshape(-1)).view(torch.float32)
    for ratio, coded in ((1.2, [2, 3]), (1.02, [1, 2, 3])):
        blob = get_codec("byteplane", min_plane_ratio=ratio).encode(tensor)
        segments = blob_info(blob).params["segments"]
        assert [lo for lo, _, mode in segments if mode == "zstd"] == coded
        assert_same(decode_blob(blob), tensor)
    assert byteplane.paying_plane_ratio(10e9) == byteplane.MIN_PLANE_RATIO
    assert byteplane.paying_plane_ratio(1e3) == 1.01
    slow = byteplane.paying_plane_ratio(100e6)
    assert 1.01 < slow < byteplane.paying_plane_ratio(150e6) < byteplane.MIN_PLANE_RATIO
    for bad in (0.5, "1.2", float("inf"), True):
        with pytest.raises(CodecParamError, match="min_plane_ratio"):
            get_codec("xor_delta", min_plane_ratio=bad)


def test_prefix_index_falls_back_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    codec = get_codec("prefix_index")
    cases = {
        "not 16/32-bit": torch.randn(100, dtype=torch.float64),
        "does not pay": make_tensor(torch.float32, 1000, 1, "bits"),
    }
    for reason, tensor in cases.items():
        header = blob_info(codec.encode(tensor))
        assert header.params["mode"] == "byteplane" and reason in header.params["reason"]
    monkeypatch.setattr(prefix_index, "MAX_DISTINCT", 4)
    header = blob_info(codec.encode(torch.randn(1000) * 1e-3))
    assert "over 4 prefixes" in header.params["reason"]


def test_ratios_on_adam_like_moments() -> None:
    """Sanity only (no speed): coding pays on moments, entropy mode beats the fixed width."""
    torch.manual_seed(0)
    exp_avg = torch.randn(1 << 18) * 1e-3
    exp_avg_sq = torch.randn(1 << 18) ** 2 * 1e-6
    for moment in (exp_avg, exp_avg_sq):
        raw = moment.numel() * 4
        fixed = raw / len(get_codec("prefix_index", entropy=False).encode(moment))
        entropy = raw / len(get_codec("prefix_index").encode(moment))
        planes = raw / len(get_codec("byteplane").encode(moment))
        assert 1.05 < fixed < entropy and planes > 1.1
    assert get_codec("prefix_index").decode(get_codec("prefix_index").encode(exp_avg)).equal(
        exp_avg
    )


@pytest.mark.parametrize(("name", "params"), CODECS[:11], ids=str)
def test_every_single_bit_flip_and_truncation_is_caught(
    small_chunks: None, name: str, params: dict[str, object]
) -> None:
    tensor = make_tensor(torch.float32, 40, 3, "trained")
    tensor[::7] = float("nan")
    codec = get_codec(name, **params)
    blob = codec.encode(tensor)
    assert blob_info(blob).sections, "the payload is checksummed in sections"
    for position in range(len(blob)):
        for bit in range(8):
            damaged = bytearray(blob)
            damaged[position] ^= 1 << bit
            with pytest.raises(CheckpointFormatError):
                codec.decode(bytes(damaged))
    for cut in range(len(blob)):
        with pytest.raises(CheckpointFormatError):
            codec.decode(blob[:cut])
    with pytest.raises(CheckpointFormatError, match="trailing"):
        codec.decode(blob + b"\0")


def test_the_device_xor_path_gives_the_same_delta_as_the_fused_host_path() -> None:
    """No GPU here: run the torch XOR (used for non-CPU tensors) on CPU tensors instead."""
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.complex64):
        tensor = make_tensor(dtype, 999, 4, "bits")
        base = make_tensor(dtype, 999, 5, "bits")
        expected = np.bitwise_xor(tensor_bytes(tensor), tensor_bytes(base))
        assert np.array_equal(xor_delta._device_xor(tensor, base), expected)


def test_xor_delta_damage_and_wrong_base_are_caught() -> None:
    base = torch.randn(64) * 0.02
    tensor = base + 1e-4
    codec = get_codec("xor_delta")
    blob = codec.encode(tensor, base)
    for position in range(len(blob)):
        for bit in range(8):
            damaged = bytearray(blob)
            damaged[position] ^= 1 << bit
            with pytest.raises(CheckpointFormatError):
                codec.decode(bytes(damaged), base)
    with pytest.raises(CheckpointFormatError, match="different base"):
        codec.decode(blob, base + 1)


def test_xor_delta_base_errors_name_shapes_and_dtypes() -> None:
    codec = get_codec("xor_delta")
    tensor = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="needs base="):
        codec.encode(tensor)
    with pytest.raises(ValueError, match=r"shape \(4, 3\) and dtype torch.float32.*\(3, 4\)"):
        codec.encode(tensor, torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"dtype torch\.float16"):
        codec.encode(tensor, torch.zeros(3, 4, dtype=torch.float16))
    blob = codec.encode(tensor, tensor)
    with pytest.raises(ValueError, match="needs base="):
        codec.decode(blob)
    with pytest.raises(ValueError, match=r"\(2,\)"):
        codec.decode(blob, torch.zeros(2))


def test_a_blob_names_its_codec_and_other_codecs_refuse_it() -> None:
    blob = get_codec("byteplane").encode(torch.ones(5))
    header = blob_info(blob)
    assert (header.codec, header.dtype, header.shape, header.nbytes) == (
        "byteplane", torch.float32, (5,), 20
    )
    with pytest.raises(CheckpointFormatError, match="written by codec 'byteplane'"):
        get_codec("raw").decode(blob)
    with pytest.raises(CheckpointFormatError, match="not a ckptpilot codec blob"):
        get_codec("auto").decode(b"PK\x03\x04 something else")


def test_unknown_names_and_bad_params_are_value_errors_with_a_message() -> None:
    with pytest.raises(UnknownCodecError, match=r"'lz5'.*valid codecs: auto, byteplane") as err:
        get_codec("lz5")
    assert isinstance(err.value, ValueError)
    assert codec_names() == (
        "auto", "byteplane", "expplane", "prefix_index", "raw", "xor_delta", "zstd"
    )
    bad = [
        ("byteplane", {"lvl": 1}, "unknown parameter.*'lvl'.*valid parameters: level, threads"),
        ("raw", {"level": 1}, r"valid parameters: \(none\)"),
        ("zstd", {"level": 0}, r"level must be an integer in \[1, 22\], got 0"),
        ("zstd", {"level": "3"}, "got '3'"),
        ("byteplane", {"threads": -1}, "threads must be an integer >= 0"),
        ("xor_delta", {"level": True}, "level must be an integer"),
        ("prefix_index", {"prefix_bits": 32}, "prefix_bits"),
        ("prefix_index", {"entropy": 1}, "entropy must be true or false"),
        ("prefix_index", {"groups": 0}, "groups"),
        ("auto", {"bandwidth_bytes_per_s": 0}, "bandwidth_bytes_per_s must be a positive"),
        ("auto", {"bandwidth_bytes_per_s": float("inf")}, "must be finite"),
        ("auto", {"sample_bytes": 10}, "sample_bytes"),
    ]
    for name, params, message in bad:
        with pytest.raises(CodecParamError, match=message) as err:
            get_codec(name, **params)
        assert isinstance(err.value, ValueError) and err.value.args[0].startswith(name)


def test_config_rebuilds_an_equal_codec() -> None:
    for name, params in CODECS:
        config = get_codec(name, **params).config
        again = get_codec(config["id"], **{k: v for k, v in config.items() if k != "id"})
        assert again.config == config and repr(again).startswith(type(again).__name__)


def test_inputs_that_are_not_dense_tensors_are_refused() -> None:
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        get_codec("raw").encode([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layout"):
        get_codec("raw").encode(torch.eye(3).to_sparse())


def test_encoding_leaves_the_input_untouched() -> None:
    tensor = make_tensor(torch.float32, 5000, 9, "trained")
    before = tensor.clone()
    for name, params in CODECS:
        get_codec(name, **params).encode(tensor)
    assert torch.equal(bits(tensor), bits(before))


def test_codecs_are_safe_to_share_between_threads() -> None:
    codecs = [get_codec(name, threads=2) for name in ("byteplane", "prefix_index", "zstd")]
    inputs = [make_tensor(torch.float32, 20_000, seed, "trained") for seed in range(6)]
    failures: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for codec in codecs:
                for tensor in inputs[seed % 3 :: 2]:
                    assert_same(codec.decode(codec.encode(tensor)), tensor)
        except BaseException as exc:  # collected and re-raised on the test thread
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures


def test_auto_picks_raw_when_bandwidth_is_free_and_the_smallest_when_it_is_dear() -> None:
    counters = torch.arange(200_000)
    fast = get_codec("auto", bandwidth_bytes_per_s=1e15)
    slow = get_codec("auto", bandwidth_bytes_per_s=1e3)
    assert fast.choose(make_tensor(torch.float32, 200_000, 1, "bits"))[0].codec_id == "raw"
    assert slow.choose(counters)[0].codec_id != "raw"
    base = torch.randn(300_000) * 0.02
    assert slow.choose(base.clone(), base)[0].codec_id == "xor_delta"
    blob = slow.encode(counters)
    assert blob_info(blob).codec in codec_names() and len(blob) < counters.numel()
    assert_same(slow.decode(blob), counters)
