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
    D, P = model.dp, model.pp
    groups = report_groups(model)
    exact = D * P <= EXACT_WORKER_LIMIT
    masks, scenario = _scenario_masks(model, groups, per_worker=exact)
    step = simulate(model, ideal=ideal.work, keep_real=masks).step_time  # (scenarios, N)
    T = step.mean(axis=1)
    # An idealised step of 0 s (a trace of 0 s ops) makes every ratio below inf or NaN:
    # the caller refuses such a trace in one line (analysis.analyze), without numpy's
    # warnings on the user's terminal before it.
    with np.errstate(divide="ignore", invalid="ignore"):
        return _attribution(model, ideal, step, T, scenario, groups, exact=exact)


def _attribution(model: Model, ideal: Ideal, step: np.ndarray, T: np.ndarray, scenario: dict,
                 groups: dict[str, np.ndarray], *, exact: bool) -> Attribution:
    """:func:`attribute`'s figures from the scenarios' step times."""
    D, P = model.dp, model.pp
    replay, ideal_run = scenario[("replay", None)], scenario[("ideal", None)]
    t_rep, t_id = T[replay], T[ideal_run]
    by_optype = {name: float(T[scenario[("optype", name)]] / t_id) for name in groups}
    by_dp = {str(d): float(T[scenario[("dp", d)]] / t_id) for d in range(D)}
    by_pp = {str(p): float(T[scenario[("pp", p)]] / t_id) for p in range(P)}
    gap = t_rep - t_id
    ms = float((t_rep - T[scenario[("ms", None)]]) / gap) if abs(gap) > 1e-12 else 0.0
    if P == 1:
        ms = 0.0  # no pipeline: no last stage to blame (the study's convention)
    if exact:
        ws = np.array([[T[scenario[("worker", (d, p))]] / t_id for p in range(P)] for d in range(D)])
    else:
        # the study's approximation: a worker is as slow as the lesser of its DP and PP rank
        ws = np.minimum(
            np.array([by_dp[str(d)] for d in range(D)])[:, None],
            np.array([by_pp[str(p)] for p in range(P)])[None, :],
        )
    top = _top_workers(ws, ideal.cell_ratio)
    t_rem = simulate(model, ideal=ideal.work, keep_real=_all_but_workers(model, top)[None]).step_time.mean()
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
        step_slowdown=step[replay] / step[ideal_run],
        step_replay=step[replay],
        step_ideal=step[ideal_run],
        ideal=ideal,
    )


def _scenario_masks(model: Model, groups: dict[str, np.ndarray], *, per_worker: bool
                    ) -> tuple[np.ndarray, dict[tuple[str, object], int]]:
    """The what-if scenarios: (S, n_t, D) masks of the ops each keeps real (the rest are
    idealised), and the index of each scenario by (kind, key).

    ``replay`` keeps every op real, ``ideal`` none; ``optype``, ``dp``, ``pp`` and
    (with ``per_worker``) ``worker`` keep that op type, DP rank, PP rank or (dp, pp)
    worker real; ``ms`` keeps all but the last stage real.
    """
    n_t, D, P = model.num_template_ops, model.dp, model.pp

    def on_every_dp_rank(ops: np.ndarray) -> np.ndarray:
        return np.repeat(ops[:, None], D, axis=1)

    named: list[tuple[tuple[str, object], np.ndarray]] = [
        (("replay", None), np.ones((n_t, D), bool)),
        (("ideal", None), np.zeros((n_t, D), bool)),
    ]
    named += [(("optype", name), on_every_dp_rank(ops)) for name, ops in groups.items()]
    for d in range(D):
        mask = np.zeros((n_t, D), bool)
        mask[:, d] = True
        named.append((("dp", d), mask))
    named += [(("pp", p), on_every_dp_rank(model.t_pp == p)) for p in range(P)]
    named.append((("ms", None), on_every_dp_rank(model.t_pp != P - 1)))
    if per_worker:
        named += [(("worker", (d, p)), ~_all_but_workers(model, [(d, p)])) for d in range(D) for p in range(P)]
    return np.stack([mask for _, mask in named]), {name: i for i, (name, _) in enumerate(named)}


def _all_but_workers(model: Model, workers: list[tuple[int, int]]) -> np.ndarray:
    """(n_t, D) mask of every op but those of the (dp, pp) ``workers``."""
    keep = np.ones((model.num_template_ops, model.dp), bool)
    for d, p in workers:
        keep[model.t_pp == p, d] = False
    return keep


def _top_workers(worker_slowdown: np.ndarray, cell_ratio: np.ndarray) -> list[tuple[int, int]]:
    """The top TOP_WORKER_FRACTION of the (D, P) workers by S_w (at least one), as
    (dp, pp); ties (the approximation makes many) broken by the worker's own compute
    ratio."""
    D, P = worker_slowdown.shape
    k = max(1, math.ceil(TOP_WORKER_FRACTION * D * P))
    order = np.lexsort((-cell_ratio.ravel(), -worker_slowdown.ravel()))[:k]
    return [(int(i // P), int(i % P)) for i in order]


def optype_code_of(name: str) -> int:
    return OPTYPE_CODE[name]
