"""Root causes, each with the numbers that support it and the remedy.

Signatures (What-if study, section 5): a slow worker shows as few hot cells in the DP x PP
heatmap and a high M_W; stage-partition imbalance as a heavy last stage and a high M_S;
sequence-length imbalance as forward and backward times of the same micro-batch moving
together (correlation >= 0.9, after removing each worker-step's own level, so a slow
worker does not fake it), and with recorded lengths as compute time tracking sum s^2;
GC as unsynchronised pauses; communication as S_t of the p2p or DP op types; workers
that start their steps late (greyhound's addition) as the S_t of the model's step-start
op, with each late worker's start against its stage's median.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from postmortem.attribution import Attribution
from postmortem.model import STEP_START, STEP_START_CODE, Model
from postmortem.schema import OPTYPE_CODE, Trace

SEQ_CORR_THRESHOLD = 0.9
COMM_TYPES_PP = ("forward-pp-comm", "backward-pp-comm")
COMM_TYPES_DP = (
    "params-all-gather",
    "grads-reduce-scatter",
    "separate-grads-all-reduce",
    "grads-all-reduce",
    "embedding-grads-all-reduce",
    "optimizer-clip-main-grad",
)


@dataclass(frozen=True, kw_only=True)
class Cause:
    cause: str
    confidence: float
    evidence: dict
    remedy: str

    def to_json(self) -> dict:
        return {"cause": self.cause, "confidence": round(self.confidence, 3), "evidence": self.evidence,
                "remedy": self.remedy}


def find_causes(trace: Trace, model: Model, attr: Attribution) -> list[Cause]:
    """Every cause whose signature is present, most confident first."""
    out: list[Cause] = []
    lost = attr.slowdown - 1.0
    nodes = trace.node_of()
    out += _slow_workers(attr, nodes, lost)
    out += _stage_imbalance(model, attr, lost)
    out += _seq_imbalance(trace, model, attr)
    out += _gc(model, attr)
    out += _communication(attr)
    out += _late_starts(model, attr, nodes)
    return sorted(out, key=lambda c: -c.confidence)


def _slow_workers(attr: Attribution, nodes, lost: float) -> list[Cause]:
    ratio = attr.ideal.cell_ratio  # (D, P)
    D, P = ratio.shape
    med = np.median(ratio)
    mad = np.median(np.abs(ratio - med)) * 1.4826
    hot = ratio > med + max(0.05 * med, 4 * mad)
    n_hot = int(hot.sum())
    if n_hot == 0 or n_hot > max(1, 0.25 * D * P) or lost < 0.02:
        return []
    cells = sorted(zip(*np.nonzero(hot)), key=lambda c: -ratio[c])
    workers = [
        {
            "dp_rank": int(d),
            "pp_rank": int(p),
            "node": nodes.get((int(d), int(p)), "?"),
            "compute_ratio": round(float(ratio[d, p]), 3),
            "s_w": round(float(attr.worker_slowdown[d, p]), 3),
        }
        for d, p in cells[:8]
    ]
    whole_dp = [int(d) for d in range(D) if P > 1 and hot[d].all()]
    conf = float(np.clip(max(attr.mw, 0.0), 0.0, 1.0))
    if whole_dp:
        conf = max(conf, 0.8)
    return [
        Cause(
            cause="slow worker" if not whole_dp else "slow DP replica",
            confidence=conf,
            evidence={
                "hot_cells": n_hot,
                "workers": workers,
                "slow_dp_replicas": whole_dp,
                "mw": round(attr.mw, 3),
                "median_compute_ratio": round(float(med), 3),
            },
            remedy=(
                "online: greyhound re-splits micro-batches away from the slow DP group (S2), "
                "gathers stragglers into few DP replicas (S3), or requeues the job excluding node "
                f"{workers[0]['node']} (S4); check that node's GPU health"
            ),
        )
    ]


def _stage_imbalance(model: Model, attr: Attribution, lost: float) -> list[Cause]:
    P = model.pp
    if P < 2 or lost < 0.02:
        return []
    ratios = {}
    for code, typical in attr.ideal.stage_typical.items():
        if code in (OPTYPE_CODE["forward-compute"], OPTYPE_CODE["backward-compute"]):
            # A stage without ops of this type has no typical value (NaN): compare with
            # the stages that have one, and only when the last stage has one too.
            others_known = typical[:-1][~np.isnan(typical[:-1])]
            others = float(others_known.mean()) if others_known.size else 0.0
            if others > 0 and np.isfinite(typical[-1]):
                name = "forward" if code == OPTYPE_CODE["forward-compute"] else "backward"
                ratios[name] = float(typical[-1] / others)
    top_pp = max(attr.by_pp_rank, key=attr.by_pp_rank.__getitem__)
    if attr.ms < 0.3 and max(ratios.values(), default=1.0) < 1.1:
        return []
    conf = float(np.clip(attr.ms, 0.0, 1.0))
    return [
        Cause(
            cause="stage-partition imbalance",
            confidence=conf,
            evidence={
                "ms": round(attr.ms, 3),
                "last_stage_vs_others_compute": {k: round(v, 3) for k, v in ratios.items()},
                "top_pp_rank": int(top_pp),
                "s_w_top_pp_rank": round(attr.by_pp_rank[top_pp], 3),
            },
            remedy=(
                "re-split the pipeline: move layers off the last stage (the loss/logits layer is "
                "heavy), e.g. give it fewer transformer layers than the others"
            ),
        )
    ]


def _seq_imbalance(trace: Trace, model: Model, attr: Attribution) -> list[Cause]:
    fc, bc = OPTYPE_CODE["forward-compute"], OPTYPE_CODE["backward-compute"]
    corrs = []
    for p in range(model.pp):
        f = (model.t_optype == fc) & (model.t_pp == p)
        b = (model.t_optype == bc) & (model.t_pp == p)
        if f.sum() < 2 or f.sum() != b.sum():
            continue
        fo = np.argsort(model.t_occ[f])
        bo = np.argsort(model.t_occ[b])
        F = model.duration[f][fo]  # (M, D, N)
        B = model.duration[b][bo]
        # remove each worker-step's level: a slow worker moves both without any sequence effect
        F = F - F.mean(axis=0, keepdims=True)
        B = B - B.mean(axis=0, keepdims=True)
        den = np.sqrt((F * F).sum() * (B * B).sum())
        if den > 0:
            corrs.append(float((F * B).sum() / den))
    if not corrs:
        return []
    corr = float(np.median(corrs))
    evidence: dict = {"forward_backward_correlation": round(corr, 3), "per_stage": [round(c, 3) for c in corrs]}
    sq_corr = None
    if trace.seqlens is not None:
        sq_corr, gain = _seqlen_evidence(trace.seqlens, model)
        if sq_corr is not None:
            evidence["compute_vs_sum_sq_seqlen_correlation"] = round(sq_corr, 3)
            evidence["greedy_rebalance_max_over_mean_before_after"] = gain
    if corr < SEQ_CORR_THRESHOLD and (sq_corr is None or sq_corr < SEQ_CORR_THRESHOLD):
        return []
    return [
        Cause(
            cause="sequence-length imbalance",
            confidence=float(np.clip(max(corr, sq_corr or 0.0), 0.0, 1.0)),
            evidence=evidence,
            remedy=(
                "rebalance sequences across DP ranks by a greedy partition of sum s^2 "
                "(postmortem.causes.rebalance_sequences; the study measured +23.9% throughput)"
            ),
        )
    ]


def _seqlen_evidence(s: dict[str, np.ndarray], model: Model):
    q = np.add.reduceat((s["lengths"].astype(np.float64) ** 2), s["offsets"][:-1]) if s["lengths"].size else None
    if q is None:
        return None, None
    empty = np.diff(s["offsets"]) == 0
    q[empty] = 0.0
    fc = OPTYPE_CODE["forward-compute"]
    step_pos = {int(v): i for i, v in enumerate(model.steps)}
    f0 = (model.t_optype == fc) & (model.t_pp == 0)
    occ = model.t_occ[f0]
    F = model.duration[f0]  # (M, D, N)
    xs, ys = [], []
    for st, d, mb, qq in zip(s["step"], s["dp_rank"], s["microbatch"], q):
        n = step_pos.get(int(st))
        hit = np.flatnonzero(occ == mb)
        if n is None or hit.size == 0 or d >= model.dp:
            continue
        xs.append(qq)
        ys.append(F[hit[0], d, n])
    if len(xs) < 3 or np.std(xs) == 0 or np.std(ys) == 0:
        return None, None
    corr = float(np.corrcoef(xs, ys)[0, 1])
    # greedy rebalance of the first step's samples
    first = s["step"] == s["step"][0]
    lens = np.concatenate([s["lengths"][a:b] for a, b in zip(s["offsets"][:-1][first], s["offsets"][1:][first])])
    before = np.zeros(model.dp)
    np.add.at(before, s["dp_rank"][first].astype(int), q[first])
    after = rebalance_sequences(lens, num_bins=model.dp)[1]
    gain = [round(float(before.max() / before.mean()), 3), round(float(after.max() / after.mean()), 3)]
    return corr, gain


def rebalance_sequences(lengths: np.ndarray, *, num_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy (LPT) partition of sequences into ``num_bins`` bins balancing sum s^2.

    Args:
        lengths: (n,) sequence lengths.
        num_bins: DP ranks.
    Returns:
        (assignment (n,) bin per sequence, load (num_bins,) sum s^2 per bin).
    """
    if num_bins < 1:
        raise ValueError("num_bins must be >= 1")
    cost = np.asarray(lengths, np.float64) ** 2
    order = np.argsort(-cost, kind="stable")
    load = np.zeros(num_bins)
    assign = np.empty(cost.size, np.int64)
    for i in order:  # n log n heap would do; n is one global batch
        b = int(np.argmin(load))
        assign[i] = b
        load[b] += cost[i]
    return assign, load


def _gc(model: Model, attr: Attribution) -> list[Cause]:
    gc = model.t_optype == OPTYPE_CODE["gc"]
    if not gc.any():
        return _irregular_gc(model)
    d = model.duration[gc]
    pauses = d[d > 0.01]
    s_gc = attr.by_optype.get("gc", 1.0)
    if pauses.size == 0 or s_gc < 1.01:
        return []
    return [
        Cause(
            cause="Python GC pauses",
            confidence=float(np.clip((s_gc - 1.0) * 10, 0.3, 1.0)),
            evidence={
                "pauses": int(pauses.size),
                "mean_pause_s": round(float(pauses.mean()), 4),
                "s_gc": round(s_gc, 3),
            },
            remedy="disable automatic GC and run a planned, synchronised gc.collect() on all ranks every K steps",
        )
    ]


def _irregular_gc(model: Model) -> list[Cause]:
    """Automatic GC pauses kept as events: their share of the workers' time."""
    pauses = model.gc_events[model.gc_events > 0.01]
    if pauses.size == 0:
        return []
    # Upper bound on the time lost: every pause stalls the whole pipeline once.
    share = float(pauses.sum() / max(model.real_step_time.sum() * model.dp, 1e-12))
    if share < 0.01:
        return []
    return [
        Cause(
            cause="Python GC pauses",
            confidence=float(np.clip(share * 10, 0.3, 1.0)),
            evidence={
                "pauses": int(pauses.size),
                "mean_pause_s": round(float(pauses.mean()), 4),
                "share_of_step_time": round(share, 4),
                "kind": "automatic (irregular)",
            },
            remedy="disable automatic GC and run a planned, synchronised gc.collect() on all ranks every K steps",
        )
    ]


def _communication(attr: Attribution) -> list[Cause]:
    pp = max((attr.by_optype.get(k, 1.0) for k in COMM_TYPES_PP), default=1.0)
    dp = max((attr.by_optype.get(k, 1.0) for k in COMM_TYPES_DP), default=1.0)
    worst = max(pp, dp)
    if worst < 1.03:
        return []
    kind = "PP" if pp >= dp else "DP"
    return [
        Cause(
            cause=f"communication ({kind})",
            confidence=float(np.clip((worst - 1.0) * 5, 0.2, 1.0)),
            evidence={"s_pp_comm": round(pp, 3), "s_dp_comm": round(dp, 3)},
            remedy=(
                "greyhound validates the links the job uses (P2P bandwidth tests) and swaps DP/PP "
                "roles so a slow link carries light PP traffic (S3)"
            ),
        )
    ]


def _late_starts(model: Model, attr: Attribution, nodes) -> list[Cause]:
    """Workers whose first op of a step starts later than their stage's usual start."""
    s_start = attr.by_optype.get(STEP_START, 1.0)
    if s_start < 1.02:
        return []
    workers = []
    for i in np.flatnonzero(model.t_optype == STEP_START_CODE):   # one op per stage
        p = int(model.t_pp[i])
        late = model.transfer[i].mean(axis=1) - attr.ideal.work[i]   # (D,) mean over steps
        for d in np.flatnonzero(late > 0.01 * max(attr.t_ideal, 1e-12)):
            workers.append({"dp_rank": int(d), "pp_rank": p, "node": nodes.get((int(d), p), "?"),
                            "late_s": round(float(late[d]), 4)})
    if not workers:   # the stage medians' own spread: no one to name
        return []
    workers.sort(key=lambda w: -w["late_s"])
    return [
        Cause(
            cause="workers start their steps late",
            confidence=float(np.clip((s_start - 1.0) * 5, 0.2, 1.0)),
            evidence={"s_step_start": round(s_start, 3), "late_workers": workers[:8]},
            remedy=(
                "a worker that starts a step late finished its previous one late: look at what it does "
                "between steps (data loading, logging, checkpoint writes) and at its own compute; a "
                "job-wide sync at the step's end (Megatron's grad-norm all-reduce) shows the delay where "
                "it arises"
            ),
        )
    ]
