"""Requests and replies to peer daemons: one-shot (:func:`call`) or over persistent
connections (:class:`Connections`), each authenticated with the job's secret (SPEC §6).

Owns: opening a connection and its handshake (``auth``), sending one request and reading
its one reply, checking every reply's tag, and the pool of idle connections. Must not:
interpret what a request means (``client`` and ``daemon`` do) or lay out frames
(``protocol``). A connection is reused only after its previous reply was read in full.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptpilot.tiers.peer.auth import Session, check_hello, hello_tag, new_nonce
from ckptpilot.tiers.peer.errors import PeerRequestError, ProtocolError
from ckptpilot.tiers.peer.protocol import (
    Body,
    Buffer,
    Frame,
    Head,
    Op,
    parse_endpoint,
    read_head,
    read_payload,
    send_frame,
)

RESENDABLE = frozenset({Op.PING, Op.LIST, Op.GET, Op.COMMIT, Op.RENEW, Op.DROP})
"""Requests a daemon may receive twice with the effect of once: after a pooled connection
turns out dead under one of them, :class:`Connections` sends it again on a fresh one. Not
PUT or DELTA (the client places those elsewhere on failure) nor CORRUPT (twice is undone)."""

CLOSING_ERRORS = frozenset({"bad_request", "internal_error", "unauthenticated", "busy"})
"""ERR codes after which the daemon closes the connection (the stream is out of step, or
the daemon will not serve it)."""

MAX_IDLE_SECONDS = 20.0
"""How long :class:`Connections` keeps a connection idle: well under a daemon's default
``--idle-timeout-seconds`` (60), so that a request rarely meets a connection the daemon is
closing at that moment."""


ReplyInto = Callable[[Head], Sequence[memoryview]]
"""Where the body of an OK reply goes, given its validated head (raise
:class:`ProtocolError` when the head is not what the caller asked for)."""


@dataclass
class Connection:
    """An open, authenticated connection: its socket, its session, when it was last used."""

    sock: socket.socket
    session: Session
    endpoint: str
    idle_since: float = field(default_factory=time.monotonic)

    def close(self) -> None:
        self.sock.close()


def call(
    endpoint: str,
    op: Op,
    header: dict[str, Any],
    parts: Sequence[Buffer | Body] = (),
    *,
    key: bytes,
    timeout_seconds: float,
    max_reply_payload: int = 0,
    reply_into: ReplyInto | None = None,
) -> Frame:
    """One request on a fresh connection authenticated with ``key``; returns the OK reply
    (its body received into ``reply_into(head)`` when given).

    Raises :class:`PeerRequestError` when the peer answers ERR, :class:`PeerAuthError` when
    the peer does not have ``key`` (its greeting or reply fails the HMAC check),
    :class:`ProtocolError` on a malformed reply, and ``OSError`` (``ConnectionRefusedError``,
    ``TimeoutError``...) when the peer cannot be reached or stalls longer than
    ``timeout_seconds`` on any step.
    """
    conn = connect(endpoint, key, timeout_seconds)
    with conn.sock:
        reply = _exchange(conn, op, header, parts, max_reply_payload, reply_into)
    return _checked(endpoint, op, reply)


class Connections:
    """Persistent connections to peer daemons, kept per endpoint and reused by requests.

    Why: a connection per request costs a handshake, and with many clients the connects
    queue in the daemons' accept backlogs, where a dropped SYN costs a retransmit of a
    second or more (enough to mark a healthy peer slow).

    Lifecycle: construct with the job's secret, :meth:`call` any number of times,
    :meth:`close` (idempotent; a call after it still works, on a connection that is closed
    when it returns).

    Threading: :meth:`call` may run on any number of threads at once. A connection serves
    one request at a time: a call takes an idle connection to the endpoint (or opens one)
    and gives it back once the whole reply is read, so concurrent calls to one endpoint use
    several; at most ``max_idle_per_endpoint`` are kept idle, each for at most
    ``max_idle_seconds``. A connection that failed in any way is closed, never reused. An
    idle connection the daemon closed (it restarted, shut down, or timed the connection
    out) is noticed before it is used; one that dies while the request is on its way fails
    the request, which is then sent once more on a fresh connection if it is
    :data:`RESENDABLE`.
    """

    def __init__(self, *, key: bytes, max_idle_per_endpoint: int = 4,
                 max_idle_seconds: float = MAX_IDLE_SECONDS) -> None:
        if max_idle_per_endpoint < 1:
            raise ValueError(f"max_idle_per_endpoint must be >= 1, got {max_idle_per_endpoint}")
        self.max_idle_per_endpoint = max_idle_per_endpoint
        self.max_idle_seconds = max_idle_seconds
        self._key = key
        self._idle: dict[str, list[Connection]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def call(
        self,
        endpoint: str,
        op: Op,
        header: dict[str, Any],
        parts: Sequence[Buffer | Body] = (),
        *,
        timeout_seconds: float,
        max_reply_payload: int = 0,
        reply_into: ReplyInto | None = None,
    ) -> Frame:
        """:func:`call` on a pooled connection (same arguments but the key, same results
        and errors)."""
        conn, reused = self._take(endpoint, timeout_seconds)
        while True:
            resend = reused and op in RESENDABLE
            try:
                reply = _exchange(conn, op, header, parts, max_reply_payload, reply_into)
            except ConnectionError:  # reset or broken pipe: the daemon dropped the connection
                if not resend:
                    conn.close()
                    raise
                reply = None
            except BaseException:
                conn.close()
                raise
            if reply is not None or not resend:
                break
            conn.close()  # a reused connection died under the request: once more, afresh
            conn, reused = connect(endpoint, self._key, timeout_seconds), False
        if reply is not None and (reply.op is Op.OK or (
                reply.op is Op.ERR and reply.header["code"] not in CLOSING_ERRORS)):
            self._give_back(endpoint, conn)
        else:
            conn.close()
        return _checked(endpoint, op, reply)

    def close(self) -> None:
        """Close the idle connections; connections in use close when their call returns."""
        with self._lock:
            self._closed = True
            idle = [conn for conns in self._idle.values() for conn in conns]
            self._idle.clear()
        for conn in idle:
            conn.close()

    def _take(self, endpoint: str, timeout_seconds: float) -> tuple[Connection, bool]:
        """An idle connection to ``endpoint`` that is still open (True), or a new one."""
        while True:
            with self._lock:
                idle = self._idle.get(endpoint)
                conn = idle.pop() if idle else None
            if conn is None:
                return connect(endpoint, self._key, timeout_seconds), False
            fresh = time.monotonic() - conn.idle_since < self.max_idle_seconds
            if fresh and _still_open(conn.sock):
                conn.sock.settimeout(timeout_seconds)
                return conn, True
            conn.close()

    def _give_back(self, endpoint: str, conn: Connection) -> None:
        conn.idle_since = time.monotonic()
        with self._lock:
            idle = self._idle.setdefault(endpoint, [])
            if not self._closed and len(idle) < self.max_idle_per_endpoint:
                idle.append(conn)
                return
        conn.close()


def connect(endpoint: str, key: bytes, timeout_seconds: float) -> Connection:
    """A new connection to ``endpoint``, past its handshake: the daemon's HELLO checked
    against ``key`` (:class:`PeerAuthError` names a daemon with another secret before
    anything is sent to it), this client's HELLO sent. A daemon that refuses the
    connection (``busy``) raises :class:`PeerRequestError`."""
    sock = socket.create_connection(parse_endpoint(endpoint), timeout=timeout_seconds)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = read_head(sock, max_payload=0)
        if head is None:
            raise ProtocolError(f"{endpoint} closed the connection before its greeting")
        if head.op is Op.ERR:  # refused before any session exists: taken only as a refusal
            raise PeerRequestError(endpoint, head.header["code"], head.header["error"])
        if head.op is not Op.HELLO:
            raise ProtocolError(f"{endpoint} opened the connection with {head.op.name}, not "
                                "HELLO: not a ckptpilot peer daemon of this version?")
        check_hello(key, head.signed, head.tag, endpoint)
        daemon_nonce, nonce = head.header["nonce"], new_nonce()
        send_frame(sock, Op.HELLO, {"nonce": nonce},
                   tag=lambda raw: hello_tag(key, raw, daemon_nonce))
        return Connection(sock, Session(key, daemon_nonce, nonce, daemon=False), endpoint)
    except BaseException:
        sock.close()
        raise


def _still_open(sock: socket.socket) -> bool:
    """Whether an idle connection can carry a request: the daemon sends nothing unasked, so
    anything to read on it (its close, a reset) means it is dead."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return not poller.poll(0)


def _exchange(
    conn: Connection, op: Op, header: dict[str, Any], parts: Sequence[Buffer | Body],
    max_reply_payload: int, reply_into: ReplyInto | None,
) -> Frame | None:
    """Send one request and read its reply, checking the reply's tag (and so that it
    answers this request) before its body is read; None if the peer closed without
    replying."""
    send_frame(conn.sock, op, header, parts, session=conn.session)
    head = read_head(conn.sock, max_payload=max_reply_payload)
    if head is None:
        return None
    conn.session.verify(head.signed, head.tag, f"the {head.op.name} reply of {conn.endpoint} "
                        f"to {op.name}")
    into = reply_into(head) if reply_into is not None and head.op is Op.OK else None
    return read_payload(conn.sock, head, into)


def _checked(endpoint: str, op: Op, reply: Frame | None) -> Frame:
    """The OK reply, or the error the reply (or its absence) stands for."""
    if reply is None:
        raise ProtocolError(f"{endpoint} closed the connection without replying to {op.name}")
    if reply.op is Op.ERR:
        raise PeerRequestError(endpoint, reply.header["code"], reply.header["error"])
    if reply.op is not Op.OK:
        raise ProtocolError(f"{endpoint} replied to {op.name} with {reply.op.name}, not OK/ERR")
    return reply

