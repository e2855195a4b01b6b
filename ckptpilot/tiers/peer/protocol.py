"""The peer wire protocol: length-prefixed binary frames over TCP (SPEC §6).

Owns: the frame layout, the op codes, the header fields each op requires, and reading and
writing frames on a socket (requests and replies over connections are ``calls``'). Must not:
interpret shards, carry state from one frame to the next (the tags that bind frames to their
connection are ``auth``'s), or know the daemon's or the client's policy.

A frame is a fixed little-endian prelude, a UTF-8 JSON object header, the frame's HMAC tag
(see ``auth``) and a binary payload::

    magic b"CKPP" | version u16 | op u8 | header length u32 | payload length u64
    header (JSON object, <= 64 KiB) | tag (32 bytes) | payload

A connection opens with the HELLO handshake of ``auth``; the reader returns each frame's tag
and the bytes it covers (:attr:`Head.signed`) for the caller's session to check.

Shard-carrying frames (PUT, DELTA and the reply to GET) put the checkpoint's meta first in
the payload and the shard (or its encoded delta) after it; ``meta_len`` in the header says
where the meta ends, so the meta never has to be base64-encoded into the header. A DELTA's
shard part is, by its ``encoding``: :data:`XOR_DELTA`, a ``ckptpilot.codecs`` ``xor_delta``
blob of the new shard against the base shard, both viewed as :data:`DELTA_DTYPE`; or
:data:`BLOCKS`, a bitmap of the shard's ``block_bytes`` blocks that changed (bit ``i % 8``
of byte ``i // 8`` for block ``i``, unused bits zero) followed by the new bytes of those
blocks in order. Digests are XXH3-128 (see ``digest``): every
shard-carrying header has ``meta_digest``; a PUT's payload ends with a
:data:`TRAILER_BYTES`-byte trailer, the digest of the shard, which the sender computes as the
shard goes out (so sending starts at once, without a pass over the shard first), then that
digest's tag (``auth``); a DELTA
carries ``digest`` (of the new shard, checked after the fold) and ``delta_digest`` (of the
encoded bytes) in its header; the reply to GET carries the shard's ``digest`` and, once
committed, ``stripe``. COMMIT carries ``stripe``, the digests of all shards of the save in
order, which the daemons keep with the shards so that a fetch can check that the shards it
combines belong to one save and that a shard rebuilt from parity is right.

The reader validates before it allocates: the prelude is checked (magic, version, op,
header size, payload size against the reader's limit), then the header (JSON, required
fields, their types and their agreement with the declared payload size), and only then is a
buffer of exactly the declared size allocated for the payload, or the caller's buffers
(``into``) are checked to hold exactly that many bytes. The part after the meta is digested
while it arrives (:attr:`Frame.payload_digest`), so a receiver never reads its bytes twice.
Anything wrong raises :class:`ProtocolError` naming the problem; the connection cannot be
trusted after that. Numbers are bounded to 64-bit integers (so that a lease of 10**400
seconds is refused here, not where it meets a float), and JSON numbers too long for Python
to parse are malformed JSON like any other.

Zero copy: a frame is sent with ``sendmsg`` of the header and the caller's buffers as they
are (a shard is a view of the image), and received with ``recv_into`` straight into its
destination; no payload passes through an intermediate ``bytes`` object.
"""

from __future__ import annotations

import enum
import json
import re
import socket
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ckptpilot.hostmem import fresh_bytes
from ckptpilot.tiers.peer.auth import NO_TAG, TAG_BYTES, Session
from ckptpilot.tiers.peer.digest import Hasher, is_digest
from ckptpilot.tiers.peer.errors import ProtocolError

if TYPE_CHECKING:
    import torch

MAGIC = b"CKPP"
VERSION = 3
PRELUDE = struct.Struct("<4sHBIQ")
MAX_HEADER_BYTES = 64 * 1024
MAX_META_BYTES = 16 * 2**20
"""The largest meta a shard may carry; meta is a small JSON description of the state."""

Buffer = bytes | bytearray | memoryview | np.ndarray

_DISCARD_CHUNK = 1 << 20
_RECV_CHUNK = 1 << 20  # digested right after each recv or before each send, while cached
_IOV_MAX = 1024
_MAX_INT = 2**63 - 1
_MAX_ERROR_CHARS = 4096
_NONCE = re.compile(r"[0-9a-f]{32}")
_ENDPOINT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")


class Op(enum.IntEnum):
    """Request and reply codes. A request gets exactly one reply: OK or ERR. HELLO opens a
    connection, once each way (``auth``)."""

    PUT = 1
    DELTA = 2
    COMMIT = 3
    GET = 4
    LIST = 5
    PING = 6
    RENEW = 7
    DROP = 8
    CORRUPT = 9
    HELLO = 10
    OK = 100
    ERR = 101


DELTA_DTYPE = "float32"
"""``xor_delta`` DELTA payloads are blobs of the shard viewed as this torch dtype (see
:func:`shard_tensor`): checkpoints are mostly float32 weights and moments, whose
sign/exponent byte is where a delta compresses."""
XOR_DELTA = "xor_delta"
BLOCKS = "blocks"
DELTA_ENCODINGS = (XOR_DELTA, BLOCKS)
MIN_BLOCK_BYTES = 4 << 10
MAX_BLOCK_BYTES = 64 << 20

SHARD_KINDS = ("data", "parity")
_META_OPS = (Op.PUT, Op.DELTA, Op.OK)
_TRAILED_OPS = (Op.PUT,)
DIGEST_BYTES = 16
TRAILER_BYTES = DIGEST_BYTES + TAG_BYTES
"""A PUT's payload ends with the binary XXH3-128 digest of its shard and that digest's tag."""


@dataclass(frozen=True)
class Head:
    """A validated prelude and header; the payload (``payload_len`` bytes) follows on the wire."""

    op: Op
    header: dict[str, Any]
    payload_len: int
    signed: bytes = b""
    """The prelude and header bytes as received, which ``tag`` covers."""
    tag: bytes = NO_TAG


@dataclass(frozen=True)
class Frame:
    """A whole frame. Frames whose header has ``meta_len`` (PUT, DELTA, the OK to GET) are
    read as ``meta`` and the rest, the body, which goes into the reader's buffers (``into``)
    or a fresh uninitialised array, ``payload``, that the bytes fill entirely (so a shard
    starts at an aligned address); other frames have an empty ``meta``. ``payload_digest``
    is the digest of the body of a frame with ``meta_len``, computed as it arrived;
    ``trailer_digest`` the digest a PUT's sender appended (compare the two) and
    ``trailer_tag`` its tag; ``head`` the frame's validated head."""

    op: Op
    header: dict[str, Any]
    payload: np.ndarray
    meta: bytes = b""
    payload_digest: str | None = None
    trailer_digest: str | None = None
    trailer_tag: bytes = NO_TAG
    head: Head | None = None


class Body:
    """A PUT's shard, sent piece by piece straight from where its bytes are (``pieces()``
    yields them; it is called once per send), digested as it goes. After the send,
    ``digest`` is the digest that went out as the frame's trailer."""

    def __init__(self, nbytes: int, pieces: Callable[[], Iterable[Buffer]]) -> None:
        self.nbytes = nbytes
        self.pieces = pieces
        self.digest: str | None = None


# ----------------------------------------------------------------------------- field checks

def _int(lo: int, hi: int = _MAX_INT) -> Callable[[object], bool]:
    def check(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
    return check


def _positive_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and 0 < v <= _MAX_INT


def _run_id(v: object) -> bool:
    return isinstance(v, str) and 0 < len(v) <= 256


def _stripe(v: object) -> bool:
    return isinstance(v, list) and 0 < len(v) <= 1024 and all(is_digest(s) for s in v)


def _str(v: object) -> bool:
    return isinstance(v, str)


_SHARD_FIELDS: dict[str, Callable[[object], bool]] = {
    "run_id": _run_id,
    "ckpt_id": _int(0),
    "shard_index": _int(0),
    "shard_count": _int(1, 1024),
    "data_shards": _int(1, 1024),
    "kind": lambda v: v in SHARD_KINDS,
    "image_len": _int(0),
    "shard_size": _int(8),
    "meta_len": _int(0, MAX_META_BYTES),
    "meta_digest": is_digest,
    "lease_seconds": _positive_number,
}
_FIELDS: dict[Op, dict[str, Callable[[object], bool]]] = {
    Op.PUT: _SHARD_FIELDS,
    Op.DELTA: {**_SHARD_FIELDS, "base_id": _int(0), "digest": is_digest,
               "delta_digest": is_digest, "encoding": lambda v: v in DELTA_ENCODINGS},
    Op.COMMIT: {"run_id": _run_id, "ckpt_id": _int(0), "lease_seconds": _positive_number,
                "stripe": _stripe},
    Op.GET: {"run_id": _run_id, "ckpt_id": _int(0), "shard_index": _int(0)},
    Op.LIST: {"run_id": _run_id},
    Op.PING: {},
    Op.RENEW: {"run_id": _run_id, "lease_seconds": _positive_number},
    Op.DROP: {"run_id": _run_id},
    Op.CORRUPT: {"run_id": _run_id, "ckpt_id": _int(0), "shard_index": _int(0)},
    Op.HELLO: {"nonce": lambda v: isinstance(v, str) and _NONCE.fullmatch(v) is not None},
    Op.OK: {},
    Op.ERR: {"error": _str, "code": _str},
}


def validate_header(op: Op, header: object, payload_len: int) -> dict[str, Any]:
    """The header if it carries every field ``op`` needs, well typed and consistent with
    the payload size; :class:`ProtocolError` naming the first fault otherwise."""
    if not isinstance(header, dict):
        raise ProtocolError(f"{op.name} header must be a JSON object, got {type(header).__name__}")
    for name, check in _FIELDS[op].items():
        if name not in header:
            raise ProtocolError(f"{op.name} header is missing field {name!r}")
        if not check(header[name]):
            raise ProtocolError(f"{op.name} header field {name!r} is invalid: "
                                f"{header[name]!r:.200}")
    if op in (Op.PUT, Op.DELTA):
        _check_shard_header(op, header, payload_len)
    elif op is Op.OK and "meta_len" in header and not (
        _int(0, MAX_META_BYTES)(header["meta_len"]) and header["meta_len"] <= payload_len
    ):
        raise ProtocolError(f"OK header field 'meta_len' is invalid: "
                            f"{header['meta_len']!r:.200}")
    return header


def _check_shard_header(op: Op, h: dict[str, Any], payload_len: int) -> None:
    index, count, data = h["shard_index"], h["shard_count"], h["data_shards"]
    if count not in (data, data + 1):
        raise ProtocolError(f"{op.name}: shard_count {count} must be data_shards ({data}) "
                            "or data_shards + 1 (with parity)")
    if index >= count:
        raise ProtocolError(f"{op.name}: shard_index {index} is out of range for "
                            f"shard_count {count}")
    if (h["kind"] == "parity") != (index == data):
        raise ProtocolError(f"{op.name}: shard {index} of {count} cannot be of kind "
                            f"{h['kind']!r}")
    if h["shard_size"] % 8 or h["shard_size"] * data < h["image_len"]:
        raise ProtocolError(f"{op.name}: shard_size {h['shard_size']} must be a multiple of 8 "
                            f"covering image_len {h['image_len']} in {data} shards")
    if op is Op.PUT and payload_len != h["meta_len"] + h["shard_size"] + TRAILER_BYTES:
        raise ProtocolError(f"PUT payload is {payload_len} bytes, header says meta_len "
                            f"{h['meta_len']} + shard_size {h['shard_size']} + a "
                            f"{TRAILER_BYTES}-byte digest + tag trailer")
    if op is Op.DELTA and payload_len <= h["meta_len"]:
        raise ProtocolError(f"DELTA payload of {payload_len} bytes holds no delta after "
                            f"meta_len {h['meta_len']}")
    if op is Op.DELTA and h["encoding"] == BLOCKS:
        block = h.get("block_bytes")
        if not (_int(MIN_BLOCK_BYTES, MAX_BLOCK_BYTES)(block) and block & (block - 1) == 0):
            raise ProtocolError(f"DELTA: block_bytes must be a power of two in "
                                f"{MIN_BLOCK_BYTES}..{MAX_BLOCK_BYTES}, got {block!r:.200}")
        bitmap = bitmap_bytes(h["shard_size"], block)
        body = payload_len - h["meta_len"]
        if not bitmap <= body <= bitmap + h["shard_size"]:
            raise ProtocolError(f"DELTA of {body} bytes after the meta cannot be a bitmap of "
                                f"{bitmap} bytes and at most shard_size {h['shard_size']} bytes "
                                "of changed blocks")


def bitmap_bytes(shard_size: int, block_bytes: int) -> int:
    """Bytes of a ``blocks`` delta's bitmap: one bit per block of the shard."""
    blocks = -(-shard_size // block_bytes)
    return -(-blocks // 8)


def shard_tensor(shard: np.ndarray) -> torch.Tensor:
    """A shard (uint8, a multiple of 8 bytes) as the tensor a DELTA payload encodes; copies
    only a read-only shard (torch tensors must be writable). Imports torch on first use:
    a daemon needs it only to fold an ``xor_delta``."""
    import torch

    if not shard.flags.writeable:
        shard = shard.copy()
    return torch.from_numpy(shard).view(getattr(torch, DELTA_DTYPE))


# ------------------------------------------------------------------------------ reading

def recv_exactly(
    sock: socket.socket, view: memoryview, what: str, deadline: float | None = None
) -> None:
    """Fill ``view`` from the socket; :class:`ProtocolError` if the peer closes first,
    ``TimeoutError`` if the bytes are not all in by ``deadline`` (``time.monotonic()``)."""
    _recv_views(sock, [view], what, None, deadline)


def _recv_views(
    sock: socket.socket, views: Sequence[memoryview], what: str, hasher: Hasher | None,
    deadline: float | None = None,
) -> None:
    """Fill ``views`` in order, straight from the socket, feeding each piece to ``hasher``
    as it lands; the error for an early close counts bytes over all of them."""
    got, size = 0, sum(v.nbytes for v in views)
    for view in views:
        done, n_view = 0, view.nbytes
        while done < n_view:
            piece = view[done:done + _RECV_CHUNK]
            if deadline is not None:  # a byte at a time must not stretch the wait for ever
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the {what} did not arrive in time ({got} of {size} "
                                       "bytes)")
                sock.settimeout(left)
            n = sock.recv_into(piece)
            if n == 0:
                raise ProtocolError(f"truncated frame: connection closed after {got} of "
                                    f"{size} bytes of the {what}")
            if hasher is not None:
                hasher.update(piece[:n])
            done += n
            got += n


def read_head(
    sock: socket.socket, *, max_payload: int, deadline: float | None = None
) -> Head | None:
    """The next frame's validated prelude and header, and its tag (unchecked: the caller's
    session checks it); None on a clean close between frames.

    ``max_payload`` is the largest payload the caller will accept; a larger declaration is
    rejected before anything is allocated for it. With ``deadline`` (``time.monotonic()``),
    all of it must be in by then (``TimeoutError``), however slowly the bytes trickle in.
    """
    prelude = bytearray(PRELUDE.size)
    view = memoryview(prelude)
    if deadline is not None:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    first = sock.recv_into(view)
    if first == 0:
        return None
    recv_exactly(sock, view[first:], "prelude", deadline)
    magic, version, op_code, header_len, payload_len = PRELUDE.unpack(prelude)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a ckptpilot "
                            "peer frame")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks "
                            f"{VERSION})")
    try:
        op = Op(op_code)
    except ValueError:
        raise ProtocolError(f"unknown op code {op_code}") from None
    if header_len > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {header_len} bytes exceeds the limit of "
                            f"{MAX_HEADER_BYTES}")
    if payload_len > max_payload:
        raise ProtocolError(f"{op.name} payload of {payload_len} bytes exceeds this side's "
                            f"limit of {max_payload} bytes")
    raw = bytearray(header_len + TAG_BYTES)
    recv_exactly(sock, memoryview(raw), "header", deadline)
    try:
        header = json.loads(raw[:header_len].decode("utf-8")) if header_len else {}
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, a number too long
        raise ProtocolError(f"{op.name} header is not valid UTF-8 JSON: {e}") from None
    return Head(op, validate_header(op, header, payload_len), payload_len,
                bytes(prelude) + bytes(raw[:header_len]), bytes(raw[header_len:]))


def read_payload(
    sock: socket.socket, head: Head, into: Sequence[memoryview] | None = None
) -> Frame:
    """The rest of the frame announced by ``head``: the meta in a fresh buffer, the body in
    ``into`` (byte views that must add up to exactly its size; then ``Frame.payload`` is
    empty) or in a fresh array of exactly the declared size. Nothing is zero-filled first:
    the bytes received fill every byte, or this raises."""
    meta_len = head.header.get("meta_len", 0) if head.op in _META_OPS else 0
    meta = bytearray(meta_len)
    recv_exactly(sock, memoryview(meta), f"{head.op.name} meta")
    trailer = bytearray(TRAILER_BYTES if head.op in _TRAILED_OPS else 0)
    body_len = head.payload_len - meta_len - len(trailer)
    if into is None:
        payload = fresh_bytes(body_len)
        views: Sequence[memoryview] = [memoryview(payload)]
    else:
        views = [v.cast("B") for v in into]
        room = sum(v.nbytes for v in views)
        if room != body_len:
            raise ProtocolError(f"{head.op.name} carries {body_len} bytes after its meta, the "
                                f"reader expected {room}")
        payload = np.empty(0, dtype=np.uint8)
    hasher = Hasher() if "meta_len" in head.header and head.op in _META_OPS else None
    _recv_views(sock, views, f"{head.op.name} payload", hasher)
    recv_exactly(sock, memoryview(trailer), f"{head.op.name} digest trailer")
    return Frame(head.op, head.header, payload, bytes(meta),
                 None if hasher is None else hasher.hexdigest(),
                 bytes(trailer[:DIGEST_BYTES]).hex() if trailer else None,
                 bytes(trailer[DIGEST_BYTES:]) if trailer else NO_TAG, head)


def discard_payload(sock: socket.socket, head: Head) -> None:
    """Read and drop the payload (through a small buffer) to stay in step with the stream."""
    scratch = memoryview(bytearray(min(_DISCARD_CHUNK, head.payload_len)))
    left = head.payload_len
    while left:
        chunk = scratch[:min(left, len(scratch))]
        recv_exactly(sock, chunk, f"{head.op.name} payload")
        left -= len(chunk)


def read_frame(sock: socket.socket, *, max_payload: int) -> Frame | None:
    """The next whole frame; None on a clean close between frames."""
    head = read_head(sock, max_payload=max_payload)
    return None if head is None else read_payload(sock, head)


# ------------------------------------------------------------------------------ writing

def encode_head(op: Op, header: dict[str, Any], payload_len: int) -> bytes:
    """Prelude + header bytes of a frame; the header is validated as a reader would."""
    validate_header(op, header, payload_len)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    return PRELUDE.pack(MAGIC, VERSION, int(op), len(raw), payload_len) + raw


def send_frame(
    sock: socket.socket, op: Op, header: dict[str, Any], parts: Sequence[Buffer | Body] = (),
    *, session: Session | None = None, tag: Callable[[bytes], bytes] | None = None,
) -> int:
    """Write one frame; returns the payload size. The payload is the concatenation of
    ``parts``, sent as they are (one ``sendmsg`` where the kernel takes it all). A PUT's
    parts are its meta, then its shard as buffers or :class:`Body` pieces, which are sent
    a chunk at a time, each digested just before it goes, then the digest as the trailer.
    The frame is tagged by ``session`` (or by ``tag(prelude + header)``: a HELLO); without
    either it carries :data:`~ckptpilot.tiers.peer.auth.NO_TAG`, which no session accepts."""
    def head_of(payload_len: int) -> tuple[memoryview, bytes]:
        raw = encode_head(op, header, payload_len)
        mac = session.sign(raw) if session is not None else tag(raw) if tag else NO_TAG
        return memoryview(raw + mac), mac

    if op not in _TRAILED_OPS:
        views = [_view(p) for p in parts]
        payload_len = sum(v.nbytes for v in views)
        _send_views(sock, [head_of(payload_len)[0], *views])
        return payload_len
    if not parts or isinstance(parts[0], Body):
        raise ProtocolError(f"{op.name} parts must start with the meta")
    meta, body = _view(parts[0]), parts[1:]
    body_len = sum(p.nbytes if isinstance(p, Body) else _view(p).nbytes for p in body)
    payload_len = meta.nbytes + body_len + TRAILER_BYTES
    head, mac = head_of(payload_len)
    _send_views(sock, [head, meta])
    hasher, sent = Hasher(), 0
    for part in body:
        for piece in (part.pieces() if isinstance(part, Body) else (part,)):
            view = _view(piece)
            for lo in range(0, view.nbytes, _RECV_CHUNK):
                chunk = view[lo:lo + _RECV_CHUNK]
                hasher.update(chunk)
                _send_views(sock, [chunk])
                sent += chunk.nbytes
    if sent != body_len:  # the frame is broken: the caller's connection must be closed
        raise ProtocolError(f"{op.name} body produced {sent} bytes, announced {body_len}")
    digest = hasher.digest()
    trailer_tag = NO_TAG if session is None else session.trailer_tag(mac, digest)
    _send_views(sock, [memoryview(digest + trailer_tag)])
    for part in body:
        if isinstance(part, Body):
            part.digest = digest.hex()
    return payload_len


def _view(part: Buffer | Body) -> memoryview:
    if isinstance(part, Body):
        raise ProtocolError("only a PUT's shard may be sent as a Body")
    return memoryview(part).cast("B")


def _send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """``sendmsg`` until every byte is out: the kernel may take part of a batch, and the
    rest is sent from where it stopped (views are sliced, never copied)."""
    pending = [v for v in views if v.nbytes]
    while pending:
        sent = sock.sendmsg(pending[:_IOV_MAX])
        while sent:
            first = pending[0].nbytes
            if sent >= first:
                sent -= first
                pending.pop(0)
            else:
                pending[0] = pending[0][sent:]
                sent = 0


def send_error(
    sock: socket.socket, code: str, message: str, session: Session | None = None
) -> None:
    """Reply ERR; a message too long for a header (it may quote a hostile frame) is cut."""
    if len(message) > _MAX_ERROR_CHARS:
        message = message[:_MAX_ERROR_CHARS] + "... (cut)"
    send_frame(sock, Op.ERR, {"error": message, "code": code}, session=session)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 as ``"[::1]:port"``) to (host, port); ``ValueError`` if malformed."""
    match = _ENDPOINT.fullmatch(endpoint)
    if match is None or not 1 <= int(match.group(2)) <= 65535:
        raise ValueError(f"expected a peer endpoint 'host:port' with a port in 1..65535, got "
                         f"{endpoint!r}")
    return match.group(1).strip("[]"), int(match.group(2))
