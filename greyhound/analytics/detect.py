"""The tracking pipeline in one call: iteration times in, change points and slow
intervals out, as ``greyhound detect`` and the node agent run it.

Every method is a :class:`~greyhound.analytics.changepoint.Detector` (see
:data:`METHODS`). Method "bocd+v" runs BOCD+V (:data:`~greyhound.analytics.verify.BocdV`,
the compiled kernel where it is built): a change point is reported only for a
sustained new regime (the new level held for 4 iterations, it is new, and the old
level rested on at least 4; see
:mod:`~greyhound.analytics.verify`), and slow intervals take their healthy reference
from a level the job held, never from its first iteration(s) (see
:func:`~greyhound.analytics.intervals.slow_intervals`). The node agent keeps one
:class:`~greyhound.analytics.tracker.RankTracker` per rank, which feeds a ``BocdV``
each poll's new iterations and reports what this function reports on the whole
series."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from greyhound.analytics.baselines import PlainBocd, WindowDetector
from greyhound.analytics.bocd import BocdConfig
from greyhound.analytics.changepoint import ChangePoint, Detector, check_series
from greyhound.analytics.intervals import SlowInterval, healthy_level, slow_intervals
from greyhound.analytics.verify import BocdV, VerifyConfig

__all__ = ["METHODS", "Detection", "detect_series", "make_detector", "slow_spans"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Method:
    """A detection method: its detector, and the slowdown its slow intervals need."""

    detector: Callable[[BocdConfig | None, VerifyConfig, int], Detector]
    min_slowdown: Callable[[VerifyConfig], float]


# Plain BOCD has no 10% test: every flagged change to a slower level is a fail-slow
# suspect, which is what makes it the baseline with many false positives.
_ANY_SLOWDOWN = 1.0 + 1e-9

_METHODS = {
    "bocd+v": _Method(
        detector=lambda bocd, verify, window: BocdV(bocd=bocd, verify=verify),
        min_slowdown=lambda verify: 1.0 + verify.min_change,
    ),
    "bocd": _Method(
        detector=lambda bocd, verify, window: PlainBocd(bocd=bocd),
        min_slowdown=lambda verify: _ANY_SLOWDOWN,
    ),
    "window": _Method(
        detector=lambda bocd, verify, window: WindowDetector(window=window,
                                                             band=verify.min_change),
        min_slowdown=lambda verify: 1.0 + verify.min_change,
    ),
}

METHODS = tuple(_METHODS)
"""Detection methods: BOCD+V (GREYHOUND), and the paper's two baselines."""


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


def _method(method: str) -> _Method:
    if method not in _METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    return _METHODS[method]


def make_detector(
    method: str = "bocd+v",
    *,
    bocd: BocdConfig | None = None,
    verify: VerifyConfig | None = None,
    window: int = 20,
) -> Detector:
    """A fresh online detector of ``method`` (parameters as :func:`detect_series`)."""
    return _method(method).detector(bocd, verify or VerifyConfig(), window)


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
            the slowdown that makes an interval slow ("bocd+v", "window") and the
            window's band.
        window: window of the "window" baseline.

    Returns:
        A :class:`Detection`.
    """
    x = check_series(x)
    if len(x) == 0:
        raise ValueError("iteration times must not be empty")
    verify = verify or VerifyConfig()
    chosen = _method(method)
    cps = chosen.detector(bocd, verify, window).feed(x)
    intervals = slow_intervals(x, cps, min_slowdown=chosen.min_slowdown(verify))
    return Detection(
        method=method,
        iterations=len(x),
        baseline_iteration_time=healthy_level(x, intervals),
        changepoints=tuple(cps),
        slow_intervals=tuple(intervals),
    )


def slow_spans(step_ends: np.ndarray, step_times: np.ndarray) -> list[tuple[float, float | None]]:
    """(start, end) in the clock of ``step_ends`` of each slowdown in a job's own step
    times (the detector run on the steps the job logged, not on the hook's records):
    what the job itself shows, to judge the control plane's detections against. A
    slowdown still open at the last step ends at None. On this project's 2-core VM runs
    without greyhound slowed 1.15-1.25x for 10-30 s; by the paper's definition (a
    sustained change of 10% or more) each is a fail-slow, and a plane that reports one
    is right.

    Args:
        step_ends: (n,) when each step ended (seconds), n >= 1.
        step_times: (n,) each step's duration (seconds, finite and > 0).
    """
    ends, times = np.asarray(step_ends, dtype=np.float64), np.asarray(step_times, dtype=np.float64)
    if ends.shape != times.shape:
        raise ValueError(f"step_ends and step_times differ in shape: {ends.shape} != {times.shape}")
    return [(float(ends[s.start_index] - times[s.start_index]),
             None if s.end_index is None else float(ends[s.end_index]))
            for s in detect_series(times).slow_intervals]
