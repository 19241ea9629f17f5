"""S3: choose a new DP x PP placement of a running job's ranks (TP = 1), exactly.

A placement gives each global rank ``r`` (0..R-1, ``R = dp * pp``) a grid cell
``(d, s)``: its DP rank ``d`` (which replica, i.e. which pipeline) and its PP stage
``s``. Every rank lives on a fixed node (``node_of_rank``). The DP group of stage ``s``
is the ``dp`` ranks of that stage; the pipeline of replica ``d`` is its ``pp`` ranks.
:func:`plan_placement` returns the placement that minimises the step-time model below
among *all* ``R!`` placements, and among the optimal ones the one that moves the fewest
ranks to another stage. Nothing here does I/O. Two moves of the paper come out of it:

* **Role swap for a congested link.** A slow link is a node pair ``frozenset({a, b})``
  or a node name ``a`` (its NIC: every inter-node pair touching ``a``), with a
  bandwidth factor in (0, 1] (0.05: 5% of healthy). When the link carries a DP ring
  (heavy), the optimum puts it under the light PP traffic (the paper's Figure 11:
  swapping the DP/PP roles of two nodes), or off the job's traffic altogether.
* **Consolidation of compute stragglers** (the paper's; the planner weighs it against
  gathering them into the fewest replicas, gather.choose_straggler_plan: with dp >= 2 one
  stage holds one straggler per replica, so every replica stays slow and S2 has nowhere
  to move micro-batches, which gathering leaves it; it wins where no split can help, a
  job whose replicas keep multiples of the pipeline depth). A stage runs at its slowest member's pace,
  so the stragglers end up in the fewest stages, ``ceil(#stragglers / dp)`` (with no
  slow link in play: moving a straggler into a stage whose pace is already at least its
  own never costs more), and in the lightest ones (``stage_seconds``). With the default
  weights the preference for any pp is: the inner stages 1..pp-2 (among them the one
  that needs fewer moves, then the lower), then stage 0, then stage pp-1; for pp = 4
  the order 1, 2, 0, 3.

The step-time model (seconds per step), :func:`step_cost`::

    T = sum_s w_s * pace_s  +  max_s A_s * inv(ring_s)  +  P * max_d sum_s inv(hop_{d,s})

* compute: ``w_s = stage_seconds[s]``, the healthy compute seconds of stage s per
  step; ``pace_s`` the largest slowdown of a rank in stage s (1 without stragglers). A
  micro-batch passes every stage once, so each stage's time adds.
* DP: stage s all-reduces ``dp_bytes[s]`` with a ring over its ranks in dp order, the
  ring's links being ``(d, s)-(d+1 mod dp, s)``; ``A_s = dp_bytes[s] * 2(dp-1)/dp /
  bandwidth`` and ``inv(ring_s)`` the largest ``inv`` of its links (the ring runs at
  its slowest link). The stages all-reduce at once, on disjoint ranks: the step waits
  for the slowest. ``A_s = 0`` when dp = 1.
* PP: each hop ``(d, s)-(d, s+1)`` carries ``pp_bytes`` of activations per step, ``P =
  pp_bytes / bandwidth``; the pipelines run side by side and the step waits for the
  slowest pipeline's transfers.
* ``inv(link) = 1 / factor`` for a slow link (the smallest factor of the entries that
  cover it: its pair, or either node), else 1. Links that no entry covers run at
  ``bandwidth``, intra-node ones included: a constant, so the model does not try to pack
  traffic inside nodes (that is the launcher's layout, which the tie-break on fewest
  moved ranks keeps); a slow entry never covers an intra-node pair.

Moving a rank to another stage means sending it that stage's parameters and optimizer
state: the pause's cost. So among the placements of least ``T`` the plan takes the one
that changes the fewest ranks' stages; then the fewest ranks' cells (a rank that only
changes its DP rank within its stage moves no parameters, but its data shard follows the
cell: it reads replica d's share of each batch from the next step on); then the
lexicographically smallest class-cell sequence (below). The plan is deterministic.

Exactness. Call a rank *special* when its node is touched by a slow entry or it is a
straggler, and group special ranks into *classes* of equal (node, slowdown), where a
straggler on a node no slow entry touches counts as on no node; the rest are *plain*.
(1) ``T`` depends only on which class sits in which cell: a link between two plain
ranks is never slow (no entry touches their nodes) and their pace is 1; a link between a
plain rank and a special rank of node ``u`` has ``inv = 1/factor(u)`` whatever the plain
rank (1 when only pairs name ``u``). So plain ranks are interchangeable, as are the
ranks of one class. (2) So are they for the moves: given the class of each cell, keep every rank whose cell keeps
its class, then keep in their stage as many more as the stage's cells of their class
allow, and move the rest. This keeps ``sum_s min(now_s, new_s)`` ranks of each class (and
of the plain ones) in their stage, the most any assignment can, and every rank that
could keep its cell, the most any can; both at once, since a rank keeping its cell keeps
its stage. Stage moves and cell changes are thus functions of the class cell sets. (3)
The search enumerates every family of disjoint cell sets, one per class (classes of
slow nodes first, then by decreasing slowdown, then by lowest rank; each set's cells
increasing, cells numbered ``s * dp + d``), depth first in lexicographic order, and
prunes a branch only when a lower bound on the key ``(T, stage moves, cell changes)``
of every completion is greater than the best complete key found, or equal to it while
the branch's cells already sort after the best one's. It starts from the current
placement, key ``(T_now, 0, 0)``. At a leaf the bound is the exact key, so the result is
the least key, ties to the first sequence: the claimed optimum, provided the bounds hold:

* T: a link not yet decided counts ``inv = 1`` (every link has ``inv >= 1``), unless
  one end is placed and every rank that can still land on the other end makes it
  slow, when it counts the least such ``inv``; an undecided pace counts 1, except that
  the slowest class still to place raises some stage to its pace (the least such sum,
  over the stages). ``fsum`` is correctly rounded, hence monotone and independent of the
  order of its terms, so the bounds compare exactly with the complete costs.
* stage moves: the ranks placed so far in a stage beyond their class's ranks there
  now, plus the plain ranks that no longer fit in their stage; or, per stage, the ranks
  still to place that sit there now beyond its free cells; and before each class of
  two ranks or more, an exchange count: a rank still to place is *banned* from a free
  cell when an edge to a placed cell alone makes the bound on T exceed the best T found;
  stage s then loses at least ``dep_s = max(waiting_s - free_s, banned out_s)`` ranks
  and gains at least ``arr_s = max(0, free_s - waiting_s + banned out_s)`` from other
  stages, whose departures are moves too: at least ``dep_s + max(arr_s, sum of the other
  dep)`` moves in all.
* cell changes: the placed ranks off their cell, the plain ranks whose cell a class
  took, and the ranks of the class being placed that can no longer get their cell back.

Sizes. The search visits at most ``C(R, |class 1|) * C(R, |class 2|) * ...`` branches,
far fewer after pruning, at some 30 000 branches a second. Measured at R = 64 (8 x 8, 2
x 32, 4 x 16): a slow node (any ranks per node), a slow link between nodes of one or
two ranks, or up to five stragglers take 0.01-3 s; the reference job (8 ranks) about a
millisecond. A slow link between two nodes of four or more ranks each, on 32 ranks or
more, is beyond it (the least-moves proof needs too many branches). Limits: ``R <=
MAX_RANKS``, at most ``MAX_SPECIAL_RANKS`` special ranks, at most ``MAX_SEARCH_NODES``
branches (some 5-10 s); beyond them :func:`plan_placement` raises ValueError rather
than return a plan it cannot prove optimal.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence

from greyhound.mitigate.microbatch import whole_number as _whole

MAX_RANKS = 1024
"""The most ranks (dp * pp) a placement may have."""
MAX_SPECIAL_RANKS = 64
"""The most special ranks (on a node touched by a slow link, or straggling)."""
MAX_SEARCH_NODES = 200_000
"""The most branches the exact search may visit before it gives up with ValueError."""

Cell = tuple[int, int]
"""(dp_rank, stage)."""
SlowLinks = Mapping[str | frozenset[str], float]
_FreeInv = Callable[[int, int], float]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """The traffic and compute of one training step, for :func:`step_cost`."""

    dp_bytes: float | Sequence[float]
    """Gradient bytes each stage all-reduces per step: one number for every stage, or
    one per stage; each finite and >= 0."""
    pp_bytes: float
    """Activation (and gradient) bytes each pipeline hop carries per step, >= 0."""
    bandwidth: float
    """Healthy link bandwidth in bytes per second, > 0."""
    stage_seconds: Sequence[float] | None = None
    """(pp,) healthy compute seconds of each stage per step, each > 0. None: 1 s for an
    inner stage, 1.1 s for the first (embedding) and 1.2 s for the last (LM head and
    loss), so that stragglers go to inner stages first, then the first, then the last."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageMove:
    """A rank that changes stage: it must receive the new stage's parameters and
    optimizer state."""

    rank: int
    from_stage: int
    to_stage: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlacementPlan:
    """The S3 plan. ``improves`` is False when no placement beats the current one under
    the model (all links slow, stragglers already consolidated, nothing slow at all);
    the placement is then the current one and nothing moves."""

    placement: tuple[Cell, ...]
    """(R,) the new (dp_rank, stage) of each rank."""
    moves: tuple[StageMove, ...]
    """The ranks whose stage changes, by rank."""
    reshuffled: tuple[int, ...]
    """Ranks that keep their stage but change DP rank: no parameters move, but their
    data shard follows the new cell."""
    cost_before: float
    """Modelled seconds per step of the current placement."""
    cost_after: float
    """Modelled seconds per step of the new placement; the least of any placement."""
    improves: bool
    """``cost_after < cost_before``."""
    reason: str
    """One line for the event log."""
    solve_seconds: float
    """Wall-clock seconds the planner took (validation included)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """What the training side needs to rebuild its process groups for a placement."""

    cells: tuple[Cell, ...]
    """(R,) (dp_rank, stage) of each global rank."""
    dp_groups: tuple[tuple[int, ...], ...]
    """(pp, dp) the global ranks of each stage's DP group, in dp order (the ring)."""
    pipelines: tuple[tuple[int, ...], ...]
    """(dp, pp) the global ranks of each replica's pipeline, in stage order."""


def default_placement(dp: int, pp: int) -> tuple[Cell, ...]:
    """The launcher's placement: rank ``s * dp + d`` at cell (d, s)."""
    dp, pp = _whole("dp", dp, 1), _whole("pp", pp, 1)
    return tuple((r % dp, r // dp) for r in range(dp * pp))


def layout(placement: Sequence[Cell], *, dp: int, pp: int) -> Layout:
    """The per-rank cells, each stage's DP group and each replica's pipeline (lists of
    global ranks) of a placement. Raises ValueError unless it is a bijection of the
    ranks 0..dp*pp-1 onto the cells."""
    dp, pp = _whole("dp", dp, 1), _whole("pp", pp, 1)
    cells = _check_placement(placement, dp, pp)
    rank_at = {cell: r for r, cell in enumerate(cells)}
    return Layout(
        cells=cells,
        dp_groups=tuple(tuple(rank_at[(d, s)] for d in range(dp)) for s in range(pp)),
        pipelines=tuple(tuple(rank_at[(d, s)] for s in range(pp)) for d in range(dp)),
    )


def step_cost(
    placement: Sequence[Cell],
    *,
    dp: int,
    pp: int,
    node_of_rank: Sequence[str],
    model: CostModel,
    slow_links: SlowLinks | None = None,
    stragglers: Mapping[int, float] | None = None,
) -> float:
    """Modelled seconds per step of a placement (the module docstring's ``T``)."""
    problem = _Problem.build(dp, pp, node_of_rank, placement, model, slow_links, stragglers)
    return problem.cost_of(problem.current_classes)


def plan_placement(
    *,
    dp: int,
    pp: int,
    node_of_rank: Sequence[str],
    model: CostModel,
    placement: Sequence[Cell] | None = None,
    slow_links: SlowLinks | None = None,
    stragglers: Mapping[int, float] | None = None,
    max_branches: int = MAX_SEARCH_NODES,
) -> PlacementPlan:
    """The placement of least modelled step time, moving the fewest ranks' stages.

    Args:
        dp: DP degree (replicas), >= 1.
        pp: PP degree (stages), >= 1.
        node_of_rank: (R,) the node each global rank runs on.
        model: bytes, bandwidth and stage compute seconds of a step.
        placement: (R,) the current (dp_rank, stage) of each rank; None for
            :func:`default_placement`.
        slow_links: ``{frozenset({a, b}) or a: factor}``, factor in (0, 1] of the
            healthy bandwidth; a node name stands for all its inter-node links.
        stragglers: ``{rank: slowdown}``, slowdown >= 1 (2.0: twice as slow).
        max_branches: branches the exact search may visit before it gives up with a
            ValueError (the master passes fewer: it must not stall for seconds).

    Returns:
        The plan (see :class:`PlacementPlan`).

    Raises:
        ValueError: one line saying which input is wrong and what is allowed, or that
            the instance is beyond the exact search's limits.
    """
    start = time.perf_counter()
    problem = _Problem.build(dp, pp, node_of_rank, placement, model, slow_links, stragglers)
    before = problem.cost_of(problem.current_classes)
    after, cell_sets = _Search(problem, before, max_branches=_whole("max_branches", max_branches, 1)).run()
    new = problem.ranks_to_cells(cell_sets)
    moves = tuple(
        StageMove(rank=r, from_stage=old[1], to_stage=cell[1])
        for r, (old, cell) in enumerate(zip(problem.cells, new))
        if old[1] != cell[1]
    )
    reshuffled = tuple(r for r, (old, cell) in enumerate(zip(problem.cells, new)) if old[1] == cell[1] and old != cell)
    return PlacementPlan(
        placement=new,
        moves=moves,
        reshuffled=reshuffled,
        cost_before=before,
        cost_after=after,
        improves=after < before,
        reason=_reason(problem, moves, before, after),
        solve_seconds=time.perf_counter() - start,
    )


def _reason(problem: _Problem, moves: tuple[StageMove, ...], before: float, after: float) -> str:
    """One line for the event log."""
    what = [f"{problem.describe_link(k)} at {f:.0%}" for k, f in sorted(problem.slow.items(), key=str)]
    what += [f"rank {r} x{f:g}" for r, f in sorted(problem.slowdown.items())]
    slow = "; ".join(what) or "nothing slow"
    if not after < before:
        return f"S3: no placement beats the current one ({slow}); modelled step {before:.4g} s"
    shown = ", ".join(f"{m.rank}:{m.from_stage}->{m.to_stage}" for m in moves[:8])
    more = f" (+{len(moves) - 8} more)" if len(moves) > 8 else ""
    return (
        f"S3: {slow}; {len(moves)} ranks change stage [{shown}{more}]; "
        f"modelled step {before:.4g} s -> {after:.4g} s ({1 - after / before:.0%} faster)"
    )


# -- validation ------------------------------------------------------------------------
def _number(name: str, value: object, *, low: float, high: float = math.inf, open_low: bool = False) -> float:
    """``value`` as a finite float in [low, high] (or (low, high] when ``open_low``)."""
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    bad = not math.isfinite(x) or x > high or x < low or (open_low and x == low)
    if bad:
        side = "(" if open_low else "["
        raise ValueError(f"{name} must be a finite number in {side}{low:g}, {high:g}], got {value!r}")
    return x


def _check_placement(placement: Sequence[Cell], dp: int, pp: int) -> tuple[Cell, ...]:
    """The placement as a tuple of (d, s), or ValueError unless it is a bijection."""
    num_ranks = dp * pp
    cells = tuple(placement)
    if len(cells) != num_ranks:
        raise ValueError(f"placement has {len(cells)} cells; it needs one per rank, dp*pp = {num_ranks}")
    owner: dict[Cell, int] = {}
    for r, cell in enumerate(cells):
        try:
            d, s = (_whole("dp rank", cell[0], 0), _whole("stage", cell[1], 0))
        except (TypeError, IndexError):
            raise ValueError(f"placement of rank {r} must be a (dp_rank, stage) pair, got {cell!r}") from None
        if len(cell) != 2 or d >= dp or s >= pp:
            raise ValueError(f"placement of rank {r} is {cell!r}; cells are (d, s) with 0 <= d < {dp}, 0 <= s < {pp}")
        if (d, s) in owner:
            raise ValueError(
                f"placement is not a bijection: cell {(d, s)} is given to ranks {owner[(d, s)]} and {r}; "
                "each cell takes exactly one rank"
            )
        owner[(d, s)] = r
    return tuple(sorted(owner, key=owner.__getitem__))


def _check_links(slow_links: SlowLinks | None, nodes: set[str]) -> dict[str | frozenset[str], float]:
    """{node or pair: factor}, or ValueError for an unknown node or a bad factor."""
    known = ", ".join(sorted(nodes)[:8]) + (" ..." if len(nodes) > 8 else "")
    out: dict[str | frozenset[str], float] = {}
    for link, factor in (slow_links or {}).items():
        ends = [link] if isinstance(link, str) else sorted(link) if isinstance(link, frozenset) else None
        if ends is None or (not isinstance(link, str) and len(ends) != 2):
            raise ValueError(f"slow link {link!r} must be a node name or a frozenset of two node names")
        for end in ends:
            if end not in nodes:
                raise ValueError(f"slow link {_show(link)} names unknown node {end!r}; the job's nodes are {known}")
        out[link] = _number(f"factor of slow link {_show(link)}", factor, low=0.0, high=1.0, open_low=True)
    return out


def _show(link: str | frozenset[str]) -> str:
    """A link as text: ``n3`` or ``n3-n4``."""
    return link if isinstance(link, str) else "-".join(sorted(link))


def _check_stragglers(stragglers: Mapping[int, float] | None, num_ranks: int) -> dict[int, float]:
    """{rank: slowdown > 1} (slowdown 1 dropped), or ValueError."""
    out: dict[int, float] = {}
    for rank, slowdown in (stragglers or {}).items():
        r = _whole("straggler rank", rank, 0)
        if r >= num_ranks:
            raise ValueError(f"straggler rank {r} is out of range; ranks are 0..{num_ranks - 1}")
        x = _number(f"slowdown of straggler rank {r}", slowdown, low=1.0)
        if x > 1.0:
            out[r] = x
    return out


def _check_model(model: CostModel, dp: int, pp: int) -> tuple[list[float], float, list[float]]:
    """(A_s per stage, P, w_s per stage) in seconds, or ValueError."""
    if not isinstance(model, CostModel):
        raise ValueError(f"model must be a CostModel, got {type(model).__name__}")
    bandwidth = _number("bandwidth", model.bandwidth, low=0.0, open_low=True)
    raw = model.dp_bytes
    per_stage = [raw] * pp if isinstance(raw, (int, float)) else list(raw)
    if len(per_stage) != pp:
        raise ValueError(f"dp_bytes has {len(per_stage)} entries; give one number or one per stage (pp = {pp})")
    ring = 2.0 * (dp - 1) / dp / bandwidth
    a = [_number(f"dp_bytes of stage {s}", b, low=0.0) * ring for s, b in enumerate(per_stage)]
    p = _number("pp_bytes", model.pp_bytes, low=0.0) / bandwidth if pp > 1 else 0.0
    if model.stage_seconds is None:
        w = [1.0] * pp
        if pp > 1:
            w[0], w[-1] = 1.1, 1.2
    else:
        given = enumerate(model.stage_seconds)
        w = [_number(f"stage_seconds of stage {s}", x, low=0.0, open_low=True) for s, x in given]
        if len(w) != pp:
            raise ValueError(f"stage_seconds has {len(w)} entries; give one per stage (pp = {pp})")
    return a, p, w


# -- the problem in classes -------------------------------------------------------------
@dataclasses.dataclass(kw_only=True)
class _Problem:
    """A validated instance, its ranks grouped into classes (module docstring, (1))."""

    dp: int
    pp: int
    cells: tuple[Cell, ...]
    slow: dict[str | frozenset[str], float]
    slowdown: dict[int, float]
    a: list[float]
    p: float
    w: list[float]
    inv: list[list[float]]
    """(m+1, m+1) inv between link nodes 0..m-1 (nodes a slow entry touches) and PLAIN=m."""
    class_node: list[int]
    """(K+1,) the link node of each class (PLAIN for a straggler elsewhere); the
    last entry is the plain ranks' pseudo-class."""
    class_pace: list[float]
    """(K+1,) the slowdown of each class; 1 for the plain pseudo-class."""
    class_ranks: list[list[int]]
    plain_ranks: list[int]

    @classmethod
    def build(
        cls,
        dp: int,
        pp: int,
        node_of_rank: Sequence[str],
        placement: Sequence[Cell] | None,
        model: CostModel,
        slow_links: SlowLinks | None,
        stragglers: Mapping[int, float] | None,
    ) -> _Problem:
        dp, pp = _whole("dp", dp, 1), _whole("pp", pp, 1)
        if dp * pp > MAX_RANKS:
            raise ValueError(f"dp*pp = {dp * pp} ranks is more than the {MAX_RANKS} the placement planner handles")
        nodes = _check_nodes(node_of_rank, dp * pp)
        cells = _check_placement(default_placement(dp, pp) if placement is None else placement, dp, pp)
        a, p, w = _check_model(model, dp, pp)
        slow = _check_links(slow_links, set(nodes))
        slowdown = _check_stragglers(stragglers, dp * pp)
        link_nodes = sorted({end for link in slow for end in ([link] if isinstance(link, str) else link)})
        index = {n: i for i, n in enumerate(link_nodes)}
        keys: dict[tuple[int, float], list[int]] = {}
        plain = []
        for r, n in enumerate(nodes):
            if n in index or r in slowdown:
                keys.setdefault((index.get(n, len(link_nodes)), slowdown.get(r, 1.0)), []).append(r)
            else:
                plain.append(r)
        special = dp * pp - len(plain)
        if special > MAX_SPECIAL_RANKS:
            raise ValueError(
                f"{special} ranks sit on slow nodes or straggle; the exact planner handles at most {MAX_SPECIAL_RANKS}"
            )
        # Classes of slow nodes first, then by decreasing slowdown, then lowest rank:
        # the order the search places them in (it prunes most that way).
        classes = sorted(keys.items(), key=lambda item: (item[0][0] == len(link_nodes), -item[0][1], item[1][0]))
        return cls(
            dp=dp, pp=pp, cells=cells, slow=slow, slowdown=slowdown, a=a, p=p, w=w,
            inv=_inv_matrix(link_nodes, slow),
            # one more entry at the end: the plain ranks as a pseudo-class
            class_node=[k[0] for k, _ in classes] + [len(link_nodes)],
            class_pace=[k[1] for k, _ in classes] + [1.0],
            class_ranks=[ranks for _, ranks in classes],
            plain_ranks=plain,
        )

    @property
    def num_cells(self) -> int:
        return self.dp * self.pp

    def cell_index(self, cell: Cell) -> int:
        return cell[1] * self.dp + cell[0]

    @property
    def current_classes(self) -> list[int]:
        """(R,) the class in each cell now, -1 for plain."""
        occ = [-1] * self.num_cells
        for k, ranks in enumerate(self.class_ranks):
            for r in ranks:
                occ[self.cell_index(self.cells[r])] = k
        return occ

    def describe_link(self, link: str | frozenset[str]) -> str:
        return f"node {link}" if isinstance(link, str) else f"link {_show(link)}"

    def cost_of(self, occ: list[int]) -> float:
        """Exact T of a complete class grid (free cells are plain)."""
        plain = len(self.inv) - 1
        assigned = [c for c, k in enumerate(occ) if k >= 0]
        return self.cost(occ, assigned, lambda u, c: self.inv[u][plain])

    def cost(self, occ: list[int], assigned: list[int], free_inv: _FreeInv, top: float = 1.0) -> float:
        """T with the links that touch no assigned cell at inv 1, those from an assigned
        cell to a free cell c at ``free_inv(link node, c)`` (exact when complete), and a
        rank of slowdown ``top`` still to land in some stage."""
        dp, pp = self.dp, self.pp
        ring = [1.0] * pp
        pace = [1.0] * pp
        hops: dict[int, float] = {}
        for c in assigned:
            u, s = self.class_node[occ[c]], c // dp
            pace[s] = max(pace[s], self.class_pace[occ[c]])
            for nb in _ring_neighbours(c, dp):
                k = occ[nb]
                ring[s] = max(ring[s], self.inv[u][self.class_node[k]] if k >= 0 else free_inv(u, nb))
            for nb in (c - dp, c + dp):
                if 0 <= nb < dp * pp:
                    k = occ[nb]
                    hops[min(c, nb)] = self.inv[u][self.class_node[k]] if k >= 0 else free_inv(u, nb)
        columns = {c % dp for c in hops}
        pp_sum = max(
            [float(pp - 1)] + [math.fsum(hops.get(s * dp + d, 1.0) for s in range(pp - 1)) for d in columns]
        )
        compute = self._compute(pace, top)
        dp_term = max((a_s * x if a_s else 0.0) for a_s, x in zip(self.a, ring))
        pp_term = self.p * pp_sum if self.p else 0.0
        return math.fsum((compute, dp_term, pp_term))

    def _compute(self, pace: list[float], top: float) -> float:
        """``fsum(w_s * pace_s)``; when a rank of slowdown ``top`` must still land, the
        least of that sum with one stage's pace raised to ``top`` (one stage tried per
        distinct (w_s, pace_s), which give equal sums)."""
        if max(pace) >= top:
            return math.fsum(ws * x for ws, x in zip(self.w, pace))
        tries = {(ws, x): s for s, (ws, x) in enumerate(zip(self.w, pace))}
        return min(
            math.fsum(ws * (top if i == s else x) for i, (ws, x) in enumerate(zip(self.w, pace)))
            for s in tries.values()
        )

    def ranks_to_cells(self, cell_sets: list[list[int]]) -> tuple[Cell, ...]:
        """(R,) a rank-level placement with the given class cell sets that keeps the most
        ranks in their cell, then in their stage (module docstring, (2))."""
        taken = {c for cells in cell_sets for c in cells}
        plain_cells = [c for c in range(self.num_cells) if c not in taken]
        new: dict[int, int] = {}
        for ranks, cells in [*zip(self.class_ranks, cell_sets), (self.plain_ranks, plain_cells)]:
            new.update(self._assign(ranks, cells))
        return tuple((new[r] % self.dp, new[r] // self.dp) for r in range(self.num_cells))

    def _assign(self, ranks: list[int], cells: list[int]) -> dict[int, int]:
        """{rank: cell}: ranks keep their cell if it is among ``cells``, then their stage,
        then take what is left, each in increasing order."""
        out = {r: self.cell_index(self.cells[r]) for r in ranks if self.cell_index(self.cells[r]) in set(cells)}
        left = sorted(set(cells) - set(out.values()))
        waiting = [r for r in ranks if r not in out]
        for r in waiting:
            stage = self.cells[r][1]
            same = [c for c in left if c // self.dp == stage]
            if same:
                out[r] = same[0]
                left.remove(same[0])
        for r, c in zip([r for r in waiting if r not in out], left):
            out[r] = c
        return out


def _ring_neighbours(c: int, dp: int) -> tuple[int, ...]:
    """Cells next to cell index c on its stage's ring (dp order, cyclic)."""
    if dp == 1:
        return ()
    base, d = c - c % dp, c % dp
    if dp == 2:
        return (base + 1 - d,)
    return (base + (d - 1) % dp, base + (d + 1) % dp)


def _check_nodes(node_of_rank: Sequence[str], num_ranks: int) -> list[str]:
    """The node names, one per rank, or ValueError."""
    if isinstance(node_of_rank, str):
        raise ValueError("node_of_rank must be a list of node names, one per rank, not one string")
    nodes = list(node_of_rank)
    if len(nodes) != num_ranks:
        raise ValueError(f"node_of_rank has {len(nodes)} entries; it needs one per rank, dp*pp = {num_ranks}")
    for r, n in enumerate(nodes):
        if not isinstance(n, str) or not n:
            raise ValueError(f"node of rank {r} must be a non-empty node name, got {n!r}")
    return nodes


def _inv_matrix(link_nodes: list[str], slow: dict[str | frozenset[str], float]) -> list[list[float]]:
    """(m+1, m+1) inv between the link nodes and PLAIN (index m), from the smallest
    factor of the entries that cover each pair; 1 within a node and between plain ranks."""
    m = len(link_nodes)
    node_factor = [slow.get(n, 1.0) for n in link_nodes] + [1.0]
    inv = [[1.0] * (m + 1) for _ in range(m + 1)]
    for i in range(m + 1):
        for j in range(m + 1):
            if i == j:
                continue
            pair = slow.get(frozenset((link_nodes[i], link_nodes[j])), 1.0) if i < m and j < m else 1.0
            inv[i][j] = 1.0 / min(pair, node_factor[i], node_factor[j])
    return inv


# -- the exact search -------------------------------------------------------------------
class _Search:
    """Depth-first branch and bound over the class cell sets (module docstring, (3))."""

    def __init__(self, problem: _Problem, cost_now: float, *, max_branches: int) -> None:
        self.pb = problem
        self.max_branches = max_branches
        pb = problem
        n, dp, pp = pb.num_cells, pb.dp, pb.pp
        self.sizes = [len(r) for r in pb.class_ranks]
        self.now_cells = [sorted(pb.cell_index(pb.cells[r]) for r in ranks) for ranks in pb.class_ranks]
        self.now_sets = [set(cells) for cells in self.now_cells]
        self.now_stage = [[sum(1 for c in cells if c // dp == s) for s in range(pp)] for cells in self.now_cells]
        plain_now = {pb.cell_index(pb.cells[r]) for r in pb.plain_ranks}
        self.plain_now = [c in plain_now for c in range(n)]
        self.plain_stage = [sum(1 for c in plain_now if c // dp == s) for s in range(pp)]
        # rest[k][u]: least inv from link node u to whatever may still land on a free
        # cell once classes < k are placed and class k is not a candidate.
        plain = len(pb.inv) - 1
        self.rest = []
        for k in range(len(self.sizes) + 1):
            later = {pb.class_node[j] for j in range(k, len(self.sizes))} | ({plain} if pb.plain_ranks else set())
            self.rest.append([min((pb.inv[u][v] for v in later), default=math.inf) for u in range(plain + 1)])
        self.occ = [-1] * n
        self.assigned: list[int] = []
        self.stage_count = [[0] * pp for _ in self.sizes]
        self.special_in_stage = [0] * pp
        self.kept = [0] * len(self.sizes)
        self.moves = 0
        self.displaced = 0
        self.visited = 0
        self.best_key = (cost_now, 0, 0)
        self.best_seq = [c for cells in self.now_cells for c in cells]

    def run(self) -> tuple[float, list[list[int]]]:
        """(least T, the class cell sets of the plan)."""
        if self.sizes:
            self._visit(0, self.sizes[0], -1)
        out, i = [], 0
        for size in self.sizes:
            out.append(self.best_seq[i : i + size])
            i += size
        return self.best_key[0], out

    def _visit(self, k: int, need: int, last: int) -> None:
        if need == 0:
            k, last = k + 1, -1
            need = self.sizes[k] if k < len(self.sizes) else 0
        self.visited += 1
        if self.visited > self.max_branches:
            raise ValueError(
                f"the exact placement search passed {self.max_branches} branches; "
                "too many ranks on slow nodes or straggling to plan exactly"
            )
        key = self._bound(k, need, last)
        seq = self.assigned
        if key > self.best_key or (key == self.best_key and seq > self.best_seq[: len(seq)]):
            return
        if k == len(self.sizes):
            self.best_key, self.best_seq = key, list(seq)
            return
        for c in range(last + 1, self.pb.num_cells - need + 1):
            if self.occ[c] < 0:
                self._place(k, c, +1)
                self._visit(k, need - 1, c)
                self._place(k, c, -1)

    def _place(self, k: int, c: int, step: int) -> None:
        """Put class k on cell c (step +1) or take it off again (step -1)."""
        s = c // self.pb.dp
        if step < 0:
            self.occ[c] = -1
            self.assigned.pop()
        counts = self.stage_count[k]
        # a rank arriving in stage s beyond the class's ranks already there moves
        arrive = counts[s] + (step - 1) // 2 >= self.now_stage[k][s]
        squeeze = self.pb.dp - self.special_in_stage[s] - (step + 1) // 2 < self.plain_stage[s]
        counts[s] += step
        self.special_in_stage[s] += step
        self.moves += step * (int(arrive) + int(squeeze))
        self.kept[k] += step * int(c in self.now_sets[k])
        self.displaced += step * int(self.plain_now[c])
        if step > 0:
            self.occ[c] = k
            self.assigned.append(c)

    def _bound(self, k: int, need: int, last: int) -> tuple[float, int, int]:
        """A lower bound on (T, stage moves, cell changes) of every completion; exact at
        a leaf (k == number of classes)."""
        rest, node_k = self.rest[min(k + 1, len(self.sizes))], -1
        if k < len(self.sizes) and need > 0:
            node_k = self.pb.class_node[k]

        def free_inv(u: int, c: int) -> float:
            if node_k >= 0 and c > last:
                return min(rest[u], self.pb.inv[u][node_k])
            return rest[u]

        waiting = self.pb.class_pace[k + (need == 0) : len(self.sizes)]
        cost = self.pb.cost(self.occ, self.assigned, free_inv, max(waiting, default=1.0))
        changes = self.displaced + sum(self.sizes[j] - self.kept[j] for j in range(min(k, len(self.sizes))))
        if k < len(self.sizes):
            free_now = sum(1 for c in self.now_cells[k] if c > last and self.occ[c] < 0)
            changes += self.sizes[k] - self.kept[k] - min(need, free_now)
        moves = max(self.moves, self._moves_by_capacity(k))
        if k < len(self.sizes) and need == self.sizes[k] > 1:  # worth it before a big subtree
            moves = max(moves, self._moves_by_exchange(k, free_inv))
        return cost, moves, changes

    def _moves_by_exchange(self, k: int, free_inv: _FreeInv) -> int:
        """A lower bound on the stage moves once classes < k are placed: a rank still to
        place cannot take a free cell where an edge to a placed cell alone makes ``T``
        exceed the best found (it is *banned* there). Per stage s, of the ``waiting_s``
        ranks now there and the ``free_s`` free cells, at least ``dep_s = max(waiting_s -
        free_s, banned-out_s)`` leave and ``arr_s = max(0, free_s - waiting_s +
        banned-out_s)`` arrive from other stages; the moves are at least ``dep_s`` plus
        the other stages' departures, which number at least ``arr_s``."""
        dp, pp = self.pb.dp, self.pb.pp
        free = [dp - self.special_in_stage[s] for s in range(pp)]
        groups = [self.now_stage[j] for j in range(k, len(self.sizes))] + [self.plain_stage]
        classes = [*range(k, len(self.sizes)), len(self.sizes)]
        waiting = [sum(g[s] for g in groups) for s in range(pp)]
        frontier = sorted(
            {nb for c in self.assigned for nb in (*_ring_neighbours(c, dp), c - dp, c + dp)
             if 0 <= nb < dp * pp and self.occ[nb] < 0}
        )
        out = [0] * pp
        for j, now in zip(classes, groups):
            banned = [0] * pp
            for c in frontier:
                if now[c // dp] and self._too_slow(j, c, free_inv):
                    banned[c // dp] += 1
            for s in range(pp):
                out[s] += max(0, now[s] - (free[s] - banned[s]))
        dep = [max(waiting[s] - free[s], out[s]) for s in range(pp)]
        arr = [max(0, free[s] - waiting[s] + out[s]) for s in range(pp)]
        total = sum(dep)
        rest = max([total] + [dep[s] + max(arr[s], total - dep[s]) for s in range(pp)])
        done = sum(max(0, n - now) for j in range(k) for n, now in zip(self.stage_count[j], self.now_stage[j]))
        return done + rest

    def _too_slow(self, j: int, c: int, free_inv: _FreeInv) -> bool:
        """Whether class j on free cell c makes the bound on T exceed the best found."""
        self.occ[c] = j
        self.assigned.append(c)
        cost = self.pb.cost(self.occ, self.assigned, free_inv)
        self.assigned.pop()
        self.occ[c] = -1
        return cost > self.best_key[0]

    def _moves_by_capacity(self, k: int) -> int:
        """Another lower bound on the stage moves: the ranks of the classes placed
        before k that moved, plus, per stage, the ranks not yet placed that sit there now
        beyond the stage's free cells (they must leave it)."""
        dp, pp = self.pb.dp, self.pb.pp
        done = sum(max(0, n - now) for j in range(k) for n, now in zip(self.stage_count[j], self.now_stage[j]))
        total = done
        for s in range(pp):
            waiting = self.plain_stage[s] + sum(self.now_stage[j][s] for j in range(k + 1, len(self.sizes)))
            if k < len(self.sizes):
                waiting += max(0, self.now_stage[k][s] - self.stage_count[k][s])
            total += max(0, waiting - (dp - self.special_in_stage[s]))
        return total
