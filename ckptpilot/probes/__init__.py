"""Measuring the machine: the probes behind the scheduler's system signal (SPEC §4.3).

- ``gpu.py``: GPU readings through NVML (optional) and the provider interface;
- ``fsync.py``: the run directory's IO latency, one timed write + fsync;
- ``monitor.py``: the background thread that runs both and summarises them as a
  :class:`~ckptpilot.scheduler.decision.SystemHealth`.

The probes live outside ``scheduler/`` because they do I/O, load a driver and run a thread,
while the scheduler is pure: it receives the summary as data, one snapshot per step.
"""
