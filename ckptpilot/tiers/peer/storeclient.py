"""A client of ``torch.distributed``'s ``TCPStore`` server in plain Python (no torch).

Owns: the store's client side of its TCP protocol, for the requests the health registry
makes (``set``, ``get``, ``add``, ``compare_set``, ``check``, ``multi_get``). Must not: host a
store (the registry's host does, with torch), know the registry's keys (``registry``).

Why: every peer daemon announces itself in the registry, and a daemon that imported torch for
its store client would cost each daemon hundreds of MB of memory and seconds of CPU to start,
which a host of many daemons cannot afford; the daemon stores and folds bytes and needs none
of it. Trainers connect through the same client, so one code path talks to the registry.

The protocol, as torch's C++ client speaks it (little-endian; a string or a value is a u64
length and its bytes; every key goes out with the ``/`` prefix torch's client adds, so both
clients see the same keys): on connect ``VALIDATE`` with a magic u32, then ``PING`` with a
u32 the server echoes; then one request at a time, each a query byte and its arguments:

=============  ============================  =====================================
request        arguments                     reply
=============  ============================  =====================================
``SET``        key, value                    none
``COMPARE_SET``  key, expected, desired      the value now stored
``ADD``        key, i64                      the i64 now stored
``CHECK``      u64 count, keys               u8: 0 all present, 1 not
``WAIT``       u64 count, keys               u8 0 once all are present
``GET``        key                           value
``MULTI_GET``  u64 count, keys               count values
=============  ============================  =====================================

``get`` and ``multi_get`` first ``WAIT`` for their keys, as torch's client does, so that
a missing key blocks until ``timeout_seconds`` instead of failing. A request that fails
(timeout, reset, closed) leaves the stream out of step: the connection is closed and every
later request raises ``ConnectionError``; the caller reconnects (``membership`` does), as
with torch's client, which dies with its server too.

Threading: requests from several threads are serialised on one connection.
"""

from __future__ import annotations

import secrets
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

_MAGIC = 0x3C85F7CE
_KEY_PREFIX = b"/"
_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_MAX_VALUE_BYTES = 64 << 20

VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT = 0, 1, 2, 3, 4, 5, 6
MULTI_GET, PING = 10, 13
_READY = _STOP_WAITING = 0
_T = TypeVar("_T")


class StoreClient:
    """One connection to the ``TCPStore`` at ``host:port``; ``timeout_seconds`` bounds the
    connect and each request (a ``TimeoutError`` after it). Connects in ``__init__``
    (``OSError`` when nothing answers there, ``ConnectionError`` when what answers is not a
    store)."""

    def __init__(self, host: str, port: int, *, timeout_seconds: float = 30.0) -> None:
        self.host, self.port = host, port
        self.timeout_seconds = timeout_seconds
        self._lock = threading.Lock()
        self._sock: socket.socket | None = socket.create_connection(
            (host, port), timeout=timeout_seconds)
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = secrets.randbits(32)
            self._sock.sendall(_U8.pack(VALIDATE) + _U32.pack(_MAGIC)
                               + _U8.pack(PING) + _U32.pack(nonce))
            echoed = _U32.unpack(self._recv(_U32.size))[0]
        except BaseException:
            self.close()
            raise
        if echoed != nonce:
            self.close()
            raise ConnectionError(f"{host}:{port} answered the store's PING with {echoed}, "
                                  f"not {nonce}: not a torch.distributed TCPStore")

    def set(self, key: str, value: str | bytes) -> None:
        self._request(_U8.pack(SET) + _key(key) + _value(value), lambda: None)

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def add(self, key: str, amount: int) -> int:
        return self._request(_U8.pack(ADD) + _key(key) + _I64.pack(amount),
                             lambda: _I64.unpack(self._recv(_I64.size))[0])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._request(_U8.pack(COMPARE_SET) + _key(key) + _value(expected)
                             + _value(desired), self._recv_value)

    def check(self, keys: Sequence[str]) -> bool:
        return self._request(_U8.pack(CHECK) + _keys(keys),
                             lambda: self._recv(1)[0] == _READY)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        def reply() -> list[bytes]:
            if self._recv(1)[0] != _STOP_WAITING:
                raise ConnectionError("the store answered WAIT with an unknown code")
            assert self._sock is not None
            self._sock.sendall(_U8.pack(MULTI_GET) + _keys(keys))
            return [self._recv_value() for _ in keys]

        return self._request(_U8.pack(WAIT) + _keys(keys), reply)

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _request(self, message: bytes, reply: Callable[[], _T]) -> _T:
        with self._lock:
            if self._sock is None:
                raise ConnectionError(f"the connection to the store at {self.host}:{self.port} "
                                      "was closed after a failed request; reconnect")
            try:
                self._sock.sendall(message)
                return reply()
            except BaseException:
                self.close()  # a reply may be half read: the stream is out of step
                raise

    def _recv(self, n: int) -> bytes:
        assert self._sock is not None
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self._sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError(f"the store at {self.host}:{self.port} closed the "
                                      "connection")
            got += k
        return bytes(buf)

    def _recv_value(self) -> bytes:
        size = _U64.unpack(self._recv(_U64.size))[0]
        if size > _MAX_VALUE_BYTES:
            raise ConnectionError(f"the store sent a value of {size} bytes: out of step")
        return self._recv(size)


def _value(value: str | bytes) -> bytes:
    raw = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    return _U64.pack(len(raw)) + raw


def _key(key: str) -> bytes:
    return _value(_KEY_PREFIX + key.encode("utf-8"))


def _keys(keys: Sequence[str]) -> bytes:
    return _U64.pack(len(keys)) + b"".join(_key(k) for k in keys)
