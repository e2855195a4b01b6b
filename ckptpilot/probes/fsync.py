"""IO latency of the run directory: one timed small write + fsync.

This module owns the probe only; the health monitor (``probes/monitor.py``) calls it from its
background thread and decides what counts as slow. It never runs on the training thread: an
fsync can stall for as long as the storage does.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["FsyncProbe"]


class FsyncProbe:
    """Times a 4 KiB write + fsync of a private file in ``run_dir``; returns milliseconds.

    Called by the monitor thread; :meth:`close` removes the file. The directory is created if
    it does not exist yet (the run will write there anyway).
    """

    _PAYLOAD = b"\0" * 4096

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir) / f".io-probe-{os.getpid()}"
        self._fd: int | None = None

    def __call__(self) -> float:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        started = time.perf_counter()
        os.pwrite(self._fd, self._PAYLOAD, 0)
        os.fsync(self._fd)
        return (time.perf_counter() - started) * 1000.0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.path.unlink(missing_ok=True)
