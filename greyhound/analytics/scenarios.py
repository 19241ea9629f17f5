"""A wider labelled test set: generators of different character, and call traces
rendered from their series.

:mod:`~greyhound.analytics.synthetic` has one generator, with every noise source mixed
into each job. A detector tuned on it can still fail on data of another shape, and did:
brief disturbances of 1-3 iterations (a GC pause, an evaluation or checkpoint
iteration, a data-loader stall, a burst of slow iterations right after a GC pause)
came out as change points. Each generator here has one character, so a result per
generator says which shape a detector gets wrong:

=================  ==========================================================
``gc_pauses``      GC pauses every 30-300 iterations (1 iteration, +20-150%)
``gc_bursts``      every GC pause followed by 2 slow iterations (+10-60%)
``heavy_tailed``   Student-t log jitter (2-4 degrees of freedom)
``ar1_jitter``     AR(1) jitter (correlation 0.3-0.9) and a bounded slow drift
``periodic_eval``  an evaluation of 1-3 iterations every 10-200 (+50-400%), a
                   checkpoint iteration every 100-500 (+100-1000%)
``loader_stalls``  data-loader stalls of 1-2 iterations at random (+20-300%)
``seqlen_mix``     iteration times drawn from 2-4 modes within +-4% (a mix of
                   sequence lengths), i.i.d. or sticky
``warmup``         a partial first iteration (0.5-0.95x) and/or 1-8 slow
                   warm-up iterations (1.2-5x, decaying)
``steps``          fail-slow steps of 1.1-3x, 20-600 iterations, with recoveries
``ramps``          fail-slows that creep in over 10-60 iterations (1.15-2.5x)
``short_episodes`` true fail-slows of only 5-15 iterations (1.3-3x)
``relapses``       a fail-slow, a short recovery (10-30 iterations), a relapse
``mixed``          :func:`~greyhound.analytics.synthetic.iteration_series`
=================  ==========================================================

Every generator draws a healthy iteration time (0.05-10 s, log-uniform) and a
Gaussian log jitter (0.3-3%) under its own character, and adds benign level shifts
of 2-5% now and then; a positive job also carries 1-3 fail-slows (>= 10% slower,
lasting >= 5 iterations), placed after 60 healthy iterations. Brief disturbances
never last more than 3 iterations and are at least 4 iterations apart: that is
what the detector is asked to tell apart from a fail-slow (``truth.transients``
lists them).

:func:`labelled_set` draws a split ("tune" or "heldout") of jobs from every
generator from disjoint seed streams; thresholds are chosen on "tune" only.
:func:`render_calls` turns a series into one rank's call trace, for the call-trace
path of ``greyhound detect`` and the node agent's tracker.

All generators are pure: they take ``rng`` and return (series, truth).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from greyhound import ring
from greyhound.analytics.synthetic import (
    COMM_DP, COMM_WORLD, CallTrace, FailSlow, hybrid_pattern, iteration_series,
)

__all__ = [
    "GENERATORS",
    "SPLITS",
    "JobTruth",
    "Job",
    "JobScore",
    "labelled_set",
    "render_calls",
    "ring_records",
    "score_job",
    "summarize",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobTruth:
    """What went into a generated job."""

    generator: str
    fail_slows: tuple[FailSlow, ...]
    """Injected fail-slows: iterations [onset, end) run up to ``factor`` x slower."""
    transients: tuple[tuple[int, int], ...]
    """(start, length) of brief disturbances (1-3 iterations) that are not fail-slows."""
    base: float
    """Healthy iteration time (seconds)."""
    jitter: float
    """Scale of the log jitter."""
    pause: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    """(n,) seconds of each iteration spent in one pause (a GC pause, an evaluation or
    checkpoint, a data-loader stall) rather than spread over its compute; None if
    unknown. :func:`render_calls` puts it at one point of the iteration."""

    @property
    def positive(self) -> bool:
        return bool(self.fail_slows)

    def detectable_onset(self, fs: FailSlow, min_change: float = 0.10) -> int:
        """First iteration of ``fs`` at which the injected slowdown reaches
        ``min_change`` (its onset for a step; later inside a ramp)."""
        if not fs.ramp:
            return fs.onset
        need = np.log1p(min_change) / np.log(fs.factor)
        k = int(np.ceil(need * fs.ramp - 1e-9))
        return fs.onset + max(0, min(k, fs.ramp) - 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Job:
    """One labelled job: its iteration times and what went into them."""

    x: np.ndarray
    """(n,) iteration times in seconds."""
    truth: JobTruth
    seed: tuple[int, ...]
    """The seed sequence entropy that regenerates it."""


class _Series:
    """A series under construction, in log seconds."""

    def __init__(self, rng: np.random.Generator, n: int, *, jitter: float | None = None):
        self.rng = rng
        self.n = n
        self.base = float(np.exp(rng.uniform(np.log(0.05), np.log(10.0))))
        self.jitter = float(rng.uniform(0.003, 0.03)) if jitter is None else jitter
        self.log_x = np.full(n, np.log(self.base))
        self.transients: list[tuple[int, int]] = []
        self.fail_slows: list[FailSlow] = []
        self._busy = np.zeros(n, dtype=bool)
        self._pause_log = np.zeros(n)

    def gaussian_jitter(self) -> None:
        self.log_x += self.rng.normal(0.0, self.jitter, self.n)

    def benign_shifts(self, rate: float = 1.0) -> None:
        """0-3 lasting shifts of 2-5% (a new data mix; not a fail-slow). Together they
        stay within +-5% of the healthy level: shifts that add up to 10% are, by the
        detector's rule, a fail-slow."""
        shifts = []
        for _ in range(min(int(self.rng.poisson(rate)), 3)):
            at = int(self.rng.integers(1, self.n))
            sign = self.rng.choice([-1.0, 1.0])
            shifts.append((at, sign * float(self.rng.uniform(0.02, 0.05))))
        total = 0.0
        for at, shift in sorted(shifts):
            if abs(total + shift) > 0.05:
                shift = -shift
            total += shift
            self.log_x[at:] += np.log1p(shift)

    def transient(
        self, start: int, factors: np.ndarray | list[float], *, point: int | None = None
    ) -> bool:
        """Brief disturbance of len(factors) <= 3 iterations; refused (False) when it
        would come within 4 iterations of another. The first ``point`` iterations' extra
        time (default all) is one pause; the rest is spread over their compute (the
        slow iterations after a GC pause)."""
        length = len(factors)
        if start < 0 or start + length > self.n:
            return False
        lo, hi = max(0, start - 4), min(self.n, start + length + 4)
        if self._busy[lo:hi].any():
            return False
        self._busy[start : start + length] = True
        logs = np.log(np.asarray(factors, dtype=float))
        self.log_x[start : start + length] += logs
        point = length if point is None else point
        self._pause_log[start : start + point] += logs[:point]
        self.transients.append((start, length))
        return True

    def fail_slow(self, onset: int, end: int, factor: float, ramp: int = 0) -> None:
        fs = FailSlow(onset=onset, end=end, factor=factor, ramp=min(ramp, (end - onset) // 2))
        self.log_x[onset:end] += np.log(factor) * fs.profile()
        self.fail_slows.append(fs)

    def place(self, count: int, durations: Callable[[], int], gap: int = 40) -> list[tuple[int, int]]:
        """``count`` non-overlapping [onset, end) spans after 60 healthy iterations,
        ``gap`` iterations apart, each in its own slot of the series."""
        out = []
        slot = (self.n - 60) // count
        for k in range(count):
            lo = 60 + k * slot
            hi = lo + slot - gap
            duration = min(durations(), max(5, hi - lo - 1))
            onset = int(self.rng.integers(lo, max(lo + 1, hi - duration)))
            out.append((onset, min(self.n, onset + duration)))
        return out

    def done(self, generator: str, *, steps: int = 0) -> tuple[np.ndarray, JobTruth]:
        """The series and its truth, after ``steps`` fail-slow steps (:func:`_steps`)."""
        if steps:
            _steps(self, steps)
        x = np.exp(self.log_x)
        truth = JobTruth(
            generator=generator, fail_slows=tuple(sorted(self.fail_slows, key=lambda f: f.onset)),
            transients=tuple(sorted(self.transients)), base=self.base, jitter=self.jitter,
            pause=x * -np.expm1(-np.maximum(self._pause_log, 0.0)),
        )
        return x, truth


def _log_uniform_int(rng: np.random.Generator, lo: int, hi: int) -> int:
    return int(np.exp(rng.uniform(np.log(lo), np.log(hi + 1))))


def _steps(s: _Series, count: int, *, lo: float = 1.1, hi: float = 3.0) -> None:
    """``count`` fail-slow steps of lo-hi x lasting 20-600 iterations, then recovery."""
    for onset, end in s.place(count, lambda: _log_uniform_int(s.rng, 20, 600)):
        # Log-uniform severity: as many mild (1.1-1.3x) as severe ones.
        factor = float(np.exp(s.rng.uniform(np.log(lo), np.log(hi))))
        s.fail_slow(onset, end, factor)


def _gc(s: _Series, *, burst_prob: float) -> None:
    every = int(s.rng.integers(30, 301))
    at = int(s.rng.integers(0, every))
    while at < s.n:
        pause = float(s.rng.uniform(1.2, 2.5))
        if s.rng.random() < burst_prob:
            # Right after a GC pause the allocator re-warms: 2 more slow iterations.
            burst = s.rng.uniform(1.1, 1.6, 2)
            s.transient(at, [pause, *burst], point=1)
        else:
            s.transient(at, [pause])
        at += every + int(s.rng.integers(-3, 4))


def _with_gc(
    rng: np.random.Generator, n: int, *, burst_prob: float, jitter: float | None = None
) -> _Series:
    """A healthy series: Gaussian jitter, benign shifts and GC pauses, ``burst_prob``
    of them followed by 2 slow iterations."""
    s = _Series(rng, n, jitter=jitter)
    s.gaussian_jitter()
    s.benign_shifts()
    _gc(s, burst_prob=burst_prob)
    return s


def gc_pauses(rng: np.random.Generator, *, num_iterations: int, num_fail_slows: int = 0):
    """Python GC pauses at a steady rhythm, a few followed by a 2-iteration burst."""
    s = _with_gc(rng, num_iterations, burst_prob=0.2)
    return s.done("gc_pauses", steps=num_fail_slows)


def gc_bursts(rng: np.random.Generator, *, num_iterations: int, num_fail_slows: int = 0):
    """Every GC pause is followed by a 2-iteration burst (3 slow iterations in all)."""
    s = _with_gc(rng, num_iterations, burst_prob=1.0)
    return s.done("gc_bursts", steps=num_fail_slows)


def heavy_tailed(rng: np.random.Generator, *, num_iterations: int, num_fail_slows: int = 0):
    """Student-t log jitter: rare large single-iteration excursions, no structure."""
    s = _Series(rng, num_iterations, jitter=float(rng.uniform(0.003, 0.015)))
    df = float(rng.uniform(2.0, 4.0))
    s.log_x += s.jitter * rng.standard_t(df, num_iterations)
    s.benign_shifts()
    return s.done("heavy_tailed", steps=num_fail_slows)


def ar1_jitter(rng: np.random.Generator, *, num_iterations: int, num_fail_slows: int = 0):
    """Correlated jitter (AR(1), correlation 0.3-0.9, stationary std 0.5-2%) on a slow
    bounded drift (within +-4%: a changing data mix)."""
    s = _Series(rng, num_iterations, jitter=float(rng.uniform(0.005, 0.02)))
    phi = float(rng.uniform(0.3, 0.9))
    shocks = rng.normal(0.0, s.jitter * np.sqrt(1 - phi * phi), num_iterations)
    level = 0.0
    noise = np.empty(num_iterations)
    for i in range(num_iterations):
        level = phi * level + shocks[i]
        noise[i] = level
    drift = np.cumsum(rng.normal(0.0, 0.002, num_iterations))
    span = np.ptp(drift)
    if span > 0.04:
        drift *= 0.04 / span
    s.log_x += noise + drift - drift[0]
    return s.done("ar1_jitter", steps=num_fail_slows)


def periodic_eval(rng: np.random.Generator, *, num_iterations: int, num_fail_slows: int = 0):
    """An evaluation every 10-200 iterations (1-3 iterations, +50-400%) and a
    checkpoint iteration every 100-500 (+100-1000%)."""
    s = _Series(rng, num_iterations)
    s.gaussian_jitter()
    s.benign_shifts()
    every = int(rng.integers(10, 201))
    length = int(rng.integers(1, 4))
    factor = float(rng.uniform(1.5, 5.0))
    for at in range(int(rng.integers(0, every)), num_iterations, every):
        s.transient(at, factor * rng.uniform(0.95, 1.05, length))
    every = int(rng.integers(100, 501))
    for at in range(every - 1, num_iterations, every):
        if not s.transient(at, [float(rng.uniform(2.0, 11.0))]):
            s.transient(at + 4, [float(rng.uniform(2.0, 11.0))])
    return s.done("periodic_eval", steps=num_fail_slows)


def loader_stalls(rng: np.random.Generator, *, num_iterations: int, num_fail_slows: int = 0):
    """Data-loader stalls at random (0.2-3% of iterations), 1-2 iterations each."""
    s = _Series(rng, num_iterations)
    s.gaussian_jitter()
    s.benign_shifts()
    rate = float(rng.uniform(0.002, 0.03))
    for at in np.flatnonzero(rng.random(num_iterations) < rate):
        length = 1 if rng.random() < 0.7 else 2
        s.transient(int(at), rng.uniform(1.2, 4.0, length))
    return s.done("loader_stalls", steps=num_fail_slows)


def seqlen_mix(rng: np.random.Generator, *, num_iterations: int, num_fail_slows: int = 0):
    """Multi-modal iteration times: 2-4 modes within +-4% of the healthy time (the
    sequence-length buckets of a data mix), drawn i.i.d. or sticky (a mode stays
    with probability up to 0.6).

    The modes stay less than 10% apart: a mode 10% above another that the series
    dwells on for 4 or more iterations at a time, but rarely (under 5% of the
    iterations), is what a short fail-slow looks like, and the detector's rule
    (:class:`~greyhound.analytics.verify.VerifyConfig`) reports it."""
    s = _Series(rng, num_iterations, jitter=float(rng.uniform(0.003, 0.01)))
    modes = np.log1p(rng.uniform(-0.04, 0.04, int(rng.integers(2, 5))))
    weights = rng.dirichlet(np.ones(len(modes)))
    stay = float(rng.uniform(0.0, 0.6))
    pick = np.empty(num_iterations, dtype=np.int64)
    draws = rng.choice(len(modes), size=num_iterations, p=weights)
    keep = rng.random(num_iterations) < stay
    pick[0] = draws[0]
    for i in range(1, num_iterations):
        pick[i] = pick[i - 1] if keep[i] else draws[i]
    s.log_x += modes[pick] - np.median(modes[pick])
    s.gaussian_jitter()
    return s.done("seqlen_mix", steps=num_fail_slows)


def warmup(rng: np.random.Generator, *, num_iterations: int, num_fail_slows: int = 0):
    """A partial first iteration (0.5-0.95x, as a trace cut mid-iteration gives) and/or
    1-8 slow warm-up iterations (1.2-5x, decaying), then GC pauses."""
    s = _Series(rng, num_iterations)
    s.gaussian_jitter()
    kind = rng.choice(["partial", "slow", "both"])
    if kind in ("slow", "both"):
        count = int(rng.integers(1, 9))
        first = float(rng.uniform(1.2, 5.0))
        s.log_x[:count] += np.log(first) * np.linspace(1.0, 1.0 / count, count)
    if kind in ("partial", "both"):
        s.log_x[0] = np.log(s.base * rng.uniform(0.5, 0.95))
    _gc(s, burst_prob=0.2)
    return s.done("warmup", steps=num_fail_slows)


def steps(rng: np.random.Generator, *, num_iterations: int, num_fail_slows: int = 0):
    """Fail-slow steps of several severities, 1.1-3x, each followed by recovery; GC
    pauses as background."""
    s = _with_gc(rng, num_iterations, burst_prob=0.1)
    return s.done("steps", steps=num_fail_slows)


def ramps(rng: np.random.Generator, *, num_iterations: int, num_fail_slows: int = 0):
    """Fail-slows that creep in linearly (in log time) over 10-60 iterations to
    1.15-2.5x, hold, and end."""
    s = _with_gc(rng, num_iterations, burst_prob=0.1)
    if num_fail_slows:
        for onset, end in s.place(num_fail_slows, lambda: _log_uniform_int(s.rng, 80, 600)):
            s.fail_slow(onset, end, float(rng.uniform(1.15, 2.5)), int(rng.integers(10, 61)))
    return s.done("ramps")


def short_episodes(rng: np.random.Generator, *, num_iterations: int, num_fail_slows: int = 0):
    """True fail-slows of only 5-15 iterations, 1.3-3x (a brief CPU contention)."""
    s = _with_gc(rng, num_iterations, burst_prob=0.1, jitter=float(rng.uniform(0.003, 0.02)))
    if num_fail_slows:
        for onset, end in s.place(num_fail_slows, lambda: int(s.rng.integers(5, 16))):
            s.fail_slow(onset, end, float(rng.uniform(1.3, 3.0)))
    return s.done("short_episodes")


def relapses(rng: np.random.Generator, *, num_iterations: int, num_fail_slows: int = 0):
    """A fail-slow (30-300 iterations, 1.2-2.5x), a short recovery (10-30), a relapse
    (30-300, 1.15-2x): both episodes must be found, the recovery between them too."""
    s = _with_gc(rng, num_iterations, burst_prob=0.1)
    if num_fail_slows:
        # One relapse pair per slot (the count asked for, as pairs).
        slots = max(1, num_fail_slows // 2 + num_fail_slows % 2)
        for onset, end in s.place(slots, lambda: _log_uniform_int(s.rng, 80, 700)):
            span = end - onset
            first = max(30, int(rng.integers(30, max(31, (span - 30) // 2 + 1))))
            gap = int(rng.integers(10, 31))
            second_on = min(onset + first + gap, end - 30)
            first_end = max(onset + 20, second_on - gap)
            s.fail_slow(onset, first_end, float(rng.uniform(1.2, 2.5)))
            s.fail_slow(second_on, end, float(rng.uniform(1.15, 2.0)))
    return s.done("relapses")


def mixed(rng: np.random.Generator, *, num_iterations: int, num_fail_slows: int = 0):
    """:func:`~greyhound.analytics.synthetic.iteration_series` (every noise source in
    one job), as a :class:`JobTruth`."""
    x, t = iteration_series(rng, num_iterations=num_iterations, num_fail_slows=num_fail_slows)
    truth = JobTruth(generator="mixed", fail_slows=t.fail_slows, transients=(), base=t.base,
                     jitter=t.jitter)
    return x, truth


GENERATORS: dict[str, Callable[..., tuple[np.ndarray, JobTruth]]] = {
    f.__name__: f
    for f in (gc_pauses, gc_bursts, heavy_tailed, ar1_jitter, periodic_eval, loader_stalls,
              seqlen_mix, warmup, steps, ramps, short_episodes, relapses, mixed)
}
"""Every generator by name: ``f(rng, *, num_iterations, num_fail_slows=0) -> (x, truth)``."""

SPLITS = {"tune": 1, "heldout": 2}
"""Seed streams of the splits: no job of one split shares a seed with the other."""


def labelled_set(
    *,
    split: str,
    jobs_per_generator: int,
    generators: tuple[str, ...] | None = None,
    positive_fraction: float = 0.5,
    min_iterations: int = 300,
    max_iterations: int = 2000,
    seed: int = 0,
) -> list[Job]:
    """Labelled jobs from every generator (or those named), from the split's seeds.

    Job k of generator g has the seed sequence (seed, split id, g's index, k): any job
    can be regenerated alone, and the splits never share one. (So a set is defined by
    ``seed``, not by an ``rng``: it makes each job's generator from its own sequence,
    the one place this module makes one; the generators take it.) The first
    ``round(jobs_per_generator * positive_fraction)`` jobs of each generator are
    positive (1-3 fail-slows; relapses come as pairs), the rest healthy.

    Returns:
        Jobs, generator by generator.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    names = tuple(GENERATORS) if generators is None else generators
    unknown = [g for g in names if g not in GENERATORS]
    if unknown:
        raise ValueError(f"unknown generator(s) {', '.join(unknown)}")
    num_pos = round(jobs_per_generator * positive_fraction)
    out = []
    for name in names:
        index = list(GENERATORS).index(name)
        for k in range(jobs_per_generator):
            entropy = (seed, SPLITS[split], index, k)
            rng = np.random.default_rng(np.random.SeedSequence(entropy))
            n = int(rng.integers(min_iterations, max_iterations + 1))
            count = 0
            if k < num_pos:
                count = int(rng.choice([1, 1, 2, 3])) if n >= 600 else 1
                if name == "relapses":
                    count = 2
            x, truth = GENERATORS[name](rng, num_iterations=n, num_fail_slows=count)
            out.append(Job(x=x, truth=truth, seed=entropy))
    return out


def render_calls(
    rng: np.random.Generator,
    x: np.ndarray,
    *,
    layout: str = "ddp",
    warmup_calls: int = 40,
    first_call_at: tuple[float, float] | None = None,
    pause: np.ndarray | None = None,
) -> tuple[CallTrace, np.ndarray]:
    """One rank's calls for iteration times ``x``: iteration i starts at
    ``sum(x[:i])``; its compute (x[i] less its pause) is spread over fixed fractions
    of it where the calls sit, the first one at a fraction drawn from
    ``first_call_at`` ("ddp": the bucket AllReduces evenly from there to 0.9, the loss
    AllReduce at 0.93; "hybrid": the rest at random fractions up to 0.95); its pause,
    if any, sits at a random point of it (calls after that point wait for it).
    Warm-up Broadcasts and a Barrier come first.

    Where the first call sits matters: an iteration is measured from its first call
    to the next iteration's (:class:`~greyhound.analytics.period.IterationClock`), so
    a slowdown spread over an iteration's compute shows partly (that fraction) in the
    measured iteration before it; a pause shows in one measured iteration.

    Args:
        rng: the random generator.
        x: (n,) iteration times, seconds.
        layout: "ddp" (3 bucket AllReduces and a loss AllReduce per iteration) or
            "hybrid" (:func:`~greyhound.analytics.synthetic.hybrid_pattern` with TP 2,
            PP 2, 4 micro-batches and 2 layers).
        warmup_calls: Broadcast calls before the first iteration (the last one a
            Barrier).
        first_call_at: range of the first call's offset, as a fraction of the
            iteration; default (0.3, 0.6) for "ddp" (the first gradient bucket's
            AllReduce comes in the middle of the backward pass) and (0, 0.05) for
            "hybrid" (the first pipeline Recv opens the forward pass).
        pause: (n,) seconds of each iteration that are one pause (``truth.pause``);
            default none.

    Returns:
        (trace, iteration_start): iteration_start is (n + 1,) seconds.
    """
    x = np.asarray(x, dtype=np.float64)
    pattern = _LAYOUTS.get(layout)
    if pattern is None:
        raise ValueError(f"layout must be 'ddp' or 'hybrid', got {layout!r}")
    offsets = _call_offsets(rng, layout, len(pattern), first_call_at)
    starts = 1.0 + warmup_calls * 1e-3 + np.concatenate(([0.0], np.cumsum(x)))
    held = np.zeros(len(x)) if pause is None else np.clip(np.asarray(pause, float), 0.0, x)
    compute = x - held
    at = rng.random(len(x))
    times = (starts[:-1, None] + offsets[None, :] * compute[:, None]
             + np.where(offsets[None, :] > at[:, None], held[:, None], 0.0)).reshape(-1)
    op, comm, nbytes = (np.array(column * len(x), dtype=np.int64)
                        for column in map(list, zip(*pattern)))
    w_sizes = rng.integers(1, 64, warmup_calls) << 16
    w_ops = np.full(warmup_calls, ring.OP["Broadcast"], dtype=np.int64)
    if warmup_calls:
        w_ops[-1], w_sizes[-1] = ring.OP["Barrier"], 0
    trace = CallTrace(
        op=np.concatenate((w_ops, op)),
        comm=np.concatenate((np.full(warmup_calls, COMM_WORLD, dtype=np.int64), comm)),
        nbytes=np.concatenate((w_sizes, nbytes)),
        time=np.concatenate((1.0 + np.arange(warmup_calls) * 1e-3, times)),
    )
    return trace, starts


_LAYOUTS = {
    "ddp": [(ring.OP["AllReduce"], COMM_DP, 25 << 20)] * 3
    + [(ring.OP["AllReduce"], COMM_WORLD, 8)],
    "hybrid": hybrid_pattern(tp=2, pp=2, microbatches=4, layers=2),
}
"""Calls per iteration of :func:`render_calls`' layouts (op code, comm id, bytes)."""


def _call_offsets(
    rng: np.random.Generator, layout: str, num_calls: int, first_call_at: tuple[float, float] | None
) -> np.ndarray:
    """(num_calls,) increasing fractions of an iteration's compute where its calls sit."""
    if first_call_at is None:
        first_call_at = (0.3, 0.6) if layout == "ddp" else (0.0, 0.05)
    first = rng.uniform(*first_call_at)
    if layout == "ddp":
        # Gradient buckets through the backward pass, the loss AllReduce at its end.
        offsets = np.concatenate((np.linspace(first, 0.9, num_calls - 1), [0.93]))
    else:
        offsets = np.sort(np.concatenate(([first], rng.uniform(first, 0.95, num_calls - 1))))
    offsets[1:] = np.maximum(offsets[1:], offsets[:-1] + 1e-6)
    return offsets


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobScore:
    """How one detection did on one labelled job."""

    positive: bool
    flagged: bool
    """The detection's ``fail_slow``."""
    episodes: int
    found: int
    """Fail-slows matched by a slower change point (see :func:`score_job`)."""
    delays: tuple[int, ...]
    """detected_at - detectable onset, per found fail-slow."""
    false_intervals: int
    """Slow intervals that overlap no fail-slow."""
    spurious_changepoints: int
    """Slower change points (ratio > 1) outside every fail-slow (false onsets)."""

    @property
    def correct(self) -> bool:
        """The job's fail_slow flag is right."""
        return self.flagged == self.positive


def score_job(
    truth: JobTruth,
    changepoints: list,
    slow_intervals: list,
    *,
    fail_slow: bool | None = None,
    slack: int = 3,
) -> JobScore:
    """Score one detection against its truth.

    A fail-slow [onset, end) is found when a change point with ratio > 1 has its
    index in [onset - ``slack``, end) and was reported (``detected_at``) before the
    fail-slow ended: an online detector must say so while it lasts. Its delay is
    counted from the first iteration whose injected slowdown reaches 10%
    (:meth:`JobTruth.detectable_onset`: the onset of a step, later inside a ramp).
    A slow interval is false when it overlaps no [onset - ``slack``, end + 15).

    Args:
        truth: the job's truth.
        changepoints: objects with ``index``, ``detected_at``, ``ratio``.
        slow_intervals: objects with ``start_index``, ``end_index`` (None = open).
        fail_slow: the detection's flag (default: any slow interval).
    """
    flagged = bool(slow_intervals) if fail_slow is None else bool(fail_slow)
    found, delays = 0, []
    for fs in truth.fail_slows:
        hits = [c for c in changepoints
                if c.ratio > 1 and fs.onset - slack <= c.index < fs.end and c.detected_at < fs.end]
        if hits:
            found += 1
            delays.append(int(hits[0].detected_at - truth.detectable_onset(fs)))
    false_intervals = 0
    for si in slow_intervals:
        end = 1 << 62 if si.end_index is None else si.end_index
        if not any(si.start_index < fs.end + 15 and end > fs.onset - slack
                   for fs in truth.fail_slows):
            false_intervals += 1
    spurious = 0
    for c in changepoints:
        if c.ratio > 1 and not any(fs.onset - slack <= c.index < fs.end for fs in truth.fail_slows):
            spurious += 1
    return JobScore(
        positive=truth.positive, flagged=flagged, episodes=len(truth.fail_slows),
        found=found, delays=tuple(delays), false_intervals=false_intervals,
        spurious_changepoints=spurious,
    )


def summarize(scores: list[JobScore], *, iterations: int | None = None) -> dict:
    """Accuracy (fail_slow flag right per job), false-positive rate on healthy jobs,
    false-negative rate, episode recall, detection delay, false slow intervals."""
    pos = [s for s in scores if s.positive]
    neg = [s for s in scores if not s.positive]
    delays = [d for s in scores for d in s.delays]
    episodes = sum(s.episodes for s in scores)
    out: dict[str, Any] = {
        "jobs": len(scores),
        "accuracy": sum(s.correct for s in scores) / len(scores) if scores else None,
        "correct": sum(s.correct for s in scores),
        "negatives": len(neg),
        "false_positives": sum(s.flagged for s in neg),
        "fpr": sum(s.flagged for s in neg) / len(neg) if neg else None,
        "positives": len(pos),
        "false_negatives": sum(not s.flagged for s in pos),
        "fnr": sum(not s.flagged for s in pos) / len(pos) if pos else None,
        "episodes": episodes,
        "episodes_found": sum(s.found for s in scores),
        "episode_recall": sum(s.found for s in scores) / episodes if episodes else None,
        "false_slow_intervals": sum(s.false_intervals for s in scores),
        "jobs_with_false_slow_interval": sum(s.false_intervals > 0 for s in scores),
        "spurious_changepoints": sum(s.spurious_changepoints for s in scores),
        "delay": None,
    }
    if delays:
        out["delay"] = {
            "median": float(np.median(delays)), "p90": float(np.percentile(delays, 90)),
            "mean": float(np.mean(delays)), "max": int(max(delays)), "n": len(delays),
        }
    if iterations:
        out["iterations"] = iterations
        out["spurious_changepoints_per_10k"] = 1e4 * out["spurious_changepoints"] / iterations
    return out


def ring_records(
    trace: CallTrace,
    *,
    rng: np.random.Generator | None = None,
    async_fraction: float = 0.0,
    duration: float = 0.2,
) -> np.ndarray:
    """A call trace as the hook's ring records (``greyhound.ring.RECORD_DTYPE``).

    Each call becomes one record (op, comm_id, size_bytes, t_start_ns; t_end_ns
    ``duration`` of the gap to the next call later). With ``async_fraction``, that share
    of the calls (at random) are async (F_ASYNC, t_end_ns right after the start) and
    a WAIT record with their req_id follows, at their completion; a GROUP record sits
    before each iteration's first call now and then. ``seq`` numbers all records.

    Args:
        trace: the calls.
        rng: for the async calls and the extra records (required when async_fraction > 0).
        async_fraction: share of calls made async.
        duration: a blocking call lasts this share of the gap to the next call.

    Returns:
        (m,) records in ring order, m >= number of calls.
    """
    n = len(trace.time)
    t_ns = np.rint(trace.time * 1e9).astype(np.uint64)
    gap = np.diff(t_ns, append=t_ns[-1:] + np.uint64(1_000_000) if n else t_ns).astype(np.int64)
    end = t_ns + np.maximum(1, (gap * duration).astype(np.int64)).astype(np.uint64)
    calls = np.zeros(n, dtype=ring.RECORD_DTYPE)
    calls["op"] = trace.op
    calls["comm_id"] = trace.comm.astype(np.uint64)
    calls["size_bytes"] = trace.nbytes.astype(np.uint64)
    calls["t_start_ns"] = t_ns
    calls["t_end_ns"] = end
    calls["peer"] = -1
    calls["source"] = 2
    if async_fraction <= 0:
        calls["seq"] = np.arange(1, n + 1)
        return calls
    if rng is None:
        raise ValueError("ring_records: async_fraction > 0 needs an rng")
    is_async = rng.random(n) < async_fraction
    calls["flags"][is_async] = ring.F_ASYNC
    calls["req_id"][is_async] = np.arange(1, int(is_async.sum()) + 1)
    calls["t_end_ns"][is_async] = t_ns[is_async] + np.uint64(1000)
    waits = np.zeros(int(is_async.sum()), dtype=ring.RECORD_DTYPE)
    waits["op"] = ring.OP["Wait"]
    waits["req_id"] = calls["req_id"][is_async]
    waits["t_start_ns"] = end[is_async]
    waits["t_end_ns"] = end[is_async]
    waits["comm_id"] = calls["comm_id"][is_async]
    groups = np.zeros(int(n // 50), dtype=ring.RECORD_DTYPE)
    at = np.sort(rng.choice(n, size=len(groups), replace=False)) if len(groups) else np.zeros(0, int)
    groups["op"] = ring.OP["Group"]
    groups["t_start_ns"] = t_ns[at]
    groups["t_end_ns"] = t_ns[at]
    # Order: a call at its start time; a WAIT at its end time; a GROUP just before the
    # call it precedes.
    keys = np.concatenate((t_ns.astype(np.float64), waits["t_end_ns"].astype(np.float64) + 0.5,
                           groups["t_start_ns"].astype(np.float64) - 0.5))
    out = np.concatenate((calls, waits, groups))[np.argsort(keys, kind="stable")]
    out["seq"] = np.arange(1, len(out) + 1)
    return out
