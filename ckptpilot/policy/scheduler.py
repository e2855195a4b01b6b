"""The ``scheduler`` section of the policy (SPEC §4): the signals, their weights and the
intervals; the checks that need two of its keys (weights summing to 1, intervals in order).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ImportString, ValidationError, model_validator
from typing_extensions import Self

from ckptpilot.policy.values import (
    MAX_COUNT,
    MAX_EXTRA_SIGNALS,
    MAX_RATIO,
    MAX_SECONDS,
    MAX_SIGNAL_SPAN,
    MAX_STEPS,
    KeyedError,
    Seconds,
    Section,
    brief,
    check_factory_text,
    check_nvml,
)

_SIGNAL_NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")
_BUILT_IN_SIGNALS = ("loss", "grad", "system", "hard_errors", "non_finite")
"""Keys of the scheduler's own signals and channels, which an extra signal cannot take."""


class SchedulerWeights(Section):
    """Weights of the built-in signals in the health score; each non-negative.

    With ``scheduler.extra_signals``' weights they sum to 1: the scheduler section checks the
    sum, since only it sees both."""

    loss: float = 0.4
    grad: float = 0.35
    system: float = 0.25

    @model_validator(mode="after")
    def _check_non_negative(self) -> Self:
        weights = {"loss": self.loss, "grad": self.grad, "system": self.system}
        negative = [name for name, weight in weights.items() if weight < 0]
        if negative:
            raise KeyedError("", f"weights must not be negative ({', '.join(negative)})")
        return self


class ExtraSignalPolicy(Section):
    """A signal beyond loss, grad and system (``scheduler.extra_signals.<name>``).

    ``factory``: the class that measures it, as ``"package.module:ClassName"``; it implements
    ``ckptpilot.scheduler.signal.Signal``. The module is imported when the policy loads, as an
    ``import`` statement would, so name only modules you trust. ``weight``: its weight in the
    score (the weights of all signals sum to 1). ``params``: checked against the class's
    pydantic model ``Params`` when the policy loads and handed to the class; a class without
    ``Params`` takes none.
    """

    factory: Annotated[ImportString[Any], BeforeValidator(check_factory_text)]
    weight: float = Field(ge=0, le=1)
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_params(self) -> Self:
        model = getattr(self.factory, "Params", None)
        if model is None:
            if self.params:
                raise KeyedError("params", f"{brief(self.factory)} takes no params (it has "
                                  "no Params model); remove them")
            return self
        try:
            model.model_validate(self.params)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise KeyedError(f"params.{where}" if where else "params", error["msg"]) from None
        return self


class LossSignalPolicy(Section):
    """Loss-change signal: robust z-score of the short-window log10-loss slope (SPEC §4.1).

    Spans are those of exponentially weighted moving averages (weight 2 / (span + 1), the
    center of mass of a plain mean of ``span`` values). ``level_span_steps``: the level the
    new loss is compared with (the slope's window); ``center_span_steps``: the slope's own
    center; ``spread_span_steps``: the spread of its step-to-step changes, the noise that
    judges the new slope. A jump grows linearly from 0 at |z| = ``z_low`` to 1 at ``z_high``;
    drift is a two-sided CUSUM of z minus ``drift_allowance`` per step, graded from 0 at
    ``drift_low`` to 1 at ``drift_high``; a slope within ``slope_threshold`` decades per step
    of its center never counts (a relative change: it keeps a flat loss quiet).
    """

    level_span_steps: int = Field(14, ge=2, le=MAX_SIGNAL_SPAN)
    center_span_steps: int = Field(24, ge=2, le=MAX_SIGNAL_SPAN)
    spread_span_steps: int = Field(32, ge=4, le=MAX_SIGNAL_SPAN)
    z_low: float = Field(5.0, ge=0, le=MAX_RATIO)
    z_high: float = Field(10.0, gt=0, le=MAX_RATIO)
    drift_allowance: float = Field(1.5, ge=0, le=MAX_RATIO)
    drift_low: float = Field(5.0, ge=0, le=MAX_RATIO)
    drift_high: float = Field(10.0, gt=0, le=MAX_RATIO)
    slope_threshold: float = Field(0.001, ge=0, le=MAX_RATIO)

    @model_validator(mode="after")
    def _check_band(self) -> Self:
        _check_band("z_low", self.z_low, "z_high", self.z_high)
        _check_band("drift_low", self.drift_low, "drift_high", self.drift_high)
        _check_allowance("drift_allowance", self.drift_allowance, self.z_high)
        return self


class GradSignalPolicy(Section):
    """Gradient-activity signal: robust deviation and growth of log grad norm (SPEC §4.2).

    Probes every ``probe_every`` steps; ``span_probes`` is the span of the EWMAs of log10 grad
    norm and of its absolute deviation (its center and spread); deviation grows from 0 at
    z = ``z_low`` to 1 at ``z_high``; growth is a CUSUM of z minus ``growth_allowance`` per
    probe, graded from 0 at ``growth_low`` to 1 at ``growth_high``; a norm within
    ``deadband_decades`` of its center never counts.
    """

    probe_every: int = Field(10, ge=1, le=MAX_STEPS)
    span_probes: int = Field(32, ge=4, le=MAX_SIGNAL_SPAN)
    z_low: float = Field(5.0, ge=0, le=MAX_RATIO)
    z_high: float = Field(10.0, gt=0, le=MAX_RATIO)
    growth_allowance: float = Field(1.5, ge=0, le=MAX_RATIO)
    growth_low: float = Field(5.0, ge=0, le=MAX_RATIO)
    growth_high: float = Field(10.0, gt=0, le=MAX_RATIO)
    deadband_decades: float = Field(0.02, ge=0, le=10)

    @model_validator(mode="after")
    def _check_band(self) -> Self:
        _check_band("z_low", self.z_low, "z_high", self.z_high)
        _check_band("growth_low", self.growth_low, "growth_high", self.growth_high)
        _check_allowance("growth_allowance", self.growth_allowance, self.z_high)
        return self


def _check_allowance(key: str, allowance: float, z_high: float) -> None:
    if allowance >= z_high:
        raise KeyedError(
            key,
            f"{key} ({allowance:g}) must be below z_high ({z_high:g}): a step adds at most "
            f"z_high − {key} to its CUSUM, so the detector could never fire",
        )


def _check_band(low_key: str, low: float, high_key: str, high: float) -> None:
    if low >= high:
        raise KeyedError(
            high_key,
            f"{high_key} ({high:g}) must be above {low_key} ({low:g}): the signal grows from "
            f"0 at {low_key} to 1 at {high_key}; raise {high_key}",
        )


class SystemSignalPolicy(Section):
    """System-health signal: NVML errors and IO latency (SPEC §4.3), and the hazard window.

    ``nvml``: ``auto`` uses NVML when a GPU and the library are present, ``true`` requires it,
    ``false`` never loads it. ``hazard_window_steps``: after a precursor (any signal at 0.5 or
    more, or a non-finite loss or grad norm) the system signal is at least a hazard that falls
    from 1 to 0 over this many steps; 0 turns it off. ``alarm_signal``: a health part of the
    system signal (what the training signals' own hazard does not explain) at or above it is
    an alarm: a save at once when it starts, and ``min_interval`` while it lasts.
    """

    nvml: Annotated[Literal["auto", True, False], BeforeValidator(check_nvml)] = "auto"
    io_latency_ms: float = Field(15, gt=0, le=MAX_SECONDS * 1000)
    sustained_seconds: Seconds = 5
    hazard_window_steps: int = Field(100, ge=0, le=MAX_STEPS)
    alarm_signal: float = Field(1.0, gt=0, le=1)


class SchedulerPolicy(Section):
    """Adaptive checkpoint scheduler (SPEC §4); intervals are in optimizer steps.

    ``trigger_refractory_fraction``: a score reaching ``trigger_threshold`` saves at once only
    when at least this fraction of the base interval has passed since the last save (0: at
    any time), so a long unusual phase does not cluster saves.
    """

    base_interval: int = Field(100, ge=1, le=MAX_STEPS)
    min_interval: int = Field(10, ge=1, le=MAX_STEPS)
    max_interval: int = Field(500, ge=1, le=MAX_STEPS)
    trigger_threshold: float = Field(0.7, ge=0, le=1)
    trigger_refractory_fraction: float = Field(0.5, ge=0, le=1)
    weights: SchedulerWeights = Field(default_factory=SchedulerWeights)
    loss: LossSignalPolicy = Field(default_factory=LossSignalPolicy)
    grad: GradSignalPolicy = Field(default_factory=GradSignalPolicy)
    system: SystemSignalPolicy = Field(default_factory=SystemSignalPolicy)
    # Left out of dumps while empty: a policy without extra signals dumps as before, and
    # the reference file, which lists every key, needs no entry for an empty mapping.
    extra_signals: dict[str, ExtraSignalPolicy] = Field(
        default_factory=dict, max_length=MAX_EXTRA_SIGNALS, exclude_if=lambda value: not value)
    organ_every: int = Field(10, ge=1, le=MAX_COUNT)
    young_daly: bool = True

    def __hash__(self) -> int:
        # By value like every section, but ``extra_signals`` is a dict: its names stand for
        # it (equal policies have equal names, which is all a hash needs).
        return hash(tuple(tuple(v) if isinstance(v, dict) else v for v in self.__dict__.values()))

    @model_validator(mode="after")
    def _check_signals(self) -> Self:
        for name in self.extra_signals:
            if name in _BUILT_IN_SIGNALS or not _SIGNAL_NAME_RE.fullmatch(name):
                raise KeyedError(
                    f"extra_signals.{name}",
                    f"{brief(name)} cannot name a signal: use lowercase letters, digits and "
                    f"'_' (at most 64, starting with a letter), other than "
                    f"{', '.join(_BUILT_IN_SIGNALS)}")
        weights = {"loss": self.weights.loss, "grad": self.weights.grad,
                   "system": self.weights.system}
        weights.update({f"extra_signals.{name}.weight": entry.weight
                        for name, entry in self.extra_signals.items()})
        total = sum(weights.values())
        if abs(total - 1.0) > 1e-6:
            names = " + ".join(weights)
            terms = " + ".join(f"{weight:g}" for weight in weights.values())
            raise KeyedError(
                "weights",
                f"{names} must sum to 1, got {terms} = {total:g} "
                "(a weight left out keeps its default); rescale them",
            )
        return self

    @model_validator(mode="after")
    def _check_intervals(self) -> Self:
        if self.min_interval > self.max_interval:
            raise KeyedError(
                "min_interval",
                f"min_interval ({self.min_interval}) is above max_interval "
                f"({self.max_interval}); swap them",
            )
        if not self.min_interval <= self.base_interval <= self.max_interval:
            raise KeyedError(
                "base_interval",
                f"base_interval ({self.base_interval}) must lie within "
                f"[min_interval, max_interval] = [{self.min_interval}, {self.max_interval}]",
            )
        return self
