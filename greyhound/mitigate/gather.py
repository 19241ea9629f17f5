"""S3 for compute stragglers: gather them into the fewest DP replicas, so that S2 can
give the replicas left clean more micro-batches; or, where no split can (a job whose
replicas keep multiples of the pipeline depth), consolidate them into the fewest stages
(placement.py): :func:`choose_straggler_plan` weighs both on one 1F1B model.

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

import dataclasses
import time
from collections.abc import Mapping, Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment

from greyhound.mitigate.microbatch import replica_seconds, split_microbatches
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


def pipeline_step(placement: Sequence[Cell], *, stragglers: Mapping[int, float], split: Sequence[int]) -> float:
    """Modelled step of a DP x PP placement under a micro-batch split, in healthy
    micro-batch times of one stage: replica d runs its ``m_d`` micro-batches through
    its stages, 1F1B, in ``(m_d - 1) * its slowest stage + the sum of its stages`` (the
    slowest stage sets the pace; every stage's time adds once while the pipeline fills
    and drains); the step waits for the slowest replica. A stage's time is its rank's
    slowness (1 when healthy). Two stragglers in two stages of one replica cost that
    replica the second one's fill and drain (the paper's Figure 12 makes the same point:
    8.5 s with stragglers in two stages, 8 s in one)."""
    cells = list(placement)
    dp = 1 + max(d for d, _ in cells)
    paces: list[list[float]] = [[] for _ in range(dp)]
    for rank, (d, _) in enumerate(cells):
        paces[d].append(float(stragglers.get(rank, 1.0)))
    return max((m - 1) * max(p) + sum(p) for m, p in zip(split, paces, strict=True))


def choose_straggler_plan(placement: Sequence[Cell], candidates: Sequence[PlacementPlan], *,
                          stragglers: Mapping[int, float], microbatches: int,
                          multiple: int = 1) -> tuple[PlacementPlan, tuple[int, ...]]:
    """The placement for compute stragglers among the one in force and ``candidates``
    (gather_stragglers' gathering into the fewest replicas; placement.py's
    consolidation into the fewest stages), each under S2's split for it (``multiple``
    as S2 takes it), by :func:`pipeline_step`.

    Which one wins depends on what S2 can do. Where S2 can move micro-batches, gathering
    wins: a clean replica takes the slow one's work (stragglers 4x slow in two
    replicas of a DP=2 x PP=4 job with 8 + 8 micro-batches: 35 as they are, 18 gathered
    with 3 + 13, 35 in one stage). Where it cannot (a job whose replicas must keep
    multiples of the pipeline depth, 4 + 4), one stage wins: two stragglers in two
    stages of one replica, 22; in one stage, every replica has one slow stage, 19.

    Returns:
        (the plan, S2's split under it). The plan's costs are :func:`pipeline_step`'s,
        before (the placement in force) and after; ``improves`` is False, with the
        placement in force, when no candidate beats it. Ties go to the placement in
        force, then to the candidate that moves fewer ranks' stages, then to the first.

    Raises:
        ValueError: as split_microbatches does (a total that is not a multiple).
    """
    start = time.perf_counter()
    cells = tuple((int(d), int(s)) for d, s in placement)

    def scored(cand: Sequence[Cell]) -> tuple[float, tuple[int, ...]]:
        dp, pp = 1 + max(d for d, _ in cand), 1 + max(s for _, s in cand)
        paces = replica_seconds(layout(cand, dp=dp, pp=pp).pipelines, stragglers)
        split = tuple(int(m) for m in split_microbatches(paces, total=microbatches, multiple=multiple).allocation)
        return pipeline_step(cand, stragglers=stragglers, split=split), split

    before, best_split = scored(cells)
    best: PlacementPlan | None = None
    after = before
    for plan in candidates:
        if not plan.improves or tuple(plan.placement) == cells:
            continue
        cost, split = scored(plan.placement)
        if cost < after or (best is not None and cost == after and len(plan.moves) < len(best.moves)):
            best, after, best_split = plan, cost, split
    seconds = time.perf_counter() - start
    if best is None:
        return PlacementPlan(placement=cells, moves=(), reshuffled=(), cost_before=before, cost_after=before,
                             improves=False, solve_seconds=seconds, reason=(
                                 f"S3: neither gathering the stragglers into fewer replicas nor consolidating them "
                                 f"into fewer stages beats the placement in force (modelled step {before:.4g} "
                                 f"healthy micro-batch stage times under split {list(best_split)})")), best_split
    if best.moves:
        stages = sorted({best.placement[r][1] for r in stragglers})
        what = (f"consolidate the stragglers into stage{'s' if len(stages) > 1 else ''} "
                f"{','.join(map(str, stages))}; {len(best.moves)} ranks change stage "
                f"[{', '.join(f'{m.rank}:{m.from_stage}->{m.to_stage}' for m in best.moves)}]")
    else:
        what = (f"gather the stragglers into fewer replicas; {len(best.reshuffled)} ranks change DP rank within "
                f"their stage {list(best.reshuffled)}")
    return dataclasses.replace(
        best, cost_before=before, cost_after=after, improves=True, solve_seconds=best.solve_seconds + seconds,
        reason=f"S3: {what}; modelled step {before:.4g} -> {after:.4g} healthy micro-batch stage times, "
               f"split {list(best_split)}"), best_split


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
