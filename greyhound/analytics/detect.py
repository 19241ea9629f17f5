"""The tracking pipeline in one call: iteration times in, change points and slow
intervals out, as ``greyhound detect`` and the node agent run it.

Method "bocd+v" runs the compiled BOCD+V kernel (:class:`~greyhound.analytics.verify.BocdV`):
a change point is reported only for a sustained new regime (the new level held for 4
iterations, it is new, and the old level rested on at least 4; see
:mod:`~greyhound.analytics.verify`), and slow intervals take their healthy reference
from a level the job held, never from its first iteration(s) (see
:func:`~greyhound.analytics.intervals.slow_intervals`). The node agent keeps one
:class:`~greyhound.analytics.tracker.RankTracker` per rank, which feeds a ``BocdV``
each poll's new iterations and reports what this function reports on the whole
series."""

from __future__ import annotations

import dataclasses

import numpy as np

from greyhound.analytics.baselines import bocd_changepoints, window_changepoints
from greyhound.analytics.bocd import BocdConfig
from greyhound.analytics.changepoint import ChangePoint
from greyhound.analytics.intervals import SlowInterval, healthy_level, slow_intervals
from greyhound.analytics.verify import VerifyConfig, bocdv_changepoints, check_series

__all__ = ["METHODS", "Detection", "detect_series"]

METHODS = ("bocd+v", "bocd", "window")
"""Detection methods: BOCD+V (GREYHOUND), and the paper's two baselines."""

# Plain BOCD has no 10% test: every flagged change to a slower level is a fail-slow
# suspect, which is what makes it the baseline with many false positives.
_ANY_SLOWDOWN = 1.0 + 1e-9


@dataclasses.dataclass(frozen=True, kw_only=True)
class Detection:
    """The outcome of detection on one rank's iteration times."""

    method: str
    iterations: int
    baseline_iteration_time: float
    """Median iteration time outside the slow intervals (seconds)."""
    changepoints: tuple[ChangePoint, ...]
    slow_intervals: tuple[SlowInterval, ...]

    @property
    def fail_slow(self) -> bool:
        return bool(self.slow_intervals)


def detect_series(
    x: np.ndarray,
    *,
    method: str = "bocd+v",
    bocd: BocdConfig | None = None,
    verify: VerifyConfig | None = None,
    window: int = 20,
) -> Detection:
    """Detect fail-slows in one series of iteration times.

    Args:
        x: (n,) iteration times in seconds, finite and > 0, n >= 1.
        method: one of :data:`METHODS`.
        bocd: BOCD parameters (methods "bocd+v" and "bocd").
        verify: verification parameters (method "bocd+v"); its ``min_change`` is also
            the slowdown that makes an interval slow.
        window: window of the "window" baseline.

    Returns:
        A :class:`Detection`.
    """
    x = check_series(x)
    if len(x) == 0:
        raise ValueError("iteration times must not be empty")
    verify = verify or VerifyConfig()
    if method == "bocd+v":
        cps = bocdv_changepoints(x, bocd=bocd, verify=verify)
        min_slowdown = 1.0 + verify.min_change
    elif method == "bocd":
        cps = bocd_changepoints(x, bocd=bocd)
        min_slowdown = _ANY_SLOWDOWN
    elif method == "window":
        cps = window_changepoints(x, window=window, band=verify.min_change)
        min_slowdown = 1.0 + verify.min_change
    else:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    intervals = slow_intervals(x, cps, min_slowdown=min_slowdown)
    return Detection(
        method=method,
        iterations=len(x),
        baseline_iteration_time=healthy_level(x, intervals),
        changepoints=tuple(cps),
        slow_intervals=tuple(intervals),
    )
