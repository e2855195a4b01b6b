"""The peer tier: checkpoint shards with XOR parity in the memory of other nodes (SPEC §6).

``protocol`` (wire frames) + ``auth`` (the job's secret, every frame's HMAC) ← ``calls``
(requests over authenticated connections); ``daemon`` + ``admission`` + ``store``
(``ckptpilot peer serve``, its CLI in ``command``) and ``placement`` + ``parity`` ←
``client`` (:class:`PeerTier`, what the pilot uses).
"""

from ckptpilot.tiers.peer.client import (
    PeerCheckpointTier,
    PeerFetchResult,
    PeerPutResult,
    PeerTier,
)
from ckptpilot.tiers.peer.errors import (
    PEER_ERRORS,
    NotEnoughPeers,
    PeerRequestError,
    PeerUnavailable,
    ProtocolError,
)

__all__ = [
    "PEER_ERRORS",
    "NotEnoughPeers",
    "PeerCheckpointTier",
    "PeerFetchResult",
    "PeerPutResult",
    "PeerRequestError",
    "PeerTier",
    "PeerUnavailable",
    "ProtocolError",
]
