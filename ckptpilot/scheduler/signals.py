"""The training-dynamics signals of the adaptive scheduler, and its hazard window (SPEC §4.1, §4.2).

This module owns :class:`LossChange`, :class:`GradActivity` and :class:`Hazard`: small stateful
trackers that turn a stream of losses, gradient-norm probes and precursor events into graded
signals in [0, 1]. Each keeps O(window) state in fixed-size rings, so memory never grows with
the run; each step updates small sorted windows by bisection, with no sort.

Why the signals are scale-free: both trackers work on the log of their input and judge each
new value by a robust z-score against the tracker's *own* recent history (median and MAD of a
rolling window). Multiplying every loss (or every grad norm) by any constant c shifts all logs
by log10(c); medians shift with them, deviations and MADs do not, so every z-score, hence every
signal, is unchanged. One policy therefore fits a
loss of 8 and of 0.01, a grad norm of 0.3 and of 300; the only absolute constant left,
``loss.slope_threshold``, is in decades per step, a relative change, and only keeps rounding
noise on a perfectly flat loss (MAD 0) quiet.

It must not do I/O, read a clock, import numpy or torch, or decide anything about saving:
the scheduler (``adaptive.py``) combines the signals. A non-finite input (NaN, ±inf) never
enters a window: for the loss it is divergence, the strongest signal (1.0) for that step; for
a grad norm it is refused (``update`` returns False). Reporting either is the caller's job.

Threading: a tracker belongs to one thread (the training thread, through the scheduler).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from math import copysign, inf, isfinite, log10

from ckptpilot.policy import GradSignalPolicy, LossSignalPolicy

__all__ = [
    "LOSS_EPSILON",
    "MAD_TO_SIGMA",
    "MIN_HISTORY",
    "PRECURSOR_SIGNAL",
    "GradActivity",
    "Hazard",
    "LossChange",
    "graded",
]

LOSS_EPSILON = 1e-30
"""Added before the log so that a loss of exactly 0 stays finite: x = log10(loss + 1e-30).

Far below any real loss, so that it shifts no log measurably: a larger one (1e-8) would make
a loss of 1e-6 read differently from the same run scaled up, breaking scale-freeness."""

GRAD_EPSILON = 1e-30
"""Added before the log so that a grad norm of exactly 0 (a frozen model) stays finite."""

MAD_TO_SIGMA = 1.4826
"""MAD × 1.4826 estimates σ for Gaussian noise: the robust z-score reads like a plain one."""

MIN_HISTORY = 8
"""Values a window must hold (or all of it, if smaller) before a new value is judged."""

PRECURSOR_SIGNAL = 0.5
"""A loss, grad or system signal at or above this is a precursor for :class:`Hazard`."""


def graded(z: float, low: float, high: float) -> float:
    """0 at or below ``low``, 1 at or above ``high``, linear between: a band, not a switch."""
    if z <= low:
        return 0.0
    if z >= high:
        return 1.0
    return (z - low) / (high - low)


class _Window:
    """The last ``size`` values in arrival order (``ring``) and the same values sorted.

    A tracker reads the median of ``ordered`` and, through :meth:`mad`, its MAD, *then* adds
    the new value: it is judged against the window before it. Adding is inline in the
    trackers, three C calls, because they run on the training thread at every step::

        if len(ring) == size:
            del ordered[bisect_left(ordered, ring[0])]  # the oldest leaves
        ring.append(value)  # a full deque drops ring[0] itself
        insort(ordered, value)

    One delete and one insert, memmoves of a few hundred bytes, no sort.
    """

    __slots__ = ("_start", "ordered", "ring", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.ring: deque[float] = deque(maxlen=size)
        self.ordered: list[float] = []
        self._start = 0

    def mad(self, middle: float) -> float:
        """The median absolute deviation of ``ordered`` from its median ``middle``.

        Without sorting the deviations. The k values nearest the median m are k neighbours
        a[i..i+k−1] of ``ordered``, so the k-th smallest deviation is the smallest reach,
        max(m − a[i], a[i+k−1] − m), of such a run. Moving a run right shortens its reach
        down and lengthens its reach up, so the best run is the first one that reaches at
        least as far up as down, or the one just before it. One value comes and one goes per
        step, so that run moves by a rank or two: the walk starts where the last one ended,
        O(1) Python steps on a steady window where a search takes O(log n). With an even
        count the MAD is the mean of the k-th and the (k+1)-th smallest deviation, the
        (k+1)-th being the nearer neighbour of the best run.
        """
        ordered = self.ordered
        count = len(ordered)
        last = count >> 1  # the last run's first rank
        top = count - last - 1  # a run a[i..i+top] holds k = count − count // 2 values
        start = self._start if self._start <= last else last + 1
        while start and ordered[start + top - 1] - middle >= middle - ordered[start - 1]:
            start -= 1
        while start <= last and ordered[start + top] - middle < middle - ordered[start]:
            start += 1
        self._start = start
        up = ordered[start + top] - middle if start <= last else inf  # a[start..]'s reach
        down = middle - ordered[start - 1] if start else inf  # a[start − 1..]'s reach
        if count & 1:
            return up if up < down else down
        if up < down:  # the best run is a[start..start+top]; a[start − 1] reaches down
            after = ordered[start + top + 1] - middle if start + top + 1 < count else inf
            return 0.5 * (up + (down if down < after else after))
        before = middle - ordered[start - 2] if start > 1 else inf  # the best is a[start − 1..]
        return 0.5 * (down + (before if before < up else up))

    def z(self, deviation: float, middle: float) -> float:
        """deviation / (1.4826·MAD), the MAD around ``middle``, the median of ``ordered``.

        Infinite over a MAD of 0 (a window of mostly identical values): anything that moves
        after a perfectly flat stretch is a change. The caller counts a deviation within its
        floor as z = 0 without asking.
        """
        scale = MAD_TO_SIGMA * self.mad(middle)
        if scale > 0.0:
            return deviation / scale
        return copysign(inf, deviation)


class LossChange:
    """Regime-change detector on the log10 loss (SPEC §4.1).

    Per accepted loss: x_t = log10(loss_t + 1e-30); the short-window slope
    s_t = (x_t − median(x_{t−w}, …, x_{t−1})) / ((w + 1) / 2), in decades per step (the median
    of the last ``w = loss.window`` values sits, for a straight line, (w + 1)/2 steps back);
    z_t = (s_t − median(S)) / (1.4826·MAD(S)) over the last ``loss.history`` slopes S before
    it. A deviation of the slope from its median of at most ``slope_threshold`` decades per
    step counts as z = 0. Two parts, and the signal is the larger:

    * jump: :func:`graded`(|z_t|, ``z_low``, ``z_high``), one step far out of the recent
      spread, either way: a spike up, a sudden drop;
    * drift: a two-sided CUSUM, C± = clamp(C± ± z_t − ``drift_allowance``, 0,
      ``drift_high``) with z_t capped at ±``z_high``, graded between ``drift_low`` and
      ``drift_high``. Slopes each a little off their median the same way add up: a descent
      that stops, a plateau that starts to fall, a run that starts climbing.

    A steady descent, at any rate and with noise of any size, keeps its slope near the
    slope's own median, within its own MAD, and z changes sign often enough to keep C± under
    ``drift_low``: quiet. A lasting new regime becomes the history within ``history`` steps
    and the signal falls back.

    A non-finite loss is divergence: the signal is 1.0 for that step and the windows are left
    exactly as they were; the next finite loss is judged against them again. Nothing is judged
    until ``window`` losses and min(``history``, 8) slopes are in.
    """

    def __init__(self, policy: LossSignalPolicy) -> None:
        self._window = policy.window
        self._lag = (policy.window + 1) / 2.0
        self._z_low = policy.z_low
        self._z_high = policy.z_high
        self._floor = policy.slope_threshold
        self._drift_allowance = policy.drift_allowance
        self._drift_low = policy.drift_low
        self._drift_high = policy.drift_high
        self._rising = 0.0
        self._falling = 0.0
        self._levels = _Window(policy.window)
        # The level median is read only from a full window: its two ranks are fixed.
        self._level_lo, self._level_hi = (policy.window - 1) // 2, policy.window // 2
        self._slopes = _Window(policy.history)
        # Accepted losses before a slope is judged: a full level window, then enough slopes.
        self._warm_up = policy.window + min(policy.history, MIN_HISTORY)
        self._accepted = 0
        self._z = 0.0
        self._signal = 0.0

    @property
    def z(self) -> float:
        """Robust z-score of the last accepted slope (signed; 0.0 until judged)."""
        return self._z

    @property
    def drift(self) -> float:
        """The larger of the two drift CUSUMs C+ and C−, in robust σ beyond the allowance."""
        return max(self._rising, self._falling)

    @property
    def signal(self) -> float:
        """The graded signal in [0, 1] of the last finite, non-zero loss judged."""
        return self._signal

    def update(self, loss: float) -> bool:
        """Feed one step's loss; False for a NaN or infinite loss (nothing changes: the
        scheduler reports that step's loss signal as 1).

        A loss of exactly 0 (a fully masked batch, a hinge loss met) is no reading: its log
        lies decades below any other and would read as a jump. Raises ``ValueError`` for a
        negative loss: its log is undefined, and clamping it would invent a change. Pass a
        non-negative training objective (cross-entropy, MSE …).
        """
        value = float(loss)
        if not 0.0 < value < inf:
            if not isfinite(value):
                return False
            if value < 0.0:
                raise ValueError(
                    f"loss must be >= 0 for the log10 loss-change signal, got {value!r}; "
                    "pass a non-negative objective to observe()"
                )
            return True
        x = log10(value + LOSS_EPSILON)
        accepted = self._accepted = self._accepted + 1
        ring, ordered = self._levels.ring, self._levels.ordered
        if accepted <= self._window:
            ring.append(x)
            insort(ordered, x)
            self._signal = 0.0
            return True
        slope = (x - 0.5 * (ordered[self._level_lo] + ordered[self._level_hi])) / self._lag
        del ordered[bisect_left(ordered, ring[0])]
        ring.append(x)
        insort(ordered, x)

        slopes = self._slopes
        ring, ordered = slopes.ring, slopes.ordered
        if accepted <= self._warm_up:  # never fills the slope window: no delete
            ring.append(slope)
            insort(ordered, slope)
            self._signal = 0.0
            return True
        count = len(ordered)
        middle = 0.5 * (ordered[(count - 1) >> 1] + ordered[count >> 1])
        deviation = slope - middle
        floor = self._floor
        z = self._z = 0.0 if -floor <= deviation <= floor else slopes.z(deviation, middle)
        if count == slopes.size:
            del ordered[bisect_left(ordered, ring[0])]
        ring.append(slope)
        insort(ordered, slope)

        size = z if z >= 0.0 else -z
        allowance = self._drift_allowance
        if size <= allowance and not self._rising and not self._falling:
            drift = 0.0  # the common, quiet step: both CUSUMs stay at 0
        else:
            z_high, high = self._z_high, self._drift_high
            capped = z_high if z > z_high else -z_high if z < -z_high else z
            rising = self._rising + capped - allowance
            rising = 0.0 if rising < 0.0 else high if rising > high else rising
            falling = self._falling - capped - allowance
            falling = 0.0 if falling < 0.0 else high if falling > high else falling
            self._rising, self._falling = rising, falling
            drift = rising if rising > falling else falling
        if size <= self._z_low and drift <= self._drift_low:
            self._signal = 0.0  # no grading needed
        else:
            self._signal = max(
                graded(size, self._z_low, self._z_high),
                graded(drift, self._drift_low, self._drift_high),
            )
        return True


class GradActivity:
    """Deviation and growth detector on the global gradient norm, one value per probe (§4.2).

    Every value passed to :meth:`update` is one probe: the caller measures the norm every
    ``grad.probe_every`` optimizer steps and hands it over once (the scheduler is given
    ``grad_norm=None`` on the other steps). Counting probes rather than steps keeps the
    tracker correct when a restored run starts at a step that is not a multiple of
    ``probe_every``.

    Per probe: y = log10(g + 1e-30); z = (y − median(Y)) / (1.4826·MAD(Y)) over the last
    ``grad.window`` probes Y before it, and z = 0 while y is within ``grad.deadband_decades``
    of the median (a flat or coarsely rounded norm, MAD 0, must not read as an infinite z).
    Two parts, and the signal is the larger:

    * deviation: :func:`graded`(z, ``z_low``, ``z_high``), a norm far above its recent
      median. Only upward: a norm far *below* it is a batch the model already fits, common
      late in training when the loss is near 0 on many batches, and no sign of instability;
    * growth: a one-sided CUSUM C = clamp(C + min(z, ``z_high``) − ``growth_allowance``,
      0, ``growth_high``), graded between ``growth_low`` and ``growth_high``. Probes each a
      little above the median, none outside the band, add up: sustained growth of the grad
      norm, the usual precursor of a loss spike, raises the signal before any single probe is
      an outlier. A probe near or below the median takes the allowance or more off C, so
      noise around a steady level keeps C under ``growth_low``.

    Every probe enters the window after being judged, so a lasting change of level becomes
    the new normal within about ``window / 2`` probes. The signal holds its value between
    probes. Nothing is judged until the window holds min(window, 8) probes.
    """

    def __init__(self, policy: GradSignalPolicy) -> None:
        self._z_low = policy.z_low
        self._z_high = policy.z_high
        self._allowance = policy.growth_allowance
        self._deadband = policy.deadband_decades
        self._growth_low = policy.growth_low
        self._growth_high = policy.growth_high
        self._window = _Window(policy.window)
        self._min_probes = min(policy.window, MIN_HISTORY)
        self._z = 0.0
        self._cusum = 0.0
        self._signal = 0.0

    @property
    def probes(self) -> int:
        """How many probes the window holds (at most ``grad.window``)."""
        return len(self._window.ring)

    @property
    def z(self) -> float:
        """Robust z-score of the last probe (signed; 0.0 until judged)."""
        return self._z

    @property
    def growth(self) -> float:
        """The growth CUSUM C, in robust σ beyond the allowance."""
        return self._cusum

    @property
    def signal(self) -> float:
        """The graded signal in [0, 1], as of the last probe."""
        return self._signal

    def update(self, grad_norm: float) -> bool:
        """Feed one probe; False (state untouched) when it is NaN or infinite.

        Raises ``ValueError`` for a negative value: a norm never is; pass the global L2 norm.
        """
        value = float(grad_norm)
        if not 0.0 <= value < inf:
            if not isfinite(value):
                return False
            raise ValueError(
                f"grad_norm must be >= 0 (a norm), got {value!r}; pass the global L2 norm "
                "of the gradients"
            )
        y = log10(value + GRAD_EPSILON)
        window = self._window
        ring, ordered = window.ring, window.ordered
        count = len(ordered)
        if count < self._min_probes:  # never a full window: no delete
            ring.append(y)
            insort(ordered, y)
            return True
        middle = 0.5 * (ordered[(count - 1) >> 1] + ordered[count >> 1])
        deviation = y - middle
        deadband = self._deadband
        z = self._z = 0.0 if -deadband <= deviation <= deadband else window.z(deviation, middle)
        if count == window.size:
            del ordered[bisect_left(ordered, ring[0])]
        ring.append(y)
        insort(ordered, y)
        # z capped at z_high: one probe, however far out (an infinite z after a flat window),
        # adds a bounded amount; C capped at growth_high, where the signal is already 1, so a
        # long climb is forgotten within a few probes once it stops.
        z_high, growth_high = self._z_high, self._growth_high
        cusum = self._cusum + (z_high if z > z_high else z) - self._allowance
        cusum = self._cusum = 0.0 if cusum < 0.0 else growth_high if cusum > growth_high else cusum
        if z <= self._z_low and cusum <= self._growth_low:
            self._signal = 0.0  # the common, quiet probe: no grading needed
        else:
            self._signal = max(
                graded(z, self._z_low, z_high), graded(cusum, self._growth_low, growth_high)
            )
        return True


class Hazard:
    """How recently a precursor was seen, as a signal that decays over a window of steps.

    A precursor (a loss, grad or system signal at or above :data:`PRECURSOR_SIGNAL`, or a
    non-finite loss or grad norm) at step p sets the hazard to 1 − (t − p) / ``window_steps``
    at step t ≥ p, so it reaches 0 ``window_steps`` after the last precursor; a newer precursor
    restarts it. The scheduler folds it into the system signal: a run that just misbehaved
    keeps a shorter interval for a while, even once the signal that fired has settled.
    ``window_steps = 0`` turns the hazard off.
    """

    def __init__(self, window_steps: int) -> None:
        self._window = window_steps
        self._last: int | None = None

    def restart(self, step: int) -> None:
        """The run went back to ``step`` (a restore): a precursor seen after it still counts,
        as seen at ``step`` — the run returns to just before the trouble."""
        if self._last is not None and self._last > step:
            self._last = step

    def update(self, step: int, precursor: bool) -> float:
        """Note whether ``step`` had a precursor; return the hazard in [0, 1] at ``step``."""
        window = self._window
        if precursor and window:
            self._last = step
            return 1.0
        last = self._last
        if last is None or step < last:
            return 0.0
        hazard = 1.0 - (step - last) / window
        return hazard if hazard > 0.0 else 0.0
