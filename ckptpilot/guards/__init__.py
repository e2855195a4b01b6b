"""The run's guards, which watch the training loop and end or rewind it: ``preemption`` (a
preemption signal → an emergency organ, exit 75 / 76), ``watchdog`` (no step progress within
the bound → exit 77) and ``rollback`` (a confirmed loss spike → back to the save before it).
Import from the modules.
"""
