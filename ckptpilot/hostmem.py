"""Large one-shot host buffers in ordinary pages: what a restore reads into, a peer receives
into, a verified chunk is checked in.

This module owns :func:`fresh_bytes`. It exists because ``np.empty`` asks the kernel for
transparent huge pages on large arrays (``MADV_HUGEPAGE``); where THP ``defrag`` is
``madvise`` (a common default) the first touch of such a buffer makes the kernel compact memory
to find them, which costs several times the system time of faulting in ordinary pages, and
the first large buffer of a process pays the most (bench/RESULTS.md, "Restore: where its
time goes", and the peer recovery rows of e2e.py). It must not import torch: the peer daemon
uses it.
"""

from __future__ import annotations

import mmap

import numpy as np

__all__ = ["fresh_bytes"]


def fresh_bytes(size: int) -> np.ndarray:
    """An uninitialised, writable byte buffer of private anonymous memory in ordinary pages,
    returned to the system when the array (and every view of it) is gone."""
    if size == 0 or not hasattr(mmap, "MAP_PRIVATE"):  # Windows has no such mapping
        return np.empty(size, dtype=np.uint8)
    return np.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                         dtype=np.uint8)
