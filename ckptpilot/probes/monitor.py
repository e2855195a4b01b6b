"""The health monitor: GPU and IO probes summarised into a SystemHealth (SPEC §4.3).

This module owns how the probes' readings become the system signal, a
:class:`~ckptpilot.scheduler.decision.SystemHealth` (the scheduler's input); it does not decide
anything (the scheduler does, from the snapshots), and its probing never runs on the training
thread.

Threads: :class:`HealthMonitor` runs one background thread that, every ``interval_seconds``,
times a write + fsync in the run directory (``probes/fsync.py``) and reads the GPU provider
(``probes/gpu.py``). The training thread only calls :meth:`HealthMonitor.snapshot`, which
returns the latest summary under a lock held for microseconds. NVML is optional: without it
(no driver, no GPU, ``nvml: false``) the GPU part is absent, reported once, and the signal
comes from IO alone.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptpilot.policy import SystemSignalPolicy
from ckptpilot.probes.fsync import FsyncProbe
from ckptpilot.probes.gpu import GpuHealthProvider, open_gpu_provider
from ckptpilot.scheduler.decision import SystemHealth

__all__ = ["FROM_POLICY", "HealthMonitor"]

log = logging.getLogger("ckptpilot")


class _FromPolicy:
    def __repr__(self) -> str:
        return "FROM_POLICY"


FROM_POLICY: Any = _FromPolicy()
"""Default ``provider`` of :class:`HealthMonitor`: open one from ``policy.nvml``."""


class HealthMonitor:
    """Background probes summarised as :class:`SystemHealth` snapshots.

    Lifecycle: construct (opens the GPU provider from ``policy.nvml`` unless one is given;
    ``nvml: true`` without NVML raises here) → :meth:`start` → :meth:`snapshot` from any thread,
    as often as wanted → :meth:`stop` (joins the thread, closes the provider and the probe).
    :meth:`poll` runs one round on the calling thread; the background loop calls it, and tests
    may call it directly with an injected ``clock`` instead of starting the thread.

    Signals, each 0 or 1, and ``signal`` = the larger:
    - IO: every probe (``io_probe`` returns milliseconds; an ``OSError`` counts as slow) above
      ``policy.io_latency_ms`` for at least ``policy.sustained_seconds``. A probe stuck in
      ``fsync`` that long counts too: :meth:`snapshot` notices it while it is still running.
    - GPU: a hard error (uncorrected ECC, retired page, remapped row, XID, lost GPU) within the
      last ``gpu_alarm_hold_seconds``, or severe throttling active now.
    ``hard_errors`` counts the hard errors seen since the monitor's first reading (that reading
    is the baseline; a counter that goes down, e.g. after a driver reload, is re-based), so it
    never decreases. A provider whose ``read`` raises is logged once per distinct error and the
    GPU part keeps its previous value.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        policy: SystemSignalPolicy,
        provider: GpuHealthProvider | None = FROM_POLICY,
        *,
        interval_seconds: float = 1.0,
        gpu_alarm_hold_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        io_probe: Callable[[], float] | None = None,
    ) -> None:
        for name, value in (
            ("interval_seconds", interval_seconds),
            ("gpu_alarm_hold_seconds", gpu_alarm_hold_seconds),
        ):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        self.run_dir = Path(run_dir)
        self.policy = policy
        self._provider = open_gpu_provider(policy.nvml) if provider is FROM_POLICY else provider
        self._interval_seconds = interval_seconds
        self._hold_seconds = gpu_alarm_hold_seconds
        self._clock = clock
        self._io_probe = io_probe if io_probe is not None else FsyncProbe(run_dir)

        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._logged_errors: set[str] = set()
        # Guarded by _lock: the summary and what snapshot() needs to detect a stuck probe.
        self._latest = SystemHealth(gpu_available=self._provider is not None)
        self._probe_started: float | None = None
        self._slow_since: float | None = None
        # Owned by the thread running poll().
        self._counters: dict[tuple[int, str], int] = {}
        self._lost_devices: set[int] = set()
        self._hard_errors = 0
        self._last_increase_at: float | None = None
        self._gpu_signal = 0.0
        self._gpu_details: dict[str, Any] = {}

    @property
    def gpu_available(self) -> bool:
        return self._provider is not None

    def start(self) -> None:
        """Start the background thread (once; a stopped monitor cannot be restarted)."""
        if self._thread is not None or self._stop_event.is_set():
            raise RuntimeError("HealthMonitor.start() may be called once, before stop()")
        self._thread = threading.Thread(target=self._run, name="ckptpilot-health", daemon=True)
        self._thread.start()

    def stop(self, timeout_seconds: float = 10.0) -> None:
        """Stop the thread, then close the provider and the IO probe. Idempotent.

        A thread still stuck in a probe after ``timeout_seconds`` (a hung ``fsync``) is left
        behind, as a daemon, with its provider and probe open, so that stop never hangs.
        """
        self._stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout_seconds)
            if self._thread.is_alive():
                log.warning(
                    "health monitor thread still busy after %.1f s (IO probe in %s stuck?); "
                    "leaving it behind",
                    timeout_seconds,
                    self.run_dir,
                )
                return
        provider, self._provider = self._provider, None
        if provider is not None:
            provider.close()
        close_probe = getattr(self._io_probe, "close", None)
        if close_probe is not None:
            close_probe()

    def __enter__(self) -> HealthMonitor:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def snapshot(self) -> SystemHealth:
        """The latest summary; cheap and thread-safe (the training thread calls it per step)."""
        with self._lock:
            latest = self._latest
            started = self._probe_started
            slow_since = self._slow_since
        if started is None:
            return latest
        now = self._clock()
        if (now - started) * 1000.0 <= self.policy.io_latency_ms:
            return latest  # the probe in flight is not slow (yet)
        stalled = now - (started if slow_since is None else slow_since)
        if stalled < self.policy.sustained_seconds:
            return latest
        details = {**latest.details, "io_signal": 1.0, "io_stalled_seconds": round(stalled, 3)}
        return dataclasses.replace(latest, signal=1.0, details=details)

    def poll(self) -> SystemHealth:
        """Run one IO probe and one GPU reading now, update and return the summary.

        Background thread (or a test); never the training thread: the probe fsyncs.
        """
        started = self._clock()
        with self._lock:
            self._probe_started = started
        io_error = None
        try:
            latency_ms: float | None = self._io_probe()
        except OSError as exc:
            latency_ms = None
            io_error = f"{type(exc).__name__}: {exc}"
            self._log_once("IO probe in %s failed: %s", self.run_dir, io_error)
        self._read_gpu()
        now = self._clock()
        slow = latency_ms is None or latency_ms > self.policy.io_latency_ms
        with self._lock:
            self._probe_started = None
            if not slow:
                self._slow_since = None
            elif self._slow_since is None:
                self._slow_since = started
            slow_for = 0.0 if self._slow_since is None else now - self._slow_since
            io_signal = 1.0 if slow and slow_for >= self.policy.sustained_seconds else 0.0
            details: dict[str, Any] = {
                "io_signal": io_signal,
                "io_slow_seconds": round(slow_for, 3),
                "gpu_signal": self._gpu_signal,
                **self._gpu_details,
            }
            if io_error is not None:
                details["io_error"] = io_error
            self._latest = SystemHealth(
                signal=max(io_signal, self._gpu_signal),
                hard_errors=self._hard_errors,
                gpu_available=self._provider is not None,
                io_latency_ms=latency_ms,
                details=details,
            )
            return self._latest

    def _run(self) -> None:
        while not self._stop_event.is_set():
            self.poll()
            self._stop_event.wait(self._interval_seconds)

    def _read_gpu(self) -> None:
        if self._provider is None:
            return
        try:
            reading = self._provider.read()
        except Exception as exc:  # any provider failure: log it, never kill the thread
            self._log_once("GPU health read failed: %s", f"{type(exc).__name__}: {exc}")
            return
        now = self._clock()
        new_errors = 0
        xids: list[int] = []
        throttled: dict[str, list[str]] = {}
        for device in reading.devices:
            for name, value in device.hard_error_counters().items():
                key = (device.index, name)
                previous = self._counters.get(key)
                if previous is not None and value > previous:
                    new_errors += value - previous
                self._counters[key] = value
            if device.xid_events:
                new_errors += len(device.xid_events)
                xids.extend(device.xid_events)
            if device.lost and device.index not in self._lost_devices:
                self._lost_devices.add(device.index)
                new_errors += 1
            severe = device.severe_clock_events()
            if severe:
                throttled[str(device.index)] = severe
        if new_errors:
            self._hard_errors += new_errors
            self._last_increase_at = now
            log.warning(
                "GPU hard errors: %d new (%d since start)%s",
                new_errors,
                self._hard_errors,
                f", XIDs {xids}" if xids else "",
            )
        recent = self._last_increase_at is not None and (
            now - self._last_increase_at < self._hold_seconds
        )
        self._gpu_signal = 1.0 if recent or throttled else 0.0
        self._gpu_details = {"gpu_devices": len(reading.devices)}
        if throttled:
            self._gpu_details["gpu_throttle"] = throttled
        if xids:
            self._gpu_details["gpu_xids"] = xids
        if self._lost_devices:
            self._gpu_details["gpu_lost"] = sorted(self._lost_devices)

    def _log_once(self, message: str, *args: object) -> None:
        key = message % args
        if key not in self._logged_errors:
            self._logged_errors.add(key)
            log.warning(message, *args)
