"""Seeded generators of labelled iteration-time series and per-rank call traces.

They stand in for production traces when measuring detection quality: every noise
source the paper names as a cause of false alarms is there (jitter, Python garbage
collection, allocator cache misses, uneven sequence lengths), plus rare single outliers
and small benign level shifts, and fail-slows of 1.1-2x lasting 20-600 iterations,
some creeping in as a ramp. Each generator takes the caller's ``rng`` and returns
(signal, truth). Call traces carry the hook's op codes (:data:`greyhound.ring.OP`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from greyhound.ring import OP

__all__ = [
    "COMM_TP",
    "COMM_PP",
    "COMM_DP",
    "COMM_WORLD",
    "FailSlow",
    "SeriesTruth",
    "TraceTruth",
    "CallTrace",
    "iteration_series",
    "labelled_series",
    "call_trace",
    "hybrid_pattern",
]

COMM_TP, COMM_PP, COMM_DP, COMM_WORLD = 0x1A, 0x2B, 0x3C, 0x4D
"""Communicator ids of generated traces: tensor-, pipeline-, data-parallel, world."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FailSlow:
    """One injected fail-slow: iterations [onset, end) run ``factor`` times slower."""

    onset: int
    end: int
    factor: float
    ramp: int
    """Iterations over which the slowdown grows linearly to ``factor`` (0 = a step)."""

    def profile(self) -> np.ndarray:
        """(end - onset,) share of log(factor) each iteration carries: 1/ramp, 2/ramp,
        ..., 1 over the ramp, then 1."""
        shape = np.ones(self.end - self.onset)
        if self.ramp:
            shape[: self.ramp] = np.arange(1, self.ramp + 1) / self.ramp
        return shape


@dataclasses.dataclass(frozen=True, kw_only=True)
class SeriesTruth:
    """What went into a generated series."""

    fail_slows: tuple[FailSlow, ...]
    base: float
    jitter: float
    level_shifts: tuple[tuple[int, float], ...]
    """(index, factor) of benign shifts (|factor - 1| <= 5%)."""

    @property
    def positive(self) -> bool:
        return bool(self.fail_slows)


def iteration_series(
    rng: np.random.Generator,
    *,
    num_iterations: int,
    num_fail_slows: int = 0,
    base: float | None = None,
) -> tuple[np.ndarray, SeriesTruth]:
    """One job's iteration times with a random, realistic noise profile.

    Noise (all multiplicative): log-normal jitter of 0.5-3%; a drift of 0.5-2% from
    the mix of sequence lengths (AR(1), correlation time ~200 iterations); a
    garbage-collection pause every 40-300 iterations (+10-80%); allocator cache misses
    (up to 2% of iterations, +3-15%); single outliers (0.05-0.3% of iterations,
    1.5-3x); 0-3 benign level shifts of 2-5%, together within +-5%.

    Args:
        rng: the random generator (the caller seeds it).
        num_iterations: series length, >= 200 when fail-slows are asked for.
        num_fail_slows: fail-slows to inject (non-overlapping, 1.1-2x, 20-600
            iterations, 30% of them ramping in over 5-40 iterations).
        base: healthy iteration time in seconds; default log-uniform in [0.3, 10].

    Returns:
        (x, truth): x is (num_iterations,) float64 seconds.
    """
    n = num_iterations
    if n < 1:
        raise ValueError(f"num_iterations must be >= 1, got {n}")
    base = float(np.exp(rng.uniform(np.log(0.3), np.log(10.0)))) if base is None else base
    jitter = float(rng.uniform(0.005, 0.03))
    log_x = np.full(n, np.log(base)) + rng.normal(0.0, jitter, n)
    # Sequence-length drift: AR(1) with stationary std drift_sd.
    drift_sd, phi = rng.uniform(0.005, 0.02), 0.995
    shocks = rng.normal(0.0, drift_sd * np.sqrt(1 - phi * phi), n)
    drift = np.empty(n)
    level = rng.normal(0.0, drift_sd)
    for i in range(n):
        level = phi * level + shocks[i]
        drift[i] = level
    log_x += drift
    gc_every = int(rng.integers(40, 301))
    gc_at = np.arange(int(rng.integers(0, gc_every)), n, gc_every)
    gc_at = np.clip(gc_at + rng.integers(-3, 4, len(gc_at)), 0, n - 1)
    log_x[gc_at] += np.log1p(rng.uniform(0.1, 0.8, len(gc_at)))
    misses = np.flatnonzero(rng.random(n) < rng.uniform(0.0, 0.02))
    log_x[misses] += np.log1p(rng.uniform(0.03, 0.15, len(misses)))
    outliers = np.flatnonzero(rng.random(n) < rng.uniform(0.0005, 0.003))
    log_x[outliers] += np.log(rng.uniform(1.5, 3.0, len(outliers)))
    drawn = []
    for _ in range(min(int(rng.poisson(1.0)), 3)):
        at = int(rng.integers(1, n))
        drawn.append((at, float(rng.choice([-1, 1]) * rng.uniform(0.02, 0.05))))
    # Together the shifts stay within +-5%: shifts adding up to 10% would be a
    # fail-slow by the detector's rule, not a benign shift.
    shifts, total = [], 0.0
    for at, change in sorted(drawn):
        if abs(total + change) > 0.05:
            change = -change
        total += change
        log_x[at:] += np.log(1.0 + change)
        shifts.append((at, 1.0 + change))
    fail_slows = _place_fail_slows(rng, n, num_fail_slows)
    for fs in fail_slows:
        log_x[fs.onset : fs.end] += np.log(fs.factor) * fs.profile()
    truth = SeriesTruth(
        fail_slows=tuple(fail_slows), base=base, jitter=jitter,
        level_shifts=tuple(sorted(shifts)),
    )
    return np.exp(log_x), truth


def _place_fail_slows(rng: np.random.Generator, n: int, count: int) -> list[FailSlow]:
    if count == 0:
        return []
    if n < 200 * count:
        raise ValueError(f"{count} fail-slows need >= {200 * count} iterations, got {n}")
    out: list[FailSlow] = []
    # Split the series into `count` equal slots; one event per slot, 60 iterations of
    # healthy warm-up first so the detector has a level to compare with.
    slot = n // count
    for k in range(count):
        lo, hi = k * slot + 60, (k + 1) * slot - 30
        duration = int(np.exp(rng.uniform(np.log(20), np.log(600))))
        duration = min(duration, hi - lo - 1)
        onset = int(rng.integers(lo, hi - duration))
        ramp = int(rng.integers(5, 41)) if rng.random() < 0.3 else 0
        ramp = min(ramp, duration // 2)
        out.append(
            FailSlow(onset=onset, end=onset + duration,
                     factor=float(rng.uniform(1.1, 2.0)), ramp=ramp)
        )
    return out


def labelled_series(
    rng: np.random.Generator,
    *,
    num_jobs: int,
    positive_fraction: float = 0.5,
    min_iterations: int = 1000,
    max_iterations: int = 3000,
) -> list[tuple[np.ndarray, SeriesTruth]]:
    """A labelled set of jobs; positives carry one (70%) or two fail-slows (two only
    in jobs of >= 400 iterations).

    Args:
        rng: the random generator (the caller seeds it).

    Returns:
        [(x, truth)] in job order; round(num_jobs * positive_fraction) of them are
        positives, spread at random.
    """
    positives = set(
        rng.choice(num_jobs, size=round(num_jobs * positive_fraction), replace=False).tolist()
    )
    out = []
    for job in range(num_jobs):
        n = int(rng.integers(min_iterations, max_iterations + 1))
        count = (1 if rng.random() < 0.7 or n < 400 else 2) if job in positives else 0
        out.append(iteration_series(rng, num_iterations=n, num_fail_slows=count))
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class TraceTruth:
    """What went into a generated call trace."""

    iteration_start: np.ndarray
    """(num_iterations + 1,) seconds; iteration i runs [start[i], start[i + 1])."""
    call_iteration: np.ndarray
    """(num_calls,) iteration of each call, -1 for warm-up calls."""
    calls_per_iteration: int
    fail_slows: tuple[FailSlow, ...]

    @property
    def iteration_times(self) -> np.ndarray:
        return np.diff(self.iteration_start)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CallTrace:
    """One rank's calls: op codes (:data:`greyhound.ring.OP`), comm ids, bytes, start
    times (seconds), each (num_calls,)."""

    op: np.ndarray
    comm: np.ndarray
    nbytes: np.ndarray
    time: np.ndarray


def hybrid_pattern(
    *, tp: int = 2, pp: int = 2, microbatches: int = 4, layers: int = 4
) -> list[tuple[int, int, int]]:
    """One iteration's calls of a middle-stage rank in a TP x DP x PP job (1F1B), as
    (op code, comm id, bytes).

    Per micro-batch: Recv activations (pp > 1), one TP AllReduce per layer (tp > 1; a
    burst of identical calls), Send activations (pp > 1); then the same backwards; at
    the iteration's end a ReduceScatter + AllGather of the gradients over DP and an
    8-byte AllReduce of the loss.
    """
    act_bytes, grad_bytes = 4 << 20, 256 << 20
    pattern: list[tuple[int, int, int]] = []
    for direction in range(2):
        for _ in range(microbatches):
            if pp > 1:
                pattern.append((OP["Recv"], COMM_PP, act_bytes))
            if tp > 1:
                pattern += [(OP["AllReduce"], COMM_TP, act_bytes * (1 + direction))] * layers
            if pp > 1:
                pattern.append((OP["Send"], COMM_PP, act_bytes))
    pattern += [(OP["ReduceScatter"], COMM_DP, grad_bytes),
                (OP["AllGather"], COMM_DP, grad_bytes), (OP["AllReduce"], COMM_WORLD, 8)]
    return pattern


class _Calls:
    """A call trace under construction, one call at a time."""

    def __init__(self) -> None:
        self.t = 0.0
        """Seconds: the time of the next call."""
        self._op: list[int] = []
        self._comm: list[int] = []
        self._nbytes: list[int] = []
        self._time: list[float] = []
        self._owner: list[int] = []

    def add(self, op: int, comm: int, size: int, owner: int) -> None:
        """A call at time ``t`` of iteration ``owner`` (-1: warm-up)."""
        self._op.append(op)
        self._comm.append(comm)
        self._nbytes.append(size)
        self._time.append(self.t)
        self._owner.append(owner)

    def done(self) -> tuple[CallTrace, np.ndarray]:
        """(trace, call_iteration)."""
        trace = CallTrace(
            op=np.array(self._op, dtype=np.int64), comm=np.array(self._comm, dtype=np.int64),
            nbytes=np.array(self._nbytes, dtype=np.int64), time=np.array(self._time),
        )
        return trace, np.array(self._owner, dtype=np.int64)


def _slowdown(fail_slows: tuple[FailSlow, ...], num_iterations: int) -> np.ndarray:
    """(num_iterations,) factor each iteration's compute runs slower by."""
    factor = np.ones(num_iterations)
    for fs in fail_slows:
        if not 0 <= fs.onset < fs.end <= num_iterations:
            raise ValueError(f"fail-slow {fs} must lie within the {num_iterations} iterations")
        factor[fs.onset : fs.end] *= fs.factor ** fs.profile()
    return factor


def call_trace(
    rng: np.random.Generator,
    *,
    num_iterations: int,
    tp: int = 2,
    pp: int = 2,
    microbatches: int = 4,
    layers: int = 4,
    warmup_calls: int = 120,
    iteration_time: float = 1.0,
    jitter: float = 0.01,
    eval_every: int = 0,
    fail_slows: tuple[FailSlow, ...] = (),
) -> tuple[CallTrace, TraceTruth]:
    """One middle-stage rank's calls in a TP x DP x PP job (Megatron-like, 1F1B).

    Each iteration makes the calls of :func:`hybrid_pattern`. Warm-up: parameter
    Broadcasts of varying size and a Barrier. With ``eval_every``, every such
    iteration ends with an extra Barrier + AllReduce (an evaluation step), which breaks
    the period once.

    Compute between calls has log-normal jitter, per call and per iteration; a
    fail-slow multiplies every gap of its iterations; a garbage-collection pause hits
    every 50th iteration.

    Args:
        rng: the random generator (the caller seeds it).

    Returns:
        (trace, truth).
    """
    pattern = hybrid_pattern(tp=tp, pp=pp, microbatches=microbatches, layers=layers)
    period = len(pattern)
    # Gap before each call of the pattern, and the optimizer step after the last one;
    # they sum to iteration_time.
    weights = rng.uniform(0.5, 1.5, period + 1)
    gaps = iteration_time * weights / weights.sum()
    factor = _slowdown(fail_slows, num_iterations)
    calls = _Calls()
    for k in range(warmup_calls):
        last = k == warmup_calls - 1
        size = 0 if last else int(rng.integers(1, 64)) << 16
        calls.t += float(rng.uniform(1e-4, 1e-3))
        calls.add(OP["Barrier"] if last else OP["Broadcast"], COMM_WORLD, size, -1)
    starts = np.empty(num_iterations + 1)
    for i in range(num_iterations):
        starts[i] = calls.t
        # Per-call compute jitter, and one factor for the whole iteration (its
        # sequence lengths).
        noise = np.exp(rng.normal(0.0, jitter, period + 1) + rng.normal(0.0, jitter)) * factor[i]
        if i % 50 == 49:
            noise[int(rng.integers(0, period + 1))] += 0.3 * period
        for j, (op, comm, size) in enumerate(pattern):
            calls.t += gaps[j] * noise[j]
            calls.add(op, comm, size, i)
        if eval_every and i % eval_every == eval_every - 1:
            for op, size in ((OP["Barrier"], 0), (OP["AllReduce"], 8)):
                calls.t += gaps[-1] * 0.1
                calls.add(op, COMM_WORLD, size, i)
        calls.t += gaps[-1] * noise[-1]
    starts[num_iterations] = calls.t
    trace, owner = calls.done()
    truth = TraceTruth(
        iteration_start=starts, call_iteration=owner,
        calls_per_iteration=period, fail_slows=tuple(fail_slows),
    )
    return trace, truth
