"""The paper's two detection baselines: a sliding-window median and plain BOCD.

Both are :class:`~greyhound.analytics.changepoint.Detector` s, as BOCD+V is.
"""

from __future__ import annotations

import math

import numpy as np

from greyhound.analytics.bocd import BocdConfig, RunLengthPosterior
from greyhound.analytics.changepoint import (
    ChangePoint, PointwiseFeed, RecentValues, check_series, check_value, level_ratio,
)

__all__ = ["PlainBocd", "WindowDetector", "bocd_changepoints", "window_changepoints"]

# Plain BOCD reports "before" over this many iterations, like BOCD+V's default.
_BEFORE_WINDOW = 50
# A flagged start older than this (BOCD+V's max_pending) is not reported.
_MAX_AGE = 12


class PlainBocd(PointwiseFeed):
    """Online BOCD without verification: every flagged change is reported."""

    def __init__(self, *, bocd: BocdConfig | None = None) -> None:
        self.bocd = bocd or BocdConfig()
        self._posterior = RunLengthPosterior(self.bocd)
        self._values = RecentValues(_BEFORE_WINDOW + 2)
        self._last_candidate = 0
        self._regime_start = 0

    def update(self, x: float) -> ChangePoint | None:
        """Add the next iteration time (seconds, > 0); returns a flagged change point."""
        check_value(x)
        post = self._posterior
        self._values.append(x)
        post.update(math.log(x))
        t = post.t
        start = post.flagged_start(self._last_candidate)
        if start is None:
            return None
        self._last_candidate = start
        if t - start + 1 > _MAX_AGE:
            return None  # an old change re-placed after the fact is no news
        before, after_low, after_high = level_ratio(
            self._values, regime_start=self._regime_start, reference=start, index=start,
            now=t, before_window=_BEFORE_WINDOW,
        )
        after = 0.5 * (after_low + after_high)
        self._regime_start = start
        return ChangePoint(index=start, detected_at=t, before=before, after=after)


def bocd_changepoints(x: np.ndarray, *, bocd: BocdConfig | None = None) -> list[ChangePoint]:
    """Plain BOCD over a whole series (the paper's "BOCD" baseline).

    Args:
        x: (n,) iteration times in seconds, finite and > 0.

    Returns:
        Every flagged change point, in order.
    """
    return PlainBocd(bocd=bocd).feed(x)


class WindowDetector:
    """The sliding-window baseline, online: report when the window median leaves a band.

    The reference level is the median of the first full window of the current regime.
    At iteration t the median of the last ``window`` iterations is compared with it; if
    they differ by more than ``band`` a change is reported with index
    ``t - (window - 1) // 2`` (a running median turns when half the window is new),
    its new level the median from there to t. The new regime's reference is its first
    full window, so no change is reported until then. O(window) per iteration; a batch
    takes its window medians in one vectorised pass.

    Args:
        window: iterations per median, >= 1.
        band: relative change that counts, in (0, 1).
    """

    def __init__(self, *, window: int = 20, band: float = 0.10) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window!r}")
        if not 0.0 < band < 1.0:
            raise ValueError(f"band must be in (0, 1), got {band!r}")
        self.window = window
        self.band = band
        self._tail = np.empty(0)  # the last values, fewer than `window`
        self._count = 0  # values added so far
        self._regime_start = 0
        self._reference: float | None = None

    def update(self, x: float) -> ChangePoint | None:
        """Add the next iteration time (seconds, > 0); returns a reported change point."""
        check_value(x)
        cps = self.feed(np.array([x]))
        return cps[0] if cps else None

    def feed(self, xs: np.ndarray) -> list[ChangePoint]:
        """Add the next (n,) iteration times; returns the change points reported meanwhile."""
        xs = check_series(xs)
        w = self.window
        # The kept tail and the batch: every full window in it ends in the batch, so
        # none is judged twice. values[0] is iteration `first`.
        first = self._count - len(self._tail)
        values = np.concatenate((self._tail, xs))
        self._count += len(xs)
        self._tail = values[len(values) - min(len(values), w - 1) :]
        if len(values) < w:
            return []
        medians = np.median(np.lib.stride_tricks.sliding_window_view(values, w), axis=1)
        out = []
        # medians[j] covers values[j : j + w], i.e. iterations [k, t] with k = first + j.
        for j, level in enumerate(medians.tolist()):
            k = first + j
            if k < self._regime_start:
                continue
            if self._reference is None:
                self._reference = level
                continue
            if abs(level / self._reference - 1.0) > self.band:
                t = k + w - 1
                index = max(t - (w - 1) // 2, self._regime_start + 1)
                after = float(np.median(values[index - first : t + 1 - first]))
                out.append(ChangePoint(index=index, detected_at=t, before=self._reference,
                                       after=after))
                self._regime_start, self._reference = index, None
        return out


def window_changepoints(
    x: np.ndarray, *, window: int = 20, band: float = 0.10
) -> list[ChangePoint]:
    """The sliding-window baseline over a whole series (:class:`WindowDetector`).

    Args:
        x: (n,) iteration times in seconds, finite and > 0.
        window: iterations per median.
        band: relative change that counts.

    Returns:
        Reported change points, in order.
    """
    x = check_series(x)
    return WindowDetector(window=window, band=band).feed(x)
