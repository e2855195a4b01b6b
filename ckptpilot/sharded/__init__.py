"""Sharded training state — FSDP2 ``fully_shard``, or DTensors on a device mesh — saved and
restored by the pilot through :mod:`ckptpilot.dcp`, resharded when the number of ranks changed.

This package owns the pilot's path for a model that holds DTensors (``state.holds_dtensors``;
every other model keeps the replicated path: ``state.capture`` and the writer's tiers):

- capture, on the training thread: DCP's view of the model and optimizer
  (``get_state_dict``: fully qualified names, DTensors as sharded), each rank's local shards
  copied into host buffers the snapshot owns (kept from save to save while the layout stays:
  the stall is a memcpy), and the rest of the training state — LR scheduler, scaler, data
  cursor, RNG, extras, step — captured by ``state.capture`` as in a replicated run;
- the save, on the writer thread, queued behind its other jobs and inside its back-pressure:
  ``dcp.save`` through :class:`ckptpilot.dcp.Writer` on a gloo process group of its own, so
  its collectives never interleave with the training thread's;
- the restore, collective: every rank walks the same list of steps, loads a step with
  ``dcp.load`` through :class:`ckptpilot.dcp.Reader` (every item verified as it is read)
  into host buffers — nothing live changes until the step has loaded on every rank — walks
  back together past a step that any rank cannot read, and applies it (``set_state_dict``).

A sharded checkpoint is one DCP checkpoint, ``dcp_step_N``, with one metadata row per rank:
``model/<fqn>`` and ``optimizer/state/<fqn>/<name>``, the global tensors as they were sharded
(DCP reshards them on load), and per rank ``rank/<r>/meta``, a JSON document stored as a
uint8 tensor (format :data:`SHARDED_FORMAT`): the model and optimizer trees around their
tensors (param groups and every other non-tensor value), the rest of the state in
``state.capture``'s form with its tensors (RNG, …) at ``rank/<r>/<name>``, and the data
cursor's data-parallel rank and degree. DCP's own "bytes" items (non-tensor values) are never
written, and a restore asks DCP for tensors only: a checkpoint that holds anything else where
the pilot expects a tensor is refused naming the key. (``ckptpilot.dcp`` would not unpickle
one anyway: it loads a non-tensor value from its JSON in the commit file.)

Across a change of the number of ranks: DCP reshards the global tensors; rank r resumes the
per-rank state (RNG, LR scheduler, scaler, extras) of saved rank r, or of r mod N for a rank
the saved run (N ranks) did not have; the data cursor is redistributed over the cursors of
every saved data-parallel rank (:func:`resume_cursor`), or refused. The memory and peer tiers
hold one rank's replicated state: they take no sharded save, and no sharded restore reads
them.

The parts: ``meta`` (the layout both sides read and write: the per-rank meta document, the
host buffers, how a data cursor resumes), ``save`` (capture and ``dcp.save``), ``restore``
(the collective walk, load and apply) and :class:`ShardedState` here, which holds one of each.

It must not decide when to save (the pilot, the scheduler) nor how bytes are laid out and
verified (``ckptpilot.dcp``). Threading: ``save``, ``restore`` and ``apply`` run on the
training thread; the ``dcp.save`` of a save on the writer thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ckptpilot.agreement import RankAgreement
from ckptpilot.capture.state import TrainingComponents
from ckptpilot.catalog import Catalog, SaveIntent
from ckptpilot.policy import Policy
from ckptpilot.restorer import Read, Restored
from ckptpilot.save.writer import CheckpointWriter
from ckptpilot.sharded.meta import SHARDED_FORMAT, SHARDED_FORMAT_VERSION, resume_cursor
from ckptpilot.sharded.restore import ShardedRestorer
from ckptpilot.sharded.save import ShardedSaver
from ckptpilot.telemetry import Telemetry

__all__ = ["SHARDED_FORMAT", "SHARDED_FORMAT_VERSION", "ShardedState",
           "resume_cursor"]

log = logging.getLogger("ckptpilot")


class ShardedState:
    """One rank's save and restore of a sharded training state; see the module docstring.

    ``save`` and ``restore`` are collective: every rank of the run calls them, in the same
    order (the pilot's scheduled saves are agreed steps; ``save()``, ``report_metric()`` and
    ``close()`` of a sharded run must be called on every rank). The save side
    (:mod:`ckptpilot.sharded.save`) and the restore side (:mod:`ckptpilot.sharded.restore`)
    share the layout of :mod:`ckptpilot.sharded.meta` and one process group.
    """

    def __init__(self, policy: Policy, components: TrainingComponents, *, catalog: Catalog,
                 writer: CheckpointWriter, telemetry: Telemetry,
                 agreement: RankAgreement | None, rank: int, world_size: int) -> None:
        # DCP's collectives run on the writer thread while training runs its own: on one
        # process group they could interleave differently on different ranks.
        group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._saver = ShardedSaver(policy, components, catalog=catalog, writer=writer,
                                   telemetry=telemetry, rank=rank, world_size=world_size,
                                   group=group)
        self._restorer = ShardedRestorer(policy, components, catalog=catalog,
                                         agreement=agreement, rank=rank,
                                         world_size=world_size, group=group)
        mem, peer = policy.tiers.memory.enabled, policy.tiers.peer.enabled
        if mem or peer:
            log.info("sharded state: saves go to the remote tier only (ckptpilot.dcp); the "
                     "memory and peer tiers hold one rank's replicated state")

    def save(self, intent: SaveIntent, *, step: int, epoch: int | None,
             extras: Mapping[str, Any]) -> float:
        """Copy the state of ``step`` to host memory and queue its ``dcp.save`` on the
        writer thread; returns what the training thread paid (back-pressure wait + copy)."""
        return self._saver.save(intent, step=step, epoch=epoch, extras=extras)

    def restore(self, step: int | None, apply: Callable[[Read], None], *,
                before: int | None = None,
                prepare: Callable[[], None] | None = None) -> Restored | None:
        """The sharded :meth:`ckptpilot.restorer.Restorer.restore`; see
        :meth:`ShardedRestorer.restore`."""
        return self._restorer.restore(step, apply, before=before, prepare=prepare)

    def apply(self, components: TrainingComponents, meta: Mapping[str, Any],
              get_tensor: Callable[[str], torch.Tensor]) -> dict[str, Any]:
        """Load a step read by :meth:`restore` into the live objects; returns the extras."""
        return self._restorer.apply(components, meta, get_tensor)
