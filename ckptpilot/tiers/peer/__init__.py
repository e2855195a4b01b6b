"""The peer tier: checkpoint shards with XOR parity in the memory of other nodes (SPEC §6).

``protocol`` (wire frames) + ``auth`` (the job's secret, every frame's HMAC) ← ``calls``
(requests over authenticated connections); ``daemon`` + ``admission`` + ``store``
(``ckptpilot peer serve``, its CLI in ``command``) and ``placement`` + ``parity`` ←
``client`` (:class:`PeerTier`, what the pilot uses: its put half ``putting``, its fetch half
``fetching``, what both return ``stripes``); ``registry`` (over ``storeclient``) ←
``membership`` (daemons announce themselves, clients watch).

The errors are imported with the package, the client's names on first use (PEP 562): the
daemon's process imports this package and must not pull the client's torch with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ckptpilot.tiers.peer.errors import (
    PEER_ERRORS,
    NotEnoughPeers,
    PeerRequestError,
    PeerUnavailable,
    ProtocolError,
)

if TYPE_CHECKING:
    from ckptpilot.tiers.peer.client import (
        PeerCheckpointTier,
        PeerFetchResult,
        PeerPutResult,
        PeerTier,
    )

_LAZY = {name: "ckptpilot.tiers.peer.client" for name in
         ("PeerCheckpointTier", "PeerFetchResult", "PeerPutResult", "PeerTier")}

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptpilot.tiers.peer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
