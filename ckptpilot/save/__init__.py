"""The save path after the capture: ``plan`` (pure: which tiers take a save, in which order,
with which fallback) and ``writer`` (the background thread that executes a plan tier by tier:
put → verify → record). Import from the modules.
"""
