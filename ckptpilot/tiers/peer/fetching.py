"""The fetch half of :class:`~ckptpilot.tiers.peer.client.PeerTier`: discovering what the
peers hold (LIST) and fetching a checkpoint bit-exact, with digest checks and parity rebuild.

A fetch of a checkpoint this tier put goes straight to the peers it put it on (its layout):
requests to its parity group only, however many peers there are. Otherwise, or when any
shard fails there, every peer is asked what it holds (LIST) and the checkpoint is fetched
from the holders that answer. Every data shard is received in parallel (one request per
peer) straight into its place in one image, digested as it lands; the parity is fetched
alongside when a shard is known to be lost, so a rebuild costs one XOR pass more than an
intact fetch.

A mixin: it uses the tier's connections, thread pool, lock and layouts, which
:class:`~ckptpilot.tiers.peer.client.PeerTier` sets up (and its ``_request``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ckptpilot.hostmem import fresh_bytes
from ckptpilot.tiers.peer.digest import digest_of
from ckptpilot.tiers.peer.errors import PeerUnavailable, ProtocolError
from ckptpilot.tiers.peer.parity import Shard
from ckptpilot.tiers.peer.protocol import MAX_META_BYTES, Frame, Head, Op
from ckptpilot.tiers.peer.stripes import (
    MISMATCH,
    NOT_HELD,
    REQUEST_ERRORS,
    Layout,
    PeerFetchResult,
    Stripe,
    agreed_stripe,
    describe_failures,
    names_itself,
    reason_of,
)

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("ckptpilot.tiers.peer.client")  # the tier's messages, one logger


class Fetching:
    """``fetch`` and the LIST of every peer (see the module docstring)."""

    run_id: str
    endpoints: tuple[str, ...]
    timeout_seconds: float
    _pool: ThreadPoolExecutor
    _lock: threading.Lock
    _layouts: dict[int, Layout]

    def fetch(
        self, ckpt_id: int | None = None, *, into: np.ndarray | None = None,
        holders: Collection[str] = (),
    ) -> PeerFetchResult:
        """Checkpoint ``ckpt_id`` (None: the newest recoverable), bit-exact and verified.

        One missing or corrupt shard is rebuilt from parity; more raise
        :class:`PeerUnavailable` naming each missing shard and why. The image is received
        straight into ``into`` (its first ``image_len`` bytes; a writable 1-D uint8 array,
        say a buffer the caller reuses, whose memory is already mapped) or else into a fresh
        array; ``ValueError`` before anything is fetched when ``into`` is too small.

        ``holders``: where the caller's own record says ``ckpt_id`` was put (a restore in a
        fresh process, which did not put it: the peer row's location). Those of them this
        tier knows are asked first, alone, so a job's restart does not make every rank ask
        every daemon; every peer is asked only when they cannot deliver it.
        """
        start = time.perf_counter()
        self._check_open()
        if into is not None and not (isinstance(into, np.ndarray) and into.dtype == np.uint8
                                     and into.ndim == 1 and into.flags.writeable
                                     and into.flags.c_contiguous):
            raise ValueError("into must be a writable, contiguous 1-D uint8 numpy array")
        known = self._fetch_known(ckpt_id, start, into)
        if known is not None:
            return known
        asked = [e for e in holders if e in self.endpoints]
        if ckpt_id is not None and asked:
            recorded = self._fetch_from(ckpt_id, asked, start, into)
            if recorded is not None:
                return recorded
        catalog, unreachable = self._catalog()
        if ckpt_id is not None:
            candidates = [ckpt_id]
        else:
            candidates = sorted((c for c, s in catalog.items() if s.recoverable()),
                                reverse=True)
            candidates += sorted((c for c in catalog if c not in candidates and
                                  catalog[c].committed), reverse=True)
        if not candidates or (ckpt_id is not None and not (
                ckpt_id in catalog and catalog[ckpt_id].committed)):
            what = (f"no committed checkpoint of run {self.run_id!r} is held by a reachable peer"
                    if ckpt_id is None else
                    f"checkpoint {ckpt_id} of run {self.run_id!r} is held by no reachable peer"
                    if ckpt_id not in catalog else
                    f"checkpoint {ckpt_id} of run {self.run_id!r} was never committed (its put "
                    "failed)")
            down = "; ".join(f"{e}: {r}" for e, r in sorted(unreachable.items()))
            raise PeerUnavailable(what + (f" (unreachable: {down})" if down else ""),
                                  {-1: NOT_HELD})
        if into is not None and into.size < catalog[candidates[0]].image_len:
            raise ValueError(f"into holds {into.size} bytes; checkpoint {candidates[0]} of run "
                             f"{self.run_id!r} is {catalog[candidates[0]].image_len} bytes")
        errors: list[PeerUnavailable] = []
        for c in candidates:
            if into is not None and into.size < catalog[c].image_len:
                errors.append(PeerUnavailable(f"checkpoint {c} of run {self.run_id!r} is "
                                              f"{catalog[c].image_len} bytes, into holds "
                                              f"{into.size}", {-1: "into too small"}))
                continue
            try:
                return self._fetch_one(catalog[c], unreachable, start, into)
            except PeerUnavailable as e:
                log.warning("peer tier: %s", e)
                errors.append(e)
        raise errors[0]

    def _fetch_known(
        self, ckpt_id: int | None, start: float, into: np.ndarray | None
    ) -> PeerFetchResult | None:
        """Checkpoint ``ckpt_id`` from the peers this tier put it on, without asking every
        peer what it holds (LIST): a fetch then costs requests to its parity group only. None
        when this tier did not put it, or any shard fails there for any reason: then
        :meth:`fetch` asks every peer, as a tier that did not put it does."""
        with self._lock:
            layout = None if ckpt_id is None else self._layouts.get(ckpt_id)
        if layout is None or (into is not None and into.size < layout.image_len):
            return None
        stripe = Stripe(layout.ckpt_id, layout.data_shards, len(layout.endpoints),
                         layout.image_len, layout.shard_size, committed=True,
                         holders={i: [e] for i, e in enumerate(layout.endpoints)
                                  if e is not None})
        try:
            return self._fetch_one(stripe, {}, start, into)
        except PeerUnavailable as e:
            log.info("peer tier: checkpoint %d not fetched from where it was put (%s); asking "
                     "every peer", layout.ckpt_id, e)
            return None

    def _fetch_from(
        self, ckpt_id: int, holders: Sequence[str], start: float, into: np.ndarray | None
    ) -> PeerFetchResult | None:
        """Checkpoint ``ckpt_id`` from ``holders`` alone (LIST on them only); None when they
        do not hold all of it, committed, or any shard fails there: then :meth:`fetch` asks
        every peer."""
        catalog, unreachable = self._catalog(holders)
        stripe = catalog.get(ckpt_id)
        if stripe is None or not stripe.committed or (
                into is not None and into.size < stripe.image_len):
            return None
        try:
            return self._fetch_one(stripe, unreachable, start, into)
        except PeerUnavailable as e:
            log.info("peer tier: checkpoint %d not fetched from its recorded holders (%s); "
                     "asking every peer", ckpt_id, e)
            return None

    def _fetch_one(
        self, stripe: Stripe, unreachable: dict[str, str], start: float,
        into: np.ndarray | None,
    ) -> PeerFetchResult:
        """The checkpoint ``stripe`` describes: every data shard received in parallel (one
        request per peer) straight into its place in one image, digested as it arrives; for
        one missing or damaged shard, the parity is received into that shard's place, and
        the other data shards XORed into it there (no buffer of its own)."""
        n, size = stripe.data_shards, stripe.shard_size
        has_parity = stripe.shard_count > n
        image = (fresh_bytes(stripe.image_len) if into is None
                 else into[:stripe.image_len])
        places = [Shard.of_image(image, i, size, fill=False) for i in range(n)]
        frames: dict[int, Frame] = {}
        lost: dict[int, str] = {}
        fetched_bytes = [0]

        def fetch(indices: Sequence[int]) -> None:
            lone = next(iter(lost), 0)  # the parity goes where the one lost shard belongs
            wanted = {i: places[i] if i < n else places[lone] for i in indices}
            results = self._pool.map(
                lambda i: self._get_shard(stripe, i, wanted[i], fetched_bytes), indices)
            for i, result in zip(indices, results, strict=True):
                if isinstance(result, str):
                    lost[i] = result
                else:
                    frames[i] = result

        def with_parity(indices: list[int]) -> list[int]:
            if not stripe.holders.get(n):
                lost[n] = self._why_missing(stripe, n, unreachable)
                return indices
            return [*indices, n]

        for i in range(n):
            if not stripe.holders.get(i):
                lost[i] = self._why_missing(stripe, i, unreachable)
        wanted = [i for i in range(n) if i not in lost]
        if len(lost) == 1 and has_parity:  # known lost: fetch the parity alongside the data
            wanted = with_parity(wanted)
        if len(lost) <= 1:
            fetch(wanted)
        if len(lost) == 1 and has_parity and n not in frames and n not in lost:
            fetch(with_parity([]))  # a shard failed in flight
        if len(lost) > 1 or (lost and not has_parity):
            raise PeerUnavailable(
                f"checkpoint {stripe.ckpt_id} of run {self.run_id!r} cannot be recovered from "
                f"peers: {describe_failures(lost)}", lost)
        expected = agreed_stripe(list(frames.values()), stripe)
        rebuilt, digest = None, None
        if lost:
            rebuilt = next(iter(lost))
            digest = places[rebuilt].rebuild_from_parity(
                [places[i] for i in range(n) if i != rebuilt])
            if expected is None:
                raise PeerUnavailable(
                    f"checkpoint {stripe.ckpt_id}: shard {rebuilt} cannot be rebuilt from "
                    "parity: no fetched shard lists the save's digests (its COMMIT did not "
                    f"reach their peers) to check the result against (lost because: "
                    f"{lost[rebuilt]})", lost)
            if digest != expected[rebuilt]:
                raise PeerUnavailable(
                    f"checkpoint {stripe.ckpt_id}: shard {rebuilt} rebuilt from parity does not "
                    f"match its digest (lost because: {lost[rebuilt]})", lost)
            log.warning("peer tier: rebuilt shard %d of checkpoint %d from parity (%s)",
                        rebuilt, stripe.ckpt_id, lost[rebuilt])
        meta = next(iter(frames.values())).meta
        found: list[str | None] = [
            frames[i].payload_digest if i in frames else digest if i == rebuilt
            else expected[i] if expected is not None else None
            for i in range(stripe.shard_count)]
        return PeerFetchResult(stripe.ckpt_id, image, meta, fetched_bytes[0], rebuilt,
                               time.perf_counter() - start, tuple(found))

    def _get_shard(
        self, stripe: Stripe, index: int, place: Shard, fetched_bytes: list[int]
    ) -> Frame | str:
        """Shard ``index`` received into ``place`` from the first holder whose bytes match
        their digest, or why none did (a later holder overwrites a damaged copy)."""
        header = {"run_id": self.run_id, "ckpt_id": stripe.ckpt_id, "shard_index": index}
        size = stripe.shard_size

        def into(head: Head) -> Sequence[memoryview]:
            if head.header.get("shard_size") != size:
                raise ProtocolError(f"GET reply for shard {index} holds a shard of "
                                    f"{head.header.get('shard_size')!r} bytes, the stripe's "
                                    f"are {size}")
            return place.views()

        reasons = []
        for endpoint in stripe.holders[index]:
            try:
                reply = self._request(endpoint, Op.GET, header, reply_into=into,
                                      max_reply_payload=size + MAX_META_BYTES)
            except REQUEST_ERRORS as e:
                reasons.append(f"@{endpoint}: {reason_of(e)}")
                continue
            with self._lock:
                fetched_bytes[0] += size
            h = reply.header
            if reply.payload_digest != h.get("digest") or not names_itself(h, index, stripe):
                reasons.append(f"@{endpoint}: {MISMATCH} (shard {index} of checkpoint "
                               f"{stripe.ckpt_id}: expected {h.get('digest')!r}, received "
                               f"{reply.payload_digest})")
                continue
            if h.get("meta_digest") != digest_of(reply.meta):
                reasons.append(f"@{endpoint}: meta {MISMATCH}")
                continue
            return reply
        return "; ".join(reasons)

    def _why_missing(self, stripe: Stripe, index: int, unreachable: dict[str, str]) -> str:
        with self._lock:
            layout = self._layouts.get(stripe.ckpt_id)
        endpoint = layout.endpoints[index] if layout is not None else None
        if endpoint is not None and endpoint in unreachable:
            return f"@{endpoint}: {unreachable[endpoint]}"
        if index in stripe.failed:
            return stripe.failed[index]
        if endpoint is not None:
            return f"@{endpoint}: not held"
        down = ", ".join(f"{e}: {r}" for e, r in sorted(unreachable.items()))
        return "held by no reachable peer" + (f" (unreachable: {down})" if down else "")

    def _catalog(self, endpoints: Sequence[str] | None = None
                 ) -> tuple[dict[int, Stripe], dict[str, str]]:
        """LIST on every endpoint (or on ``endpoints``): this run's checkpoints by id, and why
        unreachable peers could not answer."""
        asked = tuple(self.endpoints if endpoints is None else endpoints)
        header = {"run_id": self.run_id}

        def ask(endpoint: str) -> list[dict[str, Any]] | str:
            try:
                return list(self._request(endpoint, Op.LIST, header).header.get("shards", []))
            except REQUEST_ERRORS as e:
                return reason_of(e)

        catalog: dict[int, Stripe] = {}
        unreachable: dict[str, str] = {}
        for endpoint, shards in zip(asked, self._pool.map(ask, asked), strict=True):
            if isinstance(shards, str):
                unreachable[endpoint] = shards
                continue
            for s in shards:
                c = int(s["ckpt_id"])
                stripe = catalog.setdefault(c, Stripe(c, int(s["data_shards"]),
                                                       int(s["shard_count"]),
                                                       int(s["image_len"]),
                                                       int(s["shard_size"])))
                if (s["data_shards"], s["shard_count"], s["image_len"], s["shard_size"]) != (
                        stripe.data_shards, stripe.shard_count, stripe.image_len,
                        stripe.shard_size):
                    log.warning("peer %s holds checkpoint %d with another layout; ignored",
                                endpoint, c)
                    continue
                stripe.committed |= bool(s["committed"])
                index = int(s["shard_index"])
                if s["state"] == "failed":
                    stripe.failed[index] = f"@{endpoint}: fold failed"
                else:
                    stripe.holders.setdefault(index, []).append(endpoint)
        return catalog, unreachable
