"""S2: re-split a step's micro-batches across DP groups so the slowest finishes first.

DP group i takes ``t_i`` seconds per micro-batch (as profiled). A step has ``M``
micro-batches in all; group i gets ``m_i`` of them and is busy ``m_i * t_i`` seconds,
and the step waits for the slowest group. :func:`split_microbatches` returns the
integer allocation that minimises that wait, the makespan ``max_i m_i * t_i``, subject
to ``sum_i m_i = M``, every ``m_i`` a multiple of ``P`` (1F1B needs the micro-batches of
a DP group in whole multiples of the pipeline depth) and ``m_i >= minimum``.

The minimum defaults to ``P`` (so to 1 micro-batch when no multiple is asked): a DP
group keeps at least one micro-batch, or one P-block, so that its pipeline stays busy,
its ranks still take part in every gradient reduction with real work behind them, and
the ladder can see whether it recovers (a group given nothing has no time to measure).
The paper's formulation has ``m_i`` in N+ for the same reason. ``minimum=0`` lets a
group be drained. A minimum that is not a multiple of ``P`` acts as the next multiple
up, since ``m_i`` is a multiple of ``P`` anyway.

The algorithm, in units of ``P`` micro-batches: ``N = M / P`` units, group i takes
``f_i(x) = (P x) * t_i`` seconds for ``x`` units (this exact float product is the one
the makespan is measured with, so "optimal" holds for the float values reported), and
``lo`` units at least.

1. A lower bound. The continuous relaxation's level ``T_c`` solves
   ``sum_i max(lo, T_c / (P t_i)) = N``. Any integer optimum ``x*`` with makespan ``T*``
   has ``lo <= x*_i <= T* / (P t_i)``, so ``N = sum x*_i <= sum_i max(lo, T*/(P t_i))``
   and, the sum growing with ``T``, ``T_c <= T*``. Since ``lo`` is the same for every
   group, the groups above their minimum at ``T_c`` are the fastest k, so ``T_c`` is the
   smallest of n closed forms (one sort, one cumulative sum).
2. A start below the optimum. ``x_i = max(lo, floor(T_c / (P t_i)))`` (found with the
   exact products, the division only guessing). Then ``f_i(x_i) <= max(f_i(lo), T_c) <=
   T*`` and ``sum x_i <= N``; fewer than n units are left, at most one per group that
   sits above its minimum.
3. Greedy for the rest. Hand out the remaining units one at a time, each to the group
   whose finish after taking it, ``f_i(x_i + 1)``, is smallest (a heap; ties to the
   lower index). Exact, by an exchange argument: let ``c_i`` be the most units group i
   can take within ``T*`` (the largest ``x`` with ``f_i(x) <= T*``; ``f_i`` grows with
   ``x``), and note ``lo <= c_i`` and ``N <= sum c_i`` because ``x*`` fits within them.
   Suppose the greedy, at some step with ``sum x < N``, gives a unit that ends after
   ``T*``. It gives the cheapest unit, so every group has ``f_i(x_i + 1) > T*``, that
   is ``x_i >= c_i``, and ``sum x >= sum c_i >= N``: a contradiction. So every unit
   given ends by ``T*``, as does the start, and the greedy's makespan is ``T*``. The
   heap holds n entries and pops fewer than n times: O(n log n) whatever ``M``.
4. Among the optimal allocations, the one closest to the even split. With ``T*`` known,
   an allocation is optimal exactly when ``lo <= x_i <= c_i`` and ``sum x = N``. Among
   those, take the one that minimises ``sum_i (x_i - e_i)^2``, where ``e`` is the even
   split (``N // n`` units each, one more for the first ``N % n`` groups). The objective
   is separable and convex, so the minimisers are ``clip(e + lambda, lo, c)`` for the
   largest integer level ``lambda`` whose total is at most ``N``, plus one unit each
   for the ``N - total`` groups that can step to ``lambda + 1`` (every such step costs
   the same ``2 lambda + 1``; they go to the fastest groups, ties to the lower index).
   A healthy job (all ``t_i`` equal) thus gets the even split itself, and the answer
   is deterministic. A bisection on ``lambda`` over vectors: O(n log M).

Checked against a brute force over all allocations and against a cvxpy MILP solved
with HiGHS (tests/test_mitigate_microbatch.py); scripts/bench_plan times it against
that MILP.
"""

from __future__ import annotations

import dataclasses
import heapq
import operator
import time
from collections.abc import Mapping, Sequence
from typing import SupportsIndex

import numpy as np
from numpy.typing import ArrayLike

MAX_TOTAL = 2**53
"""The largest total: micro-batch counts (times P) must be exact as float64."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Allocation:
    """The S2 plan: micro-batches per DP group, and how long the slowest group takes."""

    allocation: tuple[int, ...]
    """(n,) micro-batches of each DP group, in the order of the times given; sums to the
    total, each a multiple of the multiple and at least the minimum."""
    makespan: float
    """Seconds of the slowest DP group, ``max_i allocation[i] * t_i``; the least any
    allocation allowed can reach."""
    solve_seconds: float
    """Wall-clock seconds the solver took (validation included)."""

    def as_dict(self) -> dict[str, object]:
        """``{allocation, makespan, solve_seconds}``, as ``greyhound plan microbatches
        --json`` prints it (DESIGN.md)."""
        return {
            "allocation": list(self.allocation),
            "makespan": self.makespan,
            "solve_seconds": self.solve_seconds,
        }


def split_microbatches(
    seconds_per_microbatch: ArrayLike,
    *,
    total: int,
    multiple: int = 1,
    minimum: int | None = None,
) -> Allocation:
    """The allocation of ``total`` micro-batches that minimises the slowest DP group's time.

    Args:
        seconds_per_microbatch: (n,) seconds one micro-batch takes on each DP group,
            each finite and > 0.
        total: M, the micro-batches of one step, >= 1; a multiple of ``multiple``.
        multiple: P, each group's count must be a multiple of it (the pipeline depth
            for 1F1B); 1 for no constraint.
        minimum: the fewest micro-batches a group may get, >= 0; None for ``multiple``
            (one micro-batch, or one P-block). Rounded up to a multiple of ``multiple``.

    Returns:
        The optimal allocation (the one closest to the even split among the optimal
        ones, see the module's docstring), its makespan and the time to solve.

    Raises:
        ValueError: one line saying which input is wrong and what is allowed.
    """
    start = time.perf_counter()
    t, num_units, per_unit, lo = _validate(seconds_per_microbatch, total, multiple, minimum)
    units = _optimal_units(t, num_units, per_unit, lo)
    allocation = units * per_unit
    return Allocation(
        allocation=tuple(allocation.tolist()),
        makespan=makespan(allocation, t),
        solve_seconds=time.perf_counter() - start,
    )


def even_split(num_groups: int, *, total: int, multiple: int = 1) -> tuple[int, ...]:
    """The even split in whole multiples: ``total // multiple`` blocks dealt out evenly,
    the first ``(total // multiple) % num_groups`` groups one block more (the plan a job
    runs without S2, and the baseline S2 is compared with). Raises ValueError unless
    ``num_groups >= 1`` and ``total`` is a multiple of ``multiple``."""
    if num_groups < 1:
        raise ValueError(f"no DP groups: need at least one, got {num_groups}")
    if multiple < 1 or total % multiple:
        raise ValueError(f"total {total} is not a multiple of {multiple}")
    return tuple(int(u) * multiple for u in _even_units(num_groups, total // multiple))


def replica_seconds(replicas: Sequence[Sequence[int]], slowness: Mapping[int, float]) -> np.ndarray:
    """(dp,) relative seconds per micro-batch of each DP replica: its slowest member's
    slowness (1.0 for a healthy rank)."""
    return np.array([max((slowness.get(r, 1.0) for r in members), default=1.0) for members in replicas])


def makespan(allocation: ArrayLike, seconds_per_microbatch: ArrayLike) -> float:
    """``max_i allocation[i] * seconds_per_microbatch[i]`` as float64, the product the
    solver optimises."""
    m = np.asarray(allocation, dtype=np.int64).astype(np.float64)
    return float(np.max(m * np.asarray(seconds_per_microbatch, dtype=np.float64)))


def whole_number(name: str, value: object, least: int) -> int:
    """``value`` as an int >= ``least`` (bools and fractions refused)."""
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")
    number = operator.index(value)
    if number < least:
        raise ValueError(f"{name} must be a whole number >= {least}, got {number}")
    return number


def _validate(
    seconds: ArrayLike, total: object, multiple: object, minimum: object
) -> tuple[np.ndarray, int, int, int]:
    """(t, N units, P, lo units), or ValueError with one line."""
    try:
        t = np.asarray(seconds, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError("seconds per micro-batch must be numbers, one per DP group") from None
    if t.ndim != 1:
        raise ValueError(f"seconds per micro-batch must be a flat list, one per DP group; got shape {t.shape}")
    if len(t) == 0:
        raise ValueError("no DP groups: give the seconds per micro-batch of at least one DP group")
    bad = np.flatnonzero(~(np.isfinite(t) & (t > 0)))
    if len(bad):
        raise ValueError(
            f"seconds per micro-batch of DP group {bad[0]} is {float(t[bad[0]])!r}; each must be a finite number > 0"
        )
    m_total = whole_number("total", total, 1)
    p = whole_number("multiple", multiple, 1)
    least = whole_number("minimum", p if minimum is None else minimum, 0)
    if m_total > MAX_TOTAL:
        raise ValueError(f"total {m_total} is more than 2**53 micro-batches, which a float cannot count exactly")
    if m_total % p:
        raise ValueError(
            f"total {m_total} is not a multiple of {p}; every DP group's count is a multiple of {p}, "
            "so the total must be too"
        )
    lo = -(-least // p)
    n = len(t)
    if n * lo * p > m_total:
        rounded = "" if lo * p == least else f" (minimum {least} rounded up to a multiple of {p})"
        raise ValueError(
            f"total {m_total} is less than {n} DP groups x {lo * p} micro-batches each{rounded} = {n * lo * p}; "
            "give a larger total or a smaller minimum"
        )
    if not np.isfinite(float(m_total) * float(np.max(t))):
        raise ValueError("total x the largest seconds per micro-batch overflows a float; use smaller time units")
    return t, m_total // p, p, lo


def _finish(units: np.ndarray, t: np.ndarray, per_unit: int) -> np.ndarray:
    """(n,) seconds each group takes for ``units`` P-blocks: the exact float product
    ``float(P x) * t``."""
    return (units * per_unit).astype(np.float64) * t


def _capacity(level: float, t: np.ndarray, per_unit: int, limit: int) -> np.ndarray:
    """(n,) the most units (0..limit) each group can take finishing by ``level``
    seconds: a float division guesses, the exact products decide."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        guess = np.floor(level / (per_unit * t))
    units = np.clip(np.nan_to_num(guess, nan=0.0, posinf=limit), 0, limit).astype(np.int64)
    while True:
        up = (units < limit) & (_finish(units + 1, t, per_unit) <= level)
        down = (units > 0) & (_finish(units, t, per_unit) > level)
        if not (up.any() or down.any()):
            return units
        units += up.astype(np.int64) - down.astype(np.int64)


def _relaxed_level(t: np.ndarray, num_units: int, per_unit: int, lo: int) -> float:
    """T_c: the level at which ``sum_i max(lo, T / (P t_i)) = N``, a lower bound on the
    optimal makespan. Groups above their minimum at T are the fastest k; T_c is the
    least of the n levels ``(N - (n - k) lo) / sum_{fastest k} 1 / (P t_i)``."""
    rate = np.cumsum(1.0 / (per_unit * np.sort(t)))
    rest = (len(t) - np.arange(1, len(t) + 1)) * lo
    return float(np.min((num_units - rest) / rate))


def _optimal_units(t: np.ndarray, num_units: int, per_unit: int, lo: int) -> np.ndarray:
    """(n,) int64 units of P micro-batches: optimal makespan, closest to the even split."""
    n = len(t)
    floor = np.full(n, lo, dtype=np.int64)
    # 1-2. Start at (a hair below) the relaxed level: every group within T*, sum <= N.
    level = _relaxed_level(t, num_units, per_unit, lo) * (1.0 - 1e-12)
    units = np.maximum(floor, _capacity(level, t, per_unit, num_units))
    if units.sum() > num_units:  # float trouble only; the minimums are a valid start too
        units = floor.copy()
    # 3. Greedy for the rest: the unit that ends first goes next.
    counts = units.tolist()
    times = t.tolist()
    heap = list(zip(_finish(units + 1, t, per_unit).tolist(), range(n)))
    heapq.heapify(heap)
    for _ in range(num_units - int(units.sum())):
        i = heap[0][1]
        counts[i] += 1
        heapq.heapreplace(heap, (float((counts[i] + 1) * per_unit) * times[i], i))
    best = float(np.max(_finish(np.asarray(counts, dtype=np.int64), t, per_unit)))
    # 4. Among all allocations within T*, the one closest to the even split.
    cap = _capacity(best, t, per_unit, num_units)
    return _closest(_even_units(n, num_units), floor, cap, t, num_units)


def _even_units(n: int, num_units: int) -> np.ndarray:
    """(n,) N // n units each, the first N % n groups one more."""
    even = np.full(n, num_units // n, dtype=np.int64)
    even[: num_units % n] += 1
    return even


def _closest(
    even: np.ndarray, floor: np.ndarray, cap: np.ndarray, t: np.ndarray, num_units: int
) -> np.ndarray:
    """(n,) the x with floor <= x <= cap, sum x = N, that minimises sum (x - even)^2;
    spare steps of equal cost go to the fastest groups, then the lower index."""

    def at(shift: int) -> np.ndarray:
        return np.clip(even + shift, floor, cap)

    # The largest shift whose total is at most N: at(low) sums to <= N, at(high) to >= N.
    low, high = int(np.min(floor - even)), int(np.max(cap - even))
    while low < high:
        mid = (low + high + 1) // 2
        if int(at(mid).sum()) <= num_units:
            low = mid
        else:
            high = mid - 1
    units = at(low)
    spare = num_units - int(units.sum())
    if spare:
        can_step = np.flatnonzero((floor <= even + low) & (even + low < cap))
        order = can_step[np.lexsort((can_step, t[can_step]))]
        units[order[:spare]] += 1
    return units
