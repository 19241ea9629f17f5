"""What every op would take without stragglers: the idealised work per template op.

Two estimators for compute ops (forward-compute, backward-compute, optimizer):

* ``"mean"`` -- the What-if study's: the job-wide mean of the op type.  It includes the
  stragglers' own slow ops, so with one worker much slower the ideal is too slow and S
  comes out low (1 of 16 workers at 2x: measured 1.566, this estimator 1.478).
* ``"robust"`` (greyhound's default) -- per stage, the mean over (DP rank, step) cells
  that are not slow outliers, then the op-weighted mean over stages.  A cell is the mean
  duration of the op type on one worker in one step; it is an outlier when it lies more
  than ``outlier_z`` robust standard deviations (1.4826 x MAD, floored at 0.5% of the
  median so that near-identical cells do not flag noise) above the stage's median cell.
  Why this shape: the median/MAD inside a stage is not moved by a minority of slow
  workers, so their ops no longer inflate the ideal; the mean over the healthy cells (not
  their median) keeps natural micro-batch variation such as sequence lengths in the
  ideal, as the study does; and averaging *across* stages keeps a heavy last stage a
  straggler (the ideal is the balanced partition of the same total work), so stage
  imbalance stays measurable as M_S.  The per-stage values are kept for the report.

Communication ops get the job-wide median of their transfer time (both estimators; the
median already ignores rare slow transfers), and ``gc`` the median of its pauses (most
steps have none, so an unsynchronised pause is a straggler).

The model's ``step-start`` op (a worker's first start in the step, see
``postmortem.model``) gets the median over DP ranks and steps *per stage*: part of the
skew is the schedule's own (in 1F1B the first stage always starts last, having finished
last) and stays in the ideal; what one worker adds on top, because it finished its
previous step late, is a straggler's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from postmortem.model import COMPUTE_CODES, STEP_START_CODE, Model

ESTIMATORS = ("robust", "mean")


@dataclass(frozen=True, kw_only=True)
class Ideal:
    work: np.ndarray  # (n_t,) idealised work per template op
    by_optype: dict[int, float]  # optype code -> ideal work
    stage_typical: dict[int, np.ndarray]  # compute code -> (P,) per-stage healthy mean
    outlier_cells: np.ndarray  # (P, D, N) bool: worker-step cells flagged slow (any compute type)
    cell_ratio: np.ndarray  # (D, P) mean compute work of the worker / ideal (heatmap of raw ops)
    estimator: str


def idealize(model: Model, *, estimator: str = "robust", outlier_z: float = 3.5) -> Ideal:
    """Idealised work for every template op of ``model``.

    Args:
        model: the dependency model (n_t template ops, D DP ranks, N steps, P stages).
        estimator: "robust" (default) or "mean" (the What-if study's).
        outlier_z: robust z-score above which a worker-step cell is a slow outlier.
    Returns:
        Ideal; ``work`` has shape (n_t,).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if not outlier_z > 0:
        raise ValueError(f"outlier_z must be > 0, got {outlier_z}")
    P, D, N = model.pp, model.dp, model.steps.size
    work = np.zeros(model.num_template_ops)
    by_optype: dict[int, float] = {}
    stage_typical: dict[int, np.ndarray] = {}
    outliers = np.zeros((P, D, N), bool)
    pres = np.broadcast_to(model.present[:, :, None], model.transfer.shape)
    comp_sum = np.zeros((D, P))
    comp_ideal = np.zeros((D, P))
    for code in np.unique(model.t_optype):
        sel = model.t_optype == code
        vals = model.transfer[sel]
        ok = pres[sel]
        if not ok.any():
            continue
        if code in COMPUTE_CODES:
            value, typical, out = _compute_ideal(model, sel, estimator=estimator, z=outlier_z)
            stage_typical[int(code)] = typical
            outliers |= out
            # per-worker totals for the raw-op heatmap
            for p in range(P):
                s = sel & (model.t_pp == p)
                if s.any():
                    comp_sum[:, p] += (model.transfer[s] * pres[s]).sum(axis=(0, 2))
                    comp_ideal[:, p] += value * pres[s].sum(axis=(0, 2))
        elif code == STEP_START_CODE:
            for i in np.flatnonzero(sel):   # one op per stage
                work[i] = float(np.median(model.transfer[i][model.present[i]]))
            by_optype[int(code)] = float(work[sel].mean())
            continue
        else:
            value = float(np.median(vals[ok]))
        by_optype[int(code)] = value
        work[sel] = value
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(comp_ideal > 0, comp_sum / comp_ideal, 1.0)
    return Ideal(
        work=work,
        by_optype=by_optype,
        stage_typical=stage_typical,
        outlier_cells=outliers,
        cell_ratio=ratio,
        estimator=estimator,
    )


def _compute_ideal(model: Model, sel: np.ndarray, *, estimator: str, z: float):
    P, D, N = model.pp, model.dp, model.steps.size
    typical = np.full(P, np.nan)
    weights = np.zeros(P)
    out = np.zeros((P, D, N), bool)
    total, count = 0.0, 0
    for p in range(P):
        s = sel & (model.t_pp == p)
        if not s.any():
            continue
        pres = model.present[s][:, :, None]  # (k, D, 1)
        n_ops = pres.sum(axis=0)  # (D, 1)
        x_sum = (model.transfer[s] * pres).sum(axis=0)  # (D, N)
        valid = np.broadcast_to(n_ops > 0, x_sum.shape)
        cells = np.where(valid, x_sum / np.maximum(n_ops, 1), np.nan)
        total += x_sum.sum()
        count += int(n_ops.sum()) * N
        if estimator == "mean":
            typical[p] = np.nansum(x_sum) / max(int(n_ops.sum()) * N, 1)
            weights[p] = n_ops.sum() * N
            continue
        med = np.nanmedian(cells)
        mad = np.nanmedian(np.abs(cells - med)) * 1.4826
        scale = max(mad, 0.005 * abs(med), 1e-12)
        slow = valid & (cells > med + z * scale)
        out[p] = slow
        healthy = valid & ~slow
        w = np.where(healthy, np.broadcast_to(n_ops, x_sum.shape), 0)
        typical[p] = (x_sum * healthy).sum() / max(w.sum(), 1)
        weights[p] = n_ops.sum() * N  # weight by the stage's share of the job's ops
    if estimator == "mean":
        return total / max(count, 1), typical, out
    ok = np.isfinite(typical) & (weights > 0)
    return float(np.average(typical[ok], weights=weights[ok])), typical, out
