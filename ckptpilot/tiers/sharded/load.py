"""What one rank's load of a sharded checkpoint fills: host buffers shaped like the live
tensors (their live sharding: DCP reshards into them) or, without live tensors, like the
saved global tensors; and the per-rank items this rank needs. Checks the checkpoint against
the live state before anything is read, naming the key at fault.

Local: no collective, no I/O but the commit file the caller's ``Reader`` already read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from ckptpilot.capture.sharded import decode_meta, host_like, local_part
from ckptpilot.errors import CheckpointFormatError, CkptPilotError, StateError

__all__ = ["LiveTensors", "Load", "NotLoadable", "meta_of", "plan_load", "rank_failures",
           "tensor_getter", "why_failed"]

LiveTensors = Callable[[], tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor] | None]]
"""The live model's and optimizer's tensors by checkpoint key (None: no optimizer)."""


class NotLoadable(CkptPilotError, LookupError):
    """A step this rank does not load whose bytes are not known to be wrong (a DCP
    checkpoint the pilot did not write, a step another rank cannot read): passed over, never
    condemned (not a ``CheckpointFormatError``)."""


@dataclass
class Load:
    """One step, ready for ``dcp.load``: where every tensor lands, the live devices they go
    back to, and which saved rank's per-rank state this rank resumes (``source``)."""

    state: dict[str, torch.Tensor]
    devices: dict[str, torch.device]
    source: int


def plan_load(entries: Mapping[str, Any], where: str, *, saved_world_size: int, rank: int,
              world_size: int, live: LiveTensors | None) -> Load:
    """The buffers ``dcp.load`` of a checkpoint (its ``state_dict_metadata`` ``entries``)
    fills on ``rank``: the live tensors' shapes, or every saved global tensor whole; rank
    ``rank % saved_world_size``'s items; and every saved rank's meta and data cursor when
    the world size changed (the cursor is redistributed)."""
    if any(f"rank/{r}/meta" not in entries for r in range(saved_world_size)):
        raise NotLoadable(f"{where}: not a sharded checkpoint of CheckpointPilot (no "
                          "rank/<r>/meta for every rank)")
    if live is None:
        state = {key: torch.empty(entry.size, dtype=entry.properties.dtype)
                 for key, entry in entries.items()
                 if not key.startswith("rank/") and isinstance(entry, TensorStorageMetadata)}
        devices: dict[str, torch.device] = {}
    else:
        state, devices = _template(entries, where, live)
    source = rank % saved_world_size
    metas = list(range(saved_world_size)) if saved_world_size != world_size else [source]
    for key, entry in entries.items():
        r, _, name = key.removeprefix("rank/").partition("/")
        if not key.startswith("rank/") or not r.isdigit():
            continue
        if int(r) == source or (int(r) in metas and (
                name == "meta" or name.startswith("data_state/"))):
            if not isinstance(entry, TensorStorageMetadata):
                raise CheckpointFormatError(f"{where}: {key} is no tensor")
            state[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    return Load(state, devices, source)


def _template(entries: Mapping[str, Any], where: str, live: LiveTensors
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.device]]:
    """Host buffers shaped like the live model's and optimizer's tensors (their live
    sharding), for the tensors the checkpoint holds; a model tensor missing from it, one
    it holds that the live model lacks, or one of another shape or dtype is refused
    naming the key."""
    model, optim = live()
    tensors = dict(model)
    saved_model = {k for k in entries if k.startswith("model/")}
    missing, unexpected = sorted(set(model) - saved_model), sorted(saved_model - set(model))
    if missing or unexpected:
        raise StateError(f"{where}: model keys differ from the checkpoint: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")
    if optim is not None:
        saved_optim = {k for k in entries if k.startswith("optimizer/")}
        unknown = sorted(saved_optim - set(optim))
        if unknown:
            raise StateError(f"{where}: the checkpoint holds optimizer state the live "
                             f"optimizer has no place for: {unknown[:5]}")
        tensors.update((k, t) for k, t in optim.items() if k in saved_optim)
    state, devices = {}, {}
    for name, tensor in tensors.items():
        entry = entries[name]
        if (not isinstance(entry, TensorStorageMetadata)
                or tuple(entry.size) != tuple(tensor.shape)
                or entry.properties.dtype != tensor.dtype):
            saved = (f"{entry.properties.dtype} {list(entry.size)}"
                     if isinstance(entry, TensorStorageMetadata) else "no tensor")
            raise StateError(f"{where}: {name}: the checkpoint has {saved}, the live "
                             f"state {tensor.dtype} {list(tensor.shape)}")
        state[name] = host_like(tensor, pin=False)
        devices[name] = local_part(tensor).device
    return state, devices


def meta_of(load: Load, r: int, where: str) -> dict[str, Any]:
    """Saved rank ``r``'s meta document, read: a JSON object or a format error naming it."""
    return decode_meta(load.state[f"rank/{r}/meta"], f"{where}: rank/{r}/meta")


def tensor_getter(load: Load, where: str) -> Callable[[str], torch.Tensor]:
    """The loaded tensors by key, each moved back to its live device."""
    state, devices = load.state, load.devices

    def get_tensor(name: str) -> torch.Tensor:
        try:
            tensor = state[name]
        except KeyError:
            raise CheckpointFormatError(f"{where}: state refers to tensor {name!r}, which "
                                        "was not read") from None
        device = devices.get(name)
        if device is None or device.type == "cpu":
            return tensor
        if isinstance(tensor, DTensor):
            return DTensor.from_local(tensor.to_local().to(device), tensor.device_mesh,
                                      tensor.placements, run_check=False,
                                      shape=tensor.shape, stride=tensor.stride())
        return tensor.to(device)

    return get_tensor


def rank_failures(error: CheckpointException) -> dict[int, BaseException]:
    """The exception of each failed rank (DCP keeps some with their traceback)."""
    return {rank: f[0] if isinstance(f, tuple) else f for rank, f in error.failures.items()}


def why_failed(error: BaseException) -> str:
    """One line per failed rank instead of DCP's tracebacks."""
    if isinstance(error, CheckpointException):
        return "; ".join(f"rank {rank}: {e}" for rank, e in sorted(rank_failures(error).items()))
    return str(error)
