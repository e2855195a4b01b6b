"""Capture and apply of a sharded training state — FSDP2 ``fully_shard``, or DTensors on a
device mesh — and the layout its save and its restore share.

The counterpart of ``capture.state`` for a model whose parameters are DTensors
(``state.holds_dtensors``): the assembly chooses one pair or the other once, and the pilot's
writer and restorer run the same loops for both. A sharded snapshot is a
:class:`~ckptpilot.capture.state.Snapshot` with ``sharded`` set and no arena: its ``tensors``
are DCP's view of the model and optimizer (``get_state_dict``: fully qualified names,
DTensors as sharded) — ``model/<fqn>`` and ``optimizer/state/<fqn>/<name>``, each rank's
local shards copied into host buffers the snapshot owns, kept from save to save through the
snapshot pool while the layout stays (the stall is a memcpy) — and the rest of the training
state (LR scheduler, scaler, data cursor, RNG, extras) as ``state.capture`` takes it, its
tensors at ``rank/<r>/<name>``. Its ``meta`` (format :data:`SHARDED_FORMAT`) holds the model
and optimizer trees around their tensors (param groups and every other non-tensor value),
the rest of the state in ``state.capture``'s form, and the data cursor's data-parallel rank
and degree. The DCP-backed tier (``tiers.sharded``) writes the tensors as one DCP checkpoint
and the meta as ``rank/<r>/meta``.

Across a change of the number of ranks DCP reshards the global tensors; :func:`apply_sharded`
resumes on rank r the per-rank state (RNG, LR scheduler, scaler, extras) of saved rank r, or
of r mod N for a rank the saved run (N ranks) did not have, and redistributes the data cursor
over the cursors of every saved data-parallel rank (:func:`resume_cursor`), or refuses.

It does no I/O and no collectives. Threading: the training thread.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from ckptpilot.capture.state import (
    BufferSource,
    Snapshot,
    Stateful,
    TrainingComponents,
    apply,
    capture,
    decode,
    encode_tree,
)
from ckptpilot.errors import CheckpointFormatError, StateError

__all__ = ["SHARDED_FORMAT", "SHARDED_FORMAT_VERSION", "ShardedCapture", "apply_sharded",
           "check_format", "decode_meta", "host_like", "json_tensor", "live_tensors",
           "local_part", "resume_cursor"]

SHARDED_FORMAT = "ckptpilot-sharded"
SHARDED_FORMAT_VERSION = 1

NO_MODEL = torch.nn.Module()  # stands in for the model when state.capture takes the rest
ShardLayout = tuple[tuple[str, torch.dtype, tuple[int, ...], tuple[int, ...], str], ...]


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def layout_of(sources: Mapping[str, torch.Tensor]) -> ShardLayout:
    return tuple((name, t.dtype, tuple(local_part(t).shape), tuple(t.shape),
                  repr(t.placements) if isinstance(t, DTensor) else "")
                 for name, t in sources.items())


def host_like(src: torch.Tensor, pin: bool) -> torch.Tensor:
    """An empty host tensor shaped like ``src``'s local part, a DTensor of the same mesh and
    placements when ``src`` is one: what DCP writes from or reads into."""
    local = local_part(src)
    host = torch.empty(local.shape, dtype=local.dtype, pin_memory=pin)
    if isinstance(src, DTensor):
        return DTensor.from_local(host, src.device_mesh, src.placements, run_check=False,
                                  shape=src.shape, stride=src.stride())
    return host


def json_tensor(value: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def data_parallel(cursor: object) -> dict[str, int] | None:
    """How a data cursor says it is split: ``num_replicas`` cursors, this one ``rank``."""
    degree, rank = getattr(cursor, "num_replicas", None), getattr(cursor, "rank", None)
    if isinstance(degree, int) and isinstance(rank, int):
        return {"degree": degree, "rank": rank}
    return None


def live_tensors(components: TrainingComponents
                 ) -> tuple[Any, Any, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """DCP's view of the live model and optimizer: their trees (tensors replaced by names)
    and their tensors by name (``model/…``, ``optimizer/…``), not copied; the optimizer's
    tree and tensors are None and empty without an optimizer."""
    if components.optimizer is None:
        model_sd, optim_sd = get_model_state_dict(components.model), None
    else:
        model_sd, optim_sd = get_state_dict(components.model, components.optimizer)
    model_tree, model = encode_tree(model_sd, "model")
    optim_tree, optim = None, {}
    if optim_sd is not None:
        optim_tree, optim = encode_tree(optim_sd, "optimizer")
    return model_tree, optim_tree, model, optim


class ShardedCapture:
    """Takes sharded snapshots of one rank's live objects into host buffers the snapshot
    owns; ``pool`` (the writer's snapshot pool) gives back the buffers of a finished save,
    reused while the layout stays. Called on the training thread only."""

    def __init__(self, components: TrainingComponents, *, rank: int, world_size: int,
                 pool: BufferSource | None = None) -> None:
        self._components = components
        self._rank = rank
        self._world_size = world_size
        self._pool = pool

    def __call__(self, *, step: int, epoch: int | None,
                 extras: Mapping[str, Any]) -> Snapshot:
        c = self._components
        model_tree, optim_tree, sources, optim = live_tensors(c)
        sources.update(optim)
        shards = self._reusable(sources)
        cuda = any(local_part(t).is_cuda for t in sources.values())
        if shards is None:
            shards = {name: host_like(t, cuda) for name, t in sources.items()}
        for name, src in sources.items():
            local_part(shards[name]).copy_(local_part(src).detach(), non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        rest = capture(TrainingComponents(model=NO_MODEL, lr_scheduler=c.lr_scheduler,
                                          scaler=c.scaler, data_state=c.data_state),
                       step=step, epoch=epoch, extras=extras, rank=self._rank,
                       world_size=self._world_size)
        meta = {"format": SHARDED_FORMAT, "format_version": SHARDED_FORMAT_VERSION,
                "step": step, "epoch": epoch, "rank": self._rank,
                "world_size": self._world_size, "model": model_tree, "optimizer": optim_tree,
                "state": rest.meta, "data_parallel": data_parallel(c.data_state)}
        prefix = f"rank/{self._rank}/"
        tensors = dict(shards)
        tensors.update((prefix + name, t) for name, t in rest.tensors.items())
        return Snapshot(step=step, tensors=tensors, meta=meta, sharded=True)

    def _reusable(self, sources: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The host copies of a finished save with the same layout, or None (allocate)."""
        held = self._pool.take() if self._pool is not None else None
        if held is None or not held.sharded or not set(sources) <= set(held.tensors):
            return None
        shards = {name: held.tensors[name] for name in sources}
        return shards if layout_of(shards) == layout_of(sources) else None


def resume_cursor(cursor: Stateful | None,
                  saved: Mapping[int, tuple[Any, Mapping[str, int] | None]], *, rank: int,
                  world_size: int, saved_world_size: int) -> Callable[[], None]:
    """How the live data cursor resumes: ``saved`` maps saved ranks to their cursor state and
    data-parallel split (every saved rank when the world size changed, else this rank's).

    Returns the action that loads it, after every check passed (``StateError`` otherwise):
    the same split loads the saved state of this data-parallel rank; another degree hands
    the states of every saved data-parallel rank, in order, to the cursor's
    ``load_resharded``. A cursor that does not say how it is split (``num_replicas`` and
    ``rank`` attributes) resumes only with the world size it was saved with.
    """
    if cursor is None:
        return lambda: None
    live = data_parallel(cursor)
    what = type(cursor).__name__
    if saved_world_size == world_size:
        state, split = saved[rank]
        if live is None or split is None or split == live:
            return partial(cursor.load_state_dict, state)
        raise StateError(
            f"data_state: {what} was saved as data-parallel rank {split['rank']} of "
            f"{split['degree']} and is rank {live['rank']} of {live['degree']} now, with the "
            f"same {world_size} ranks: a new mesh shape at the same world size is not "
            "redistributed; resume with the saved data-parallel degree")
    splits = [split for _, split in saved.values()]
    if live is None or any(split is None for split in splits):
        raise StateError(
            f"data_state: the checkpoint was saved by {saved_world_size} ranks and this run "
            f"has {world_size}, but {what} does not say how it is split across data-parallel "
            "ranks (num_replicas and rank attributes, and load_resharded(states)), so its "
            "position cannot be redistributed exactly; use ckptpilot.ResumableSampler(..., "
            f"num_replicas=D, rank=d), or resume with {saved_world_size} ranks")
    degrees = {split["degree"] for split in splits if split is not None}
    by_dp: dict[int, Any] = {}
    for r in sorted(saved):
        state, split = saved[r]
        assert split is not None
        by_dp.setdefault(split["rank"], state)
    if len(degrees) != 1 or sorted(by_dp) != list(range(next(iter(degrees)))):
        raise StateError(f"data_state: the saved cursors are of data-parallel degrees "
                         f"{sorted(degrees)} and ranks {sorted(by_dp)}, not one full set")
    degree = degrees.pop()
    if live["degree"] == degree:
        return partial(cursor.load_state_dict, by_dp[live["rank"]])
    reshard = getattr(cursor, "load_resharded", None)
    if reshard is None:
        raise StateError(
            f"data_state: saved by {degree} data-parallel ranks, this run has "
            f"{live['degree']}, and {what} has no load_resharded(states) to deal out the rest "
            "of the epoch among them; use ckptpilot.ResumableSampler, or resume with "
            f"{degree} data-parallel ranks")
    return partial(reshard, [by_dp[d] for d in range(degree)])


def decode_meta(raw: torch.Tensor, where: str) -> dict[str, Any]:
    """A per-rank meta document from its uint8 tensor (``rank/<r>/meta``): a JSON object,
    or a format error naming ``where``."""
    try:
        meta = json.loads(bytes(raw.numpy()))
    except (ValueError, RecursionError) as e:  # JSON, UTF-8, an int too long
        raise CheckpointFormatError(f"{where}: not valid JSON ({e})") from e
    if not isinstance(meta, dict):
        raise CheckpointFormatError(f"{where}: a JSON {type(meta).__name__}, not an object")
    return meta


def check_format(meta: Mapping[str, Any], where: str) -> None:
    """Refuse a meta document of another format (``CheckpointFormatError`` naming it)."""
    if (meta.get("format"), meta.get("format_version")) != (SHARDED_FORMAT,
                                                           SHARDED_FORMAT_VERSION):
        raise CheckpointFormatError(
            f"{where}: format {meta.get('format')!r} version {meta.get('format_version')!r} "
            f"is not {SHARDED_FORMAT} version {SHARDED_FORMAT_VERSION}")


def apply_sharded(components: TrainingComponents, meta: Mapping[str, Any],
                  get_tensor: Callable[[str], torch.Tensor], *, rank: int,
                  world_size: int) -> dict[str, Any]:
    """Load a sharded step, as the DCP-backed tier opens it, into the live objects; returns
    the extras. ``meta`` is the document of the saved rank this rank resumes (rank r mod N
    of the N saved ranks); after a change of the number of ranks every saved rank's
    document (``rank/<r>/meta``) is read for the data cursors. The data cursor is checked
    (and loaded) first, then the rest of the state (checked before it changes), then the
    model and optimizer (``set_state_dict``)."""
    saved_world = int(meta["world_size"])
    source = rank % saved_world
    ranks: dict[int, Mapping[str, Any]] = {source: meta}
    if saved_world != world_size:
        ranks = {r: decode_meta(get_tensor(f"rank/{r}/meta"), f"rank/{r}/meta")
                 for r in range(saved_world)}
    for r, doc in ranks.items():
        check_format(doc, f"rank/{r}/meta")

    def of_rank(r: int) -> Callable[[str], torch.Tensor]:
        return lambda name: get_tensor(f"rank/{r}/{name}")

    if components.data_state is not None and any(
            m["state"]["data_state"] is None for m in ranks.values()):
        raise StateError("data_state: the checkpoint holds no data_state state but one "
                         "was given")
    saved = {r: (decode(m["state"]["data_state"], of_rank(r)), m["data_parallel"])
             for r, m in ranks.items()}
    resume_cursor(components.data_state, saved, rank=rank, world_size=world_size,
                  saved_world_size=saved_world)()
    own = ranks[source]
    extras = apply(TrainingComponents(model=NO_MODEL, lr_scheduler=components.lr_scheduler,
                                      scaler=components.scaler),
                   own["state"], of_rank(source))
    model_sd = decode(own["model"], get_tensor)
    if components.optimizer is None:
        set_model_state_dict(components.model, model_sd)
    elif own["optimizer"] is None:
        raise StateError("optimizer: the checkpoint holds no optimizer state but one was "
                         "given")
    else:
        set_state_dict(components.model, components.optimizer, model_state_dict=model_sd,
                       optim_state_dict=decode(own["optimizer"], get_tensor))
    return extras
