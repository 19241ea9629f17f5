"""Bayesian online change-point detection (Adams & MacKay, 2007) on log iteration times.

Each hypothesis is "the current segment started at iteration s"; its data are modelled
as Normal with unknown mean and precision under a conjugate Normal-Gamma prior, so the
predictive of the next point is a Student-t and one observation updates a hypothesis in
O(1). With a constant hazard H, after observing y_t:

    P(start = t)  ∝ H     * p0(y_t)                  (y_t opens a new segment)
    P(start = s)  ∝ (1-H) * P_{t-1}(start = s) * p_s(y_t)   (segment s goes on)

Iteration times are positive and change multiplicatively (a 1.3x slower GPU), so the
model runs on ``log(x)``.

Where this departs from the textbook recursion, and why:

- The run-length posterior here includes y_t (y_t may itself be the first point of a
  new segment). In the textbook form P(r_t = 0) is always H, so "P(r_t = 0) > 0.9"
  (the paper's rule) could never fire; here a change is flagged when the posterior
  mass within one iteration of a start later than the last flagged one reaches
  ``threshold`` (:meth:`RunLengthPosterior.flagged_start`).
- Truncation: at most ``max_hypotheses`` are kept; when full, a new segment takes the
  slot of the least probable one, and every 16 observations hypotheses below
  exp(``prune_log``) of the most probable are dropped. The cost per iteration is then
  O(max_hypotheses), independent of t. (In a steady regime the posterior of a short
  segment decays only polynomially, so a probability floor alone would not bound the
  count.)
- Prior per new segment: its mean is the segment's first point (the first point's
  density is then a constant, p0 does not depend on where the level is), its noise
  scale is the recent jitter of the series (median absolute log-difference, updated
  online), so the same defaults work for 0.1 s and 60 s iterations, 0.5% or 5% jitter.
- Outliers: a point is explained by its segment's Student-t predictive with
  probability 1 - ``outlier_prob`` and by the broad density of a new segment's first
  point otherwise. Without it a single 2x spike is 20 standard deviations out for a
  long, tight run, the run's posterior drops by e^-40, truncation drops it, and the
  iterations after the spike look like a new segment.
- Robust update: before a point joins a hypothesis' sufficient statistics it is clipped
  to that hypothesis' predictive mean +- ``clip`` scales. One garbage-collection spike
  of 2x would otherwise inflate a long run's variance for the rest of the run and blunt
  it to the next real change. The point's likelihood is never clipped.

:class:`RunLengthPosterior` is the Python statement of this model: the plain-BOCD
baseline (:mod:`greyhound.analytics.baselines`) and the BOCD+V reference
(:class:`~greyhound.analytics.verify.ReferenceBocdV`) run it. BOCD+V detection runs the
same posterior, expression for expression, inside the compiled kernel
``greyhound/analytics/_bocdv.c`` (:class:`~greyhound.analytics.verify.CompiledBocdV`);
a change to the recursion here must be made there too
(tests/test_detect_bocd_kernel.py holds them together). The constants the recursion
derives from its :class:`BocdConfig` are computed in one place,
:func:`derived_constants`, and the kernel receives them (and :func:`gamma_ratio_table`)
from there.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np
from scipy.special import gammaln

__all__ = [
    "BocdConfig", "BocdConstants", "RunLengthPosterior", "derived_constants", "gamma_ratio_table",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BocdConfig:
    """Parameters of the BOCD model and of its change-point rule."""

    expected_run: float = 250.0
    """Expected iterations between changes; the hazard is 1 / expected_run."""
    kappa0: float = 0.1
    """Prior pseudo-count of a new segment's mean (small: the level is unknown)."""
    alpha0: float = 3.0
    """Prior pseudo-count (x2) of a new segment's noise precision."""
    noise_default: float = 0.02
    """Jitter (std of log time) assumed until ``noise_min_samples`` differences exist."""
    noise_floor: float = 0.002
    """Smallest jitter assumed (a perfectly regular series would otherwise make any
    rounding look like a change)."""
    noise_window: int = 64
    """Recent log-differences the jitter estimate looks at."""
    noise_min_samples: int = 8
    """Log-differences needed before the jitter estimate replaces the default."""
    outlier_prob: float = 0.01
    """Probability that a point is an outlier of its segment (drawn from the broad
    density of a new segment's first point instead of the segment's predictive)."""
    clip: float = 5.0
    """Robust update: a point joins a hypothesis' statistics clipped to +- clip
    predictive scales of its mean."""
    threshold: float = 0.9
    """Posterior mass within one iteration of a new start that flags a change (the
    paper's 0.9)."""
    prune_log: float = -23.0
    """Hypotheses below exp(prune_log) of the most probable one are dropped."""
    max_hypotheses: int = 48
    """At most this many hypotheses are kept (the most probable)."""

    def __post_init__(self) -> None:
        positive = {
            "expected_run": self.expected_run, "kappa0": self.kappa0,
            "alpha0": self.alpha0, "noise_default": self.noise_default,
            "noise_floor": self.noise_floor, "clip": self.clip,
        }
        for name, value in positive.items():
            if not value > 0 or not math.isfinite(value):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.expected_run <= 1:
            raise ValueError(f"expected_run must be > 1, got {self.expected_run!r}")
        for name in ("noise_window", "noise_min_samples", "max_hypotheses"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {self.threshold!r}")
        if not 0.0 < self.outlier_prob < 0.5:
            raise ValueError(f"outlier_prob must be in (0, 0.5), got {self.outlier_prob!r}")
        if not self.prune_log < 0:
            raise ValueError(f"prune_log must be < 0, got {self.prune_log!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BocdConstants:
    """What the recursion derives from a :class:`BocdConfig`, computed once
    (:func:`derived_constants`): :class:`RunLengthPosterior` and the compiled kernel
    (``_bocdv.c``, through :class:`~greyhound.analytics.verify.BocdV`) both use these
    values and derive none of their own."""

    log_h: float
    """log H, the log hazard (H = 1 / expected_run)."""
    log_1mh: float
    """log(1 - H)."""
    log_eps: float
    """log of ``outlier_prob``."""
    log_1m_eps: float
    """log(1 - ``outlier_prob``)."""
    logpred0_base: float
    """Log density of a new segment's first point, less -log(jitter): the Student-t
    (2 alpha0 degrees of freedom) at its own mean."""
    prune_factor: float
    """exp(``prune_log``): hypotheses below this share of the most probable go."""
    kappa_first: float
    """kappa of a new segment after its first point (kappa0 + 1)."""
    alpha_first: float
    """alpha of a new segment after its first point (alpha0 + 1/2)."""
    mad_per_sigma: float
    """Median |difference| of two iid N(0, s^2) per s: 0.6745 * sqrt(2)."""


def derived_constants(config: BocdConfig) -> BocdConstants:
    """The constants of the BOCD recursion for ``config``."""
    c = config
    return BocdConstants(
        log_h=math.log(1.0 / c.expected_run),
        log_1mh=math.log1p(-1.0 / c.expected_run),
        log_eps=math.log(c.outlier_prob),
        log_1m_eps=math.log1p(-c.outlier_prob),
        logpred0_base=float(
            gammaln(c.alpha0 + 0.5) - gammaln(c.alpha0)
            - 0.5 * math.log(2.0 * c.alpha0 * math.pi * (c.kappa0 + 1.0) / c.kappa0)
        ),
        prune_factor=math.exp(c.prune_log),
        kappa_first=c.kappa0 + 1.0,
        alpha_first=c.alpha0 + 0.5,
        mad_per_sigma=0.6745 * math.sqrt(2.0),
    )


def gamma_ratio_table(alpha0: float, size: int) -> np.ndarray:
    """(size,) float64 gammaln(alpha + 1/2) - gammaln(alpha) for alpha = alpha0 + n/2,
    n = 0 .. size - 1: the Student-t normalising term of a hypothesis n points old.
    The posterior (and the kernel) extend it by doubling as their oldest hypothesis
    ages."""
    alpha = alpha0 + 0.5 * np.arange(size)
    return np.ascontiguousarray(gammaln(alpha + 0.5) - gammaln(alpha))


class RunLengthPosterior:
    """The BOCD posterior over segment start, updated one observation at a time.

    Observations are indexed 0, 1, ... in the order given. Per hypothesis (aligned
    arrays of length ``num_hypotheses``): ``starts`` and the Normal-Gamma posterior
    (kappa, mu, alpha, and beta less the prior's share, which is added at use so that
    every hypothesis shares the current jitter estimate).
    """

    def __init__(self, config: BocdConfig | None = None) -> None:
        self.config = config or BocdConfig()
        c = self.config
        self._k = derived_constants(c)
        self.t = -1
        cap = c.max_hypotheses + 1
        self._starts = np.empty(cap, dtype=np.int64)
        # Rows: kappa, mu, alpha, beta_data, log probability.
        self._state = np.empty((5, cap))
        self._size = 0
        self._diffs: collections.deque[float] = collections.deque(maxlen=c.noise_window)
        self._prev: float | None = None
        self._sigma = c.noise_default
        self._p = np.empty(0)
        self._lg_table = np.empty(0)

    @property
    def starts(self) -> np.ndarray:
        """(num_hypotheses,) start index of each hypothesis' segment."""
        return self._starts[: self._size]

    @property
    def probs(self) -> np.ndarray:
        """(num_hypotheses,) posterior probability of each start in ``starts``."""
        return self._p.copy()

    @property
    def num_hypotheses(self) -> int:
        return self._size

    def noise_scale(self) -> float:
        """Current robust jitter estimate (std of log time)."""
        return self._sigma

    def update(self, y: float) -> None:
        """Add the next observation (a log iteration time)."""
        c, k = self.config, self._k
        self.t += 1
        sigma = self._sigma
        beta0 = c.alpha0 * sigma * sigma
        # A new segment's first point is its own prior mean: Student-t(2 alpha0) at 0.
        logpred0 = k.logpred0_base - math.log(sigma)
        r = self._size
        state = self._state
        if r:
            kappa, mu, alpha, beta_data, logp = state[:, :r]
            # Student-t predictive: nu = 2 alpha, scale^2 = beta (kappa + 1) / (alpha kappa).
            kappa1 = kappa + 1.0
            scale_sq = (beta0 + beta_data) * kappa1 / (alpha * kappa)
            nu_scale_sq = 2.0 * alpha * scale_sq
            z = y - mu
            logpred = (
                self._log_gamma_ratio(self.t - self._starts[:r])
                - 0.5 * np.log(math.pi * nu_scale_sq)
                - (alpha + 0.5) * np.log1p(z * z / nu_scale_sq)
            )
            logp += np.logaddexp(logpred + k.log_1m_eps, k.log_eps + logpred0)
            logp += k.log_1mh
            bound = c.clip * np.sqrt(scale_sq)
            zc = np.minimum(np.maximum(z, -bound), bound)
            beta_data += kappa * zc * zc / (2.0 * kappa1)
            mu += zc / kappa1
            kappa += 1.0
            alpha += 0.5
        slot = r
        if r == c.max_hypotheses:
            # Full: the new segment takes the slot of the least probable old one.
            slot = int(np.argmin(state[4, :r]))
        else:
            self._size = r + 1
        state[:, slot] = (k.kappa_first, y, k.alpha_first, 0.0, k.log_h + logpred0)
        self._starts[slot] = self.t
        self._normalise()
        if self.t % 16 == 0:
            self._prune()
        if self._prev is not None:
            self._diffs.append(abs(y - self._prev))
            # The median of 64 values costs as much as the rest of the update; the
            # jitter moves slowly, so it is refreshed every 8 observations.
            if len(self._diffs) >= c.noise_min_samples and self.t % 8 == 0:
                self._sigma = self._estimate_noise()
        self._prev = y

    def flagged_start(self, after: int) -> int | None:
        """A change after ``after``, if BOCD is sure of it: its start, else None.

        The most probable start later than ``after`` is flagged when the posterior mass
        within one iteration of it (and later than ``after``) reaches ``threshold``. Mass spread thinly over many
        starts (a slow drift leaves such a posterior) flags nothing.
        """
        start = self.most_likely_start_since(after + 1)
        if start is None:
            return None
        near = self.prob_started_between(max(start - 1, after + 1), start + 1)
        if near < self.config.threshold:
            return None
        return start

    def _log_gamma_ratio(self, n: np.ndarray) -> np.ndarray:
        """gammaln(alpha + 1/2) - gammaln(alpha) for alpha = alpha0 + n / 2, by table."""
        top = int(n.max())
        if top >= len(self._lg_table):
            size = max(2 * len(self._lg_table), top + 1)
            self._lg_table = gamma_ratio_table(self.config.alpha0, size)
        return self._lg_table[n]

    def _normalise(self) -> None:
        r = self._size
        logp = self._state[4, :r]
        top = logp.max()
        p = np.exp(logp - top)
        total = p.sum()
        logp -= top + math.log(total)
        self._p = p / total

    def _estimate_noise(self) -> float:
        mad = float(np.median(np.fromiter(self._diffs, float)))
        return max(self.config.noise_floor, mad / self._k.mad_per_sigma)

    def prob_started_since(self, first: int) -> float:
        """Posterior probability that the current segment started at or after ``first``."""
        return float(self._p[self._starts[: self._size] >= first].sum())

    def prob_started_between(self, first: int, last: int) -> float:
        """Posterior probability that the current segment started in [first, last]."""
        starts = self._starts[: self._size]
        return float(self._p[(starts >= first) & (starts <= last)].sum())

    def most_likely_start_since(self, first: int) -> int | None:
        """The most probable start at or after ``first``; None if there is none."""
        chosen = np.flatnonzero(self._starts[: self._size] >= first)
        if not len(chosen):
            return None
        return int(self._starts[chosen[np.argmax(self._p[chosen])]])

    def _prune(self) -> None:
        """Drop hypotheses below exp(prune_log) of the most probable (amortised)."""
        r = self._size
        p = self._p
        keep = p >= p.max() * self._k.prune_factor
        n = int(keep.sum())
        if n == r:
            return
        self._state[:, :n] = self._state[:, :r][:, keep]
        self._starts[:n] = self._starts[:r][keep]
        self._size = n
        self._normalise()
