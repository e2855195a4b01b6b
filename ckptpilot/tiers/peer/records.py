"""What the health registry stores and the errors it raises: the key names, a node's
:class:`NodeState` and the bitmap that says which writer holds which node's bit, each parsed
as untrusted input (any process that reaches the store can write its keys).

Split from :mod:`ckptpilot.tiers.peer.registry`, which reads and writes them through the
store; everything here is plain data and parsing, so it imports neither torch nor a store.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from ckptpilot.errors import CkptPilotError

PREFIX = "ckptpilot/health"
BITMAP_KEY = f"{PREFIX}/bitmap"
NUM_NODES_KEY = f"{PREFIX}/num_nodes"
STATUSES = ("up", "down", "draining")


class RegistryError(CkptPilotError, RuntimeError):
    """The health registry cannot be read or written as asked."""


class RegistryFormatError(RegistryError, ValueError):
    """A registry key in the store holds something this version cannot parse; ``key`` names it."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message} (was the key written by something other than "
                         "ckptpilot's HealthRegistry? republishing the node overwrites it)")


class RegistryTimeoutError(RegistryError, TimeoutError):
    """No consistent state of ``node`` could be read (or its bit taken) within the timeout.

    ``stalled`` is True when nothing moved while waiting (same bit holder ``holder``, same
    ``seq``): the writer most likely died mid-write, and ``mark_down(node, ...)`` recovers.
    """

    def __init__(self, node: int, message: str, *, stalled: bool, holder: str | None,
                 seq: int) -> None:
        self.node = node
        self.stalled = stalled
        self.holder = holder
        self.seq = seq
        super().__init__(f"node {node}: {message}")


@dataclass(frozen=True)
class NodeState:
    """What the registry knows about one node; ``seq`` and ``updated_at`` are set by the registry.

    ``updated_at`` is the writer's Unix time in seconds, for people and logs: registry logic
    never compares clocks of different machines.
    """

    node: int
    status: str
    endpoint: str = ""
    mem_used_bytes: int = 0
    mem_limit_bytes: int = 0
    updated_at: float = 0.0
    seq: int = 0
    reason: str = ""

    def __post_init__(self) -> None:
        for name in ("node", "mem_used_bytes", "mem_limit_bytes", "seq"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"NodeState.{name} must be an integer >= 0, got {value!r}")
        if self.status not in STATUSES:
            raise ValueError(f"NodeState.status must be one of {STATUSES}, got {self.status!r}")
        for name in ("endpoint", "reason"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"NodeState.{name} must be a string, "
                                 f"got {getattr(self, name)!r}")
        ok_time = isinstance(self.updated_at, (int, float)) and not isinstance(
            self.updated_at, bool) and math.isfinite(self.updated_at)
        if not ok_time:
            raise ValueError(f"NodeState.updated_at must be a finite number of seconds, "
                             f"got {self.updated_at!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, *, key: str = "<json>") -> NodeState:
        """Parse :meth:`to_json` output; ``key`` names the source in the error message."""
        return cls.from_dict(load_object(text, key), key=key)

    @classmethod
    def from_dict(cls, doc: dict[str, Any], *, key: str) -> NodeState:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - names)
        if unknown:
            raise RegistryFormatError(key, f"unknown field(s) {unknown}")
        try:
            return cls(**doc)
        except (TypeError, ValueError) as e:
            raise RegistryFormatError(key, str(e)) from e


def encode_bitmap(bits: dict[int, str]) -> str:
    return ",".join(f"{bit}:{token}" for bit, token in sorted(bits.items()))


def decode_bitmap(raw: str) -> dict[int, str]:
    bits = {}
    for item in filter(None, raw.split(",")):
        bit, sep, token = item.partition(":")
        if not (sep and bit.isdigit() and token):
            raise RegistryFormatError(BITMAP_KEY, f"malformed entry {item!r} in {raw!r}")
        bits[int(bit)] = token
    return bits


def load_object(raw: str | bytes, key: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSON, UTF-8, an int too long
        raise RegistryFormatError(key, f"not JSON ({e})") from e
    if not isinstance(doc, dict):
        raise RegistryFormatError(key, f"expected a JSON object, got {type(doc).__name__}")
    return doc
