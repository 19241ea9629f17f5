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

How the walk stays small (the same numbers, bit for bit, as a walk that keeps every
op's end; ``tests/test_postmortem_simulate.py`` checks it against that walk):

* a live buffer: an op's end is kept only until the last op that waits on it has read
  it (``Level.read``; each level writes its ends in place to one block of rows,
  ``Level.block``), so memory is O(live ops), not O(ops);
* the step time is the max over sinks (ops nothing waits on): every other op has a
  successor that ends no earlier, since work >= 0;
* steps are independent (each starts at 0), so they are chunked freely to bound memory;
* a scenario that keeps real work on only some DP ranks runs with those ranks plus one
  stand-in for all the others: ranks with only idealised work and the same ops are
  identical, so one column stands for them (a DP-group max over them is that column).
  Per-DP-rank and per-worker what-ifs so cost 2 ranks instead of D.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from postmortem.model import Model

_CELL_BUDGET = 24_000_000  # float64 cells per scenario batch of the recording walk
_ROW_CELLS = 1 << 15  # (scenario, DP rank, step) cells per op row of the live walk
_WALK_COST_CELLS = 20_000  # one level's fixed cost of a walk, in cells (~100 us / ~5 ns)


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
    if not record and model.levels and model.levels[0].read is not None:
        return SimResult(step_time=_simulate_live(model, ideal, keep_real))
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


def _columns(model: Model, keep: np.ndarray, ideal: np.ndarray) -> list[np.ndarray]:
    """DP ranks each scenario must simulate: (S,) arrays of rank indices.

    Ranks that keep no real work are all alike when their ops are the same (``present``)
    and the ideal does not vary by rank; one of them stands for the rest.
    """
    S, _, D = keep.shape
    full = np.arange(D)
    if ideal.shape[1] != 1 or ideal.shape[2] != 1:
        return [full] * S
    real_ranks = np.any(keep, axis=1)  # (S, D)
    pres = model.present
    out = []
    for s in range(S):
        idle = np.flatnonzero(~real_ranks[s])
        if idle.size < 2 or not (pres[:, idle] == pres[:, idle[:1]]).all():
            out.append(full)
            continue
        out.append(np.union1d(np.flatnonzero(real_ranks[s]), idle[:1]))
    return out


def _simulate_live(model: Model, ideal: np.ndarray, keep: np.ndarray) -> np.ndarray:
    n_t, D, N = model.transfer.shape
    S = keep.shape[0]
    cols = _columns(model, keep, ideal)
    times = np.empty((S, N))
    by_width: dict[int, list[int]] = {}
    for s, c in enumerate(cols):
        by_width.setdefault(c.size, []).append(s)
    # a narrower walk saves cells but costs its own pass over the levels: on a small
    # trace the per-level overhead wins, so its scenarios join the full-width walk
    for width in [w for w in by_width if w < D]:
        saved = (D - width) * N * n_t * len(by_width[width])
        if saved < len(model.levels) * _WALK_COST_CELLS:
            moved = by_width.pop(width)
            for s in moved:
                cols[s] = np.arange(D)
            by_width.setdefault(D, []).extend(moved)
    for width, members in by_width.items():
        members_a = np.asarray(members)
        per_step = width
        if per_step * N <= _ROW_CELLS:
            s_batch, n_batch = max(1, _ROW_CELLS // (per_step * N)), N
        else:
            s_batch, n_batch = 1, max(1, _ROW_CELLS // per_step)
        for lo in range(0, members_a.size, s_batch):
            sel = members_a[lo : lo + s_batch]
            c = np.stack([cols[s] for s in sel])  # (s_b, width)
            for n0 in range(0, N, n_batch):
                n1 = min(N, n0 + n_batch)
                times[sel, n0:n1] = _walk_live(model, ideal, keep[sel], c, n0, n1)
    return times


def _group_max(g: np.ndarray, lv) -> None:
    """In place: each op's value becomes the max over its group (Level.group_blocks)."""
    for a, n, k in lv.group_blocks:
        m = g[a : a + n]
        for j in range(1, k):
            np.maximum(m, g[a + j * n : a + (j + 1) * n], out=m)
        for j in range(1, k):
            g[a + j * n : a + (j + 1) * n] = m


def _walk_live(model: Model, ideal: np.ndarray, keep: np.ndarray, cols: np.ndarray, n0: int, n1: int) -> np.ndarray:
    """Step times (S, n1 - n0) of scenarios ``keep`` (S, n_t, D) on DP ranks ``cols`` (S, W)."""
    S, W = cols.shape
    D = model.dp
    Nb = n1 - n0
    identity = W == D and (cols == np.arange(D)).all()
    transfer = model.transfer[:, :, n0:n1]
    if identity:
        keep_c = np.ascontiguousarray(keep.transpose(1, 0, 2))[..., None]  # (n_t, S, D, 1)
        ideal_c = np.where(model.present[:, :, None], ideal[:, :, n0:n1] if ideal.shape[2] > 1 else ideal, 0.0)
        ideal_c = ideal_c[:, None]  # (n_t, 1, D, N|1)
    else:  # ideal is (n_t, 1, 1) here (see _columns)
        keep_w = np.take_along_axis(keep, cols[:, None, :], axis=2)  # (S, n_t, W)
        keep_c = np.ascontiguousarray(keep_w.transpose(1, 0, 2))[..., None]  # (n_t, S, W, 1)
        pres_c = model.present[:, cols]  # (n_t, S, W)
        ideal_c = np.where(pres_c, ideal[:, :, 0][:, :, None], 0.0)[..., None]  # (n_t, S, W, 1)
    buf = np.zeros((model.buffer_rows + 1, S, W, Nb))
    step_time = np.full((S, Nb), -np.inf)
    for lv in model.levels:
        ops = lv.ops
        rd = lv.read
        assert rd is not None  # build_model plans every level's buffer rows
        g = buf[rd[:, 0]]  # (n_l, S, W, Nb) launch
        for j in range(1, rd.shape[1]):
            np.maximum(g, buf[rd[:, j]], out=g)
        if lv.spans is not None:
            g[lv.spans] = g[lv.spans].max(axis=2, keepdims=True)
        _group_max(g, lv)
        real = transfer[ops][:, None] if identity else transfer[ops][:, cols]  # (n_l, 1|S, W, Nb)
        end = buf[lv.block : lv.block + ops.size]  # written in place
        np.add(g, ideal_c[ops], out=end)
        np.add(g, real, out=end, where=keep_c[ops])
        if lv.sinks is not None:
            sink_end = end if lv.sinks.size == ops.size else end[lv.sinks]
            np.maximum(step_time, sink_end.max(axis=(0, 2)), out=step_time)
    return step_time


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
        if launch_rec is not None:
            launch_rec[ops] = la
        g = la
        if lv.spans is not None:
            g = g.copy()
            g[lv.spans] = g[lv.spans].max(axis=2, keepdims=True)
        _group_max(g, lv)
        end[ops] = g + np.where(keep_t[ops], real[ops], ideal_full[ops])
    step_time = end[:n_t].max(axis=(0, 2))  # (S, N)
    if launch_rec is not None:
        return step_time, launch_rec.transpose(1, 0, 2, 3), end[:n_t].transpose(1, 0, 2, 3)
    return step_time, None, None
