"""Fuzzing every parser of untrusted bytes: codec blobs of every codec (both blob versions),
containers, and peer frames (the parse path, and a live daemon's handlers).

Two kinds of damage: *random* (bit flips, truncation, extension, overwritten runs) and
*forged* (header fields or sections rewritten, then every checksum recomputed, so that the
structural checks behind the checksums are reached). The property: decoding returns the
exact original (bit-exact, via integer views) or raises ``CheckpointFormatError`` (frames:
``ProtocolError``); never any other exception, never a hang, never a huge allocation. A
forged blob carries no digest of its tensor, so it may also decode to *a* tensor: then one
of exactly the dtype and shape its header claims. Containers keep a SHA256 per tensor, so
forged ones still decode exactly or not at all.

The originals are the golden fixtures of ``test_codecs_golden.py`` (every codec and layout).
"""

from __future__ import annotations

import io
import json
import signal
import socket
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from test_codecs_golden import BLOB_VERSIONS, fixture, golden_cases, golden_container_state
from test_codecs_hostile import Blob, Container

from ckptpilot.codecs import codec_names, decode_blob, read_container
from ckptpilot.codecs.blob import DTYPES
from ckptpilot.errors import CheckpointFormatError
from ckptpilot.tiers.peer.auth import TAG_BYTES
from ckptpilot.tiers.peer.calls import call, connect
from ckptpilot.tiers.peer.daemon import PeerDaemon
from ckptpilot.tiers.peer.digest import digest_of
from ckptpilot.tiers.peer.errors import ProtocolError
from ckptpilot.tiers.peer.protocol import (
    PRELUDE,
    TRAILER_BYTES,
    Op,
    read_frame,
    send_frame,
    validate_header,
)

_T = TypeVar("_T")
MiB = 1 << 20
FRAME_LIMIT = MiB
KEY = b"fuzz-peer-secret" * 2
HANG_SECONDS = 60  # a safety net only: every case takes milliseconds
FUZZ = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ------------------------------------------------------------------------------ harness

@contextmanager
def no_hang() -> Iterator[None]:
    """Fail (instead of hanging the suite) if the block runs past ``HANG_SECONDS``."""
    def expired(signum: int, frame: object) -> None:
        raise AssertionError(f"decoding hung for over {HANG_SECONDS} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(HANG_SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def outcome(decode: Callable[[], _T], refused: type[Exception], budget: int) -> _T | None:
    """``decode()``, or None if it raised ``refused``; any other exception propagates. Fails
    if it allocated more than ``budget`` bytes at once (NumPy reports to tracemalloc)."""
    tracemalloc.start()
    try:
        with no_hang():
            try:
                result: _T | None = decode()
            except refused:
                result = None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= budget, f"allocated {peak} bytes, more than {budget}"
    return result


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def assert_exact(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(bits(got), bits(expected))


# ---------------------------------------------------------------------------- mutations

HOSTILE_TEXT = {"\x00huge": b"1" + b"0" * 5000, "\x00deep": b"[" * 50_000 + b"]" * 50_000}
"""Stand-ins for JSON that Python cannot dump: a number past its 4300-digit limit, nesting
past its recursion limit. :func:`dumps` writes them in."""

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.text(max_size=6) | st.sampled_from(list(HOSTILE_TEXT))
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, 1, -1, 2, 3, 7, 8, 16, 255, 256, 4096, 65536, 2**31, 2**40, 2**63]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                 max_size=3),
    max_leaves=8,
)


def length_near(n: int) -> st.SearchStrategy[int]:
    """A u64 length field for ``n`` bytes, off by a little or a lot."""
    return st.sampled_from([n, n + 1, max(n - 1, 0), 0, 2**63, 2**64 - 1]) | st.integers(
        0, 2**64 - 1)


def dumps(value: Any, **kw: Any) -> bytes:
    text = json.dumps(value, **kw).encode()
    for marker, raw in HOSTILE_TEXT.items():
        text = text.replace(json.dumps(marker).encode(), raw)
    return text


@st.composite
def damaged(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` with one to three random mutations: bit flips, a cut, an extension, a run of
    bytes overwritten, or a slice duplicated."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "cut", "extend", "overwrite", "duplicate"]))
        at = draw(st.integers(0, max(len(out) - 1, 0)))
        if kind == "flip" and out:
            out[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "cut":
            del out[at:]
        elif kind == "extend":
            out += draw(st.binary(min_size=1, max_size=16))
        elif kind == "overwrite":
            run = draw(st.binary(min_size=1, max_size=8))
            out[at : at + len(run)] = run
        else:
            out[at:at] = out[at : at + draw(st.integers(1, 32))]
    return bytes(out)


@st.composite
def rewritten(draw: st.DrawFn, value: Any) -> Any:
    """A plausible or a hostile replacement for a header value."""
    if isinstance(value, int) and not isinstance(value, bool) and draw(st.booleans()):
        return draw(st.sampled_from([value + 1, value - 1, value * 2, value // 2, 0,
                                     value * 4096, -value, 2**48, 2**64]))
    if isinstance(value, list) and value and draw(st.booleans()):
        items = list(value)
        i = draw(st.integers(0, len(items) - 1))
        items[i] = draw(rewritten(items[i]))
        return draw(st.sampled_from([items, items + items[:1], items[1:]]))
    return draw(JSON_VALUES)


@st.composite
def forged_blob(draw: st.DrawFn, blob: bytes) -> bytes:
    """``blob`` with header fields or sections rewritten and every checksum recomputed."""
    parts = Blob.parse(blob)
    header, sections = parts.header, parts.sections
    for _ in range(draw(st.integers(1, 3))):  # "lengths" acts last: sections may change
        kind = draw(st.sampled_from(["shape", "dtype", "codec", "param", "section",
                                     "sections", "lengths"]))
        if kind == "shape":
            header["shape"] = draw(rewritten(header["shape"]))
            if draw(st.booleans()):  # keep nbytes consistent so the codec is reached
                try:
                    numel = 1
                    for d in header["shape"]:
                        numel *= int(d)
                    header["nbytes"] = numel * DTYPES[header["dtype"]].itemsize
                except (TypeError, ValueError, KeyError, OverflowError):
                    pass
        elif kind == "dtype":
            header["dtype"] = draw(st.sampled_from([*DTYPES, "float99"]) | JSON_VALUES)
        elif kind == "codec":
            header["codec"] = draw(st.sampled_from([*codec_names(), "lz5"]) | JSON_VALUES)
        elif kind == "param":
            params = header["params"]
            key = draw(st.sampled_from([*params, "extra"]))
            if key in params and draw(st.integers(0, 3)) == 0:
                del params[key]
            else:
                params[key] = draw(rewritten(params.get(key)))
        elif kind == "section" and sections:
            i = draw(st.integers(0, len(sections) - 1))
            sections[i] = draw(damaged(sections[i]))
        elif kind == "sections" and sections:
            i = draw(st.integers(0, len(sections) - 1))
            change = draw(st.sampled_from(["drop", "duplicate", "swap"]))
            if change == "drop":
                del sections[i]
            elif change == "duplicate":
                sections.insert(i, sections[i])
            else:
                j = draw(st.integers(0, len(sections) - 1))
                sections[i], sections[j] = sections[j], sections[i]
        elif kind == "lengths":
            parts.lengths = []
    if parts.lengths is not None:
        parts.lengths = [draw(length_near(len(section))) for section in sections]
    parts.header_text = dumps(header, sort_keys=True, separators=(",", ":"))
    return parts.build()


# --------------------------------------------------------------------------------- blobs

@dataclass(frozen=True)
class BlobCase:
    name: str
    blob: bytes
    tensor: torch.Tensor
    base: torch.Tensor

    @property
    def budget(self) -> int:
        """What an honest decode may allocate at once: the tensor and its scratch, a few
        times over, and NumPy's and the codecs' small change."""
        return 8 * (len(self.blob) + self.tensor.numel() * self.tensor.element_size()) + MiB


def blob_cases() -> list[BlobCase]:
    cases = []
    for name, (_, tensor, base) in sorted(golden_cases().items()):
        for version in BLOB_VERSIONS:
            blob = fixture(name, version, ".blob").read_bytes()
            # Every blob is decoded with a base, so that a blob forged to be a delta reaches
            # the delta's checks instead of "needs base=" (a caller's mistake, not the blob's).
            cases.append(BlobCase(f"{name}.v{version}", blob, tensor,
                                  torch.zeros_like(tensor) if base is None else base))
    return cases


BLOBS = {case.name: case for case in blob_cases()}


def decode(case: BlobCase, blob: bytes) -> torch.Tensor | None:
    return outcome(lambda: decode_blob(blob, case.base, threads=1), CheckpointFormatError,
                   case.budget)


@FUZZ
@given(data=st.data())
def test_damaged_blobs_decode_exactly_or_raise_format_errors(data: st.DataObject) -> None:
    case = BLOBS[data.draw(st.sampled_from(sorted(BLOBS)), label="case")]
    got = decode(case, data.draw(damaged(case.blob), label="blob"))
    if got is not None:
        assert_exact(got, case.tensor)


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_forged_blobs_decode_to_what_they_claim_or_raise_format_errors(
    data: st.DataObject
) -> None:
    case = BLOBS[data.draw(st.sampled_from(sorted(BLOBS)), label="case")]
    blob = data.draw(forged_blob(case.blob), label="blob")
    got = decode(case, blob)
    if got is not None:
        claimed = Blob.parse(blob).header
        assert got.dtype == DTYPES[claimed["dtype"]]
        assert list(got.shape) == claimed["shape"] and got.is_contiguous()


def test_the_fuzzed_blobs_cover_every_codec_and_both_versions() -> None:
    blobs = [Blob.parse(case.blob) for case in BLOBS.values()]
    assert {blob.header["codec"] for blob in blobs} == set(codec_names()) - {"auto"}
    assert {blob.version for blob in blobs} == set(BLOB_VERSIONS)


# ---------------------------------------------------------------------------- containers

STATE, BASES = golden_container_state()
CONTAINERS = [fixture("container", version, ".ckpc").read_bytes() for version in BLOB_VERSIONS]
CONTAINER_BUDGET = 16 * max(map(len, CONTAINERS)) + 4 * MiB


def read(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    return outcome(lambda: read_container(io.BytesIO(data), BASES, threads=1),
                   CheckpointFormatError, CONTAINER_BUDGET)


def assert_whole_state(got: tuple[dict[str, torch.Tensor], dict[str, Any]] | None) -> None:
    if got is None:
        return
    tensors, meta = got
    assert list(tensors) == list(STATE)
    for name, tensor in STATE.items():
        assert_exact(tensors[name], tensor)
    assert meta == json.loads(json.dumps(meta)) and meta["step"] == 42


@st.composite
def forged_container(draw: st.DrawFn, data: bytes) -> bytes:
    """Index fields rewritten (names kept), or one blob forged in place; the offsets, the
    index's crc32 and the trailer are recomputed (the tensors' SHA256s are not)."""
    forged = Container.parse(data)
    entries = forged.index["tensors"]
    i = draw(st.integers(0, len(entries) - 1))
    if draw(st.booleans()):
        target = draw(st.sampled_from([entries[i], forged.index["meta"], forged.index]))
        key = draw(st.sampled_from(sorted(k for k in target if k not in ("name", "tensors"))))
        target[key] = draw(rewritten(target[key]))
        forged.index_text = dumps(forged.index)
        return forged.build()
    start, size = entries[i]["offset"], entries[i]["encoded_bytes"]
    blob = draw(forged_blob(forged.body[start : start + size]))
    forged.body = forged.body[:start] + blob + forged.body[start + size :]
    shift = len(blob) - size
    entries[i]["encoded_bytes"] = len(blob)
    for entry in entries[i + 1 :]:
        entry["offset"] += shift
    forged.index["meta"]["offset"] += shift
    return forged.build()


@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_damaged_containers_read_exactly_or_raise_format_errors(data: st.DataObject) -> None:
    original = data.draw(st.sampled_from(CONTAINERS), label="container")
    assert_whole_state(read(data.draw(damaged(original), label="damaged")))


@settings(FUZZ, max_examples=80)
@given(data=st.data())
def test_forged_containers_read_exactly_or_raise_format_errors(data: st.DataObject) -> None:
    original = data.draw(st.sampled_from(CONTAINERS), label="container")
    assert_whole_state(read(data.draw(forged_container(original), label="forged")))


# -------------------------------------------------------------------------------- frames

def _frame(op: Op, header: dict[str, Any], meta: bytes = b"", body: bytes = b"") -> bytes:
    """The bytes ``send_frame`` puts on the wire (a PUT's digest trailer included)."""
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, op, header, [meta, body])
        a.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := b.recv(1 << 16):
            chunks.append(chunk)
    return b"".join(chunks)


def _shard_header(op: Op, body: bytes, meta: bytes, delta: bytes = b"") -> dict[str, Any]:
    header = {"run_id": "fuzz", "ckpt_id": 2, "shard_index": 0, "shard_count": 1,
              "data_shards": 1, "kind": "data", "image_len": len(body),
              "shard_size": len(body), "meta_len": len(meta), "meta_digest": digest_of(meta),
              "lease_seconds": 30.0}
    if op is Op.DELTA:
        header.update(base_id=1, digest=digest_of(body), delta_digest=digest_of(delta),
                      encoding="xor_delta")
    return header


BODY, META, DELTA = bytes(range(64)), b'{"step": 2}', b"not a real delta"
FRAMES = [
    _frame(Op.PUT, _shard_header(Op.PUT, BODY, META), META, BODY),
    _frame(Op.DELTA, _shard_header(Op.DELTA, BODY, META, DELTA), META, DELTA),
    _frame(Op.COMMIT, {"run_id": "fuzz", "ckpt_id": 2, "lease_seconds": 30.0,
                       "stripe": [digest_of(BODY)]}),
    _frame(Op.GET, {"run_id": "fuzz", "ckpt_id": 1, "shard_index": 0}),
    _frame(Op.LIST, {"run_id": "fuzz"}),
    _frame(Op.PING, {}),
    _frame(Op.RENEW, {"run_id": "fuzz", "lease_seconds": 30.0}),
    _frame(Op.OK, {"ckpt_id": 1, "meta_len": len(META), "shards": []}, META, BODY),
    _frame(Op.ERR, {"error": "no base", "code": "no_base"}),
]


@st.composite
def forged_frame(draw: st.DrawFn, frame: bytes) -> bytes:
    """A frame with header fields rewritten and its prelude's lengths recomputed (or, now
    and then, rewritten too)."""
    _, version, op, header_len, _ = PRELUDE.unpack_from(frame)
    header = json.loads(frame[PRELUDE.size : PRELUDE.size + header_len])
    tag = frame[PRELUDE.size + header_len : PRELUDE.size + header_len + TAG_BYTES]
    payload = frame[PRELUDE.size + header_len + TAG_BYTES :]
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from([*header, "extra"]))
        header[key] = draw(rewritten(header.get(key)))
    if draw(st.integers(0, 4)) == 0:
        payload = draw(damaged(payload)) if payload else payload
    text = dumps(header)
    declared = len(payload) if draw(st.integers(0, 4)) else draw(length_near(len(payload)))
    op = op if draw(st.integers(0, 6)) else draw(st.integers(0, 255))
    return PRELUDE.pack(b"CKPP", version, op, len(text), declared) + text + tag + payload


def parse_all(data: bytes) -> list[Any]:
    """Every frame a reader gets from ``data`` until the stream ends or a frame is refused
    (then a ``ProtocolError`` ends the list)."""
    a, b = socket.socketpair()
    b.settimeout(HANG_SECONDS)

    def send() -> None:
        try:
            a.sendall(data)
            a.shutdown(socket.SHUT_WR)
        except OSError:  # the reader refused a frame and closed
            pass

    sender = threading.Thread(target=send)
    sender.start()
    frames: list[Any] = []
    try:
        while True:
            frame = outcome(lambda: read_frame(b, max_payload=FRAME_LIMIT), ProtocolError,
                            FRAME_LIMIT + 8 * len(data) + MiB)
            if frame is None:
                break
            frames.append(frame)
    finally:
        b.close()
        sender.join()
        a.close()
    return frames


def assert_frames_valid(frames: list[Any]) -> None:
    for frame in frames:
        trailer = TRAILER_BYTES if frame.trailer_digest is not None else 0  # a PUT's digest
        payload = len(frame.meta) + len(frame.payload) + trailer
        assert validate_header(frame.op, frame.header, payload) is frame.header


@settings(FUZZ, max_examples=100)
@given(data=st.data())
def test_damaged_frames_parse_whole_or_raise_protocol_errors(data: st.DataObject) -> None:
    assert_frames_valid(parse_all(data.draw(damaged(data.draw(st.sampled_from(FRAMES))))))


@settings(FUZZ, max_examples=100)
@given(data=st.data())
def test_forged_frames_parse_whole_or_raise_protocol_errors(data: st.DataObject) -> None:
    assert_frames_valid(parse_all(data.draw(forged_frame(data.draw(st.sampled_from(FRAMES))))))


@pytest.fixture(scope="module")
def daemon() -> Iterator[PeerDaemon]:
    """A daemon in this process, holding shard 0 of checkpoint 1 (the fuzzed DELTA's base)."""
    served = PeerDaemon("127.0.0.1", 0, key=KEY, mem_limit=4 * MiB, frame_timeout_seconds=10)
    thread = threading.Thread(target=served.serve_forever)
    thread.start()
    try:
        endpoint = f"127.0.0.1:{served.address[1]}"
        base = bytes(64)
        header = {**_shard_header(Op.PUT, base, META), "ckpt_id": 1}
        call(endpoint, Op.PUT, header, [META, base], key=KEY, timeout_seconds=10)
        yield served
    finally:
        served.shutdown()
        thread.join()


def replies(endpoint: tuple[str, int], data: bytes) -> list[Any]:
    """The daemon's replies to ``data`` sent on one connection past its handshake (the
    fuzzed frames' tags are not the session's: each is refused, by its form or its tag),
    until it closes."""
    with connect(f"{endpoint[0]}:{endpoint[1]}", KEY, HANG_SECONDS).sock as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # it refused a frame and closed before taking everything
            pass
        got = []
        while True:
            try:
                reply = read_frame(sock, max_payload=FRAME_LIMIT)
            except ConnectionResetError:
                break
            if reply is None:
                break
            got.append(reply)
        return got


@settings(FUZZ, max_examples=60, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_daemon_answers_every_fuzzed_frame_with_ok_or_err_and_keeps_serving(
    daemon: PeerDaemon, data: st.DataObject
) -> None:
    frame = data.draw(st.sampled_from(FRAMES))
    mutated = data.draw(damaged(frame) if data.draw(st.booleans()) else forged_frame(frame))
    answers = replies(daemon.address, mutated)
    assert answers or not mutated, "the daemon closed without a reply"
    for reply in answers:
        assert reply.op in (Op.OK, Op.ERR)
        assert reply.op is Op.OK or reply.header["code"] != "internal_error", reply.header
    pong = call(f"127.0.0.1:{daemon.address[1]}", Op.PING, {}, key=KEY, timeout_seconds=10)
    assert pong.op is Op.OK
