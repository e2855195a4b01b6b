"""A small real training job run as a child process by the crash tests.

Dropout, BatchNorm buffers, AdamW, a cosine LR schedule and shuffled data drawn through
``ResumableSampler``; every step's loss is appended (as a float hex string) to ``--losses``;
at the end the model and optimizer state go to ``--final`` (safetensors + JSON).

Fault injection (all real SIGKILLs of this process):
- ``--kill-after-step S``: after step S completed, was observed and no save is in flight;
- ``--kill-in-save S --kill-point {tensors,publish}``: while the background writer persists
  the checkpoint of step S — in the middle of the tensor file, or after every file of the
  staging directory was written but before it is published.

Preemption notices (tests/test_preemption.py): ``--notice-at-step S`` delivers the signal
``--notice`` in the middle of step S (after the backward pass): sent by this process itself,
or with ``--notice-from parent`` by the test, the step waiting until it arrives (a handler of
the job's own, which the pilot chains, tells it). ``--slow-publish STEP:SECONDS`` holds the
publication of the checkpoint of STEP back that long: a save still in flight.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import sys
import time

import torch
from helpers import save_final_state, seeded_data

from ckptpilot import CheckpointPilot, ResumableSampler, load_policy
from ckptpilot.fit.job import Net  # the same small real model `ckptpilot fit` trains
from ckptpilot.tiers.remote import archive
from ckptpilot.tiers.remote.store import RemoteTier


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _inject_kill_in_save(step: int, point: str) -> None:
    prefix = archive.checkpoint_name(step, 0)
    if point == "tensors":
        original = RemoteTier.write_record

        def write_record(self: RemoteTier, relpath: str, chunks, **kw):  # type: ignore[no-untyped-def]
            if relpath.startswith(prefix) and relpath.endswith(archive.TENSORS_FILE):
                def dying(source):  # type: ignore[no-untyped-def]
                    for i, chunk in enumerate(source):
                        yield chunk
                        if i == 2:
                            _die()
                chunks = dying(chunks)
            return original(self, relpath, chunks, **kw)

        RemoteTier.write_record = write_record  # type: ignore[method-assign]
        original_open = RemoteTier.open_write

        @contextlib.contextmanager
        def open_write(self: RemoteTier, relpath: str, **kw):  # type: ignore[no-untyped-def]
            with original_open(self, relpath, **kw) as out:
                if relpath.startswith(prefix) and relpath.endswith(archive.CONTAINER_FILE):
                    write, calls = out.write, itertools.count()

                    def dying(data):  # type: ignore[no-untyped-def]
                        n = write(data)
                        if next(calls) == 4:
                            _die()
                        return n
                    out.write = dying
                yield out

        RemoteTier.open_write = open_write  # type: ignore[method-assign]
    else:
        original_publish = RemoteTier.publish

        def publish(self: RemoteTier, staging: str, final: str) -> None:
            if final == prefix:
                _die()
            original_publish(self, staging, final)

        RemoteTier.publish = publish  # type: ignore[method-assign]


def _slow_publish(step: int, seconds: float) -> None:
    prefix = archive.checkpoint_name(step, 0)
    original_publish = RemoteTier.publish

    def publish(self: RemoteTier, staging: str, final: str) -> None:
        if final == prefix:
            time.sleep(seconds)
        original_publish(self, staging, final)

    RemoteTier.publish = publish  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--losses", required=True)
    p.add_argument("--final", required=True)
    p.add_argument("--kill-after-step", type=int)
    p.add_argument("--kill-in-save", type=int)
    p.add_argument("--kill-point", choices=["tensors", "publish"], default="tensors")
    p.add_argument("--notice-at-step", type=int)
    p.add_argument("--notice", default="SIGTERM")
    p.add_argument("--notice-from", choices=["self", "parent"], default="self")
    p.add_argument("--slow-publish")
    a = p.parse_args()
    if a.kill_in_save is not None:
        _inject_kill_in_save(a.kill_in_save, a.kill_point)
    if a.slow_publish is not None:
        slow_step, seconds = a.slow_publish.split(":")
        _slow_publish(int(slow_step), float(seconds))
    notice = signal.Signals[a.notice]
    noticed: list[int] = []
    if a.notice_at_step is not None:
        signal.signal(notice, lambda signum, frame: noticed.append(signum))

    x, y = seeded_data()

    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.steps)
    sampler = ResumableSampler(len(x), seed=7)
    pilot = CheckpointPilot(load_policy(a.config, run_dir=a.run_dir), model=model,
                            optimizer=opt, lr_scheduler=sched, data_state=sampler)
    start = pilot.restore()
    rec = pilot.last_recovery
    print(f"RESUMED {start} {rec.source.value} {rec.steps_lost} {rec.level}", flush=True)
    print("RECOVERY " + json.dumps({"location": rec.location, "bytes_read": rec.bytes_read,
                                    "skipped": [[s.location, s.reason] for s in rec.skipped]}),
          flush=True)
    with open(a.losses, "a") as log:
        for step in range(start, a.steps):
            model.train()
            idx = sampler.take(32)
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            if a.notice_at_step == step:
                if a.notice_from == "self":
                    os.kill(os.getpid(), notice)
                else:
                    print(f"WAITING {step}", flush=True)
                    deadline = time.monotonic() + 120  # a safety net: the test sends it
                    while not noticed and time.monotonic() < deadline:
                        time.sleep(0.01)
            opt.step()
            sched.step()
            log.write(f"{step} {loss.item().hex()}\n")
            log.flush()
            pilot.observe(loss)
            if a.kill_after_step == step:
                pilot.flush()  # "between saves": nothing in flight when the kill lands
                _die()
    pilot.close()
    save_final_state(model, opt, a.final, sampler=sampler.state_dict(),
                     sched=sched.state_dict(), torch_rng=torch.get_rng_state().tolist(),
                     saves=len(pilot.saves))
    print("DONE", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
