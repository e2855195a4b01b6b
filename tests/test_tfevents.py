"""The event file ``ckptpilot.format.tfevents`` writes is what TensorBoard writes: its own
reader gets every scalar back, the checksums are TensorBoard's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ckptpilot.format.tfevents import EventFile, masked_crc32c


def _scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def test_tensorboard_reads_every_scalar_back(tmp_path: Path) -> None:
    events = EventFile(tmp_path / "tb")
    for step in range(1, 6):
        events.add_scalar("checkpoint/score", step / 4, step)
        events.add_scalar("checkpoint/bytes", 1e6 * step, step)
    events.close()
    assert events.path.name.startswith("events.out.tfevents.")
    assert _scalars(tmp_path / "tb") == {
        "checkpoint/score": [(s, s / 4) for s in range(1, 6)],
        "checkpoint/bytes": [(s, 1e6 * s) for s in range(1, 6)]}


@pytest.mark.parametrize("data", [b"", b"a", b"123456789", bytes(range(256)) * 3])
def test_the_checksum_is_tensorboards(data: bytes) -> None:
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as theirs

    assert masked_crc32c(data) == theirs(data)


def test_crc32c_check_value() -> None:
    # CRC-32C of "123456789" is 0xE3069283 (RFC 3720); masked as TFRecord masks it.
    crc = 0xE3069283
    assert masked_crc32c(b"123456789") == (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def test_writing_events_does_not_import_tensorboards_writer(tmp_path: Path) -> None:
    code = ("import sys\n"
            "from pathlib import Path\n"
            "from ckptpilot.format.tfevents import EventFile\n"
            f"e = EventFile(Path({str(tmp_path)!r}))\n"
            "e.add_scalar('x', 1.0, 1); e.close()\n"
            "print(sorted(m for m in sys.modules if m.startswith(('boto3', "
            "'torch.utils.tensorboard', 'tensorboard.summary'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
