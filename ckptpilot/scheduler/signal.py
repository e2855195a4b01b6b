"""What a scheduler signal is, and the registry that builds a run's signals from its policy.

This module owns the :class:`Signal` protocol, :func:`build_signals` and :class:`SignalLayout`.
A signal turns the scheduler's per-step inputs into a graded value in [0, 1] that the score
weighs; the built-in ones are the loss change and the gradient activity (``signals.py``). A
new signal is one new module holding a class that satisfies :class:`Signal`, plus one entry
under ``scheduler.extra_signals`` in the policy naming it, with its weight and its parameters::

    scheduler:
      weights: {loss: 0.4, grad: 0.3, system: 0.2}
      extra_signals:
        lr_warmup: {factory: "mypackage.lr_warmup:LrWarmup", weight: 0.1, params: {steps: 500}}

The scheduler, the cross-rank agreement and the decision log then carry it under its policy
key without another edit: the scheduler reads every signal through this protocol, and the
agreement reduces whatever :class:`SignalLayout` the scheduler hands it.

What stays the scheduler's own and is no signal: the ``system`` channel (the health reading
and the hazard that precursors leave), the hard-error count that triggers an emergency save
and the non-finite flag. Their rules (alarm, emergency, no save of a non-finite step) tie
them to the save bookkeeping, not to a weight in the score.

It must not do I/O or read a clock, and it imports no signal module of its own accord: a
policy names the module, and loading the policy imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from pydantic import ValidationError

from ckptpilot.errors import PolicyError
from ckptpilot.policy import ExtraSignalPolicy, SchedulerPolicy
from ckptpilot.scheduler.decision import SystemHealth
from ckptpilot.scheduler.signals import GradActivity, LossChange

__all__ = [
    "SCHEDULER_KEYS",
    "Combine",
    "Signal",
    "SignalLayout",
    "WeightedSignal",
    "build_signals",
    "layout_of",
]

Combine = Literal["max", "sum"]
"""How the ranks of a distributed run combine one signal: the largest value, or the total."""

SCHEDULER_KEYS = ("system", "hard_errors", "non_finite")
"""The scheduler's own channels, after the signals in a measurement; the ranks take the max."""


class Signal(Protocol):
    """One graded input of the score, fed once per step on the training thread.

    Lifecycle, all on the training thread:

    1. built once per scheduler by :func:`build_signals`: ``factory(params)`` with the
       entry's ``params`` validated by the factory's pydantic model ``Params``, or
       ``factory()`` when it declares none;
    2. per step boundary, :meth:`measure` exactly once, with steps increasing, except that
       after :meth:`restart` they start again from the restored step;
    3. :meth:`restart` when the run is restored to an earlier step.

    The value :meth:`measure` returns should lie in [0, 1]; the scheduler clamps the value
    it decides from (after the ranks combined theirs) and reads NaN as 0. At or above 0.5 it
    is a precursor: it raises the hazard of the ``system`` channel for
    ``system.hazard_window_steps`` steps, as a loss or grad signal that high does. Same
    inputs in the same order must give the same values, on every rank that sees them: the
    decisions are replayable and ranks agree on them.

    Three class attributes say how the scheduler uses the value:

    * ``combine``: ``"max"`` or ``"sum"``, how the ranks combine their values each step;
    * ``shortens_interval``: whether the weighted value shortens the interval, as the grad
      signal does (a sign that a crash may come), or only raises the score, as the loss
      signal does (a change of the training that warns of no crash);
    * ``marks_damage``: whether a value at or above 0.5 means the state saved now may already
      be damaged, so that such a save is kept as at most important, never critical.
    """

    combine: ClassVar[Combine]
    shortens_interval: ClassVar[bool]
    marks_damage: ClassVar[bool]

    def measure(self, step: int, loss: float | None, grad_norm: float | None,
                system: SystemHealth | None) -> float:
        """This rank's value at ``step`` from the scheduler's inputs of that step.

        ``loss`` is ``None`` when the loop reported none; ``grad_norm`` only on the steps the
        gradient norm was probed; ``system`` is the health reading, if any. ``loss`` and
        ``grad_norm`` may be NaN or infinite: the scheduler then marks the step non-finite
        and saves nothing of it, and a signal must keep such a value out of its estimates.
        """
        ...

    def restart(self, step: int) -> None:
        """The run was restored to ``step``: the next :meth:`measure` is for a later step."""
        ...


@dataclass(frozen=True)
class WeightedSignal:
    """A signal under its policy key, with its weight in the score."""

    name: str
    weight: float
    signal: Signal


@dataclass(frozen=True)
class SignalLayout:
    """The keys of a scheduler's measurement, grouped by how the ranks combine them.

    Every rank of a run builds the same layout from the same policy, so the agreement can
    send values by position. ``maxed`` includes :data:`SCHEDULER_KEYS`.
    """

    maxed: tuple[str, ...]
    summed: tuple[str, ...]


def build_signals(policy: SchedulerPolicy) -> tuple[WeightedSignal, ...]:
    """The run's signals in score order: loss, grad, then ``scheduler.extra_signals`` as listed.

    Raises :class:`PolicyError` naming the entry's key when its factory does not build a
    :class:`Signal` (a policy validated by ``load_policy`` has already had its parameters
    checked; one built in code may not have).
    """
    weights = policy.weights
    built = [WeightedSignal("loss", weights.loss, LossChange(policy.loss)),
             WeightedSignal("grad", weights.grad, GradActivity(policy.grad))]
    for name, entry in policy.extra_signals.items():
        built.append(WeightedSignal(name, entry.weight, _construct(name, entry)))
    return tuple(built)


def layout_of(signals: tuple[WeightedSignal, ...]) -> SignalLayout:
    """The layout of a measurement by a scheduler holding ``signals``."""
    summed = tuple(s.name for s in signals if s.signal.combine == "sum")
    maxed = tuple(s.name for s in signals if s.signal.combine != "sum")
    return SignalLayout(maxed=maxed + SCHEDULER_KEYS, summed=summed)


def _construct(name: str, entry: ExtraSignalPolicy) -> Signal:
    key = f"scheduler.extra_signals.{name}"
    factory: Any = entry.factory
    params_model = getattr(factory, "Params", None)
    try:
        signal = factory() if params_model is None else factory(
            params_model.model_validate(entry.params))
    except ValidationError as exc:
        raise PolicyError(f"{key}.params", f"{_path(factory)}: {exc}") from exc
    problem = _protocol_problem(signal)
    if problem is not None:
        raise PolicyError(f"{key}.factory", f"{_path(factory)} built {type(signal).__name__}, "
                          f"which is no scheduler Signal: {problem} (see "
                          "ckptpilot.scheduler.signal.Signal)")
    return signal


def _protocol_problem(signal: object) -> str | None:
    for method in ("measure", "restart"):
        if not callable(getattr(signal, method, None)):
            return f"it has no method {method}()"
    combine = getattr(signal, "combine", None)
    if not (isinstance(combine, str) and combine in ("max", "sum")):
        return f"its combine is {combine!r}, not 'max' or 'sum'"
    for flag in ("shortens_interval", "marks_damage"):
        if not isinstance(getattr(signal, flag, None), bool):
            return f"its {flag} is {getattr(signal, flag, None)!r}, not True or False"
    return None


def _path(factory: object) -> str:
    return f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', factory)}"
