"""Measuring the machine: the probes behind the scheduler's system signal (SPEC §4.3).
"""
