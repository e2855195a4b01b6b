"""Capture and restore of the complete training state (SPEC §2).

This module owns *what* a resumable checkpoint contains and how it maps onto two plain parts:
a flat mapping of named CPU tensors and a JSON-able ``meta`` tree that refers to those tensors
by name. It does no I/O; archives and tiers decide where the two parts go.

A snapshot is decoupled from the live objects: every tensor is copied into host memory that
the snapshot owns, so changing the model or optimizer in place after ``capture`` returns never
changes what is stored. Copies from an accelerator may still be running when a capture given
a copier returns (``devicecopy``): its snapshot's ``fence`` says when they are done.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ckptpilot.capture.devicecopy import CopyFence, DeviceCopier, copy_now
from ckptpilot.errors import StateError
from ckptpilot.hostmem import fresh_bytes

STATE_FORMAT_VERSION = 1

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_DICT = "__dict__"
_NPSCALAR = "__npscalar__"
_MARKERS = (_TENSOR, _TUPLE, _DICT, _NPSCALAR)


class Stateful(Protocol):
    """Anything with the torch ``state_dict`` / ``load_state_dict`` pair (sampler, scheduler)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> Any: ...


@dataclass
class TrainingComponents:
    """The live objects whose state makes a run resumable; everything but ``model`` is optional."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Stateful | None = None
    scaler: Stateful | None = None
    data_state: Stateful | None = None


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a framework's wrapper (Accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``, …), found through its ``optimizer`` / ``_optimizer``
    attribute: the pilot hooks the optimizer that really steps and captures its state. A
    wrapper that is an optimizer with state of its own (a lookahead) is kept as it is; one
    that shares its inner optimizer's state (Lightning's) is a pure delegate and unwrapped.

    Refuses with a ``TypeError`` naming the types what it cannot capture: an object that is
    no optimizer and wraps none, and ``ZeroRedundancyOptimizer``, whose state is sharded
    across ranks (its ``state_dict`` needs a collective consolidation first).
    """
    current, chain = optimizer, [type(optimizer).__name__]
    for _ in range(8):
        if type(current).__name__ == "ZeroRedundancyOptimizer":
            raise TypeError(
                "ZeroRedundancyOptimizer shards its state across ranks and ckptpilot captures "
                "whole optimizers only; use a plain optimizer (state replicated by DDP)")
        inner = getattr(current, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            inner = getattr(current, "_optimizer", None)
        delegate = (isinstance(inner, torch.optim.Optimizer)
                    and getattr(current, "state", None) is getattr(inner, "state", ()))
        if (isinstance(current, torch.optim.Optimizer)
                and hasattr(current, "_optimizer_step_post_hooks") and not delegate):
            return current
        if inner is None or inner is current:
            break
        current = inner
        chain.append(type(current).__name__)
    raise TypeError(
        f"optimizer {' -> '.join(chain)} is not a torch.optim.Optimizer and wraps none "
        "(no .optimizer or ._optimizer attribute holding one); pass the torch optimizer")


@dataclass
class Snapshot:
    """One step's complete training state, owned by the snapshot (never aliased to live memory).

    ``tensors`` holds contiguous CPU tensors keyed by path (``model/fc.weight``,
    ``optimizer/state/0/exp_avg``, ``rng/torch_cpu`` …); ``meta`` is JSON-able and refers to
    them with ``{"__tensor__": name}``. A captured snapshot's tensors are views of one
    contiguous byte buffer, ``arena``, laid out widest element first (so every view is
    aligned) in the order of ``tensors``: that is the data section of the organ's safetensors
    file and the image the peer tier shards, with no copy.

    ``fence``: the device-to-host copies still filling the arena (None when none are: every
    capture without a copier, every CPU capture). Whoever reads ``tensors`` or ``arena`` first
    calls ``fence.wait()``; the pilot's writer does, before anything else.

    ``sharded``: a sharded state (``capture.sharded``): ``tensors`` hold DTensors over host
    buffers, each rank's part of the global tensors, laid out by DCP rather than in an arena
    (``arena`` None); ``nbytes`` counts this rank's part.
    """

    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    arena: torch.Tensor | None = None
    fence: CopyFence | None = None
    sharded: bool = False
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = local_nbytes(self.tensors)

    @property
    def layout(self) -> tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]:
        """(name, dtype, shape) in arena order: two snapshots with equal layouts have arenas
        that are byte-for-byte comparable."""
        return tuple((k, t.dtype, tuple(t.shape)) for k, t in self.tensors.items())


def local_nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """The bytes of ``tensors`` this process holds: a DTensor's local part, not the global
    tensor (``to_local``, looked up by name: a dense run never imports DTensor)."""
    total = 0
    for t in tensors.values():
        to_local = getattr(t, "to_local", None)
        local = to_local() if to_local is not None else t
        total += local.numel() * local.element_size()
    return total


class BufferSource(Protocol):
    def take(self) -> Snapshot | None: ...


class HostBufferPool:
    """Every host buffer set a capture writes into: the free ones, how many exist, and the
    one a tier keeps on loan (the memory tier holds its newest checkpoint in the snapshot's
    own buffers, no copy).

    Reusing memory that is already faulted in makes the training-thread copy a plain memcpy
    instead of a page-fault storm, which dominates the first save's stall (bench/RESULTS.md,
    stall.py: first save against later saves). The pool keeps at most ``max_sets`` free sets.
    With a holder (:meth:`lend`), a capture allocates a new set only while fewer than
    ``max_sets`` exist; then it takes the held set back — the holder is empty until that save
    completes — so holding never adds host memory beyond the in-flight bound. While the
    writer reads the held set (a delta base) it is pinned (:meth:`pin`): a capture meanwhile
    allocates one set beyond ``max_sets`` rather than overwrite it.

    Thread-safe: the writer thread returns and pins buffers while the training thread takes
    them. Lock order: the pool's lock, then the holder's (``reclaim`` runs under the pool's).
    """

    def __init__(self, max_sets: int) -> None:
        self._max_sets = max_sets
        self._sets: list[Snapshot] = []
        self._allocated = 0  # sets the captures were told to allocate, with a holder
        self._reclaim: Callable[[], Snapshot | None] | None = None
        self._pinned = False
        self._lock = threading.Lock()

    def lend(self, reclaim: Callable[[], Snapshot | None]) -> None:
        """Register the holder of one set: ``reclaim()`` gives it up (None: it holds none)."""
        with self._lock:
            self._reclaim = reclaim

    def take(self) -> Snapshot | None:
        """Buffers for the next capture: a free set; else None (allocate) while fewer than
        ``max_sets`` exist, the held set is pinned or nothing is held; else the held set."""
        with self._lock:
            if self._sets:
                return self._sets.pop()
            if self._reclaim is None or self._pinned:
                return None
            if self._allocated < self._max_sets:
                self._allocated += 1
                return None
            held = self._reclaim()
            if held is None:
                self._allocated += 1
            return held

    def pin(self) -> None:
        """The held set is being read: no capture may take it until :meth:`unpin`."""
        with self._lock:
            self._pinned = True

    def unpin(self) -> None:
        with self._lock:
            self._pinned = False

    def give_back(self, snapshot: Snapshot) -> None:
        """Return a snapshot whose contents nobody needs any more; its buffers get reused."""
        if snapshot.arena is None and not snapshot.sharded:
            return
        with self._lock:
            if len(self._sets) < self._max_sets and all(s is not snapshot for s in self._sets):
                self._sets.append(snapshot)


class _Encoder:
    """Turns a nested state structure into JSON plus named tensor copies in one arena.

    Tensors are collected first and copied in ``finish``, once their total size is known.
    """

    def __init__(self, reuse: Snapshot | None) -> None:
        self._sources: dict[str, torch.Tensor] = {}
        self._reuse = reuse

    def tensor(self, name: str, value: torch.Tensor) -> dict[str, str]:
        if name in self._sources:
            raise StateError(f"{name}: two tensors map to the same checkpoint key")
        self._sources[name] = value.detach()
        return {_TENSOR: name}

    def encode(self, value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            return self.tensor(path, value)
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, np.generic):
            return {_NPSCALAR: value.dtype.str, "value": value.item()}
        if isinstance(value, tuple):
            return {_TUPLE: [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            plain = all(isinstance(k, str) and k not in _MARKERS for k in value)
            if plain:
                return {k: self.encode(v, f"{path}/{k}") for k, v in value.items()}
            return {_DICT: [[self.encode(k, f"{path}/<key>"), self.encode(v, f"{path}/{k}")]
                            for k, v in value.items()]}
        raise StateError(
            f"{path}: cannot checkpoint a value of type {type(value).__qualname__}; "
            "state must be tensors, numbers, strings, None, lists, tuples or dicts of those")

    def finish(self, copier: DeviceCopier | None, late: Callable[[str, torch.Tensor], bool]
               ) -> tuple[dict[str, torch.Tensor], torch.Tensor, CopyFence | None]:
        """Copy every collected tensor into the arena (reused when the layout is unchanged).

        Host tensors are copied at once. Device tensors: without ``copier``, copied and waited
        for (fence None); with one, started in two groups — ``late(name, source)`` true for
        those only the optimizer step writes — and still running when this returns."""
        order = sorted(self._sources.items(), key=lambda kv: -kv[1].element_size())
        layout = tuple((k, t.dtype, tuple(t.shape)) for k, t in order)
        reuse = self._reuse
        if reuse is not None and reuse.arena is not None and reuse.layout == layout:
            arena, views = reuse.arena, reuse.tensors
        else:
            total = sum(t.numel() * t.element_size() for _, t in order)
            # Page-aligned either way (pinned memory is whole pages): the organ's file is
            # written straight from it (``tiers/remote/directio.py``).
            arena = (torch.empty(total, dtype=torch.uint8, pin_memory=True)
                     if any(t.is_cuda for _, t in order)
                     else torch.from_numpy(fresh_bytes(total)))
            views, offset = {}, 0
            for name, src in order:
                n = src.numel() * src.element_size()
                views[name] = arena[offset:offset + n].view(src.dtype).reshape(src.shape)
                offset += n
        device: list[tuple[str, torch.Tensor]] = []
        for name, src in order:
            if (src.is_cuda if copier is None else copier.owns(src)):
                device.append((name, src))
            else:
                views[name].copy_(src)
        if not device:
            return views, arena, None
        if copier is None:
            copy_now([(views[name], src) for name, src in device])
            return views, arena, None
        first = [(views[name], src) for name, src in device if not late(name, src)]
        second = [(views[name], src) for name, src in device if late(name, src)]
        return views, arena, copier.start(first, second)


def arena_views(arena: torch.Tensor,
                layout: Sequence[tuple[str, torch.dtype, Sequence[int]]]
                ) -> dict[str, torch.Tensor]:
    """The tensors of ``layout`` as views of ``arena`` (a uint8 buffer in arena order)."""
    views, offset = {}, 0
    for name, dtype, shape in layout:
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise StateError(f"{name}: bad shape {list(shape)!r} in the layout")
        n = math.prod(shape) * dtype.itemsize
        if offset + n > arena.numel():
            raise StateError(f"{name}: the arena ends at byte {arena.numel()}, the layout "
                             f"needs {offset + n}")
        views[name] = arena[offset:offset + n].view(dtype).reshape(tuple(shape))
        offset += n
    if offset != arena.numel():
        raise StateError(f"the layout covers {offset} bytes, the arena has {arena.numel()}")
    return views


def encode_tree(value: Any, path: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """``value`` as the JSON-able tree a checkpoint's ``meta`` holds (tensors replaced by
    ``{"__tensor__": name}``, names under ``path``), and those tensors by name, not copied:
    for a caller that stores the tensors another way (``sharded``: DTensors through DCP).
    :func:`decode` is the inverse."""
    enc = _Encoder(None)
    return enc.encode(value, path), enc._sources


def decode(value: Any, get_tensor: Callable[[str], torch.Tensor]) -> Any:
    """Inverse of the encoder: rebuild tuples, non-string-keyed dicts and tensors."""
    if isinstance(value, list):
        return [decode(v, get_tensor) for v in value]
    if isinstance(value, dict):
        if _TENSOR in value:
            return get_tensor(value[_TENSOR])
        if _TUPLE in value:
            return tuple(decode(v, get_tensor) for v in value[_TUPLE])
        if _DICT in value:
            return {decode(k, get_tensor): decode(v, get_tensor) for k, v in value[_DICT]}
        if _NPSCALAR in value:
            return np.dtype(value[_NPSCALAR]).type(value["value"])
        return {k: decode(v, get_tensor) for k, v in value.items()}
    return value


def _rng_state(enc: _Encoder) -> dict[str, Any]:
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": enc.encode(random.getstate(), "rng/python"),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": np_state["state"]["key"].tolist(),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch_cpu": enc.tensor("rng/torch_cpu", torch.get_rng_state()),
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [enc.tensor(f"rng/cuda/{i}", s)
                         for i, s in enumerate(torch.cuda.get_rng_state_all())]
    return state


def _set_rng_state(rng: dict[str, Any], get_tensor: Callable[[str], torch.Tensor]) -> None:
    random.setstate(decode(rng["python"], get_tensor))
    np_rng = rng["numpy"]
    np.random.set_state({
        "bit_generator": np_rng["bit_generator"],
        "state": {"key": np.asarray(np_rng["key"], dtype=np.uint32), "pos": np_rng["pos"]},
        "has_gauss": np_rng["has_gauss"],
        "gauss": np_rng["gauss"],
    })
    # Fresh tensors: the generators read the storage from its start, so a view into a
    # snapshot's arena (storage offset > 0) crashes torch.set_rng_state.
    torch.set_rng_state(get_tensor(rng["torch_cpu"][_TENSOR]).clone())
    cuda = [get_tensor(ref[_TENSOR]).clone() for ref in rng["cuda"]]
    if cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(cuda):
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise StateError(
                f"rng/cuda: checkpoint holds RNG state of {len(cuda)} CUDA devices, "
                f"this process sees {have}")
        torch.cuda.set_rng_state_all(cuda)


def _written_by_the_optimizer(model: torch.nn.Module) -> Callable[[str, torch.Tensor], bool]:
    """Which captured tensors only an optimizer step writes: the model's parameters (found by
    their memory, as ``state_dict`` returns them detached) and the optimizer's state. Anything
    not recognised counts as written earlier, which only makes its copy wait sooner. The
    parameters are listed on the first question: a CPU capture never asks."""
    params = functools.cache(lambda: {p.data_ptr() for p in model.parameters()})

    def late(name: str, source: torch.Tensor) -> bool:
        return name.startswith("optimizer/state/") or (
            name.startswith("model/") and source.data_ptr() in params())

    return late


def capture(components: TrainingComponents, *, step: int, epoch: int | None = None,
            extras: Mapping[str, Any] | None = None, rank: int = 0, world_size: int = 1,
            pool: BufferSource | None = None, copier: DeviceCopier | None = None) -> Snapshot:
    """Copy the complete training state into host memory owned by the returned snapshot.

    Without ``copier`` every copy is done on return. With one (the pilot's
    :class:`~ckptpilot.capture.devicecopy.StepFences`, whose hooks keep the next steps behind the
    copies) the tensors it owns may still be copying: read the snapshot after
    ``snapshot.fence.wait()``.
    """
    enc = _Encoder(pool.take() if pool is not None else None)
    model_sd = components.model.state_dict()
    for name, tensor in model_sd.items():
        enc.tensor(f"model/{name}", tensor)
    meta: dict[str, Any] = {
        "format_version": STATE_FORMAT_VERSION,
        "step": step,
        "epoch": epoch,
        "rank": rank,
        "world_size": world_size,
        "torch_version": torch.__version__,
        "model_keys": list(model_sd),
    }
    parts = {"optimizer": components.optimizer, "lr_scheduler": components.lr_scheduler,
             "scaler": components.scaler, "data_state": components.data_state}
    for key, obj in parts.items():
        meta[key] = None if obj is None else enc.encode(obj.state_dict(), key)
    meta["extras"] = enc.encode(dict(extras or {}), "extras")
    meta["rng"] = _rng_state(enc)
    tensors, arena, fence = enc.finish(copier, _written_by_the_optimizer(components.model))
    return Snapshot(step=step, tensors=tensors, meta=meta, arena=arena, fence=fence)


def apply(components: TrainingComponents, meta: Mapping[str, Any],
          get_tensor: Callable[[str], torch.Tensor]) -> dict[str, Any]:
    """Load a stored state into the live objects; returns the decoded user extras.

    Everything is checked before anything is changed where torch allows it (model keys and
    shapes, presence of each component), so a mismatched checkpoint fails with the offending
    key instead of leaving a half-restored model.
    """
    if meta.get("format_version") != STATE_FORMAT_VERSION:
        raise StateError(f"state format version {meta.get('format_version')!r} is not "
                         f"supported (expected {STATE_FORMAT_VERSION})")
    model_sd = {k: get_tensor(f"model/{k}") for k in meta["model_keys"]}
    live = components.model.state_dict()
    missing = sorted(set(live) - set(model_sd))
    unexpected = sorted(set(model_sd) - set(live))
    if missing or unexpected:
        raise StateError(f"model keys differ from the checkpoint: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for k, t in model_sd.items():
        if t.shape != live[k].shape or t.dtype != live[k].dtype:
            raise StateError(f"model/{k}: checkpoint has {t.dtype} {tuple(t.shape)}, the live "
                             f"model has {live[k].dtype} {tuple(live[k].shape)}")
    parts = {"optimizer": components.optimizer, "lr_scheduler": components.lr_scheduler,
             "scaler": components.scaler, "data_state": components.data_state}
    for key, obj in parts.items():
        if obj is not None and meta.get(key) is None:
            raise StateError(f"{key}: the checkpoint holds no {key} state but one was given")
    components.model.load_state_dict(model_sd, strict=True)
    for key, obj in parts.items():
        if obj is None:
            continue
        try:
            obj.load_state_dict(decode(meta[key], get_tensor))
        except (KeyError, ValueError, RuntimeError, TypeError) as e:
            raise StateError(f"{key}: cannot load its state from the checkpoint: {e}") from e
    _set_rng_state(meta["rng"], get_tensor)
    return decode(meta["extras"], get_tensor)


def holds_dtensors(components: TrainingComponents) -> bool:
    """Whether the model's parameters or buffers are DTensors (FSDP2, tensor parallel).

    Without ``torch.distributed.tensor`` imported no tensor can be one, and a dense run then
    never pays for importing it (with DCP, a second or more of every process start).
    """
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:
        return False
    model = components.model
    return any(isinstance(t, module.DTensor)
               for t in itertools.chain(model.parameters(), model.buffers()))
