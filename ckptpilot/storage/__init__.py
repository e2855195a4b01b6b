"""The run's own records as files: one on-disk format per module, with its version and damage.

- ``metadata.py``: the SQLite metadata store (checkpoint rows, hash chain, audit trail), on
  ``database.py`` (the file, its locking and errors), ``schema.py`` (tables, migrations) and
  ``rows.py`` (the frozen rows it hands out);
- ``heartbeat.py``: the level-0 heartbeat ring, a memory-mapped file in the run directory;
- ``ledger.py``: the failure ledger, JSON lines in the run directory, from which the MTBF comes;
- ``lineage.py``: each rank's fork record (JSON lines in the run directory), which says which
  saved steps a restore to an earlier step abandoned, so that no lost database revives them;
- ``damaged.py``: setting a damaged heartbeat ring or ledger aside so that a restart goes on.

The heartbeat ring and the ledger live here rather than beside the scheduler because they are
versioned file formats written and repaired like the metadata store, while the scheduler must
stay pure (it receives the MTBF as a number). They are not in ``rundir.py`` either: that module
owns only the run's identity and lease, not any format a run's history is kept in.

Nothing here decides when to save, what to keep or what to load: the scheduler, retention and
recovery planners decide, the pilot calls these modules to read and write. The checkpoints
themselves (the organ archive) belong to their tier (``tiers/remote/archive.py``), which sits
above this package: nothing here imports from ``tiers/``.
"""
