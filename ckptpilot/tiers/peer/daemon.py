"""The peer daemon: ``ckptpilot peer serve`` holds other nodes' shards in RAM (SPEC §6).

Owns: the TCP server (one thread per connection, bounded and evicted by ``admission``), the
handshake and the check of every request's tag (``auth``: a request not made with the job's
secret is refused with ERR ``unauthenticated`` before its payload is read, and the
connection closed), the header and idle timeouts, the meaning of each request, checking
every received shard's digest (as it arrives), folding deltas into their base in the
background and checking the result's digest, the lease reaper and clean shutdown (the
``peer`` CLI commands are ``command``). Must not: decide placement or parity (clients do), or
persist anything (a restarted daemon is empty by design). With ``--registry`` the daemon
announces itself through ``membership.Announcer``: "up" and a heartbeat while serving,
"draining" once SIGTERM arrives, "down" when it exits.

Lifecycle: :class:`PeerDaemon` binds in ``__init__`` (``port=0`` picks a free port, see
:attr:`PeerDaemon.address`), :meth:`serve_forever` runs on the calling thread until
:meth:`shutdown` (from another thread or a signal) stops accepting; in-flight requests
finish, idle connections close, then the call returns.

Threading: connection threads read, verify and answer requests; a small pool folds deltas
(``decode(delta, base=old)``, or the base with the changed ``blocks`` written over it; then
the digest the client announced is checked); a reaper thread frees runs whose lease ran
out. Shared state lives in :class:`ShardStore`. Zero copy: a shard is received straight into
the array that then holds it (digested as it lands) and sent on GET straight from there.

Torch: only an ``xor_delta`` fold needs it (the codec decodes the delta against the base);
storing, serving and ``blocks`` folds are numpy and memoryviews. The daemon imports it at
start, so that no fold waits for it, or with ``lazy_torch`` on the first ``xor_delta`` fold:
a daemon then costs tens of MB instead of a few hundred, for hosts that run many; that
fold, and a GET of its shard, wait for the import (seconds of CPU).

A malformed frame (garbage, truncated, oversized, unparseable) gets an ERR reply naming the
fault and closes that connection only, with one logged line; a request that fails on a bug
here gets an ERR ``internal_error`` and a logged traceback. Every other client keeps being
served. Clients keep their connections open across requests (``calls.Connections``), and
the listen backlog is the system's maximum, so that bursts of connects from many clients
queue instead of having their SYNs dropped (a retransmit costs a second or more). A
connection's handshake, and each request's prelude + header + tag, must arrive within
``header_timeout_seconds`` of their first byte (a slow-loris client holds nothing longer);
a connection idle for ``idle_timeout_seconds`` is closed (its client reconnects).
"""

from __future__ import annotations

import logging
import select
import socket
import socketserver
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from ckptpilot.tiers.peer.admission import Conn, ConnectionTable
from ckptpilot.tiers.peer.auth import (
    HOW_TO_SHARE,
    PeerAuthError,
    Session,
    hello_tag,
    hello_tag_ok,
    new_nonce,
)
from ckptpilot.tiers.peer.deltas import fold_blocks
from ckptpilot.tiers.peer.digest import digest_of
from ckptpilot.tiers.peer.errors import ProtocolError
from ckptpilot.tiers.peer.placement import describe_failure
from ckptpilot.tiers.peer.protocol import (
    BLOCKS,
    Head,
    Op,
    discard_payload,
    read_head,
    read_payload,
    send_error,
    send_frame,
    shard_tensor,
)
from ckptpilot.tiers.peer.store import SHARD_FIELDS, Entry, ShardStore

if TYPE_CHECKING:
    from ckptpilot.codecs.base import Codec

log = logging.getLogger(__name__)

_IDLE_POLL_SECONDS = 0.2
_LINGER_SECONDS = 0.5
_LINGER_MAX_BYTES = 1 << 20


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    request_queue_size = socket.SOMAXCONN  # the kernel caps it (net.core.somaxconn)
    daemon_threads = False  # server_close() joins them: in-flight requests finish
    block_on_close = True

    def __init__(self, address: tuple[str, int], daemon: PeerDaemon) -> None:
        self.peer_daemon = daemon
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        return self.peer_daemon.connections.admit(request, client_address)


# A persistent client connection holds one handler thread; TCP keepalive probes find a client
# host that vanished without closing (power loss) within ~1-2 minutes and free that thread.
_KEEPALIVE = (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))


class _Handler(socketserver.BaseRequestHandler):
    def setup(self) -> None:
        self.request.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in _KEEPALIVE:
            if hasattr(socket, name):  # Linux names; other systems keep their defaults
                self.request.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)

    def handle(self) -> None:
        self.server.peer_daemon.serve_connection(self.request, self.client_address)  # type: ignore[attr-defined]


class PeerDaemon:
    """Holds shards for clients (see the module docstring for lifecycle and threading)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        key: bytes,
        mem_limit: int,
        allow_fault_injection: bool = False,
        frame_timeout_seconds: float = 30.0,
        header_timeout_seconds: float = 10.0,
        idle_timeout_seconds: float = 60.0,
        max_connections: int = 128,
        max_per_client: int = 64,
        fold_wait_seconds: float = 60.0,
        reap_interval_seconds: float = 0.2,
        fold_threads: int = 2,
        lazy_torch: bool = False,
    ) -> None:
        self._key = key
        self.connections = ConnectionTable(max_connections=max_connections,
                                           max_per_client=max_per_client)
        self.header_timeout_seconds = header_timeout_seconds
        self.idle_timeout_seconds = idle_timeout_seconds
        self.store = ShardStore(mem_limit)
        self.allow_fault_injection = allow_fault_injection
        self.frame_timeout_seconds = frame_timeout_seconds
        self.fold_wait_seconds = fold_wait_seconds
        self.reap_interval_seconds = reap_interval_seconds
        self._codec: Codec | None = None  # made by the first xor_delta fold (see _xor_codec)
        self._codec_lock = threading.Lock()
        if not lazy_torch:
            self._xor_codec()
        self._folds = ThreadPoolExecutor(max_workers=fold_threads,
                                         thread_name_prefix="ckptpilot-peer-fold")
        self._stopping = threading.Event()
        self._accepted = 0
        self._accepted_lock = threading.Lock()
        self._server = _Server((host, port), self)
        self._reaper = threading.Thread(target=self._reap, name="ckptpilot-peer-reaper",
                                        daemon=True)

    @property
    def connections_accepted(self) -> int:
        """How many connections this daemon has accepted: clients that reuse connections
        add one per endpoint, not one per request."""
        with self._accepted_lock:
            return self._accepted

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def serve_forever(self) -> None:
        self._reaper.start()
        try:
            self._server.serve_forever(poll_interval=_IDLE_POLL_SECONDS)
        finally:
            self._stopping.set()
            self._server.server_close()  # joins the connection threads
            self._folds.shutdown(wait=True)
            self._reaper.join()

    def shutdown(self) -> None:
        """Stop accepting and let in-flight requests finish; call from another thread."""
        self._stopping.set()
        self._server.shutdown()
        self.connections.shut_idle()

    def close(self) -> None:
        """Release the port and threads of a daemon that will not serve after all (a
        :meth:`serve_forever` that returned has done this already)."""
        self._stopping.set()
        self._server.server_close()
        self._folds.shutdown(wait=True)

    # -------------------------------------------------------------------------- connections

    def serve_connection(self, sock: socket.socket, address: Any) -> None:
        """Answer frames on one connection until the client closes it, the daemon stops,
        the connection is idle too long or evicted, or a frame is malformed or not made with
        the job's secret (then log one line and close)."""
        conn = self.connections.get(sock)
        if conn is None:  # not admitted (a daemon used without its server's accept path)
            return
        with self._accepted_lock:
            self._accepted += 1
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._serve(conn)
        finally:
            self.connections.forget(sock)

    def _serve(self, conn: Conn) -> None:
        sock, who = conn.sock, conn.who
        poller = select.poll()  # unlike select(), no limit on descriptor numbers
        poller.register(sock, select.POLLIN)
        while not self._stopping.is_set():
            if conn.session is not None and not poller.poll(_IDLE_POLL_SECONDS * 1000):
                if time.monotonic() - conn.last_active > self.idle_timeout_seconds:
                    log.debug("closing the connection from %s: idle for over %g s", who,
                              self.idle_timeout_seconds)
                    return
                continue
            try:
                if conn.session is None:
                    conn.session = self._handshake(conn)
                    if conn.session is None:
                        return
                    continue
                head = read_head(sock, max_payload=self.store.mem_limit,
                                 deadline=time.monotonic() + self.header_timeout_seconds)
                if head is None:
                    return
                conn.session.verify(head.signed, head.tag, f"the {head.op.name} request")
                conn.busy = True
                sock.settimeout(self.frame_timeout_seconds)
                self._dispatch(conn, head)
            except PeerAuthError as e:
                log.warning("refusing %s: %s", who, e)
                _close_after_error(sock, "unauthenticated", f"refused: {e}", conn.session)
                return
            except ProtocolError as e:
                log.warning("closing connection from %s: %s", who, e)
                _close_after_error(sock, "bad_request", str(e), conn.session)
                return
            except OSError as e:
                log.warning("closing connection from %s: %s", who, describe_failure(e))
                return
            except Exception as e:  # a bug here: tell the client, keep serving the others
                log.exception("closing connection from %s after an internal error", who)
                _close_after_error(sock, "internal_error",
                                   f"internal error in the peer daemon ({type(e).__name__}: "
                                   f"{e}); see its log", conn.session)
                return
            finally:
                conn.busy = False
                conn.last_active = time.monotonic()

    def _handshake(self, conn: Conn) -> Session | None:
        """Greet with a fresh nonce; the client's HELLO must answer it with the job's secret
        within the header timeout. None when the client left first."""
        nonce, key = new_nonce(), self._key
        deadline = time.monotonic() + self.header_timeout_seconds
        conn.sock.settimeout(self.header_timeout_seconds)
        send_frame(conn.sock, Op.HELLO, {"nonce": nonce}, tag=lambda raw: hello_tag(key, raw))
        head = read_head(conn.sock, max_payload=self.store.mem_limit, deadline=deadline)
        if head is None:
            return None
        if head.op is not Op.HELLO:
            raise PeerAuthError(f"{head.op.name} on a connection that is not authenticated: a "
                                "client must first answer the daemon's HELLO with a tag made "
                                f"with the job's peer secret; {HOW_TO_SHARE}")
        if not hello_tag_ok(key, head.signed, head.tag, nonce):
            raise PeerAuthError(f"the client's HELLO fails its HMAC check: that client does "
                                f"not have this daemon's peer secret; {HOW_TO_SHARE}")
        return Session(key, nonce, head.header["nonce"], daemon=True)

    def _dispatch(self, ch: Conn, head: Head) -> None:
        handler = {
            Op.PUT: self._put, Op.DELTA: self._delta, Op.COMMIT: self._commit,
            Op.GET: self._get, Op.LIST: self._list, Op.PING: self._ping,
            Op.RENEW: self._renew, Op.DROP: self._drop, Op.CORRUPT: self._corrupt,
        }.get(head.op)
        if handler is None:
            raise ProtocolError(f"{head.op.name} is a reply, not a request")
        if head.op is Op.HELLO:
            raise ProtocolError("HELLO after the handshake")
        if head.op not in (Op.PUT, Op.DELTA) and head.payload_len:
            raise ProtocolError(f"{head.op.name} carries no payload, got {head.payload_len} "
                                "bytes")
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s", head.op.name, {k: v for k, v in head.header.items()
                                              if k != "stripe"})
        handler(ch, head)

    # ----------------------------------------------------------------------------- writing

    def _put(self, ch: Conn, head: Head) -> None:
        h = head.header
        if not self._reserve_or_refuse(ch, head, head.payload_len):
            return
        try:
            frame = read_payload(ch.sock, head)
            assert ch.session is not None and frame.trailer_digest is not None
            ch.session.verify_trailer(head.tag, bytes.fromhex(frame.trailer_digest),
                                      frame.trailer_tag, f"shard {h['shard_index']} of "
                                      f"checkpoint {h['ckpt_id']}")
        except BaseException:
            self.store.unreserve(head.payload_len)
            raise
        problem = _check_meta(h, frame.meta) or _check_digest(
            frame.trailer_digest, frame.payload_digest, f"received shard {h['shard_index']} "
            f"of checkpoint {h['ckpt_id']}", "resend it")
        if problem is not None:
            self.store.unreserve(head.payload_len)
            ch.error(*problem)
            return
        info = {**{f: h[f] for f in SHARD_FIELDS}, "digest": frame.payload_digest}
        entry = Entry(_key(h), info, frame.meta, frame.payload,
                      len(frame.meta) + frame.payload.size)
        self.store.add(entry, reserved=head.payload_len, lease_seconds=h["lease_seconds"])
        ch.ok({})

    def _delta(self, ch: Conn, head: Head) -> None:
        h = head.header
        run, index = h["run_id"], h["shard_index"]
        base = self.store.base_of(run, h["base_id"], index)
        if base is None or base.info["shard_size"] != h["shard_size"]:
            discard_payload(ch.sock, head)
            ch.error("no_base", f"no base: checkpoint {h['base_id']} shard {index} of "
                     f"run {run!r} is not held here (with this shard size); send the full "
                     "shard")
            return
        reserved = head.payload_len + h["shard_size"]
        if not self._reserve_or_refuse(ch, head, reserved):
            return
        try:
            frame = read_payload(ch.sock, head)
        except BaseException:
            self.store.unreserve(reserved)
            raise
        problem = _check_meta(h, frame.meta) or _check_digest(
            h["delta_digest"], frame.payload_digest, f"received delta of shard "
            f"{h['shard_index']} of checkpoint {h['ckpt_id']}", "resend it")
        if problem is not None:
            self.store.unreserve(reserved)
            ch.error(*problem)
            return
        info = {**{f: h[f] for f in SHARD_FIELDS}, "digest": h["digest"]}
        entry = Entry(_key(h), info, frame.meta, None, reserved)
        if not self.store.begin_fold(entry, base, reserved=reserved,
                                     lease_seconds=h["lease_seconds"]):
            ch.error("no_base", f"no base: checkpoint {h['base_id']} shard {index} of "
                     f"run {run!r} was dropped meanwhile; send the full shard")
            return
        self._folds.submit(self._fold, entry, base, frame.payload, h["encoding"],
                           h.get("block_bytes", 0))
        ch.ok({"folding": True})

    def _fold(
        self, entry: Entry, base: Entry, delta: np.ndarray, encoding: str, block_bytes: int
    ) -> None:
        """``new = base + delta`` (by ``encoding``), verified against the announced digest."""
        data, error = None, None
        try:
            if not base.ready.wait(self.fold_wait_seconds):
                raise TimeoutError("its base is still folding")
            if base.data is None:
                raise ValueError(f"its base failed: {base.error}")
            if encoding == BLOCKS:
                data = fold_blocks(base.data, delta, block_bytes)
            else:
                out = self._xor_codec().decode(delta, base=shard_tensor(base.data))
                data = out.view(-1).numpy().view(np.uint8)
            if data.size != entry.info["shard_size"]:
                raise ValueError(f"delta decoded to {data.size} bytes, expected "
                                 f"{entry.info['shard_size']}")
            problem = _check_digest(entry.info["digest"], digest_of(data), "folded shard")
            if problem is not None:
                raise ValueError(problem[1])
        except Exception as e:
            data, error = None, f"fold failed: {e}"
            log.warning("run %s checkpoint %d shard %d: %s", *entry.key, error)
        self.store.finish_fold(entry, data, error)

    def _xor_codec(self) -> Codec:
        """The ``xor_delta`` codec, built (and torch imported) in ``__init__``, or with
        ``lazy_torch`` on the first fold that needs it: then a daemon that only stores full
        shards and ``blocks`` deltas never loads torch."""
        with self._codec_lock:
            if self._codec is None:
                from ckptpilot.codecs import get_codec

                self._codec = get_codec("xor_delta", threads=1)
            return self._codec

    def _reserve_or_refuse(self, ch: Conn, head: Head, nbytes: int) -> bool:
        h = head.header
        if self.store.reserve(nbytes, writing=(h["run_id"], h["ckpt_id"])):
            return True
        discard_payload(ch.sock, head)
        used, limit = self.store.mem_used, self.store.mem_limit
        log.warning("refused %d bytes for run %s checkpoint %d: out of memory (%d of %d bytes "
                    "in use, nothing evictable)", nbytes, h["run_id"], h["ckpt_id"], used, limit)
        ch.error("out_of_memory", f"out of memory: {nbytes} bytes do not fit ({used} of "
                 f"{limit} bytes in use, none evictable); use another peer or raise "
                 "--mem-limit")
        return False

    def _commit(self, ch: Conn, head: Head) -> None:
        h = head.header
        held = self.store.commit(h["run_id"], h["ckpt_id"], h["lease_seconds"], h["stripe"])
        ch.ok({"held": held})

    # ----------------------------------------------------------------------------- reading

    def _held(self, ch: Conn, h: dict[str, Any]) -> tuple[Entry, np.ndarray] | None:
        """The entry named by the header and its final bytes (waiting for a fold in
        progress), or None after answering ERR."""
        entry = self.store.get(_key(h))
        what = f"run {h['run_id']!r} checkpoint {h['ckpt_id']} shard {h['shard_index']}"
        if entry is None:
            ch.error("not_found", f"{what} is not held here")
            return None
        if not entry.ready.wait(self.fold_wait_seconds):
            ch.error("fold_failed", f"{what} is still folding after "
                     f"{self.fold_wait_seconds:g} s")
            return None
        if entry.data is None:
            ch.error("fold_failed", f"{what}: {entry.error}")
            return None
        return entry, entry.data

    def _get(self, ch: Conn, head: Head) -> None:
        held = self._held(ch, head.header)
        if held is None:
            return
        entry, data = held
        reply = {"ckpt_id": entry.key[1], "shard_index": entry.key[2],
                 "meta_len": len(entry.meta), **entry.info}
        ch.ok(reply, [entry.meta, data])

    def _list(self, ch: Conn, head: Head) -> None:
        ch.ok({"shards": self.store.listing(head.header["run_id"])})

    def _ping(self, ch: Conn, head: Head) -> None:
        ch.ok({"mem_used": self.store.mem_used,
               "mem_limit": self.store.mem_limit,
               "n_runs": self.store.n_runs})

    def _renew(self, ch: Conn, head: Head) -> None:
        h = head.header
        ch.ok({"held": self.store.renew(h["run_id"], h["lease_seconds"])})

    def _drop(self, ch: Conn, head: Head) -> None:
        freed = self.store.drop(head.header["run_id"])
        log.info("dropped run %s on request: freed %d bytes", head.header["run_id"], freed)
        ch.ok({"freed": freed})

    def _corrupt(self, ch: Conn, head: Head) -> None:
        """Fault injection (SPEC §9): flip one byte of a held shard in place."""
        if not self.allow_fault_injection:
            ch.error("refused", "fault injection is disabled on this daemon; start it "
                     "with --allow-fault-injection")
            return
        held = self._held(ch, head.header)
        if held is None:
            return
        entry, data = held
        offset = head.header.get("offset")
        if not isinstance(offset, int) or isinstance(offset, bool):
            offset = data.size // 2
        offset %= data.size
        data[offset] ^= 0xFF
        log.warning("fault injection: flipped byte %d of run %s checkpoint %d shard %d",
                    offset, *entry.key)
        ch.ok({"offset": offset})

    # ------------------------------------------------------------------------------ leases

    def _reap(self) -> None:
        while not self._stopping.wait(self.reap_interval_seconds):
            for run, freed in self.store.expire():
                if freed:
                    log.info("lease of run %s expired: freed %d bytes", run, freed)


def _key(h: dict[str, Any]) -> tuple[str, int, int]:
    return h["run_id"], h["ckpt_id"], h["shard_index"]


def _check_digest(
    expected: str | None, actual: str | None, what: str, fix: str = ""
) -> tuple[str, str] | None:
    if actual == expected:
        return None
    return ("digest_mismatch", f"digest mismatch on the {what} (expected {expected}, got "
            f"{actual})" + (f"; {fix}" if fix else ""))


def _check_meta(h: dict[str, Any], meta: bytes) -> tuple[str, str] | None:
    if digest_of(meta) == h["meta_digest"]:
        return None
    return ("digest_mismatch", f"meta of checkpoint {h['ckpt_id']} does not match its "
            "meta_digest; resend it")


def _close_after_error(
    sock: socket.socket, code: str, message: str, session: Session | None = None
) -> None:
    """Best effort: tell the client why, then drain briefly what it is still sending, so the
    close is a FIN the client can read the reason before, not a reset that loses it.
    ``code`` is one of ``calls.CLOSING_ERRORS``, after which clients drop the connection."""
    try:
        sock.settimeout(_LINGER_SECONDS)
        send_error(sock, code, message, session)
        sock.shutdown(socket.SHUT_WR)
        scratch = bytearray(64 * 1024)
        for _ in range(_LINGER_MAX_BYTES // len(scratch)):
            if not sock.recv_into(scratch):
                break
    except OSError:
        pass
