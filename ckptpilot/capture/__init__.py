"""Capture, the first step of a save: ``state`` (what a resumable checkpoint contains, copied
into host memory the snapshot owns, and applied back on restore), ``sharded`` (the same for a
sharded state: DTensor shards in host buffers, laid out by DCP) and ``devicecopy`` (the
device-to-host copies of a capture and the fences that keep the next steps behind them).
Import from the modules.
"""
