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
  over the trailing ``window`` calls (then over shorter tails while no lag qualifies,
  so that a short trace's warm-up falls out too) and iteration times start at the
  first call from which a whole period repeats exactly.
- If no lag qualifies with bytes in the symbol (variable sequence lengths change the
  bytes of every call), it is retried on (op, communicator) alone.

The node agent calls :func:`iteration_times_from_calls` on the fields of the hook's
ring records (see its docstring); ``greyhound detect`` on the columns of a CSV trace.
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
    "iteration_times_from_ring_records",
]

# More distinct symbols than this are rare in real traces; the rarest are pooled into
# one symbol so the FFT cost stays bounded (one FFT per symbol).
_MAX_TOKENS = 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class CallIterations:
    """Iteration times recovered from one rank's call sequence."""

    period: int | None
    """Calls per iteration; None when the sequence has no period."""
    start: int
    """Index of the first call of the periodic part (calls before it are warm-up)."""
    iteration_times: np.ndarray
    """(num_iterations,) float64 seconds; entry j spans call block j to block j + 1."""
    available_at: np.ndarray
    """(num_iterations,) float64: start time of the last call entry j needs, i.e.
    when an online tracker knows it."""
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
    """Period and per-iteration times of one rank's calls.

    The node agent passes the fields of the hook's ring records, see
    :func:`iteration_times_from_ring_records`. Entry j of the result is the
    median, over the calls of period block j whose symbol recurs one period later, of
    ``t_start[i + period] - t_start[i]``; the median keeps one late call (or an inserted
    eval/checkpoint call) from moving an iteration's time.

    Args:
        op: (n,) op codes (ints or names).
        comm: (n,) communicator ids.
        nbytes: (n,) bytes per call.
        t_start: (n,) float call start times in seconds, non-decreasing.
        threshold, tolerance, max_period: see :func:`find_period`.
        window: the period is found on the trailing ``window`` calls (warm-up calls
            at the start of a trace fall out of it).
        period: a known period (e.g. from an earlier window): skips the search.

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
    if window < 2:
        raise ValueError(f"window must be >= 2, got {window}")
    use_bytes = True
    if period is None:
        for use_bytes in (True, False):
            period = _search_period(
                op, comm, nbytes if use_bytes else None, window=window,
                threshold=threshold, tolerance=tolerance, max_period=max_period,
            )
            if period is not None:
                break
    empty = np.empty(0)
    if period is None or n < 2 * period:
        return CallIterations(
            period=period, start=0, iteration_times=empty, available_at=empty,
            tokens_use_bytes=use_bytes,
        )
    same = (op[period:] == op[:-period]) & (comm[period:] == comm[:-period])
    if use_bytes:
        same &= nbytes[period:] == nbytes[:-period]
    start = _first_clean_period(same, period)
    num_iterations = (n - start) // period - 1
    if num_iterations < 1:
        return CallIterations(
            period=period, start=start, iteration_times=empty, available_at=empty,
            tokens_use_bytes=use_bytes,
        )
    stop = start + num_iterations * period
    deltas = (t_start[start + period : stop + period] - t_start[start:stop]).reshape(
        num_iterations, period
    )
    matched = same[start:stop].reshape(num_iterations, period)
    times = _masked_row_median(deltas, matched)
    available_at = t_start[start + 2 * period - 1 : stop + period : period]
    return CallIterations(
        period=period, start=start, iteration_times=times, available_at=available_at,
        tokens_use_bytes=use_bytes,
    )


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
) -> int | None:
    """find_period on the trailing window; if none, on shorter and shorter tails.

    Warm-up calls sit at the start of a trace; in a short trace they can be a large
    share of the window and pull every lag's ACF down (most of all when one symbol
    dominates and chance agreement is high). Tails of 7/8, 3/4, 1/2, 1/4, ... of the
    window drop them.
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
            return period
    return None


def _first_clean_period(same: np.ndarray, period: int) -> int:
    """First i with ``same[i:i + period]`` all true; 0 if there is none."""
    if len(same) < period:
        return 0
    bad = np.concatenate(([0], np.cumsum(~same)))
    clean = np.flatnonzero(bad[period:] - bad[:-period] == 0)
    return int(clean[0]) if len(clean) else 0


def _masked_row_median(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Row medians over masked entries; rows with no entry use all of theirs.

    Args:
        values: (rows, cols) float64.
        mask: (rows, cols) bool.

    Returns:
        (rows,) float64.
    """
    if mask.all():
        return np.median(values, axis=1)
    full = mask.all(axis=1)
    out = np.empty(len(values))
    out[full] = np.median(values[full], axis=1)
    for row in np.flatnonzero(~full):
        chosen = values[row][mask[row]]
        out[row] = np.median(chosen if len(chosen) else values[row])
    return out
