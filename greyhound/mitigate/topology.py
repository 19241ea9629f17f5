"""S3 on the master's side: what the placement planner (placement.py) needs, read from
the job's board, and what a move costs. Pure functions on the board's plain data.

The traffic of a step comes from the agents' per-communicator figures (``comms:{rank}``,
bytes per iteration over the recent window), which the hook measured on the job itself:

* a stage's DP gradient bytes: what each of its ranks moves per iteration in
  collectives that reduce or gather (AllReduce, ReduceScatter, AllGather), the median
  over the stage's ranks (its replicas move the same gradients);
* a pipeline hop's bytes: each rank's point-to-point bytes (sends and receives) per
  iteration, halved (an inner stage sends and receives on two hops; the first and last
  on one), the largest over the ranks;
* a stage's compute: its ranks' healthy work per iteration outside communication calls
  (the agents' ``compute_base_s``, else ``compute_s``), the median over the stage.

The healthy link bandwidth is the median the validation's P2P tests measured (a slow
link's entry carries its bandwidth and its ratio to that median).

What a move costs, the pause: measured on the job once it has moved (the training
side says, ``training:relaid``); before that, estimated as the moved stages' state
(parameters and two Adam moments: three times a stage's gradient bytes) over the
healthy bandwidth, plus two steps for the pause's edges and the groups' rebuild.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from greyhound.mitigate.placement import CostModel, PlacementPlan, layout

Cell = tuple[int, int]

DP_OPS = frozenset({"AllReduce", "ReduceScatter", "AllGather"})
P2P_OPS = frozenset({"Send", "Recv", "SendRecv"})
STATE_PER_GRADIENT = 3.0
"""Bytes of a stage's state that move per byte of its gradients: parameters and Adam's
two moments (float32 each)."""
PAUSE_EDGE_STEPS = 2.0
"""Steps a move costs besides the transfer: the ranks wait for the slowest to reach
the step boundary, and the process groups are rebuilt."""


def placement_now(layout: Mapping, applied: Mapping | None) -> tuple[Cell, ...]:
    """The placement in force: the last applied plan's, else the job's own (from the
    ranks of each replica's stages in the training layout)."""
    from greyhound.mitigate.training import placement_of

    if applied and applied.get("placement"):
        return tuple((int(d), int(s)) for d, s in applied["placement"])
    return placement_of(layout["replicas"])


def pipelines(placement: Sequence[Cell]) -> list[list[int]]:
    """The ranks of each replica's stages, in stage order, under a placement."""
    dp = 1 + max(d for d, _ in placement)
    pp = 1 + max(s for _, s in placement)
    return [list(p) for p in layout(placement, dp=dp, pp=pp).pipelines]


def _per_rank(comms: Mapping[int, Mapping[str, Mapping]], ops: frozenset[str]) -> dict[int, float]:
    return {rank: sum(float(c.get("bytes_per_iter") or 0.0) for c in stats.values() if c.get("op") in ops)
            for rank, stats in comms.items()}


def step_model(comms: Mapping[int, Mapping[str, Mapping]], ranks: Mapping[int, Mapping],
               placement: Sequence[Cell], *, bandwidth: float) -> CostModel:
    """The step's traffic and compute for placement.py, from the board (module doc).

    Raises:
        ValueError: the board lacks the figures (no comm figures for a stage, say).
    """
    pp = 1 + max(s for _, s in placement)
    dp_rank = _per_rank(comms, DP_OPS)
    p2p_rank = _per_rank(comms, P2P_OPS)
    dp_bytes, work = [], []
    for s in range(pp):
        members = [r for r, (_, stage) in enumerate(placement) if stage == s]
        moved = [dp_rank[r] for r in members if r in dp_rank]
        if not moved:
            raise ValueError(f"no communication figures for the ranks of stage {s} ({members})")
        dp_bytes.append(float(np.median(moved)))
        known = [w for w in (_work(ranks.get(r, {})) for r in members) if w is not None]
        work.append(float(np.median(known)) if known else None)
    # A stage without a figure takes the others' median: the model needs them all.
    measured = [w for w in work if w is not None]
    stage_seconds = None
    if measured:
        fill = float(np.median(measured))
        stage_seconds = [fill if w is None else w for w in work]
    return CostModel(dp_bytes=dp_bytes, pp_bytes=max(p2p_rank.values(), default=0.0) / 2, bandwidth=bandwidth,
                     stage_seconds=stage_seconds)


def _work(state: Mapping) -> float | None:
    for key in ("compute_base_s", "compute_s"):
        try:
            value = float(state[key])
        except (KeyError, TypeError, ValueError):
            continue
        if value > 0:
            return value
    return None


def slow_links_of(verdict: Mapping) -> tuple[dict[str | frozenset[str], float], float | None]:
    """The slow links of a validated link verdict as placement.py takes them (a node's
    name for its NIC, a node pair for one link; factor = the measured ratio to the
    median) and the healthy bandwidth (B/s) the P2P tests measured; ({}, None) when
    the verdict carries no measurement."""
    measured = verdict.get("measured")
    entries = measured.get("slow_links", []) if isinstance(measured, dict) else measured or []
    hits = [h for h in entries if isinstance(h, dict) and h.get("ratio") and h.get("bandwidth_Bps")]
    if not hits:
        return {}, None
    nodes = list(verdict.get("nodes") or [])
    worst = min(float(h["ratio"]) for h in hits)
    key: str | frozenset[str] = nodes[0] if len(nodes) == 1 else frozenset(nodes)
    healthy = float(np.median([float(h["bandwidth_Bps"]) / float(h["ratio"]) for h in hits]))
    return {key: min(1.0, max(worst, 1e-6))}, healthy


def move_cost_s(plan: PlacementPlan, model: CostModel | None, *, step_s: float, measured_s: float | None) -> float:
    """Seconds the job would pause for the plan: the last measured pause of this job if
    there is one, else the estimate of the module doc (``model`` may be None for a plan
    that moves no rank's stage: only the edges of the pause are paid)."""
    if measured_s is not None:
        return measured_s
    if not plan.moves or model is None:
        return PAUSE_EDGE_STEPS * step_s
    per_stage = model.dp_bytes
    moved = sum(STATE_PER_GRADIENT * float(per_stage[m.to_stage] if isinstance(per_stage, Sequence) else per_stage)
                for m in plan.moves)
    return moved / model.bandwidth + PAUSE_EDGE_STEPS * step_s
