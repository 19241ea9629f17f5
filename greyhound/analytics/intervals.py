"""Slow intervals: onset, recovery and severity, from a series and its change points.

The series is split at the change points into regimes; a regime's level is the median
of its first ``level_window`` iterations (all of them if it is shorter). That is what
the detector saw when the regime was young, and it is bounded: the node agent's
tracker recomputes it every poll without keeping a regime's whole history in view.

The healthy reference:

- Warm-up: the first regime that lasts ``min_reference`` iterations is the first
  reference; regimes before it (a partial first iteration, compilation and cache
  warm-up, a job that starts while a fail-slow is ending) are neither slow nor
  healthy. A reference must rest on a level the job held, not on its first
  iteration(s). (A fail-slow that starts within the first ``min_reference``
  iterations and lasts becomes the reference: there is nothing to compare it with.)
- Later, a regime that is not slow and lasts ``min_healthy_iterations`` becomes the
  reference when it ends, so benign shifts (a new data mix, a longer sequence length)
  move it with them; a short one (the first step of a ramp) does not.
- The reference's value is the median of the last ``level_window`` iterations of its
  regime, right before the regime ended: a level that drifted by a few percent over a
  long regime is compared where it stood, not where it started.

A regime opens a slow interval if its level is ``min_slowdown`` times the reference,
or half that if its change point was itself accepted as ``min_slowdown`` slower than
the level right before it (its onset was judged on the level right before it, which a
drift may have moved off the reference); the interval goes on while regimes stay half
that far above it (hysteresis, so a level hovering at the threshold does not flap),
except a regime that began with a drop accepted as ``min_slowdown`` faster: that is a
real change, not a hover, and it keeps the interval open only if it is itself
``min_slowdown`` above the reference.
The interval's slowdown is its median iteration time over the reference at its onset.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from greyhound.analytics.changepoint import ChangePoint, check_series

__all__ = ["SlowInterval", "slow_intervals", "healthy_level"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlowInterval:
    """Consecutive iterations slower than the healthy level."""

    start_index: int
    """Onset: first slow iteration."""
    end_index: int | None
    """Recovery: first healthy iteration again; None while still slow at the end."""
    slowdown: float
    """Severity: median iteration time in the interval / the healthy level before it."""

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "start_index": self.start_index, "end_index": self.end_index,
            "slowdown": self.slowdown,
        }


def slow_intervals(
    x: np.ndarray,
    changepoints: Sequence[ChangePoint],
    *,
    min_slowdown: float = 1.10,
    min_healthy_iterations: int = 50,
    min_reference: int = 20,
    level_window: int = 50,
) -> list[SlowInterval]:
    """Split the series at the change points and mark the regimes slower than healthy
    (the rules: module docstring).

    Args:
        x: (n,) iteration times, finite and > 0.
        changepoints: change points with 0 < index < n, in increasing index order.
        min_slowdown: slowdown that counts as slow, > 1 (for "any slowdown" use a
            value just above 1).
        min_healthy_iterations: regimes shorter than this never move the reference.
        min_reference: iterations the first reference regime needs (warm-up before).
        level_window: iterations a regime's level and the reference are taken over.

    Returns:
        Slow intervals in order.
    """
    x = check_series(x)
    if not min_slowdown > 1:
        raise ValueError(f"min_slowdown must be > 1, got {min_slowdown!r}")
    for name, value in (("min_healthy_iterations", min_healthy_iterations),
                        ("min_reference", min_reference), ("level_window", level_window)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value!r}")
    hold = 1.0 + 0.5 * (min_slowdown - 1.0)
    out: list[SlowInterval] = []
    healthy: float | None = None
    onset: int | None = None
    onset_healthy = 1.0
    for lo, hi, ratio in _regimes(changepoints, len(x)):
        if healthy is None:
            # Warm-up until a regime lasts min_reference iterations; that one is the
            # first reference, and is itself healthy.
            if hi - lo >= min_reference:
                healthy = _last_level(x, lo, hi, level_window)
            continue
        slowdown = float(np.median(x[lo : min(hi, lo + level_window)])) / healthy
        # A regime whose change point was itself accepted as min_slowdown slower
        # opens at the hold level; an open interval goes on at it, unless the regime
        # began with a drop accepted as min_slowdown faster: then it must itself be
        # min_slowdown slow (a job back from a 2.6x fail-slow at 1.051x its reference,
        # noise, stayed "slow" to its end at the hold level).
        if onset is None:
            opens = hold if ratio >= min_slowdown else min_slowdown
        else:
            opens = min_slowdown if ratio * min_slowdown <= 1.0 else hold
        if slowdown >= opens:
            if onset is None:
                onset, onset_healthy = lo, healthy
            back = _faded(x, lo, hi, healthy * hold, level_window)
            if back is None:
                continue
            # A slowdown that faded without a change point (a drift that eased off
            # over dozens of iterations): the interval ends where it was gone, and the
            # rest of the regime is healthy.
            out.append(_interval(x, onset, back, onset_healthy))
            onset, lo = None, back
        if onset is not None:
            out.append(_interval(x, onset, lo, onset_healthy))
            onset = None
        if hi - lo >= min_healthy_iterations:
            healthy = _last_level(x, lo, hi, level_window)
    if onset is not None:
        out.append(_interval(x, onset, None, onset_healthy))
    return out


def _regimes(changepoints: Sequence[ChangePoint], n: int) -> list[tuple[int, int, float]]:
    """(start, end, ratio of the change point that opened it; 0 for the first) of each
    regime of a series of n iterations."""
    bounds = [0] + [cp.index for cp in changepoints] + [n]
    if any(not a < b for a, b in zip(bounds, bounds[1:])):
        raise ValueError("change point indices must increase strictly within (0, n)")
    ratios = [0.0] + [cp.ratio for cp in changepoints]
    return list(zip(bounds[:-1], bounds[1:], ratios))


def _faded(x: np.ndarray, lo: int, hi: int, level: float, level_window: int) -> int | None:
    """The first iteration of a slow regime [lo, hi) from which a whole window of
    ``level_window`` iterations has its median below ``level`` (windows half a window
    apart, the first half a window in); None if none has.
    BOCD accepts a change that comes as a step; a slowdown that fades over tens of
    iterations brings none, and the regime's level (its first window) kept a healthy
    job "slow" at 1.009x for 700 iterations on the local cluster after a VM drift."""
    stride = max(1, level_window // 2)
    starts = np.arange(lo + stride, hi - level_window + 1, stride)
    if not len(starts):
        return None
    windows = np.lib.stride_tricks.sliding_window_view(x[lo:hi], level_window)[starts - lo]
    below = np.flatnonzero(np.median(windows, axis=1) < level)
    return int(starts[below[0]]) if len(below) else None


def _last_level(x: np.ndarray, lo: int, hi: int, level_window: int) -> float:
    """Median of the last ``level_window`` iterations of the regime [lo, hi)."""
    return float(np.median(x[max(lo, hi - level_window) : hi]))


def healthy_level(x: np.ndarray, intervals: Sequence[SlowInterval]) -> float:
    """Median iteration time outside the slow intervals."""
    x = check_series(x)
    mask = np.ones(len(x), dtype=bool)
    for interval in intervals:
        mask[interval.start_index : interval.end_index] = False
    return float(np.median(x[mask])) if mask.any() else float("nan")


def _interval(x: np.ndarray, start: int, end: int | None, healthy: float) -> SlowInterval:
    return SlowInterval(
        start_index=start, end_index=end, slowdown=float(np.median(x[start:end])) / healthy
    )
