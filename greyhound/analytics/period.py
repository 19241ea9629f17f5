"""The iteration period of a rank's call sequence, and the iteration times it implies.

A training rank issues the same communication calls in the same order every iteration;
how many calls an iteration holds depends on the framework, model and layout and is not
known in advance. GREYHOUND takes the smallest lag k at which the autocorrelation of
the call sequence reaches 0.95 as the period, and an iteration's time as the time
between a call and the same call one period earlier.

Where this departs from the paper, and why:

- A call is a categorical symbol (op, communicator, bytes). Its "ACF" here is Cohen's
  kappa of the sequence against itself shifted by k: the fraction of positions whose
  symbols agree, corrected for the agreement expected by chance. A plain match rate
  reaches 0.95 at lag 1 inside a tensor-parallel burst (dozens of identical AllReduce
  calls per layer); the chance correction pulls such lags far below the threshold.
- A lag that reaches the threshold is still not the period if one of its multiples
  agrees clearly better (by ``tolerance``): long bursts of identical calls (128
  micro-batches x 8 layers of the same TP AllReduce) or many identical micro-batches
  of Send/Recv reach 0.95 at lag 1 or 2, but the iteration (a multiple of it) reaches
  1.0. An evaluation step every 50 iterations does not stretch the period: 50
  iterations plus the eval calls are no multiple of the iteration.
- Warm-up calls (parameter broadcasts, barriers) are not periodic: the ACF is computed
  over the trailing calls (then over shorter tails while no lag qualifies, so that a
  short trace's warm-up falls out too) and iteration times start at the first call
  from which 4 whole periods repeat exactly.
- If no lag qualifies with bytes in the symbol (variable sequence lengths change the
  bytes of every call), it is retried on (op, communicator) alone.
- Online, the period is searched at fixed call counts and locked only once it is
  confirmed on max(256 calls, 16 periods) (a motif inside the iteration repeats like
  a period until the pattern moves on), at a call count fixed by the calls, not by
  the polls: 16 iterations after the warm-up at 16 or more calls per iteration.
  A young lock is checked again on more calls (up to 4096): one that turns out a
  motif is withdrawn. Iteration k of a lock starts at a fixed call; the lock ends
  only on evidence (8 iterations whose calls no longer repeat), and the iterations
  measured under it meanwhile are withdrawn. See :class:`IterationClock`.
- An iteration's time is the time from one of its calls to the same call of the next
  iteration (not the median over all its calls, which spreads a slow iteration half
  into its neighbour): its first call, or, for a data-parallel job whose calls come
  late in the iteration, its last call (:meth:`IterationClock._measure_backward`).

The node agent's tracker (:class:`greyhound.analytics.tracker.RankTracker`) feeds an
:class:`IterationClock` the hook's ring records poll after poll; ``greyhound detect``
calls :func:`iteration_times_from_calls` on the columns of a CSV trace, which is the
same clock fed all calls at once: the two see the same iterations.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import scipy.fft

__all__ = [
    "CallIterations",
    "call_tokens",
    "lag_agreement",
    "find_period",
    "iteration_times_from_calls",
    "IterationClock",
    "ClockConfig",
    "ClockStep",
    "Segment",
    "collect_steps",
    "iteration_times_from_ring_records",
]

# More distinct symbols than this are rare in real traces; the rarest are pooled into
# one symbol so the FFT cost stays bounded (one FFT per symbol).
_MAX_TOKENS = 32
SHRINK_MAX_PERIOD = 512
"""Periods up to this are checked at every shorter lag for a shrunk pattern (p^2
comparisons a suspicious iteration); longer ones at their divisors only."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CallIterations:
    """Iteration times recovered from one rank's call sequence."""

    period: int | None
    """Calls per iteration (the last period locked); None when the sequence has none."""
    start: int
    """Index of the first call of iteration 0 (calls before it are warm-up)."""
    iteration_times: np.ndarray
    """(num_iterations,) float64 seconds; entry j spans iteration j's first call to
    iteration j + 1's (see :class:`IterationClock`)."""
    available_at: np.ndarray
    """(num_iterations,) float64: start time of the last call entry j needs, i.e.
    when an online tracker knows it."""
    first_call: np.ndarray
    """(num_iterations,) int64: index of each iteration's first call."""
    tokens_use_bytes: bool
    """Whether bytes were part of the call symbol that gave the period."""


def call_tokens(
    op: np.ndarray, comm: np.ndarray, nbytes: np.ndarray | None = None
) -> tuple[np.ndarray, int]:
    """Give every distinct (op, comm[, bytes]) an integer symbol.

    Args:
        op: (n,) op codes or names.
        comm: (n,) communicator ids (any hashable dtype numpy can sort).
        nbytes: (n,) bytes per call, or None to leave bytes out of the symbol.

    Returns:
        (tokens, num_tokens): tokens is (n,) int64 in [0, num_tokens).
    """
    columns = [op, comm] if nbytes is None else [op, comm, nbytes]
    key = np.zeros(len(op), dtype=np.int64)
    for column in columns:
        values, codes = np.unique(np.asarray(column), return_inverse=True)
        # Mixed-radix key of per-column codes; re-factorised after each column so it
        # never overflows int64.
        key = key * len(values) + codes.reshape(-1)
        _, key = np.unique(key, return_inverse=True)
        key = key.reshape(-1).astype(np.int64)
    num_tokens = int(key.max()) + 1 if len(key) else 0
    return key, num_tokens


def lag_agreement(tokens: np.ndarray, num_tokens: int, *, max_lag: int) -> np.ndarray:
    """Chance-corrected agreement (Cohen's kappa) of the sequence with itself at each lag.

    ``kappa[k] = (P_k - P_e) / (1 - P_e)`` where P_k is the fraction of positions i
    with ``tokens[i] == tokens[i + k]`` and ``P_e = sum_c p_c**2`` the agreement of two
    independent draws. Match counts for all lags come from one FFT per symbol (the
    autocorrelations of the one-hot indicator sequences, summed in frequency space), so
    the cost is O(num_tokens * n log n).

    Args:
        tokens: (n,) int symbols in [0, num_tokens).
        num_tokens: number of distinct symbols.
        max_lag: largest lag, 0 <= max_lag < n.

    Returns:
        (max_lag + 1,) float64; kappa[0] == 1. A sequence of one symbol agrees
        perfectly at every lag (all ones).
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    n = len(tokens)
    if not 0 <= max_lag < max(n, 1):
        raise ValueError(f"max_lag must be in [0, {n}), got {max_lag}")
    counts = np.bincount(tokens, minlength=num_tokens)
    if num_tokens > _MAX_TOKENS:
        # Pool the rarest symbols: they move P_k and P_e by at most their share.
        keep = np.argsort(counts)[::-1][: _MAX_TOKENS - 1]
        remap = np.full(num_tokens, _MAX_TOKENS - 1, dtype=np.int64)
        remap[keep] = np.arange(_MAX_TOKENS - 1)
        tokens = remap[tokens]
        num_tokens = _MAX_TOKENS
        counts = np.bincount(tokens, minlength=num_tokens)
    p = counts / n
    chance = float(np.sum(p * p))
    if chance >= 1.0 - 1e-12:
        return np.ones(max_lag + 1)
    nfft = scipy.fft.next_fast_len(n + max_lag + 1, real=True)
    power = np.zeros(nfft // 2 + 1)
    for c in np.flatnonzero(counts):
        indicator = (tokens == c).astype(np.float64)
        spectrum = scipy.fft.rfft(indicator, nfft)
        power += spectrum.real**2 + spectrum.imag**2
    matches = scipy.fft.irfft(power, nfft)[: max_lag + 1]
    overlap = n - np.arange(max_lag + 1)
    agreement = np.rint(matches) / overlap
    return (agreement - chance) / (1.0 - chance)


def find_period(
    tokens: np.ndarray,
    num_tokens: int,
    *,
    threshold: float = 0.95,
    tolerance: float = 0.02,
    max_period: int | None = None,
) -> int | None:
    """The smallest lag whose ACF reaches ``threshold``, unless a multiple beats it.

    If a multiple of that lag has an ACF higher by ``tolerance``, the lag is a motif
    inside the iteration; the first such multiple is taken instead (and checked the
    same way).

    Args:
        tokens: (n,) int symbols in [0, num_tokens).
        num_tokens: number of distinct symbols.
        threshold: ACF a lag needs (the paper's M = 0.95).
        tolerance: a lag is a sub-pattern, not the period, if a multiple of it (up to
            n - 1) has an ACF higher by this much.
        max_period: largest period considered; default n // 2 (two repetitions).

    Returns:
        The period in calls, or None if no lag qualifies.
    """
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    if tolerance < 0.0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    n = len(tokens)
    limit = n // 2 if max_period is None else min(max_period, n - 1)
    if limit < 1:
        return None
    # Multiples are looked at up to n - 1 lags: a sub-pattern's iteration may be
    # longer than max_period allows as a period.
    kappa = lag_agreement(tokens, num_tokens, max_lag=max(limit, n - 1))
    qualifying = np.flatnonzero(kappa[1 : limit + 1] >= threshold - 1e-12) + 1
    if not len(qualifying):
        return None
    lag = int(qualifying[0])
    while True:
        # A sub-pattern's multiples include its iteration: move to the first multiple
        # that agrees clearly better, and ask the same of it.
        multiples = kappa[2 * lag :: lag]
        better = np.flatnonzero(multiples >= kappa[lag] + tolerance)
        if not len(better):
            return lag
        lag = lag * (int(better[0]) + 2)
        if lag > limit:
            return None


def iteration_times_from_calls(
    op: np.ndarray,
    comm: np.ndarray,
    nbytes: np.ndarray,
    t_start: np.ndarray,
    *,
    threshold: float = 0.95,
    tolerance: float = 0.02,
    window: int = 1 << 16,
    max_period: int | None = None,
    period: int | None = None,
) -> CallIterations:
    """Period and per-iteration times of one rank's whole call sequence.

    Exactly what an :class:`IterationClock` fed the same calls, in any batches, and
    then told the stream ended (:meth:`IterationClock.finish`) reports: ``greyhound
    detect`` and the node agent's tracker see the same iterations.

    Args:
        op: (n,) op codes (ints or names).
        comm: (n,) communicator ids.
        nbytes: (n,) bytes per call.
        t_start: (n,) float call start times in seconds, non-decreasing.
        threshold, tolerance, max_period: see :func:`find_period`.
        window: most calls a period search looks at (see :class:`ClockConfig`).
        period: a known period: skips the search.

    Returns:
        A :class:`CallIterations`; ``iteration_times`` is empty when there is no
        period or fewer than two whole periods after the warm-up.
    """
    op, comm, nbytes = np.asarray(op), np.asarray(comm), np.asarray(nbytes)
    t_start = np.asarray(t_start, dtype=np.float64)
    n = len(t_start)
    if not len(op) == len(comm) == len(nbytes) == n:
        raise ValueError(
            f"op, comm, nbytes and t_start must have one length, got "
            f"{len(op)}, {len(comm)}, {len(nbytes)}, {n}"
        )
    config = ClockConfig(
        threshold=threshold, tolerance=tolerance, window=window, max_period=max_period,
    )
    clock = IterationClock(config, period=period)
    times, avail, first_call = _collect([clock.feed(op, comm, nbytes, t_start), clock.finish()])
    return CallIterations(
        period=clock.period if clock.period is not None else clock.last_period,
        start=int(first_call[0]) if len(first_call) else clock.first_start,
        iteration_times=times, available_at=avail, first_call=first_call,
        tokens_use_bytes=clock.tokens_use_bytes,
    )


def collect_steps(steps: list[ClockStep]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The iterations of consecutive clock steps, withdrawals applied: (times,
    available_at, first_call)."""
    return _collect(steps)


def _collect(steps: list[ClockStep]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    times, avail, first = np.empty(0), np.empty(0), np.empty(0, dtype=np.int64)
    for step in steps:
        keep = step.first_iteration
        times, avail, first = times[:keep], avail[:keep], first[:keep]
        times = np.concatenate((times, step.iteration_times))
        avail = np.concatenate((avail, step.available_at))
        first = np.concatenate((first, step.first_call))
    return times, avail, first


def iteration_times_from_ring_records(calls: np.ndarray, **kwargs) -> CallIterations:
    """:func:`iteration_times_from_calls` on the hook's ring records of one rank.

    Args:
        calls: (n,) structured array with the fields of ``greyhound.ring.RECORD_DTYPE``
            (``op``, ``comm_id``, ``size_bytes``, ``t_start_ns``), communication calls
            only and in ring order, e.g. ``greyhound.ring.call_records(batch.records)``
            over the batches read so far.
        **kwargs: keyword parameters of :func:`iteration_times_from_calls`.

    Returns:
        A :class:`CallIterations`; times in seconds of CLOCK_MONOTONIC.
    """
    return iteration_times_from_calls(
        calls["op"], calls["comm_id"], calls["size_bytes"],
        calls["t_start_ns"].astype(np.float64) * 1e-9, **kwargs,
    )


# Shortened windows stop here, and must hold three periods: in fewer calls a random
# sequence can look periodic.
_MIN_WINDOW = 8


def _search_period(
    op: np.ndarray,
    comm: np.ndarray,
    nbytes: np.ndarray | None,
    *,
    window: int,
    threshold: float,
    tolerance: float,
    max_period: int | None,
) -> tuple[int, int] | None:
    """find_period on the trailing window; if none, on shorter and shorter tails.

    Warm-up calls sit at the start of a trace; in a short trace they can be a large
    share of the window and pull every lag's ACF down (most of all when one symbol
    dominates and chance agreement is high). Tails of 7/8, 3/4, 1/2, 1/4, ... of the
    window drop them.

    Returns:
        (period, tail): the period and how many trailing calls showed it; None.
    """
    n = len(op)
    full = min(n, window)
    sizes = [full] + [full * 7 // 8, full * 3 // 4]
    size = full // 2
    while size >= _MIN_WINDOW:
        sizes.append(size)
        size //= 2
    for k, size in enumerate(sizes):
        if size < _MIN_WINDOW and k:
            break
        tail = slice(n - size, n)
        tokens, num_tokens = call_tokens(
            op[tail], comm[tail], None if nbytes is None else nbytes[tail]
        )
        limit = max_period if k == 0 else min(max_period or size, size // 3)
        if limit is not None and limit < 1:
            continue
        period = find_period(
            tokens, num_tokens, threshold=threshold, tolerance=tolerance, max_period=limit
        )
        if period is not None:
            return period, size
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClockConfig:
    """How an :class:`IterationClock` locks onto a period and when it lets go."""

    threshold: float = 0.95
    """ACF a lag needs to be the period (the paper's M)."""
    tolerance: float = 0.02
    """See :func:`find_period`."""
    window: int = 1 << 16
    """Most calls one period search looks at (the trailing ones)."""
    max_period: int | None = None
    """Largest period considered; default half the searched calls."""
    first_check: int = 32
    """The period is searched when the calls since the search began reach
    ``first_check``, twice that, four times, ... up to ``window``, then every
    ``window // 2`` calls: at fixed call counts, never at a poll's boundary, so any
    split of the calls into batches locks at the same call."""
    min_periods: int = 4
    """Whole repeats of the period after its first clean one that a lock needs."""
    confirm_calls: int = 256
    """See ``confirm_periods``: the floor for short periods (a motif of one to a
    few calls, e.g. a burst of identical TP AllReduces, repeats many times in an
    iteration). It sets the first lock's delay at fewer than 16 calls per iteration:
    ``confirm_calls / period`` iterations (64 at 4 calls)."""
    confirm_periods: int = 16
    """A period found is a candidate; it locks at the call count where the calls from
    its first clean period on number max(``confirm_calls``, ``confirm_periods`` x
    period), if a period search on those calls alone finds it again (and at every
    scheduled search before that). A motif inside the iteration (16 micro-batches of
    the same Recv, AllReduce, Send; a burst of 128 identical AllReduces) repeats like
    a period until the pattern moves on; the iterations are held back until then,
    and those of a dropped candidate are never reported."""
    verify_calls: int = 4096
    """A lock is checked again at each scheduled search (see ``first_check``) while
    its calls number at most this many: a period search on them alone must find its
    period again, else its iterations are withdrawn and the period found locks
    instead (see :meth:`IterationClock._verify`). 0: never."""
    min_match: float = 0.9
    """Share of the calls after the first clean period that must equal the call one
    period later for a lock."""
    wrap_gap: float = 0.2
    """Share of the iteration between its last call and the next one's first above
    which iterations are measured between last calls (see
    :meth:`IterationClock._measure_backward`)."""
    relock_blocks: int = 8
    """Consecutive iterations in which fewer than ``relock_match`` of the calls equal
    the call one period later, or that repeat whole at a divisor of the period, end the
    lock (the pattern changed)."""
    relock_shrunk_blocks: int = 2
    """Consecutive iterations that each repeat whole at a shorter lag end the lock
    sooner than ``relock_blocks``: the pattern shrank (an S2 split that gives a stage
    fewer micro-batches), and one iteration of the old period spans several new ones.
    With ``relock_blocks`` alone, a synthetic stage going from 14 micro-batches to 2
    kept its old lock for 55 new steps; on the reference job, after a [14, 2] split,
    the unloaded replica's ranks kept theirs for 14-21 s, reporting each 3.4 steps as
    one slow iteration: the master read the job 3x slower than it ran."""
    relock_match: float = 0.95
    """See ``relock_blocks``. A pipeline stage's calls are a few tokens (its sends and
    receives, sizes varying): after an S2 re-split of its micro-batches the old period
    still matched 59-94% of the new pattern's calls on the local cluster, and a lock
    at 0.5 stayed on the old period for the rest of the job."""

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold!r}")
        if self.tolerance < 0.0:
            raise ValueError(f"tolerance must be >= 0, got {self.tolerance!r}")
        if self.first_check < 2:
            raise ValueError(f"first_check must be >= 2, got {self.first_check!r}")
        if self.window < self.first_check:
            raise ValueError(
                f"window must be >= first_check ({self.first_check}), got {self.window!r}"
            )
        if self.verify_calls < 0:
            raise ValueError(f"verify_calls must be >= 0, got {self.verify_calls!r}")
        if self.max_period is not None and self.max_period < 1:
            raise ValueError(f"max_period must be >= 1, got {self.max_period!r}")
        if min(self.min_periods, self.relock_blocks, self.relock_shrunk_blocks, self.confirm_calls,
               self.confirm_periods) < 1:
            raise ValueError(
                "min_periods, relock_blocks, relock_shrunk_blocks, confirm_calls and confirm_periods "
                "must be >= 1"
            )
        for name in ("min_match", "relock_match"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClockStep:
    """Iterations an :class:`IterationClock` completed during one feed."""

    first_iteration: int
    """Number of the first iteration in this step (iterations are numbered 0, 1, ...
    over the whole stream, across re-locks)."""
    iteration_times: np.ndarray
    """(m,) float64 seconds."""
    available_at: np.ndarray
    """(m,) float64: start time of the call that completed each one."""
    first_call: np.ndarray
    """(m,) int64: index (in the stream, from 0) of each iteration's first call."""
    withdrawn_from: int | None = None
    """Iterations numbered from this on that earlier steps reported are withdrawn
    (they were measured under a lock that had ended, see :class:`IterationClock`);
    ``first_iteration`` is then this number, reused by the new lock."""

    @property
    def iterations(self) -> np.ndarray:
        """(m,) int64 numbers of the iterations."""
        return np.arange(self.first_iteration, self.first_iteration + len(self.iteration_times))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Segment:
    """A stretch of iterations under one lock."""

    first_iteration: int
    period: int
    start_call: int
    """Index of the first call of iteration ``first_iteration``."""
    tokens_use_bytes: bool
    backward: bool = False
    """Iteration k's time is measured between the last calls of iterations k - 1 and
    k (True), or between the first calls of k and k + 1 (False); see
    :class:`IterationClock`."""
    locked_at: int = 0
    """Calls fed when the lock was made (it knew calls [0, locked_at)): the
    iterations whose calls were in by then were reported at once, the later ones as
    their calls come. A fixed call count, whatever the batches."""


class IterationClock:
    """Online period lock and iteration numbering of one rank's call stream.

    Feed it the calls as they come (:meth:`feed`, any batch sizes); it reports each
    iteration's time as soon as the calls that define it have arrived.

    Locking: while no period is locked, the calls are kept (the trailing
    ``window``) and the period is searched (:func:`find_period` on the trailing calls
    and shorter tails, with and without bytes) at fixed call counts (see
    :attr:`ClockConfig.first_check`). A period found is a candidate if the calls
    after its first clean period hold ``min_periods`` repeats of which ``min_match``
    equal the call one period later, and, if it was found without bytes, the calls
    are not all one (op, comm) (parameter broadcasts of varying size). The candidate
    locks at a fixed call count, once max(``confirm_calls``, ``confirm_periods`` x
    period) calls from its first clean period on are in and a period search on them
    alone finds it again; each scheduled search before that checks it the same way
    on the calls so far, and drops it if they show another period (a motif inside
    the iteration: its run ended), so that the search for the real period goes on.
    The first lock thus comes max(256, 16 p) calls after the first clean period
    (16 iterations for p >= 16, 64 for a data-parallel job's 4 calls, 256 for 1),
    or at the first scheduled search that finds the candidate if later (it needs
    ``min_periods`` + 1 clean periods after the warm-up in the searched calls, and
    the searches come at 32, 64, 128, ... calls). A young lock (up to
    ``verify_calls`` calls) is checked again at each scheduled search: if its calls
    show another period (the lock was a motif, a run of micro-batches longer than
    the calls that confirmed it), its iterations are withdrawn and that period is
    the candidate. At the end of a stream (:meth:`finish`) a waiting candidate, or
    one search on what is there, suffices.

    Numbering: once locked at period p with first clean call s, iteration k of the
    lock starts at call s + k p, whatever comes later: an evaluation step that adds
    calls shifts where iterations start within the pattern, never the numbering.
    Iteration k's time is the time between its first call and the same call one
    period later; if that call differs from its repeat (an inserted call), the first
    call of the iteration that equals its repeat is used instead. (Not the median
    over the iteration's calls: a slow iteration would then spread half into its
    neighbours, and a 3-iteration disturbance look like 4.)

    Re-locking, only on evidence: when ``relock_blocks`` consecutive iterations have
    fewer than ``relock_match`` of their calls equal to the call one period later, or
    repeat whole at a divisor of the period (the pattern changed: a new parallel
    layout, a re-split of micro-batches), or ``relock_shrunk_blocks`` of them repeat
    whole at a shorter lag (the pattern shrank), the lock ends at the first of them, and the
    search starts again from there. Such evidence counts only after the lock has held
    for one iteration (else a lock could end at its own first call, and be found there
    again). A young lock's check that finds another period, on calls whose pattern held
    and then changed, ends the lock where the change began, as the evidence would
    (:meth:`_changed_at`); only a lock that never held is withdrawn whole. The
    iteration numbers go on from the last one reported.

    All of it depends only on the calls, not on how they were split into batches.
    """

    def __init__(self, config: ClockConfig | None = None, *, period: int | None = None) -> None:
        if period is not None and period < 1:
            raise ValueError(f"period must be >= 1, got {period!r}")
        self.config = config or ClockConfig()
        self._fixed = period
        self._n = 0
        self._lo = 0
        self._buf: list[np.ndarray] | None = None  # op, comm, nbytes, t
        self._origin = 0
        self._check = self.config.first_check
        self._iters = 0
        self.segments: list[Segment] = []
        self._seg: Segment | None = None
        self._cand: Segment | None = None
        self._withdrew: int | None = None
        self._confirm_from = 0
        self._confirm_at = 0
        self._cand_at = 0
        self._disproved: set[int] = set()
        self._next_start = 0
        self._eval_start = 0
        self._bad_run = self._shrunk_run = 0
        self._held = False
        self._bad_from = 0
        self.last_period: int | None = None
        self.first_start = 0

    # ---- state ------------------------------------------------------------------

    @property
    def num_calls(self) -> int:
        """Calls fed so far."""
        return self._n

    @property
    def num_iterations(self) -> int:
        """Iterations reported so far (the next one gets this number)."""
        return self._iters

    @property
    def locked(self) -> bool:
        return self._seg is not None

    @property
    def period(self) -> int | None:
        """Calls per iteration of the current lock; None while unlocked."""
        return None if self._seg is None else self._seg.period

    @property
    def tokens_use_bytes(self) -> bool:
        seg = self._seg or (self.segments[-1] if self.segments else None)
        return True if seg is None else seg.tokens_use_bytes

    def iteration_start_call(self, iteration: int) -> int | None:
        """Index of the first call of ``iteration`` (0-based, in the stream), for a
        reported iteration or a future one of the current lock; None if unknown (before
        the first lock, or in a stretch between two locks)."""
        for seg in reversed(self.segments):
            if iteration >= seg.first_iteration:
                if seg is not self._seg and iteration >= self._segment_end(seg):
                    return None
                return seg.start_call + (iteration - seg.first_iteration) * seg.period
        return None

    def _segment_end(self, seg: Segment) -> int:
        k = self.segments.index(seg)
        return self.segments[k + 1].first_iteration if k + 1 < len(self.segments) else self._iters

    # ---- feeding ------------------------------------------------------------------

    def feed(
        self, op: np.ndarray, comm: np.ndarray, nbytes: np.ndarray, t_start: np.ndarray
    ) -> ClockStep:
        """Add the next calls (in order); returns the iterations they completed.

        Args:
            op, comm, nbytes: (n,) op codes, communicator ids, bytes per call.
            t_start: (n,) call start times in seconds, non-decreasing.
        """
        cols = [np.asarray(op), np.asarray(comm), np.asarray(nbytes),
                np.asarray(t_start, dtype=np.float64)]
        n = len(cols[3])
        if any(len(c) != n for c in cols) or any(c.ndim != 1 for c in cols):
            raise ValueError("op, comm, nbytes and t_start must be 1-D and of one length")
        if self._buf is None:
            self._buf = cols
        elif n:
            self._buf = [np.concatenate((a, b)) for a, b in zip(self._buf, cols)]
        self._n += n
        out = self._advance(final=False)
        self._trim()
        return out

    def finish(self) -> ClockStep:
        """The stream ended: if no period is locked, lock on what is there (one search,
        no confirmation by a later one). Returns the iterations that completed."""
        return self._advance(final=True)

    # ---- internals ----------------------------------------------------------------

    def _advance(self, *, final: bool) -> ClockStep:
        first = self._iters
        times: list[np.ndarray] = []
        avail: list[np.ndarray] = []
        starts: list[np.ndarray] = []
        withdrawn: int | None = None
        final_done = False
        while True:
            if self._seg is None:
                if self._unlocked_step():
                    continue
                if final and not final_done:
                    final_done = True
                    if self._cand is not None:
                        self._lock(self._cand, self._n)
                    else:
                        self._search(
                            max(self._origin, self._n - self.config.window), self._n, final=True
                        )
                    if self._seg is not None:
                        continue
                break
            self._withdrew = None
            # A young lock is checked at the scheduled searches: iterations are
            # reported up to such a call count, then the lock is checked there.
            verify_at = self._verify_due()
            more = self._emit(times, avail, starts, self._n if verify_at is None else verify_at)
            if verify_at is not None and self._seg is not None:
                self._check = self._origin + self._next_offset(verify_at - self._origin)
                self._verify(verify_at)
                more = True
            if self._withdrew is not None:
                # The lock ended: iterations from self._iters on are withdrawn.
                w = self._withdrew
                if w < first:
                    withdrawn = w if withdrawn is None else min(withdrawn, w)
                    times.clear(), avail.clear(), starts.clear()
                    first = w
                else:
                    keep = w - first
                    t_all = np.concatenate(times) if times else np.empty(0)
                    a_all = np.concatenate(avail) if avail else np.empty(0)
                    s_all = np.concatenate(starts) if starts else np.empty(0, dtype=np.int64)
                    times[:], avail[:], starts[:] = [t_all[:keep]], [a_all[:keep]], [s_all[:keep]]
            if not more:
                break
        if not times or not sum(len(t) for t in times):
            empty = np.empty(0)
            return ClockStep(first_iteration=first, iteration_times=empty, available_at=empty,
                             first_call=np.empty(0, dtype=np.int64), withdrawn_from=withdrawn)
        return ClockStep(
            first_iteration=first, iteration_times=np.concatenate(times),
            available_at=np.concatenate(avail), first_call=np.concatenate(starts),
            withdrawn_from=withdrawn,
        )

    def _next_offset(self, offset: int) -> int:
        f, w = self.config.first_check, self.config.window
        if offset < f:
            return f
        if offset * 2 <= w:
            return offset * 2
        return offset + max(1, w // 2)

    def _cols(self, lo: int, hi: int) -> list[np.ndarray]:
        assert self._buf is not None
        return [c[lo - self._lo : hi - self._lo] for c in self._buf]

    def _tokens(self, lo: int, hi: int, use_bytes: bool) -> tuple[np.ndarray, int]:
        """:func:`call_tokens` of the calls [lo, hi)."""
        op, comm, nb, _ = self._cols(lo, hi)
        return call_tokens(op, comm, nb if use_bytes else None)

    def _find(self, tokens: np.ndarray, num_tokens: int) -> int | None:
        """:func:`find_period` with this clock's settings."""
        return find_period(
            tokens, num_tokens, threshold=self.config.threshold,
            tolerance=self.config.tolerance, max_period=self.config.max_period,
        )

    def _holds(self, period: int, lo: int, hi: int, use_bytes: bool) -> bool:
        """Whether the calls [lo, hi) alone have ``period``: a period search on them
        finds it; for one call per iteration, they are the same call every time."""
        tokens, num_tokens = self._tokens(lo, hi, use_bytes)
        return num_tokens == 1 if period == 1 else self._find(tokens, num_tokens) == period

    def _blocks(self, lo: int, count: int, period: int, lag: int, use_bytes: bool) -> np.ndarray:
        """(count, period) bool: whether each call of the ``count`` iterations from
        ``lo`` equals the call ``lag`` later."""
        return self._same(lo, lo + count * period, lag, use_bytes).reshape(count, period)

    def _same(self, lo: int, hi: int, period: int, use_bytes: bool) -> np.ndarray:
        """same[i - lo] for lo <= i < hi: call i equals call i + period (hi + period <= n)."""
        op, comm, nb, _ = self._cols(lo, hi + period)
        m = hi - lo
        out = (op[period : period + m] == op[:m]) & (comm[period : period + m] == comm[:m])
        if use_bytes:
            out &= nb[period : period + m] == nb[:m]
        return np.asarray(out, dtype=bool)

    def _unlocked_step(self) -> bool:
        """Handle the next due event while unlocked (calls fed so far permitting): the
        candidate's confirmation at its fixed call count, or a scheduled search. True
        if one was handled (another may be due), False if none is due.

        Both events sit at call counts that depend only on the calls (a search at
        :attr:`ClockConfig.first_check` x 1, 2, 4, ... calls since the origin; a
        candidate's confirmation ``confirm_from + max(confirm_calls, confirm_periods x
        period)``, or the search that found it if that is later), so any split of the
        calls into batches gives the same events in the same order."""
        n, window = self._n, self.config.window
        cand = self._cand
        if cand is not None and self._confirm_at <= n and self._confirm_at <= self._check:
            c = self._confirm_at
            if self._check == c:
                self._check = self._origin + self._next_offset(c - self._origin)
            if self._confirms(cand, c):
                self._lock(cand, c)
                return True
            self._cand = None
            if c > self._cand_at:
                # Not the search that made it: search again on the calls up to here.
                self._search(max(self._origin, c - window), c, final=False)
            return True
        if self._check > n:
            return False
        c = self._check
        self._check = self._origin + self._next_offset(c - self._origin)
        if cand is not None:
            # A scheduled search while a candidate waits checks it on the calls since
            # it was found (twice as many as at the last search, or more): a motif
            # inside the iteration is dropped as soon as the calls show its end, and
            # does not hold off the search for the real period.
            if c - self._confirm_from < 2 * cand.period or self._confirms(cand, c):
                return True
            self._cand = None
        self._search(max(self._origin, c - window), c, final=False)
        return True

    def _search(self, lo: int, hi: int, *, final: bool) -> None:
        """One period search on calls [lo, hi) (no candidate waiting): makes a
        candidate, or locks at once with a known period or at the end of the stream."""
        if hi - lo < 2:
            return
        op, comm, nb, _ = self._cols(lo, hi)
        if self._fixed is not None:
            found: tuple[int, bool] | None = (self._fixed, True)
        else:
            found = None
            for use_bytes in (True, False):
                got = _search_period(
                    op, comm, nb if use_bytes else None, window=hi - lo,
                    threshold=self.config.threshold, tolerance=self.config.tolerance,
                    max_period=self.config.max_period,
                )
                if got is not None:
                    found = (got[0], use_bytes)
                    tail = hi - got[1]
                    break
            if found is not None and not found[1] and _one_symbol(*self._cols(tail, hi)[:2]):
                # Parameter broadcasts of varying size: no period, only one call kind.
                found = None
        if found is None or found[0] in self._disproved:
            return
        self.last_period = found[0]
        cand = self._candidate(lo, hi, found)
        if cand is None:
            return
        # Confirmed on calls the period was seen in, not on a warm-up that only
        # looks periodic without bytes: from the tail that showed it, or from the
        # first clean period if every call from there to the tail equals the call one
        # period later (no warm-up call among them).
        confirm_from = cand.start_call
        if self._fixed is None and tail > confirm_from and not np.all(
            self._same(confirm_from, tail, cand.period, cand.tokens_use_bytes)
        ):
            confirm_from = tail
        if self._fixed is not None or final:
            self._confirm_from = confirm_from
            self._lock(cand, hi)
        else:
            self._set_candidate(cand, confirm_from, hi)

    def _set_candidate(self, cand: Segment, confirm_from: int, hi: int) -> None:
        """Wait for ``cand``'s confirmation on calls from ``confirm_from`` on (found
        by a search on calls up to ``hi``)."""
        self._cand = cand
        self._cand_at = hi
        self._confirm_from = confirm_from
        need = max(self.config.confirm_calls, self.config.confirm_periods * cand.period)
        self._confirm_at = max(hi, confirm_from + need)

    def _confirms(self, cand: Segment, hi: int) -> bool:
        """Whether the calls from the candidate's first clean period to ``hi`` (the
        trailing ``window`` of them) have its period, by :func:`find_period` on them
        alone: no warm-up left, and, at the confirmation, at least
        max(confirm_calls, confirm_periods x period) of them, so a motif that ends
        within them is found out. One call per iteration (as for the candidate) is the
        same call every time: a burst of one call kind that ends is a motif."""
        return self._holds(cand.period, max(self._confirm_from, hi - self.config.window), hi,
                           cand.tokens_use_bytes)

    def _measure_backward(self, seg: Segment, hi: int) -> bool:
        """Whether to measure iterations between their last calls instead of their
        first ones, decided on the calls [start, hi) of a new lock.

        An iteration is measured from one of its calls to the same call of the next
        (or previous) iteration. Work of an iteration done before its first call
        counts, measured between first calls, in the iteration before it; work done
        after its last call counts, measured between last calls, in the one after it.
        An iteration whose compute is slower then shows partly in its neighbour,
        neighbours' times correlate, and a slowdown of 3 iterations looks like one of
        4, which the detector would take for a new regime. Both kinds of work lie in
        the gap between an iteration's last call and the next one's first call (the
        wrap gap); how it splits is unknown. So:

        - wrap gap under ``wrap_gap`` of the iteration (calls spread over the work:
          tensor- and pipeline-parallel jobs), or fewer than 8 iterations to judge by:
          first calls;
        - else last calls (a data-parallel job: its gradient AllReduces come in the
          backward pass, the forward pass before them belongs to the same iteration),
          unless the first calls give clearly less correlated neighbours (rank
          correlation of deviations from a running median lower by 0.1: the calls sit
          at the start of the work).
        """
        p, s = seg.period, seg.start_call
        blocks = (hi - s) // p - 2  # iterations 1, 2, ...: the calls before s are not used
        if p < 2 or blocks < 8:
            return False
        t = self._cols(s, s + (blocks + 2) * p)[3]
        first = np.arange(1, blocks + 1) * p
        forward = t[first + p] - t[first]          # first call of k to first of k + 1
        backward = t[first + p - 1] - t[first - 1]  # last call of k - 1 to last of k
        if np.any(forward <= 0) or np.any(backward <= 0):
            return False
        wrap = (t[first + p] - t[first + p - 1]) / forward
        if float(np.median(wrap)) <= self.config.wrap_gap:
            return False
        # Same iterations in both: forward[k] and backward[k + 1] span mostly k.
        a, b = _residual(np.log(forward[:-1])), _residual(np.log(backward[1:]))
        return not _rank_autocorrelation(a) < _rank_autocorrelation(b) - 0.1

    def _candidate(self, lo: int, hi: int, found: tuple[int, bool]) -> Segment | None:
        """The lock a period found on calls [lo, hi) would make, if they are clean
        enough: its first clean period, and enough repeats after it that match."""
        p, use_bytes = found
        tries = [use_bytes] if self._fixed is None else [True, False]
        for use_bytes in tries:
            if hi - lo < 2 * p:
                return None
            same = self._same(lo, hi - p, p, use_bytes)
            # min_periods clean periods in a row: an accidental repeat among warm-up
            # calls (two broadcasts of one size) is no start; nor, for a period of more
            # than one call, a run of one call kind (broadcasts, compared without bytes).
            span = min(self.config.min_periods * p, len(same))
            varied = None
            if p > 1:
                op, comm, nb, _ = self._cols(lo, hi)
                change = (op[1:] != op[:-1]) | (comm[1:] != comm[:-1])
                if use_bytes:
                    change |= nb[1:] != nb[:-1]
                varied = np.concatenate(([0], np.cumsum(change)))
            start = _clean_period_start(same, span, varied)
            if start is None:
                continue
            repeats = (hi - (lo + start)) // p - 1
            if repeats < min(self.config.min_periods, max(1, (hi - lo) // p - 1)):
                continue
            if same[start:].mean() < self.config.min_match:
                continue
            if p == 1 and not same[start:].all():
                # Runs of a few call kinds (warm-up broadcasts, then a burst of
                # AllReduces) agree with themselves at lag 1 too; one call per
                # iteration means the same call every time.
                continue
            return Segment(first_iteration=self._iters, period=p, start_call=lo + start,
                           tokens_use_bytes=use_bytes)
        return None

    def _lock(self, seg: Segment, hi: int) -> None:
        seg = dataclasses.replace(seg, backward=self._measure_backward(seg, hi), locked_at=hi)
        if not self.segments:
            self.first_start = seg.start_call
        self.segments.append(seg)
        self._seg = seg
        self._cand = None
        self.last_period = seg.period
        self._next_start = seg.start_call
        self._eval_start = seg.start_call
        self._bad_run = self._shrunk_run = 0
        self._held = False

    def _verify_due(self) -> int | None:
        """The scheduled search's call count if it is due (fed) while the lock is young
        (its calls up to there number at most ``verify_calls``), else None."""
        seg = self._seg
        c = self._check
        if seg is None or self._fixed is not None or c > self._n:
            return None
        return c if c - seg.start_call <= self.config.verify_calls else None

    def _verify(self, c: int) -> None:
        """Check the lock on its calls up to ``c`` (the trailing ``window``): a period
        search on them alone must find its period again (and, for one call per
        iteration, the same call every time). If it finds another, the lock was a
        motif inside the iteration (a run of micro-batches longer than the calls
        that confirmed it) or a multiple of the period: its iterations are all
        withdrawn, the lock is forgotten, and the period found is the candidate
        (confirmed as any other). A period disproved so is not a candidate again
        until the next re-lock."""
        seg = self._seg
        assert seg is not None
        p, use_bytes = seg.period, seg.tokens_use_bytes
        lo = max(seg.start_call, c - self.config.window)
        tokens, num_tokens = self._tokens(lo, c, use_bytes)
        found = self._find(tokens, num_tokens)
        disproved = num_tokens > 1 if p == 1 else (found is not None and found != p)
        if not disproved:
            return
        changed = self._changed_at(lo, c, found)
        if changed is not None:
            # The lock held, then the pattern changed (a new micro-batch split): it ends
            # where the change began, as on re-lock evidence, and keeps the iterations
            # before. Withdrawing them all lost every rank's history (its healthy
            # reference) at each S2 split change on the local cluster, and the search
            # on the mixed calls locked on multiples of the step (4 and 7 steps).
            self._bad_from = changed
            self._end_lock(changed)
            return
        self._disproved.add(p)
        self._iters = seg.first_iteration
        self._withdrew = self._iters
        self.segments.pop()
        if not self.segments:
            self.first_start = 0
        self._seg = None
        self._bad_run = self._shrunk_run = 0
        if found is None or found in self._disproved:
            return
        cand = self._candidate(max(self._origin, c - self.config.window), c, (found, use_bytes))
        if cand is None:
            return
        self.last_period = found
        self._set_candidate(cand, max(cand.start_call, seg.start_call), c)

    def _changed_at(self, lo: int, c: int, found: int | None) -> int | None:
        """Where the young lock's pattern stopped repeating, if it had held until then:
        the first call of its first iteration in [lo, c) with fewer than ``min_match``
        of its calls equal to the call one period later, when the calls before it span
        more than ``found`` (the period a search on [lo, c) found) and a period search
        on them alone finds the lock's period again. None otherwise: the lock was a
        motif, a run of micro-batches that ends within one of the real iterations, and
        its calls span less than one of them."""
        seg = self._seg
        assert seg is not None
        p, use_bytes = seg.period, seg.tokens_use_bytes
        first = seg.start_call + -(-(lo - seg.start_call) // p) * p
        count = (c - first) // p - 1
        if found is None or count < 1:
            return None
        frac = self._blocks(first, count, p, p, use_bytes).mean(axis=1)
        bad = np.flatnonzero(frac < self.config.min_match)
        if not len(bad):
            return None
        changed = first + int(bad[0]) * p
        if changed - seg.start_call <= found:
            return None
        return changed if self._holds(p, max(lo, changed - self.config.window), changed, use_bytes) else None

    def _emit(self, times: list, avail: list, starts: list, n: int) -> bool:
        """Report the iterations of the lock whose times are known from calls [0, n);
        True when the lock ended (a search may be due), False when nothing more can be
        done with those calls."""
        seg = self._seg
        assert seg is not None
        p, use_bytes = seg.period, seg.tokens_use_bytes
        # Re-lock evidence, on whole iterations (their calls and the next iteration's
        # all here), in order.
        trigger = None
        e0 = self._eval_start
        count = (n - e0 - 2 * p) // p + 1 if n - e0 >= 2 * p else 0
        if count > 0:
            bad = self._blocks(e0, count, p, p, use_bytes).mean(axis=1) < self.config.relock_match
            divisor = np.zeros(count, dtype=bool)
            for prime in _prime_factors(p):
                # The iteration repeats at p / prime too: the pattern shrank to a divisor
                # of the period (an S2 split of 8 micro-batches down to 2: 18 calls a
                # step, then 6, and every call still equals the one 18 later).
                divisor |= self._blocks(e0, count, p, p // prime, use_bytes).all(axis=1)
            bad |= divisor
            done = count
            if not bad.any():       # the usual feed: every iteration as the lock has it
                self._held = True
                self._bad_run = self._shrunk_run = 0
            else:
                for r in range(count):
                    # Evidence counts once the lock has held for an iteration: a period the
                    # search found on calls that match it 90-95% (or that repeat at a divisor
                    # too) would otherwise end at its own first call, and be found and ended
                    # there again forever (an agent spun on one rank's calls).
                    self._held = self._held or not bad[r]
                    if bad[r] and self._held:
                        if self._bad_run == 0:
                            self._bad_from = e0 + r * p
                        self._bad_run += 1
                        shrunk = divisor[r] or self._repeats_sooner(e0 + r * p, p, use_bytes)
                        self._shrunk_run = self._shrunk_run + 1 if shrunk else 0
                        if self._bad_run >= self.config.relock_blocks or \
                                self._shrunk_run >= self.config.relock_shrunk_blocks:
                            trigger, done = e0 + r * p, r + 1
                            break
                    else:
                        self._bad_run = self._shrunk_run = 0
            self._eval_start = e0 + done * p
        if seg.backward:
            self._emit_backward(times, avail, starts, trigger, n)
            return self._end_lock(trigger)
        # Iteration times: iteration k needs its first call that equals the call one
        # period later, and that later call.
        s0 = self._next_start
        rows = (n - 1 - s0) // p if n - 1 >= s0 + p else 0
        if trigger is not None:
            rows = min(rows, (trigger - s0) // p + 1)
        if rows > 0:
            block = s0 + p * np.arange(rows)
            hi = min(s0 + rows * p, n - p)
            same = np.zeros(rows * p, dtype=bool)
            same[: hi - s0] = self._same(s0, hi, p, use_bytes)
            same_rows = same.reshape(rows, p)
            full = block + 2 * p - 1 < n
            has = np.any(same_rows, axis=1)
            ready = has | full
            stop = rows if ready.all() else int(np.argmin(ready))
            if stop:
                q = np.where(has[:stop], np.argmax(same_rows[:stop], axis=1), 0)
                t = self._cols(s0, min(n, s0 + stop * p + p))[3]
                used = np.arange(stop) * p + q
                times.append(t[used + p] - t[used])
                avail.append(t[used + p])
                starts.append(block[:stop].astype(np.int64))
                self._iters += stop
                self._next_start = s0 + stop * p
        return self._end_lock(trigger)

    def _repeats_sooner(self, lo: int, p: int, use_bytes: bool) -> bool:
        """Whether each call of the iteration of ``p`` calls from ``lo`` equals the call
        ``q`` later, for one lag 0 < q < p (calls up to lo + 2p - 1 are in). Costs p^2
        comparisons: above ``SHRINK_MAX_PERIOD`` only the divisor lags are looked at."""
        if p < 2 or p > SHRINK_MAX_PERIOD:
            return False
        tokens, _ = self._tokens(lo, lo + 2 * p - 1, use_bytes)
        later = np.lib.stride_tricks.sliding_window_view(tokens[1:], p)
        return bool((later == tokens[:p]).all(axis=1).any())

    def _end_lock(self, trigger: int | None) -> bool:
        if trigger is None:
            return False
        seg = self._seg
        assert seg is not None
        # Iterations from the first one of the evidence on were measured with a period
        # that no longer held: withdrawn, their numbers go to the new lock.
        self._iters = min(self._iters,
                          seg.first_iteration + (self._bad_from - seg.start_call) // seg.period)
        self._withdrew = self._iters
        self._seg = None
        self._origin = self._bad_from
        self._check = self._origin + self.config.first_check
        self._disproved = set()
        self._bad_run = self._shrunk_run = 0
        return True

    def _emit_backward(
        self, times: list, avail: list, starts: list, trigger: int | None, n: int
    ) -> None:
        """Iteration k, measured between last calls: its last call that equals the call
        one period earlier, and that earlier call; known when iteration k is complete.
        An iteration with no such call (the first of a lock, after a warm-up) is
        measured forward from its first call instead, once the next one begins."""
        seg = self._seg
        assert seg is not None
        p, s0 = seg.period, self._next_start
        rows = (n - s0) // p
        if trigger is not None:
            rows = min(rows, (trigger - s0) // p + 1)
        if rows <= 0:
            return
        # Never a call before the lock's first one: the first iteration of a lock is
        # measured forward.
        lo = max(s0 - p, seg.start_call)
        back = np.zeros(rows * p, dtype=bool)
        # back[j - s0] for call j in [s0, s0 + rows p): call j equals call j - p.
        same = self._same(lo, s0 + rows * p - p, p, seg.tokens_use_bytes)
        back[lo + p - s0 :] = same
        back_rows = back.reshape(rows, p)
        has = np.any(back_rows, axis=1)
        q = p - 1 - np.argmax(back_rows[:, ::-1], axis=1)
        block = s0 + p * np.arange(rows)
        # A row without a match waits for the next iteration's first call.
        ready = has | (block + p < n)
        stop = rows if ready.all() else int(np.argmin(ready))
        if not stop:
            return
        t = self._cols(lo, min(n, s0 + stop * p + 1))[3]
        off = s0 - lo
        used = off + np.arange(stop) * p + np.where(has[:stop], q[:stop], 0)
        earlier = np.where(has[:stop], used - p, used)
        later = np.where(has[:stop], used, used + p)
        times.append(t[later] - t[earlier])
        avail.append(t[later])
        starts.append(block[:stop].astype(np.int64))
        self._iters += stop
        self._next_start = s0 + stop * p

    def _trim(self) -> None:
        if self._buf is None:
            return
        if self._seg is not None:
            keep = min(max(self._next_start - self._seg.period, self._seg.start_call),
                       self._eval_start)
            if self._bad_run:
                keep = min(keep, self._bad_from)
            if self._check - self._seg.start_call <= self.config.verify_calls:
                # A check of the lock may come, and one that disproves it searches
                # from the origin (within the window) for the period instead.
                keep = min(keep, self._seg.start_call, max(self._origin, self._n - self.config.window))
        else:
            keep = max(self._origin, self._n - self.config.window)
            if self._cand is not None:
                keep = min(keep, self._cand.start_call, self._confirm_from)
        keep = min(keep, self._n)
        if keep - self._lo > max(1024, (self._n - self._lo) // 2):
            self._buf = [c[keep - self._lo :].copy() for c in self._buf]
            self._lo = keep


def _prime_factors(n: int) -> list[int]:
    """The distinct primes that divide n (n >= 1)."""
    out, k = [], 2
    while k * k <= n:
        if n % k == 0:
            out.append(k)
            while n % k == 0:
                n //= k
        k += 1
    return out + ([n] if n > 1 else [])


def _residual(x: np.ndarray, width: int = 9) -> np.ndarray:
    """x less its centred running median over ``width`` (edges: the nearest window)."""
    if len(x) < width:
        return x - np.median(x)
    med = np.median(np.lib.stride_tricks.sliding_window_view(x, width), axis=1)
    half = width // 2
    med = np.concatenate((np.full(half, med[0]), med, np.full(width - 1 - half, med[-1])))
    return x - med


def _rank_autocorrelation(x: np.ndarray) -> float:
    """Spearman correlation of x[:-1] with x[1:] (0 when undefined)."""
    if len(x) < 3:
        return 0.0
    r = np.argsort(np.argsort(x, kind="stable"), kind="stable").astype(np.float64)
    a, b = r[:-1] - r[:-1].mean(), r[1:] - r[1:].mean()
    den = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / den) if den > 0 else 0.0


def _one_symbol(op: np.ndarray, comm: np.ndarray) -> bool:
    return bool(len(op)) and bool(np.all(op == op[0]) and np.all(comm == comm[0]))


def _clean_period_start(
    same: np.ndarray, span: int, varied: np.ndarray | None = None
) -> int | None:
    """First i with ``same[i:i + span]`` all true (and, with ``varied`` the running
    count of changes of call kind, some change within the span); None if none."""
    if len(same) < span or span < 1:
        return None
    bad = np.concatenate(([0], np.cumsum(~same)))
    ok = bad[span:] - bad[:-span] == 0
    if varied is not None:
        last = np.arange(len(ok)) + span - 1
        ok &= varied[last] - varied[: len(ok)] > 0
    clean = np.flatnonzero(ok)
    return int(clean[0]) if len(clean) else None
