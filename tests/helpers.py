"""Small helpers shared by the test modules."""

from __future__ import annotations

from pathlib import Path

from ckptpilot.storage import archive


def archive_tensors(directory: Path) -> Path:
    """The tensors file of a checkpoint directory: safetensors (organ) or container (pulse)."""
    for name in (archive.TENSORS_FILE, archive.CONTAINER_FILE):
        if (directory / name).exists():
            return directory / name
    raise FileNotFoundError(f"{directory}: no tensors file")
