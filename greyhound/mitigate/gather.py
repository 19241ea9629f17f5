"""S3 for compute stragglers: gather them into the fewest DP replicas, so that S2 can
give the replicas left clean more micro-batches.

A DP replica's pipeline runs at its slowest stage's pace, and S2 balances the replicas
(microbatch.py). Two stragglers in two replicas slow both, and S2 has nothing to move
micro-batches to; in one replica they slow only that one, and S2 moves its
micro-batches to the others. Putting them into one *stage* instead (placement.py's
consolidation, one straggler per replica when dp >= 2) leaves every replica with a
straggler: on the local cluster it changed nothing (1.2-1.3 s a step before and after
the move, stragglers 7.2x and 3.1x); and for two stragglers already in one replica it
would spread them and undo S2.

The gathering only exchanges DP ranks inside a stage: a straggler keeps its stage and
takes the cell of the rank at its target replica's same stage, which takes the
straggler's cell. Both hold that stage's parameters and optimizer state already (DP
replicas are identical), so nothing moves but each rank's process groups and data
shard: the pause is a rebuild. Two stragglers of one stage stay in different replicas.

Exact under that model: every assignment of stragglers to replicas is tried up to a
renaming of the replicas (restricted growth strings: the i-th straggler goes to a
replica already used or the next new one; stragglers of one stage never share one), each
is scored by S2's exact optimum over the replicas' paces (a replica's pace: its slowest
straggler's slowness, 1 for a clean replica), and the best is mapped onto the actual
replicas so that the fewest stragglers change replica (an assignment problem, solved
exactly by scipy's linear_sum_assignment). Ties go to fewer cell changes, then to the
first assignment found. The count of assignments is at most the Bell number of the
stragglers (203 for 6, 4140 for 8): ``MAX_STRAGGLERS`` bounds it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment

from greyhound.mitigate.microbatch import split_microbatches
from greyhound.mitigate.placement import Cell, PlacementPlan, layout

MAX_STRAGGLERS = 8
"""The most stragglers gathered at once (4140 assignments, each an S2 solve)."""


def gather_stragglers(placement: Sequence[Cell], *, stragglers: Mapping[int, float], microbatches: int,
                      multiple: int = 1) -> tuple[PlacementPlan, tuple[int, ...]]:
    """The placement that gathers ``stragglers`` ({rank: slowness >= 1}) into the
    fewest replicas by DP-rank exchanges within stages, and S2's split for it.

    Args:
        placement: (R,) the current (dp_rank, stage) of each rank.
        stragglers: {rank: slowness}; slowness 2.0 is twice as slow.
        microbatches: the micro-batches of one step (S2 shares them).
        multiple: each replica's micro-batches a multiple of this (S2's ``multiple``).

    Returns:
        (the plan, S2's split under it). The plan's costs are S2's makespans in seconds of
        one healthy micro-batch, before and after; it moves no rank's stage
        (``moves`` is empty), ``reshuffled`` lists the ranks whose cell changes, and
        ``improves`` is False (with the current placement) when no gathering beats it.

    Raises:
        ValueError: one line saying what is wrong (a placement that is not a grid, an
            unknown rank, a slowness below 1, too many stragglers).
    """
    start = time.perf_counter()
    dp = 1 + max((int(c[0]) for c in placement), default=0)
    pp = 1 + max((int(c[1]) for c in placement), default=0)
    cells = list(layout(placement, dp=dp, pp=pp).cells)       # or ValueError: not a grid
    slow = {}
    for rank, slowness in stragglers.items():
        if not 0 <= int(rank) < len(cells):
            raise ValueError(f"straggler rank {rank} is out of range; ranks are 0..{len(cells) - 1}")
        if not float(slowness) >= 1.0:
            raise ValueError(f"slowness of straggler rank {rank} must be >= 1, got {slowness!r}")
        slow[int(rank)] = float(slowness)
    if len(slow) > MAX_STRAGGLERS:
        raise ValueError(f"{len(slow)} stragglers; at most {MAX_STRAGGLERS} are gathered at once")
    ranks = sorted(slow)
    stage = [cells[r][1] for r in ranks]

    def makespan(paces: list[float]) -> tuple[float, tuple[int, ...]]:
        times = paces + [1.0] * (dp - len(paces))
        plan = split_microbatches(np.array(times), total=microbatches, multiple=multiple)
        return plan.makespan, tuple(int(m) for m in plan.allocation)

    now_paces = [max([slow[r] for r in ranks if cells[r][0] == d], default=1.0) for d in range(dp)]
    before, before_split = makespan(now_paces)
    if not ranks:
        return _plan(cells, cells, before, before, start, False), before_split
    best: tuple | None = None          # (makespan, changes, labels -> replicas, split)
    for labels in _assignments(stage, dp):
        groups = 1 + max(labels, default=-1)
        paces = [max(slow[r] for r, label in zip(ranks, labels) if label == g) for g in range(groups)]
        span, _ = makespan(paces)
        if best is not None and span > best[0]:
            continue
        # Label g onto replica d costs the stragglers of g not in d now.
        cost = np.array([[sum(1 for r, label in zip(ranks, labels) if label == g and cells[r][0] != d)
                          for d in range(dp)] for g in range(groups)])
        rows, cols = linear_sum_assignment(cost)
        changes = int(cost[rows, cols].sum())
        if best is None or (span, changes) < best[:2]:
            target = {r: (int(cols[label]), cells[r][1]) for r, label in zip(ranks, labels)}
            best = (span, changes, target)
    assert best is not None      # the empty assignment at least
    after, _, target = best
    if not after < before:
        return _plan(cells, cells, before, before, start, False), before_split
    new = _exchange(cells, target)
    paces = [max([slow[r] for r in ranks if new[r][0] == d], default=1.0) for d in range(dp)]
    after, split = makespan(paces)
    return _plan(cells, new, before, after, start, after < before), split


def _assignments(stage: list[int], dp: int):
    """Every assignment of labels (replicas up to renaming) to the stragglers, whose
    stages are ``stage``: restricted growth strings, at most ``dp`` labels, no two
    stragglers of one stage under one label."""
    labels: list[int] = []

    def extend(i: int, used: int):
        if i == len(stage):
            yield tuple(labels)
            return
        for label in range(min(used + 1, dp)):
            if any(labels[j] == label and stage[j] == stage[i] for j in range(i)):
                continue
            labels.append(label)
            yield from extend(i + 1, max(used, label + 1))
            labels.pop()

    yield from extend(0, 0)


def _exchange(cells: list[Cell], target: dict[int, Cell]) -> list[Cell]:
    """The placement with each straggler at its target cell; in each stage, the other
    ranks keep their cells where free and take the freed ones (in rank order) where not."""
    new = list(cells)
    taken = set(target.values())
    freed = sorted((cells[r] for r in target if cells[r] not in taken), key=lambda c: (c[1], c[0]))
    for r, cell in target.items():
        new[r] = cell
    for r, cell in enumerate(cells):
        if r in target or cell not in taken:
            continue
        spare = next(c for c in freed if c[1] == cell[1])   # a straggler left this stage's cell
        freed.remove(spare)
        new[r] = spare
    return new


def _plan(cells: list[Cell], new: list[Cell], before: float, after: float, start: float,
          improves: bool) -> PlacementPlan:
    moved = [r for r, (old, cell) in enumerate(zip(cells, new)) if old != cell]
    reason = (f"S3: gather stragglers into fewer replicas; {len(moved)} ranks change DP rank within their "
              f"stage {moved}; S2 makespan {before:.4g} -> {after:.4g} healthy micro-batches"
              if improves else f"S3: no gathering of stragglers beats the current placement "
              f"(S2 makespan {before:.4g} healthy micro-batches)")
    return PlacementPlan(placement=tuple(new), moves=(), reshuffled=tuple(moved), cost_before=before,
                         cost_after=after, improves=improves, reason=reason,
                         solve_seconds=time.perf_counter() - start)
