"""The Young/Daly checkpoint-interval bounds: how long to run between saves (SPEC §4).

This module owns :func:`young_interval` and :func:`daly_interval`, the optimal time between
checkpoints given the cost of one checkpoint δ and the mean time between failures M. The
scheduler turns the bound into steps; the failure ledger (``storage/ledger.py``) supplies M.

Pure: no I/O, no clock, no state. Both inputs share one time unit and the result is in it.
"""

from __future__ import annotations

import math

__all__ = ["daly_interval", "young_interval"]


def _check_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def young_interval(delta: float, mtbf: float) -> float:
    """Young's first-order optimum sqrt(2·δ·M): time between checkpoints minimising waste.

    ``delta`` (checkpoint cost) and ``mtbf`` share one time unit; the result is in that unit.
    Accurate when δ ≪ M; :func:`daly_interval` is the better estimate otherwise.
    """
    _check_positive("delta", delta)
    _check_positive("mtbf", mtbf)
    return math.sqrt(2.0 * delta * mtbf)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly's higher-order optimum, in the unit of ``delta`` and ``mtbf``.

    τ = sqrt(2δM)·[1 + ⅓·sqrt(δ/2M) + (1/9)·(δ/2M)] − δ for δ < 2M; once a checkpoint costs
    twice the MTBF or more, the expansion no longer holds and τ = M.
    """
    _check_positive("delta", delta)
    _check_positive("mtbf", mtbf)
    if delta >= 2.0 * mtbf:
        return mtbf
    ratio = delta / (2.0 * mtbf)
    return math.sqrt(2.0 * delta * mtbf) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - delta
