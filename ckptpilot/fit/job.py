"""The training child of ``ckptpilot fit``: ``python -m ckptpilot.fit.job``.

A small real model (BatchNorm, dropout, AdamW, a cosine schedule, shuffled data through
``ResumableSampler``, python/numpy/torch randomness) trained with a ``CheckpointPilot`` under
the policy fit wrote for the scenario; with ``--dist`` one rank of a torchrun (gloo) job whose
ranks train one DDP model on their own halves of the data. It restores first, so a second
start resumes. One thread (``torch.set_num_threads(1)``) in every run: a reduction split over
another thread count may round differently, and the runs of a scenario are compared bit for
bit with an uninterrupted reference.

What the parent reads back, all under ``--out`` (one file per rank):

- ``events_rank{r}.jsonl``: what happened, one JSON object a line, each naming its start of
  the torchrun worker group (``attempt``) — ``restored`` (or ``refused``: restore raised),
  ``fault`` (just before the job kills itself, with the saves completed so far), ``error`` (a
  ckptpilot error stopped training), ``paused``, ``quiet`` (the campaign's quiet point: the
  pid and the saves completed, see ``rankfaults``), ``exited`` (the pilot ended the process,
  with its status), ``done``;
- ``losses_rank{r}.txt``: ``<step> <loss as float hex>`` for every step this run trained;
- ``final_rank{r}.safetensors`` and ``.json`` after the last step: model, optimizer,
  schedule, data cursor and every RNG state.

Faults are injected by this process into itself (``--fault``): it wraps the library function
of the phase where the pilot looks it up, and SIGKILLs itself there or fails like a full disk
or an unreachable store. Production code carries no hook for it. A fault fires at the first
save of step ``--at-step`` or later; a point that no longer exists under its name makes the
job exit with an error rather than run without the fault.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import inspect
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from ckptpilot import CheckpointPilot, CkptPilotError, ResumableSampler, load_policy
from ckptpilot.capture import state as state_module
from ckptpilot.fit import rankfaults
from ckptpilot.fit.harness import read_losses
from ckptpilot.probes.gpu import DeviceReading, GpuHealthProvider, GpuReading
from ckptpilot.probes.monitor import FROM_POLICY
from ckptpilot.tiers.peer import PeerTier
from ckptpilot.tiers.remote.archive import (
    CONTAINER_FILE,
    MANIFEST_FILE,
    TENSORS_FILE,
    checkpoint_name,
    parse_checkpoint_name,
)
from ckptpilot.tiers.remote.store import STAGING_MARK, HashingWriter, RemoteTier
from ckptpilot.validation.postwrite import PostWriteValidator

WRITE_WAITS = {"kill-write": None, "kill-write-after-rank0": "rank0-published",
               "kill-write-every-rank": "every-rank-writing"}
FAULTS = ("kill-capture", *WRITE_WAITS, "kill-validate", "kill-publish", "kill-between",
          "enospc", "remote-down", "remote-flaky", "nvml-burst", *rankfaults.FAULTS)
EXIT_ERROR = 3  # a ckptpilot error (restore refused, a save failed): reported in the events
ENOSPC_AFTER_BYTES = 4096
OTHER_RANKS_WAIT_SECONDS = 60.0
BURST_WAIT_SECONDS = 60.0
GO_WAIT_SECONDS = 120.0
SAMPLES = 512
BATCH = 32


class Events:
    """Appends JSON lines for the parent; each line is flushed as written, so it survives the
    SIGKILL that follows it. Every line names the start of the worker group (``attempt``):
    the starts of one torchrun job share the file."""

    def __init__(self, path: Path, attempt: int) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the job
        self._lock = threading.Lock()
        self._attempt = attempt

    def emit(self, event: str, **fields: Any) -> None:
        with self._lock:
            self._file.write(json.dumps({"event": event, "attempt": self._attempt, **fields})
                             + "\n")
            self._file.flush()


class Job:
    """What the fault wrappers need: the pilot (for the saves completed so far) and the
    events file."""

    def __init__(self, events: Events, rank: int, world_size: int) -> None:
        self.events = events
        self.rank = rank
        self.world_size = world_size
        self.pilot: CheckpointPilot | None = None

    def saves(self) -> list[dict[str, Any]]:
        records = list(self.pilot.saves) if self.pilot is not None else []
        return [{"step": r.step, "level": r.level, "status": r.status, "tier": r.tier,
                 "location": r.location, "persist_seconds": r.persist_seconds}
                for r in records]

    def die(self, phase: str, step: int, **fields: Any) -> None:
        """Report the fault and the saves completed before it, then SIGKILL this process."""
        self.events.emit("fault", phase=phase, step=step, saves=self.saves(), **fields)
        os.kill(os.getpid(), signal.SIGKILL)


def _step_of(relpath: str) -> int | None:
    """The step of the checkpoint a remote path belongs to (staging or published)."""
    parsed = parse_checkpoint_name(relpath.split("/", 1)[0].split(STAGING_MARK, 1)[0])
    return None if parsed is None else parsed[0]


def _replace_function(original: Callable[..., Any], replacement: Callable[..., Any]) -> None:
    """Put ``replacement`` wherever a ckptpilot module holds ``original`` (the pilot imports
    functions by name, so patching their home module alone would not reach it)."""
    replaced = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "ckptpilot" or name.startswith("ckptpilot.")):
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, replacement)
                replaced += 1
    if replaced == 0:
        raise RuntimeError(f"fault point {original.__qualname__} is not used by ckptpilot")


def _wrap_remote_writes(on_open: Callable[[RemoteTier, str, HashingWriter], None]) -> None:
    """Call ``on_open(tier, relpath, writer)`` for every file the remote tier opens for
    writing (``write_file`` goes through ``open_write`` too)."""
    original = RemoteTier.open_write

    @contextlib.contextmanager
    def open_write(self: RemoteTier, relpath: str, **kwargs: Any) -> Iterator[HashingWriter]:
        with original(self, relpath, **kwargs) as out:
            on_open(self, relpath, out)
            yield out

    RemoteTier.open_write = open_write  # type: ignore[method-assign]


def _kill_in_capture(job: Job, at_step: int) -> None:
    original = state_module.capture
    signature = inspect.signature(original)

    @functools.wraps(original)
    def capture(*args: Any, **kwargs: Any) -> Any:
        snapshot = original(*args, **kwargs)
        step = int(signature.bind(*args, **kwargs).arguments["step"])
        if step >= at_step:
            job.die("capture", step, tier="memory")
        return snapshot

    _replace_function(original, capture)


def _kill_in_write(job: Job, at_step: int, *, wait: str | None = None) -> None:
    """Die after the first chunk of a checkpoint's tensors file (remote), or as a put to
    the peers begins. ``wait`` (distributed runs): first wait until rank 0 published the
    same step (``rank0-published``: the ranks' newest checkpoints then differ when this rank
    dies), or until every rank has begun writing it (``every-rank-writing``: all die
    mid-save, none is stopped by torchrun before it got there)."""

    def ready(tier: RemoteTier, step: int) -> bool:
        if wait == "rank0-published":
            return tier.exists(f"{checkpoint_name(step, 0)}/{MANIFEST_FILE}")
        names = tier.list()
        return all(any(n.startswith(checkpoint_name(step, r) + STAGING_MARK) for n in names)
                   for r in range(job.world_size))

    def on_open(tier: RemoteTier, relpath: str, out: HashingWriter) -> None:
        step = _step_of(relpath)
        if step is None or step < at_step or relpath.rsplit("/", 1)[-1] not in (
                TENSORS_FILE, CONTAINER_FILE):
            return
        waited = None if wait is None else rankfaults.wait_for(lambda: ready(tier, step),
                                                               OTHER_RANKS_WAIT_SECONDS)
        write = out.write

        def dying(data: bytes | memoryview) -> int:
            write(data)
            job.die("write", step, tier="remote", waited=waited)
            return 0

        out.write = dying  # type: ignore[method-assign]

    _wrap_remote_writes(on_open)
    original_put = PeerTier.put

    @functools.wraps(original_put)
    def put(self: PeerTier, ckpt_id: int, *args: Any, **kwargs: Any) -> Any:
        if ckpt_id >= at_step:
            job.die("write", ckpt_id, tier="peer")
        return original_put(self, ckpt_id, *args, **kwargs)

    PeerTier.put = put  # type: ignore[method-assign]


def _kill_in_validate(job: Job, at_step: int) -> None:
    original = PostWriteValidator.validate

    @functools.wraps(original)
    def validate(self: PostWriteValidator, tier: RemoteTier, name: str, manifest: Any,
                 *args: Any, **kwargs: Any) -> Any:
        step = int(manifest["step"])
        if step >= at_step:
            job.die("validate", step, tier="remote")
        return original(self, tier, name, manifest, *args, **kwargs)

    PostWriteValidator.validate = validate  # type: ignore[method-assign]


def _kill_in_publish(job: Job, at_step: int) -> None:
    """Die right after the atomic rename, before the pilot marks the row valid."""
    original = RemoteTier.publish

    @functools.wraps(original)
    def publish(self: RemoteTier, staging: str, final: str) -> None:
        original(self, staging, final)
        step = _step_of(final)
        if step is not None and step >= at_step:
            job.die("publish", step, tier="remote")

    RemoteTier.publish = publish  # type: ignore[method-assign]


def _enospc(job: Job, at_step: int) -> None:
    """From the first save of ``at_step`` on, the disk is full: after a few KB more, every
    write to the remote tier raises ``OSError(ENOSPC)``."""
    written = 0
    reported = False

    def on_open(tier: RemoteTier, relpath: str, out: HashingWriter) -> None:
        step = _step_of(relpath)
        if step is None or step < at_step:
            return
        write = out.write

        def full(data: bytes | memoryview) -> int:
            nonlocal written, reported
            if written >= ENOSPC_AFTER_BYTES:
                if not reported:
                    reported = True
                    job.events.emit("fault", phase="enospc", step=step, tier="remote",
                                    saves=job.saves())
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), tier.path(relpath))
            n = write(data)
            written += n
            return n

        out.write = full  # type: ignore[method-assign]

    _wrap_remote_writes(on_open)


_REMOTE_IO = ("new_staging", "write_file", "open_write", "publish", "set_aside", "list",
              "exists", "open_read", "read_bytes", "size", "read_verified", "verify", "digest",
              "write_record", "remove")


def _remote_down() -> None:
    """Every I/O method of the remote tier fails as a store that cannot be reached does."""

    def unreachable(name: str) -> Callable[..., Any]:
        def method(self: RemoteTier, *args: Any, **kwargs: Any) -> Any:
            raise OSError(errno.EHOSTUNREACH,
                          f"{os.strerror(errno.EHOSTUNREACH)} (remote tier {self.url} made "
                          f"unreachable by ckptpilot fit, in {name})")
        return method

    for name in _REMOTE_IO:
        if not callable(getattr(RemoteTier, name, None)):
            raise RuntimeError(f"fault point RemoteTier.{name} does not exist")
        setattr(RemoteTier, name, unreachable(name))


FLAKY_METHODS = ("open", "cat_file", "info", "ls", "exists", "pipe_file")


def _remote_flaky() -> None:
    """The object store behind the remote tier drops the connection on the first call of
    each of its file-system methods for each path (a reset, as a restarting server gives),
    then answers: the tier's retries must see every operation through. A file opened for
    writing reaches the store only when it is flushed, so its ``open`` is left alone."""
    failed: set[tuple[str, str]] = set()
    lock = threading.Lock()
    original_init = RemoteTier.__init__

    def flaky(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            mode = kwargs.get("mode", args[0] if args else "rb")
            if name == "open" and "r" not in str(mode):
                return method(path, *args, **kwargs)  # a write reaches the store at its flush
            with lock:
                first = (name, str(path)) not in failed
                failed.add((name, str(path)))
            if first:
                raise ConnectionResetError(errno.ECONNRESET, f"connection reset by ckptpilot "
                                           f"fit (remote-flaky, in {name} {path})")
            return method(path, *args, **kwargs)
        return call

    def init(self: RemoteTier, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        for name in FLAKY_METHODS:
            setattr(self.fs, name, flaky(name, getattr(self.fs, name)))

    RemoteTier.__init__ = init  # type: ignore[method-assign]


class BurstProvider(GpuHealthProvider):
    """A GPU that reports nothing until ``arm()``, then a burst: uncorrected ECC errors and
    three XIDs. ``wait_seen`` returns once the monitor has read the burst and polled again,
    so its snapshot carries the errors."""

    def __init__(self) -> None:
        self._armed = threading.Event()
        self._seen = threading.Event()
        self._reads_since_armed = 0

    def arm(self) -> None:
        self._armed.set()

    def wait_seen(self, timeout_seconds: float) -> bool:
        return self._seen.wait(timeout_seconds)

    def read(self) -> GpuReading:
        if not self._armed.is_set():
            return GpuReading(devices=(DeviceReading(index=0, ecc_volatile_uncorrected=0),))
        self._reads_since_armed += 1
        if self._reads_since_armed >= 2:
            self._seen.set()
        xids = (48, 63, 64) if self._reads_since_armed == 1 else ()
        return GpuReading(devices=(DeviceReading(index=0, ecc_volatile_uncorrected=5,
                                                 xid_events=xids),))


def _shift_clock(offset_seconds: float) -> None:
    """Make ``time.time`` lie by ``offset_seconds`` (a wall clock that jumped)."""
    real = time.time
    time.time = lambda: real() + offset_seconds  # type: ignore[assignment]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
            torch.nn.Dropout(0.2), torch.nn.Linear(64, 64), torch.nn.ReLU(),
            torch.nn.Dropout(0.2), torch.nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _final_state(t: Training) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """What the parent compares bit for bit: model, optimizer, schedule, cursor, RNGs."""
    sd = t.opt.state_dict()
    tensors = {f"model/{k}": v.contiguous() for k, v in t.model.state_dict().items()}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            tensors[f"opt/{pid}/{k}"] = v.contiguous()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    return tensors, {
        "param_groups": sd["param_groups"], "sampler": t.sampler.state_dict(),
        "sched": t.sched.state_dict(), "torch_rng": torch.get_rng_state().tolist(),
        "numpy_rng": [kind, keys.tolist(), pos, has_gauss, gauss],
        "python_rng": [version, list(py_state), py_gauss],
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ckptpilot.fit.job")
    p.add_argument("--config", required=True, help="the scenario's policy (run_dir inside)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dist", action="store_true", help="one rank of a torchrun (gloo) job")
    p.add_argument("--fault", choices=FAULTS)
    p.add_argument("--at-step", type=int, default=0)
    p.add_argument("--fault-rank", type=int, default=None,
                   help="only this rank injects the fault (default: every rank)")
    p.add_argument("--fault-attempt", type=int, default=0,
                   help="inject the fault only in this start of the torchrun worker group")
    p.add_argument("--quiet-at-step", type=int, default=None,
                   help="first start only: flush, report the saves and meet the other ranks "
                        "after this step, then wait for --go-file if given")
    p.add_argument("--clock-offset-seconds", type=float, default=0.0)
    p.add_argument("--exit-after-restore", action="store_true")
    p.add_argument("--pause-at-step", type=int, default=None)
    p.add_argument("--go-file", type=Path, default=None)
    return p.parse_args(argv)


def _install(fault: str | None, at_step: int, job: Job) -> None:
    """Wrap the library function at the fault point (faults in the loop need nothing)."""
    if fault == "kill-capture":
        _kill_in_capture(job, at_step)
    elif fault in WRITE_WAITS:
        _kill_in_write(job, at_step, wait=WRITE_WAITS[fault])
    elif fault == "kill-validate":
        _kill_in_validate(job, at_step)
    elif fault == "kill-publish":
        _kill_in_publish(job, at_step)
    elif fault == "enospc":
        _enospc(job, at_step)
    elif fault == "remote-down":
        _remote_down()
    elif fault == "remote-flaky":
        _remote_flaky()
    elif fault in rankfaults.FAULTS:
        rankfaults.install(fault, at_step, job.die, job.world_size)


@dataclass
class Training:
    """The model and everything that moves it, seeded: the same every time."""

    x: torch.Tensor
    y: torch.Tensor
    model: Net
    trained: torch.nn.Module  # the model, or its DDP wrapper
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    sampler: ResumableSampler
    world: int

    @classmethod
    def build(cls, steps: int, rank: int, world: int) -> Training:
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1234)
        x = torch.randn(SAMPLES, 16, generator=gen)
        y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
        model = Net()
        trained = (torch.nn.parallel.DistributedDataParallel(model) if world > 1
                   else model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
        x, y = x[rank::world], y[rank::world]
        return cls(x, y, model, trained, opt, sched, ResumableSampler(len(x), seed=7), world)

    def step(self) -> torch.Tensor:
        """One optimizer step (python, numpy and torch randomness all play a part)."""
        self.trained.train()
        idx = self.sampler.take(BATCH // self.world)
        noise = torch.from_numpy(np.random.standard_normal((len(idx), 16)).astype(np.float32))
        xb = self.x[idx] + 0.01 * noise * (1.0 + random.random())
        self.opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(self.trained(xb), self.y[idx])
        loss.backward()
        self.opt.step()
        self.sched.step()
        return loss


def _train(a: argparse.Namespace, job: Job, pilot: CheckpointPilot, training: Training,
           start: int, burst: BurstProvider | None) -> None:
    """Train from ``start`` to ``--steps``, with the faults that live in the loop."""
    kill_between = a.fault == "kill-between" and a.fault_rank in (None, job.rank)
    with open(a.out / f"losses_rank{job.rank:05d}.txt", "a") as losses:
        for step in range(start + 1, a.steps + 1):
            loss = training.step()
            losses.write(f"{step} {loss.item().hex()}\n")
            losses.flush()
            decision = pilot.observe(loss)
            if burst is not None and step == a.at_step:
                burst.arm()
                if not burst.wait_seen(BURST_WAIT_SECONDS):
                    raise RuntimeError("the health monitor never read the GPU provider")
            if a.fault == "nvml-burst" and decision.emergency and (burst is not None
                                                                    or a.dist):
                pilot.flush()  # every rank's organ complete before the burst's rank dies
                if a.dist:
                    torch.distributed.barrier()
                if burst is not None:
                    job.die("after the emergency organ", step,
                            level=decision.level.value if decision.level else None)
            if kill_between and step == a.at_step:
                pilot.flush()  # between saves: nothing in flight when the kill lands
                job.die("between saves", step)
            if step == a.quiet_at_step and rankfaults.attempt() == 0:
                rankfaults.quiet_point(job.events.emit, pilot, job.saves, step, dist=a.dist,
                                       go_file=a.go_file)
            if step == a.pause_at_step and a.go_file is not None:
                job.events.emit("paused", step=step)
                if not rankfaults.wait_for(a.go_file.exists, GO_WAIT_SECONDS):
                    raise RuntimeError(f"{a.go_file} did not appear")


def main(argv: list[str] | None = None) -> None:
    a = _parse(argv)
    torch.set_num_threads(1)
    rank, world = 0, 1
    if a.dist:
        torch.distributed.init_process_group("gloo")
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    a.out.mkdir(parents=True, exist_ok=True)
    job = Job(Events(a.out / f"events_rank{rank:05d}.jsonl", rankfaults.attempt()), rank, world)
    if a.clock_offset_seconds:
        _shift_clock(a.clock_offset_seconds)
    injects = (a.fault is not None and a.fault_rank in (None, rank)
               and rankfaults.attempt() == a.fault_attempt)
    _install(a.fault if injects else None, a.at_step, job)
    burst = BurstProvider() if injects and a.fault == "nvml-burst" else None
    training = Training.build(a.steps, rank, world)
    pilot = CheckpointPilot(load_policy(a.config), model=training.model, optimizer=training.opt,
                            lr_scheduler=training.sched, data_state=training.sampler,
                            gpu_health=FROM_POLICY if burst is None else burst)
    job.pilot = pilot
    if injects and a.fault == "stop-mid-step":
        rankfaults.stop_mid_step(training.model, lambda: pilot.step, a.at_step, job.events.emit)
    try:
        start = pilot.restore()
    except CkptPilotError as e:
        job.events.emit("refused", error=type(e).__name__, message=str(e))
        os._exit(EXIT_ERROR)
    rec = pilot.last_recovery
    assert rec is not None
    reached = max((s for s, _ in read_losses(a.out / f"losses_rank{rank:05d}.txt")), default=0)
    job.events.emit("restored", step=start, reached=reached, pid=os.getpid(),
                    source=rec.source.value,
                    level=rec.level,
                    steps_lost=rec.steps_lost, seconds=rec.seconds, location=rec.location,
                    skipped=[[s.location, s.reason] for s in rec.skipped])
    try:
        if not a.exit_after_restore:
            _train(a, job, pilot, training, start, burst)
        pilot.close()
    except SystemExit as e:  # the pilot ends the process (a preemption notice honoured)
        job.events.emit("exited", code=e.code, step=pilot.step, saves=job.saves())
        raise
    except CkptPilotError as e:
        job.events.emit("error", error=type(e).__name__, message=str(e), saves=job.saves())
        os._exit(EXIT_ERROR)
    if not a.exit_after_restore:
        tensors, info = _final_state(training)
        safetensors.torch.save_file(tensors, a.out / f"final_rank{rank:05d}.safetensors")
        (a.out / f"final_rank{rank:05d}.json").write_text(json.dumps(info))
    job.events.emit("done", step=pilot.step, saves=job.saves())
    if a.dist:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
