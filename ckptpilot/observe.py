"""Telemetry of checkpointing: TensorBoard scalars for every completed save.

Owns the TensorBoard writer and nothing else. Called only from the pilot's background writer
thread, so importing TensorBoard (about a second) and writing events never touch the training
thread. With ``observability.tensorboard: false`` every call is a no-op.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class Telemetry:
    def __init__(self, log_dir: Path, *, tensorboard: bool) -> None:
        self._log_dir = log_dir
        self._enabled = tensorboard
        self._writer: Any = None

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if not self._enabled:
            return
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self._log_dir))
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
