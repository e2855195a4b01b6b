"""The remote tier: persistent checkpoints behind an fsspec URL (local dir, NFS, S3, GCS).

Bottom up: ``retry`` (retries of repeatable object-store operations), ``directio`` (local
writes that bypass the page cache), ``entries`` (the names under the URL and the one checked
way to delete one), ``store`` (:class:`~ckptpilot.tiers.remote.store.RemoteTier`: durability
and atomic publication of bytes), ``archive`` (the organ archive's layout and its
verification, on the store) and ``tier``
(:class:`~ckptpilot.tiers.remote.tier.RemoteCheckpointTier`: one rank's images as archives,
the :class:`~ckptpilot.tiers.base.CheckpointTier` protocol). Import from the modules.
"""
