"""The DCP-backed sharded tier: a sharded training state (``capture.sharded``) as one
``torch.distributed.checkpoint`` checkpoint per step on the remote store, each rank writing
its part (:class:`ShardedTier`, in ``tier``; the load's plan in ``load``). The bytes are
``ckptpilot.dcp``'s: SHA256 per item, JSON values, the commit file last, no pickle read."""

from ckptpilot.tiers.sharded.load import NotLoadable
from ckptpilot.tiers.sharded.tier import ShardedTier

__all__ = ["NotLoadable", "ShardedTier"]
