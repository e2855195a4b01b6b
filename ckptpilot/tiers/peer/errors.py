"""Errors of the peer tier, on the ckptpilot hierarchy.

:class:`PeerUnavailable` is the one a caller acts on (fall back to the remote tier); the
others say why a single request or frame failed.
"""

from __future__ import annotations

from collections.abc import Mapping

from ckptpilot.errors import CkptPilotError


class ProtocolError(CkptPilotError, ValueError):
    """A frame is malformed: bad magic or version, unknown op, oversized or truncated parts,
    or a header that is not the JSON object its op requires. Close the connection."""


class PeerRequestError(CkptPilotError, RuntimeError):
    """A peer answered a request with ERR; ``code`` is machine-readable (``no_base``,
    ``out_of_memory``, ``not_found``, ``digest_mismatch``, ``fold_failed``, ``refused``,
    ``bad_request``)."""

    def __init__(self, endpoint: str, code: str, message: str) -> None:
        self.endpoint = endpoint
        self.code = code
        self.message = message
        super().__init__(f"{endpoint}: {message}")


class PeerUnavailable(CkptPilotError, RuntimeError):
    """The peer tier cannot store or return a checkpoint; ``failures`` maps each shard index
    (or ``-1`` for the checkpoint as a whole) to why. Recover from the remote tier."""

    def __init__(self, message: str, failures: Mapping[int, str] | None = None) -> None:
        self.failures = dict(failures or {})
        super().__init__(message)


class NotEnoughPeers(PeerUnavailable):
    """Fewer usable peers than shards to place."""


PEER_ERRORS: tuple[type[BaseException], ...] = (CkptPilotError, OSError, ValueError, KeyError,
                                                TypeError)
"""What a misbehaving peer tier can raise: never a reason to fail a save or a restore that
another tier can serve (a daemon of another version, a garbled reply, a dead socket)."""
