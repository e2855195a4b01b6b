"""The failure ledger's line format: one JSON record per line, version 1 (``"v": 1``).

``"kind"`` is one of:

* ``run_start``: ``wall_time``, ``step`` — a run (or a resumed run) began at this step;
* ``run_end``: ``wall_time``, ``step``, optional ``uptime_seconds`` — that run ended cleanly;
* ``interruption``: ``wall_time`` (when recorded), ``failed_at`` (wall time the interrupted run
  was last seen alive), ``last_step``, ``recovered_step``, ``steps_lost``, ``source``,
  ``recovery_seconds``, optional ``uptime_seconds``;
* ``rollback``: ``wall_time``, ``step`` (where the spike was confirmed), ``onset``, ``to_step``
  (the checkpoint restored), ``skipped_batches``, ``reason``. (A ckptpilot older than this
  record kind sets such a file aside as damaged.)
* ``stop``: ``wall_time``, ``step`` (the last step boundary reached), ``cause``
  (``preemption`` or ``hang``: ``ckptpilot.vocab.StopCause``), ``reason`` (what happened, in
  words), optional ``uptime_seconds`` — the pilot itself ended that run: a preemption notice
  (no failure) or its hang watchdog (a failure). It ends the run as ``run_end`` does, so the
  restart records no ``interruption`` for it. (A ckptpilot older than this record kind sets
  such a file aside as damaged.)

Readers ignore fields they do not know, so an optional field needs no new version. Every
number fits in ±2**53, so floats stay exact and no reader is sent a giant integer.

Owns a line's bytes and the check of one line. Must not touch the file: appending, torn-tail
repair and setting a damaged file aside belong to ``storage/ledger.py``, and what the records
mean (the MTBF) too.
"""

from __future__ import annotations

import json
from typing import Any

from ckptpilot.errors import CheckpointFormatError

__all__ = ["LEDGER_VERSION", "RECORD_FIELDS", "encode_line", "parse_line"]

LEDGER_VERSION = 1

_NUMBER = (int, float)
_MAX_MAGNITUDE = 2**53
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "wall_time": _NUMBER,
    "failed_at": _NUMBER,
    "recovery_seconds": _NUMBER,
    "uptime_seconds": _NUMBER,
    "step": (int,),
    "last_step": (int,),
    "recovered_step": (int,),
    "steps_lost": (int,),
    "source": (str,),
    "onset": (int,),
    "to_step": (int,),
    "skipped_batches": (int,),
    "reason": (str,),
    "cause": (str,),
}
RECORD_FIELDS: dict[str, tuple[str, ...]] = {
    "run_start": ("wall_time", "step"),
    "run_end": ("wall_time", "step"),
    "interruption": (
        "wall_time",
        "failed_at",
        "last_step",
        "recovered_step",
        "steps_lost",
        "source",
        "recovery_seconds",
    ),
    "rollback": ("wall_time", "step", "onset", "to_step", "skipped_batches", "reason"),
    "stop": ("wall_time", "step", "cause", "reason"),
}
"""The fields each record kind must carry."""


def encode_line(record: dict[str, Any]) -> bytes:
    """``record`` (``"v"`` and ``"kind"`` included) as one line; NaN and infinities are refused
    (``ValueError``): JSON readers other than Python's would reject the whole file."""
    return (json.dumps(record, allow_nan=False) + "\n").encode("utf-8")


def parse_line(line: bytes, number: int) -> dict[str, Any]:
    """One valid record; :class:`CheckpointFormatError` naming the line ``number`` and its fault."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as exc:  # JSON, UTF-8, an int past the digit limit
        raise CheckpointFormatError(f"line {number}: not a JSON record ({exc})") from exc
    if not isinstance(record, dict) or record.get("v") != LEDGER_VERSION:
        raise CheckpointFormatError(
            f"line {number}: not a version-{LEDGER_VERSION} ledger record: {line[:80]!r}"
        )
    kind = record.get("kind")
    required = RECORD_FIELDS.get(kind) if isinstance(kind, str) else None
    if required is None:
        raise CheckpointFormatError(f"line {number}: unknown record kind {kind!r}")
    missing = [name for name in required if name not in record]
    if missing:
        raise CheckpointFormatError(
            f"line {number}: {record['kind']} record lacks {', '.join(missing)}"
        )
    for name, types in _FIELD_TYPES.items():
        value = record.get(name)
        if name in record and (isinstance(value, bool) or not isinstance(value, types)):
            raise CheckpointFormatError(
                f"line {number}: {record['kind']} record has {name}={value!r:.80}, not a "
                f"{' or '.join(t.__name__ for t in types)}"
            )
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not (
                abs(value) <= _MAX_MAGNITUDE):
            raise CheckpointFormatError(
                f"line {number}: {record['kind']} record has {name} beyond ±2**53: "
                f"{str(value)[:40]}")
    return record
