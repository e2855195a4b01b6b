"""The load test runs in a separate, bounded process and catches what a hash cannot."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptpilot.capture.state import TrainingComponents, capture
from ckptpilot.codecs import get_codec
from ckptpilot.tiers.remote.archive import STATE_FILE, TENSORS_FILE, model_layout, stage_organ
from ckptpilot.tiers.remote.store import RemoteTier
from ckptpilot.validation.loadcheck import LoadChecker


@pytest.fixture(scope="module")
def checker() -> Any:
    lc = LoadChecker(timeout_seconds=30)
    yield lc
    lc.close()


def staged(tmp_path: Path, *, container: bool = False
           ) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """An organ's files (safetensors), or with ``container`` a pulse's (the codec container)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64))
    snap = capture(TrainingComponents(model), step=4)
    tier = RemoteTier(str(tmp_path / "ckpt"))
    zstd = get_codec("zstd")
    st = stage_organ(tier, snap, codec_for=(lambda name, t: (zstd, None)) if container else None)
    return Path(tier.path(st.staging)), json.loads(json.dumps(st.manifest)), model_layout(snap)


def rewrite(directory: Path, manifest: dict[str, Any], fname: str, data: bytes) -> None:
    """Replace a file *and* its recorded digest: damage no hash can see."""
    (directory / fname).write_bytes(data)
    manifest["files"][fname] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_good_checkpoint_passes(checker: LoadChecker, tmp_path: Path) -> None:
    d, manifest, layout = staged(tmp_path)
    result = checker.check(d, manifest, layout)
    assert result.ok, result.reason
    assert result.tensors == len(layout) + 1  # + the torch RNG state


def test_the_worker_is_another_process(checker: LoadChecker, tmp_path: Path) -> None:
    d, manifest, layout = staged(tmp_path)
    checker.check(d, manifest, layout)
    assert checker._proc is not None and checker._proc.pid != os.getpid()


def test_bytes_differing_from_what_was_written_fail(checker: LoadChecker, tmp_path: Path) -> None:
    d, manifest, layout = staged(tmp_path)
    data = bytearray((d / TENSORS_FILE).read_bytes())
    data[-1] ^= 0xFF
    (d / TENSORS_FILE).write_bytes(bytes(data))
    result = checker.check(d, manifest, layout)
    assert not result.ok and "tensors.safetensors bytes [0, " in result.reason
    assert "SHA256 mismatch" in result.reason


def test_the_default_mode_reads_headers_not_the_bytes_it_hashed_while_writing(
        checker: LoadChecker, tmp_path: Path) -> None:
    """Without ``reread`` (validation.paranoid off) a flipped tensor byte is the writer's
    digests' business, not the load test's; a truncated file or a broken header still fails."""
    d, manifest, layout = staged(tmp_path)
    data = bytearray((d / TENSORS_FILE).read_bytes())
    data[-1] ^= 0xFF
    (d / TENSORS_FILE).write_bytes(bytes(data))
    assert checker.check(d, manifest, layout, reread=False).ok
    (d / TENSORS_FILE).write_bytes(bytes(data[:-1]))
    result = checker.check(d, manifest, layout, reread=False)
    assert not result.ok and f"{TENSORS_FILE}: {len(data) - 1} bytes, the manifest says" \
        in result.reason
    data[8:12] = b"\xff\xff\xff\xff"  # the header's opening bytes: not JSON any more
    (d / TENSORS_FILE).write_bytes(bytes(data))
    assert not checker.check(d, manifest, layout, reread=False).ok


def test_layout_differing_from_the_live_model_fails(checker: LoadChecker, tmp_path: Path) -> None:
    d, manifest, layout = staged(tmp_path)
    layout["model/0.weight"] = ("F32", [64, 33])
    result = checker.check(d, manifest, layout)
    assert not result.ok and "model/0.weight: checkpoint has F32 [64, 32]" in result.reason
    layout = {**staged(tmp_path / "b")[2], "model/extra": ("F32", [1])}
    d2, m2, _ = staged(tmp_path / "c")
    assert "model/extra: the live model has it" in checker.check(d2, m2, layout).reason


def test_hostile_header_is_refused_without_allocating(checker: LoadChecker,
                                                      tmp_path: Path) -> None:
    d, manifest, layout = staged(tmp_path)
    raw = (d / TENSORS_FILE).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["model/0.weight"]["shape"] = [1 << 20, 1 << 18]  # 1 TiB of float32
    header["model/0.weight"]["data_offsets"][1] = 1 << 40
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    rewrite(d, manifest, TENSORS_FILE, len(hb).to_bytes(8, "little") + hb + raw[8 + n:])
    result = checker.check(d, manifest, layout)
    assert not result.ok and "header claims 1099511627776 bytes" in result.reason
    good_d, good_m, good_l = staged(tmp_path / "again")
    assert checker.check(good_d, good_m, good_l).ok  # the worker survived


def test_state_missing_required_fields_fails(checker: LoadChecker, tmp_path: Path) -> None:
    d, manifest, layout = staged(tmp_path)
    meta = json.loads((d / STATE_FILE).read_text())
    del meta["rng"]
    rewrite(d, manifest, STATE_FILE, json.dumps(meta).encode())
    result = checker.check(d, manifest, layout)
    assert not result.ok and "lacks required fields ['rng']" in result.reason


def test_dangling_tensor_reference_fails(checker: LoadChecker, tmp_path: Path) -> None:
    d, manifest, layout = staged(tmp_path)
    meta = json.loads((d / STATE_FILE).read_text())
    meta["extras"] = {"x": {"__tensor__": "extras/x"}}
    rewrite(d, manifest, STATE_FILE, json.dumps(meta).encode())
    result = checker.check(d, manifest, layout)
    assert not result.ok and "absent from the file: ['extras/x']" in result.reason


def test_a_hanging_load_times_out_and_the_worker_is_replaced(tmp_path: Path) -> None:
    d, manifest, layout = staged(tmp_path)
    (d / TENSORS_FILE).unlink()
    os.mkfifo(d / TENSORS_FILE)  # opening it for reading blocks forever
    manifest["files"][TENSORS_FILE]["bytes"] = 0  # a FIFO's size: past the size check
    lc = LoadChecker(timeout_seconds=3)
    try:
        result = lc.check(d, manifest, layout)
        assert not result.ok and result.reason == "load test timed out after 3 s"
        assert lc._proc is None  # the hung worker was killed
        lc.timeout_seconds = 120  # the replacement must serve; how fast is not the question
        good = staged(tmp_path / "good")
        result = lc.check(*good)
        assert result.ok, result.reason
    finally:
        lc.close()


def slow_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    """Run ``code`` at the start of every Python process started from here on (the worker)."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(code)
    paths = [str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))


def test_the_timeout_bounds_the_load_not_the_start_of_a_slow_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy machine may take longer to start a worker (import torch) than the timeout."""
    slow_start(tmp_path, monkeypatch, "import time\ntime.sleep(5)\n")
    lc = LoadChecker(timeout_seconds=4)
    try:
        result = lc.check(*staged(tmp_path))
        assert result.ok, result.reason
        assert result.seconds >= 5  # the start is in the check's time, not its timeout
    finally:
        lc.close()


def test_a_worker_that_cannot_start_fails_the_check_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_start(tmp_path, monkeypatch, "import os\nos._exit(7)\n")
    lc = LoadChecker(timeout_seconds=30)
    try:
        result = lc.check(*staged(tmp_path))
        assert not result.ok
        assert result.reason == "load-test worker died while starting (exit code 7)"
    finally:
        lc.close()


def test_a_worker_that_hangs_while_starting_fails_after_the_start_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_start(tmp_path, monkeypatch, "import time\ntime.sleep(3600)\n")
    lc = LoadChecker(timeout_seconds=30, start_timeout_seconds=1)
    try:
        result = lc.check(*staged(tmp_path))
        assert not result.ok
        assert result.reason == "load-test worker did not start within 1 s"
        assert lc._proc is None  # killed, not left sleeping
    finally:
        lc.close()


def test_a_load_beyond_the_memory_bound_fails_and_the_worker_survives(tmp_path: Path) -> None:
    torch.manual_seed(0)
    snap = capture(TrainingComponents(torch.nn.Linear(1024, 1024)), step=1)
    tier = RemoteTier(str(tmp_path / "ckpt"))
    st = stage_organ(tier, snap)
    # A bound below what decoding needs: the job hits RLIMIT_AS inside the worker.
    lc = LoadChecker(timeout_seconds=30, memory_margin_bytes=-(2 * st.bytes + (64 << 20)))
    try:
        first = lc.check(tier.path(st.staging), st.manifest, model_layout(snap))
        assert not first.ok and first.reason == "load test exceeded its memory bound"
        pid = lc._proc.pid if lc._proc is not None else None
        again = lc.check(tier.path(st.staging), st.manifest, model_layout(snap))
        assert again.reason == first.reason
        assert lc._proc is not None and lc._proc.pid == pid  # the same worker, still serving
    finally:
        lc.close()


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps")
def test_the_default_mode_runs_without_torch_and_the_paranoid_mode_loads_it(
        tmp_path: Path) -> None:
    """Checking headers, indexes and JSON needs no torch, for an organ's safetensors and a
    pulse's container alike: a worker that imported it would cost every training run its
    import (CPU seconds beside the first steps, hundreds of MB of memory)."""
    organ = staged(tmp_path / "organ")
    pulse = staged(tmp_path / "pulse", container=True)
    assert "tensors.ckpt" in pulse[1]["files"]
    lc = LoadChecker(timeout_seconds=60)
    try:
        counts = []
        for d, manifest, layout in (organ, pulse):
            result = lc.check(d, manifest, layout, reread=False)
            assert result.ok, result.reason
            counts.append(result.tensors)
        assert counts[0] == counts[1] > 4  # the model's 4 tensors and the rest of the state
        assert lc._proc is not None
        pid = lc._proc.pid
        assert not _maps_torch(pid)
        for d, manifest, layout in (organ, pulse):  # decodes: torch, before its limit
            assert lc.check(d, manifest, layout, reread=True).ok
        assert lc._proc.pid == pid and _maps_torch(pid)
    finally:
        lc.close()


def test_a_pulse_whose_layout_differs_from_the_live_model_fails_in_the_default_mode(
        checker: LoadChecker, tmp_path: Path) -> None:
    d, manifest, layout = staged(tmp_path, container=True)
    layout["model/0.weight"] = ("F32", [64, 31])
    result = checker.check(d, manifest, layout, reread=False)
    assert not result.ok
    assert "model/0.weight: checkpoint has F32 [64, 32], the live model F32 [64, 31]" in \
        result.reason
