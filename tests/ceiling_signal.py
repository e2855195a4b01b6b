"""A scheduler signal that lives outside ckptpilot, added to a run by its policy alone.

Used by ``tests/test_signal_registry.py`` and ``tests/signaljob.py`` to show that a new signal
is one module plus one ``scheduler.extra_signals`` entry: nothing in ``ckptpilot`` names it.
:class:`LossCeiling` reads ``value`` at a step whose loss reaches ``ceiling``, else 0; the
subclasses differ only in the class attributes the scheduler and the agreement read.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ckptpilot.scheduler import SystemHealth


class LossCeiling:
    """Raised while the loss is at or above a fixed ceiling; the ranks take the max."""

    combine = "max"
    shortens_interval = True
    marks_damage = False

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

        ceiling: float = Field(gt=0)
        value: float = Field(1.0, ge=0, le=1)

    def __init__(self, params: Params) -> None:
        self._ceiling = params.ceiling
        self._value = params.value
        self.measured_steps: list[int] = []
        self.restarts: list[int] = []

    def measure(self, step: int, loss: float | None, grad_norm: float | None,
                system: SystemHealth | None) -> float:
        self.measured_steps.append(step)
        # A NaN loss compares False: no reading, as the protocol asks.
        return self._value if loss is not None and loss >= self._ceiling else 0.0

    def restart(self, step: int) -> None:
        self.restarts.append(step)


class LossCeilingVote(LossCeiling):
    """The same reading, summed over ranks: each rank's value is its vote."""

    combine = "sum"


class LossCeilingDamage(LossCeiling):
    """The same reading, marking a possibly damaged state instead of shortening the interval."""

    shortens_interval = False
    marks_damage = True


class NoParams:
    """A signal without a ``Params`` model: it takes no params."""

    combine = "max"
    shortens_interval = False
    marks_damage = False

    def measure(self, step: int, loss: float | None, grad_norm: float | None,
                system: SystemHealth | None) -> float:
        return 0.0

    def restart(self, step: int) -> None:
        pass


class SummedBadly(NoParams):
    """Not a signal: ``combine`` is neither 'max' nor 'sum'."""

    combine = "mean"
