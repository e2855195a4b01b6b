"""What a peer-tier put and fetch return, and the stripe bookkeeping they share: where a
checkpoint's shards are (:class:`Layout`, from a put; :class:`Stripe`, from the peers' LIST
replies), the stripe record a caller keeps to prove a fetch, and the checks and wording of
failures both halves use (``putting``, ``fetching``; :class:`~ckptpilot.tiers.peer.client.
PeerTier` is both).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptpilot.tiers.peer.digest import is_digest
from ckptpilot.tiers.peer.errors import PeerRequestError, PeerUnavailable, ProtocolError
from ckptpilot.tiers.peer.placement import describe_failure
from ckptpilot.tiers.peer.protocol import Frame

REQUEST_ERRORS = (OSError, ProtocolError, PeerRequestError)
# Failures that say the peer is gone (reported to the health registry); a peer that answers
# ERR or sends a malformed frame is alive, and a name that does not resolve is our problem.
PEER_GONE_ERRORS = (ConnectionError, TimeoutError)
LAYOUTS_KEPT = 4
MISMATCH = "digest mismatch"
FULL = "full"
NOT_HELD = "not held"


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
class Layout:
    """Where a checkpoint's shards went (or were found), by shard index."""

    ckpt_id: int
    image_len: int
    shard_size: int
    data_shards: int
    endpoints: tuple[str | None, ...]


@dataclass
class Stripe:
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


def names_itself(header: dict[str, Any], index: int, stripe: Stripe) -> bool:
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


def reason_of(error: BaseException) -> str:
    if isinstance(error, PeerRequestError):
        return error.message
    return describe_failure(error)


def describe_failures(failures: dict[int, str]) -> str:
    return "; ".join(f"shard {i} {r}" if r.startswith("@") else f"shard {i}: {r}"
                     for i, r in sorted(failures.items()))


def agreed_stripe(frames: Sequence[Frame], stripe: Stripe) -> list[str] | None:
    """The save's shard digests, on which every fetched shard that lists them agrees (each
    committed shard carries them all); None when none lists them."""
    stripes = {tuple(f.header["stripe"]) for f in frames if "stripe" in f.header}
    if len(stripes) > 1:
        raise PeerUnavailable(f"checkpoint {stripe.ckpt_id}: the fetched shards disagree on "
                              "the stripe's digests (shards of different saves?)")
    return list(next(iter(stripes))) if stripes else None
