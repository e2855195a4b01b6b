"""GPU health through NVML: ECC counters, retired pages, remapped rows, XIDs, clock events.

This module owns what a GPU reading is (:class:`DeviceReading`, :class:`GpuReading`), the
provider interface the health monitor reads (:class:`GpuHealthProvider`) and its NVML
implementation. It does not summarise readings into a signal (``probes/monitor.py`` does) nor
decide anything (the scheduler does). NVML is optional: :func:`open_gpu_provider` answers None
where it cannot be used, unless the policy requires it.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ckptpilot.errors import CkptPilotError

__all__ = [
    "SEVERE_CLOCK_EVENTS",
    "DeviceReading",
    "GpuHealthProvider",
    "GpuReading",
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
    """Source of GPU readings for :class:`~ckptpilot.probes.monitor.HealthMonitor`.

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
