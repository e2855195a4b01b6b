"""Background threads and the load-test worker run at a lower priority than training."""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptpilot import background
from ckptpilot.background import BACKGROUND_NICE, background_pool, urgent
from ckptpilot.validation.loadcheck import LoadChecker


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _policy() -> tuple[int, int]:
    """The calling thread's scheduling policy and nice value."""
    tid = threading.get_native_id()
    return os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)


IDLE = getattr(os, "SCHED_IDLE", None)
linux_idle = pytest.mark.skipif(IDLE is None or not os.path.isdir("/proc/self/task"),
                                reason="SCHED_IDLE and /proc/self/task are Linux's")


@pytest.fixture
def idle() -> Iterator[None]:
    """The policy's ``async.background_priority: idle`` for the test's new threads."""
    background.use_idle_priority(True)
    try:
        yield
    finally:
        background.use_idle_priority(False)


def test_pool_threads_are_niced_by_default_and_the_caller_keeps_its_priority() -> None:
    before = _policy()
    with background_pool(2, "test-bg") as pool:
        seen = {pool.submit(_policy).result() for _ in range(4)}
    assert {nice for _, nice in seen} == {max(before[1], BACKGROUND_NICE)}
    assert {policy for policy, _ in seen} == {before[0]}
    assert _policy() == before


def test_with_idle_priority_pool_threads_run_idle(idle: None) -> None:
    before = _policy()
    with background_pool(2, "test-bg-idle") as pool:
        seen = {pool.submit(_policy).result() for _ in range(4)}
    if IDLE is not None and background._urgency.idle_allowed:
        assert {policy for policy, _ in seen} == {IDLE}
    else:  # the fallback: niced
        assert {nice for _, nice in seen} == {max(before[1], BACKGROUND_NICE)}
    assert _policy() == before


def test_the_policy_chooses_the_priority(tmp_path: Path) -> None:
    from ckptpilot import CheckpointPilot, load_policy

    for priority, wanted in (("nice", False), ("idle", True)):
        cfg = tmp_path / f"{priority}.yaml"
        cfg.write_text(f"async: {{background_priority: {priority}}}\n"
                       "validation: {load_test: none}\n")
        pilot = CheckpointPilot(load_policy(cfg, run_dir=tmp_path / priority),
                                model=torch.nn.Linear(2, 2))
        try:
            assert background._urgency.idle_wanted is wanted
        finally:
            pilot.close(save=False)
    background.use_idle_priority(False)


@linux_idle
def test_while_training_waits_the_idle_threads_run_niced_and_go_back_to_idle_after(
        idle: None) -> None:
    """Idle priority may starve a save on busy cores; once training waits for it (back-
    pressure, a flush) that would cost training time, so the wait lifts it to nice 10."""
    release, ready = threading.Event(), threading.Event()
    seen: list[tuple[int, int]] = []

    def job() -> None:
        ready.set()
        release.wait(60)
        seen.append(_policy())

    with background_pool(1, "test-urgent") as pool:
        assert pool.submit(_policy).result()[0] == IDLE
        before = _policy()
        with urgent():
            with urgent():  # nested waits
                pool.submit(job)
                ready.wait(60)
                release.set()
                pool.submit(lambda: None).result()
            assert pool.submit(_policy).result() == (os.SCHED_OTHER, BACKGROUND_NICE)
        assert pool.submit(_policy).result()[0] == IDLE
        assert _policy() == before  # the waiting thread itself was never touched
    assert seen == [(os.SCHED_OTHER, BACKGROUND_NICE)]


@linux_idle
def test_back_pressure_lifts_a_starved_save(tmp_path: Path, idle: None) -> None:
    """A writer whose slot is taken waits under urgent(): the save it waits for runs niced."""
    from ckptpilot.save.writer import CheckpointWriter

    slots = threading.BoundedSemaphore(1)
    writer = CheckpointWriter.__new__(CheckpointWriter)
    writer._slots = slots
    slots.acquire()
    with background_pool(1, "test-bp") as pool:
        pool.submit(lambda: None).result()
        seen: list[tuple[int, int]] = []

        def save() -> None:
            while not background._urgency.moved:  # until the writer waits
                threading.Event().wait(0.01)
            seen.append(_policy())
            slots.release()

        pool.submit(save)
        writer.acquire_slot()  # blocks until the save, lifted, releases the slot
    assert seen == [(os.SCHED_OTHER, BACKGROUND_NICE)]


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_the_load_test_worker_runs_niced() -> None:
    checker = LoadChecker()
    try:
        checker.start()
        proc = checker._worker(decoding=False)  # waits until it is ready
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
        fields = stat.rsplit(")", 1)[1].split()
        assert int(fields[16]) >= BACKGROUND_NICE  # field 19 of stat: nice
    finally:
        checker.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_child_forked_after_hashing_hashes_on_threads_of_its_own(tmp_path: Path) -> None:
    """The parent's hashing threads do not exist in a forked child (torch.multiprocessing's
    fork start, a launcher that forks): work handed to the inherited pool would never run."""
    from ckptpilot.tiers.remote.store import RemoteTier

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


@linux_idle
def test_a_save_that_waits_too_long_for_idle_cores_is_lifted_until_it_is_done(
        idle: None) -> None:
    """On cores kept busy, an idle-priority save could wait forever while training goes on
    (no back-pressure yet): past the writer's patience it runs at nice 10 until done."""
    from concurrent.futures import Future

    from ckptpilot.save.writer import PATIENCE_SECONDS, CheckpointWriter, _Job

    writer = CheckpointWriter.__new__(CheckpointWriter)
    writer._jobs, writer._lifted, writer.saves = deque(), None, []
    release = threading.Event()
    with background_pool(1, "test-rescue") as pool:
        job = _Job(6, "save")
        job.future = pool.submit(release.wait, 60)
        writer._jobs.append(job)
        writer.raise_errors()  # just queued: patience
        assert background._urgency.depth == 0
        job.queued -= PATIENCE_SECONDS + 1
        writer.raise_errors()  # now past patience: lifted
        assert background._urgency.depth == 1 and writer._lifted is job
        moved = set(background._urgency.moved)
        assert moved and all(os.sched_getscheduler(t) == os.SCHED_OTHER for t in moved)
        release.set()
        job.future.result()
        done: Future[tuple[int, int]] = pool.submit(_policy)
        assert done.result() == (os.SCHED_OTHER, BACKGROUND_NICE)  # still lifted
        writer._jobs.clear()
        writer.raise_errors()  # the lifted save is done: back to idle
        assert background._urgency.depth == 0 and writer._lifted is None
        assert pool.submit(_policy).result()[0] == IDLE
