"""Scratch directories for the benchmarks: made under ``--dir`` and always removed.

The default parent is ``.bench-tmp`` in the repository (ignored by git), on the same disk as
the checkouts, so write and fsync timings are of the disk a run really uses.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / ".bench-tmp"


@contextlib.contextmanager
def scratch_dir(parent: Path, prefix: str) -> Iterator[Path]:
    """A fresh directory under ``parent``, removed with its contents on exit (also on error);
    ``parent`` itself is removed too when this call created it and it is empty."""
    made = not parent.exists()
    parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield workdir
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if made:
            with contextlib.suppress(OSError):  # another run may still use it
                parent.rmdir()
