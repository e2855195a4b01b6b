"""The peer tier's client: put a checkpoint image as N data shards + 1 XOR parity shard in the
memory of N+1 peers, and fetch it back, surviving the loss of any one (SPEC §6).

Owns: striping and placing shards, choosing between full shards and per-shard deltas,
committing, discovering what peers hold (LIST), fetching with digest checks and parity
rebuild, and renewing the run's lease. Must not: interpret the image or the meta (the pilot's
container format does), or fall back to other tiers (it raises :class:`PeerUnavailable`).

Delta puts: ``put(c, image, meta, base=(b, base_image))`` may send a shard as a delta
against the same shard of ``b`` to the peer that holds it: its changed blocks, or the
codec's XOR delta (``deltas`` says which, and when: with ``deltas: auto`` only where a
delta is estimated faster than the full shard on the measured wire). The parity peer gets
the delta of the parity (its changed blocks lie where the data shards' did; XOR parity is
linear). The peer folds it into its copy of ``b`` in the background, so every holder keeps
one full state and a fetch reads exactly N shards, never a chain. A peer that no longer has the base
(restarted empty) gets the full shard; one that cannot be reached is replaced by a newly
chosen peer, which gets the full shard.

Commit: once every shard is acknowledged, COMMIT (with the stripe: every shard's digest)
goes to every reachable endpoint. Holders
of the new checkpoint then drop the run's older states (after their folds succeed); other
peers drop stale copies of the run. A put that fails half-way is never committed, so the
previous committed checkpoint stays recoverable.

Long because put, fetch, list, drop, the lease and placement share one connection pool and one
stripe bookkeeping (which peer holds which shard of which checkpoint, which base each delta
needs); the wire format, parity maths and placement policy already live in their own modules.

Health registry (optional, ``registry="host:port"``): placement never chooses a peer whose
node the registry has down or draining, and a peer that refuses, resets or times out a
transfer is marked down there, so that other clients avoid it too. Registry trouble is logged
and never fails a put or fetch (see ``membership.RegistryView``).

Images: :class:`PeerCheckpointTier` is one rank's view of a :class:`PeerTier` as a
:class:`~ckptpilot.tiers.base.CheckpointTier`. Its image is the snapshot's arena, striped as
it is, with the meta of ``format.image`` (:class:`~ckptpilot.format.image.ImageMeta`).

Integrity and speed: every shard is checked against its XXH3-128 digest wherever it lands
(what that guarantees: ``digest``), and every frame is authenticated with the job's secret
(``auth``). Against a peer that lies (its secret leaked, or it is compromised), a put's
:attr:`PeerPutResult.stripe` is the digests this client computed as it sent; the caller
keeps their :func:`stripe_record` (the pilot: in its metadata row) and a fetch proves the
image against it (``PeerCheckpointTier.get(step, expect=...)``), never against a digest
the peers send. A put sends every shard in parallel straight from the
image's memory, digesting each chunk as it goes (the parity XORed a chunk at a time into
one reused buffer); a fetch receives every shard in parallel (one request per peer)
straight into its place in one fresh image, digesting each piece as it lands, and fetches
the parity alongside when a shard is known to be lost, so a rebuild costs one XOR pass
more than an intact fetch.

Threading: ``put`` and ``fetch`` may be called from one thread at a time each (the pilot's
background writer, the restoring thread); they spread their transfers over an internal
thread pool. A daemon thread renews the lease every ``lease_seconds / 3`` until
:meth:`PeerTier.close`; a placement thread probes the peers every ``probe_interval``; with a
registry, a thread rereads it every ``probe_interval`` and one more writes the down marks.
Every request, probes included, goes over the tier's persistent connections
(``protocol.Connections``): one handshake per peer and concurrent request, not per request.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ckptpilot.errors import CkptPilotError, IntegrityError, NoCheckpointError
from ckptpilot.format.image import ImageMeta
from ckptpilot.tiers.base import CheckpointImage, PutReceipt, TierCapabilities
from ckptpilot.tiers.peer.auth import load_secret
from ckptpilot.tiers.peer.calls import Connections, ReplyInto
from ckptpilot.tiers.peer.deltas import (
    BLOCK_BYTES,
    blocks_payload,
    changed_blocks,
    choose,
    estimate,
    parity_blocks_payload,
    sample_ranges,
)
from ckptpilot.tiers.peer.digest import digest_of, digest_of_pieces, is_digest
from ckptpilot.tiers.peer.errors import (
    NotEnoughPeers,
    PeerRequestError,
    PeerUnavailable,
    ProtocolError,
)
from ckptpilot.tiers.peer.parity import Shard, as_bytes, parity_chunks, parity_of, split
from ckptpilot.tiers.peer.placement import PeerStatus, Placement, describe_failure
from ckptpilot.tiers.peer.protocol import (
    BLOCKS,
    MAX_META_BYTES,
    XOR_DELTA,
    Body,
    Buffer,
    Frame,
    Head,
    Op,
    parse_endpoint,
    shard_tensor,
)
from ckptpilot.vocab import Tier

if TYPE_CHECKING:
    from ckptpilot.policy import PeerTierPolicy
    from ckptpilot.tiers.peer.membership import RegistryView

log = logging.getLogger(__name__)

_REQUEST_ERRORS = (OSError, ProtocolError, PeerRequestError)
DELTA_MODES = ("auto", "always", "never")
_RATE_ALPHA = 0.3  # weight of the newest transfer in a peer's measured wire rate
# Failures that say the peer is gone (reported to the health registry); a peer that answers
# ERR or sends a malformed frame is alive, and a name that does not resolve is our problem.
_PEER_GONE_ERRORS = (ConnectionError, TimeoutError)
_LAYOUTS_KEPT = 4
_MISMATCH = "digest mismatch"
FULL = "full"
_NOT_HELD = "not held"


@dataclass(frozen=True)
class PeerPutResult:
    """What a put did. ``endpoints[i]`` holds shard ``i`` (the parity shard is last);
    ``bytes_sent`` counts shard bytes and encoded deltas, not headers or meta;
    ``encodings[i]`` is how shard ``i`` travelled: ``"full"``, ``"blocks"`` or
    ``"xor_delta"``."""

    ckpt_id: int
    endpoints: tuple[str, ...]
    bytes_sent: int
    full_shards: int
    delta_shards: int
    seconds: float
    encodings: tuple[str, ...] = ()
    stripe: tuple[str, ...] = ()
    """The digest of each shard (the parity last), computed by this client as it sent."""


@dataclass(frozen=True)
class PeerFetchResult:
    """A fetched checkpoint: ``image`` is a fresh uint8 array owned by the caller (or the
    first bytes of the array the caller passed as ``fetch(into=...)``).
    ``bytes_fetched`` counts shard bytes received (N data shards when nothing was lost; the
    N - 1 others and the parity shard when one had to be rebuilt). ``digests`` is the
    stripe as this client found it: each shard's digest computed here from the bytes
    received (or rebuilt), and for a parity shard it did not need, the digest the peers
    list (None when none lists one); compare its :func:`stripe_record` with the put's."""

    ckpt_id: int
    image: np.ndarray
    meta: bytes
    bytes_fetched: int
    rebuilt_shard: int | None
    seconds: float
    digests: tuple[str | None, ...] = ()


@dataclass(frozen=True)
class _Layout:
    """Where a checkpoint's shards went (or were found), by shard index."""

    ckpt_id: int
    image_len: int
    shard_size: int
    data_shards: int
    endpoints: tuple[str | None, ...]


@dataclass
class _Stripe:
    """A checkpoint as the peers' LIST replies describe it."""

    ckpt_id: int
    data_shards: int
    shard_count: int
    image_len: int
    shard_size: int
    committed: bool = False
    holders: dict[int, list[str]] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)

    def missing(self) -> list[int]:
        return [i for i in range(self.shard_count) if not self.holders.get(i)]

    def recoverable(self) -> bool:
        lost = self.missing()
        has_parity = self.shard_count > self.data_shards
        return self.committed and (not lost or (has_parity and len(lost) == 1))


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


class PeerTier:
    """Checkpoints in the memory of peer daemons (see the module docstring).

    Lifecycle: construct (probes every endpoint once; with ``registry``, reads the health
    registry once, waiting up to ``min(timeout_seconds, 5)`` s for it), ``put`` / ``fetch``
    / ``list`` any number of times, :meth:`close` (or use as a context manager). Closing
    stops the lease renewal, so the peers free this run's shards ``lease_seconds`` later
    unless another :class:`PeerTier` with the same ``run_id`` takes over.

    ``is_down`` and ``registry`` both keep peers out of placement; ``registry_view`` is the
    tier's own :class:`~ckptpilot.tiers.peer.membership.RegistryView` (None without one).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        run_id: str,
        secret: bytes,
        data_shards: int = 3,
        parity: bool = True,
        lease_seconds: float = 600.0,
        timeout_seconds: float = 10.0,
        probe_interval: float = 1.0,
        is_down: Callable[[str], bool] | None = None,
        rtt_tie_seconds: float = 0.0005,
        registry: str | None = None,
        deltas: str = "auto",
    ) -> None:
        if not isinstance(run_id, str) or not 0 < len(run_id) <= 256:
            raise ValueError(f"run_id must be a non-empty string of at most 256 characters, "
                             f"got {run_id!r}")
        if data_shards < 1:
            raise ValueError(f"data_shards must be >= 1, got {data_shards}")
        for name, value in (("lease_seconds", lease_seconds),
                            ("timeout_seconds", timeout_seconds),
                            ("probe_interval", probe_interval)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        for endpoint in [*endpoints, *([registry] if registry is not None else [])]:
            parse_endpoint(endpoint)
        if deltas not in DELTA_MODES:
            raise ValueError(f"deltas must be one of {DELTA_MODES}, got {deltas!r}")
        self.deltas = deltas
        self._wire_rates: dict[str, float] = {}  # EWMA of full-shard PUT bytes/s per peer
        self.run_id = run_id
        self.data_shards = data_shards
        self.parity = parity
        self.shard_count = data_shards + (1 if parity else 0)
        if len(endpoints) < self.shard_count:
            raise ValueError(f"{self.shard_count} shards need {self.shard_count} distinct peers, "
                             f"got {len(endpoints)} endpoints; add peers or lower data_shards")
        self.endpoints = tuple(endpoints)
        self.lease_seconds = float(lease_seconds)
        self.timeout_seconds = float(timeout_seconds)
        from ckptpilot.codecs import get_codec

        self._codec = get_codec("xor_delta", threads=1)
        self._pool = ThreadPoolExecutor(max_workers=min(32, max(len(self.endpoints), 2)),
                                        thread_name_prefix="ckptpilot-peer-io")
        self._layouts: dict[int, _Layout] = {}
        # Peers that may hold data of this run that no COMMIT of this tier has superseded
        # there: None (all peers) until this tier's first COMMIT, which may find a previous
        # process's shards anywhere.
        self._unsettled: set[str] | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._connections = Connections(key=secret)
        self.registry_view: RegistryView | None = None
        if registry is not None:
            from ckptpilot.tiers.peer.membership import RegistryView

            self.registry_view = RegistryView(registry, refresh_seconds=probe_interval,
                                              timeout_seconds=min(timeout_seconds, 5.0),
                                              answers=self._answers)
            is_down = _either(is_down, self.registry_view.is_down)
        self.placement = Placement(self.endpoints, probe_interval=probe_interval,
                                   timeout_seconds=timeout_seconds, is_down=is_down,
                                   rtt_tie_seconds=rtt_tie_seconds, probe=self._probe)
        if self.registry_view is not None:
            self.registry_view.start()  # before the first placement: it must know who is down
        self.placement.start()
        self._renewer = threading.Thread(target=self._renew_loop, daemon=True,
                                         name="ckptpilot-peer-lease")
        self._renewer.start()

    @classmethod
    def from_policy(
        cls,
        policy: PeerTierPolicy,
        *,
        run_id: str,
        is_down: Callable[[str], bool] | None = None,
    ) -> PeerTier:
        """A tier configured by ``tiers.peer`` of the policy file, watching the health
        registry at ``tiers.peer.registry`` when it is set, with the job's secret from
        ``CKPTPILOT_PEER_SECRET`` or ``tiers.peer.secret_file`` (created when missing)."""
        secret = load_secret(policy.secret_file, what="tiers.peer.secret_file")
        return cls(policy.endpoints, run_id=run_id, secret=secret,
                   data_shards=policy.data_shards,
                   parity=policy.parity, lease_seconds=policy.lease_seconds,
                   timeout_seconds=policy.timeout_seconds,
                   probe_interval=policy.probe_interval, is_down=is_down,
                   registry=policy.registry, deltas=policy.deltas)

    def __enter__(self) -> PeerTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the background threads (idempotent); held shards stay until their lease ends."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._renewer.join()
        self.placement.close()
        self._pool.shutdown(wait=True)
        if self.registry_view is not None:
            self.registry_view.close()
        self._connections.close()

    # -------------------------------------------------------------------------------- put

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
                f"committed): {_describe(failures)}", failures)
        done = [p for p in placed if p is not None]
        endpoints = tuple(p.endpoint for p in done)
        self._commit(ckpt_id, endpoints, [p.digest for p in done])
        with self._lock:
            self._layouts[ckpt_id] = _Layout(ckpt_id, image_len, size, self.data_shards,
                                             endpoints)
            for old_id in sorted(self._layouts)[:-_LAYOUTS_KEPT]:
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
            except _REQUEST_ERRORS as e:
                reasons.append(f"@{endpoint}: {_reason(e)}")
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

    def _request(
        self, endpoint: str, op: Op, header: dict[str, Any], parts: Sequence[Buffer] = (),
        max_reply_payload: int = 0, reply_into: ReplyInto | None = None,
    ) -> Frame:
        """One request, with its outcome reported to placement (a failure or a transfer
        slower than ``timeout_seconds`` makes the peer avoided next time) and, when the peer
        seems gone, to the health registry."""
        start = time.perf_counter()
        try:
            reply = self._connections.call(endpoint, op, header, parts,
                                           timeout_seconds=self.timeout_seconds,
                                           max_reply_payload=max_reply_payload,
                                           reply_into=reply_into)
        except PeerRequestError as e:
            ok = e.code in ("no_base", "not_found")  # a sound peer answering a fair no
            self.placement.report(endpoint, ok, time.perf_counter() - start)
            raise
        except (OSError, ProtocolError) as e:
            self.placement.report(endpoint, False, time.perf_counter() - start)
            if self.registry_view is not None and isinstance(e, _PEER_GONE_ERRORS):
                self.registry_view.report_failure(
                    endpoint, f"{op.name} from run {self.run_id!r} failed: "
                    f"{describe_failure(e)}")
            raise
        self.placement.report(endpoint, True, time.perf_counter() - start)
        return reply

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
            except _REQUEST_ERRORS as e:
                return _reason(e)

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

    def _probe(self, endpoint: str, timeout_seconds: float) -> PeerStatus:
        """Placement's PING, over the pooled connections (the RTT is the request's alone)."""
        start = time.perf_counter()
        h = self._connections.call(endpoint, Op.PING, {}, timeout_seconds=timeout_seconds).header
        return PeerStatus(time.perf_counter() - start, int(h.get("mem_used", 0)),
                          int(h.get("mem_limit", 0)), int(h.get("n_runs", 0)))

    def _answers(self, endpoint: str) -> bool:
        """Whether ``endpoint`` answers a PING now (asked before a failure is reported to
        the health registry: see ``RegistryView``)."""
        try:
            self._probe(endpoint, min(self.timeout_seconds, 2.0))
        except (*_REQUEST_ERRORS, CkptPilotError):
            return False
        return True

    def _base_layout(self, base_id: int, image_len: int, size: int) -> _Layout | None:
        """Where ``base_id``'s shards are, if a delta against it can work: remembered from
        this object's put, else discovered by LIST (a restarted process)."""
        with self._lock:
            layout = self._layouts.get(base_id)
        if layout is None:
            stripe = self._catalog()[0].get(base_id)
            if stripe is None or stripe.shard_count != self.shard_count:
                return None
            layout = _Layout(base_id, stripe.image_len, stripe.shard_size, stripe.data_shards,
                             tuple((stripe.holders.get(i) or [None])[0]
                                   for i in range(stripe.shard_count)))
        if (layout.image_len, layout.shard_size, layout.data_shards) != (
                image_len, size, self.data_shards):
            return None
        return layout

    # ------------------------------------------------------------------------------ fetch

    def fetch(
        self, ckpt_id: int | None = None, *, into: np.ndarray | None = None
    ) -> PeerFetchResult:
        """Checkpoint ``ckpt_id`` (None: the newest recoverable), bit-exact and verified.

        One missing or corrupt shard is rebuilt from parity; more raise
        :class:`PeerUnavailable` naming each missing shard and why. The image is received
        straight into ``into`` (its first ``image_len`` bytes; a writable 1-D uint8 array,
        say a buffer the caller reuses, whose memory is already mapped) or else into a fresh
        array; ``ValueError`` before anything is fetched when ``into`` is too small.
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
                                  {-1: _NOT_HELD})
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
        stripe = _Stripe(layout.ckpt_id, layout.data_shards, len(layout.endpoints),
                         layout.image_len, layout.shard_size, committed=True,
                         holders={i: [e] for i, e in enumerate(layout.endpoints)
                                  if e is not None})
        try:
            return self._fetch_one(stripe, {}, start, into)
        except PeerUnavailable as e:
            log.info("peer tier: checkpoint %d not fetched from where it was put (%s); asking "
                     "every peer", layout.ckpt_id, e)
            return None

    def _fetch_one(
        self, stripe: _Stripe, unreachable: dict[str, str], start: float,
        into: np.ndarray | None,
    ) -> PeerFetchResult:
        """The checkpoint ``stripe`` describes: every data shard received in parallel (one
        request per peer) straight into its place in one image, digested as it arrives; for
        one missing or damaged shard, the parity is received into that shard's place, and
        the other data shards XORed into it there (no buffer of its own)."""
        n, size = stripe.data_shards, stripe.shard_size
        has_parity = stripe.shard_count > n
        image = (np.empty(stripe.image_len, dtype=np.uint8) if into is None
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
                f"peers: {_describe(lost)}", lost)
        expected = _agreed_stripe(list(frames.values()), stripe)
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
        self, stripe: _Stripe, index: int, place: Shard, fetched_bytes: list[int]
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
            except _REQUEST_ERRORS as e:
                reasons.append(f"@{endpoint}: {_reason(e)}")
                continue
            with self._lock:
                fetched_bytes[0] += size
            h = reply.header
            if reply.payload_digest != h.get("digest") or not _names_itself(h, index, stripe):
                reasons.append(f"@{endpoint}: {_MISMATCH} (shard {index} of checkpoint "
                               f"{stripe.ckpt_id}: expected {h.get('digest')!r}, received "
                               f"{reply.payload_digest})")
                continue
            if h.get("meta_digest") != digest_of(reply.meta):
                reasons.append(f"@{endpoint}: meta {_MISMATCH}")
                continue
            return reply
        return "; ".join(reasons)

    def _why_missing(self, stripe: _Stripe, index: int, unreachable: dict[str, str]) -> str:
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

    def _catalog(self) -> tuple[dict[int, _Stripe], dict[str, str]]:
        """LIST on every endpoint: this run's checkpoints by id, and why unreachable peers
        could not answer."""
        header = {"run_id": self.run_id}

        def ask(endpoint: str) -> list[dict[str, Any]] | str:
            try:
                return list(self._request(endpoint, Op.LIST, header).header.get("shards", []))
            except _REQUEST_ERRORS as e:
                return _reason(e)

        catalog: dict[int, _Stripe] = {}
        unreachable: dict[str, str] = {}
        for endpoint, shards in zip(self.endpoints, self._pool.map(ask, self.endpoints),
                                    strict=True):
            if isinstance(shards, str):
                unreachable[endpoint] = shards
                continue
            for s in shards:
                c = int(s["ckpt_id"])
                stripe = catalog.setdefault(c, _Stripe(c, int(s["data_shards"]),
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

    # ------------------------------------------------------------------------------ lease

    def _renew_loop(self) -> None:
        header = {"run_id": self.run_id, "lease_seconds": self.lease_seconds}
        def renew(endpoint: str) -> None:
            if self._closed.is_set():
                return
            try:
                self._connections.call(endpoint, Op.RENEW, header,
                                       timeout_seconds=self.timeout_seconds)
            except _REQUEST_ERRORS as e:
                log.debug("lease renewal on %s failed: %s", endpoint, _reason(e))

        # In parallel, so that unreachable peers cost one timeout, not one each, and close()
        # never waits behind a row of them.
        while not self._closed.wait(self.lease_seconds / 3):
            try:
                list(self._pool.map(renew, self.endpoints))
            except RuntimeError:  # the pool was shut down by close() meanwhile
                return

    def list(self) -> list[int]:
        """Checkpoint ids of this run that the peers can return, oldest first."""
        self._check_open()
        return sorted(c for c, s in self._catalog()[0].items() if s.recoverable())

    def drop(self, ckpt_id: int) -> None:
        """Free checkpoint ``ckpt_id`` on every reachable peer (nothing when none holds it).

        Peers drop whole runs only; that is this checkpoint and anything older, which the
        peers supersede anyway. A newer committed checkpoint would go with it, so then this
        raises instead. A peer that cannot be reached keeps its shards until the lease ends.
        """
        self._check_open()
        catalog = self._catalog()[0]
        if ckpt_id not in catalog:
            return
        newer = sorted(c for c, s in catalog.items() if c > ckpt_id and s.committed)
        if newer:
            raise PeerUnavailable(
                f"cannot drop checkpoint {ckpt_id} of run {self.run_id!r} alone: the peers "
                f"also hold the newer {newer} and free only whole runs; drop {newer[-1]}, "
                "which frees both", {-1: "newer checkpoint held"})

        def drop(endpoint: str) -> str | None:
            try:
                self._connections.call(endpoint, Op.DROP, {"run_id": self.run_id},
                                       timeout_seconds=self.timeout_seconds)
                return None
            except _REQUEST_ERRORS as e:
                return _reason(e)

        for endpoint, error in zip(self.endpoints, self._pool.map(drop, self.endpoints),
                                   strict=True):
            if error is not None:
                log.warning("DROP of run %r on %s failed (its shards stay until the lease "
                            "ends): %s", self.run_id, endpoint, error)

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise RuntimeError("this PeerTier is closed")


class PeerCheckpointTier:
    """The images of one rank on a :class:`PeerTier` (see "Images" in the module docstring).
    Owns the tier: :meth:`close` closes it."""

    kind = Tier.PEER
    capabilities = TierCapabilities(durable=False, survives_node_loss=True, folds_deltas=True,
                                    speed=Tier.PEER.speed, keeps_older=False)

    def __init__(self, peers: PeerTier, *, rank: int) -> None:
        self.peers = peers
        self.rank = rank

    def _where(self, step: int) -> str:
        return f"peer:{self.peers.run_id}/{step}"

    def put(self, image: CheckpointImage, base: CheckpointImage | None = None) -> PutReceipt:
        """Stripe the arena over the peers, as XOR deltas against ``base`` where they still
        hold it; committed only once every shard is stored, so a failed put leaves the
        previous image the one ``get`` returns."""
        return self.put_stripe(image, base)[0]

    def _meta(self, image: CheckpointImage) -> bytes:
        image.tensors()  # an arena that disagrees with its layout is refused before sending
        return ImageMeta(step=image.step, rank=self.rank, level=image.level,
                         reason=image.reason, retention_class=image.retention_class,
                         score=image.score, created_unix=time.time(), layout=image.layout,
                         state=dict(image.meta)).encode()

    def put_stripe(self, image: CheckpointImage, base: CheckpointImage | None = None
                   ) -> tuple[PutReceipt, str]:
        """:meth:`put`, and the :func:`stripe_record` to give :meth:`get` as ``expect``."""
        meta = self._meta(image)
        result = self.peers.put(image.step, image.arena.numpy(), meta,
                                base=None if base is None else (base.step, base.arena.numpy()))
        receipt = PutReceipt(image.step, f"{self._where(image.step)}@"
                             f"{','.join(result.endpoints)}", result.bytes_sent,
                             delta=result.delta_shards > 0)
        return receipt, stripe_record(meta, result.stripe)

    def get(self, step: int, *, expect: str | None = None) -> CheckpointImage:
        """The image, every shard checked against its digest (one lost or corrupt shard is
        rebuilt from parity). A step the peers hold but never committed (a failed put) is not
        returned. Peers that cannot be reached raise :class:`PeerUnavailable`, or
        :class:`NoCheckpointError` when none that answered holds the step (with why the others
        did not answer).

        ``expect`` is the :func:`stripe_record` of the put, kept by the caller: then the meta
        and every shard fetched (or rebuilt) must be the ones that put sent, whatever digests
        the peers list, or this raises :class:`IntegrityError`. Without it, the peers' own
        digests are all that is checked (they catch damage, not a peer that forges)."""
        where = self._where(step)
        try:
            fetched = self.peers.fetch(step)
        except PeerUnavailable as e:
            if e.failures == {-1: _NOT_HELD}:
                raise NoCheckpointError(f"{where}: step {step}: {e}; restore it from the "
                                        "remote tier") from e
            if any(_MISMATCH in reason for reason in e.failures.values()):
                raise IntegrityError(f"{where}: step {step}", "the shard digests of its put",
                                     str(e)) from e
            raise
        if expect is not None:
            found = (stripe_record(fetched.meta, fetched.digests)
                     if all(d is not None for d in fetched.digests) else "an unverifiable stripe"
                     " (no fetched shard lists the parity's digest)")
            if found != expect:
                raise IntegrityError(
                    f"{where}: step {step}: the peers' copy is not the one this trainer put "
                    "(digest mismatch against the stripe recorded in its metadata row at save "
                    "time: a peer returned other bytes or digests)", expect, found)
        meta = ImageMeta.decode(fetched.meta, where=where, step=step, rank=self.rank)
        arena = torch.from_numpy(fetched.image)
        if fetched.rebuilt_shard is not None:
            where += f" (shard {fetched.rebuilt_shard} rebuilt from parity)"
        return CheckpointImage(step, meta.state, arena, meta.layout, meta.level, meta.reason,
                               meta.retention_class, meta.score, source=where,
                               bytes_read=fetched.bytes_fetched)

    def steps(self) -> list[int]:
        return self.peers.list()

    def discard(self, step: int) -> None:
        self.peers.drop(step)

    def close(self) -> None:
        self.peers.close()


def stripe_record(meta: bytes, stripe: Sequence[str | None]) -> str:
    """SHA256 over a put's meta and its stripe of shard digests: what the caller keeps to
    prove a later fetch (a peer that alters the meta, a shard, or a digest changes it)."""
    h = hashlib.sha256(b"ckptpilot-peer-stripe-v1\0")
    h.update(hashlib.sha256(meta).digest())
    for digest in stripe:
        if digest is None:
            raise ValueError("a stripe record needs every shard's digest")
        h.update(bytes.fromhex(digest))
    return h.hexdigest()


def _either(
    first: Callable[[str], bool] | None, second: Callable[[str], bool]
) -> Callable[[str], bool]:
    if first is None:
        return second
    return lambda endpoint: first(endpoint) or second(endpoint)


def _names_itself(header: dict[str, Any], index: int, stripe: _Stripe) -> bool:
    """Whether a GET reply's header has a digest and, when it lists the save's stripe (once
    its COMMIT reached that peer), a stripe of this checkpoint's shape with that digest at
    ``index`` (what ``_agreed_stripe`` and a rebuild rely on)."""
    if not is_digest(header.get("digest")):
        return False
    if "stripe" not in header:
        return True
    listed = header["stripe"]
    return (isinstance(listed, list) and len(listed) == stripe.shard_count
            and all(is_digest(d) for d in listed) and listed[index] == header["digest"])


def _reason(error: BaseException) -> str:
    if isinstance(error, PeerRequestError):
        return error.message
    return describe_failure(error)


def _describe(failures: dict[int, str]) -> str:
    return "; ".join(f"shard {i} {r}" if r.startswith("@") else f"shard {i}: {r}"
                     for i, r in sorted(failures.items()))


def _agreed_stripe(frames: Sequence[Frame], stripe: _Stripe) -> list[str] | None:
    """The save's shard digests, on which every fetched shard that lists them agrees (each
    committed shard carries them all); None when none lists them."""
    stripes = {tuple(f.header["stripe"]) for f in frames if "stripe" in f.header}
    if len(stripes) > 1:
        raise PeerUnavailable(f"checkpoint {stripe.ckpt_id}: the fetched shards disagree on "
                              "the stripe's digests (shards of different saves?)")
    return list(next(iter(stripes))) if stripes else None
