"""The adaptive checkpoint scheduler: when to save, at which level, kept for how long (SPEC §4).

This module owns :class:`AdaptiveCheckpointScheduler`, the pure decision at each step boundary:
it feeds the loss, the gradient-norm probes and a health reading to its signals (the built-in
loss and grad signals and a policy's extra ones, all behind the protocol of ``signal.py``),
adds the system channel, and derives a score, the interval in force, and whether a pulse or
organ is due now. It also owns the save
bookkeeping the decision depends on (last save step, saves since the last organ, the hard-error
reading last acted on, whether the score trigger is armed, whether a health alarm is on).

It must not do I/O, read a clock, import numpy or torch, or talk to other ranks: health
readings, costs and agreed signals arrive as data, and the caller (the pilot) does the saving,
the logging and the collective. Same inputs in the same order give the same decisions. The one
line it logs itself warns of a cost it was handed and had to drop as unusable.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from math import isfinite

from ckptpilot.policy import RetentionPolicy, SchedulerPolicy
from ckptpilot.scheduler.decision import CheckpointDecision, Level, RetentionClass, SystemHealth
from ckptpilot.scheduler.interval import daly_interval
from ckptpilot.scheduler.signal import SCHEDULER_KEYS, SignalLayout, build_signals, layout_of
from ckptpilot.scheduler.signals import PRECURSOR_SIGNAL, Hazard

__all__ = ["MAX_SCORE_REDUCTION", "SIGNAL_KEYS", "AdaptiveCheckpointScheduler"]

log = logging.getLogger("ckptpilot")

SIGNAL_KEYS = ("loss", "grad", *SCHEDULER_KEYS)
"""Keys of :meth:`AdaptiveCheckpointScheduler.measure` without extra signals, in its order;
:attr:`AdaptiveCheckpointScheduler.signal_keys` gives them with a policy's extra signals."""

_NEW = object.__new__

MAX_SCORE_REDUCTION = 0.95
"""interval = base·(1 − min(score, 0.95)): even a maximal score keeps 5 % of the base."""


class AdaptiveCheckpointScheduler:
    """Decides, step by step, whether a pulse or organ checkpoint is due.

    Lifecycle and threading — everything runs on the training thread, once per step boundary:

    1. construct with ``policy.scheduler`` (and ``policy.retention``; defaults otherwise);
    2. after a restore, or whenever a save happens that the scheduler did not decide (a
       forced ``pilot.save``), call :meth:`note_save` so the interval counts from there;
    3. whenever the save cost, MTBF or step time is (re)measured, :meth:`set_cost_model`;
    4. per step, :meth:`decide` — or, in a distributed run, :meth:`measure` on every rank,
       the measurements combined over ranks as :attr:`layout` says (element-wise max, or sum
       for a signal that declares it; ``agreement.py``), then :meth:`decide_from` with the
       agreed values. Every rank then holds the same bookkeeping and takes the same decision.

    Rules (SPEC §4), with the choices the spec leaves open. Against failures that strike at
    random, evenly spaced saves lose the least for their number, so every save off the beat
    must buy something: only a sign that a crash or a loss spike is coming moves one.

    * score = Σ w_s·s over the signals s (loss, grad, then the extra ones, in that order)
      + w_system·system, each value clamped to [0, 1] (NaN counts as 0): the unusualness of
      the step, logged, and what the trigger tests.
    * health = the part of the system signal the training signals do not explain: the
      scheduler keeps its own hazard of the steps where an (agreed) signal reached 0.5 or a
      value was non-finite, over ``system.hazard_window_steps``, and health is the system
      signal where it exceeds that hazard, else 0 — a health probe's reading, or the hazard
      a health reading left.
    * interval = clamp(round_half_up(base·(1 − min(Σ w_s·s + w_system·health, 0.95))),
      min_interval, max_interval), the sum over the signals that declare
      ``shortens_interval`` (grad, not loss), ``base`` being :attr:`base_interval`. The loss
      signal and the hazard it raises do not shorten it: a loss that moves (a faster descent,
      a plateau, a spike already under way) is no warning of a crash, and the saves it would
      add cluster where uniform failures punish clustering most.
    * A save is due when ``step − last save step ≥ interval``. A score reaching
      ``trigger_threshold`` saves at once, on the rising edge only, and only when at least
      ``trigger_refractory_fraction`` × base steps have passed since the last save (an edge
      sooner is passed over: the last save is recent). While the score stays at or above the
      threshold the interval rule applies, so a long fast-change phase does not save every
      step. The trigger re-arms when the score falls below.
    * Health alarm: health ≥ ``system.alarm_signal`` (throttling, slow IO, a recent hard
      error: the precursors of a crash) saves at once when it starts and holds the interval at
      ``min_interval`` while it lasts, so the newest save stays close when the crash comes.
    * A step is saved at most once: nothing is saved at the step of the last save (a repeated
      decision, or the step :meth:`note_save` reported).
    * New hard errors save an organ at once (``emergency``, class critical). ``measure``
      reports as ``hard_errors`` how many errors this rank's probe counted beyond the reading
      last acted on — not the raw count: a max over ranks of raw counts would hide a first
      error on one rank behind an older, higher count on another. Errors count as acted on
      only when the emergency save is decided (every rank then moves its reference to its
      latest reading); if the step is non-finite or already saved, it fires at the next step.
      A reading that falls (a restarted probe) becomes the new reference. Health probes must
      count errors since they started: a first reading above 0 is an emergency.
    * Level: the ``organ_every``-th save since the last organ is an organ, else a pulse.
      Emergency organs (and organs passed to :meth:`note_save`) restart that count: an organ
      is a fresh self-contained base, and ``organ_every`` bounds the saves since the last one.
    * A non-finite loss or grad norm gives ``save=False, non_finite=True`` and changes no
      save bookkeeping, the trigger's and the alarm's arming included. (In a distributed run
      the pilot decides step t from the signals agreed at step t − 1, so another rank's
      non-finite value holds back the save one step later.) The trackers never saw the value
      (see ``signals.py``), but the loss signal is 1 for that step and both hazard windows
      start: the system signal stays raised for a while, and none of it reads as health.
    * Retention class from the score at save time: ≥ ``critical_score`` critical,
      ≥ ``important_score`` important, else routine; emergency saves are critical. While a
      signal that declares ``marks_damage`` (the loss signal) is at or above 0.5 a save is at
      most important: the loss may already be in a spike's excursion, and a possibly damaged
      state must not be kept forever (the pilot promotes the save before a confirmed spike's
      onset, the one a rollback returns to).
    """

    def __init__(self, policy: SchedulerPolicy, retention: RetentionPolicy | None = None) -> None:
        self.policy = policy
        self.retention = RetentionPolicy() if retention is None else retention
        signals = self._signals = build_signals(policy)
        self._layout = layout_of(signals)
        # Per step, the signals are read through these tuples (bound methods and policy
        # values resolved once): attribute chains cost on this path.
        self._measures = tuple((s.name, s.signal.measure) for s in signals)
        self._scored = tuple((s.name, s.weight, s.signal.shortens_interval,
                              s.signal.marks_damage) for s in signals)
        self._quiet_signals = dict.fromkeys((*(s.name for s in signals), "system"), 0.0)
        self._hazard = Hazard(policy.system.hazard_window_steps)
        self._training_hazard = Hazard(policy.system.hazard_window_steps)
        self._w_system = policy.weights.system
        # Policy values read at every step, copied once (attribute chains cost on this path).
        self._min_interval = policy.min_interval
        self._max_interval = policy.max_interval
        self._trigger_threshold = policy.trigger_threshold
        self._refractory_fraction = policy.trigger_refractory_fraction
        self._alarm_signal = policy.system.alarm_signal
        self._critical_score = self.retention.critical_score
        self._important_score = self.retention.important_score
        self._base = policy.base_interval
        self._quiet_interval = self._interval_for(0.0)
        self._daly_costs: tuple[float, float] | None = None
        self._daly_seconds = math.inf
        self._last_save_step = 0
        self._saves_since_organ = 0
        self._hard_errors_reading = 0
        self._hard_errors_acted_on = 0
        self._trigger_armed = True
        self._alarm_on = False
        self._non_finite_note: tuple[int, str] | None = None
        self._bad_costs_reported: set[str] = set()

    @property
    def base_interval(self) -> int:
        """The base interval in force: ``base_interval``, capped by the Young/Daly bound."""
        return self._base

    @property
    def signal_keys(self) -> tuple[str, ...]:
        """Keys of :meth:`measure`'s result, in its order: the signals (loss, grad, then the
        policy's ``extra_signals``), then ``system``, ``hard_errors`` and ``non_finite``."""
        return (*(s.name for s in self._signals), *SCHEDULER_KEYS)

    @property
    def layout(self) -> SignalLayout:
        """How the ranks combine each key of :meth:`measure`'s result (the agreement's input)."""
        return self._layout

    @property
    def last_save_step(self) -> int:
        """Step of the last save decided or noted (0 before any)."""
        return self._last_save_step

    def set_cost_model(
        self,
        save_seconds: float | None,
        mtbf_seconds: float | None,
        step_seconds: float | None,
    ) -> None:
        """Cap the base interval by Daly's optimum τ, in steps: min(base, ⌊τ / step⌋).

        ``save_seconds`` is what one save costs the training (the stall it causes), ``mtbf``
        comes from the failure ledger and ``step_seconds`` is the mean step time. The cap
        applies only with ``young_daly: true`` and all three known; it never goes below
        ``min_interval``. Passing ``None`` for any of them removes the cap.

        These are measurements handed over while training runs, so a bad one must not stop
        the run: a value that is not a positive finite number counts as unknown (``None``),
        with a WARNING the first time each cost is bad, and the interval falls back to the
        policy's, which is what it is without a cost model.
        """
        # The pilot hands its costs over at every step: plain positive floats skip the checks.
        if not (save_seconds.__class__ is float and 0.0 < save_seconds < math.inf):
            save_seconds = self._known_cost("save_seconds", save_seconds)
        if not (mtbf_seconds.__class__ is float and 0.0 < mtbf_seconds < math.inf):
            mtbf_seconds = self._known_cost("mtbf_seconds", mtbf_seconds)
        if not (step_seconds.__class__ is float and 0.0 < step_seconds < math.inf):
            step_seconds = self._known_cost("step_seconds", step_seconds)
        policy = self.policy
        base = policy.base_interval
        if (
            policy.young_daly
            and save_seconds is not None
            and mtbf_seconds is not None
            and step_seconds is not None
        ):
            if (save_seconds, mtbf_seconds) != self._daly_costs:  # they change per save
                self._daly_costs = (save_seconds, mtbf_seconds)
                self._daly_seconds = daly_interval(save_seconds, mtbf_seconds)
            bound_steps = self._daly_seconds / step_seconds
            if bound_steps < base:  # also False for an infinite bound: no cap
                base = max(self._min_interval, math.floor(bound_steps))
        if base != self._base:
            self._base = base
            self._quiet_interval = self._interval_for(0.0)

    def _known_cost(self, name: str, value: float | None) -> float | None:
        if value is None:
            return None
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and math.isfinite(value) and value > 0:
            return float(value)
        if name not in self._bad_costs_reported:
            self._bad_costs_reported.add(name)
            log.warning(
                "scheduler cost model: %s=%r is not a positive finite number; treating it as "
                "unknown, so the Young/Daly bound is off while it stays so",
                name,
                value,
            )
        return None

    def restart(self, step: int) -> None:
        """The run was restored to ``step``: a precursor seen after it keeps the hazard
        raised from ``step`` on (a rollback returns to just before the trouble), and every
        signal is told (:meth:`Signal.restart <ckptpilot.scheduler.signal.Signal.restart>`)."""
        self._hazard.restart(step)
        self._training_hazard.restart(step)
        for weighted in self._signals:
            weighted.signal.restart(step)

    def note_save(self, step: int, level: Level | str) -> None:
        """Record a save the scheduler did not decide (forced, or the restored checkpoint)."""
        level = Level(level)
        if level is Level.HEARTBEAT:
            raise ValueError("a heartbeat is not a save; note only pulse or organ saves")
        self._record_save(step, level)

    def measure(
        self,
        step: int,
        loss: float | None,
        grad_norm: float | None = None,
        system: SystemHealth | None = None,
    ) -> dict[str, float]:
        """Feed this rank's values to every signal and return its measurement.

        ``loss=None`` (a loop that reports no loss) leaves the loss signal where it was.

        ``grad_norm`` is a probe: pass it only on the steps where it was measured (every
        ``grad.probe_every`` optimizer steps), ``None`` otherwise. ``system=None`` means no
        health reading: the system signal is the hazard alone, and the hard-error count is
        the last reading's. The result maps :attr:`signal_keys` to floats: each signal's
        value (``loss``, ``grad`` and the extra signals, in [0, 1]), ``system`` in [0, 1],
        ``hard_errors`` the hard errors not yet acted on by an emergency save, ``non_finite``
        1.0 when the loss or grad norm was NaN or infinite (the signals keep it out of their
        estimates; a non-finite loss is a loss signal of 1). ``system`` is the larger of the
        health reading's signal and the hazard: a precursor (a signal or a health reading at
        or above 0.5, or a non-finite value) at this step or within the last
        ``system.hazard_window_steps`` steps.
        """
        problem = None
        if loss is not None and not isfinite(loss):
            problem = f"loss ({float(loss)})"
        if grad_norm is not None and not isfinite(grad_norm):
            grad_problem = f"grad norm ({float(grad_norm)})"
            problem = grad_problem if problem is None else f"{problem} and {grad_problem}"
        if problem is not None:
            self._non_finite_note = (step, problem)
        precursor = problem is not None
        measured = {}
        for name, measure in self._measures:
            value = measured[name] = measure(step, loss, grad_norm, system)
            if value >= PRECURSOR_SIGNAL:
                precursor = True
        health_signal = 0.0
        if system is not None:
            health_signal = system.signal  # clamped inline, NaN as 0, as in decide_from
            health_signal = ((1.0 if health_signal > 1.0 else float(health_signal))
                             if health_signal > 0.0 else 0.0)
            if health_signal >= PRECURSOR_SIGNAL:
                precursor = True
            hard = self._hard_errors_reading = system.hard_errors
            # A reading below the reference means the probe restarted: start from it.
            acted = self._hard_errors_acted_on
            self._hard_errors_acted_on = hard if hard < acted else acted
        hazard = self._hazard.update(step, precursor)
        hard_errors = self._hard_errors_reading - self._hard_errors_acted_on
        measured["system"] = hazard if hazard > health_signal else health_signal
        measured["hard_errors"] = float(hard_errors) if hard_errors else 0.0
        measured["non_finite"] = 0.0 if problem is None else 1.0
        return measured

    def decide(
        self,
        step: int,
        loss: float,
        grad_norm: float | None = None,
        system: SystemHealth | None = None,
    ) -> CheckpointDecision:
        """Single-process shortcut: ``decide_from(step, measure(step, loss, ...))``."""
        return self.decide_from(step, self.measure(step, loss, grad_norm, system))

    def decide_from(self, step: int, signals: Mapping[str, float]) -> CheckpointDecision:
        """Decide for ``step`` from a measurement (this rank's, or the ranks' combined).

        ``signals`` holds every key of :attr:`signal_keys`. A decided save updates the
        bookkeeping at once: the scheduler takes it as done. A caller that ends up saving
        something else (or at another step) reports that through :meth:`note_save`.
        """
        new_hard_errors = signals["hard_errors"]
        if new_hard_errors:
            new_hard_errors = float(new_hard_errors)
            if not (math.isfinite(new_hard_errors) and new_hard_errors >= 0):
                raise ValueError(f"hard_errors must be a count >= 0, got {new_hard_errors!r}")
        non_finite = signals["non_finite"] > 0
        # The sums run in signal order, then the system term: the same floats on every rank.
        score = shortening = 0.0
        training_precursor = non_finite
        damaged = False
        clean = self._quiet_signals.copy()  # every value 0.0, in the decision's key order
        for name, weight, shortens, marks_damage in self._scored:
            # Clamped inline (NaN counts as 0): this runs on the training thread every step.
            value = signals[name]
            if value > 0.0:
                value = clean[name] = 1.0 if value > 1.0 else float(value)
                weighted = weight * value
                score += weighted
                if shortens:
                    shortening += weighted
                if value >= PRECURSOR_SIGNAL:
                    training_precursor = True
                    if marks_damage:
                        damaged = True
        system = signals["system"]
        system = clean["system"] = (1.0 if system > 1.0 else float(system)) if system > 0.0 else 0.0
        training_hazard = self._training_hazard.update(step, training_precursor)
        health = system if system > training_hazard else 0.0
        alarm = health >= self._alarm_signal
        score += self._w_system * system
        if alarm:
            interval = self._min_interval
        else:
            shortening += self._w_system * health
            interval = self._interval_for(shortening) if shortening else self._quiet_interval
        if score >= self._critical_score and not damaged:
            klass = RetentionClass.CRITICAL
        elif score >= self._important_score:
            klass = RetentionClass.IMPORTANT
        else:
            klass = RetentionClass.ROUTINE

        if non_finite:
            reason = self._non_finite_reason(step)
            if new_hard_errors:
                reason += "; emergency save deferred"
            return self._decision(step, None, interval, score, clean, reason, klass,
                                  non_finite=True)

        threshold = self._trigger_threshold
        triggered = self._trigger_armed and score >= threshold
        self._trigger_armed = score < threshold
        alarm_started = alarm and not self._alarm_on
        self._alarm_on = alarm
        if step == self._last_save_step:
            reason = "already saved at this step"
            if new_hard_errors:
                reason += "; emergency save deferred"
            return self._decision(step, None, interval, score, clean, reason, klass)

        if new_hard_errors:
            self._hard_errors_acted_on = self._hard_errors_reading
            self._record_save(step, Level.ORGAN)
            reason = f"emergency: {new_hard_errors:g} new hard error(s)"
            return self._decision(step, Level.ORGAN, interval, score, clean, reason, klass,
                                  emergency=True)
        since = step - self._last_save_step
        if alarm_started:
            reason = f"alarm: health {health:.2f} >= {self._alarm_signal:g}"
        elif triggered and since >= self._refractory_fraction * self._base:
            reason = f"trigger: score {score:.2f} >= {threshold:g}"
        else:
            if since < interval:
                return self._decision(step, None, interval, score, clean, "not due", klass)
            reason = f"interval: {since} steps since last save (interval {interval})"
        organ_due = self._saves_since_organ + 1 >= self.policy.organ_every
        level = Level.ORGAN if organ_due else Level.PULSE
        self._record_save(step, level)
        return self._decision(step, level, interval, score, clean, reason, klass)

    def _decision(
        self,
        step: int,
        level: Level | None,
        interval: int,
        score: float,
        signals: dict[str, float],
        reason: str,
        klass: RetentionClass,
        *,
        emergency: bool = False,
        non_finite: bool = False,
    ) -> CheckpointDecision:
        """A save when ``level`` is set; emergency saves are critical, others ``klass``.

        Built without the frozen dataclass's ``__init__``, which sets each of its 12 fields
        through ``object.__setattr__`` and was a third of the scheduler's per-step cost
        (bench/RESULTS.md, scheduler.py): one ``__dict__`` update holding every
        field (``tests/test_scheduler.py`` checks that none is missing) gives an equal, still
        frozen object at a fraction of the cost.
        """
        decision = _NEW(CheckpointDecision)
        decision.__dict__.update(
            step=step,
            save=level is not None,
            level=level,
            interval=interval,
            score=score,
            signals=signals,
            retention_class=RetentionClass.CRITICAL if emergency else klass,
            reason=reason,
            emergency=emergency,
            non_finite=non_finite,
            spike_onset=None,
            rollback_to=None,
        )
        return decision

    def _interval_for(self, score: float) -> int:
        # Comparisons rather than min()/max(): this runs at every step a signal is raised.
        reduced = self._base * (1.0 - (score if score < MAX_SCORE_REDUCTION
                                       else MAX_SCORE_REDUCTION))
        # Half-up rounding; Python's round() would round 62.5 to 62 but 63.5 to 64.
        interval = math.floor(reduced + 0.5)
        low, high = self._min_interval, self._max_interval
        return low if interval < low else high if interval > high else interval

    def _record_save(self, step: int, level: Level) -> None:
        self._last_save_step = step
        self._saves_since_organ = 0 if level is Level.ORGAN else self._saves_since_organ + 1

    def _non_finite_reason(self, step: int) -> str:
        note = self._non_finite_note
        if note is not None and note[0] == step:
            return f"non-finite {note[1]} at step {step}"
        return f"non-finite loss or grad norm on another rank at step {step}"

