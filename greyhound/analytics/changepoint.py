"""What every detector is and reports, and the bounded history it reads levels from.

A detector (:class:`Detector`) takes iteration times one at a time (``update``) or in
batches (``feed``) and reports :class:`ChangePoint` s; its state carries over between
calls, so any split of a series into batches reports the same change points. The
methods of ``greyhound detect`` all are detectors: BOCD+V
(:class:`~greyhound.analytics.verify.BocdV`), plain BOCD
(:class:`~greyhound.analytics.baselines.PlainBocd`) and the sliding window
(:class:`~greyhound.analytics.baselines.WindowDetector`).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Protocol

import numpy as np

__all__ = [
    "ChangePoint", "Detector", "PointwiseFeed", "RecentValues", "check_series",
    "check_value", "level_ratio",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChangePoint:
    """A change of the iteration-time level."""

    index: int
    """First iteration of the new regime."""
    detected_at: int
    """Iteration at which the online detector reported it (>= index)."""
    before: float
    """Level (median seconds) of the old regime just before ``index``."""
    after: float
    """Level (median seconds) of the new regime from ``index`` to ``detected_at``."""

    @property
    def ratio(self) -> float:
        """after / before: > 1 slower, < 1 faster."""
        return self.after / self.before

    def as_dict(self) -> dict[str, float | int]:
        return {
            "index": self.index, "detected_at": self.detected_at,
            "before": self.before, "after": self.after, "ratio": self.ratio,
        }


class Detector(Protocol):
    """An online change-point detector on iteration times (seconds, finite and > 0)."""

    def update(self, x: float) -> ChangePoint | None:
        """Add the next iteration time; returns the change point reported now, if any."""
        ...

    def feed(self, xs: np.ndarray) -> list[ChangePoint]:
        """Add the next (n,) iteration times (all checked before any is added); returns
        the change points reported meanwhile, in order of ``detected_at``."""
        ...


class PointwiseFeed(abc.ABC):
    """A :class:`Detector` that works one value at a time: ``feed`` is ``update`` on
    each value."""

    @abc.abstractmethod
    def update(self, x: float) -> ChangePoint | None:
        """Add the next iteration time (see :meth:`Detector.update`)."""

    def feed(self, xs: np.ndarray) -> list[ChangePoint]:
        """Add the next iteration times (see :meth:`Detector.feed`)."""
        return [cp for cp in map(self.update, check_series(xs).tolist()) if cp is not None]


def check_series(x: np.ndarray) -> np.ndarray:
    """Validate an iteration-time series: (n,) finite, > 0. Returns it as float64."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"iteration times must be 1-D, got shape {x.shape}")
    bad = np.flatnonzero(~(np.isfinite(x) & (x > 0)))
    if len(bad):
        raise ValueError(
            f"iteration times must be finite and > 0, got {x[bad[0]]!r} at {bad[0]}"
        )
    return x


def check_value(x: float) -> None:
    """Validate one iteration time: finite and > 0."""
    if not (x > 0 and math.isfinite(x)):
        raise ValueError(f"iteration time must be finite and > 0, got {x!r}")


class RecentValues:
    """The last ``capacity`` values of a stream, addressed by absolute index.

    Every value is stored twice, ``capacity`` apart, so any window is one slice.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._cap = capacity
        self._buf = np.empty(2 * capacity)
        self.count = 0
        """Values appended so far; the next one gets this index."""

    def append(self, value: float) -> None:
        i = self.count % self._cap
        self._buf[i] = self._buf[i + self._cap] = value
        self.count += 1

    def window(self, start: int, stop: int) -> np.ndarray:
        """Values with absolute index in [start, stop), clipped to what is kept (a view)."""
        first = max(0, self.count - self._cap)
        lo, hi = max(start, first), min(stop, self.count)
        if hi <= lo:
            return self._buf[:0]
        offset = lo - first
        base = first % self._cap
        return self._buf[base + offset : base + offset + (hi - lo)]


def level_ratio(
    values: RecentValues,
    *,
    regime_start: int,
    reference: int,
    index: int,
    now: int,
    before_window: int,
) -> tuple[float, float, float]:
    """Level before ``reference`` (within the regime) and from ``index`` to ``now``.

    Medians, not the paper's means: with the three or four points available a few
    iterations after a change, one garbage-collection spike would move a mean by tens of
    percent. ``after_low`` / ``after_high`` are the lower / upper median of the points
    after: a strict majority of them lies at or above / at or below it, so a change
    judged on them is backed by most of the new iterations, not by two spikes of four.

    Returns:
        (before, after_low, after_high) in the values' unit.
    """
    before = values.window(max(regime_start, reference - before_window), reference)
    if len(before) == 0:
        before = values.window(reference - 1, reference)
    if len(before) == 0:
        raise ValueError(f"no values kept before index {reference}; the buffer is too short")
    after = np.sort(values.window(index, now + 1))
    m = len(after)
    return float(np.median(before)), float(after[(m - 1) // 2]), float(after[m // 2])
