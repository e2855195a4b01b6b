"""The training-dynamics signals of the adaptive scheduler, and its hazard window (SPEC §4.1, §4.2).

This module owns :class:`LossChange`, :class:`GradActivity` and :class:`Hazard`: small stateful
trackers that turn a stream of losses, gradient-norm probes and precursor events into graded
signals in [0, 1]. The first two are the built-in scheduler signals: each implements the
:class:`~ckptpilot.scheduler.signal.Signal` protocol, as an extra signal of a policy does. Each
keeps a handful of floats, and a step costs a handful of float operations (no window, no sort):
they run on the training thread at every step.

Why the signals are scale-free: both trackers work on the log of their input and judge each
new value by a robust z-score against the tracker's *own* recent history: a center and a
spread, exponentially weighted moving averages (EWMA) of the value and of its absolute
deviation. Multiplying every loss (or every grad norm) by any constant c shifts all logs by
log10(c); a level or center, started from the first value and moved by fractions of the
difference to each new one, shifts with them, while differences, spreads and z-scores do not,
so every signal is unchanged. One policy therefore fits a loss of 8 and of 0.01, a grad norm
of 0.3 and of 300; the only absolute constants left, ``loss.slope_threshold`` (decades per
step, a relative change) and ``grad.deadband_decades``, only keep rounding noise on a
perfectly flat value (spread 0) quiet.

Why robust: before a value moves a level or a center, its deviation is winsorised to
±(``z_high``·σ + the dead band), and before it enters a spread it is capped at
:data:`SPREAD_CLIP`·σ, so one outlier, however far out, moves the center by at most a
fraction of ``z_high``·σ and the spread by a bounded factor; a lasting change moves both step
after step and becomes the new normal.

It must not do I/O, read a clock, import numpy or torch, or decide anything about saving:
the scheduler (``adaptive.py``) combines the signals. A non-finite input (NaN, ±inf) never
enters an estimate: for the loss it is divergence, the strongest signal (1.0) for that step;
for a grad norm it is refused (``update`` returns False). Reporting either is the caller's job.

Threading: a tracker belongs to one thread (the training thread, through the scheduler).
"""

from __future__ import annotations

from math import erfc, exp, inf, isfinite, log10, pi, sqrt
from typing import ClassVar, Literal

from ckptpilot.policy import GradSignalPolicy, LossSignalPolicy
from ckptpilot.scheduler.decision import SystemHealth

__all__ = [
    "GRAD_EPSILON",
    "MIN_HISTORY",
    "PRECURSOR_SIGNAL",
    "SPREAD_CLIP",
    "GradActivity",
    "Hazard",
    "LossChange",
    "ewma_rate",
    "graded",
]

GRAD_EPSILON = 1e-30
"""Added before the log so that a grad norm of exactly 0 (a frozen model) stays finite."""

SPREAD_CLIP = 1.4
"""A spread averages absolute deviations capped at this many of its own σ (plus the dead band).

Capped this low, the average reads the bulk of the noise, as a median absolute deviation
does, not its tails nor a trend that has just started: those are what the z-score must show.
A lasting wider spread still raises it, by a factor of up to 1 + rate·(1.4/0.72 − 1) a step."""

_CLIPPED_MEAN_ABS = sqrt(2.0 / pi) * (1.0 - exp(-SPREAD_CLIP**2 / 2.0)) + SPREAD_CLIP * erfc(
    SPREAD_CLIP / sqrt(2.0)
)
"""E[min(|Z|, SPREAD_CLIP)] for a standard normal Z: the spread of Gaussian noise of σ = 1."""

_SIGMA_PER_SPREAD = 1.0 / _CLIPPED_MEAN_ABS
"""σ of Gaussian noise per unit of its spread."""

_SPREAD_CAP = SPREAD_CLIP * _SIGMA_PER_SPREAD
"""The cap on an absolute deviation entering a spread, per unit of that spread."""

_SQRT2 = sqrt(2.0)

_SLOPE_SIGMA_PER_SPREAD = _SIGMA_PER_SPREAD / _SQRT2
"""σ of a slope per unit of the spread of its step-to-step changes: a difference of two
independent slopes has σ·√2."""

MIN_HISTORY = 8
"""Values a center and spread must have averaged (or their whole span, if shorter) before a
value is judged against them."""

PRECURSOR_SIGNAL = 0.5
"""A loss, grad or system signal at or above this is a precursor for :class:`Hazard`."""


def graded(z: float, low: float, high: float) -> float:
    """0 at or below ``low``, 1 at or above ``high``, linear between: a band, not a switch."""
    if z <= low:
        return 0.0
    if z >= high:
        return 1.0
    return (z - low) / (high - low)


def ewma_rate(span: int) -> float:
    """The weight 2 / (span + 1) of the newest value in an EWMA of ``span`` steps.

    Its center of mass lies (span − 1) / 2 steps back, as for a plain mean of the last
    ``span`` values: a span reads like a window of that many values.
    """
    return 2.0 / (span + 1)


class LossChange:
    """Regime-change detector on the log10 loss (SPEC §4.1).

    Per accepted loss (finite and above 0), with x_t = log10(loss_t) and the weights
    α = 2 / (``level_span_steps`` + 1), β_m = 2 / (``center_span_steps`` + 1),
    β_a = 2 / (``spread_span_steps`` + 1) (:func:`ewma_rate`):

    * level L, an EWMA of x whose center of mass lies λ = 1/α − 1 steps back, so that
      s_t = (x_t − L_{t−1}) / λ is the short-window slope, in decades per step;
    * center m, an EWMA of s (weight β_m), and spread a, an EWMA of the step-to-step change
      |s_t − s_{t−1}| (weight β_a), capped at :data:`SPREAD_CLIP` of its own σ: the noise of
      the slope, which a slowly turning trend does not inflate. σ = a / (√2·0.63), so that z
      reads like a plain z-score on Gaussian noise;
    * d_t = s_t − m_{t−1}, z_t = d_t / σ_{t−1}; z = 0 when |d_t| ≤ ``slope_threshold``.

    Robustness: d_t is winsorised to ±(``z_high``·σ + ``slope_threshold``) before it moves
    the center and the level, so one outlier (a single-step spike) moves neither by more than
    a fraction of ``z_high``·σ and the steps after it read as before. A change that lasts is
    followed: when ``level_span_steps`` / 2 steps in a row are winsorised the same way (as a
    rolling median would follow once half its window has changed), the level restarts at the
    new values, x_t − λ·m.

    Two parts, and the signal is the larger:

    * jump: :func:`graded`(|z_t|, ``z_low``, ``z_high``), one step far out of the recent
      spread, either way: a spike up, a sudden drop;
    * drift: a two-sided CUSUM, C± = clamp(C± ± z_t − ``drift_allowance``, 0,
      ``drift_high``) with z_t capped at ±``z_high``, graded between ``drift_low`` and
      ``drift_high``. Slopes each a little off their center the same way add up: a descent
      that stops, a plateau that starts to fall, a run that starts climbing.

    A steady descent, at any rate and with noise of any size, keeps its slope near the
    slope's own center, within its own spread, and z changes sign often enough to keep C±
    under ``drift_low``: quiet. A lasting new slope moves the center within about
    ``center_span_steps`` steps and the signal falls back.

    Warm-up: the level is the plain mean of the first ``level_span_steps`` values (it then
    lags a steady descent by λ, as the EWMA will); the center and the spread start as plain
    means of the next slopes; nothing is judged until ``level_span_steps`` +
    min(``spread_span_steps``, 8) losses are in.

    A non-finite loss is divergence: the signal is 1.0 for that step and the estimates are
    left exactly as they were; the next finite loss is judged against them again.
    """

    __slots__ = (
        "_accepted",
        "_center",
        "_center_rate",
        "_clipped_run",
        "_drift",
        "_drift_allowance",
        "_drift_high",
        "_drift_low",
        "_falling",
        "_floor",
        "_follow",
        "_inverse_lag",
        "_lag",
        "_level",
        "_level_keep",
        "_level_steps",
        "_previous",
        "_quiet",
        "_rising",
        "_signal",
        "_spread",
        "_spread_cap",
        "_spread_rate",
        "_warm_up",
        "_z",
        "_z_high",
        "_z_low",
    )

    combine: ClassVar[Literal["max"]] = "max"
    shortens_interval: ClassVar[bool] = False
    marks_damage: ClassVar[bool] = True

    def __init__(self, policy: LossSignalPolicy) -> None:
        level_rate = ewma_rate(policy.level_span_steps)
        self._lag = 1.0 / level_rate - 1.0
        self._inverse_lag = 1.0 / self._lag
        self._level_keep = 1.0 - level_rate  # α·(x − L) = (1 − α)·s
        self._center_rate = ewma_rate(policy.center_span_steps)
        self._spread_rate = ewma_rate(policy.spread_span_steps)
        self._spread_cap = _SPREAD_CAP
        self._z_low = policy.z_low
        self._z_high = policy.z_high
        self._floor = policy.slope_threshold
        self._drift_allowance = policy.drift_allowance
        self._drift_low = policy.drift_low
        self._drift_high = policy.drift_high
        # |z| at or below this changes nothing while C± are 0: no drift added, no jump.
        self._quiet = min(policy.drift_allowance, policy.z_low)
        self._level_steps = policy.level_span_steps
        self._follow = max(1, policy.level_span_steps // 2)
        self._warm_up = policy.level_span_steps + min(policy.spread_span_steps, MIN_HISTORY)
        self._level = 0.0
        self._center = 0.0
        self._spread = 0.0
        self._previous = 0.0
        self._clipped_run = 0
        self._rising = 0.0
        self._falling = 0.0
        self._drift = 0.0
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
        return self._drift

    @property
    def sigma(self) -> float:
        """The slope's noise σ that the next slope is judged against, decades per step."""
        return self._spread * _SLOPE_SIGMA_PER_SPREAD

    @property
    def estimates(self) -> tuple[float, float, float]:
        """(level L in log10 loss, center m of the slope, spread a), as of the last loss."""
        return self._level, self._center, self._spread

    @property
    def signal(self) -> float:
        """The graded signal in [0, 1] of the last finite, non-zero loss judged."""
        return self._signal

    def update(self, loss: float) -> bool:
        """Feed one step's loss; False for a NaN or infinite loss, which changes nothing.

        The same as :meth:`measure`, for a caller that reads :attr:`signal` itself.
        """
        if not isfinite(float(loss)):
            return False
        self.measure(0, loss, None, None)
        return True

    def measure(self, step: int, loss: float | None, grad_norm: float | None,
                system: SystemHealth | None) -> float:
        """Feed this step's loss and return the signal (a
        :class:`~ckptpilot.scheduler.signal.Signal`; only ``loss`` is read).

        ``loss=None`` (the loop reported none) changes nothing. A NaN or infinite loss is
        divergence: 1.0 for this step, and the estimates stay exactly as they were. A loss of
        exactly 0 (a fully masked batch, a hinge loss met) is no reading either: its log lies
        decades below any other and would read as a jump. Raises ``ValueError`` for a
        negative loss: its log is undefined, and clamping it would invent a change. Pass a
        non-negative training objective (cross-entropy, MSE …).
        """
        if loss is None:
            return self._signal
        value = float(loss)
        if not 0.0 < value < inf:
            if not isfinite(value):
                return 1.0
            if value < 0.0:
                raise ValueError(
                    f"loss must be >= 0 for the log10 loss-change signal, got {value!r}; "
                    "pass a non-negative objective to observe()"
                )
            return self._signal
        x = log10(value)
        if self._warm_up:  # counts down to 0: one test per step once warm
            self._warm_up -= 1
            self._accepted += 1
            self._warm(x, self._accepted)
            return self._signal
        level = self._level
        center = self._center
        slope = (x - level) * self._inverse_lag
        deviation = slope - center
        change = slope - self._previous
        self._previous = slope
        spread = self._spread
        floor = self._floor
        z_high = self._z_high
        if -floor <= deviation <= floor:
            z = 0.0
            if self._clipped_run:
                self._clipped_run = 0
        else:
            sigma = spread * _SLOPE_SIGMA_PER_SPREAD
            z = deviation / sigma if sigma > 0.0 else (inf if deviation > 0.0 else -inf)
            bound = z_high * sigma + floor
            if deviation > bound or deviation < -bound:
                deviation = self._outlier(x, z, bound)
                level = self._level
            elif self._clipped_run:
                self._clipped_run = 0
        self._z = z
        self._level = level + self._level_keep * (center + deviation)
        self._center = center + self._center_rate * deviation
        size = change if change >= 0.0 else -change
        bound = spread * self._spread_cap + floor
        self._spread = spread + self._spread_rate * ((bound if size > bound else size) - spread)

        size = z if z >= 0.0 else -z
        if size <= self._quiet and not self._drift:
            if self._signal:
                self._signal = 0.0
            return 0.0  # the common, quiet step: both CUSUMs stay at 0, no jump
        allowance, high = self._drift_allowance, self._drift_high
        capped = z_high if z > z_high else -z_high if z < -z_high else z
        rising = self._rising + capped - allowance
        rising = self._rising = 0.0 if rising < 0.0 else high if rising > high else rising
        falling = self._falling - capped - allowance
        falling = self._falling = 0.0 if falling < 0.0 else high if falling > high else falling
        drift = self._drift = rising if rising > falling else falling
        if size <= self._z_low and drift <= self._drift_low:
            self._signal = 0.0  # no grading needed
        else:
            self._signal = max(
                graded(size, self._z_low, z_high), graded(drift, self._drift_low, high)
            )
        return self._signal


    def restart(self, step: int) -> None:
        """Keeps the estimates: the steps replayed from ``step`` continue the dynamics they
        describe, and starting over would leave the signal blind for a warm-up."""

    def _warm(self, x: float, accepted: int) -> None:
        """Warm-up: the level is the plain mean of the first ``level_span_steps`` values (it
        then lags a steady trend by λ, as the EWMA does); the center and the spread are plain
        means of the slopes that follow."""
        level = self._level
        seen = accepted - self._level_steps
        if seen <= 0:
            self._level = level + (x - level) / accepted
            return
        slope = (x - level) * self._inverse_lag
        if seen == 1:  # the first slope has no center to deviate from, no change to measure
            self._center = slope
        else:
            self._center += (slope - self._center) / seen
            change = slope - self._previous
            self._spread += ((change if change >= 0.0 else -change) - self._spread) / (seen - 1)
        self._previous = slope
        self._level = level + self._level_keep * slope

    def _outlier(self, x: float, z: float, bound: float) -> float:
        """The winsorised deviation of a slope beyond ±``bound``; after ``level_span_steps``
        / 2 of them in a row on one side, the level restarts at x − λ·m (a lasting change)."""
        run = self._clipped_run
        run = (run + 1 if run > 0 else 1) if z > 0.0 else (run - 1 if run < 0 else -1)
        clipped = bound if z > 0.0 else -bound
        if run >= self._follow or -run >= self._follow:
            run = 0
            center = self._center
            # Set so that the caller's level update lands on x − λ·m.
            self._level = x - self._lag * center - self._level_keep * (center + clipped)
        self._clipped_run = run
        return clipped


class GradActivity:
    """Deviation and growth detector on the global gradient norm, one value per probe (§4.2).

    Every value passed to :meth:`update` is one probe: the caller measures the norm every
    ``grad.probe_every`` optimizer steps and hands it over once (the scheduler is given
    ``grad_norm=None`` on the other steps). Counting probes rather than steps keeps the
    tracker correct when a restored run starts at a step that is not a multiple of
    ``probe_every``.

    Per probe, with y = log10(g + 1e-30) and β = 2 / (``grad.span_probes`` + 1): the center
    m and spread a are EWMAs of y and of its absolute deviation; d = y − m_{t−1},
    z = d / (√(π/2)·a_{t−1}), and z = 0 while |d| ≤ ``grad.deadband_decades`` (a flat or
    coarsely rounded norm, spread 0, must not read as an infinite z). Then, with d winsorised
    to c = clamp(d, ±(``z_high``·√(π/2)·a + ``deadband_decades``)), m += β·c and
    a += β·(|c| − a). Two parts, and the signal is the larger:

    * deviation: :func:`graded`(z, ``z_low``, ``z_high``), a norm far above its recent
      center. Only upward: a norm far *below* it is a batch the model already fits, common
      late in training when the loss is near 0 on many batches, and no sign of instability;
    * growth: a one-sided CUSUM C = clamp(C + min(z, ``z_high``) − ``growth_allowance``,
      0, ``growth_high``), graded between ``growth_low`` and ``growth_high``. Probes each a
      little above the center, none outside the band, add up: sustained growth of the grad
      norm, the usual precursor of a loss spike, raises the signal before any single probe is
      an outlier. A probe near or below the center takes the allowance or more off C, so
      noise around a steady level keeps C under ``growth_low``.

    Every probe moves the center and the spread after being judged, so a lasting change of
    level becomes the new normal within a fraction of ``span_probes`` probes. The signal
    holds its value between probes. The center and spread start as plain means of the
    probes seen; nothing is judged until min(``span_probes``, 8) probes are in.
    """

    __slots__ = (
        "_allowance",
        "_center",
        "_cusum",
        "_deadband",
        "_growth_high",
        "_growth_low",
        "_probes",
        "_quiet",
        "_rate",
        "_signal",
        "_spread",
        "_warm_up",
        "_z",
        "_z_high",
        "_z_low",
    )

    combine: ClassVar[Literal["max"]] = "max"
    shortens_interval: ClassVar[bool] = True
    marks_damage: ClassVar[bool] = False

    def __init__(self, policy: GradSignalPolicy) -> None:
        self._z_low = policy.z_low
        self._z_high = policy.z_high
        self._allowance = policy.growth_allowance
        self._deadband = policy.deadband_decades
        self._growth_low = policy.growth_low
        self._growth_high = policy.growth_high
        # z at or below this changes nothing while C is 0: no growth added, no deviation.
        self._quiet = min(policy.growth_allowance, policy.z_low)
        self._rate = ewma_rate(policy.span_probes)
        self._warm_up = min(policy.span_probes, MIN_HISTORY)
        self._probes = 0
        self._center = 0.0
        self._spread = 0.0
        self._z = 0.0
        self._cusum = 0.0
        self._signal = 0.0

    @property
    def estimates(self) -> tuple[float, float]:
        """(center m, spread a) of log10 grad norm, as of the last probe."""
        return self._center, self._spread

    @property
    def sigma(self) -> float:
        """The noise σ of log10 grad norm that the next probe is judged against."""
        return self._spread * _SIGMA_PER_SPREAD

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
        """Feed one probe; False for a NaN or infinite one, which changes nothing.

        The same as :meth:`measure`, for a caller that reads :attr:`signal` itself.
        """
        if not isfinite(float(grad_norm)):
            return False
        self.measure(0, None, grad_norm, None)
        return True

    def measure(self, step: int, loss: float | None, grad_norm: float | None,
                system: SystemHealth | None) -> float:
        """Feed this step's probe, if any, and return the signal (a
        :class:`~ckptpilot.scheduler.signal.Signal`; only ``grad_norm`` is read).

        The signal holds its value between probes (``grad_norm=None``) and over a NaN or
        infinite probe, which changes nothing. Raises ``ValueError`` for a negative value: a
        norm never is; pass the global L2 norm.
        """
        if grad_norm is None:
            return self._signal
        value = float(grad_norm)
        if not 0.0 <= value < inf:
            if not isfinite(value):
                return self._signal
            raise ValueError(
                f"grad_norm must be >= 0 (a norm), got {value!r}; pass the global L2 norm "
                "of the gradients"
            )
        y = log10(value + GRAD_EPSILON)
        if self._warm_up:  # counts down to 0: one test per probe once warm
            self._warm(y)
            return self._signal
        deviation = y - self._center
        spread = self._spread
        deadband = self._deadband
        z_high = self._z_high
        size = deviation if deviation >= 0.0 else -deviation
        if size <= deadband:
            z = 0.0
        else:
            sigma = spread * _SIGMA_PER_SPREAD
            z = deviation / sigma if sigma > 0.0 else (inf if deviation > 0.0 else -inf)
            bound = z_high * sigma + deadband
            if size > bound:  # winsorised: one outlier moves the center a bounded amount
                deviation = bound if deviation > 0.0 else -bound
        self._z = z
        rate = self._rate
        self._center += rate * deviation
        bound = spread * _SPREAD_CAP + deadband
        self._spread = spread + rate * ((bound if size > bound else size) - spread)
        if z <= self._quiet and not self._cusum:
            if self._signal:
                self._signal = 0.0
            return 0.0  # the common, quiet probe: C stays at 0, no deviation
        allowance = self._allowance
        # z capped at z_high: one probe, however far out (an infinite z after a flat stretch),
        # adds a bounded amount; C capped at growth_high, where the signal is already 1, so a
        # long climb is forgotten within a few probes once it stops.
        growth_high = self._growth_high
        cusum = self._cusum + (z_high if z > z_high else z) - allowance
        cusum = self._cusum = 0.0 if cusum < 0.0 else growth_high if cusum > growth_high else cusum
        if z <= self._z_low and cusum <= self._growth_low:
            self._signal = 0.0  # no grading needed
        else:
            self._signal = max(
                graded(z, self._z_low, z_high), graded(cusum, self._growth_low, growth_high)
            )
        return self._signal


    def restart(self, step: int) -> None:
        """Keeps the estimates, as :meth:`LossChange.restart` does."""

    def _warm(self, y: float) -> None:
        """Warm-up: the center and the spread are plain means of the probes so far."""
        self._warm_up -= 1
        probes = self._probes = self._probes + 1
        if probes == 1:
            self._center = y
            return
        deviation = y - self._center
        self._center += deviation / probes
        size = deviation if deviation >= 0.0 else -deviation
        self._spread += (size - self._spread) / (probes - 1)


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
