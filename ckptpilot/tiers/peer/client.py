"""The peer tier's client: put a checkpoint image as N data shards + 1 XOR parity shard in the
memory of N+1 peers, and fetch it back, surviving the loss of any one (SPEC §6).

Owns: :class:`PeerTier` (its connections, placement, lease, ``list`` and ``drop``) and
:class:`PeerCheckpointTier`. The put half (striping, placing, deltas, committing) is
``putting``, the fetch half (LIST, fetching, parity rebuild) ``fetching``, what both return
and share ``stripes``. Must not: interpret the image or the meta (the pilot's container
format does), or fall back to other tiers (it raises :class:`PeerUnavailable`).

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
one reused buffer); a fetch receives every shard in parallel (see ``fetching``).

Threading: ``put`` and ``fetch`` may be called from one thread at a time each (the pilot's
background writer, the restoring thread); they spread their transfers over an internal
thread pool. A daemon thread renews the lease every ``lease_seconds / 3`` until
:meth:`PeerTier.close`; a placement thread probes the peers every ``probe_interval``; with a
registry, a thread rereads it every ``probe_interval`` and one more writes the down marks.
Every request, probes included, goes over the tier's persistent connections
(``calls.Connections``): one handshake per peer and concurrent request, not per request.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from ckptpilot.errors import CkptPilotError, IntegrityError, NoCheckpointError
from ckptpilot.format.image import ImageMeta
from ckptpilot.tiers.base import (
    PLAIN,
    Check,
    CheckpointImage,
    OpenedImage,
    PutReceipt,
    Staged,
    StageOptions,
    TierCapabilities,
    put_in_two_phases,
)
from ckptpilot.tiers.peer.auth import load_secret
from ckptpilot.tiers.peer.calls import Connections, ReplyInto
from ckptpilot.tiers.peer.errors import (
    PEER_ERRORS,
    PeerRequestError,
    PeerUnavailable,
    ProtocolError,
)
from ckptpilot.tiers.peer.fetching import Fetching
from ckptpilot.tiers.peer.placement import PeerStatus, Placement, describe_failure
from ckptpilot.tiers.peer.protocol import Buffer, Frame, Op, parse_endpoint
from ckptpilot.tiers.peer.putting import DELTA_MODES, Putting
from ckptpilot.tiers.peer.stripes import (
    FULL,
    MISMATCH,
    NOT_HELD,
    PEER_GONE_ERRORS,
    REQUEST_ERRORS,
    Layout,
    PeerFetchResult,
    PeerPutResult,
    reason_of,
    stripe_record,
)
from ckptpilot.vocab import Tier

if TYPE_CHECKING:
    from ckptpilot.policy import PeerTierPolicy
    from ckptpilot.tiers.peer.membership import RegistryView

__all__ = ["DELTA_MODES", "FULL", "PeerCheckpointTier", "PeerFetchResult", "PeerPutResult",
           "PeerTier", "stripe_record"]

log = logging.getLogger(__name__)


class PeerTier(Putting, Fetching):
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
        self._layouts: dict[int, Layout] = {}
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
            if self.registry_view is not None and isinstance(e, PEER_GONE_ERRORS):
                self.registry_view.report_failure(
                    endpoint, f"{op.name} from run {self.run_id!r} failed: "
                    f"{describe_failure(e)}")
            raise
        self.placement.report(endpoint, True, time.perf_counter() - start)
        return reply

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
        except (*REQUEST_ERRORS, CkptPilotError):
            return False
        return True

    # ------------------------------------------------------------------------------ lease

    def _renew_loop(self) -> None:
        header = {"run_id": self.run_id, "lease_seconds": self.lease_seconds}
        def renew(endpoint: str) -> None:
            if self._closed.is_set():
                return
            try:
                self._connections.call(endpoint, Op.RENEW, header,
                                       timeout_seconds=self.timeout_seconds)
            except REQUEST_ERRORS as e:
                log.debug("lease renewal on %s failed: %s", endpoint, reason_of(e))

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
            except REQUEST_ERRORS as e:
                return reason_of(e)

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

    failures: tuple[type[BaseException], ...] = (*PEER_ERRORS, RuntimeError)

    def __init__(self, peers: PeerTier, *, rank: int) -> None:
        self.peers = peers
        self.rank = rank
        self.where = f"the peer tier ({', '.join(peers.endpoints)})"

    def _where(self, step: int) -> str:
        return f"peer:{self.peers.run_id}/{step}"

    def stage(self, image: CheckpointImage, base: CheckpointImage | None = None, *,
              options: StageOptions = PLAIN) -> Staged:
        """Encode the image's meta; the shards travel at :meth:`publish`, which sends and
        commits them in one step (a peer stores nothing visible before its COMMIT). The
        pending row records the meta's SHA256 (``options`` do not apply: the shards go
        raw or as deltas, never through the codecs)."""
        meta = self._meta(image)
        return Staged(image.step, self.kind, self._where(image.step),
                      hashlib.sha256(meta).hexdigest(), image.nbytes, None, "raw", None, image,
                      base, handle=meta)

    def validate(self, staged: Staged) -> Check:
        """Nothing is staged on the peers to look at: every shard is checked against the
        digest computed as it is sent, by its peer on receipt and after each fold, and the
        publication fails unless all of them pass."""
        return Check(True, "shard digests checked by the peers on receipt")

    def publish(self, staged: Staged) -> PutReceipt:
        """Stripe the arena over the peers, as XOR deltas against the base where they still
        hold it, and commit it once every shard is stored (a failed put leaves the previous
        image the one ``open`` returns). The receipt's ``digest`` is the
        :func:`stripe_record` of what this process sent: give it to :meth:`open` as
        ``expect``."""
        image, base, meta = staged.image, staged.base, staged.handle
        result = self.peers.put(image.step, image.arena.numpy(), meta,
                                base=None if base is None else (base.step, base.arena.numpy()))
        deltas = sorted({e for e in result.encodings if e != FULL})
        return PutReceipt(image.step, f"{self._where(image.step)}@"
                          f"{','.join(result.endpoints)}", result.bytes_sent,
                          delta=result.delta_shards > 0,
                          digest=stripe_record(meta, result.stripe),
                          codec="+".join(deltas) if deltas else "raw",
                          write_seconds=result.seconds)

    def abort(self, staged: Staged, why: str) -> str | None:
        """Nothing is committed before :meth:`publish`: nothing to set aside."""
        return None

    def put(self, image: CheckpointImage, base: CheckpointImage | None = None) -> PutReceipt:
        """:meth:`stage` → :meth:`validate` → :meth:`publish`."""
        return put_in_two_phases(self, image, base)

    def _meta(self, image: CheckpointImage) -> bytes:
        image.tensors()  # an arena that disagrees with its layout is refused before sending
        return ImageMeta(step=image.step, rank=self.rank, level=image.level,
                         reason=image.reason, retention_class=image.retention_class,
                         score=image.score, created_unix=time.time(), layout=image.layout,
                         state=dict(image.meta)).encode()

    def open(self, step: int, *, expect: str | None = None,
             at: str | None = None) -> OpenedImage:
        """:meth:`get`: the peers' image is fetched whole (every shard in parallel), from the
        daemons ``at`` (a receipt's location) names first."""
        return OpenedImage.of(self.get(step, expect=expect, holders=recorded_holders(at)))

    def locate(self, step: int) -> str:
        return self._where(step)

    def set_aside(self, step: int, why: str) -> str | None:
        """Nothing to keep: the peers hold one state per run and the next put replaces it."""
        return None

    def get(self, step: int, *, expect: str | None = None,
            holders: Sequence[str] = ()) -> CheckpointImage:
        """The image, every shard checked against its digest (one lost or corrupt shard is
        rebuilt from parity). A step the peers hold but never committed (a failed put) is not
        returned. Peers that cannot be reached raise :class:`PeerUnavailable`, or
        :class:`NoCheckpointError` when none that answered holds the step (with why the others
        did not answer).

        ``expect`` is the :func:`stripe_record` of the put, kept by the caller: then the meta
        and every shard fetched (or rebuilt) must be the ones that put sent, whatever digests
        the peers list, or this raises :class:`IntegrityError`. Without it, the peers' own
        digests are all that is checked (they catch damage, not a peer that forges).
        ``holders``: the daemons to ask first (``PeerTier.fetch``)."""
        where = self._where(step)
        try:
            fetched = self.peers.fetch(step, holders=holders)
        except PeerUnavailable as e:
            if e.failures == {-1: NOT_HELD}:
                raise NoCheckpointError(f"{where}: step {step}: {e}; restore it from the "
                                        "remote tier") from e
            if any(MISMATCH in reason for reason in e.failures.values()):
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


def recorded_holders(location: str | None) -> tuple[str, ...]:
    """The daemons a :class:`PeerCheckpointTier` receipt's location names
    (``peer:RUN/STEP@ENDPOINT,ENDPOINT,...``, in shard order); none for anything else."""
    if not location or not location.startswith("peer:") or "@" not in location:
        return ()
    return tuple(e for e in location.rsplit("@", 1)[1].split(",") if e)


def _either(
    first: Callable[[str], bool] | None, second: Callable[[str], bool]
) -> Callable[[str], bool]:
    if first is None:
        return second
    return lambda endpoint: first(endpoint) or second(endpoint)
