"""Which connections a peer daemon serves: bounds per client address and in total, and
which connection makes room for a new one (SPEC §6).

Owns: the daemon's table of open connections and the admission rule. Must not: read or
answer frames (``daemon`` does; this module only shuts a socket down to evict it).

Why. A connection costs the daemon a thread and a descriptor; without bounds one client can
open enough idle connections to starve the daemon of both, and the trainers' next connects
time out. A bound alone would not help the trainers, though: an attacker on the same host as
a trainer shares its address, and one elsewhere can fill the total. So a new connection
beyond a bound *evicts* one that serves nobody: first a connection that has not completed
the authenticated handshake (``auth``; an attacker without the secret never does), oldest
first; then an authenticated one idle between requests, idle longest first (its client
reconnects transparently, see ``calls.Connections``). Only when every connection in the
way is in the middle of a request is the new one refused, with ERR ``busy``. Unfinished
handshakes and idle connections also end on their own (the daemon's header and idle
timeouts), so nothing held without a request lasts.

Threading: the accept thread calls :meth:`ConnectionTable.admit`; each connection's thread
marks its own connection and :meth:`~ConnectionTable.forget` s it when it ends; one lock
guards the table.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptpilot.tiers.peer.auth import Session
from ckptpilot.tiers.peer.protocol import Buffer, Op, send_error, send_frame

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Conn:
    """One accepted connection: its socket, the client's address, its session once the
    handshake is done (``authenticated``), whether a request is being served (``busy``),
    and when it last finished one. ``ok`` and ``error`` answer a request, tagged."""

    sock: socket.socket
    host: str
    who: str
    session: Session | None = None
    busy: bool = False
    evicted: bool = False
    accepted: float = field(default_factory=time.monotonic)
    last_active: float = field(default_factory=time.monotonic)

    @property
    def authenticated(self) -> bool:
        return self.session is not None

    def ok(self, header: dict[str, Any], parts: Sequence[Buffer] = ()) -> None:
        send_frame(self.sock, Op.OK, header, parts, session=self.session)

    def error(self, code: str, message: str) -> None:
        send_error(self.sock, code, message, self.session)


def victim(conns: Sequence[Conn]) -> Conn | None:
    """The connection that makes room (see the module docstring), or None when each of
    ``conns`` is serving a request. Pure."""
    unauthenticated = [c for c in conns if not c.authenticated]
    if unauthenticated:
        return min(unauthenticated, key=lambda c: c.accepted)
    idle = [c for c in conns if not c.busy]
    return min(idle, key=lambda c: c.last_active) if idle else None


class ConnectionTable:
    """The open connections of one daemon, at most ``max_connections`` in all and
    ``max_per_client`` from one address."""

    def __init__(self, *, max_connections: int, max_per_client: int) -> None:
        if not 1 <= max_per_client <= max_connections:
            raise ValueError(f"need 1 <= max_per_client ({max_per_client}) <= "
                             f"max_connections ({max_connections})")
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self._conns: dict[socket.socket, Conn] = {}
        self._lock = threading.Lock()

    def admit(self, sock: socket.socket, address: Any) -> bool:
        """Take a new connection, evicting one if a bound is reached; False (after telling
        the client why, ERR ``busy``) when nothing can make room."""
        host = str(address[0])
        conn = Conn(sock, host, f"{host}:{address[1]}")
        refusal = None
        with self._lock:
            live = [c for c in self._conns.values() if not c.evicted]
            mine = [c for c in live if c.host == host]
            if len(mine) >= self.max_per_client:
                crowd, bound = mine, (f"{host} holds {len(mine)} connections, the most one "
                                      "client may have (--max-per-client)")
            elif len(live) >= self.max_connections:
                crowd, bound = live, (f"{len(live)} connections are open, the most this daemon "
                                      "serves (--max-connections)")
            else:
                crowd, bound = [], ""
            out = victim(crowd) if crowd else None
            if crowd and out is None:
                refusal = f"busy: {bound}, each serving a request; retry shortly"
            else:
                if out is not None:
                    out.evicted = True
                self._conns[sock] = conn
        if out is not None:
            log.info("evicting the %s connection from %s: %s",
                     "idle" if out.authenticated else "unauthenticated", out.who, bound)
            shut(out.sock)
        if refusal is not None:
            log.warning("refusing a connection from %s: %s", conn.who, refusal)
            with contextlib.suppress(OSError):
                sock.settimeout(0.1)  # the ERR is small: it fits in the socket's buffer
                send_error(sock, "busy", refusal)
            return False
        return True

    def get(self, sock: socket.socket) -> Conn | None:
        with self._lock:
            return self._conns.get(sock)

    def forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._conns.pop(sock, None)

    def shut_idle(self) -> None:
        """Shut every connection that serves no request (the daemon is stopping)."""
        with self._lock:
            idle = [c for c in self._conns.values() if not c.busy]
        for c in idle:
            shut(c.sock)

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for c in self._conns.values() if not c.evicted)


def shut(sock: socket.socket) -> None:
    """Wake the connection's thread (its poll or recv sees the end) without closing the
    descriptor under it: the thread closes it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
