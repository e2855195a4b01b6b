"""Telemetry of checkpointing: the decision log (JSON lines) and TensorBoard scalars.

Owns one background thread and the files it writes; nothing else. The training thread only
enqueues plain values (``decision`` costs a deque append), so building protobufs and writing
files never run on it, and the thread runs at background priority (``ckptpilot.background``),
so they take few time slices from training. Priority does not decide who holds the GIL,
though: Python this thread runs delays the training thread's return from every operator, so
it does little of it — the event file is written by ``ckptpilot.format.tfevents``, without
importing TensorBoard's writer, whose import at the first save was most of the demo's loop
overhead (bench/RESULTS.md, loop.py). ``close()`` drains the queue.

Every decision goes to ``decisions_rank_{rank:05d}.jsonl``. TensorBoard gets
``checkpoint/score``, ``checkpoint/interval``, ``checkpoint/level`` (0 heartbeat only, 1 pulse,
2 organ) and the three signals (``checkpoint/signal_loss`` …) at every save and rollback and,
between them, for the newest decision of each batch the thread takes (about two a second),
when one of them changed — a flat curve costs nothing, and a fast loop does not pay a protobuf
per step on a thread that shares the interpreter with training — and ``checkpoint/save_seconds``,
``checkpoint/stall_seconds``, ``checkpoint/bytes`` for every completed save, and
``checkpoint/rollback_to`` (the step returned to) at the step of each instability rollback.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from pathlib import Path
from typing import Any

from ckptpilot.background import lower_priority, urgent
from ckptpilot.format.tfevents import EventFile
from ckptpilot.scheduler.decision import CheckpointDecision

log = logging.getLogger("ckptpilot")


class Telemetry:
    def __init__(self, run_dir: Path, *, rank: int, tensorboard: bool,
                 decision_log: bool) -> None:
        self._tb_dir = run_dir / "tensorboard"
        self._log_path = run_dir / f"decisions_rank_{rank:05d}.jsonl"
        self._tensorboard = tensorboard
        self._decision_log = decision_log
        self._queue: deque[tuple[str, Any]] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._writer: EventFile | None = None
        self._log_file: Any = None
        self._last_scalars: tuple[float, ...] | None = None
        self._thread: threading.Thread | None = None
        if tensorboard or decision_log:
            self._thread = threading.Thread(target=self._run, name="ckptpilot-telemetry",
                                            daemon=True)
            self._thread.start()

    # -- any thread ------------------------------------------------------------------------

    def decision(self, decision: CheckpointDecision) -> None:
        if self._thread is not None:
            self._queue.append(("decision", decision))

    def save(self, step: int, values: dict[str, float]) -> None:
        if self._tensorboard:
            self._queue.append(("save", (step, values)))
            self._wake.set()

    def close(self) -> None:
        if self._thread is None:
            return
        self._stop = True
        self._wake.set()
        with urgent():  # the thread runs at idle priority; now training waits for it
            self._thread.join()
        self._thread = None

    # -- telemetry thread ------------------------------------------------------------------

    def _run(self) -> None:
        lower_priority()  # few time slices from training (the GIL is another matter: above)
        while True:
            self._wake.wait(0.5)
            self._wake.clear()
            stopping = self._stop
            try:
                self._drain()
            except OSError as e:
                log.error("telemetry: cannot write to %s: %s", self._log_path.parent, e)
            if stopping:
                break
        if self._log_file is not None:
            self._log_file.close()
        if self._writer is not None:
            self._writer.close()

    def _drain(self) -> None:
        quiet: CheckpointDecision | None = None  # the newest one not plotted: no save, no rollback
        while self._queue:
            kind, item = self._queue.popleft()
            if kind == "decision":
                self._write_decision(item)
                if not self._tensorboard:
                    continue
                if item.save or item.rollback_to is not None:
                    if quiet is not None:  # steps reach TensorBoard in order
                        self._plot(quiet)
                        quiet = None
                    self._plot(item)
                else:
                    quiet = item
            else:
                step, values = item
                for tag, value in values.items():
                    self._tb().add_scalar(tag, value, step)
        if quiet is not None:
            self._plot(quiet)
        if self._log_file is not None:
            self._log_file.flush()
        if self._writer is not None:
            self._writer.flush()

    def _write_decision(self, d: CheckpointDecision) -> None:
        if self._decision_log:
            if self._log_file is None:
                self._log_file = open(self._log_path, "a")  # noqa: SIM115 - owned by the thread
            self._log_file.write(json.dumps({
                "step": d.step, "save": d.save, "level": d.level.value if d.level else None,
                "interval": d.interval, "score": round(d.score, 6), "signals": d.signals,
                "retention_class": d.retention_class.value, "reason": d.reason,
                **({"spike_onset": d.spike_onset} if d.spike_onset is not None else {}),
                **({"rollback_to": d.rollback_to} if d.rollback_to is not None else {}),
            }) + "\n")

    def _plot(self, d: CheckpointDecision) -> None:
        level = d.level.rank if d.save and d.level is not None else 0
        if d.rollback_to is not None:
            self._tb().add_scalar("checkpoint/rollback_to", d.rollback_to, d.step)
        sig = d.signals
        scalars = (d.score, float(d.interval), float(level), sig.get("loss", 0.0),
                   sig.get("grad", 0.0), sig.get("system", 0.0))
        if scalars == self._last_scalars:
            return
        self._last_scalars = scalars
        tags = ("checkpoint/score", "checkpoint/interval", "checkpoint/level",
                "checkpoint/signal_loss", "checkpoint/signal_grad", "checkpoint/signal_system")
        tb = self._tb()
        for tag, value in zip(tags, scalars, strict=True):
            tb.add_scalar(tag, value, d.step)

    def _tb(self) -> EventFile:
        if self._writer is None:
            self._writer = EventFile(self._tb_dir)
        return self._writer
