"""Seeded generators of labelled iteration-time series and per-rank call traces.

They stand in for production traces when measuring detection quality: every noise
source the paper names as a cause of false alarms is there (jitter, Python garbage
collection, allocator cache misses, uneven sequence lengths), plus rare single outliers
and small benign level shifts, and fail-slows of 1.1-2x lasting 20-600 iterations,
some creeping in as a ramp. Each generator returns (signal, truth).
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = [
    "OP_NAMES",
    "FailSlow",
    "SeriesTruth",
    "TraceTruth",
    "CallTrace",
    "iteration_series",
    "labelled_series",
    "call_trace",
]

OP_NAMES = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Send", "Recv", "Barrier")
"""Op names of generated call traces; a trace's ``op`` holds indices into this."""
_AR, _AG, _RS, _BC, _SEND, _RECV, _BARRIER = range(len(OP_NAMES))


@dataclasses.dataclass(frozen=True, kw_only=True)
class FailSlow:
    """One injected fail-slow: iterations [onset, end) run ``factor`` times slower."""

    onset: int
    end: int
    factor: float
    ramp: int
    """Iterations over which the slowdown grows linearly to ``factor`` (0 = a step)."""


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
        ramp = np.ones(fs.end - fs.onset)
        if fs.ramp:
            ramp[: fs.ramp] = np.arange(1, fs.ramp + 1) / fs.ramp
        log_x[fs.onset : fs.end] += np.log(fs.factor) * ramp
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
    *,
    seed: int,
    num_jobs: int,
    positive_fraction: float = 0.5,
    min_iterations: int = 1000,
    max_iterations: int = 3000,
) -> list[tuple[np.ndarray, SeriesTruth]]:
    """A labelled set of jobs; positives carry one (70%) or two fail-slows (two only
    in jobs of >= 400 iterations).

    Returns:
        [(x, truth)] in job order; the first round(num_jobs * positive_fraction) jobs
        are not the positives, positives are spread at random.
    """
    rng = np.random.default_rng(seed)
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
    """One rank's calls: op indices into :data:`OP_NAMES`, comm ids, bytes, start times."""

    op: np.ndarray
    comm: np.ndarray
    nbytes: np.ndarray
    time: np.ndarray


def call_trace(
    *,
    seed: int,
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

    Per micro-batch: Recv activations (pp > 1), one TP AllReduce per layer (tp > 1; a
    burst of identical calls), Send activations (pp > 1); then the same backwards; at the iteration's
    end a ReduceScatter + AllGather of the gradients over DP and an 8-byte AllReduce of
    the loss. Warm-up: parameter Broadcasts of varying size and a Barrier. With
    ``eval_every``, every such iteration ends with an extra Barrier + AllReduce (an
    evaluation step), which breaks the period once.

    Compute between calls has log-normal jitter, per call and per iteration; a
    fail-slow multiplies every gap of its iterations; a garbage-collection pause hits every 50th iteration.

    Returns:
        (trace, truth).
    """
    rng = np.random.default_rng(seed)
    comm_tp, comm_pp, comm_dp, comm_world = 0x1A, 0x2B, 0x3C, 0x4D
    act_bytes, grad_bytes = 4 << 20, 256 << 20
    pattern: list[tuple[int, int, int]] = []
    for direction in range(2):
        for _ in range(microbatches):
            if pp > 1:
                pattern.append((_RECV, comm_pp, act_bytes))
            if tp > 1:
                pattern += [(_AR, comm_tp, act_bytes * (1 + direction))] * layers
            if pp > 1:
                pattern.append((_SEND, comm_pp, act_bytes))
    pattern += [(_RS, comm_dp, grad_bytes), (_AG, comm_dp, grad_bytes), (_AR, comm_world, 8)]
    period = len(pattern)
    # Gap before each call of the pattern, and the optimizer step after the last one;
    # they sum to iteration_time.
    weights = rng.uniform(0.5, 1.5, period + 1)
    gaps = iteration_time * weights / weights.sum()
    factor = np.ones(num_iterations)
    for fs in fail_slows:
        if not 0 <= fs.onset < fs.end <= num_iterations:
            raise ValueError(f"fail-slow {fs} must lie within the {num_iterations} iterations")
        ramp = np.ones(fs.end - fs.onset)
        if fs.ramp:
            ramp[: fs.ramp] = np.arange(1, fs.ramp + 1) / fs.ramp
        factor[fs.onset : fs.end] *= fs.factor**ramp
    ops, comms, sizes, times, owner = [], [], [], [], []
    t = 0.0
    for k in range(warmup_calls):
        last = k == warmup_calls - 1
        ops.append(_BARRIER if last else _BC)
        comms.append(comm_world)
        sizes.append(0 if last else int(rng.integers(1, 64)) << 16)
        t += float(rng.uniform(1e-4, 1e-3))
        times.append(t)
        owner.append(-1)
    starts = np.empty(num_iterations + 1)
    for i in range(num_iterations):
        starts[i] = t
        # Per-call compute jitter, and one factor for the whole iteration (its
        # sequence lengths).
        noise = np.exp(rng.normal(0.0, jitter, period + 1) + rng.normal(0.0, jitter)) * factor[i]
        if i % 50 == 49:
            noise[int(rng.integers(0, period + 1))] += 0.3 * period
        for j, (op, comm, size) in enumerate(pattern):
            t += gaps[j] * noise[j]
            ops.append(op)
            comms.append(comm)
            sizes.append(size)
            times.append(t)
            owner.append(i)
        if eval_every and i % eval_every == eval_every - 1:
            for op, size in ((_BARRIER, 0), (_AR, 8)):
                t += gaps[-1] * 0.1
                ops.append(op)
                comms.append(comm_world)
                sizes.append(size)
                times.append(t)
                owner.append(i)
        t += gaps[-1] * noise[-1]
    starts[num_iterations] = t
    trace = CallTrace(
        op=np.array(ops, dtype=np.int64), comm=np.array(comms, dtype=np.int64),
        nbytes=np.array(sizes, dtype=np.int64), time=np.array(times),
    )
    truth = TraceTruth(
        iteration_start=starts, call_iteration=np.array(owner, dtype=np.int64),
        calls_per_iteration=period, fail_slows=tuple(fail_slows),
    )
    return trace, truth
