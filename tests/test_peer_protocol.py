"""Peer wire frames (SPEC §6): round trips, and every kind of malformed frame is refused."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import pytest

from ckptpilot.errors import CkptPilotError
from ckptpilot.tiers.peer.auth import NO_TAG, Session, hello_tag, new_nonce
from ckptpilot.tiers.peer.calls import Connections
from ckptpilot.tiers.peer.digest import digest_of
from ckptpilot.tiers.peer.errors import PeerRequestError, ProtocolError
from ckptpilot.tiers.peer.protocol import (
    MAGIC,
    MAX_HEADER_BYTES,
    PRELUDE,
    TRAILER_BYTES,
    VERSION,
    Body,
    Op,
    encode_head,
    parse_endpoint,
    read_frame,
    read_head,
    read_payload,
    send_error,
    send_frame,
    validate_header,
)

LIMIT = 1 << 20
KEY = b"k" * 32


def greet(conn: socket.socket) -> Session:
    """The daemon's side of the handshake (``auth``) on an accepted connection."""
    nonce = new_nonce()
    send_frame(conn, Op.HELLO, {"nonce": nonce}, tag=lambda raw: hello_tag(KEY, raw))
    head = read_head(conn, max_payload=0)
    assert head is not None and head.op is Op.HELLO
    return Session(KEY, nonce, head.header["nonce"], daemon=True)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    yield a, b
    a.close()
    b.close()


def shard_header(op: Op = Op.PUT, *, meta: bytes = b"{}", size: int = 16) -> dict[str, object]:
    header: dict[str, object] = {
        "run_id": "run", "ckpt_id": 7, "shard_index": 0, "shard_count": 2, "data_shards": 1,
        "kind": "data", "image_len": size, "shard_size": size, "meta_len": len(meta),
        "meta_digest": digest_of(meta), "lease_seconds": 5.0,
    }
    if op is Op.DELTA:
        header["base_id"] = 6
        header["digest"] = digest_of(bytes(range(size)))
        header["delta_digest"] = digest_of(b"delta")
        header["encoding"] = "xor_delta"
    return header


def raw_frame(op: int, header: bytes, payload: bytes = b"", *, magic: bytes = MAGIC,
              version: int = VERSION, payload_len: int | None = None) -> bytes:
    size = len(payload) if payload_len is None else payload_len
    return PRELUDE.pack(magic, version, op, len(header), size) + header + NO_TAG + payload


def test_put_frame_round_trip_splits_meta_and_shard(pair: tuple[socket.socket, socket.socket]
                                                    ) -> None:
    a, b = pair
    meta, body = b'{"step": 7}', bytes(range(16))
    header = shard_header(meta=meta)
    sent = send_frame(a, Op.PUT, header, [meta, memoryview(body)])
    assert sent == len(meta) + len(body) + TRAILER_BYTES
    frame = read_frame(b, max_payload=LIMIT)
    assert frame is not None
    assert frame.op is Op.PUT and frame.header == header
    assert frame.meta == meta and bytes(frame.payload) == body
    assert frame.payload_digest == frame.trailer_digest == digest_of(body)


def test_a_put_streams_its_body_and_sends_the_digest_after_it(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """A Body's pieces are produced while the frame is sent (the parity is XORed that way);
    its digest is known once sent, and a Body that produces fewer bytes breaks the frame."""
    a, b = pair
    meta, body = b"{}", bytes(range(16))
    streamed = Body(16, lambda: (body[:5], memoryview(body)[5:]))
    send_frame(a, Op.PUT, shard_header(meta=meta), [meta, streamed])
    frame = read_frame(b, max_payload=LIMIT)
    assert frame is not None and bytes(frame.payload) == body
    assert streamed.digest == frame.trailer_digest == digest_of(body)
    short = Body(16, lambda: (body[:15],))
    with pytest.raises(ProtocolError, match="body produced 15 bytes, announced 16"):
        send_frame(a, Op.PUT, shard_header(meta=meta), [meta, short])
    with pytest.raises(ProtocolError, match="only a PUT's shard may be sent as a Body"):
        send_frame(a, Op.LIST, {"run_id": "r"}, [Body(1, lambda: (b"x",))])


def test_a_body_is_received_into_the_readers_buffers(pair: tuple[socket.socket, socket.socket]
                                                     ) -> None:
    a, b = pair
    meta, body = b'{"step": 7}', bytes(range(16))
    send_frame(a, Op.PUT, shard_header(meta=meta), [meta, body])
    head = read_head(b, max_payload=LIMIT)
    assert head is not None
    first, second = bytearray(10), bytearray(6)
    frame = read_payload(b, head, [memoryview(first), memoryview(second)])
    assert bytes(first + second) == body and frame.payload.size == 0
    assert frame.meta == meta and frame.payload_digest == digest_of(body)


def test_buffers_of_another_size_than_the_body_are_refused(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    meta, body = b"{}", bytes(range(16))
    send_frame(a, Op.PUT, shard_header(meta=meta), [meta, body])
    head = read_head(b, max_payload=LIMIT)
    assert head is not None
    with pytest.raises(ProtocolError, match="PUT carries 16 bytes after its meta, the reader "
                                            "expected 15"):
        read_payload(b, head, [memoryview(bytearray(15))])


@pytest.mark.parametrize(("op", "header"), [
    (Op.PING, {}),
    (Op.LIST, {"run_id": "r"}),
    (Op.GET, {"run_id": "r", "ckpt_id": 3, "shard_index": 1}),
    (Op.COMMIT, {"run_id": "r", "ckpt_id": 3, "lease_seconds": 1, "stripe": ["0" * 32]}),
    (Op.RENEW, {"run_id": "r", "lease_seconds": 0.5}),
    (Op.DROP, {"run_id": "r"}),
    (Op.CORRUPT, {"run_id": "r", "ckpt_id": 0, "shard_index": 0}),
    (Op.ERR, {"error": "no base", "code": "no_base"}),
    (Op.OK, {"mem_used": 1, "shards": [{"ckpt_id": 1}]}),
])
def test_small_frames_round_trip(pair: tuple[socket.socket, socket.socket], op: Op,
                                 header: dict[str, object]) -> None:
    a, b = pair
    send_frame(a, op, header)
    frame = read_frame(b, max_payload=LIMIT)
    assert frame is not None and frame.op is op and frame.header == header
    assert frame.meta == b"" and frame.payload.size == 0 and frame.payload_digest is None


def test_several_frames_on_one_connection_then_clean_close(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    meta = b"m" * 100
    send_frame(a, Op.DELTA, shard_header(Op.DELTA, meta=meta), [meta, b"delta"])
    send_frame(a, Op.PING, {})
    a.shutdown(socket.SHUT_WR)
    first, second = read_frame(b, max_payload=LIMIT), read_frame(b, max_payload=LIMIT)
    assert first is not None and first.op is Op.DELTA and bytes(first.payload) == b"delta"
    assert second is not None and second.op is Op.PING
    assert read_frame(b, max_payload=LIMIT) is None


def test_protocol_error_is_a_ckptpilot_error() -> None:
    assert issubclass(ProtocolError, CkptPilotError)


PING_HEADER = b"{}"


@pytest.mark.parametrize(("data", "match"), [
    (raw_frame(Op.PING, PING_HEADER, magic=b"HTTP"), "bad magic"),
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad magic"),
    (raw_frame(Op.PING, PING_HEADER, version=VERSION + 1), "unsupported protocol version"),
    (raw_frame(77, PING_HEADER), "unknown op code 77"),
    (PRELUDE.pack(MAGIC, VERSION, Op.PING, MAX_HEADER_BYTES + 1, 0), "header of 65537 bytes"),
    (raw_frame(Op.PUT, b"{}", payload_len=LIMIT + 1), "exceeds this side's limit"),
    (raw_frame(Op.PING, b"{not json"), "not valid UTF-8 JSON"),
    (raw_frame(Op.PING, b"\xff\xfe"), "not valid UTF-8 JSON"),
    (raw_frame(Op.PING, b"[1, 2]"), "must be a JSON object"),
    (raw_frame(Op.PING, b"[" * 60_000), "not valid UTF-8 JSON"),
    (raw_frame(Op.LIST, b'{"run_id": 1' + b"0" * 5000 + b"}"), "not valid UTF-8 JSON.*digits"),
    (raw_frame(Op.GET, b'{"run_id": "r", "ckpt_id": 9223372036854775808, "shard_index": 0}'),
     "field 'ckpt_id' is invalid"),
    (raw_frame(Op.GET, b'{"run_id": "r", "ckpt_id": 1}'), "missing field 'shard_index'"),
    (raw_frame(Op.GET, b'{"run_id": "r", "ckpt_id": "1", "shard_index": 0}'),
     "field 'ckpt_id' is invalid"),
    (raw_frame(Op.GET, b'{"run_id": "r", "ckpt_id": true, "shard_index": 0}'),
     "field 'ckpt_id' is invalid"),
    (raw_frame(Op.RENEW, b'{"run_id": "r", "lease_seconds": -1}'),
     "field 'lease_seconds' is invalid"),
    (raw_frame(Op.RENEW, b'{"run_id": "r", "lease_seconds": 1' + b"0" * 400 + b"}"),
     "field 'lease_seconds' is invalid"),
    (raw_frame(Op.ERR, b'{"error": "x"}'), "missing field 'code'"),
    (raw_frame(Op.PING, PING_HEADER)[:7], "truncated frame.*prelude"),
    (raw_frame(Op.LIST, b'{"run_id": "r"}')[:-3 - len(NO_TAG)], "truncated frame.*header"),
])
def test_malformed_frames_raise_protocol_error(pair: tuple[socket.socket, socket.socket],
                                               data: bytes, match: str) -> None:
    a, b = pair
    a.sendall(data)
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ProtocolError, match=match):
        read_head(b, max_payload=LIMIT)


def test_truncated_payload_raises(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    meta = b"{}"
    head = encode_head(Op.PUT, shard_header(meta=meta), len(meta) + 16 + TRAILER_BYTES)
    a.sendall(head + NO_TAG + meta + bytes(10))
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ProtocolError, match=r"truncated frame.* 10 of 16 bytes of the PUT"):
        read_frame(b, max_payload=LIMIT)


def test_oversized_payload_is_refused_before_anything_is_allocated(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    header = json.dumps(shard_header()).encode()
    a.sendall(raw_frame(Op.PUT, header, payload_len=1 << 50))
    with pytest.raises(ProtocolError, match=r"payload of 1125899906842624 bytes exceeds"):
        read_head(b, max_payload=LIMIT)


@pytest.mark.parametrize(("change", "match"), [
    ({"kind": "delta"}, "field 'kind' is invalid"),
    ({"shard_index": 2}, "shard_index 2 is out of range"),
    ({"shard_count": 3}, "shard_count 3 must be data_shards"),
    ({"kind": "parity"}, "cannot be of kind 'parity'"),
    ({"shard_size": 12}, "shard_size 12 must be a multiple of 8"),
    ({"shard_size": 24}, "PUT payload is 66 bytes, header says meta_len 2 \\+ shard_size 24 "
                         "\\+ a 48-byte digest \\+ tag trailer"),
    ({"meta_len": 3}, "PUT payload is 66 bytes"),
    ({"meta_digest": "XYZ"}, "field 'meta_digest' is invalid"),
    ({"meta_digest": "ab" * 32}, "field 'meta_digest' is invalid"),  # a SHA256 is no XXH3-128
    ({"run_id": ""}, "field 'run_id' is invalid"),
])
def test_inconsistent_shard_headers_are_refused(change: dict[str, object], match: str) -> None:
    header = {**shard_header(), **change}
    with pytest.raises(ProtocolError, match=match):
        validate_header(Op.PUT, header, 2 + 16 + TRAILER_BYTES)


def test_delta_must_carry_a_delta_after_the_meta() -> None:
    with pytest.raises(ProtocolError, match="holds no delta"):
        validate_header(Op.DELTA, shard_header(Op.DELTA), 2)
    with pytest.raises(ProtocolError, match="missing field 'base_id'"):
        validate_header(Op.DELTA, shard_header(Op.PUT), 100)
    for field in ("digest", "delta_digest"):
        header = shard_header(Op.DELTA)
        del header[field]
        with pytest.raises(ProtocolError, match=f"missing field '{field}'"):
            validate_header(Op.DELTA, header, 100)


@pytest.mark.parametrize(("change", "body", "match"), [
    ({"encoding": "zip"}, 100, "field 'encoding' is invalid"),
    ({"encoding": "blocks"}, 100, "block_bytes must be a power of two"),
    ({"encoding": "blocks", "block_bytes": 3 << 12}, 100, "block_bytes must be a power of two"),
    ({"encoding": "blocks", "block_bytes": 1 << 10}, 100, "block_bytes must be a power of two"),
    ({"encoding": "blocks", "block_bytes": 4096, "shard_size": 65536}, 1,
     "DELTA of 1 bytes after the meta cannot be a bitmap of 2 bytes"),
    ({"encoding": "blocks", "block_bytes": 4096, "shard_size": 65536}, 65536 + 3,
     "and at most shard_size 65536 bytes of changed blocks"),
])
def test_a_delta_declares_an_encoding_that_fits_its_size(change: dict[str, object], body: int,
                                                         match: str) -> None:
    header = {**shard_header(Op.DELTA), **change}
    with pytest.raises(ProtocolError, match=match):
        validate_header(Op.DELTA, header, 2 + body)
    if "block_bytes" in change and "shard_size" in change:
        validate_header(Op.DELTA, header, 2 + 2 + 4096)  # the bitmap and one block


def test_a_commit_carries_the_stripe_of_digests() -> None:
    with pytest.raises(ProtocolError, match="missing field 'stripe'"):
        validate_header(Op.COMMIT, {"run_id": "r", "ckpt_id": 1, "lease_seconds": 1}, 0)
    with pytest.raises(ProtocolError, match="field 'stripe' is invalid"):
        validate_header(Op.COMMIT, {"run_id": "r", "ckpt_id": 1, "lease_seconds": 1,
                                    "stripe": ["0" * 64]}, 0)


def test_writer_refuses_to_send_an_invalid_header(pair: tuple[socket.socket, socket.socket]
                                                  ) -> None:
    with pytest.raises(ProtocolError, match="missing field 'run_id'"):
        send_frame(pair[0], Op.LIST, {})
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        encode_head(Op.PING, {"pad": "x" * MAX_HEADER_BYTES}, 0)


def test_an_error_quoting_a_huge_field_still_fits_in_a_reply(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """Escaped as JSON, 6000 emoji take 72 KB: more than a header may hold."""
    with pytest.raises(ProtocolError, match="field 'run_id' is invalid") as err:
        validate_header(Op.LIST, {"run_id": "\U0001F600" * 6000}, 0)
    assert len(str(err.value)) < 300
    a, b = pair
    send_error(a, "bad_request", "\U0001F600" * 6000)
    reply = read_frame(b, max_payload=LIMIT)
    assert reply is not None and reply.op is Op.ERR
    assert reply.header["error"] == "\U0001F600" * 4096 + "... (cut)"


# ---------------------------------------------------------------- persistent connections

class ScriptedPeer:
    """A real TCP server on 127.0.0.1 that plays a script: per connection it accepts, a list
    of actions for the requests on it, "ok" (reply OK) or "drop" (read the request, then
    close without replying, as a daemon that stops or dies does). ``received`` lists the ops
    each connection carried; each is recorded before the client can see the reaction."""

    def __init__(self, script: list[list[str]]) -> None:
        self.script = script
        self.received: list[list[Op]] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(10)
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve)
        self.thread.start()

    def _serve(self) -> None:
        for actions in self.script:
            conn, _ = self.listener.accept()
            ops: list[Op] = []
            self.received.append(ops)
            with conn:
                conn.settimeout(10)
                session = greet(conn)
                for action in actions:
                    frame = read_frame(conn, max_payload=LIMIT)
                    if frame is None:
                        break
                    session.verify(frame.head.signed, frame.head.tag, "request")
                    ops.append(frame.op)
                    if action == "drop":
                        break
                    send_frame(conn, Op.OK, {}, session=session)

    def close(self) -> None:
        self.thread.join(10)
        self.listener.close()


def test_a_request_that_meets_a_dead_pooled_connection_is_resent_once_if_safe() -> None:
    peer = ScriptedPeer([["ok", "drop"], ["ok"]])
    connections = Connections(key=KEY)
    try:
        connections.call(peer.endpoint, Op.PING, {}, timeout_seconds=10)
        reply = connections.call(peer.endpoint, Op.LIST, {"run_id": "r"}, timeout_seconds=10)
        assert reply.op is Op.OK
    finally:
        connections.close()
        peer.close()
    assert peer.received == [[Op.PING, Op.LIST], [Op.LIST]]


def test_a_put_that_meets_a_dead_pooled_connection_is_not_resent() -> None:
    peer = ScriptedPeer([["ok", "drop"], ["ok"]])
    connections = Connections(key=KEY)
    meta, body = b"{}", bytes(range(16))
    try:
        connections.call(peer.endpoint, Op.PING, {}, timeout_seconds=10)
        with pytest.raises(ProtocolError, match="closed the connection without replying to PUT"):
            connections.call(peer.endpoint, Op.PUT, shard_header(meta=meta), [meta, body],
                             timeout_seconds=10)
        connections.call(peer.endpoint, Op.PING, {}, timeout_seconds=10)
    finally:
        connections.close()
        peer.close()
    assert peer.received == [[Op.PING, Op.PUT], [Op.PING]]


def test_connections_are_reused_after_ok_and_after_a_fair_err() -> None:
    """An ERR the daemon answers in step (not_found) keeps the connection; one it closes the
    connection after (bad_request) does not."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
    accepted: list[int] = []

    def serve() -> None:  # keeps the first connection open after bad_request
        for replies in (["ok", "not_found", "ok", "bad_request", "ok"], ["ok"]):
            conn, _ = listener.accept()
            accepted.append(1)
            with conn:
                session = greet(conn)
                for reply in replies:
                    frame = read_frame(conn, max_payload=LIMIT)
                    if frame is None:
                        break
                    session.verify(frame.head.signed, frame.head.tag, "request")
                    if reply == "ok":
                        send_frame(conn, Op.OK, {}, session=session)
                    else:
                        send_error(conn, reply, f"{reply} here", session)

    thread = threading.Thread(target=serve)
    thread.start()
    connections = Connections(key=KEY)
    try:
        connections.call(endpoint, Op.PING, {}, timeout_seconds=10)
        with pytest.raises(PeerRequestError, match="not_found here"):
            connections.call(endpoint, Op.GET, {"run_id": "r", "ckpt_id": 1, "shard_index": 0},
                             timeout_seconds=10)
        connections.call(endpoint, Op.PING, {}, timeout_seconds=10)
        with pytest.raises(PeerRequestError, match="bad_request here"):
            connections.call(endpoint, Op.PING, {}, timeout_seconds=10)
        assert len(accepted) == 1
        connections.call(endpoint, Op.PING, {}, timeout_seconds=10)
        assert len(accepted) == 2
    finally:
        connections.close()
        thread.join(10)
        listener.close()


@pytest.mark.parametrize(("text", "expected"), [
    ("127.0.0.1:7000", ("127.0.0.1", 7000)),
    ("node-2:1", ("node-2", 1)),
    ("[::1]:65535", ("::1", 65535)),
])
def test_parse_endpoint(text: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize("text", ["127.0.0.1", "host:0", "host:70000", "a b:1", ""])
def test_parse_endpoint_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        parse_endpoint(text)
