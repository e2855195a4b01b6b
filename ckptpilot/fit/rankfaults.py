"""What fit's training child does only under a torchrun campaign (``--launcher torchrun``):
know which start of the worker group it is, stop at a quiet point for the parent, and die in
the phases of a save that only a multi-rank job has to agree on.

A torchrun agent with ``--max-restarts`` starts the whole worker group again after any worker
failed; ``TORCHELASTIC_RESTART_COUNT`` tells each worker which start it is (0: the first).
The child injects its fault in one start only (``--fault-attempt``), so the restart it causes
runs clean — or carries the next fault, for an incident that hurts a restart itself.

The quiet point is where the campaign's oracle comes from: every rank finishes the saves in
flight, reports the saves it completed and its pid, and waits at a barrier, so that what each
rank holds is known before the incident lands; the parent then acts (damages storage, kills
a rank, a peer daemon ...) while the ranks wait for its go file.

Faults here are wrappers the child puts around library functions in its own process, as in
``job.py``; the library carries no hooks. ``die`` is ``Job.die``: report, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckptpilot.tiers.remote.archive import MANIFEST_FILE, checkpoint_name, parse_checkpoint_name
from ckptpilot.tiers.remote.store import STAGING_MARK, RemoteTier

ATTEMPT_ENV = "TORCHELASTIC_RESTART_COUNT"
FAULTS = ("kill-fsync", "kill-staged", "kill-publish-all", "clock-back", "stop-mid-step")
CLOCK_BACK_SECONDS = -86400.0
OTHER_RANKS_WAIT_SECONDS = 60.0
GO_WAIT_SECONDS = 120.0

Die = Callable[..., None]


def attempt() -> int:
    """Which start of the worker group this process belongs to (0 outside torchrun)."""
    return int(os.environ.get(ATTEMPT_ENV, "0"))


def _step_in_path(path: str) -> int | None:
    """The step of the checkpoint directory (staging or published) a path lies in."""
    for part in reversed(Path(path).parts):
        parsed = parse_checkpoint_name(part.split(STAGING_MARK, 1)[0])
        if parsed is not None:
            return parsed[0]
    return None


def _kill_in_fsync(die: Die, at_step: int) -> None:
    """Die as a checkpoint file of step ``at_step`` or later is about to be fsynced: its
    bytes are written but not yet durable (the write's fsync window)."""
    real = os.fsync

    def fsync(fd: int) -> None:
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.fstat(fd).st_mode):
                path = os.readlink(f"/proc/self/fd/{fd}")
                step = _step_in_path(path)
                if step is not None and step >= at_step:
                    die("fsync", step, tier="remote", file=os.path.basename(path))
        real(fd)

    os.fsync = fsync


def _kill_at_publish(die: Die, at_step: int, *, world_size: int, after: bool) -> None:
    """``after=False``: die with the checkpoint staged, complete, before the rename that
    publishes it. ``after=True``: publish, wait until every rank published the same step,
    then die before the pilot records the save valid."""
    original = RemoteTier.publish

    @functools.wraps(original)
    def publish(self: RemoteTier, staging: str, final: str) -> None:
        step = _step_in_path(final)
        if step is None or step < at_step:
            original(self, staging, final)
            return
        if not after:
            die("stage (before publish)", step, tier="remote")
        original(self, staging, final)
        waited = wait_for(lambda: all(self.exists(f"{checkpoint_name(step, r)}/{MANIFEST_FILE}")
                                      for r in range(world_size)), OTHER_RANKS_WAIT_SECONDS)
        die("publish", step, tier="remote", waited=waited)

    RemoteTier.publish = publish  # type: ignore[method-assign]


def _clock_back() -> None:
    real = time.time
    time.time = lambda: real() + CLOCK_BACK_SECONDS  # type: ignore[assignment]


def install(fault: str, at_step: int, die: Die, world_size: int) -> None:
    """Put ``fault`` (one of ``FAULTS``) in place in this process."""
    if fault == "kill-fsync":
        _kill_in_fsync(die, at_step)
    elif fault in ("kill-staged", "kill-publish-all"):
        _kill_at_publish(die, at_step, world_size=world_size, after=fault == "kill-publish-all")
    elif fault == "clock-back":
        _clock_back()
    elif fault == "stop-mid-step":
        pass  # needs the model: ``stop_mid_step``, once it is built
    else:
        raise ValueError(f"unknown campaign fault {fault!r}; valid: {', '.join(FAULTS)}")


def stop_mid_step(model: torch.nn.Module, step_now: Callable[[], int], at_step: int,
                  emit: Callable[..., None]) -> None:
    """SIGSTOP this process as the forward pass of step ``at_step`` begins: a rank hung in
    the middle of a step, its sockets open, its peers waiting for it in the next collective."""
    def hook(module: torch.nn.Module, args: Any) -> None:
        step = step_now() + 1
        if step >= at_step:
            emit("fault", phase="forward (SIGSTOP)", step=step)
            os.kill(os.getpid(), signal.SIGSTOP)

    model.register_forward_pre_hook(hook)


def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def quiet_point(emit: Callable[..., None], pilot: Any, saves: Callable[[], list[Any]],
                step: int, *, dist: bool, go_file: Path | None) -> None:
    """Finish the saves in flight, report them with this pid, meet the other ranks, then
    wait for the parent's go file (if any): the parent knows what every rank holds before it
    acts."""
    pilot.flush()
    emit("quiet", step=step, pid=os.getpid(), saves=saves())
    if dist:
        torch.distributed.barrier()
    if go_file is not None and not wait_for(go_file.exists, GO_WAIT_SECONDS):
        raise RuntimeError(f"{go_file} did not appear")
