"""The two training-dynamics signals of the adaptive scheduler (SPEC §4.1, §4.2).

This module owns :class:`LossTrend` and :class:`GradActivity`: small stateful trackers that
turn a stream of losses and gradient-norm probes into a signal in {0, 1}. Each keeps O(1)
state (a few floats, or one fixed-size ring buffer), so memory never grows with the run.

It must not do I/O, read a clock, import numpy or torch, or decide anything about saving:
the scheduler (``adaptive.py``) combines the signals. A non-finite input (NaN, ±inf) is
refused — ``update`` returns False and the state is left exactly as it was — so one bad step
never poisons the EWMA or the window; reporting it is the caller's job.

Threading: a tracker belongs to one thread (the training thread, through the scheduler).
"""

from __future__ import annotations

import math

from ckptpilot.policy import GradSignalPolicy, LossSignalPolicy

__all__ = ["GRAD_MIN_PROBES", "LOSS_EPSILON", "GradActivity", "LossTrend"]

LOSS_EPSILON = 1e-8
"""Added before the log so that a loss of exactly 0 stays finite: x = log10(loss + 1e-8)."""

GRAD_MIN_PROBES = 5
"""Probes the window must hold (or the whole window, if smaller) before a probe is judged."""


class LossTrend:
    """Fast-change detector on the log10 loss (SPEC §4.1).

    x_t = log10(loss_t + 1e-8); slope_t = a·(x_t − x_{t−1}) + (1 − a)·slope_{t−1}. The signal
    is 1 while |slope| has exceeded ``slope_threshold`` on at least ``consecutive``
    consecutive accepted steps, else 0. Working on log10 makes the threshold a rate in
    decades per step, so a plateau at 1e-4 with ±1 % noise moves x by at most ~0.004 per step
    — far under 0.05 — and never fires, while an early descent by decades does.

    The recursion needs only x_{t−1}, the slope and the run length, so no loss history is
    kept and ``loss.window`` (the seed's buffer length, a horizon of roughly 1/a steps) does
    not change the result. The first accepted loss only seeds x_{t−1}; the slope starts at 0.
    """

    def __init__(self, policy: LossSignalPolicy) -> None:
        self._alpha = policy.ewma_alpha
        self._threshold = policy.slope_threshold
        self._consecutive = policy.consecutive
        self._previous_x: float | None = None
        self._slope = 0.0
        self._run = 0

    @property
    def slope(self) -> float:
        """The current EWMA slope of log10(loss), in decades per step."""
        return self._slope

    @property
    def signal(self) -> float:
        """1.0 during a fast-change phase, else 0.0."""
        return 1.0 if self._run >= self._consecutive else 0.0

    def update(self, loss: float) -> bool:
        """Feed one step's loss; False (state untouched) when it is NaN or infinite.

        Raises ``ValueError`` for a negative loss: its log is undefined, and clamping it would
        invent a trend. Pass a non-negative training objective (cross-entropy, MSE …).
        """
        value = float(loss)
        if not math.isfinite(value):
            return False
        if value < 0.0:
            raise ValueError(
                f"loss must be >= 0 for the log10 loss-trend signal, got {value!r}; "
                "pass a non-negative objective to observe()"
            )
        x = math.log10(value + LOSS_EPSILON)
        if self._previous_x is not None:
            alpha = self._alpha
            self._slope = alpha * (x - self._previous_x) + (1.0 - alpha) * self._slope
        self._previous_x = x
        if abs(self._slope) > self._threshold:
            # Capped: the run only needs to reach ``consecutive``.
            self._run = min(self._run + 1, self._consecutive)
        else:
            self._run = 0
        return True


class GradActivity:
    """Outlier detector on the global gradient norm, fed one value per probe (SPEC §4.2).

    Every value passed to :meth:`update` is one probe: the caller measures the norm every
    ``grad.probe_every`` optimizer steps and hands it over once (the scheduler is given
    ``grad_norm=None`` on the other steps). Counting probes rather than steps keeps the
    tracker correct when a restored run starts at a step that is not a multiple of
    ``probe_every``.

    A probe g is an outlier when it lies outside [μ − kσ, μ + kσ] *and*
    |g − μ| ≥ ``min_rel_change``·|μ|, where μ and σ (population standard deviation) describe
    the last ``grad.window`` probes *before* g is added. Nothing is judged until the window
    holds min(window, 5) probes. The signal is 1 while the last ``consecutive`` probes were
    all outliers, else 0; it holds its value between probes.

    Outliers do enter the window after being judged: a lasting change of regime (a new
    learning-rate phase) then becomes the new normal within a few probes instead of holding
    the signal at 1 forever. The price is that one spike widens σ for the next ``window``
    probes; a second spike at the same height still stands out (k = 3, window 50).

    μ and σ are kept as O(1) running moments over a fixed ring buffer (sliding Welford
    update); on every wrap of the ring they are recomputed exactly from the buffer, so
    rounding error cannot accumulate over a weeks-long run (amortised O(1) per probe).
    """

    def __init__(self, policy: GradSignalPolicy) -> None:
        self._k = policy.k_sigma
        self._min_rel = policy.min_rel_change
        self._consecutive = policy.consecutive
        self._size = policy.window
        self._min_probes = min(policy.window, GRAD_MIN_PROBES)
        self._ring = [0.0] * policy.window
        self._next = 0
        self._count = 0
        self._mean = 0.0
        self._m2 = 0.0
        self._run = 0

    @property
    def mean(self) -> float:
        """μ of the probes in the window (0.0 while empty)."""
        return self._mean

    @property
    def std(self) -> float:
        """σ (population) of the probes in the window (0.0 while empty)."""
        return math.sqrt(self._m2 / self._count) if self._count else 0.0

    @property
    def probes(self) -> int:
        """How many probes the window holds (at most ``grad.window``)."""
        return self._count

    @property
    def signal(self) -> float:
        """1.0 after ``consecutive`` outlier probes in a row, else 0.0."""
        return 1.0 if self._run >= self._consecutive else 0.0

    def update(self, grad_norm: float) -> bool:
        """Feed one probe; False (state untouched) when it is NaN or infinite."""
        value = float(grad_norm)
        if not math.isfinite(value):
            return False
        if self._count >= self._min_probes:
            mean = self._mean
            band = self._k * math.sqrt(self._m2 / self._count)
            distance = abs(value - mean)
            if distance > band and distance >= self._min_rel * abs(mean):
                self._run = min(self._run + 1, self._consecutive)
            else:
                self._run = 0
        self._push(value)
        return True

    def _push(self, value: float) -> None:
        slot = self._next
        if self._count < self._size:
            self._count += 1
            delta = value - self._mean
            self._mean += delta / self._count
            self._m2 += delta * (value - self._mean)
        else:
            old = self._ring[slot]
            old_mean = self._mean
            self._mean = old_mean + (value - old) / self._size
            self._m2 = max(0.0, self._m2 + (value - old) * (value - self._mean + old - old_mean))
        self._ring[slot] = value
        self._next = (slot + 1) % self._size
        if self._next == 0:
            self._resync()

    def _resync(self) -> None:
        """Exact two-pass moments of the full ring, replacing the running ones."""
        mean = math.fsum(self._ring) / self._size
        self._mean = mean
        self._m2 = math.fsum((value - mean) ** 2 for value in self._ring)
