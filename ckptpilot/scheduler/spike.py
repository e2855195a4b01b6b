"""Loss-spike detection for instability rollback (docs/concepts/rollback.md).

This module owns :class:`SpikeDetector`, which turns the per-step loss into spike events: a
loss above ``spike_factor`` × its rolling baseline for ``patience`` steps in a row, or a
non-finite loss at once. Large runs restart from such events (PaLM went back ~100 steps before
a spike and skipped the batches around it); the event carries the spike's *onset*, the first
step of the excursion, because the checkpoint to return to is the newest one saved before it:
a save during the excursion may already hold the damaged state.

The baseline is the median of the last ``baseline_window`` losses outside any excursion, so
the steps of a spike do not raise their own yardstick, and the test is a ratio: a loss of 8
and one of 0.01 need the same settings. It must not do I/O or decide what happens next: the
pilot promotes the checkpoint before the onset and, when rollback is enabled, restores it.

Threading: a detector belongs to the training thread.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

from ckptpilot.policy import RollbackPolicy

__all__ = ["Spike", "SpikeDetector"]

_MIN_BASELINE = 8
"""Losses the baseline needs (or all of its window, if smaller) before a loss is judged."""


@dataclass(frozen=True)
class Spike:
    """One confirmed spike: ``onset`` its first step, ``step`` where it was confirmed."""

    onset: int
    step: int
    loss: float
    baseline: float
    reason: str


class SpikeDetector:
    """Confirms loss spikes against the median of the recent losses outside any excursion.

    Per loss at step t: a NaN or infinite loss confirms a spike at once; a loss of 0 is no
    reading (a fully masked batch); otherwise, once the baseline holds min(window, 8) losses,
    a loss above ``spike_factor`` × baseline is *high*. The first high step opens an excursion
    (its onset); ``patience`` high steps in a row confirm it; a loss at or below the bar closes
    it and, like every ordinary loss, enters the baseline. A confirmed excursion is reported
    once. If the run goes on without a rollback (:meth:`forget_excursion` not called) its
    losses then enter the baseline, so a lasting new level becomes the normal one instead of
    a spike that never ends.
    """

    def __init__(self, policy: RollbackPolicy) -> None:
        self._factor = policy.spike_factor
        self._patience = policy.patience
        self._size = policy.baseline_window
        self._ring: deque[float] = deque()
        self._sorted: list[float] = []
        self._needed = min(policy.baseline_window, _MIN_BASELINE)
        self._onset: int | None = None
        self._high = 0
        self._confirmed = False

    @property
    def baseline(self) -> float | None:
        """The median of the baseline window; None until it holds enough losses."""
        ordered = self._sorted
        if len(ordered) < self._needed:
            return None
        half = len(ordered) // 2
        return ordered[half] if len(ordered) % 2 else 0.5 * (ordered[half - 1] + ordered[half])

    def update(self, step: int, loss: float) -> Spike | None:
        """Feed one step's loss; the spike it confirms, if any.

        Raises ``ValueError`` for a negative loss: the ratio to the baseline has no meaning
        for it; pass a non-negative objective.
        """
        value = float(loss)
        ordered = self._sorted
        count = len(ordered)
        if count < self._needed:
            baseline = None
        else:  # the median, inline: this runs on the training thread every step
            half = count >> 1
            baseline = ordered[half] if count & 1 else 0.5 * (ordered[half - 1] + ordered[half])
        if not math.isfinite(value):
            onset = step if self._onset is None else self._onset
            self._onset, self._high, self._confirmed = None, 0, False
            return Spike(onset, step, value, math.nan if baseline is None else baseline,
                         f"non-finite loss ({value}) at step {step}")
        if value < 0.0:
            raise ValueError(
                f"loss must be >= 0 for spike detection, got {value!r} at step {step}; pass "
                "a non-negative objective to observe()")
        if value == 0.0:
            return None
        if baseline is None or value <= self._factor * baseline:
            if self._onset is not None:
                self._onset, self._high, self._confirmed = None, 0, False
            ring = self._ring
            if count == self._size:
                del ordered[bisect.bisect_left(ordered, ring.popleft())]
            ring.append(value)
            bisect.insort(ordered, value)
            return None
        if self._confirmed:
            self._push(value)
            return None
        if self._onset is None:
            self._onset = step
        self._high += 1
        if self._high < self._patience:
            return None
        self._confirmed = True
        return Spike(self._onset, step, value, baseline,
                     f"loss {value:.4g} above {self._factor:g} x its baseline {baseline:.4g} "
                     f"for {self._high} steps since step {self._onset}")

    def forget_excursion(self) -> None:
        """The run went back before the excursion (a rollback): judge afresh from here."""
        self._onset, self._high, self._confirmed = None, 0, False

    def _push(self, value: float) -> None:
        ring, ordered = self._ring, self._sorted
        if len(ring) == self._size:
            del ordered[bisect.bisect_left(ordered, ring.popleft())]
        ring.append(value)
        bisect.insort(ordered, value)
