"""TensorBoard's event file, written without importing TensorBoard's writer: TFRecord framing
(length, masked CRC-32C of the length, the serialized ``Event`` protobuf, masked CRC-32C of
the data) around ``tensorboard.compat.proto``'s ``Event`` and ``Summary`` messages.

Why not ``torch.utils.tensorboard.SummaryWriter``: importing it pulls in TensorBoard's
TensorFlow stub, whose file layer imports boto3 whenever boto3 is installed: a long stretch
of Python holding the GIL. On the telemetry thread, during training, the training thread
waits for the interpreter between two operators all that time (a thread's priority does not
help: the GIL is not scheduled by the kernel); it was most of the demo's loop overhead
(bench/RESULTS.md, loop.py). The two protobuf modules import in a small fraction of that.
TensorBoard itself reads these files (``tests/test_tfevents.py`` reads them back with its
``EventAccumulator``).

Owns the bytes of one event file; nothing about what is plotted (``ckptpilot.telemetry``).
Threading: one writer per thread.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

__all__ = ["EventFile", "masked_crc32c"]


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_TABLE = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: CRC-32C (Castagnoli), rotated and offset (``masked``) so that a
    CRC stored inside checksummed data does not checksum to a fixed value. Records here are
    tens of bytes, so a table loop in Python is enough."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class EventFile:
    """One new event file in ``directory`` (named as TensorBoard names them, so several runs
    and restarts sit side by side), starting with the ``brain.Event:2`` version record."""

    def __init__(self, directory: Path) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / (f"events.out.tfevents.{int(time.time()):010d}."
                                 f"{socket.gethostname()}.{os.getpid()}.{time.monotonic_ns()}")
        self._file = open(self.path, "xb")  # noqa: SIM115 - owned until close()
        self._write(self._event(wall_time=time.time(), file_version="brain.Event:2"))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=value)])
        self._write(self._event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def _write(self, event: Any) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self._file.write(b"".join((header, struct.pack("<I", masked_crc32c(header)), data,
                                   struct.pack("<I", masked_crc32c(data)))))
