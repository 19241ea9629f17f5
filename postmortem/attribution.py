"""Attribution: S, S_t, S_w (DP rank, PP rank, worker), M_W, M_S and the heatmap.

S = T / T_ideal where T is the replay of the real trace (so simulation error cancels)
and T_ideal the replay with every op idealised; times are means over the kept steps.
S_t keeps op type t real and idealises the rest; S_w does the same for one DP rank, PP
rank or worker.  M_W = (T - T_rem) / (T - T_ideal) with the top 3% workers (by S_w)
idealised and everything else real; M_S likewise for the last stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from postmortem.idealize import Ideal, idealize
from postmortem.model import Model, optype_label
from postmortem.schema import OPTYPE_CODE
from postmortem.simulate import simulate

# The study's report merges the four p2p types into two.
REPORT_OPTYPES: dict[str, tuple[str, ...]] = {
    "forward-pp-comm": ("forward-send", "forward-recv"),
    "backward-pp-comm": ("backward-send", "backward-recv"),
}
EXACT_WORKER_LIMIT = 16  # above this many workers, per-worker S_w uses the study's approximation
TOP_WORKER_FRACTION = 0.03


@dataclass(frozen=True, kw_only=True)
class Attribution:
    slowdown: float
    t_real: float  # mean traced step time
    t_replay: float  # mean replayed step time (T)
    t_ideal: float
    simulation_error: float  # (T - T_real) / T_real
    by_optype: dict[str, float]
    by_dp_rank: dict[str, float]
    by_pp_rank: dict[str, float]
    worker_slowdown: np.ndarray  # (D, P) S_w per worker
    worker_slowdown_exact: bool
    mw: float
    ms: float
    mw_workers: list[tuple[int, int]]
    step_slowdown: np.ndarray  # (N,)
    step_replay: np.ndarray  # (N,)
    step_ideal: np.ndarray  # (N,)
    ideal: Ideal
    extra: dict = field(default_factory=dict)


def report_groups(model: Model) -> dict[str, np.ndarray]:
    """Report op-type name -> (n_t,) mask of template ops, p2p merged as the study does."""
    groups: dict[str, np.ndarray] = {}
    merged = {o: k for k, v in REPORT_OPTYPES.items() for o in v}
    for code in np.unique(model.t_optype):
        name = optype_label(code)
        key = merged.get(name, name)
        m = model.t_optype == code
        groups[key] = groups[key] | m if key in groups else m
    return groups


def attribute(
    model: Model,
    *,
    estimator: str = "robust",
    outlier_z: float = 3.5,
    ideal: Ideal | None = None,
) -> Attribution:
    """Run every what-if scenario of ``model`` and attribute the slowdown."""
    ideal = ideal or idealize(model, estimator=estimator, outlier_z=outlier_z)
    n_t, D, P = model.num_template_ops, model.dp, model.pp
    groups = report_groups(model)
    masks: list[np.ndarray] = []
    names: list[tuple[str, object]] = []

    def add(kind: str, key, mask_td: np.ndarray) -> None:
        masks.append(mask_td)
        names.append((kind, key))

    ones = np.ones((n_t, D), bool)
    add("replay", None, ones)
    add("ideal", None, ~ones)
    for name, m in groups.items():
        add("optype", name, np.repeat(m[:, None], D, axis=1))
    for d in range(D):
        mk = np.zeros((n_t, D), bool)
        mk[:, d] = True
        add("dp", d, mk)
    for p in range(P):
        add("pp", p, np.repeat((model.t_pp == p)[:, None], D, axis=1))
    add("ms", None, np.repeat((model.t_pp != P - 1)[:, None], D, axis=1))
    exact = D * P <= EXACT_WORKER_LIMIT
    if exact:
        for d in range(D):
            for p in range(P):
                mk = np.zeros((n_t, D), bool)
                mk[model.t_pp == p, d] = True
                add("worker", (d, p), mk)
    res = simulate(model, ideal=ideal.work, keep_real=np.stack(masks))
    step = res.step_time  # (S, N)
    T = step.mean(axis=1)
    idx = {k: i for i, k in enumerate(names)}
    t_rep = T[idx[("replay", None)]]
    t_id = T[idx[("ideal", None)]]
    by_optype = {name: float(T[idx[("optype", name)]] / t_id) for name in groups}
    by_dp = {str(d): float(T[idx[("dp", d)]] / t_id) for d in range(D)}
    by_pp = {str(p): float(T[idx[("pp", p)]] / t_id) for p in range(P)}
    gap = t_rep - t_id
    ms = float((t_rep - T[idx[("ms", None)]]) / gap) if abs(gap) > 1e-12 else 0.0
    if P == 1:
        ms = 0.0  # no pipeline: no last stage to blame (the study's convention)
    if exact:
        ws = np.array([[T[idx[("worker", (d, p))]] / t_id for p in range(P)] for d in range(D)])
    else:
        # the study's approximation: a worker is as slow as the lesser of its DP and PP rank
        ws = np.minimum(
            np.array([by_dp[str(d)] for d in range(D)])[:, None],
            np.array([by_pp[str(p)] for p in range(P)])[None, :],
        )
    k = max(1, math.ceil(TOP_WORKER_FRACTION * D * P))
    # ties (the approximation makes many) broken by the worker's own compute ratio
    order = np.lexsort((-ideal.cell_ratio.ravel(), -ws.ravel()))[:k]
    top = [(int(i // P), int(i % P)) for i in order]
    keep = np.ones((n_t, D), bool)
    for d, p in top:
        keep[model.t_pp == p, d] = False
    t_rem = simulate(model, ideal=ideal.work, keep_real=keep[None]).step_time.mean()
    mw = float((t_rep - t_rem) / gap) if abs(gap) > 1e-12 else 0.0
    t_real = float(model.real_step_time.mean())
    return Attribution(
        slowdown=float(t_rep / t_id),
        t_real=t_real,
        t_replay=float(t_rep),
        t_ideal=float(t_id),
        simulation_error=float((t_rep - t_real) / t_real),
        by_optype=by_optype,
        by_dp_rank=by_dp,
        by_pp_rank=by_pp,
        worker_slowdown=ws,
        worker_slowdown_exact=exact,
        mw=mw,
        ms=ms,
        mw_workers=top,
        step_slowdown=step[idx[("replay", None)]] / step[idx[("ideal", None)]],
        step_replay=step[idx[("replay", None)]],
        step_ideal=step[idx[("ideal", None)]],
        ideal=ideal,
    )


def optype_code_of(name: str) -> int:
    return OPTYPE_CODE[name]
