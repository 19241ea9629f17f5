"""Vectorised replay of a :class:`~postmortem.model.Model` under what-if durations.

The graph is walked level by level (see ``model._levels``); each level is a handful of
numpy operations over arrays shaped (ops in level, scenarios, DP ranks, steps), so the
Python loop runs once per level, never once per op.  Scenarios (which ops keep their
real durations) are batched so one walk answers many what-if questions at once.

Semantics per op u, for every (scenario, DP rank, step):
    launch(u) = max(end(v) for v in pred(u))            (0 for the step's first op)
    glaunch   = max(launch(m) for m in group(u)), also over DP ranks for DP groups
    end(u)    = glaunch + work(u)
where work is the traced duration of compute ops and the transfer time of communication
ops (the real one where the scenario keeps it, else the idealised one).  The step time
is the latest end of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from postmortem.model import Model

_CELL_BUDGET = 24_000_000  # float64 cells per scenario batch (~190 MB for one array)


@dataclass(frozen=True, kw_only=True)
class SimResult:
    step_time: np.ndarray  # (S, N) simulated step times
    launch: np.ndarray | None = None  # (S, n_t, D, N) when recorded
    end: np.ndarray | None = None  # (S, n_t, D, N) when recorded


def simulate(
    model: Model,
    *,
    ideal: np.ndarray,
    keep_real: np.ndarray,
    record: bool = False,
) -> SimResult:
    """Replay ``model`` for S scenarios.

    Args:
        model: the template graph and real work tensors (n_t ops, D DP ranks, N steps).
        ideal: (n_t,) or (n_t, D, N) idealised work of each template op, seconds.
        keep_real: (S, n_t, D) bool; True keeps the op's real work on that DP rank.
        record: also return per-op launch and end times (memory: 2 x S x n_t x D x N).
    Returns:
        SimResult with ``step_time`` (S, N).
    """
    keep_real = np.asarray(keep_real, bool)
    if keep_real.ndim != 3 or keep_real.shape[1:] != (model.num_template_ops, model.dp):
        raise ValueError(f"keep_real must be (S, {model.num_template_ops}, {model.dp}), got {keep_real.shape}")
    ideal = np.asarray(ideal, np.float64)
    if ideal.ndim == 1:
        ideal = ideal[:, None, None]
    n_t, D, N = model.transfer.shape
    S = keep_real.shape[0]
    batch = max(1, _CELL_BUDGET // max(n_t * D * N, 1))
    if record:
        batch = S
    times = np.empty((S, N))
    launches, ends = [], []
    for lo in range(0, S, batch):
        hi = min(S, lo + batch)
        t, la, en = _walk(model, ideal, keep_real[lo:hi], record)
        times[lo:hi] = t
        if record:
            launches.append(la)
            ends.append(en)
    if record:
        return SimResult(step_time=times, launch=np.concatenate(launches), end=np.concatenate(ends))
    return SimResult(step_time=times)


def _walk(model: Model, ideal: np.ndarray, keep: np.ndarray, record: bool):
    n_t, D, N = model.transfer.shape
    S = keep.shape[0]
    real = model.transfer[:, None]  # (n_t, 1, D, N)
    # idealised work, 0 where the op does not exist on a DP rank (uneven micro-batches)
    ideal_full = np.where(model.present[:, :, None], ideal, 0.0)[:, None]  # (n_t, 1, D, N|1)
    end = np.zeros((n_t + 1, S, D, N))  # row n_t: the step's start, always 0
    launch_rec = np.zeros((n_t, S, D, N)) if record else None
    keep_t = np.ascontiguousarray(keep.transpose(1, 0, 2))[..., None]  # (n_t, S, D, 1)
    for lv in model.levels:
        ops = lv.ops
        pr = lv.pred
        la = end[pr[:, 0]] if pr.shape[1] == 1 else end[pr].max(axis=1)  # (n_l, S, D, N)
        if record:
            launch_rec[ops] = la
        g = la
        if lv.spans is not None:
            g = g.copy()
            g[lv.spans] = g[lv.spans].max(axis=2, keepdims=True)
        if lv.members is not None:
            g = g[lv.members].max(axis=1)
        end[ops] = g + np.where(keep_t[ops], real[ops], ideal_full[ops])
    step_time = end[:n_t].max(axis=(0, 2))  # (S, N)
    if record:
        return step_time, launch_rec.transpose(1, 0, 2, 3), end[:n_t].transpose(1, 0, 2, 3)
    return step_time, None, None
