"""Background threads and the load-test worker run at a lower priority than training."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from ckptpilot.background import BACKGROUND_NICE, background_pool
from ckptpilot.format.digest import hash_pool
from ckptpilot.validation.loadcheck import LoadChecker


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_pool_threads_are_niced_and_the_caller_keeps_its_priority() -> None:
    before = _nice()
    with background_pool(2, "test-bg") as pool:
        seen = {pool.submit(_nice).result() for _ in range(4)}
    assert seen == {max(before, BACKGROUND_NICE)}
    assert hash_pool().submit(_nice).result() == max(before, BACKGROUND_NICE)
    assert _nice() == before


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_the_load_test_worker_runs_niced() -> None:
    checker = LoadChecker()
    try:
        checker.start()
        proc = checker._worker()  # waits until it is ready
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
        fields = stat.rsplit(")", 1)[1].split()
        assert int(fields[16]) >= BACKGROUND_NICE  # field 19 of stat: nice
    finally:
        checker.close()
