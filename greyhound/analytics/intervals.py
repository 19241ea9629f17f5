"""Slow intervals: onset, recovery and severity, from a series and its change points."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from greyhound.analytics.changepoint import ChangePoint
from greyhound.analytics.verify import check_series

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
) -> list[SlowInterval]:
    """Split the series at the change points and mark the regimes slower than healthy.

    The first regime is healthy (there is nothing to compare it with). A later regime
    opens a slow interval if its median is ``min_slowdown`` times the healthy level; the
    interval goes on while regimes stay half that far above healthy (hysteresis, so a
    level hovering at the threshold does not flap). A regime that is not slow and lasts
    ``min_healthy_iterations`` becomes the new healthy level, so benign shifts (a new
    data mix, a longer sequence length) move the reference with them; a short one (the
    first step of a ramp) does not.

    Args:
        x: (n,) iteration times, finite and > 0.
        changepoints: change points with 0 < index < n, in increasing index order.
        min_slowdown: slowdown that counts as slow, > 1 (for "any slowdown" use a
            value just above 1).
        min_healthy_iterations: regimes shorter than this never become the reference.

    Returns:
        Slow intervals in order.
    """
    x = check_series(x)
    if not min_slowdown > 1:
        raise ValueError(f"min_slowdown must be > 1, got {min_slowdown!r}")
    hold = 1.0 + 0.5 * (min_slowdown - 1.0)
    n = len(x)
    bounds = [0] + [cp.index for cp in changepoints] + [n]
    if any(not a < b for a, b in zip(bounds, bounds[1:])):
        raise ValueError("change point indices must increase strictly within (0, n)")
    out: list[SlowInterval] = []
    healthy = float(np.median(x[bounds[0] : bounds[1]])) if n else 1.0
    onset: int | None = None
    onset_healthy = healthy
    for lo, hi in zip(bounds[1:-1], bounds[2:]):
        slowdown = float(np.median(x[lo:hi])) / healthy
        if slowdown >= (hold if onset is not None else min_slowdown):
            if onset is None:
                onset, onset_healthy = lo, healthy
            continue
        if onset is not None:
            out.append(_interval(x, onset, lo, onset_healthy))
            onset = None
        if hi - lo >= min_healthy_iterations:
            healthy *= slowdown
    if onset is not None:
        out.append(_interval(x, onset, None, onset_healthy))
    return out


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
