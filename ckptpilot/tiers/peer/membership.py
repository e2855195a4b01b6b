"""A process's link to the health registry (SPEC §6): peer daemons announce themselves in it,
peer-tier clients watch it and report the peers they found dead.

Owns: the threads that keep a daemon's state current (:class:`Announcer`: "up" with a
heartbeat, then "draining" and "down" on the way out) and a client's view of it current
(:class:`RegistryView`: which endpoints get no new shards), and reconnecting after the
registry went away. Must not: define how states are stored (``registry``), choose peers
(``placement``) or move shards.

Registry trouble never stops a daemon or fails a transfer: it is logged once per outage (a
warning when it starts, one when it ends), retried every interval, and while the registry
cannot be read every peer counts as not down (the placement's own probes still catch dead
peers).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ckptpilot.tiers.peer.registry import (
    HealthRegistry,
    NodeState,
    RegistryError,
    connect_registry,
)

log = logging.getLogger(__name__)

# What a registry that went away or misbehaves raises: torch.distributed.DistError (a
# RuntimeError, like RegistryError), OSError, and ValueError for unparsable contents.
_REGISTRY_ERRORS = (RuntimeError, OSError, ValueError)

Connect = Callable[..., HealthRegistry]
"""``connect_registry``'s signature; a seam for tests."""


class Announcer:
    """Publishes one peer daemon's state as node ``node`` of the registry at ``address``.

    Lifecycle: :meth:`start` connects and publishes "up" with ``endpoint`` (raises
    :class:`RegistryError` if the registry cannot be reached within ``timeout_seconds`` or has
    no node ``node``: a daemon told to announce itself must not serve unannounced); then a
    daemon thread heartbeats every ``heartbeat_seconds`` with ``mem_used()``. :meth:`drain`
    publishes "draining" (clients place no new shards there); :meth:`close` publishes "down"
    with a reason and waits at most ``wait_seconds`` for that write.

    A registry that goes away later is logged and reconnected every ``heartbeat_seconds``;
    a fresh (restarted, empty) registry gets the daemon's current state again. A node marked
    down by a client stays down through heartbeats (see ``HealthRegistry``), logged once.

    Threading: after :meth:`start`, every registry write happens on the announcer's thread;
    :meth:`drain` and :meth:`close` only ask for them, so a hung registry holds a daemon's
    shutdown up by ``wait_seconds`` at most.
    """

    def __init__(
        self,
        address: str,
        *,
        node: int,
        endpoint: str,
        mem_limit_bytes: int,
        mem_used: Callable[[], int],
        heartbeat_seconds: float = 1.0,
        timeout_seconds: float = 10.0,
        connect: Connect = connect_registry,
    ) -> None:
        if not heartbeat_seconds > 0:
            raise ValueError(f"heartbeat_seconds must be > 0, got {heartbeat_seconds!r}")
        self.address = address
        self.node = node
        self.endpoint = endpoint
        self.mem_limit_bytes = mem_limit_bytes
        self.heartbeat_seconds = heartbeat_seconds
        self.timeout_seconds = timeout_seconds
        self._mem_used = mem_used
        self._connect = connect
        self._registry: HealthRegistry | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._status, self._reason = "up", ""
        self._pending = False  # a status change not yet written
        self._final = False
        self._trouble: str | None = None  # the problem last logged, to log each one once
        self._told_marked_down = False
        self._thread = threading.Thread(target=self._loop, name="ckptpilot-peer-announce",
                                        daemon=True)

    def start(self) -> NodeState:
        """Connect, publish "up", start heartbeating; returns the state as stored."""
        registry = self._connect(self.address, node=self.node,
                                 timeout_seconds=self.timeout_seconds)
        try:
            stored = registry.publish(self._state())
        except _REGISTRY_ERRORS as e:
            raise RegistryError(f"node {self.node}: cannot publish to the health registry at "
                                f"{self.address}: {_first_line(e)}") from e
        self._registry = registry
        self._thread.start()
        log.info("announced node %d (%s) to the health registry at %s", self.node,
                 self.endpoint, self.address)
        return stored

    def drain(self, reason: str) -> None:
        """Publish "draining" soon (on the announcer's thread)."""
        self._ask("draining", reason)

    def close(self, reason: str, *, wait_seconds: float = 3.0) -> None:
        """Publish "down" with ``reason``, then stop; gives up after ``wait_seconds``."""
        self._ask("down", reason, final=True)
        if self._thread.is_alive():
            self._thread.join(wait_seconds)
        if self._thread.is_alive():
            log.warning("node %d: could not publish 'down' to the health registry at %s within "
                        "%g s; clients will find this daemon gone", self.node, self.address,
                        wait_seconds)

    def _ask(self, status: str, reason: str, *, final: bool = False) -> None:
        with self._lock:
            self._status, self._reason, self._pending = status, reason, True
            self._final = self._final or final
        self._wake.set()

    def _state(self) -> NodeState:
        return NodeState(node=self.node, status=self._status, endpoint=self.endpoint,
                         mem_used_bytes=self._mem_used(), mem_limit_bytes=self.mem_limit_bytes,
                         reason=self._reason)

    def _loop(self) -> None:
        while True:
            self._wake.wait(self.heartbeat_seconds)
            self._wake.clear()
            with self._lock:
                publish, final = self._pending, self._final
                self._pending = False
            try:
                self._write(publish, final=final)
                if self._trouble is not None:
                    log.warning("node %d: the health registry at %s is reachable again",
                                self.node, self.address)
                    self._trouble = None
            except _REGISTRY_ERRORS as e:
                with self._lock:
                    self._pending = self._pending or publish  # retry it next time
                self._registry = None  # a TCPStore client does not survive its server
                self._report_trouble(e, final)
            if final:
                return

    def _write(self, publish: bool, *, final: bool) -> None:
        registry = self._registry
        if registry is None and final:
            raise RegistryError("unreachable at the last attempt; not waiting for it on the "
                                "way out")
        if registry is None:
            registry = self._connect(self.address, node=self.node,
                                     timeout_seconds=min(self.timeout_seconds,
                                                         self.heartbeat_seconds))
            self._registry = registry
            publish = publish or registry.read(self.node) is None  # a fresh registry
        if publish:
            with self._lock:
                state = self._state()
            registry.publish(state)
            return
        stored = registry.heartbeat(mem_used_bytes=self._mem_used())
        marked_down = stored.status == "down" and self._status != "down"
        if marked_down and not self._told_marked_down:
            log.warning("node %d is marked down in the health registry (%s): clients place no "
                        "new shards here until this daemon restarts", self.node, stored.reason)
        self._told_marked_down = marked_down

    def _report_trouble(self, error: BaseException, final: bool) -> None:
        message = _first_line(error)
        if self._trouble is not None and not final:
            log.debug("node %d: health registry at %s: %s", self.node, self.address, message)
            return
        self._trouble = message
        log.warning("node %d: health registry at %s: %s; %s", self.node, self.address, message,
                    "giving up on publishing 'down'" if final else
                    f"still serving shards, retrying every {self.heartbeat_seconds:g} s")


class RegistryView:
    """A peer-tier client's view of the health registry at ``address``.

    :meth:`is_down` answers the placement's question from a cached set of endpoints whose
    node is "down" or "draining" (neither gets new shards), refreshed every
    ``refresh_seconds``; :meth:`report_failure` marks the node serving an endpoint down so
    that other clients avoid it too, unless ``answers(endpoint)`` (the tier's PING) says it
    answers by the time the report is written: a daemon that restarted meanwhile has
    published "up" again, and a down mark written after that would keep its new, healthy
    incarnation out of every client's placement until it restarts once more.

    Lifecycle: :meth:`start` (one refresh, waiting up to ``timeout_seconds`` for the
    registry; one that cannot be reached is logged, not raised), then :meth:`is_down` and
    :meth:`report_failure` from any thread, :meth:`close`.

    Threading: :meth:`is_down` reads the cached set only (no I/O on the transfer path); a
    daemon thread refreshes it; reports are written in order by one worker thread, so a slow
    registry delays neither transfers nor failover. A node marked down by another client is
    therefore seen up to ``refresh_seconds`` (plus one read of the registry) later.
    """

    def __init__(
        self,
        address: str,
        *,
        refresh_seconds: float = 1.0,
        timeout_seconds: float = 5.0,
        connect: Connect = connect_registry,
        answers: Callable[[str], bool] | None = None,
    ) -> None:
        if not refresh_seconds > 0:
            raise ValueError(f"refresh_seconds must be > 0, got {refresh_seconds!r}")
        self.address = address
        self._answers = answers
        self.refresh_seconds = refresh_seconds
        self.timeout_seconds = timeout_seconds
        self._connect = connect
        self._registry: HealthRegistry | None = None
        self._connect_lock = threading.Lock()
        self._lock = threading.Lock()
        self._excluded: frozenset[str] = frozenset()
        self._reporting: set[str] = set()
        self._trouble: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ckptpilot-peer-registry",
                                        daemon=True)
        self._reports = ThreadPoolExecutor(max_workers=1,
                                           thread_name_prefix="ckptpilot-peer-report")

    def start(self) -> None:
        self.refresh()
        self._thread.start()

    def close(self) -> None:
        """Stop refreshing; reports already asked for are written first (idempotent). With a
        hung registry this takes up to about ``timeout_seconds``."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.timeout_seconds)
        self._reports.shutdown(wait=True)

    def is_down(self, endpoint: str) -> bool:
        """True if the registry, when last read, had ``endpoint``'s node down or draining."""
        return endpoint in self._excluded

    def states(self) -> dict[int, NodeState]:
        """Every published node's state, read now; raises the registry's errors."""
        return self._reader().read_all(mark_stalled_down=True)

    def refresh(self) -> None:
        """Read the registry now and replace the cached set; on failure log and forget it."""
        try:
            states = self.states()
        except _REGISTRY_ERRORS as e:
            self._lost(e, "reading it")
            with self._lock:
                self._excluded = frozenset()
            return
        self._recovered()
        with self._lock:
            self._excluded = frozenset(s.endpoint for s in states.values()
                                       if s.status != "up" and s.endpoint)

    def report_failure(self, endpoint: str, reason: str) -> None:
        """Mark the node(s) publishing ``endpoint`` down with ``reason``, in the background.

        Nodes already down are left alone (their first reason stays), and reports on an
        endpoint already being reported are dropped.
        """
        with self._lock:
            if endpoint in self._reporting or self._stop.is_set():
                return
            self._reporting.add(endpoint)
        try:
            self._reports.submit(self._mark_down, endpoint, reason)
        except RuntimeError:  # closed meanwhile
            with self._lock:
                self._reporting.discard(endpoint)

    def _mark_down(self, endpoint: str, reason: str) -> None:
        try:
            registry = self._reader()
            states = registry.read_all(mark_stalled_down=True)
            nodes = [n for n, s in states.items()
                     if s.endpoint == endpoint and s.status != "down"]
            # Asked last, right before the write: the report may have waited in the queue
            # (or on a slow registry) while the daemon restarted and published "up".
            if nodes and self._answers is not None and self._answers(endpoint):
                log.info("peer %s failed (%s) but answers now; not marking it down", endpoint,
                         reason)
                return
            for node in nodes:
                registry.mark_down(node, reason)
            if nodes or any(s.endpoint == endpoint for s in states.values()):
                with self._lock:
                    self._excluded = self._excluded | {endpoint}
            else:
                log.info("peer %s failed (%s) but no node of the health registry publishes "
                         "it; nothing to mark down", endpoint, reason)
        except _REGISTRY_ERRORS as e:
            self._lost(e, f"marking {endpoint} down")
        finally:
            with self._lock:
                self._reporting.discard(endpoint)

    def _reader(self) -> HealthRegistry:
        with self._connect_lock:
            if self._registry is None:
                self._registry = self._connect(self.address,
                                               timeout_seconds=self.timeout_seconds)
            return self._registry

    def _loop(self) -> None:
        while not self._stop.wait(self.refresh_seconds):
            self.refresh()

    def _lost(self, error: BaseException, doing: str) -> None:
        with self._connect_lock:
            self._registry = None  # reconnect next time: a TCPStore client dies with its server
        message = _first_line(error)
        with self._lock:
            was, self._trouble = self._trouble, message
        if was is not None:  # once per outage
            log.debug("health registry at %s: %s failed: %s", self.address, doing, message)
            return
        log.warning("health registry at %s: %s failed: %s; meanwhile every peer counts as not "
                    "down, retrying every %g s", self.address, doing, message,
                    self.refresh_seconds)

    def _recovered(self) -> None:
        with self._lock:
            was, self._trouble = self._trouble, None
        if was is not None:
            log.warning("health registry at %s is reachable again", self.address)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
