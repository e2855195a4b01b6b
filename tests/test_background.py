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


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_child_forked_after_hashing_hashes_on_threads_of_its_own(tmp_path: Path) -> None:
    """The parent's hashing threads do not exist in a forked child (torch.multiprocessing's
    fork start, a launcher that forks): work handed to the inherited pool would never run."""
    from ckptpilot.tiers.remote import RemoteTier

    tier = RemoteTier(str(tmp_path))
    data = [bytes(range(256)) * 4096 * 3]  # 3 MiB
    parent = tier.write_record("parent.bin", data)
    pid = os.fork()
    if pid == 0:  # the child: the same write, then the exit code says whether it matched
        try:
            ok = tier.write_record("child.bin", data) == parent
        finally:
            os._exit(0 if ok else 1)
    deadline = 120  # a safety net for a hang, not a speed bound
    for _ in range(deadline * 10):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        threading.Event().wait(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's write hung on its parent's hashing pool")
    assert os.waitstatus_to_exitcode(status) == 0
