"""Device-to-host copies of a capture, and the order the next steps keep behind them.

This module owns the one concept of a capture whose accelerator tensors are still on their
way into host memory: a :class:`DeviceCopier` starts the copies and returns a
:class:`CopyFence`, which says when they are done to the three parties that must not run
ahead of them — the next forward, the next optimizer step, and the host thread that reads
the snapshot. :class:`CudaSideStreams` is the CUDA copier; :class:`StepFences` wraps a copier
with the hooks that order the training steps behind it. It must not choose what is captured
or where the bytes go (``state`` and the writer do); it imports nothing of ckptpilot, and
imports cleanly without CUDA.

Why two groups: the copies run on a side stream while the next step's kernels are queued,
so each tensor must be read before the first kernel that writes it. A forward writes model
buffers (BatchNorm running statistics), and any captured tensor that is neither a parameter
nor optimizer state may be written by the loop before its next forward (extras, scheduler,
scaler and cursor tensors): those are the *first* group, waited for before the forward.
Parameters and optimizer state are written by the optimizer step only: the *second* group,
waited for before that step, so their copies overlap the forward and backward.

Ordering, per device (CUDA):

1. ``start`` — the side stream waits for the current stream (``wait_stream``: it sees the
   step's results), copies the first group into the pinned arena (``non_blocking``), records
   event 1, copies the second group, records event 2; ``record_stream`` tells the caching
   allocator that each source is in use on the side stream, so a source freed meanwhile is
   not reused before its copy ran. The host does not wait: the save's stall is the launch.
2. the forward pre-hook — the current stream waits for event 1 (``wait_event``: on the
   GPU, no host block; right at the capture instead while the hook is not known to run
   before each step, see :class:`StepFences`); the optimizer step pre-hook — for events 1
   and 2.
3. the writer thread — ``event.synchronize()`` before it reads the arena in any way.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = ["CopyFence", "CudaSideStreams", "DeviceCopier", "Pairs", "StepFences", "copier_for",
           "copy_now"]

log = logging.getLogger("ckptpilot")

Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]
"""(host destination, device source) pairs of equal dtype and shape."""


class CopyFence(Protocol):
    """When the copies of one capture are done. All three are idempotent and cheap after
    their first call; ``before_forward`` and ``before_optimizer_step`` are called by the
    training thread (through :class:`StepFences`' hooks), ``wait`` by the thread that reads
    the snapshot."""

    def before_forward(self) -> None:
        """Order the next forward after the first group's copies."""

    def before_optimizer_step(self) -> None:
        """Order the next optimizer step after both groups' copies."""

    def wait(self) -> None:
        """Block the calling host thread until every copy is done."""


class DeviceCopier(Protocol):
    """Starts the copies of a capture's device tensors; the training thread calls it."""

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a device tensor this copier copies (else the capture copies
        it on the host at once)."""

    def start(self, first: Pairs, second: Pairs) -> CopyFence:
        """Start the copies, ``first`` (written by a forward or the loop) before ``second``
        (parameters and optimizer state); returns before they are done."""


class _CudaFence:
    def __init__(self, first: dict[torch.device, torch.cuda.Event],
                 second: dict[torch.device, torch.cuda.Event]) -> None:
        self._first, self._second = first, second
        self._forward = self._step = self._done = False

    def before_forward(self) -> None:
        if not self._forward:
            _current_streams_wait(self._first)
            self._forward = True

    def before_optimizer_step(self) -> None:
        if not self._step:
            self.before_forward()
            _current_streams_wait(self._second)
            self._step = True

    def wait(self) -> None:
        if not self._done:
            for event in (*self._first.values(), *self._second.values()):
                event.synchronize()
            self._done = True


def _current_streams_wait(events: dict[torch.device, torch.cuda.Event]) -> None:
    for device, event in events.items():
        torch.cuda.current_stream(device).wait_event(event)


class CudaSideStreams:
    """The CUDA :class:`DeviceCopier`: one side stream per device, created on first use.

    Its events are ``blocking``: a host thread in ``wait`` sleeps instead of spinning, so the
    writer thread waiting for a large copy takes no core from training. Threading: ``start``
    on the training thread only (it enters the side stream's context there).
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def start(self, first: Pairs, second: Pairs) -> CopyFence:
        waited: set[torch.device] = set()
        events = []
        for pairs in (first, second):
            by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for dst, src in pairs:
                by_device.setdefault(src.device, []).append((dst, src))
            recorded = {}
            for device, todo in by_device.items():
                side = self._streams.get(device)
                if side is None:
                    side = self._streams[device] = torch.cuda.Stream(device=device)
                if device not in waited:
                    side.wait_stream(torch.cuda.current_stream(device))
                    waited.add(device)
                with torch.cuda.stream(side):
                    for dst, src in todo:
                        dst.copy_(src, non_blocking=True)
                        src.record_stream(side)
                recorded[device] = side.record_event(torch.cuda.Event(blocking=True))
            events.append(recorded)
        return _CudaFence(*events)


def copy_now(pairs: Pairs) -> None:
    """Copy ``pairs`` and return once they are done: for a capture without a copier to
    order the next steps after it (a sharded state's objects other than its DTensors,
    which ``capture.sharded`` copies itself; a capture outside a pilot)."""
    CudaSideStreams().start(pairs, ()).wait()


def copier_for(model: torch.nn.Module) -> DeviceCopier | None:
    """The copier a pilot overlaps its captures with: CUDA side streams when ``model`` has a
    CUDA parameter, else None — a CPU model gets no hooks and pays nothing per step. The
    assembly calls it through the module, so a test can put a copier of its own here."""
    if any(p.is_cuda for p in model.parameters()):
        return CudaSideStreams()
    return None


class StepFences:
    """A :class:`DeviceCopier` that also orders the training steps after each capture's
    copies: a forward pre-hook on ``model`` and a step pre-hook on ``optimizer`` call the
    pending fences' ``before_forward`` / ``before_optimizer_step``. Without an optimizer the
    forward waits for both groups (nothing else tells when the parameters change).

    The forward hook sees only calls of ``model`` itself; a loop may call its submodules
    instead (a LightningModule's ``training_step`` calling ``self.backbone(x)``), and their
    forwards write buffers too. So the first group waits for the forward hook only once the
    hook was seen to run between a capture and the next optimizer step; until then, and after
    a step that came without it (logged as a warning: that save's buffers may be a forward
    late), the current stream waits for the first group right at the capture — still on the
    GPU, no host block, a wait as short as the buffers' and extras' copies.

    Lifecycle: built by the assembly for a model with device tensors, passed to every
    ``state.capture`` of the pilot, :meth:`remove` d at close. Threading: the training thread
    (the hooks run where forward and step run). The hooks are excluded from ``torch.compile``
    tracing: their state changes with every save, and a traced hook would recompile the model
    each time.
    """

    def __init__(self, copier: DeviceCopier, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None) -> None:
        self._copier = copier
        self._pending: list[CopyFence] = []  # started since the last optimizer step
        self._forward_seen = False  # the forward hook ran since the newest capture
        self._forward_trusted = False  # ... and did so before the optimizer step after one
        self._has_optimizer = optimizer is not None
        self._handles = [model.register_forward_pre_hook(
            torch.compiler.disable(self._before_forward))]
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(
                torch.compiler.disable(self._before_step)))

    def owns(self, tensor: torch.Tensor) -> bool:
        return self._copier.owns(tensor)

    def start(self, first: Pairs, second: Pairs) -> CopyFence:
        fence = self._copier.start(first, second)
        if not self._forward_trusted:
            fence.before_forward()
        self._pending.append(fence)
        self._forward_seen = False
        return fence

    def remove(self) -> None:
        """Unregister the hooks (the pilot's close, after its pending saves were flushed)."""
        for handle in self._handles:
            handle.remove()
        self._pending.clear()

    def _before_forward(self, *_: object) -> None:
        self._forward_seen = True
        if not self._has_optimizer:
            self._release()
        for fence in self._pending:
            fence.before_forward()

    def _before_step(self, *_: object) -> None:
        if self._pending:
            if self._forward_seen:
                self._forward_trusted = True
            elif self._forward_trusted:
                self._forward_trusted = False
                log.warning(
                    "the model given to the pilot was not called between the last save and "
                    "this optimizer step (the loop calls its submodules?): that save's "
                    "buffers and extras may hold values a forward wrote after it. From now "
                    "on each save orders them before any later GPU work; pass the module the "
                    "loop calls as model= to keep them overlapped")
        self._release()

    def _release(self) -> None:
        for fence in self._pending:
            fence.before_optimizer_step()
        self._pending.clear()
