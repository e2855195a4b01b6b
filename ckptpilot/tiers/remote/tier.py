"""The remote tier as a :class:`~ckptpilot.tiers.base.CheckpointTier`: one rank's images as
organ archives on a :class:`~ckptpilot.tiers.remote.store.RemoteTier`.

An image is an organ archive (``tiers.remote.archive``: safetensors + state + manifest, the
plain path; codecs are the caller's business), published under ``step_{step}_rank_{rank}`` in
one rename. This module sits above both ``tiers.remote.store`` (the bytes) and
``tiers.remote.archive`` (the archive layout), so neither imports the other's caller.

Threading: one writer thread and any number of readers; methods hold no shared state.
"""

from __future__ import annotations

from dataclasses import replace

from ckptpilot.errors import IntegrityError, NoCheckpointError
from ckptpilot.tiers.base import CheckpointImage, PutReceipt, TierCapabilities
from ckptpilot.tiers.remote.archive import (
    checkpoint_name,
    list_archives,
    publish_organ,
    read_organ,
    stage_organ,
)
from ckptpilot.tiers.remote.store import RemoteTier
from ckptpilot.vocab import Level, RetentionClass, Tier

__all__ = ["RemoteCheckpointTier"]


class RemoteCheckpointTier:
    """The images of one rank on a :class:`RemoteTier` (see the module docstring)."""

    kind = Tier.REMOTE
    capabilities = TierCapabilities(durable=True, survives_node_loss=True, folds_deltas=False,
                                    speed=Tier.REMOTE.speed, keeps_older=True)

    def __init__(self, remote: RemoteTier, *, rank: int) -> None:
        self.remote = remote
        self.rank = rank

    def put(self, image: CheckpointImage, base: CheckpointImage | None = None) -> PutReceipt:
        """Stage the archive, then publish it (one rename, or the manifest written last on an
        object store); an archive of the same step already there is set aside
        (``*.replaced-*``). A failure before the publication leaves staging debris that no
        listing takes for a checkpoint."""
        snapshot = image.snapshot()
        staged = stage_organ(self.remote, snapshot, level=image.level.value,
                             reason=image.reason, retention_class=image.retention_class.value,
                             score=image.score)
        publish_organ(self.remote, staged)
        return PutReceipt(image.step, self.remote.path(staged.name), staged.bytes)

    def get(self, step: int) -> CheckpointImage:
        """The archive, every file checked against its manifest, copied into one arena."""
        name = checkpoint_name(step, self.rank)
        if not self.remote.exists(name) or not self.remote.committed(name):
            raise NoCheckpointError(
                f"{self.remote.path(name)}: step {step} of rank {self.rank} is not on the "
                f"remote tier; `ckptpilot ls` lists the steps it holds")
        try:
            loaded = read_organ(self.remote, name)
        except IntegrityError as e:
            raise IntegrityError(f"step {step}: {e.key}", e.expected, e.actual) from e
        manifest = loaded.manifest
        image = CheckpointImage.copied(
            step, loaded.meta, loaded.tensors, level=Level(manifest["level"]),
            reason=manifest["reason"], retention_class=RetentionClass(manifest["retention_class"]),
            score=manifest["score"])
        read = sum(int(f["bytes"]) for f in manifest["files"].values())
        return replace(image, source=loaded.location, bytes_read=read)

    def steps(self) -> list[int]:
        return sorted(step for step, _ in list_archives(self.remote, self.rank).published)

    def discard(self, step: int) -> None:
        name = checkpoint_name(step, self.rank)
        if self.remote.exists(name):
            self.remote.remove(name, step=step, rank=self.rank)

    def close(self) -> None:
        """Nothing to release: every call opens and closes its own files."""
