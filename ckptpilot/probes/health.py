"""System-health probes: GPU errors through NVML and IO latency of the run directory (SPEC §4.3).

This module owns how the system signal is measured and summarised into a
:class:`~ckptpilot.scheduler.decision.SystemHealth`; it does not decide anything (the scheduler
does, from the snapshots) and it never runs on the training thread.

Threads: :class:`HealthMonitor` runs one background thread that, every ``interval_seconds``,
times a write + fsync in the run directory and reads the GPU provider. The training thread only
calls :meth:`HealthMonitor.snapshot`, which returns the latest summary under a lock held for
microseconds. NVML is optional: without it (no driver, no GPU, ``nvml: false``) the GPU part is
absent, reported once, and the signal comes from IO alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ckptpilot.errors import CkptPilotError
from ckptpilot.policy import SystemSignalPolicy
from ckptpilot.scheduler.decision import SystemHealth

__all__ = [
    "FROM_POLICY",
    "SEVERE_CLOCK_EVENTS",
    "DeviceReading",
    "FsyncProbe",
    "GpuHealthProvider",
    "GpuReading",
    "HealthMonitor",
    "NvmlProvider",
    "NvmlUnavailableError",
    "open_gpu_provider",
]

log = logging.getLogger("ckptpilot")

# Clock event ("throttle") reason bits of nvmlDeviceGetCurrentClocksEventReasons, from nvml.h.
# Only the ones that mean the hardware is in trouble; SW power capping and idle are routine.
SEVERE_CLOCK_EVENTS: dict[int, str] = {
    0x08: "hw_slowdown",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
}


class NvmlUnavailableError(CkptPilotError, RuntimeError):
    """``scheduler.system.nvml`` is ``true`` but NVML cannot be used on this machine."""


@dataclass(frozen=True)
class DeviceReading:
    """What one GPU reports. A field is None when the device or driver does not offer it.

    ECC counts are cumulative (volatile: since the driver loaded; aggregate: lifetime).
    ``xid_events`` are the XIDs delivered since the previous reading (None: no event set).
    ``clock_event_reasons`` is the NVML bit mask of why clocks are reduced. ``lost`` means the
    GPU fell off the bus.
    """

    index: int
    ecc_volatile_uncorrected: int | None = None
    ecc_volatile_corrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    ecc_aggregate_corrected: int | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    xid_events: tuple[int, ...] | None = None
    clock_event_reasons: int | None = None
    lost: bool = False

    def hard_error_counters(self) -> dict[str, int]:
        """The cumulative counters whose increase is a hard error, by name.

        Uncorrected ECC uses the volatile count, or the aggregate one where only that exists.
        """
        uncorrected = self.ecc_volatile_uncorrected
        if uncorrected is None:
            uncorrected = self.ecc_aggregate_uncorrected
        counters = {
            "ecc_uncorrected": uncorrected,
            "retired_pages_sbe": self.retired_pages_sbe,
            "retired_pages_dbe": self.retired_pages_dbe,
            "remapped_rows_correctable": self.remapped_rows_correctable,
            "remapped_rows_uncorrectable": self.remapped_rows_uncorrectable,
        }
        return {name: value for name, value in counters.items() if value is not None}

    def severe_clock_events(self) -> list[str]:
        """Names of the severe throttling reasons active now (thermal, power brake)."""
        reasons = self.clock_event_reasons or 0
        return [name for bit, name in SEVERE_CLOCK_EVENTS.items() if reasons & bit]


@dataclass(frozen=True)
class GpuReading:
    """One reading of every GPU the provider watches."""

    devices: tuple[DeviceReading, ...]


class GpuHealthProvider(ABC):
    """Source of GPU readings for :class:`HealthMonitor`.

    Lifecycle: built (ready to read) → :meth:`read` any number of times → :meth:`close`.
    The monitor that receives a provider owns it: it calls ``read`` and ``close`` from its
    background thread only. ``read`` may raise; the monitor logs the error and keeps its last
    GPU state.
    """

    @abstractmethod
    def read(self) -> GpuReading:
        """Read every device now; queries a device does not support are left as None."""

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release what the provider holds."""


class NvmlProvider(GpuHealthProvider):
    """Reads ECC counters, retired pages, remapped rows, XID events and clock events via NVML.

    Build it with :func:`open_gpu_provider` (which initialises NVML). XIDs come from one event
    set per device, registered for critical-XID events and drained with a 0 ms wait on every
    read; a device that refuses registration simply reports no XIDs.
    """

    _MAX_EVENTS_PER_READ = 64

    def __init__(self, nvml: ModuleType) -> None:
        self._nvml = nvml
        # A query the device or driver does not offer leaves its field None.
        self._unsupported = (
            nvml.NVMLError_NotSupported,
            nvml.NVMLError_FunctionNotFound,
            nvml.NVMLError_NoPermission,
        )
        self._handles = [
            nvml.nvmlDeviceGetHandleByIndex(index) for index in range(nvml.nvmlDeviceGetCount())
        ]
        self._event_sets = [self._register_events(handle) for handle in self._handles]

    @property
    def device_count(self) -> int:
        return len(self._handles)

    def read(self) -> GpuReading:
        return GpuReading(
            devices=tuple(
                self._read_device(index, handle, events)
                for index, (handle, events) in enumerate(
                    zip(self._handles, self._event_sets, strict=True)
                )
            )
        )

    def close(self) -> None:
        nvml = self._nvml
        for event_set in self._event_sets:
            if event_set is not None:
                try:
                    nvml.nvmlEventSetFree(event_set)
                except nvml.NVMLError as exc:
                    log.debug("nvmlEventSetFree failed: %s", exc)
        self._event_sets = [None] * len(self._handles)
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as exc:
            log.debug("nvmlShutdown failed: %s", exc)

    def _register_events(self, handle: Any) -> Any:
        nvml = self._nvml
        try:
            supported = nvml.nvmlDeviceGetSupportedEventTypes(handle)
            if not supported & nvml.nvmlEventTypeXidCriticalError:
                return None
            event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError:
            return None
        try:
            nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, event_set)
        except nvml.NVMLError:
            nvml.nvmlEventSetFree(event_set)
            return None
        return event_set

    def _read_device(self, index: int, handle: Any, event_set: Any) -> DeviceReading:
        nvml = self._nvml
        fields: dict[str, Any] = {}
        uncorrected, corrected = (
            nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
        )
        ecc_queries = {
            "ecc_volatile_uncorrected": (uncorrected, nvml.NVML_VOLATILE_ECC),
            "ecc_volatile_corrected": (corrected, nvml.NVML_VOLATILE_ECC),
            "ecc_aggregate_uncorrected": (uncorrected, nvml.NVML_AGGREGATE_ECC),
            "ecc_aggregate_corrected": (corrected, nvml.NVML_AGGREGATE_ECC),
        }
        retirement_causes = {
            "retired_pages_sbe": nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            "retired_pages_dbe": nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        }
        try:
            for name, (error_type, counter) in ecc_queries.items():
                fields[name] = self._query(
                    nvml.nvmlDeviceGetTotalEccErrors, handle, error_type, counter
                )
            for name, cause in retirement_causes.items():
                pages = self._query(nvml.nvmlDeviceGetRetiredPages, handle, cause)
                fields[name] = None if pages is None else len(pages)
            rows = self._query(nvml.nvmlDeviceGetRemappedRows, handle)
            if rows is not None:
                correctable, uncorrectable, pending, failed = rows
                fields.update(
                    remapped_rows_correctable=int(correctable),
                    remapped_rows_uncorrectable=int(uncorrectable),
                    remap_pending=bool(pending),
                    remap_failed=bool(failed),
                )
            reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
            if reasons is None:  # nvidia-ml-py before 12.535 only has the older name
                reasons = nvml.nvmlDeviceGetCurrentClocksThrottleReasons
            fields["clock_event_reasons"] = self._query(reasons, handle)
            if event_set is not None:
                fields["xid_events"] = self._drain_xids(event_set)
        except nvml.NVMLError_GpuIsLost:
            return DeviceReading(index=index, lost=True, **fields)
        return DeviceReading(index=index, **fields)

    def _query(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)``, or None when the device does not support the query."""
        try:
            return function(*args)
        except self._unsupported:
            return None

    def _drain_xids(self, event_set: Any) -> tuple[int, ...]:
        nvml = self._nvml
        xids = []
        for _ in range(self._MAX_EVENTS_PER_READ):
            try:
                data = nvml.nvmlEventSetWait(event_set, 0)
            except nvml.NVMLError_Timeout:
                break
            if data.eventType == nvml.nvmlEventTypeXidCriticalError:
                xids.append(int(data.eventData))
        return tuple(xids)


def open_gpu_provider(mode: str | bool) -> NvmlProvider | None:
    """The NVML provider for ``scheduler.system.nvml`` = ``mode``, or None.

    ``auto``: NVML when it initialises and sees at least one GPU, else None and one INFO line
    ``NVML unavailable: <reason>`` on the ``ckptpilot`` logger. ``true``: NVML or
    :class:`NvmlUnavailableError`. ``false``: None, NVML is not even loaded.
    """
    if isinstance(mode, bool):
        required = mode
    elif isinstance(mode, str) and mode.lower() in ("auto", "true", "false"):
        required = {"auto": None, "true": True, "false": False}[mode.lower()]
    else:
        raise ValueError(f"nvml mode must be auto, true or false, got {mode!r}")
    if required is False:
        return None
    try:
        provider = _open_nvml()
    except NvmlUnavailableError as exc:
        if required:
            raise NvmlUnavailableError(
                f"scheduler.system.nvml is true but NVML is unavailable: {exc}; install the "
                "NVIDIA driver and nvidia-ml-py, or set scheduler.system.nvml to auto"
            ) from exc
        log.info("NVML unavailable: %s", exc)
        return None
    return provider


def _open_nvml() -> NvmlProvider:
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlUnavailableError(f"nvidia-ml-py is not installed ({exc})") from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NvmlUnavailableError(str(exc)) from exc
    try:
        provider = NvmlProvider(pynvml)
    except pynvml.NVMLError as exc:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
        raise NvmlUnavailableError(f"cannot enumerate GPUs: {exc}") from exc
    if provider.device_count == 0:
        provider.close()
        raise NvmlUnavailableError("no GPU found")
    return provider


class FsyncProbe:
    """Times a 4 KiB write + fsync of a private file in ``run_dir``; returns milliseconds.

    Called by the monitor thread; :meth:`close` removes the file. The directory is created if
    it does not exist yet (the run will write there anyway).
    """

    _PAYLOAD = b"\0" * 4096

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir) / f".io-probe-{os.getpid()}"
        self._fd: int | None = None

    def __call__(self) -> float:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        started = time.perf_counter()
        os.pwrite(self._fd, self._PAYLOAD, 0)
        os.fsync(self._fd)
        return (time.perf_counter() - started) * 1000.0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.path.unlink(missing_ok=True)


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
