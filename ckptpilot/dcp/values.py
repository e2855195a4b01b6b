"""The JSON form of a non-tensor value of a DCP state dict (DCP's "bytes" items: an epoch,
a param group's ``betas``, a nested dict of settings), so that no load path unpickles one.

Owns, and keeps pure (no I/O), a tagged JSON encoding that gives back the value bit for bit,
types included:

- ``None``, ``bool``, ``int`` (any size), ``str``: as JSON;
- ``float``: a JSON number when finite (Python writes the shortest repr that reads back
  exactly, ``-0.0`` included), else ``{"$float": "<16 hex digits>"}``, its IEEE 754 bits (so
  a NaN keeps its sign and payload);
- ``list``: a JSON array; ``tuple``: ``{"$tuple": [...]}``;
- ``dict`` and ``OrderedDict``: ``{"$dict": [[key, value], ...]}`` and ``{"$odict": ...}``,
  in insertion order, the keys any of the hashable types above.

Every JSON object is a tag, so no value can pass for another. Anything else — a tensor
inside a tuple, a set, ``bytes``, an object — is refused when saved, naming the item and the
type, with what to do instead. ``canonical`` is the one text of a document that its digest
is taken over (the commit file and every rank's part digest cover each value).

Must not read files or know where a value is stored (``dcp.format``).
"""

from __future__ import annotations

import json
import math
import struct
from collections import OrderedDict
from typing import Any

from ckptpilot.errors import CheckpointFormatError

__all__ = ["MAX_DEPTH", "PLAIN_TYPES", "canonical", "decode_value", "encode_value",
           "unsupported"]

MAX_DEPTH = 64
"""Containers nest at most this deep: a value is data, and a deeper document is refused
rather than taken down with a RecursionError."""

PLAIN_TYPES = "None, bool, int, float or str, or a list, tuple or dict of them"
_SCALARS = (type(None), bool, int, str)
_DOUBLE = struct.Struct(">d")
_TAGS = ("$float", "$tuple", "$dict", "$odict")


class _Unsupported(Exception):
    """A value with no JSON form here; ``what`` names its type and where in the value."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def encode_value(value: Any, item: str) -> Any:
    """The JSON document of ``value``; ``CheckpointFormatError`` naming ``item`` (how the
    caller names the item: step and fqn) and the offending type when it has none."""
    try:
        return _encode(value, 0, "")
    except _Unsupported as e:
        raise unsupported(item, e.what) from None


def unsupported(item: str, what: str) -> CheckpointFormatError:
    """The refusal of a value that has no JSON form, saying what to do instead."""
    return CheckpointFormatError(
        f"{item}: {what} cannot be saved: ckptpilot stores a non-tensor value as JSON, so it "
        f"must be {PLAIN_TYPES}. Put each tensor in the state dict as an entry of its own (in "
        "a dict or a list, which DCP saves tensor by tensor, not in a tuple), and turn other "
        "objects into plain data (their state_dict(), say)")


def _encode(value: Any, depth: int, path: str) -> Any:
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is float:
        if math.isfinite(value):
            return value
        return {"$float": _DOUBLE.pack(value).hex()}
    if depth >= MAX_DEPTH:
        raise _Unsupported(f"a value nested deeper than {MAX_DEPTH} containers (at {path})")
    if kind is list:
        return [_encode(v, depth + 1, f"{path}[{i}]") for i, v in enumerate(value)]
    if kind is tuple:
        return {"$tuple": [_encode(v, depth + 1, f"{path}[{i}]") for i, v in enumerate(value)]}
    if kind is dict or kind is OrderedDict:
        pairs = [[_encode(k, depth + 1, f"{path} key {k!r}"),
                  _encode(v, depth + 1, f"{path}[{k!r}]")] for k, v in value.items()]
        return {"$dict" if kind is dict else "$odict": pairs}
    at = f" (at {path})" if path else ""
    name = kind.__qualname__ if kind.__module__ == "builtins" else (
        f"{kind.__module__}.{kind.__qualname__}")
    raise _Unsupported(f"a value of type {name}{at}")


def decode_value(doc: Any, where: str) -> Any:
    """The value of a JSON document made by :func:`encode_value`; anything else raises
    ``CheckpointFormatError`` naming ``where``. Builds only the types listed above."""
    return _decode(doc, 0, where)


def _decode(doc: Any, depth: int, where: str) -> Any:
    kind = type(doc)
    if kind in _SCALARS or kind is float:
        if kind is float and not math.isfinite(doc):
            raise CheckpointFormatError(f"{where}: a non-finite float must be a $float tag")
        return doc
    if depth >= MAX_DEPTH:
        raise CheckpointFormatError(f"{where}: nested deeper than {MAX_DEPTH} containers")
    if kind is list:
        return [_decode(v, depth + 1, where) for v in doc]
    if kind is not dict or len(doc) != 1 or next(iter(doc)) not in _TAGS:
        raise CheckpointFormatError(f"{where}: {_show(doc)} is not an encoded value (an object "
                                    f"must be one of the tags {', '.join(_TAGS)})")
    tag, body = next(iter(doc.items()))
    if tag == "$float":
        if not isinstance(body, str) or len(body) != 2 * _DOUBLE.size:
            raise CheckpointFormatError(f"{where}: $float {_show(body)} is not 16 hex digits")
        try:
            return _DOUBLE.unpack(bytes.fromhex(body))[0]
        except ValueError as e:
            raise CheckpointFormatError(f"{where}: $float {_show(body)}: {e}") from e
    if not isinstance(body, list):
        raise CheckpointFormatError(f"{where}: {tag} holds {_show(body)}, not a list")
    if tag == "$tuple":
        return tuple(_decode(v, depth + 1, where) for v in body)
    out: dict[Any, Any] = {} if tag == "$dict" else OrderedDict()
    for pair in body:
        if not isinstance(pair, list) or len(pair) != 2:
            raise CheckpointFormatError(f"{where}: {tag} entry {_show(pair)} is not a "
                                        "[key, value] pair")
        key = _decode(pair[0], depth + 1, where)
        try:
            out[key] = _decode(pair[1], depth + 1, where)
        except TypeError as e:  # an unhashable key (a list)
            raise CheckpointFormatError(f"{where}: {tag} key {_show(key)}: {e}") from e
    if len(out) != len(body):
        raise CheckpointFormatError(f"{where}: {tag} repeats a key")
    return out


def canonical(doc: Any) -> str:
    """The one text of a document: what its digest is taken over."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _show(doc: Any) -> str:
    text = repr(doc)
    return text if len(text) <= 80 else text[:77] + "..."
