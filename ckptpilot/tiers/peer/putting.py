"""The put half of :class:`~ckptpilot.tiers.peer.client.PeerTier`: striping and placing a
checkpoint's shards, choosing between full shards and per-shard deltas, and committing.

Delta puts: ``put(c, image, meta, base=(b, base_image))`` may send a shard as a delta
against the same shard of ``b`` to the peer that holds it: its changed blocks, or the
codec's XOR delta (``deltas`` says which, and when: with ``deltas: auto`` only where a
delta is estimated faster than the full shard on the measured wire). The parity peer gets
the delta of the parity (its changed blocks lie where the data shards' did; XOR parity is
linear). The peer folds it into its copy of ``b`` in the background, so every holder keeps
one full state and a fetch reads exactly N shards, never a chain. A peer that no longer has
the base (restarted empty) gets the full shard; one that cannot be reached is replaced by a
newly chosen peer, which gets the full shard.

Commit: once every shard is acknowledged, COMMIT (with the stripe: every shard's digest)
goes to the new holders and to the reachable peers that may hold older data of this run:
after the tier's first COMMIT, which goes to every reachable peer (a previous process's
shards may be anywhere), those the tier sent a shard to, or could not reach, since they last
confirmed a COMMIT. Holders of the new checkpoint then drop the run's older states (after
their folds succeed); the other peers drop stale copies of the run. A put thus talks to its
parity group and the previous one, however many peers there are. A put that fails half-way
is never committed, so the previous committed checkpoint stays recoverable.

A mixin: it uses the tier's connections, placement, thread pool, lock and layouts, which
:class:`~ckptpilot.tiers.peer.client.PeerTier` sets up (and its ``_request``, ``_catalog``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ckptpilot.tiers.peer.deltas import (
    BLOCK_BYTES,
    blocks_payload,
    changed_blocks,
    choose,
    estimate,
    parity_blocks_payload,
    sample_ranges,
)
from ckptpilot.tiers.peer.digest import digest_of, digest_of_pieces
from ckptpilot.tiers.peer.errors import (
    NotEnoughPeers,
    PeerRequestError,
    PeerUnavailable,
    ProtocolError,
)
from ckptpilot.tiers.peer.parity import Shard, as_bytes, parity_chunks, parity_of, split
from ckptpilot.tiers.peer.placement import Placement, describe_failure
from ckptpilot.tiers.peer.protocol import (
    BLOCKS,
    MAX_META_BYTES,
    XOR_DELTA,
    Body,
    Buffer,
    Op,
    shard_tensor,
)
from ckptpilot.tiers.peer.stripes import (
    FULL,
    LAYOUTS_KEPT,
    REQUEST_ERRORS,
    Layout,
    PeerPutResult,
    describe_failures,
    reason_of,
)

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from ckptpilot.codecs.base import Codec

log = logging.getLogger("ckptpilot.tiers.peer.client")  # the tier's messages, one logger

DELTA_MODES = ("auto", "always", "never")
_RATE_ALPHA = 0.3  # weight of the newest transfer in a peer's measured wire rate


class _Masks:
    """The changed-block masks of one put's data shards against the base's, each computed
    once by whichever shard's thread needs it first (a ``blocks`` parity needs them all)."""

    def __init__(self, data: Sequence[Shard], old: Sequence[Shard]) -> None:
        self._data, self._old = data, old
        self._locks = [threading.Lock() for _ in data]
        self._masks: list[np.ndarray | None] = [None] * len(data)

    def get(self, index: int) -> np.ndarray:
        with self._locks[index]:
            mask = self._masks[index]
            if mask is None:
                mask = self._masks[index] = changed_blocks(self._data[index], self._old[index])
            return mask


@dataclass(frozen=True)
class _DeltaPlan:
    """A shard to send as a delta of ``encoding`` against the same shard of ``base_id``:
    ``old`` are the base's data shards; ``blob`` the ``xor_delta`` payload when the estimate
    already encoded all of it."""

    base_id: int
    old: list[Shard]
    masks: _Masks
    encoding: str
    blob: list[Buffer] | None


@dataclass(frozen=True)
class _Placed:
    """Where one shard went, the bytes sent for it, how (``PeerPutResult.encodings``), and
    the digest of the shard."""

    endpoint: str
    bytes_sent: int
    encoding: str
    digest: str


@dataclass
class _Claims:
    """Peers taken by one put, so that re-chosen peers stay distinct, and the peers that
    failed a shard of it with the reason (named by a shard left without a peer)."""

    taken: set[str]
    failed: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Putting:
    """``put`` and what it needs (see the module docstring)."""

    run_id: str
    data_shards: int
    shard_count: int
    endpoints: tuple[str, ...]
    deltas: str
    lease_seconds: float
    timeout_seconds: float
    placement: Placement
    _codec: Codec
    _pool: ThreadPoolExecutor
    _lock: threading.Lock
    _layouts: dict[int, Layout]
    _unsettled: set[str] | None
    _wire_rates: dict[str, float]

    def put(
        self,
        ckpt_id: int,
        image: Buffer,
        meta: Buffer,
        *,
        base: tuple[int, Buffer] | None = None,
    ) -> PeerPutResult:
        """Store ``image`` (with ``meta``, a few KB the caller needs to decode it) as
        checkpoint ``ckpt_id``; with ``base=(base_id, base_image)`` send deltas where the
        peers still hold ``base_id`` and a delta is estimated faster (``deltas: auto``, see
        ``deltas``) or forced (``always``). Raises :class:`PeerUnavailable` naming each shard
        that could not be placed (nothing is committed then)."""
        start = time.perf_counter()
        self._check_open()
        if isinstance(ckpt_id, bool) or not isinstance(ckpt_id, int) or ckpt_id < 0:
            raise ValueError(f"ckpt_id must be an integer >= 0, got {ckpt_id!r}")
        meta = bytes(meta)
        if len(meta) > MAX_META_BYTES:
            raise ValueError(f"meta of {len(meta)} bytes exceeds {MAX_META_BYTES}; keep it to "
                             "a small description of the state")
        data = split(image, self.data_shards)
        image_len, size = as_bytes(image).size, data[0].size
        common = {"run_id": self.run_id, "ckpt_id": ckpt_id, "shard_count": self.shard_count,
                  "data_shards": self.data_shards, "image_len": image_len, "shard_size": size,
                  "meta_len": len(meta), "meta_digest": digest_of(meta),
                  "lease_seconds": self.lease_seconds}

        targets: list[str | None] = [None] * self.shard_count
        plans: list[_DeltaPlan | None] = [None] * self.shard_count
        layout = (self._base_layout(base[0], image_len, size)
                  if base is not None and self.deltas != "never" else None)
        if base is not None and layout is not None:
            usable = {r.endpoint for r in self.placement.readings() if r.up and not r.avoided}
            holders = {i: e for i, e in enumerate(layout.endpoints) if e in usable}
            for i, endpoint in holders.items():
                targets[i] = endpoint
            plans = self._plan_deltas(base, data, holders)
        claims = _Claims({t for t in targets if t is not None})

        def place(i: int) -> _Placed:
            header = {**common, "shard_index": i,
                      "kind": "parity" if i == self.data_shards else "data"}
            return self._place(header, data, plans[i], targets[i], meta, claims)

        futures = [self._pool.submit(place, i) for i in range(self.shard_count)]
        placed: list[_Placed | None] = []
        failures: dict[int, str] = {}
        for i, fut in enumerate(futures):
            try:
                placed.append(fut.result())
            except PeerUnavailable as e:
                placed.append(None)
                failures[i] = str(e)
        if failures:
            raise PeerUnavailable(
                f"put of checkpoint {ckpt_id} of run {self.run_id!r} failed (nothing "
                f"committed): {describe_failures(failures)}", failures)
        done = [p for p in placed if p is not None]
        endpoints = tuple(p.endpoint for p in done)
        self._commit(ckpt_id, endpoints, [p.digest for p in done])
        with self._lock:
            self._layouts[ckpt_id] = Layout(ckpt_id, image_len, size, self.data_shards,
                                             endpoints)
            for old_id in sorted(self._layouts)[:-LAYOUTS_KEPT]:
                del self._layouts[old_id]
        deltas = sum(1 for p in done if p.encoding != FULL)
        return PeerPutResult(ckpt_id, endpoints, sum(p.bytes_sent for p in done),
                             len(done) - deltas, deltas, time.perf_counter() - start,
                             tuple(p.encoding for p in done), tuple(p.digest for p in done))

    def _plan_deltas(
        self, base: tuple[int, Buffer], data: Sequence[Shard], holders: dict[int, str]
    ) -> list[_DeltaPlan | None]:
        """Which shards go as deltas to the holders of the base, and as which kind (see
        ``deltas``): each shard's sample is measured here, before any transfer starts, so
        the estimates do not compete with the transfers for the CPU."""
        old = split(base[1], self.data_shards)
        masks = _Masks(data, old)
        ranges = sample_ranges(data[0].size)
        plans: list[_DeltaPlan | None] = [None] * self.shard_count
        for i, endpoint in holders.items():
            sources = [i] if i < self.data_shards else list(range(self.data_shards))
            est = estimate(self._codec, [data[j] for j in sources], [old[j] for j in sources],
                           ranges)
            kind = choose(est, self._wire_rate(endpoint), concurrent=len(holders),
                          cores=os.cpu_count() or 1, forced=self.deltas == "always")
            if kind is not None:
                plans[i] = _DeltaPlan(base[0], old, masks, kind,
                                      est.xor_blob if kind == XOR_DELTA else None)
        return plans

    def _delta_payload(
        self, index: int, data: Sequence[Shard], plan: _DeltaPlan
    ) -> tuple[str, list[Buffer], dict[str, Any]]:
        """The new shard's digest, the DELTA payload after the meta, and its header fields.
        ``blocks`` of a data shard are views of the image; of the parity, the changed
        blocks of the data shards (a block of the parity can only change where one of
        theirs did) cut from one streamed pass of the parity, which also digests it."""
        n = self.data_shards
        if plan.encoding == BLOCKS:
            fields = {"encoding": BLOCKS, "block_bytes": BLOCK_BYTES}
            if index < n:
                bitmap, views = blocks_payload(data[index], plan.masks.get(index))
                return digest_of_pieces(data[index].pieces), [bitmap, *views], fields
            changed = np.logical_or.reduce([plan.masks.get(j) for j in range(n)])
            digest, bitmap, views = parity_blocks_payload(data, changed)
            return digest, [bitmap, *views], fields
        new = data[index] if index < n else parity_of(data)
        blob = plan.blob
        if blob is None:
            old = plan.old[index] if index < n else parity_of(plan.old)
            blob = self._codec.encode_parts(shard_tensor(new.contiguous()),
                                            base=shard_tensor(old.contiguous()))
        return digest_of_pieces(new.pieces), blob, {"encoding": XOR_DELTA}

    def _wire_rate(self, endpoint: str) -> float | None:
        """Measured bytes/s of full shard transfers to ``endpoint`` (else the mean over the
        peers measured; None before the first full put)."""
        with self._lock:
            rate = self._wire_rates.get(endpoint)
            if rate is None and self._wire_rates:
                rate = sum(self._wire_rates.values()) / len(self._wire_rates)
            return rate

    def _note_wire(self, endpoint: str, nbytes: int, seconds: float) -> None:
        if seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            old = self._wire_rates.get(endpoint)
            self._wire_rates[endpoint] = (rate if old is None else
                                          _RATE_ALPHA * rate + (1 - _RATE_ALPHA) * old)

    def _place(
        self,
        header: dict[str, Any],
        data: Sequence[Shard],
        plan: _DeltaPlan | None,
        endpoint: str | None,
        meta: bytes,
        claims: _Claims,
    ) -> _Placed:
        """Send shard ``header["shard_index"]``: a delta to the base's holder first when
        planned, else (or when that holder lost the base) the full shard to that holder, or
        to fresh peers until one takes it. A full shard streams from the image (the parity
        is XORed a chunk at a time as it goes) and is digested as it is sent."""
        index = header["shard_index"]
        reasons: list[str] = []
        if endpoint is not None and plan is not None:
            digest, payload, fields = self._delta_payload(index, data, plan)
            delta_header = {**header, **fields, "base_id": plan.base_id, "digest": digest,
                            "delta_digest": digest_of_pieces(payload)}
            self._unsettle(endpoint)
            try:  # the payload's parts are sent as they are: joining them would copy them
                self._request(endpoint, Op.DELTA, delta_header, [meta, *payload])
                return _Placed(endpoint, sum(memoryview(p).nbytes for p in payload),
                               plan.encoding, digest)
            except PeerRequestError as e:
                if e.code != "no_base":
                    reasons.append(f"@{endpoint}: {e.message}")
                    endpoint = None
                # else: the peer is fine but lost the base (restarted): send it the full shard
            except (OSError, ProtocolError) as e:
                reasons.append(f"@{endpoint}: {describe_failure(e)}")
                endpoint = None
        shard = data[index] if index < self.data_shards else None
        body = Body(data[0].size, shard.chunks if shard is not None else
                    lambda: parity_chunks(data))
        for _ in range(len(self.endpoints)):
            if endpoint is None:
                endpoint = self._claim(claims, reasons)
            self._unsettle(endpoint)
            try:
                t0 = time.perf_counter()
                self._request(endpoint, Op.PUT, header, [meta, body])
                self._note_wire(endpoint, body.nbytes, time.perf_counter() - t0)
                assert body.digest is not None
                return _Placed(endpoint, body.nbytes, FULL, body.digest)
            except REQUEST_ERRORS as e:
                reasons.append(f"@{endpoint}: {reason_of(e)}")
                with claims.lock:
                    claims.failed[endpoint] = reasons[-1]
                endpoint = None
        raise PeerUnavailable("; ".join(reasons))

    def _claim(self, claims: _Claims, reasons: list[str]) -> str:
        """A usable peer no other shard of this put uses or failed on."""
        with claims.lock:
            try:
                chosen = self.placement.choose(1, exclude=claims.taken | claims.failed.keys())[0]
            except NotEnoughPeers as e:
                others = [why for why in claims.failed.values() if why not in reasons]
                raise PeerUnavailable("; ".join([*reasons, str(e), *others])) from e
            claims.taken.add(chosen)
            return chosen

    def _unsettle(self, endpoint: str) -> None:
        """``endpoint`` is about to get a shard of this run: a later COMMIT must reach it."""
        with self._lock:
            if self._unsettled is not None:
                self._unsettled.add(endpoint)

    def _commit(self, ckpt_id: int, holders: Sequence[str], stripe: list[str]) -> None:
        """COMMIT (with the stripe of digests) on the holders, and on the reachable peers that
        may hold older data of this run (every peer before this tier's first COMMIT; then
        those it sent a shard to, or could not reach, since they last confirmed one): holders
        keep ``ckpt_id`` and drop older states; the others drop stale copies of this run. At
        least one holder must confirm. A put thus costs requests to the peers of its parity
        group and of the previous one, however many peers there are."""
        header = {"run_id": self.run_id, "ckpt_id": ckpt_id, "lease_seconds": self.lease_seconds,
                  "stripe": stripe}
        with self._lock:
            unsettled = set(self.endpoints if self._unsettled is None else self._unsettled)
        reachable = {r.endpoint for r in self.placement.readings() if r.up}
        up = (unsettled & reachable) | set(holders)

        def commit(endpoint: str) -> str | None:
            try:
                self._connections.call(endpoint, Op.COMMIT, header,
                                       timeout_seconds=self.timeout_seconds)
                return None
            except REQUEST_ERRORS as e:
                return reason_of(e)

        targets = sorted(up)
        results = dict(zip(targets, self._pool.map(commit, targets), strict=True))
        for endpoint, error in results.items():
            if error is not None:
                log.warning("COMMIT of checkpoint %d on %s failed: %s", ckpt_id, endpoint, error)
        confirmed = {e for e, error in results.items() if error is None}
        with self._lock:
            self._unsettled = (unsettled - confirmed) | set(holders)
        if all(results[h] is not None for h in holders):
            raise PeerUnavailable(f"checkpoint {ckpt_id} of run {self.run_id!r} was sent but no "
                                  "holder confirmed its COMMIT: " + "; ".join(
                                      f"@{h}: {results[h]}" for h in holders))

    def _base_layout(self, base_id: int, image_len: int, size: int) -> Layout | None:
        """Where ``base_id``'s shards are, if a delta against it can work: remembered from
        this object's put, else discovered by LIST (a restarted process)."""
        with self._lock:
            layout = self._layouts.get(base_id)
        if layout is None:
            stripe = self._catalog()[0].get(base_id)
            if stripe is None or stripe.shard_count != self.shard_count:
                return None
            layout = Layout(base_id, stripe.image_len, stripe.shard_size, stripe.data_shards,
                             tuple((stripe.holders.get(i) or [None])[0]
                                   for i in range(stripe.shard_count)))
        if (layout.image_len, layout.shard_size, layout.data_shards) != (
                image_len, size, self.data_shards):
            return None
        return layout
