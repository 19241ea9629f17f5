"""The dependency model of one training step, built from a trace.

Every (step, DP replica) of a DP x PP job runs the same program: each stage issues the
same ops in the same order.  So the graph is built once as a *template* over
(PP rank, op) and the simulator runs it vectorised over DP ranks x steps (x scenarios).

Template ops are keyed by (pp_rank, optype, occurrence), occurrence being the op's index
in start order among ops of its type on that worker in that step (for the non-interleaved
schedules, the micro-batch).  Their order on a worker is their mean start time.

Dependencies (what the What-if study's streams amount to for Megatron-style code, whose
p2p waits make the compute stream wait for the NCCL stream):

* chain: a worker issues its ops in order; an op launches when the previous *slot* has
  finished.  A slot is one op, or p2p ops that the trace shows starting together
  (Megatron's fused send_forward_recv_backward): they launch together and the next slot
  waits for all of them.
* async DP sync: ``separate-grads-all-reduce`` overlaps compute; the chain does not wait
  for it, the next DP-stream op and the optimizer do.
* cross-rank groups finish at max(launch of all members) + transfer: p2p pairs
  (forward-send on p / forward-recv on p+1, backward-send on p / backward-recv on p-1,
  same micro-batch and DP rank), DP collectives (same stage, all DP ranks), the
  embedding group (first + last stage), and the clip group (every worker).

Transfer time of a communication op = its end - the latest start among its group's
members (clipped to [0, duration]); the rest of its traced duration is blocking time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from greyhound.errors import InputError
from postmortem.schema import OPTYPE_CODE, OPTYPES, Trace

log = logging.getLogger(__name__)

_C = OPTYPE_CODE
COMPUTE_CODES = frozenset({_C["forward-compute"], _C["backward-compute"], _C["optimizer"]})
GC_CODE = _C["gc"]
DP_GROUP_CODES = frozenset(
    {_C["params-all-gather"], _C["grads-reduce-scatter"], _C["separate-grads-all-reduce"], _C["grads-all-reduce"]}
)
ASYNC_CODES = frozenset({_C["separate-grads-all-reduce"]})
SYNC_POINT_CODES = frozenset({_C["optimizer-clip-main-grad"], _C["optimizer"]})
P2P_PEER = {  # send code -> (recv code, stage offset of the receiver)
    _C["forward-send"]: (_C["forward-recv"], +1),
    _C["backward-send"]: (_C["backward-recv"], -1),
}
P2P_CODES = frozenset({_C["forward-send"], _C["forward-recv"], _C["backward-send"], _C["backward-recv"]})
FUSE_TOLERANCE_S = 1e-6


def is_compute_code(code: int) -> bool:
    """Ops whose whole duration is work (no peer to wait for)."""
    return code in COMPUTE_CODES or code == GC_CODE


@dataclass(frozen=True, kw_only=True)
class Level:
    """The template ops of one topological level, sorted by group."""

    ops: np.ndarray  # (n_l,) template op ids
    pred: np.ndarray  # (n_l, k) predecessors of each op, trimmed to the level's max count
    members: np.ndarray | None  # (n_l, g) level-local indices of each op's group, None if singletons
    spans: np.ndarray | None  # level-local indices of ops whose group reduces over DP, None if none


@dataclass(frozen=True, kw_only=True)
class Model:
    """A trace turned into a template graph plus dense duration tensors.

    Shapes: n_t template ops, D = dp, N = kept steps.
    """

    dp: int
    pp: int
    steps: np.ndarray  # (N,) step numbers kept
    t_pp: np.ndarray  # (n_t,) int
    t_optype: np.ndarray  # (n_t,) int (codes into OPTYPES)
    t_occ: np.ndarray  # (n_t,) int
    t_is_comm: np.ndarray  # (n_t,) bool
    start: np.ndarray  # (n_t, D, N) real start, seconds from the step's start
    duration: np.ndarray  # (n_t, D, N) real traced duration (0 where absent)
    transfer: np.ndarray  # (n_t, D, N) work part: duration for compute, transfer for comm
    present: np.ndarray  # (n_t, D) bool: the op exists on that DP rank
    pred: np.ndarray  # (n_t, K) predecessor template ops; n_t = the step's start
    group: np.ndarray  # (n_t,) group id
    levels: tuple[Level, ...]
    real_step_time: np.ndarray  # (N,) traced step time (last end - first start)
    dropped: tuple[str, ...] = field(default=())

    @property
    def num_template_ops(self) -> int:
        return int(self.t_pp.shape[0])


def build_model(trace: Trace) -> Model:
    """Build the template dependency model of ``trace``.

    Steps with damaged rows (NaN or negative times, ranks out of range) or whose op set
    differs from the job's usual one (a truncated step, an unmatched p2p) are dropped and
    listed in ``Model.dropped``; InputError if no whole step remains or the program has
    no consistent structure (a p2p op without a peer anywhere, a deadlocking order).
    """
    where = trace.path or "trace"
    meta = trace.meta
    D, P = meta.dp, meta.pp
    ops = trace.ops
    notes: list[str] = list(trace.dropped)
    step = ops["step"].astype(np.int64)
    dp = ops["dp_rank"].astype(np.int64)
    pp = ops["pp_rank"].astype(np.int64)
    code = ops["optype"].astype(np.int64)
    start = ops["start"]
    dur = ops["duration"]
    if step.size == 0:
        raise InputError(f"{where}: the trace has no ops")

    bad = ~np.isfinite(start) | ~np.isfinite(dur) | (dur < 0) | (dp < 0) | (dp >= D) | (pp < 0) | (pp >= P)
    steps_all, step_idx = np.unique(step, return_inverse=True)
    N_all = steps_all.size
    bad_step = np.zeros(N_all, bool)
    if bad.any():
        bad_step[np.unique(step_idx[bad])] = True
        notes.append(
            f"{int(bad.sum())} op rows with NaN/negative times or ranks out of range "
            f"(dp < {D}, pp < {P}); their steps are dropped"
        )
    # drop bad rows now so they cannot poison the layout
    keep_rows = ~bad
    step_idx, dp, pp, code = step_idx[keep_rows], dp[keep_rows], pp[keep_rows], code[keep_rows]
    start, dur = start[keep_rows], dur[keep_rows]

    # occurrence index among (step, dp, pp, optype), in start order
    worker_key = ((step_idx * D + dp) * P + pp) * len(OPTYPES) + code
    order = np.lexsort((start, worker_key))
    wk = worker_key[order]
    boundary = np.empty(wk.size, bool)
    boundary[0] = True
    boundary[1:] = wk[1:] != wk[:-1]
    first = np.flatnonzero(boundary)
    run_id = np.cumsum(boundary) - 1
    occ_sorted = np.arange(wk.size) - first[run_id]
    occ = np.empty_like(occ_sorted)
    occ[order] = occ_sorted

    # per-step origin: the earliest start of the step (the study's traces are already 0)
    step_min = np.full(N_all, np.inf)
    np.minimum.at(step_min, step_idx, start)
    rel_start = start - step_min[step_idx]
    step_end = np.full(N_all, -np.inf)
    np.maximum.at(step_end, step_idx, rel_start + dur)

    # template keys
    max_occ = int(occ.max()) + 1
    tkey = (pp * len(OPTYPES) + code) * max_occ + occ
    tkeys, t_of_row = np.unique(tkey, return_inverse=True)
    n_t = tkeys.size
    cell = (t_of_row * D + dp) * N_all + step_idx
    count = np.bincount(cell, minlength=n_t * D * N_all).reshape(n_t, D, N_all)
    S = np.zeros((n_t, D, N_all))
    U = np.zeros((n_t, D, N_all))
    S.reshape(-1)[cell] = rel_start
    U.reshape(-1)[cell] = dur
    have = count > 0
    usable = ~bad_step
    frac = have[:, :, usable].mean(axis=2) if usable.any() else np.zeros((n_t, D))
    expected = frac >= 0.5  # (n_t, D)
    mismatch = (have != expected[:, :, None]).any(axis=(0, 1))
    if mismatch.any():
        notes.append(
            f"{int((mismatch & usable).sum())} step(s) with missing or extra ops "
            f"(truncated or unmatched) dropped: steps {_fmt_list(steps_all[mismatch & usable])}"
        )
    keep_steps = usable & ~mismatch
    if not keep_steps.any():
        raise InputError(f"{where}: no whole step in the trace (every step has missing or damaged ops)")
    keep_t = expected.any(axis=1)
    S, U = S[keep_t][:, :, keep_steps], U[keep_t][:, :, keep_steps]
    expected = expected[keep_t]
    tkeys = tkeys[keep_t]
    t_occ = tkeys % max_occ
    t_code = (tkeys // max_occ) % len(OPTYPES)
    t_pp = tkeys // max_occ // len(OPTYPES)
    steps = steps_all[keep_steps]
    real_step_time = step_end[keep_steps]
    n_t = tkeys.size

    # order on each worker: mean start over present instances; ties by op code
    pres3 = expected[:, :, None] & np.ones(steps.size, bool)
    mean_start = (S * pres3).sum(axis=(1, 2)) / np.maximum(pres3.sum(axis=(1, 2)), 1)
    perm = np.lexsort((t_occ, t_code, mean_start, t_pp))
    t_pp, t_code, t_occ = t_pp[perm], t_code[perm], t_occ[perm]
    S, U, expected, pres3 = S[perm], U[perm], expected[perm], pres3[perm]

    t_is_comm = ~np.isin(t_code, list(COMPUTE_CODES | {GC_CODE}))
    lookup = {(int(p), int(c), int(o)): i for i, (p, c, o) in enumerate(zip(t_pp, t_code, t_occ))}

    # groups
    group = np.arange(n_t)
    spans = np.zeros(n_t, bool)
    for i in range(n_t):  # template size, not op count: O(PP x ops per stage)
        c = int(t_code[i])
        if c in P2P_PEER:
            rc, off = P2P_PEER[c]
            j = lookup.get((int(t_pp[i]) + off, rc, int(t_occ[i])))
            if j is None:
                raise InputError(
                    f"{where}: unmatched p2p: {OPTYPES[c]} #{int(t_occ[i])} of stage {int(t_pp[i])} "
                    f"has no {OPTYPES[rc]} on stage {int(t_pp[i]) + off}"
                )
            group[j] = group[i]
        elif c in DP_GROUP_CODES:
            spans[i] = True
        elif c == _C["embedding-grads-all-reduce"] and t_pp[i] == P - 1 and P > 1:
            j = lookup.get((0, c, int(t_occ[i])))
            if j is not None:
                group[i] = group[j]
        elif c == _C["optimizer-clip-main-grad"]:
            j = lookup.get((0, c, int(t_occ[i])))
            group[i] = group[j] if j is not None else i
            spans[i] = True
    recv_unmatched = [
        i for i in range(n_t) if t_code[i] in (_C["forward-recv"], _C["backward-recv"]) and group[i] == i
    ]
    if recv_unmatched:
        i = recv_unmatched[0]
        raise InputError(
            f"{where}: unmatched p2p: {OPTYPES[int(t_code[i])]} #{int(t_occ[i])} of stage {int(t_pp[i])} "
            "has no matching send"
        )
    _, group = np.unique(group, return_inverse=True)
    g_spans = np.zeros(group.max() + 1, bool)
    np.logical_or.at(g_spans, group, spans)
    spans = g_spans[group]

    # transfer: end - latest start among the group (and the DP axis for DP groups)
    S_m = np.where(pres3, S, -np.inf)
    gmax = np.full((int(group.max()) + 1,) + S.shape[1:], -np.inf)
    np.maximum.at(gmax, group, S_m)
    gmax_dp = gmax.max(axis=1, keepdims=True)
    gm = np.where(g_spans[:, None, None], gmax_dp, gmax)[group]
    end = S + U
    transfer = np.where(t_is_comm[:, None, None], np.clip(end - gm, 0.0, U), U)
    transfer = np.where(pres3, transfer, 0.0)

    pred = _chain_preds(t_pp, t_code, S, U, pres3, P)
    levels = _levels(pred, group, spans, where=where)
    return Model(
        dp=D,
        pp=P,
        steps=steps,
        t_pp=t_pp.astype(np.int64),
        t_optype=t_code.astype(np.int64),
        t_occ=t_occ.astype(np.int64),
        t_is_comm=t_is_comm,
        start=S,
        duration=U,
        transfer=transfer,
        present=expected,
        pred=pred,
        group=group,
        levels=levels,
        real_step_time=real_step_time,
        dropped=tuple(notes),
    )


def _fmt_list(values, limit: int = 10) -> str:
    vals = [str(int(v)) for v in values[:limit]]
    return ", ".join(vals) + (f" ... ({len(values)} in all)" if len(values) > limit else "")


def _chain_preds(t_pp, t_code, S, U, pres3, P) -> np.ndarray:
    """Padded predecessor lists (n_t, K); the sentinel n_t means 'the step's start'."""
    n_t = t_pp.size
    # fused slots: consecutive p2p ops on one worker that start together in most instances
    same_pp = np.zeros(n_t, bool)
    same_pp[1:] = t_pp[1:] == t_pp[:-1]
    both_p2p = np.zeros(n_t, bool)
    is_p2p = np.isin(t_code, list(P2P_CODES))
    both_p2p[1:] = is_p2p[1:] & is_p2p[:-1]
    fused = np.zeros(n_t, bool)  # fused[i]: op i is in the same slot as op i-1
    cand = np.flatnonzero(same_pp & both_p2p)
    if cand.size:
        both = pres3[cand] & pres3[cand - 1]
        close = (np.abs(S[cand] - S[cand - 1]) <= FUSE_TOLERANCE_S) & both
        fused[cand] = close.sum(axis=(1, 2)) * 2 >= np.maximum(both.sum(axis=(1, 2)), 1)
    preds: list[list[int]] = [[] for _ in range(n_t)]
    i = 0
    while i < n_t:
        p = t_pp[i]
        prev_slot: list[int] = []
        pending_async: list[int] = []
        last_dp_async: int | None = None
        while i < n_t and t_pp[i] == p:
            slot = [i]
            while i + 1 < n_t and fused[i + 1]:
                i += 1
                slot.append(i)
            for j in slot:
                c = int(t_code[j])
                extra = []
                if c in DP_GROUP_CODES and last_dp_async is not None:
                    extra.append(last_dp_async)
                if c in SYNC_POINT_CODES:
                    extra.extend(pending_async)
                preds[j] = list(prev_slot) + extra
            if len(slot) == 1 and int(t_code[slot[0]]) in ASYNC_CODES:
                pending_async.append(slot[0])
                last_dp_async = slot[0]
            else:
                if any(int(t_code[j]) in SYNC_POINT_CODES for j in slot):
                    pending_async = []
                prev_slot = slot
            i += 1
    K = max(1, max(len(x) for x in preds))
    pred = np.full((n_t, K), n_t, dtype=np.int64)
    for j, x in enumerate(preds):
        pred[j, : len(x)] = x
    return pred


def _levels(pred: np.ndarray, group: np.ndarray, spans: np.ndarray, *, where: str) -> tuple[Level, ...]:
    """Topological levels of groups: a group's level is 1 + the max level of its preds."""
    n_t = pred.shape[0]
    n_g = int(group.max()) + 1
    level = np.zeros(n_t + 1, dtype=np.int64)  # sentinel (step start) at level 0
    for _ in range(n_t + 2):
        op_need = level[pred].max(axis=1) + 1
        g_need = np.zeros(n_g, np.int64)
        np.maximum.at(g_need, group, op_need)
        new = g_need[group]
        if np.array_equal(new, level[:n_t]):
            break
        level[:n_t] = new
    else:
        raise InputError(f"{where}: the ops' order deadlocks (a cycle through p2p or collective groups)")
    lv = level[:n_t]
    order = np.lexsort((group, lv))
    bounds = np.flatnonzero(np.diff(lv[order])) + 1
    out = []
    for chunk in np.split(order, bounds):
        g = group[chunk]
        gb = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
        sizes = np.diff(np.r_[gb, g.size])
        members = None
        if (sizes > 1).any():
            gmax = int(sizes.max())
            gid = np.repeat(np.arange(gb.size), sizes)
            # pad each group's member list with its own first member (max is unchanged)
            idx = gb[:, None] + np.minimum(np.arange(gmax)[None, :], sizes[:, None] - 1)
            members = idx[gid]
        pr = pred[chunk]
        k = int(max(1, (pr != n_t).sum(axis=1).max()))
        sp = np.flatnonzero(spans[chunk])
        out.append(
            Level(ops=chunk, pred=np.ascontiguousarray(pr[:, :k]), members=members, spans=sp if sp.size else None)
        )
    return tuple(out)
