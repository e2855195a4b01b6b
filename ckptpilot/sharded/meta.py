"""The layout a sharded checkpoint shares between its save and its restore: the per-rank
meta document's format (:data:`SHARDED_FORMAT`), the host buffers DCP writes from and reads
into, and how a data cursor resumes across a change of the number of ranks
(:func:`resume_cursor`). The key scheme is described in :mod:`ckptpilot.sharded`.

Pure helpers: no I/O, no collectives.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from ckptpilot.capture.state import Stateful
from ckptpilot.errors import StateError

SHARDED_FORMAT = "ckptpilot-sharded"
SHARDED_FORMAT_VERSION = 1

NO_MODEL = torch.nn.Module()  # stands in for the model when state.capture takes the rest
Layout = tuple[tuple[str, torch.dtype, tuple[int, ...], tuple[int, ...], str], ...]


def data_parallel(cursor: object) -> dict[str, int] | None:
    """How a data cursor says it is split: ``num_replicas`` cursors, this one ``rank``."""
    degree, rank = getattr(cursor, "num_replicas", None), getattr(cursor, "rank", None)
    if isinstance(degree, int) and isinstance(rank, int):
        return {"degree": degree, "rank": rank}
    return None


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

def local_part(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def layout_of(sources: Mapping[str, torch.Tensor]) -> Layout:
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


def rank_failures(error: CheckpointException) -> dict[int, BaseException]:
    """The exception of each failed rank (DCP keeps some with their traceback)."""
    return {rank: f[0] if isinstance(f, tuple) else f for rank, f in error.failures.items()}


def why_failed(error: BaseException) -> str:
    """One line per failed rank instead of DCP's tracebacks."""
    if isinstance(error, CheckpointException):
        return "; ".join(f"rank {rank}: {e}" for rank, e in sorted(rank_failures(error).items()))
    return str(error)
