"""System health probes: NVML absence, fake GPU providers, sustained and stuck IO latency.

This machine has no NVIDIA driver: the NVML-unavailable tests run here and skip on a GPU box,
where the real-NVML test runs instead. Fake providers stand in for a failing GPU.
"""

from __future__ import annotations

import logging
import threading
import time
import types
from collections.abc import Callable, Iterable
from pathlib import Path

import pynvml
import pytest

from ckptpilot.policy import SystemSignalPolicy
from ckptpilot.probes.fsync import FsyncProbe
from ckptpilot.probes.gpu import (
    DeviceReading,
    GpuHealthProvider,
    GpuReading,
    NvmlProvider,
    NvmlUnavailableError,
    open_gpu_provider,
)
from ckptpilot.probes.monitor import HealthMonitor
from ckptpilot.scheduler.decision import SystemHealth


def _nvml_works() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


NVML_WORKS = _nvml_works()
needs_no_nvml = pytest.mark.skipif(NVML_WORKS, reason="NVML works on this machine")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ScriptedProvider(GpuHealthProvider):
    """Returns the given readings in turn, then repeats the last one."""

    def __init__(self, readings: Iterable[GpuReading]) -> None:
        self.readings = list(readings)
        self.calls = 0
        self.closed = False

    def read(self) -> GpuReading:
        reading = self.readings[min(self.calls, len(self.readings) - 1)]
        self.calls += 1
        return reading

    def close(self) -> None:
        self.closed = True


class FailingProvider(GpuHealthProvider):
    def __init__(self, first: GpuReading | None = None) -> None:
        self.first = first
        self.calls = 0

    def read(self) -> GpuReading:
        self.calls += 1
        if self.calls == 1 and self.first is not None:
            return self.first
        raise RuntimeError("NVML went away")


def _gpu(**fields: object) -> GpuReading:
    return GpuReading(devices=(DeviceReading(index=0, **fields),))  # type: ignore[arg-type]


def _policy(**overrides: object) -> SystemSignalPolicy:
    return SystemSignalPolicy(**{"nvml": False, **overrides})  # type: ignore[arg-type]


def _fast_probe() -> float:
    return 0.5


def _wait_for(condition: Callable[[], bool], timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


@needs_no_nvml
def test_auto_without_nvml_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ckptpilot")
    assert open_gpu_provider("auto") is None
    lines = [r.getMessage() for r in caplog.records if "NVML unavailable" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith("NVML unavailable: ")
    assert open_gpu_provider(False) is None
    assert open_gpu_provider("false") is None


@needs_no_nvml
def test_nvml_true_without_nvml_raises() -> None:
    with pytest.raises(NvmlUnavailableError, match=r"scheduler\.system\.nvml is true but NVML"):
        open_gpu_provider("true")
    with pytest.raises(NvmlUnavailableError, match=r"set scheduler\.system\.nvml to auto"):
        HealthMonitor("unused", _policy(nvml=True))


def test_bad_nvml_mode() -> None:
    with pytest.raises(ValueError, match="nvml mode must be auto, true or false"):
        open_gpu_provider("sometimes")


def test_auto_reports_driver_failure_anywhere(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_driver() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    caplog.set_level(logging.INFO, logger="ckptpilot")
    assert open_gpu_provider("auto") is None
    assert [r.getMessage() for r in caplog.records] == ["NVML unavailable: Driver Not Loaded"]


@needs_no_nvml
def test_monitor_without_gpu_real_run_dir(tmp_path: Path) -> None:
    policy = SystemSignalPolicy()  # nvml: auto, io_latency_ms 15, sustained_seconds 5
    monitor = HealthMonitor(tmp_path, policy, interval_seconds=0.01)
    assert monitor.snapshot() == SystemHealth(gpu_available=False)
    with monitor:
        _wait_for(lambda: monitor.snapshot().io_latency_ms is not None)
        health = monitor.snapshot()
    assert health.gpu_available is False
    assert health.signal == 0.0 and health.hard_errors == 0
    assert health.io_latency_ms is not None and health.io_latency_ms > 0
    assert list(tmp_path.iterdir()) == []  # the probe file is removed on stop


def test_real_fsync_probe(tmp_path: Path) -> None:
    probe = FsyncProbe(tmp_path / "run")
    latency_ms = probe()
    assert latency_ms > 0
    assert probe.path.stat().st_size == 4096
    probe.close()
    assert not probe.path.exists()


def test_ecc_increase_raises_hard_errors_and_signal(tmp_path: Path) -> None:
    clock = FakeClock()
    provider = ScriptedProvider(
        [
            _gpu(ecc_volatile_uncorrected=2, retired_pages_dbe=1),  # old errors: the baseline
            _gpu(ecc_volatile_uncorrected=3, retired_pages_dbe=1),
            _gpu(ecc_volatile_uncorrected=3, retired_pages_dbe=1),
            _gpu(ecc_volatile_uncorrected=0, retired_pages_dbe=1),  # driver reload: re-based
            _gpu(ecc_volatile_uncorrected=0, retired_pages_dbe=1, xid_events=(79,)),
        ]
    )
    monitor = HealthMonitor(
        tmp_path,
        _policy(),
        provider,
        clock=clock,
        io_probe=_fast_probe,
        gpu_alarm_hold_seconds=30.0,
    )
    first = monitor.poll()
    assert (first.hard_errors, first.signal, first.gpu_available) == (0, 0.0, True)
    clock.now += 1
    alarm = monitor.poll()
    assert (alarm.hard_errors, alarm.signal) == (1, 1.0)
    assert alarm.details["gpu_signal"] == 1.0 and alarm.details["io_signal"] == 0.0
    clock.now += 29
    assert monitor.poll().signal == 1.0  # still within the hold
    clock.now += 2
    calm = monitor.poll()
    assert (calm.hard_errors, calm.signal) == (1, 0.0)
    clock.now += 1
    xid = monitor.poll()
    assert (xid.hard_errors, xid.signal) == (2, 1.0)
    assert xid.details["gpu_xids"] == [79]
    assert monitor.snapshot() == xid
    monitor.stop()
    assert provider.closed


def test_severe_throttling_raises_signal(tmp_path: Path) -> None:
    provider = ScriptedProvider(
        [_gpu(clock_event_reasons=0x04), _gpu(clock_event_reasons=0x04 | 0x40), _gpu()]
    )
    monitor = HealthMonitor(tmp_path, _policy(), provider, io_probe=_fast_probe)
    assert monitor.poll().signal == 0.0  # SW power cap is routine
    throttled = monitor.poll()
    assert throttled.signal == 1.0 and throttled.hard_errors == 0
    assert throttled.details["gpu_throttle"] == {"0": ["hw_thermal_slowdown"]}
    assert monitor.poll().signal == 0.0


def test_lost_gpu_is_a_hard_error_once(tmp_path: Path) -> None:
    provider = ScriptedProvider([_gpu(), _gpu(lost=True)])
    monitor = HealthMonitor(tmp_path, _policy(), provider, io_probe=_fast_probe)
    monitor.poll()
    assert monitor.poll().hard_errors == 1
    lost = monitor.poll()
    assert (lost.hard_errors, lost.signal, lost.details["gpu_lost"]) == (1, 1.0, [0])


def test_failing_provider_is_logged_once_and_the_thread_survives(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ckptpilot")
    provider = FailingProvider(first=_gpu(clock_event_reasons=0x80))
    monitor = HealthMonitor(
        tmp_path, _policy(), provider, interval_seconds=0.005, io_probe=_fast_probe
    )
    with monitor:
        _wait_for(lambda: provider.calls >= 10)
        health = monitor.snapshot()
        assert monitor._thread is not None and monitor._thread.is_alive()
    failures = [r for r in caplog.records if "GPU health read failed" in r.getMessage()]
    assert len(failures) == 1
    assert "RuntimeError: NVML went away" in failures[0].getMessage()
    assert health.signal == 1.0  # the power brake seen before the failures stays as is
    assert health.io_latency_ms == 0.5


def test_sustained_io_latency_with_fake_clock(tmp_path: Path) -> None:
    clock = FakeClock()
    latencies = iter([20.0, 20.0, 20.0, 3.0, 20.0, 20.0, 20.0, 20.0, 20.0, 20.0, 2.0])

    def probe() -> float:
        clock.now += 0.125  # each round takes 0.125 s (exact in binary)
        return next(latencies)

    monitor = HealthMonitor(
        tmp_path,
        _policy(io_latency_ms=15, sustained_seconds=0.5),
        None,
        clock=clock,
        io_probe=probe,
    )
    signals = [monitor.poll().signal for _ in range(11)]
    # The fast 4th probe resets the span; slow again from the 5th probe's start, the span
    # reaches 0.5 s at the end of the 8th; the fast 11th ends it.
    assert signals == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0]


def test_sustained_io_latency_with_a_slow_real_probe(tmp_path: Path) -> None:
    slow = threading.Event()
    slow.set()

    def probe() -> float:
        started = time.perf_counter()
        if slow.is_set():
            time.sleep(0.02)
        return (time.perf_counter() - started) * 1000.0

    monitor = HealthMonitor(
        tmp_path,
        _policy(io_latency_ms=15, sustained_seconds=0.15),
        None,
        interval_seconds=0.005,
        io_probe=probe,
    )
    started = time.monotonic()
    with monitor:
        _wait_for(lambda: monitor.snapshot().signal == 1.0)
        assert time.monotonic() - started >= 0.15
        assert monitor.snapshot().io_latency_ms > 15  # type: ignore[operator]
        slow.clear()
        _wait_for(lambda: monitor.snapshot().signal == 0.0)


def test_stuck_probe_is_noticed_while_it_hangs_and_stop_does_not_hang(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ckptpilot")
    release = threading.Event()
    entered = threading.Event()

    def probe() -> float:
        entered.set()
        release.wait(5)
        return 1.0

    monitor = HealthMonitor(
        tmp_path,
        _policy(io_latency_ms=15, sustained_seconds=0.1),
        None,
        interval_seconds=0.01,
        io_probe=probe,
    )
    monitor.start()
    assert entered.wait(2)
    assert monitor.snapshot().signal == 0.0
    _wait_for(lambda: monitor.snapshot().signal == 1.0)
    assert monitor.snapshot().details["io_stalled_seconds"] >= 0.1

    started = time.monotonic()
    monitor.stop(timeout_seconds=0.05)
    assert time.monotonic() - started < 1.0
    assert any("still busy" in r.getMessage() for r in caplog.records)
    release.set()
    assert monitor._thread is not None
    monitor._thread.join(2)
    assert monitor.snapshot().signal == 0.0  # the probe finished fast after all


def test_io_errors_count_as_slow_and_are_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ckptpilot")
    clock = FakeClock()

    def probe() -> float:
        clock.now += 1.0
        raise OSError(28, "No space left on device")

    monitor = HealthMonitor(
        tmp_path, _policy(sustained_seconds=3), None, clock=clock, io_probe=probe
    )
    readings = [monitor.poll() for _ in range(4)]
    assert [r.signal for r in readings] == [0, 0, 1, 1]
    assert readings[-1].io_latency_ms is None
    assert "No space left on device" in readings[-1].details["io_error"]
    assert len([r for r in caplog.records if "IO probe" in r.getMessage()]) == 1


def _fake_nvml(*, lost: bool = False, xids: Iterable[int] = (), ecc: int = 5) -> types.ModuleType:
    """A pynvml stand-in with the real error classes and constants: one device, no row remapper,
    no retired pages, ECC counters and XID events as given."""
    nvml = types.ModuleType("fake_pynvml")
    for name in dir(pynvml):
        if name.startswith(("NVMLError", "NVML_", "nvmlEventType", "nvmlClocks")):
            setattr(nvml, name, getattr(pynvml, name))
    pending = list(xids)
    state = {"shutdown": False, "freed": 0}

    def check_lost() -> None:
        if lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    def not_supported(*args: object) -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def total_ecc(handle: object, error_type: int, counter: int) -> int:
        check_lost()
        if counter == pynvml.NVML_AGGREGATE_ECC:
            not_supported()
        return ecc if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else 100

    def wait(event_set: object, timeout_ms: int) -> object:
        assert timeout_ms == 0
        if not pending:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return types.SimpleNamespace(
            eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=pending.pop(0)
        )

    def free(event_set: object) -> None:
        state["freed"] += 1

    def shutdown() -> None:
        state["shutdown"] = True

    nvml.nvmlDeviceGetCount = lambda: 1
    nvml.nvmlDeviceGetHandleByIndex = lambda index: f"handle{index}"
    nvml.nvmlDeviceGetSupportedEventTypes = lambda handle: pynvml.nvmlEventTypeAll
    nvml.nvmlEventSetCreate = lambda: "event-set"
    nvml.nvmlDeviceRegisterEvents = lambda handle, types_, event_set: None
    nvml.nvmlEventSetWait = wait
    nvml.nvmlEventSetFree = free
    nvml.nvmlShutdown = shutdown
    nvml.nvmlDeviceGetTotalEccErrors = total_ecc
    nvml.nvmlDeviceGetRetiredPages = not_supported
    nvml.nvmlDeviceGetRemappedRows = not_supported
    nvml.nvmlDeviceGetCurrentClocksEventReasons = lambda handle: 0x40
    nvml.state = state
    return nvml


def test_nvml_provider_maps_nvml_answers() -> None:
    nvml = _fake_nvml(xids=(48, 79), ecc=5)
    provider = NvmlProvider(nvml)
    (device,) = provider.read().devices
    assert device == DeviceReading(
        index=0,
        ecc_volatile_uncorrected=5,
        ecc_volatile_corrected=100,
        xid_events=(48, 79),
        clock_event_reasons=0x40,
    )
    assert device.hard_error_counters() == {"ecc_uncorrected": 5}
    assert provider.read().devices[0].xid_events == ()
    provider.close()
    assert nvml.state == {"shutdown": True, "freed": 1}


def test_nvml_provider_reports_a_lost_gpu() -> None:
    (device,) = NvmlProvider(_fake_nvml(lost=True)).read().devices
    assert device.lost and device.ecc_volatile_uncorrected is None


@pytest.mark.skipif(not NVML_WORKS, reason="needs an NVIDIA driver")
def test_real_nvml_provider() -> None:
    provider = open_gpu_provider(True)
    assert provider is not None
    try:
        reading = provider.read()
        assert len(reading.devices) == provider.device_count >= 1
        assert all(device.lost is False for device in reading.devices)
    finally:
        provider.close()
