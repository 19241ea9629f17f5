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

Step-start skew: steps are replayed independently, each from 0, but workers do not
start a step together. Without a job-wide sync at the step's end (the study's Megatron
jobs have one, the clip-grad all-reduce), each worker starts as soon as its own previous
step is done: in 1F1B the first stage finishes last and starts the next step tens of
milliseconds after the last stage. Replayed from 0, such a trace comes out ~10% short
of its real step time. So each worker's chain begins with a ``step-start`` op (a model
op, not a trace op type: ``STEP_START_CODE``) whose work is the worker's first start in
the step: a launch delay the replay keeps and the idealisation treats per stage (see
``postmortem.idealize``).
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
STEP_START = "step-start"
STEP_START_CODE = len(OPTYPES)
"""Code of the model's step-start op (past the trace's op-type codes; see the module doc)."""


def optype_label(code: int) -> str:
    """Name of a template op's type: a trace op type, or ``step-start``."""
    return STEP_START if int(code) == STEP_START_CODE else OPTYPES[int(code)]


def is_compute_code(code: int) -> bool:
    """Ops whose whole duration is work (no peer to wait for)."""
    return code in COMPUTE_CODES or code == GC_CODE


@dataclass(frozen=True, kw_only=True)
class Level:
    """The template ops of one topological level, sorted by group."""

    ops: np.ndarray  # (n_l,) template op ids
    pred: np.ndarray  # (n_l, k) predecessors of each op, trimmed to the level's max count
    spans: np.ndarray | None  # level-local indices of ops whose group reduces over DP, None if none
    # groups of k > 1 members, as k adjacent blocks of n ops starting at a: block j holds
    # member j of each of the n groups, so a group max is a max of k slices
    group_blocks: tuple[tuple[int, int, int], ...] = ()  # (a, n, k) per group size k
    # the live-buffer walk (simulate.py): a buffer holds each op's end only until its
    # last successor has read it; a level writes its ends to the contiguous rows
    # block .. block + n_l - 1, and row Model.buffer_rows is the step's start (always 0)
    read: np.ndarray | None = None  # (n_l, k) buffer rows of ``pred``
    block: int = 0
    sinks: np.ndarray | None = None  # level-local ops with no successor (they end the step)


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
    buffer_rows: int = 0  # live-buffer rows the walk needs (see Level.read)
    gc_events: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """(n_gc,) durations of irregular GC pauses kept out of the template (see build_model)."""

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
    # native (narrow) dtypes: widened only where a key needs it
    step, dp, pp, code = ops["step"], ops["dp_rank"], ops["pp_rank"], ops["optype"]
    start = ops["start"]
    dur = ops["duration"]
    if step.size == 0:
        raise InputError(f"{where}: the trace has no ops")

    bad = ~np.isfinite(start) | ~np.isfinite(dur) | (dur < 0) | (dp < 0) | (dp >= D) | (pp < 0) | (pp >= P)
    steps_all, step_idx = _dense_unique(step)
    steps_all = steps_all.astype(np.int64)
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
    del bad

    # Automatic Python GC pauses (gc.callbacks) come at irregular steps and ranks, and
    # inside other ops' spans, unlike the study's planned GC at a fixed place in every
    # step. As template ops they would make every step with a pause "mismatched": keep
    # them as events beside the model instead (their time is already in the ops around).
    gc_events = np.zeros(0)
    is_gc = code == GC_CODE
    if is_gc.any():
        cell = (step_idx.astype(np.int64) * D + dp) * P + pp
        per_cell = np.bincount(cell[is_gc], minlength=N_all * D * P)
        if per_cell.min() != per_cell.max():
            gc_events = dur[is_gc].astype(np.float64)
            notes.append(f"{int(is_gc.sum())} irregular GC pauses (automatic Python GC) "
                         "kept as events, not as ops of the step")
            keep_rows = ~is_gc
            step_idx, dp, pp, code = step_idx[keep_rows], dp[keep_rows], pp[keep_rows], code[keep_rows]
            start, dur = start[keep_rows], dur[keep_rows]
        del cell, per_cell
    del is_gc

    occ = _occurrence(step_idx, dp, pp, code, start, D=D, P=P, N=N_all)

    # per-step origin: the earliest start of the step (the study's traces are already 0)
    step_min = np.full(N_all, np.inf)
    np.minimum.at(step_min, step_idx, start)
    rel_start = start - step_min[step_idx]
    step_end = np.full(N_all, -np.inf)
    np.maximum.at(step_end, step_idx, rel_start + dur)

    # template keys
    max_occ = int(occ.max()) + 1
    tdt = np.int32 if P * len(OPTYPES) * max_occ < np.iinfo(np.int32).max else np.int64
    tkey = (pp.astype(tdt) * len(OPTYPES) + code) * max_occ + occ
    del occ
    tkeys, t_of_row = _dense_unique(tkey)
    tkeys = tkeys.astype(np.int64)
    del tkey
    n_t = tkeys.size
    # (template op, dp, step) is unique per row: the occurrence numbers a worker-step's
    # ops of one type, so each cell gets at most one row
    cell = (t_of_row.astype(np.int64) * D + dp) * N_all + step_idx
    del t_of_row
    S = np.zeros((n_t, D, N_all))
    U = np.zeros((n_t, D, N_all))
    have = np.zeros((n_t, D, N_all), bool)
    S.reshape(-1)[cell] = rel_start
    U.reshape(-1)[cell] = dur
    have.reshape(-1)[cell] = True
    del cell, rel_start
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
    if not (keep_t.all() and keep_steps.all()):
        sel = np.ix_(keep_t, np.ones(D, bool), keep_steps)
        S, U = S[sel], U[sel]
    del have
    expected = expected[keep_t]
    tkeys = tkeys[keep_t]
    t_occ = tkeys % max_occ
    t_code = (tkeys // max_occ) % len(OPTYPES)
    t_pp = tkeys // max_occ // len(OPTYPES)
    steps = steps_all[keep_steps]
    real_step_time = step_end[keep_steps]
    n_t = tkeys.size
    empty = np.setdiff1d(np.arange(P), t_pp)
    if empty.size:
        raise InputError(
            f"{where}: pipeline stage(s) {_fmt_list(empty)} have no op that recurs in most steps; "
            f"every stage of the job's pp={P} needs its ops in the trace"
        )

    # step-start ops: one per stage, its work the worker's first start in the step
    offset = np.stack([np.where(expected[t_pp == p][:, :, None], S[t_pp == p], np.inf).min(axis=0)
                       for p in range(P)])  # (P, D, N)
    offset[~np.isfinite(offset)] = 0.0   # a stage with no op on a DP rank (never in practice)
    S = np.concatenate([S, np.zeros_like(offset)])
    U = np.concatenate([U, offset])
    expected = np.concatenate([expected, np.ones((P, D), bool)])
    t_pp = np.concatenate([t_pp, np.arange(P)])
    t_code = np.concatenate([t_code, np.full(P, STEP_START_CODE)])
    t_occ = np.concatenate([t_occ, np.zeros(P, t_occ.dtype)])
    n_t += P
    del offset

    # order on each worker: mean start over present instances; ties by op code
    pres3 = expected[:, :, None] & np.ones(steps.size, bool)
    # S * pres3 is S itself when every op is present (x * 1.0 == x): skip the copy
    weighted = S if expected.all() else S * pres3
    mean_start = weighted.sum(axis=(1, 2)) / np.maximum(pres3.sum(axis=(1, 2)), 1)
    mean_start[t_code == STEP_START_CODE] = -1.0   # first on its worker
    del weighted
    perm = np.lexsort((t_occ, t_code, mean_start, t_pp))
    t_pp, t_code, t_occ = t_pp[perm], t_code[perm], t_occ[perm]
    S, U, expected, pres3 = S[perm], U[perm], expected[perm], pres3[perm]

    t_is_comm = ~np.isin(t_code, list(COMPUTE_CODES | {GC_CODE, STEP_START_CODE}))
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

    transfer = _transfer(S, U, expected, group, g_spans, t_is_comm)

    pred = _chain_preds(t_pp, t_code, S, U, pres3, P)
    levels, buffer_rows = _levels(pred, group, spans, where=where)
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
        buffer_rows=buffer_rows,
        real_step_time=real_step_time,
        dropped=tuple(notes),
        gc_events=gc_events,
    )


_DENSE_SLACK = 4  # a key range up to this many times the row count is tabulated, not sorted


def _dense_unique(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_inverse=True)`` for non-negative-ish integer keys.

    Trace keys (step numbers, template keys) span a small range, so a presence table
    and a cumulative sum give the same sorted unique values and inverse in O(n + range)
    instead of an O(n log n) sort of millions of rows.
    """
    if keys.size == 0:
        return np.unique(keys, return_inverse=True)
    lo, hi = int(keys.min()), int(keys.max())
    span = hi - lo + 1
    if span > _DENSE_SLACK * keys.size + 1024:
        return np.unique(keys, return_inverse=True)
    shifted = keys - lo
    seen = np.zeros(span, bool)
    seen[shifted] = True
    values = np.flatnonzero(seen).astype(keys.dtype) + lo
    rank = np.cumsum(seen, dtype=np.int64) - 1
    if values.size < np.iinfo(np.int32).max:
        rank = rank.astype(np.int32)  # half the memory of the per-row inverse
    return values, rank[shifted]


def _occurrence(step_idx, dp, pp, code, start, *, D: int, P: int, N: int) -> np.ndarray:
    """Each row's index in start order among the rows of its (step, dp, pp, optype).

    Equal to ranking by ``np.lexsort((start, worker_key))``; done as one stable integer
    sort on the smallest dtype that holds the key (rows of a worker usually arrive in
    time order, so the stable order already is the start order), with the float
    lexsort only when some group is not.
    """
    n_codes = len(OPTYPES)
    key_max = N * D * P * n_codes
    kdt = np.int32 if key_max < np.iinfo(np.int32).max else np.int64
    worker_key = ((step_idx.astype(kdt) * D + dp.astype(kdt)) * P + pp.astype(kdt)) * n_codes + code.astype(kdt)
    order = np.argsort(worker_key, kind="stable")
    wk = worker_key[order]
    s = start[order]
    boundary = np.empty(wk.size, bool)
    boundary[0] = True
    np.not_equal(wk[1:], wk[:-1], out=boundary[1:])
    if not (boundary[1:] | (s[1:] >= s[:-1])).all():
        order = np.lexsort((start, worker_key))
        wk = worker_key[order]
        np.not_equal(wk[1:], wk[:-1], out=boundary[1:])
    del s, wk, worker_key
    first = np.flatnonzero(boundary)
    idt = np.int32 if boundary.size < np.iinfo(np.int32).max else np.int64
    run_id = np.cumsum(boundary, dtype=idt) - 1
    occ_sorted = np.arange(boundary.size, dtype=idt) - first.astype(idt)[run_id]
    del run_id, boundary
    occ = np.empty_like(occ_sorted)
    occ[order] = occ_sorted
    return occ


_TRANSFER_CHUNK_CELLS = 1 << 21  # cells per temporary of the transfer pass (16 MB)


def _transfer(S, U, present, group, g_spans, is_comm) -> np.ndarray:
    """(n_t, D, N) work of each op: its duration, or for communication its end minus the
    latest start among its group (over DP ranks too for DP groups), clipped to
    [0, duration]; 0 where the op is absent.

    Only communication rows are touched, group by group and a few steps at a time, so
    the temporaries stay small (fresh memory is what a large trace pays for).
    """
    transfer = U.copy()
    comm = np.flatnonzero(is_comm)
    if comm.size:
        rows = comm[np.argsort(group[comm], kind="stable")]
        g = group[rows]
        gb = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
        sizes = np.diff(np.r_[gb, g.size])
        last = gb + sizes - 1
        gid = np.repeat(np.arange(gb.size), sizes)
        span = g_spans[g[gb]]
        any_span = bool(span.any())
        pres_rows = present[rows][:, :, None]  # (n_c, D, 1)
        all_present = bool(pres_rows.all())
        D, N = S.shape[1], S.shape[2]
        chunk = max(1, _TRANSFER_CHUNK_CELLS // max(rows.size * D, 1))
        for n0 in range(0, N, chunk):
            sl = slice(n0, min(N, n0 + chunk))
            s_r, u_r = S[rows, :, sl], U[rows, :, sl]
            s_m = s_r if all_present else np.where(pres_rows, s_r, -np.inf)
            gmax = s_m[gb]
            for j in range(1, int(sizes.max())):
                np.maximum(gmax, s_m[np.minimum(gb + j, last)], out=gmax)
            if any_span:
                gmax[span] = gmax[span].max(axis=1, keepdims=True)
            end = s_r + u_r
            end -= gmax[gid]
            np.clip(end, 0.0, u_r, out=end)
            transfer[rows, :, sl] = end
    if not present.all():
        transfer[~present] = 0.0
    return transfer


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


def _levels(pred: np.ndarray, group: np.ndarray, spans: np.ndarray, *, where: str) -> tuple[tuple[Level, ...], int]:
    """Topological levels of groups (a group's level is 1 + the max level of its preds),
    and the live-buffer plan of the walk.  Returns (levels, buffer rows).

    Built with whole-graph array operations and split per level at the end: a Python
    loop per level costs more than the walk itself on small traces.
    """
    n_t = pred.shape[0]
    lv = _group_levels(pred, group, where=where)
    # within a level: singletons, then per group size k, member 0 of every group, member
    # 1 of every group, ... (see Level.group_blocks)
    size = np.bincount(group)[group]
    by_group = np.lexsort((np.arange(n_t), group))
    g_sorted = group[by_group]
    g_first = np.flatnonzero(np.r_[True, g_sorted[1:] != g_sorted[:-1]])
    member = np.empty(n_t, np.int64)
    member[by_group] = np.arange(n_t) - np.repeat(g_first, np.diff(np.r_[g_first, n_t]))
    order = np.lexsort((group, member, size, lv))
    lv_s = lv[order]
    new_level = np.r_[True, lv_s[1:] != lv_s[:-1]]
    lstart = np.flatnonzero(new_level)  # (L,) first position of each level
    lend = np.r_[lstart[1:], n_t]
    level_no = np.empty(n_t, np.int64)
    level_no[order] = np.cumsum(new_level) - 1

    # the walk keeps an op's end only until its last successor's level has read it;
    # ops nobody waits for (sinks) are only folded into the step time
    rows, cols = np.nonzero(pred != n_t)
    last_use = np.full(n_t, -1, np.int64)
    np.maximum.at(last_use, pred[rows, cols], level_no[rows])
    slot_of, block, n_slots = _assign_blocks(order, level_no, last_use, lstart, lend)
    slot_of = np.r_[slot_of, n_slots]  # the step's start: the buffer's last (all-zero) row

    n_pred = (pred != n_t).sum(axis=1)[order]
    k_level = np.maximum(np.maximum.reduceat(n_pred, lstart), 1)
    pred_s = pred[order]
    read_s = slot_of[pred_s]
    sink_s = last_use[order] < 0
    span_s = spans[order]
    size_s = size[order]
    seg = np.flatnonzero(new_level | np.r_[True, size_s[1:] != size_s[:-1]])
    seg_len = np.diff(np.r_[seg, n_t])
    blocks: list[list[tuple[int, int, int]]] = [[] for _ in lstart]
    for a, length in zip(seg.tolist(), seg_len.tolist()):
        k = int(size_s[a])
        if k > 1:
            i = int(level_no[order[a]])
            blocks[i].append((a - int(lstart[i]), length // k, k))

    out = []
    for i, (a, b) in enumerate(zip(lstart.tolist(), lend.tolist())):
        k = int(k_level[i])
        sp = np.flatnonzero(span_s[a:b])
        sinks = np.flatnonzero(sink_s[a:b])
        out.append(
            Level(
                ops=order[a:b],
                pred=pred_s[a:b, :k],
                spans=sp if sp.size else None,
                group_blocks=tuple(blocks[i]),
                read=read_s[a:b, :k],
                block=int(block[i]),
                sinks=sinks if sinks.size else None,
            )
        )
    return tuple(out), n_slots


def _assign_blocks(order, level_no, last_use, lstart, lend) -> tuple[np.ndarray, np.ndarray, int]:
    """Buffer rows for the walk: each level's ends go to one contiguous block (so they
    are written in place, not scattered), and a row is reused once its op is dead.

    An op's row is free for the block of level L when L >= its last reader's level (the
    walk reads all of a level's preds before it writes the level) or, for a sink, when
    L is past its own level.  First fit over the free rows.  Returns (row per op,
    first row of each level's block, buffer rows).
    """
    n_t, n_levels = order.size, lstart.size
    avail = np.where(last_use >= 0, last_use, level_no + 1)
    by_avail = np.argsort(avail, kind="stable")
    released = np.split(by_avail, np.searchsorted(avail[by_avail], np.arange(1, n_levels + 1)))
    slot = np.full(n_t, -1, np.int64)
    block = np.empty(n_levels, np.int64)
    used = np.zeros(0, bool)
    for i in range(n_levels):
        if released[i].size:
            used[slot[released[i]]] = False
        n = int(lend[i] - lstart[i])
        free = ~used
        cs = np.concatenate([[0], np.cumsum(free)])
        fits = np.flatnonzero(cs[n:] - cs[:-n] == n) if used.size >= n else np.zeros(0, np.int64)
        if fits.size:
            at = int(fits[0])
        else:  # append, reusing a free tail
            busy = np.flatnonzero(used)
            at = int(busy[-1]) + 1 if busy.size else 0
            used = np.concatenate([used, np.zeros(max(0, at + n - used.size), bool)])
        used[at : at + n] = True
        slot[order[lstart[i] : lend[i]]] = np.arange(at, at + n)
        block[i] = at
    return slot, block, int(used.size)


def _group_levels(pred: np.ndarray, group: np.ndarray, *, where: str) -> np.ndarray:
    """(n_t,) level of each op's group: the longest path from the step's start, in groups.

    Kahn's algorithm over the group graph (an edge per pred): a group is placed once
    all its preds are, at 1 + the max of theirs.  A group that is never placed (a cycle,
    or an op waiting on its own group) deadlocks.  Plain Python: the group graph has a
    few edges per template op, and a numpy pass per frontier costs more than a loop.
    """
    n_t = pred.shape[0]
    n_g = int(group.max()) + 1
    rows, cols = np.nonzero(pred != n_t)
    succ: list[list[int]] = [[] for _ in range(n_g)]
    indeg = [0] * n_g
    for s, d in zip(group[pred[rows, cols]].tolist(), group[rows].tolist()):
        succ[s].append(d)
        indeg[d] += 1
    level = [1] * n_g
    queue = [g for g in range(n_g) if indeg[g] == 0]
    for g in queue:  # grows while it is walked
        lg = level[g] + 1
        for h in succ[g]:
            if level[h] < lg:
                level[h] = lg
            indeg[h] -= 1
            if indeg[h] == 0:
                queue.append(h)
    if len(queue) < n_g:
        raise InputError(f"{where}: the ops' order deadlocks (a cycle through p2p or collective groups)")
    return np.asarray(level, np.int64)[group]
