"""The safetensors header checks, without torch.

Owns: the bound on a header's size and the check that a header's tensors fit the data that
is really there. Must not: decode tensors (``tiers.remote.archive`` does, with torch). It imports
no torch so that the load-test worker's default mode, which reads only headers and JSON, runs
without it (``validation.loadcheck``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ckptpilot.errors import CheckpointFormatError

__all__ = ["ELEMENT_BYTES", "MAX_HEADER_BYTES", "check_safetensors_header"]

MAX_HEADER_BYTES = 100 << 20

ELEMENT_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
}
"""Bytes per element of every safetensors dtype ckptpilot writes (``tiers.remote.archive`` maps
each to its torch dtype; a test keeps the two in step)."""


def check_safetensors_header(header: Mapping[str, Any], data_bytes: int,
                             where: str) -> None:
    """Reject a header whose tensors do not fit the data that is really there.

    A hostile or damaged header (a "1 TB tensor", overlapping ranges) is refused before
    anything is allocated for it.
    """
    for name, info in header.items():
        if name == "__metadata__":
            continue
        width = ELEMENT_BYTES.get(info.get("dtype")) if isinstance(info, dict) else None
        if width is None:
            raise CheckpointFormatError(f"{where}: {name}: unknown or missing dtype")
        begin, end = info["data_offsets"]
        count = math.prod(int(d) for d in info["shape"])
        if not 0 <= begin <= end <= data_bytes or end - begin != count * width:
            raise CheckpointFormatError(
                f"{where}: {name}: header claims {count * width} bytes at [{begin}, {end}) "
                f"but the file holds {data_bytes} data bytes")
