"""Choosing which peers receive a checkpoint's shards (SPEC §6: lowest RTT, then lowest memory).

Owns: probing every endpoint with PING in a background thread, remembering how each peer
did on its last transfer, and the ranking. Must not: send shards or decide how many are
needed (the client asks for ``n``).

The decision is pure: :func:`rank_peers` takes :class:`PeerReading` values and returns the
order; :class:`Placement` only gathers readings. A peer is *down* (never chosen) when its
last probe failed, when it was never probed successfully, or when the optional ``is_down``
callable (the health registry) says so. A peer whose last transfer failed or took longer
than ``timeout_seconds`` is *avoided*: chosen only when there are not enough other peers,
until a later transfer goes well or ``forgive_seconds`` pass.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ckptpilot.errors import CkptPilotError
from ckptpilot.tiers.peer.calls import call
from ckptpilot.tiers.peer.errors import NotEnoughPeers
from ckptpilot.tiers.peer.protocol import Op

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerStatus:
    """What one PING returned."""

    rtt_seconds: float
    mem_used: int
    mem_limit: int
    n_runs: int


@dataclass(frozen=True)
class PeerReading:
    """Everything the ranking knows about one endpoint."""

    endpoint: str
    up: bool
    rtt_seconds: float = math.inf
    mem_used: int = 0
    avoided: bool = False
    reason: str = "never probed"


def rank_peers(
    readings: Iterable[PeerReading],
    n: int,
    *,
    exclude: Iterable[str] = (),
    rtt_tie_seconds: float = 0.0005,
) -> list[str]:
    """The ``n`` best usable endpoints, best first; :class:`NotEnoughPeers` if too few.

    Usable: up and not excluded. Peers not avoided come first; within each group the order
    is RTT (RTTs in the same ``rtt_tie_seconds`` bucket count as tied), then memory in use,
    then the exact RTT and the name (so the result is deterministic).
    """
    skip = set(exclude)
    readings = list(readings)
    usable = [r for r in readings if r.up and r.endpoint not in skip]
    if len(usable) < n:
        down = [f"{r.endpoint} ({r.reason})" for r in readings
                if not r.up and r.endpoint not in skip]
        raise NotEnoughPeers(
            f"need {n} peers but only {len(usable)} are usable"
            + (f"; down: {', '.join(down)}" if down else "")
            + (f"; already used for this checkpoint: {', '.join(sorted(skip))}" if skip else "")
            + "; start more `ckptpilot peer serve` daemons or lower tiers.peer.data_shards"
        )
    tie = max(rtt_tie_seconds, 1e-9)

    def key(r: PeerReading) -> tuple[bool, float, int, float, str]:
        return (r.avoided, math.floor(r.rtt_seconds / tie), r.mem_used, r.rtt_seconds,
                r.endpoint)

    return [r.endpoint for r in sorted(usable, key=key)[:n]]


def ping(endpoint: str, timeout_seconds: float, *, key: bytes) -> PeerStatus:
    """PING one peer over a fresh connection authenticated with ``key`` (the round trip
    includes connecting); the peer tier probes through its pooled connections instead
    (``Placement(probe=...)``)."""
    start = time.perf_counter()
    reply = call(endpoint, Op.PING, {}, key=key, timeout_seconds=timeout_seconds)
    h = reply.header
    return PeerStatus(time.perf_counter() - start, int(h.get("mem_used", 0)),
                      int(h.get("mem_limit", 0)), int(h.get("n_runs", 0)))


class Placement:
    """Live readings of a fixed set of endpoints.

    Lifecycle: construct, :meth:`start` (one synchronous probe round, then a daemon thread
    probing every ``probe_interval`` seconds), :meth:`choose` / :meth:`report` from any
    thread, :meth:`close`. ``probe`` is the PING function (:func:`ping` with the job's key,
    or the tier's pooled one; a seam for tests); ``clock``
    times the forgiveness of avoided peers.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        probe_interval: float = 1.0,
        timeout_seconds: float = 10.0,
        is_down: Callable[[str], bool] | None = None,
        rtt_tie_seconds: float = 0.0005,
        forgive_seconds: float = 60.0,
        probe: Callable[[str, float], PeerStatus],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not endpoints:
            raise ValueError("the peer tier needs at least one endpoint (tiers.peer.endpoints)")
        if len(set(endpoints)) != len(endpoints):
            raise ValueError(f"duplicate peer endpoints in {list(endpoints)}")
        self.endpoints = tuple(endpoints)
        self.probe_interval = probe_interval
        self.timeout_seconds = timeout_seconds
        self.is_down = is_down
        self.rtt_tie_seconds = rtt_tie_seconds
        self.forgive_seconds = forgive_seconds
        self._probe = probe
        self._clock = clock
        self._lock = threading.Lock()
        self._readings = {e: PeerReading(e, up=False) for e in self.endpoints}
        self._avoided_since: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=min(16, len(self.endpoints)),
                                        thread_name_prefix="ckptpilot-peer-probe")

    def start(self) -> None:
        self.probe_now()
        self._thread = threading.Thread(target=self._loop, name="ckptpilot-peer-placement",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._pool.shutdown(wait=True)

    def probe_now(self) -> None:
        """Probe every endpoint once, in parallel, and record the readings."""
        probe_timeout = min(self.timeout_seconds, max(self.probe_interval, 0.5))
        results = self._pool.map(lambda e: self._probe_one(e, probe_timeout), self.endpoints)
        for endpoint, result in zip(self.endpoints, results, strict=True):
            with self._lock:
                old = self._readings[endpoint]
                if isinstance(result, PeerStatus):
                    self._readings[endpoint] = replace(
                        old, up=True, rtt_seconds=result.rtt_seconds, mem_used=result.mem_used,
                        reason="up")
                else:
                    if old.up:
                        log.warning("peer %s is down: %s", endpoint, result)
                    self._readings[endpoint] = replace(old, up=False, reason=result)

    def _probe_one(self, endpoint: str, timeout_seconds: float) -> PeerStatus | str:
        try:
            return self._probe(endpoint, timeout_seconds)
        except (OSError, CkptPilotError) as e:
            return describe_failure(e)

    def _loop(self) -> None:
        while not self._stop.wait(self.probe_interval):
            try:
                self.probe_now()
            except RuntimeError:  # the pool was shut down under us by close()
                return

    def report(self, endpoint: str, ok: bool, seconds: float) -> None:
        """How a transfer to ``endpoint`` went: failed or slower than ``timeout_seconds``
        means the peer is avoided next time; a good one clears that."""
        bad = not ok or seconds > self.timeout_seconds
        with self._lock:
            if bad:
                self._avoided_since[endpoint] = self._clock()
            else:
                self._avoided_since.pop(endpoint, None)

    def readings(self) -> list[PeerReading]:
        """A snapshot of the readings, with ``avoided`` and ``is_down`` applied."""
        now = self._clock()
        with self._lock:
            for e, since in list(self._avoided_since.items()):
                if now - since > self.forgive_seconds:
                    del self._avoided_since[e]
            # The stored readings are frozen and never avoided: copy only those that are (a
            # copy of every one would make each shard a put places cost O(peers)).
            out = [replace(r, avoided=True) if r.endpoint in self._avoided_since else r
                   for r in self._readings.values()]
        if self.is_down is not None:
            out = [replace(r, up=False, reason="marked down by the health registry")
                   if r.up and self.is_down(r.endpoint) else r for r in out]
        return out

    def is_usable(self, endpoint: str) -> bool:
        """Up and not avoided: fit to keep receiving a checkpoint's shard."""
        return any(r.endpoint == endpoint and r.up and not r.avoided for r in self.readings())

    def choose(self, n: int, *, exclude: Iterable[str] = ()) -> list[str]:
        """The ``n`` best usable peers (see :func:`rank_peers`)."""
        return rank_peers(self.readings(), n, exclude=exclude,
                          rtt_tie_seconds=self.rtt_tie_seconds)


def describe_failure(error: BaseException) -> str:
    """A short reason for a failed request, for error messages and logs."""
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(error, TimeoutError):
        return "timed out"
    if isinstance(error, ConnectionResetError):
        return "connection reset"
    if isinstance(error, OSError):
        return error.strerror or type(error).__name__
    return str(error)
