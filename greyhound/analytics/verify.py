"""BOCD+V: a BOCD change point counts only if the level moved by >= 10%.

BOCD alone flags the natural jitter of training (garbage-collection pauses, allocator
cache misses, uneven sequence lengths) as change points. GREYHOUND keeps a change only
if the iteration time before and after it differs by at least 10%.

How a candidate is decided, online:

1. BOCD flags a change after the last candidate
   (:meth:`~greyhound.analytics.bocd.RunLengthPosterior.flagged_start`); its start
   becomes the pending candidate.
2. The candidate is dropped as soon as BOCD stops believing in it (mass of segments
   started within one before and two after it falls below ``keep_prob``): a lone
   spike is explained away by the next normal iteration.
3. From ``min_after`` (4) iterations after its start on, the iterations since the
   start are compared with the median of up to ``before_window`` iterations before it
   (within the current regime; if an earlier candidate of the last ``before_window``
   iterations was judged and rejected, before that one, unless fewer than
   ``min_before`` iterations precede it). If a strict majority of them is >=
   ``min_change`` slower (or faster) and the new level is a *sustained new regime*
   (below), the change point is accepted and reported now (``detected_at``); after
   ``max_pending`` iterations without that, it is rejected.
4. A fail-slow that creeps in as a ramp leaves BOCD sure that the regime changed but
   unsure where. While no candidate is pending and BOCD puts ``threshold`` of its mass
   on a start after the regime's, every ``creep_every`` iterations a strict majority
   of the last ``creep_window`` (7) iterations is compared with the median of the
   ``before_window`` iterations that ended ``before_window`` iterations ago; if it
   moved and is a sustained new regime, the change point is BOCD's most probable
   start after that reference.

A sustained new regime. Training has brief disturbances that are not fail-slows: a
garbage-collection pause, an evaluation or checkpoint iteration, a data-loader stall,
a GC pause followed by two slow iterations while the allocator re-warms. They last
at most 3 iterations and the level then returns. A moved level counts as a new
regime only if, at the iteration it is accepted:

- it held for ``min_after`` = 4 iterations: a strict majority of the newest 4 moved by
  ``min_change`` (as of all iterations since the start), and each of the newest
  ``hold_newest`` = 4 lies nearer the new level than the old one (beyond their
  geometric mean). A disturbance of 3 iterations fails the 4th; one noisy iteration
  in 4 is tolerated at the 10% level, so a 1.1x fail-slow is not missed for jitter.
  So every change is reported 3 iterations after its start at the earliest
  (``detected_at - index >= 3``), which is when a 3-iteration disturbance and a
  fail-slow can first be told apart.
- it is new: fewer than ``max_visited`` (5%) of the old level's reference iterations,
  or fewer than 4, lie within half of ``min_change`` of it. A series that dwells on
  one of its modes (a mix of sequence lengths) has visited that level before.
- the old level is a level: a change less than ``min_before`` = 4 iterations after
  the regime's start is not reported; the regime starts again at the change
  (re-baselining). The first, partial iteration of a trace, or a short warm-up, is
  then never the baseline of a change point.

Where this departs from the paper: medians instead of means (see
:func:`~greyhound.analytics.changepoint.level_ratio`), and "before" is the regime
since the last *accepted* change, so a fail-slow that creeps in as a ramp of several
small steps, each under 10%, is still caught once the level has moved 10% in all
(the paper names that ramp as its one missed case).

Two implementations, one algorithm, both :class:`~greyhound.analytics.changepoint.Detector` s:
:class:`CompiledBocdV` keeps its state in a compiled kernel (``_bocdv.c``);
:class:`ReferenceBocdV` is the same loop in Python over
:class:`~greyhound.analytics.bocd.RunLengthPosterior`, kept as the readable reference
that the kernel is tested against. The kernel computes every expression in the
reference's order with the same libm functions, and takes every derived constant from
:func:`~greyhound.analytics.bocd.derived_constants` and
:attr:`VerifyConfig.values_capacity`, so on CPUs where numpy calls libm for float64
exp/log (no AVX-512) the two agree bit for bit. :data:`BocdV`, what detection runs, is
the compiled one where the kernel is built, and the reference (~60x slower, same change
points) where it is not.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import numpy as np

from greyhound.analytics.bocd import (
    BocdConfig, RunLengthPosterior, derived_constants, gamma_ratio_table,
)
from greyhound.analytics.changepoint import (
    ChangePoint, PointwiseFeed, RecentValues, check_series, check_value, level_ratio,
)

logger = logging.getLogger(__name__)

_KERNEL_MISSING = ""
try:
    from greyhound.analytics import _bocdv
except ImportError as exc:  # an install that skipped the build, or a stale build
    _bocdv = None  # type: ignore[assignment]  # CompiledBocdV checks for it
    _KERNEL_MISSING = (
        "greyhound: analytics: the compiled BOCD+V kernel (greyhound.analytics._bocdv) "
        f"cannot be imported: {exc}; run scripts/setup or pip install -e ."
    )
    logger.warning("%s Detection runs the Python reference (same change points, ~60x slower).",
                   _KERNEL_MISSING)

__all__ = [
    "VerifyConfig", "PosteriorState", "BocdV", "CompiledBocdV", "ReferenceBocdV",
    "HAVE_KERNEL", "bocdv_changepoints",
]

HAVE_KERNEL = _bocdv is not None
"""Whether the compiled kernel is built (then :data:`BocdV` is :class:`CompiledBocdV`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyConfig:
    """Parameters of the verification step."""

    min_change: float = 0.10
    """Relative level change a change point needs (the paper's 10%)."""
    min_after: int = 4
    """Iterations of the new level, from the start and including it, before a change
    can be accepted: a brief disturbance (a GC pause, an evaluation or checkpoint
    iteration, a data-loader stall, a GC pause with 2 slow iterations after it) lasts
    at most 3 iterations, so the 4th says whether the level stayed. It is also the
    earliest a change can be reported: ``detected_at >= index + min_after - 1``."""
    hold_newest: int = 4
    """The newest this many iterations (at most ``min_after``) must still lie nearer
    the new level than the old one (beyond their geometric mean) when a change is
    accepted: a level that went back is not a new regime, whatever the majority of the
    iterations since the start says. Two, not one: one normal iteration that jitter
    lifts half-way would otherwise pass a 3-iteration disturbance."""
    min_before: int = 4
    """Iterations the old regime needs before the change for its level to be a
    baseline. A change after fewer (the first, partial iteration of a trace, a short
    warm-up) is not reported: the regime starts again at the change (re-baselining)."""
    max_visited: float = 0.05
    """A new level must be new: if at least this share of the old level's reference
    iterations, and at least ``min_after`` of them (more than one brief disturbance
    explains), lies within half of ``min_change`` of it, the series merely dwells on
    one of its modes (a mix of sequence lengths), and the change is not accepted."""
    max_pending: int = 12
    """A candidate not accepted within this many iterations of its start is rejected."""
    before_window: int = 50
    """Iterations before the candidate (within the regime) that set the old level."""
    keep_prob: float = 0.5
    """A pending candidate is dropped when BOCD's mass on it falls below this."""
    creep_window: int = 7
    """Ramps: iterations whose level is compared with the level ``before_window``
    iterations earlier while BOCD believes the regime has changed."""
    creep_every: int = 4
    """Ramps are looked for every ``creep_every`` iterations."""

    def __post_init__(self) -> None:
        if not 0.0 < self.min_change < 1.0:
            raise ValueError(f"min_change must be in (0, 1), got {self.min_change!r}")
        if self.min_after < 1:
            raise ValueError(f"min_after must be >= 1, got {self.min_after!r}")
        if self.hold_newest < 1:
            raise ValueError(f"hold_newest must be >= 1, got {self.hold_newest!r}")
        if self.min_before < 1:
            raise ValueError(f"min_before must be >= 1, got {self.min_before!r}")
        if self.max_pending < self.min_after:
            raise ValueError(
                f"max_pending must be >= min_after ({self.min_after}), got {self.max_pending!r}"
            )
        if self.before_window < 1:
            raise ValueError(f"before_window must be >= 1, got {self.before_window!r}")
        if self.creep_every < 1:
            raise ValueError(f"creep_every must be >= 1, got {self.creep_every!r}")
        if self.creep_window < 1:
            raise ValueError(f"creep_window must be >= 1, got {self.creep_window!r}")
        if not 0.0 < self.max_visited <= 1.0:
            raise ValueError(f"max_visited must be in (0, 1], got {self.max_visited!r}")
        if not 0.0 <= self.keep_prob < 1.0:
            raise ValueError(f"keep_prob must be in [0, 1), got {self.keep_prob!r}")

    @property
    def values_capacity(self) -> int:
        """Recent iteration times a detector keeps: the old level's window and the
        pending one, for a reference up to ``before_window`` before the candidate."""
        return 2 * self.before_window + 2 * self.max_pending + 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class PosteriorState:
    """A snapshot of the run-length posterior (for tests and debugging)."""

    t: int
    """Index of the last observation (-1 before the first)."""
    starts: np.ndarray
    """(num_hypotheses,) int64 start of each hypothesis, in slot order."""
    probs: np.ndarray
    """(num_hypotheses,) posterior probability of each start."""
    noise_scale: float
    """Current jitter estimate (std of log time)."""


class CompiledBocdV:
    """Online BOCD+V (the compiled kernel): :meth:`update` one iteration time, or
    :meth:`feed` a batch (a node agent's poll); the state carries over between calls,
    and any split of a series into batches reports the same change points.

    Args:
        bocd: BOCD parameters.
        verify: verification parameters.
        exact_math: compute exp/log/log1p with libm's scalar functions, as numpy does,
            instead of glibc's 4-lane libmvec ones (used where the CPU has AVX2+FMA;
            within 4 ulp; ~2x faster overall). Then the posterior is bit-identical to
            :class:`ReferenceBocdV`'s where numpy calls libm (tests); otherwise it
            agrees to ~1e-13 and the change points are the same.
    """

    def __init__(
        self,
        *,
        bocd: BocdConfig | None = None,
        verify: VerifyConfig | None = None,
        exact_math: bool = False,
    ) -> None:
        if _bocdv is None:
            raise ImportError(_KERNEL_MISSING)
        self.bocd = bocd or BocdConfig()
        self.verify = verify or VerifyConfig()
        c, v = self.bocd, self.verify
        # The kernel derives nothing: constants and the gammaln table come from bocd.py.
        self._kernel = _bocdv.Kernel(
            **dataclasses.asdict(derived_constants(c)),
            alpha0=c.alpha0, noise_default=c.noise_default,
            noise_floor=c.noise_floor, clip=c.clip, threshold=c.threshold,
            max_hypotheses=c.max_hypotheses, noise_window=c.noise_window,
            noise_min_samples=c.noise_min_samples,
            min_change=v.min_change, keep_prob=v.keep_prob, min_after=v.min_after,
            max_pending=v.max_pending, before_window=v.before_window,
            creep_window=v.creep_window, creep_every=v.creep_every,
            hold_newest=v.hold_newest, min_before=v.min_before, max_visited=v.max_visited,
            values_capacity=v.values_capacity,
            # A plain function, not a bound method: the kernel is not tracked by the
            # cycle collector, so it must not hold a reference back to self.
            lg_table=functools.partial(gamma_ratio_table, c.alpha0), exact_math=exact_math,
        )

    @property
    def pending(self) -> int | None:
        """Start of the candidate being verified, if any."""
        return self._kernel.pending

    @property
    def math(self) -> str:
        """exp/log/log1p in use: "libm" or "libmvec-avx2"."""
        return self._kernel.math

    @property
    def count(self) -> int:
        """Iteration times added so far (the next one has this index)."""
        return self._kernel.count

    def update(self, x: float) -> ChangePoint | None:
        """Add the next iteration time (seconds, > 0); returns an accepted change point."""
        cp = self._kernel.update(x)
        return None if cp is None else _change_point(cp)

    def feed(self, xs: np.ndarray) -> list[ChangePoint]:
        """Add the next iteration times; returns the change points accepted meanwhile.

        Args:
            xs: (n,) iteration times in seconds, finite and > 0. All are checked before
                any is added, so a bad batch leaves the state as it was.

        Returns:
            Accepted change points in order of ``detected_at``.
        """
        xs = np.ascontiguousarray(check_series(xs))
        return [_change_point(cp) for cp in self._kernel.feed(xs)]

    def posterior_state(self) -> PosteriorState:
        """The run-length posterior now, as :meth:`ReferenceBocdV.posterior_state`."""
        t, starts, probs, sigma = self._kernel.posterior()
        return PosteriorState(
            t=t, starts=np.array(starts, dtype=np.int64), probs=np.array(probs),
            noise_scale=sigma,
        )


def _change_point(cp: tuple[int, int, float, float]) -> ChangePoint:
    index, detected_at, before, after = cp
    return ChangePoint(index=index, detected_at=detected_at, before=before, after=after)


class ReferenceBocdV(PointwiseFeed):
    """BOCD+V in Python, one iteration time at a time: the reference.

    This is the readable statement of the algorithm (module docstring, and
    :class:`~greyhound.analytics.bocd.RunLengthPosterior` for the model). Detection
    runs :class:`CompiledBocdV` where it is built, which does the same arithmetic in
    the same order (~60x faster); a change here must be made in ``_bocdv.c`` too. The
    tests hold the two to the same change points and posterior, and
    ``scripts/bench_detect`` measures both.
    """

    math = "numpy"
    """exp/log/log1p in use: numpy's."""

    def __init__(
        self, *, bocd: BocdConfig | None = None, verify: VerifyConfig | None = None
    ) -> None:
        self.bocd = bocd or BocdConfig()
        self.verify = verify or VerifyConfig()
        self._posterior = RunLengthPosterior(self.bocd)
        v = self.verify
        self._values = RecentValues(v.values_capacity)
        self._regime_start = 0
        self._last_candidate = 0
        self._pending: int | None = None
        self._suspicion: int | None = None

    @property
    def pending(self) -> int | None:
        """Start of the candidate being verified, if any."""
        return self._pending

    @property
    def count(self) -> int:
        """Iteration times added so far (the next one has this index)."""
        return self._values.count

    def posterior_state(self) -> PosteriorState:
        """The run-length posterior now (to compare with :meth:`CompiledBocdV.posterior_state`)."""
        post = self._posterior
        return PosteriorState(
            t=post.t, starts=post.starts.copy(), probs=post.probs,
            noise_scale=post.noise_scale(),
        )

    def update(self, x: float) -> ChangePoint | None:
        """Add the next iteration time (seconds, > 0); returns an accepted change point."""
        check_value(x)
        v, post = self.verify, self._posterior
        self._values.append(x)
        post.update(math.log(x))
        t = post.t
        if self._suspicion is not None and t - self._suspicion > v.before_window:
            self._suspicion = None
        flagged = post.flagged_start(self._last_candidate)
        if flagged is not None:
            self._last_candidate = flagged
            # BOCD sometimes re-places an old change by a few iterations long after
            # the fact; only fresh changes are news.
            if t - flagged + 1 <= v.max_pending:
                self._pending = flagged
        start = self._pending
        if start is None:
            return self._check_creep(t)
        # Mass near the candidate only: a later segment (the normal iteration after a
        # spike opens one too) must not keep a spike's candidate alive.
        if post.prob_started_between(start - 1, start + 2) < v.keep_prob:
            self._pending = None
            return self._check_creep(t)
        if t - start + 1 < v.min_after:
            return None
        # A level that crept up in steps is compared with the level before the first
        # step still under suspicion, not with the last step.
        reference = start if self._suspicion is None else min(self._suspicion, start)
        if reference - self._regime_start < v.min_before:
            # Too few iterations before the suspicion to be a level: the candidate's
            # own start is the reference.
            reference = start
        before, after_low, after_high = level_ratio(
            self._values, regime_start=self._regime_start, reference=reference,
            index=start, now=t, before_window=v.before_window,
        )
        after = _moved(before, after_low, after_high, v.min_change)
        if after is not None and self._holds(t, before, after, start, self._old_level(reference)):
            if reference - self._regime_start < v.min_before:
                # The old level rests on too few iterations to be a baseline.
                self._rebaseline(start)
                return None
            return self._accept(start, t, before, after)
        if self._suspicion is None:
            self._suspicion = start
        if t - start + 1 >= v.max_pending:
            self._pending = None
        return None

    def _check_creep(self, t: int) -> ChangePoint | None:
        """A level that moved without a sharp change BOCD could pin down (a ramp)."""
        v, post = self.verify, self._posterior
        # Ramps take tens of iterations; looking every few iterations keeps the medians
        # out of the per-iteration cost.
        if t % v.creep_every:
            return None
        if post.prob_started_since(self._regime_start + 1) < self.bocd.threshold:
            return None
        reference_end = t - v.before_window + 1
        if reference_end - self._regime_start < v.min_after:
            return None
        recent = np.sort(self._values.window(t - v.creep_window + 1, t + 1))
        if len(recent) < v.creep_window:
            return None
        # The change must lie after the reference window, or the window would hold it.
        start = post.most_likely_start_since(max(self._regime_start + 1, reference_end))
        if start is None or t - start + 1 < v.min_after:
            return None
        old = self._values.window(
            max(self._regime_start, reference_end - v.before_window), reference_end
        )
        before = float(np.median(old))
        m = len(recent)
        after = _moved(before, float(recent[(m - 1) // 2]), float(recent[m // 2]), v.min_change)
        if after is None or not self._holds(t, before, after, start, old):
            return None
        return self._accept(start, t, before, after)

    def _old_level(self, reference: int) -> np.ndarray:
        """The iterations ``level_ratio`` takes the old level from."""
        v = self.verify
        old = self._values.window(max(self._regime_start, reference - v.before_window), reference)
        return old if len(old) else self._values.window(reference - 1, reference)

    def _holds(
        self, t: int, before: float, after: float, start: int, old: np.ndarray
    ) -> bool:
        """Whether a moved level is a new regime (the level test passed).

        A strict majority of the newest ``min_after`` iterations (none before
        ``start``) must have moved by ``min_change`` too, not only of those since
        ``start`` (a disturbance late in a long pending window, on top of a small
        benign shift, would otherwise carry the majority); the newest ``hold_newest``
        iterations (at most ``min_after``, none before ``start``) must each lie nearer
        the new level than the old one, beyond their geometric mean sqrt(before * after)
        (the level still holds), and fewer than ``min_after`` or fewer than
        ``max_visited`` of the old level's iterations ``old`` within half of
        ``min_change`` of ``after`` (the level is new)."""
        v = self.verify
        half = 0.5 * v.min_change
        recent = np.sort(self._values.window(t - min(v.min_after, t - start + 1) + 1, t + 1))
        low, high = float(recent[(len(recent) - 1) // 2]), float(recent[len(recent) // 2])
        count = min(v.hold_newest, v.min_after, t - start + 1)
        newest = self._values.window(t - count + 1, t + 1)
        middle = math.sqrt(before * after)
        if after > before:
            if low < before * (1.0 + v.min_change) or not np.all(newest >= middle):
                return False
        elif high > before * (1.0 - v.min_change) or not np.all(newest <= middle):
            return False
        visited = np.count_nonzero((old >= after / (1.0 + half)) & (old <= after * (1.0 + half)))
        return bool(visited < v.min_after or visited < v.max_visited * len(old))

    def _accept(self, start: int, t: int, before: float, after: float) -> ChangePoint:
        self._rebaseline(start)
        return ChangePoint(index=start, detected_at=t, before=before, after=after)

    def _rebaseline(self, start: int) -> None:
        """A new regime from ``start`` on."""
        self._pending = self._suspicion = None
        self._regime_start = start
        self._last_candidate = max(start, self._last_candidate)


def _moved(before: float, after_low: float, after_high: float, min_change: float) -> float | None:
    """The new level if a strict majority moved by >= min_change, else None."""
    if after_low >= before * (1.0 + min_change):
        return after_low
    if after_high <= before * (1.0 - min_change):
        return after_high
    return None


BocdV: type[CompiledBocdV] | type[ReferenceBocdV] = (
    CompiledBocdV if _bocdv is not None else ReferenceBocdV
)
"""Online BOCD+V as detection runs it: :class:`CompiledBocdV` where the kernel is
built, else :class:`ReferenceBocdV` (the same change points, ~60x slower). Both take
``bocd=`` and ``verify=`` and are :class:`~greyhound.analytics.changepoint.Detector` s."""


def bocdv_changepoints(
    x: np.ndarray, *, bocd: BocdConfig | None = None, verify: VerifyConfig | None = None
) -> list[ChangePoint]:
    """BOCD+V over a whole series, exactly as :data:`BocdV` reports it online.

    Args:
        x: (n,) iteration times in seconds, finite and > 0.

    Returns:
        Accepted change points in order of ``index``.
    """
    return BocdV(bocd=bocd, verify=verify).feed(x)
