"""The peer tier's shard digest: XXH3-128, computed while the bytes stream by (SPEC §6).

Owns: the digest function, its text form on the wire, and hashing a stream of pieces. Must
not: decide what to do about a mismatch (the daemon replies ERR, the client rebuilds from
parity or names the shard).

What the digest guarantees. The client digests every shard of an image (data and parity)
from its own memory before sending; every shard carries its own digest and the digests of
its whole stripe. The daemon checks a shard's digest as the bytes arrive (a PUT) or after
folding a delta into its base (a DELTA, whose encoded bytes carry a digest of their own, so
a damaged delta is refused on arrival instead of failing its fold), keeps the digest with
the shard, and returns it on GET; the client checks it again as the bytes arrive, and
checks a shard rebuilt from parity against the stripe. So a byte changed anywhere between
the client's memory at put time and its memory at fetch time (on the wire, in a daemon's
RAM, by a fold against the wrong base, by a shard of another save) is detected, with a
chance of 2**-128 of a random change going unnoticed, and named by shard and peer.

What it does not guarantee: XXH3 is not cryptographic, and the digests travel with the
shards through the same daemons, so a peer that *wants* to return other bytes can forge them
with matching digests. So a restore does not take the peers' digests as the reference: the
trainer's metadata row keeps a SHA256 over the put's meta and the digests the trainer itself
computed as it sent (``client.stripe_record``), and the restorer proves the fetched copy
against it. That stops a peer that replaces shards and recomputes their digests; it still
rests on XXH3-128 against crafted second preimages, which XXH3 does not promise (the durable
archive's self-digested SHA256 manifest, ``tiers/remote/archive.py``, does). XXH3 was chosen
because it is an order of magnitude faster than SHA256 on one core, so hashing stays off the
critical path of a put and a fetch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np
import xxhash

BytesLike = bytes | bytearray | memoryview | np.ndarray
"""Anything with a contiguous buffer: the digest reads it in place."""

DIGEST_NAME = "xxh3-128"
DIGEST_HEX_CHARS = 32
_HEX = re.compile(r"[0-9a-f]{32}")


def digest_of(data: BytesLike) -> str:
    """The digest of ``data`` as lowercase hex (the wire form)."""
    return xxhash.xxh3_128_hexdigest(data)


def digest_of_pieces(pieces: Iterable[BytesLike]) -> str:
    """The digest of the concatenation of ``pieces``, without joining them."""
    hasher = xxhash.xxh3_128()
    for piece in pieces:
        hasher.update(piece)
    return hasher.hexdigest()


def is_digest(value: object) -> bool:
    """Whether ``value`` is a digest in its wire form."""
    return isinstance(value, str) and _HEX.fullmatch(value) is not None


Hasher = xxhash.xxh3_128
"""A streaming digest: ``update(piece)`` as pieces arrive, then ``hexdigest()``."""
