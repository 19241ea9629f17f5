"""The paper's two detection baselines: a sliding-window median and plain BOCD."""

from __future__ import annotations

import math

import numpy as np

from greyhound.analytics.bocd import BocdConfig, RunLengthPosterior
from greyhound.analytics.changepoint import ChangePoint, RecentValues, level_ratio
from greyhound.analytics.verify import check_series

__all__ = ["PlainBocd", "bocd_changepoints", "window_changepoints"]

# Plain BOCD reports "before" over this many iterations, like BOCD+V's default.
_BEFORE_WINDOW = 50
# A flagged start older than this (BOCD+V's max_pending) is not reported.
_MAX_AGE = 12


class PlainBocd:
    """Online BOCD without verification: every flagged change is reported."""

    def __init__(self, *, bocd: BocdConfig | None = None) -> None:
        self.bocd = bocd or BocdConfig()
        self._posterior = RunLengthPosterior(self.bocd)
        self._values = RecentValues(_BEFORE_WINDOW + 2)
        self._last_candidate = 0
        self._regime_start = 0

    def update(self, x: float) -> ChangePoint | None:
        """Add the next iteration time (seconds, > 0); returns a flagged change point."""
        if not (x > 0 and math.isfinite(x)):
            raise ValueError(f"iteration time must be finite and > 0, got {x!r}")
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
    detector = PlainBocd(bocd=bocd)
    out = []
    for value in check_series(x).tolist():
        cp = detector.update(value)
        if cp is not None:
            out.append(cp)
    return out


def window_changepoints(
    x: np.ndarray, *, window: int = 20, band: float = 0.10
) -> list[ChangePoint]:
    """The sliding-window baseline: report when the window median leaves a 10% band.

    The reference level is the median of the first full window of the current regime.
    At iteration t the median of the last ``window`` iterations is compared with it; if
    they differ by more than ``band`` a change is reported with index
    ``t - (window - 1) // 2`` (a running median turns when half the window is new),
    its new level the median from there to t. The new
    regime's reference is its first full window, so no change is reported until then.
    O(n * window).

    Args:
        x: (n,) iteration times in seconds, finite and > 0.
        window: iterations per median.
        band: relative change that counts.

    Returns:
        Reported change points, in order.
    """
    x = check_series(x)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window!r}")
    if not 0.0 < band < 1.0:
        raise ValueError(f"band must be in (0, 1), got {band!r}")
    n = len(x)
    if n < window:
        return []
    medians = np.median(np.lib.stride_tricks.sliding_window_view(x, window), axis=1)
    # medians[k] covers x[k : k + window]; it is known at t = k + window - 1.
    out: list[ChangePoint] = []
    regime_start = 0
    reference = None
    for k in range(len(medians)):
        if k < regime_start:
            continue
        if reference is None:
            reference = float(medians[k])
            continue
        level = float(medians[k])
        if abs(level / reference - 1.0) > band:
            t = k + window - 1
            index = max(t - (window - 1) // 2, regime_start + 1)
            after = float(np.median(x[index : t + 1]))
            out.append(ChangePoint(index=index, detected_at=t, before=reference, after=after))
            regime_start, reference = index, None
    return out
