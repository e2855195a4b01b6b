"""The health registry: which nodes are up, down or draining, and where their peer daemons listen.

It owns the layout of node states in a ``torch.distributed`` key-value store (the coordinator's
``TCPStore``) and the protocol that lets a state spread over several keys be rewritten while
other processes read it, and hosting / connecting to that store (:func:`host_registry`,
:func:`connect_registry`). It must not talk to peers or choose placements: daemons publish
(through ``membership.Announcer``), clients read (through ``membership.RegistryView``), and the
peer placement asks whether an endpoint is down.

Keys, all under ``ckptpilot/health/`` (``n`` is a node index):

``num_nodes``        how many nodes the registry holds (set once by :func:`host_registry`), so
                     that a reader needs only the store's address
``bitmap``           the master bitmap (SPEC §6): the set bits, each with the token of the writer
                     holding it, ``"<n>:<token>,<m>:<token>"`` sorted by bit, ``""`` when no bit
                     is set. Changed only with ``compare_set``; bit ``n`` set means node ``n``'s
                     state is being written, so it is also the write lock of that state.
``node/<n>/seq``     the version of node ``n``'s state, a counter changed only with ``add``;
                     0 means never published.
``node/<n>/status``  JSON ``{"v", "status", "reason"}``
``node/<n>/info``    JSON ``{"v", "endpoint", "mem_used_bytes", "mem_limit_bytes", "updated_at"}``

A write: set bit ``n`` (waiting while another writer holds it) → ``v = add(seq, 1)`` → set
``status`` stamped ``v`` → set ``info`` stamped ``v`` → clear bit ``n`` (only if this writer still
holds it). A read: ``s1 = seq`` → bit ``n`` clear? → read ``status`` and ``info`` (one
``multi_get``) → accept only if both stamps equal ``s1``; otherwise back off, retry, and give up
after ``retry_timeout_seconds`` with :class:`RegistryTimeoutError` naming the node.

Why an accepted read cannot mix two writes: every write stamps both keys with its own version,
and ``add`` hands each version to exactly one write, which sets each key once. Two keys stamped
``s1`` therefore hold exactly what write ``s1`` stored: one complete state, never parts of two.
The stamps are the seqlock's second ``seq`` read done per key, in the same round trip: a write
that began after ``s1`` and reached a key changed its stamp. They also protect readers from a
writer presumed dead (its bit taken over, below) that wakes up and writes on. Reads are
monotonic: an accepted state has version ``s1``, and ``seq`` only grows. The bit keeps writers of
one node exclusive (two interleaved writers could leave the keys stamped by different writes
for good) and tells readers to wait instead of spinning on a state in flux; it alone is not
enough, since a writer may take the bit between a reader's check and its key reads.

Dead writers: a bit whose holder token and ``seq`` have not changed for ``retry_timeout_seconds``
is stale. Readers then raise :class:`RegistryTimeoutError` (``stalled=True``); any writer
(:meth:`~HealthRegistry.publish`, :meth:`~HealthRegistry.mark_down`) takes the stale bit over
with one ``compare_set`` and writes on; :meth:`~HealthRegistry.is_down` treats a stalled node as
dead and marks it down, because a node that cannot prove it is alive must not receive shards.
"""

from __future__ import annotations

import datetime
import json
import logging
import random
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ckptpilot.tiers.peer.records import (
    BITMAP_KEY,
    NUM_NODES_KEY,
    PREFIX,
    NodeState,
    RegistryError,
    RegistryFormatError,
    RegistryTimeoutError,
    decode_bitmap,
    encode_bitmap,
    load_object,
)
from ckptpilot.tiers.peer.storeclient import StoreClient

if TYPE_CHECKING:
    import torch.distributed as dist

# Jitter for lock/retry back-off from a private generator: drawing from the global `random`
# would consume the training job's Python RNG and break a bit-exact resume.
_JITTER = random.Random()

log = logging.getLogger(__name__)

_BACKOFF_MIN_SECONDS = 0.0005
_BACKOFF_MAX_SECONDS = 0.01
# A writer that keeps losing bit n to other live writers gives up after this many timeouts
# (one timeout is needed just to see that a holder is stale).
_ACQUIRE_TIMEOUTS = 3
_CONNECT_RETRY_SECONDS = 0.1


def host_store(host: str, port: int, *, world_size: int | None = None,
               timeout_seconds: float = 30.0) -> dist.TCPStore:
    """Start the store server (the coordinator's job); ``port=0`` picks a free port (``.port``).

    It does not wait for workers: nodes come and go, and the registry never needs all of them.
    """
    import torch.distributed as dist

    return dist.TCPStore(host, port, world_size, True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_seconds))


def connect_store(host: str, port: int, *, timeout_seconds: float = 30.0) -> dist.TCPStore:
    """Connect to the store a coordinator hosts with torch's own client (:func:`connect_registry`
    uses the torch-free :class:`~ckptpilot.tiers.peer.storeclient.StoreClient`);
    ``timeout_seconds`` bounds connect and ops."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_seconds))


def host_registry(host: str, port: int, *, num_nodes: int,
                  timeout_seconds: float = 30.0) -> dist.TCPStore:
    """Host the registry of ``num_nodes`` nodes (``ckptpilot peer registry``); ``port=0``
    picks a free port (``.port``). Raises :class:`RegistryError` if ``host`` is not an address
    of this machine, ``torch.distributed.DistError`` if the store cannot listen (port taken).
    """
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes must be an integer >= 1, got {num_nodes!r}")
    # The store's own client connects to ``host`` and retries a bad one for ``timeout_seconds``
    # (with a C++ stack trace per try): fail at once instead.
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.bind(sockaddr)
    except OSError as e:
        raise RegistryError(f"{host} is no address of this machine ({e.strerror or e})") from e
    store = host_store(host, port, timeout_seconds=timeout_seconds)
    store.set(NUM_NODES_KEY, str(num_nodes))
    return store


def connect_registry(address: str, *, node: int | None = None, timeout_seconds: float = 10.0,
                     retry_timeout_seconds: float = 5.0) -> HealthRegistry:
    """The registry a ``ckptpilot peer registry`` hosts at ``"host:port"``, as node ``node``
    (None: a reader, which never publishes). Its size comes from the store.

    Waits up to ``timeout_seconds`` for the address to accept connections (a registry started
    at the same time as its nodes may not listen yet); ``timeout_seconds`` also bounds each
    store request later. Raises :class:`RegistryError` naming the address if it cannot be
    reached, is not a ckptpilot registry, or has no node ``node``.
    """
    from ckptpilot.tiers.peer.protocol import parse_endpoint

    host, port = parse_endpoint(address)
    _wait_until_listening(address, host, port, timeout_seconds)
    try:
        store = StoreClient(host, port, timeout_seconds=timeout_seconds)
        found = store.check([NUM_NODES_KEY])
        raw = store.get(NUM_NODES_KEY) if found else b""
    except OSError as e:  # refused, reset, timed out, not a store
        raise RegistryError(f"health registry at {address}: {_first_line(e)}") from e
    if not found:
        raise RegistryError(f"{address} serves a store without {NUM_NODES_KEY}: not a ckptpilot "
                            "health registry; start one with `ckptpilot peer registry --nodes N`")
    try:
        num_nodes = int(raw)
    except ValueError:
        raise RegistryFormatError(NUM_NODES_KEY, f"expected a node count, got {raw!r}") from None
    if node is not None and not 0 <= node < num_nodes:
        raise RegistryError(f"node {node} is out of range: the health registry at {address} "
                            f"holds {num_nodes} nodes (0..{num_nodes - 1})")
    return HealthRegistry(store, node=node, num_nodes=num_nodes,
                          retry_timeout_seconds=retry_timeout_seconds)


def _wait_until_listening(address: str, host: str, port: int, timeout_seconds: float) -> None:
    """Return once ``host:port`` accepts a TCP connection; :class:`RegistryError` after
    ``timeout_seconds``. Done here because the TCPStore client's own retries log a C++ stack
    trace per attempt."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(remaining, 0.05)):
                return
        except OSError as e:
            if time.monotonic() + _CONNECT_RETRY_SECONDS >= deadline:
                why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
                raise RegistryError(
                    f"cannot reach the health registry at {address} within "
                    f"{timeout_seconds:g} s: {why}; is `ckptpilot peer registry` running there?"
                ) from e
        time.sleep(_CONNECT_RETRY_SECONDS)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


class HealthRegistry:
    """Node ``node``'s view of the registry of ``num_nodes`` nodes kept in ``store``;
    ``node=None`` is a reader (a client), which may read and mark others down but not publish.

    Lifecycle: a node calls :meth:`publish` when its peer daemon is serving (status "up"),
    :meth:`heartbeat` periodically, and :meth:`publish` again to drain or leave. Anyone calls
    :meth:`mark_down` on a node it finds dead, and :meth:`read`, :meth:`read_all`,
    :meth:`is_down` whenever it needs to know. A node marked down by someone else stays down
    through its heartbeats until it publishes again: only an explicit publish revives it.

    Threading: methods may be called from any thread. The instance keeps no state beyond its
    configuration and a set of nodes known to have keys (only ever grows), and the
    ``TCPStore`` client serialises its own requests.
    """

    def __init__(self, store: dist.Store | StoreClient, *, node: int | None, num_nodes: int,
                 retry_timeout_seconds: float = 5.0,
                 clock: Callable[[], float] = time.time) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        if node is not None and not 0 <= node < num_nodes:
            raise ValueError(f"node must be in [0, {num_nodes}), got {node}")
        if retry_timeout_seconds <= 0:
            raise ValueError(f"retry_timeout_seconds must be > 0, got {retry_timeout_seconds}")
        self.store = store
        self.node = node
        self.num_nodes = num_nodes
        self.retry_timeout_seconds = retry_timeout_seconds
        self._clock = clock
        # Test seams: called between the two key writes of one state; False = writes ignore the
        # protocol (no bit, no new version), which is how the tests prove torn reads are caught.
        self._between_keys: Callable[[], None] | None = None
        self._guarded = True
        self._keys_exist: set[int] = set()  # nodes whose state keys exist (never deleted)

    # -- writing ---------------------------------------------------------------------------

    def publish(self, state: NodeState) -> NodeState:
        """Write this node's state; returns it as stored (with its ``seq`` and ``updated_at``)."""
        node = self._check_writer("publish")
        if state.node != node:
            raise ValueError(f"node {node} can only publish its own state, not node "
                             f"{state.node}'s (use mark_down for other nodes)")
        if not self._guarded:
            stored = replace(state, seq=self._seq(node), updated_at=self._clock())
            self._write_keys(stored)
            return stored
        with self._write_lock(node):
            stored = replace(state, seq=self._bump(node), updated_at=self._clock())
            self._write_keys(stored)
        return stored

    def heartbeat(self, *, mem_used_bytes: int | None = None) -> NodeState:
        """Republish this node's stored state with a fresh ``updated_at`` (and memory use).

        Status, endpoint and reason are kept as stored, so a down mark set by another node
        survives heartbeats. Raises :class:`RegistryError` if this node never published.
        """
        node = self._check_writer("heartbeat")
        if self._seq(node) == 0:
            raise RegistryError(f"node {node}: nothing to heartbeat; publish a state first")
        with self._write_lock(node):
            current = self._peek(node)
            if current is None:
                raise RegistryError(f"node {node}: stored state is missing or torn; "
                                    "publish a complete state")
            changes: dict[str, Any] = {"seq": self._bump(node),
                                       "updated_at": self._clock()}
            if mem_used_bytes is not None:
                changes["mem_used_bytes"] = mem_used_bytes
            stored = replace(current, **changes)
            self._write_keys(stored)
        return stored

    def mark_down(self, node: int, reason: str) -> NodeState:
        """Mark ``node`` down, keeping its endpoint so that placement recognises it.

        Any node may call it, for any node; it goes through the same bit as the node's own
        writes, and takes over a stale bit (a writer that died mid-write).
        """
        self._check_node(node)
        with self._write_lock(node):
            return self._write_down(node, reason)

    def _write_down(self, node: int, reason: str) -> NodeState:
        """Write ``node`` down, keeping its other fields; only while holding bit ``node``."""
        current = self._peek(node, tolerant=True) or NodeState(node=node, status="down")
        stored = replace(current, status="down", reason=reason, seq=self._bump(node),
                         updated_at=self._clock())
        self._write_keys(stored)
        log.warning("health registry: node %d marked down by %s: %s", node, self._who, reason)
        return stored

    # -- reading ---------------------------------------------------------------------------

    def read(self, node: int) -> NodeState | None:
        """The latest complete state of ``node``, or None if it never published.

        Waits (with backoff) while the node's state is being written; raises
        :class:`RegistryTimeoutError` after ``retry_timeout_seconds`` without a clean read, and
        :class:`RegistryFormatError` if a key holds something unparsable.
        """
        self._check_node(node)
        start = time.monotonic()
        delay = _BACKOFF_MIN_SECONDS
        first: tuple[str | None, int] | None = None
        while True:
            s1 = self._seq(node)
            if s1 == 0:
                return None
            holder = self._bitmap()[0].get(node)
            if holder is not None:
                why = f"bit {node} of the master bitmap is held by writer {holder}"
            else:
                state, why = self._read_keys(node, s1)
                if state is not None:
                    return state
            first = first or (holder, s1)
            waited = time.monotonic() - start
            if waited >= self.retry_timeout_seconds:
                stalled = (holder, s1) == first
                hint = ("nothing changed meanwhile: its writer probably died mid-write; "
                        f"mark_down({node}, ...) takes the bit over" if stalled else
                        "its writers kept rewriting it")
                raise RegistryTimeoutError(
                    node, f"no consistent state after {waited:.1f} s: {why}; {hint}",
                    stalled=stalled, holder=holder, seq=s1)
            time.sleep(delay * _JITTER.uniform(0.5, 1.0))
            delay = min(delay * 2, _BACKOFF_MAX_SECONDS)

    def read_all(self, *, mark_stalled_down: bool = False) -> dict[int, NodeState]:
        """The states of every node that has published, by node index; raises as :meth:`read`.

        ``mark_stalled_down``: a node whose state is stuck behind a dead writer's bit is
        marked down (a write to the store) instead of raising; what :meth:`is_down` does.
        """
        states = {}
        for node in range(self.num_nodes):
            state = self._read_or_mark_down(node) if mark_stalled_down else self.read(node)
            if state is not None:
                states[node] = state
        return states

    def is_down(self, endpoint: str) -> bool:
        """True if a node serving ``endpoint`` is marked down; the peer placement's question.

        A node whose state is stuck behind a dead writer's bit is marked down here (a write
        to the store) and counts as down. "draining" nodes are not down; an endpoint no node
        has published is not down either.
        """
        return any(state.endpoint == endpoint and state.status == "down"
                   for state in self.read_all(mark_stalled_down=True).values())

    def _read_or_mark_down(self, node: int) -> NodeState | None:
        try:
            return self.read(node)
        except RegistryTimeoutError as e:
            if not e.stalled:
                raise
            # Take the stalled bit over at once, but if the node wrote since it timed out,
            # it is alive after all: read it again instead of marking it down.
            with self._write_lock(node, stale_hint=(e.holder, e.seq)):
                state = (self._write_down(node, f"registry: stale write of its state ({e})")
                         if self._seq(node) == e.seq else None)
            return state or self.read(node)

    # -- the protocol ----------------------------------------------------------------------

    @contextmanager
    def _write_lock(self, node: int, *,
                    stale_hint: tuple[str | None, int] | None = None) -> Iterator[None]:
        """Hold bit ``node`` for the block; the block calls :meth:`_bump` just before writing,
        so that a failure while preparing leaves the stored state readable."""
        token = secrets.token_hex(6)
        self._acquire(node, token, stale_hint)
        try:
            yield
        finally:
            self._release(node, token)

    def _bump(self, node: int) -> int:
        """The version of the write about to happen; only while holding bit ``node``."""
        return int(self.store.add(self._key(node, "seq"), 1))

    def _acquire(self, node: int, token: str, stale_hint: tuple[str | None, int] | None) -> None:
        start = observed_since = time.monotonic()
        observed: tuple[str | None, int] | None = None
        delay = _BACKOFF_MIN_SECONDS
        while True:
            bits, raw = self._bitmap()
            holder = bits.get(node)
            if holder is not None:
                now = time.monotonic()
                seen = (holder, self._seq(node))
                if seen != observed:
                    observed, observed_since = seen, now
                stale = seen == stale_hint or now - observed_since >= self.retry_timeout_seconds
                if not stale:
                    if now - start >= _ACQUIRE_TIMEOUTS * self.retry_timeout_seconds:
                        raise RegistryTimeoutError(
                            node, f"bit {node} of the master bitmap stayed busy for "
                            f"{now - start:.1f} s (other writers kept taking it)",
                            stalled=False, holder=holder, seq=seen[1])
                    time.sleep(delay * _JITTER.uniform(0.5, 1.0))
                    delay = min(delay * 2, _BACKOFF_MAX_SECONDS)
                    continue
                log.warning("health registry: %s takes over bit %d from writer %s "
                            "(no progress for %.1f s; presumed dead)", self._who, node, holder,
                            now - observed_since)
            desired = encode_bitmap({**bits, node: token})
            # The new token makes ``desired`` unique, so getting it back means this swap won.
            if self.store.compare_set(BITMAP_KEY, raw, desired).decode() == desired:
                return

    def _release(self, node: int, token: str) -> None:
        while True:
            bits, raw = self._bitmap()
            if bits.get(node) != token:
                raise RegistryError(
                    f"node {node}: this write's bit was taken over by another writer that "
                    f"presumed it dead (it took longer than {self.retry_timeout_seconds} s); "
                    "readers ignore what it wrote: write again")
            del bits[node]
            desired = encode_bitmap(bits)
            if self.store.compare_set(BITMAP_KEY, raw, desired).decode() == desired:
                return

    def _write_keys(self, state: NodeState) -> None:
        status = {"v": state.seq, "status": state.status, "reason": state.reason}
        info = {"v": state.seq, "endpoint": state.endpoint,
                "mem_used_bytes": state.mem_used_bytes,
                "mem_limit_bytes": state.mem_limit_bytes, "updated_at": state.updated_at}
        self.store.set(self._key(state.node, "status"), json.dumps(status))
        if self._between_keys is not None:
            self._between_keys()
        self.store.set(self._key(state.node, "info"), json.dumps(info))

    def _read_keys(self, node: int, s1: int) -> tuple[NodeState | None, str]:
        """The state of version ``s1``, or None and why it is not (yet) readable.

        Both keys come back in one ``multi_get``, so that a reader fits in the short gaps
        between the writes of a node that rewrites its state nonstop.
        """
        loaded = self._load_keys(node)
        if loaded is None:
            return None, f"its keys are missing although seq is {s1}"
        stamps, state = loaded
        if stamps != [s1, s1]:
            return None, f"its keys are stamped {stamps}, not seq {s1}"
        return replace(state, seq=s1), ""

    def _peek(self, node: int, *, tolerant: bool = False) -> NodeState | None:
        """The stored fields of ``node`` whatever their stamps; only while holding its bit.

        ``tolerant``: unparsable keys count as absent (logged), so mark_down can repair them.
        """
        try:
            loaded = self._load_keys(node)
        except RegistryFormatError as e:
            if not tolerant:
                raise
            log.warning("health registry: ignoring the unparsable state of node %d: %s", node, e)
            return None
        return None if loaded is None else loaded[1]

    def _load_keys(self, node: int) -> tuple[list[int], NodeState] | None:
        """(stamps of the status and info keys, the state they describe), None if absent."""
        keys = [self._key(node, "status"), self._key(node, "info")]
        if node not in self._keys_exist:
            # multi_get would block on a missing key; keys are never deleted, so ask once.
            if not self.store.check(keys):
                return None
            self._keys_exist.add(node)
        values = self.store.multi_get(keys)
        fields_of = (("status", "reason"),
                     ("endpoint", "mem_used_bytes", "mem_limit_bytes", "updated_at"))
        merged: dict[str, Any] = {"node": node, "status": "down"}
        stamps = []
        for raw, key, names in zip(values, keys, fields_of, strict=True):
            doc = load_object(raw, key)
            if set(doc) != {"v", *names}:
                raise RegistryFormatError(key, f"expected the fields {['v', *names]}, "
                                          f"got {sorted(doc)}")
            stamp = doc.pop("v")
            if not isinstance(stamp, int) or isinstance(stamp, bool):
                raise RegistryFormatError(key, f"version stamp 'v' must be an integer, "
                                          f"got {stamp!r}")
            stamps.append(stamp)
            NodeState.from_dict({"node": node, "status": "down", **doc}, key=key)
            merged.update(doc)
        return stamps, NodeState.from_dict(merged, key=keys[0])

    def _bitmap(self) -> tuple[dict[int, str], str]:
        # compare_set(k, "", "") reads without blocking: it creates a missing key as "" and
        # otherwise returns the value unchanged (a plain get would wait for a missing key).
        raw = self.store.compare_set(BITMAP_KEY, "", "").decode()
        return decode_bitmap(raw), raw

    def _seq(self, node: int) -> int:
        return int(self.store.add(self._key(node, "seq"), 0))

    def _key(self, node: int, name: str) -> str:
        return f"{PREFIX}/node/{node}/{name}"

    def _check_node(self, node: int) -> None:
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node must be in [0, {self.num_nodes}), got {node}")

    @property
    def _who(self) -> str:
        return "a reader" if self.node is None else f"node {self.node}"

    def _check_writer(self, what: str) -> int:
        if self.node is None:
            raise RegistryError(f"a reader (node=None) cannot {what}: only a node writes its "
                                "own state; connect with node=<its index>")
        return self.node
