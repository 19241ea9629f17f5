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
from typing import NamedTuple

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

    The stages: the trace's usable rows (:func:`_usable_rows`), irregular GC pauses set
    apart (:func:`_split_gc_events`), each row's template op (:func:`_template_keys`),
    the dense (op, DP rank, step) tensors (:func:`_dense_cells`), the ops and steps kept
    (:func:`_whole_steps`), the step-start ops and the order on each worker
    (:func:`_ordered_with_step_starts`), the cross-rank groups (:func:`_groups`), then the
    transfer times, the predecessors and the levels the simulator walks.
    """
    where = trace.path or "trace"
    P = trace.meta.pp
    # The (n_t, D, N) tensors are ~50 MB each on a 6M-op trace, and each stage supersedes
    # its input's: a stage's input is a temporary or a name the stage's result rebinds,
    # so that a superseded tensor is freed as soon as the next stage has read it.
    template, steps, gc_events, notes = _whole_steps(_observe(trace, where=where), num_stages=P, where=where)
    template = _ordered_with_step_starts(template, num_stages=P)
    group, group_spans = _groups(template, num_stages=P, where=where)
    is_comm = ~np.isin(template.code, list(COMPUTE_CODES | {GC_CODE, STEP_START_CODE}))
    transfer = _transfer(template.start, template.duration, template.present, group, group_spans, is_comm)
    pred = _chain_preds(template)
    levels, buffer_rows = _levels(pred, group, group_spans[group], where=where)
    return Model(
        dp=trace.meta.dp,
        pp=P,
        steps=steps.numbers,
        t_pp=template.pp,
        t_optype=template.code,
        t_occ=template.occ,
        t_is_comm=is_comm,
        start=template.start,
        duration=template.duration,
        transfer=transfer,
        present=template.present,
        pred=pred,
        group=group,
        levels=levels,
        buffer_rows=buffer_rows,
        real_step_time=steps.time,
        dropped=notes,
        gc_events=gc_events,
    )


class _Rows(NamedTuple):
    """The op rows the model reads, one entry per row, in the trace's (narrow) dtypes:
    widened only where a key needs it."""

    step_idx: np.ndarray  # (n,) index of the row's step among the trace's step numbers
    dp: np.ndarray  # (n,) DP rank
    pp: np.ndarray  # (n,) PP rank
    code: np.ndarray  # (n,) op-type code (into OPTYPES)
    start: np.ndarray  # (n,) seconds, on the trace's clock
    duration: np.ndarray  # (n,) seconds

    def take(self, keep: np.ndarray) -> _Rows:
        return _Rows(*(column[keep] for column in self))


class _Observed(NamedTuple):
    """The trace's usable rows laid out as dense (template op, DP rank, step) cells,
    over every step of the trace (D DP ranks, N_all steps)."""

    keys: np.ndarray  # (n_t,) int64 template keys, sorted (see _template_keys)
    max_occ: int  # radix of the occurrence in the keys
    start: np.ndarray  # (n_t, D, N_all) start, seconds from the step's first start
    duration: np.ndarray  # (n_t, D, N_all) traced duration (0 where no row)
    traced: np.ndarray  # (n_t, D, N_all) bool: a row fills the cell
    step_numbers: np.ndarray  # (N_all,) int64, sorted
    step_time: np.ndarray  # (N_all,) traced step time (last end - first start)
    damaged_step: np.ndarray  # (N_all,) bool: the step has a damaged row
    gc_events: np.ndarray  # (n_gc,) durations of irregular GC pauses
    notes: tuple[str, ...]  # what was dropped so far, and why


class _Template(NamedTuple):
    """Template ops and their (op, DP rank, step) cells over the kept steps."""

    pp: np.ndarray  # (n_t,) int64 PP rank
    code: np.ndarray  # (n_t,) int64 op-type code, or STEP_START_CODE
    occ: np.ndarray  # (n_t,) int64 occurrence (see the module doc)
    start: np.ndarray  # (n_t, D, N) start, seconds from the step's first start
    duration: np.ndarray  # (n_t, D, N) traced duration (0 where absent)
    present: np.ndarray  # (n_t, D) bool: the op exists on that DP rank


class _Steps(NamedTuple):
    """The kept steps."""

    numbers: np.ndarray  # (N,) int64 step numbers
    time: np.ndarray  # (N,) traced step time (last end - first start)


class _Kept(NamedTuple):
    """What :func:`_whole_steps` keeps of an observed trace."""

    template: _Template
    steps: _Steps
    gc_events: np.ndarray
    notes: tuple[str, ...]


def _observe(trace: Trace, *, where: str) -> _Observed:
    """Dense cells of ``trace``'s usable rows (the per-row arrays die with this call)."""
    D, P = trace.meta.dp, trace.meta.pp
    rows, step_numbers, damaged_step, damage_note = _usable_rows(trace, where=where)
    num_steps = step_numbers.size
    rows, gc_events, gc_note = _split_gc_events(rows, D=D, P=P, num_steps=num_steps)
    if rows.step_idx.size == 0:
        raise InputError(f"{where}: no usable op row: every row is damaged (NaN or negative times, "
                         f"ranks outside dp < {D}, pp < {P}) or an irregular GC pause")
    keys, max_occ, cell = _template_keys(rows, D=D, P=P, num_steps=num_steps)
    start, duration, traced, step_time = _dense_cells(rows, cell, shape=(keys.size, D, num_steps))
    notes = (*trace.dropped, *(note for note in (damage_note, gc_note) if note))
    return _Observed(keys, max_occ, start, duration, traced, step_numbers, step_time, damaged_step,
                     gc_events, notes)


def _usable_rows(trace: Trace, *, where: str) -> tuple[_Rows, np.ndarray, np.ndarray, str | None]:
    """The trace's rows minus damaged ones (NaN or negative times, ranks out of range).

    Returns (rows, every step number of the trace (N_all,) int64, the steps that had a
    damaged row (N_all,) bool, a note when rows were dropped).  The damaged rows go now,
    so that they cannot poison the layout; their steps are dropped later.
    """
    D, P = trace.meta.dp, trace.meta.pp
    ops = trace.ops
    if ops["step"].size == 0:
        raise InputError(f"{where}: the trace has no ops")
    dp, pp, start, duration = ops["dp_rank"], ops["pp_rank"], ops["start"], ops["duration"]
    damaged = (~np.isfinite(start) | ~np.isfinite(duration) | (duration < 0)
               | (dp < 0) | (dp >= D) | (pp < 0) | (pp >= P))
    step_numbers, step_idx = _dense_unique(ops["step"])
    step_numbers = step_numbers.astype(np.int64)
    rows = _Rows(step_idx, dp, pp, ops["optype"], start, duration)
    damaged_step = np.zeros(step_numbers.size, bool)
    if not damaged.any():
        return rows, step_numbers, damaged_step, None
    damaged_step[np.unique(step_idx[damaged])] = True
    note = (f"{int(damaged.sum())} op rows with NaN/negative times or ranks out of range "
            f"(dp < {D}, pp < {P}); their steps are dropped")
    return rows.take(~damaged), step_numbers, damaged_step, note


def _split_gc_events(rows: _Rows, *, D: int, P: int, num_steps: int) -> tuple[_Rows, np.ndarray, str | None]:
    """Set irregular GC pauses apart from the ops: (rows, (n_gc,) pause durations, note).

    Automatic Python GC pauses (gc.callbacks) come at irregular steps and ranks, and
    inside other ops' spans, unlike the study's planned GC at a fixed place in every
    step. As template ops they would make every step with a pause "mismatched": keep
    them as events beside the model instead (their time is already in the ops around).
    GC rows that recur the same number of times in every worker-step stay ops.
    """
    no_events = np.zeros(0)
    is_gc = rows.code == GC_CODE
    if not is_gc.any():
        return rows, no_events, None
    worker_step = (rows.step_idx.astype(np.int64) * D + rows.dp) * P + rows.pp
    pauses = np.bincount(worker_step[is_gc], minlength=num_steps * D * P)  # per worker-step
    if pauses.min() == pauses.max():
        return rows, no_events, None
    note = (f"{int(is_gc.sum())} irregular GC pauses (automatic Python GC) "
            "kept as events, not as ops of the step")
    return rows.take(~is_gc), rows.duration[is_gc].astype(np.float64), note


def _template_keys(rows: _Rows, *, D: int, P: int, num_steps: int) -> tuple[np.ndarray, int, np.ndarray]:
    """The template ops and each row's cell.

    A template op is keyed (pp_rank, optype, occurrence), encoded as
    ``(pp * len(OPTYPES) + code) * max_occ + occ``.  Returns (the sorted keys (n_t,)
    int64, max_occ, each row's flat index into the (n_t, D, num_steps) cells).
    """
    row_keys, max_occ = _row_template_keys(rows, D=D, P=P, num_steps=num_steps)
    keys, template_of_row = _dense_unique(row_keys)
    # (template op, dp, step) is unique per row: the occurrence numbers a worker-step's
    # ops of one type, so each cell gets at most one row
    cell = (template_of_row.astype(np.int64) * D + rows.dp) * num_steps + rows.step_idx
    return keys.astype(np.int64), max_occ, cell


def _row_template_keys(rows: _Rows, *, D: int, P: int, num_steps: int) -> tuple[np.ndarray, int]:
    """(n,) template key of each row (see :func:`_template_keys`), and max_occ."""
    occ = _occurrence(rows.step_idx, rows.dp, rows.pp, rows.code, rows.start, D=D, P=P, N=num_steps)
    max_occ = int(occ.max()) + 1
    key_dtype = np.int32 if P * len(OPTYPES) * max_occ < np.iinfo(np.int32).max else np.int64
    return (rows.pp.astype(key_dtype) * len(OPTYPES) + rows.code) * max_occ + occ, max_occ


def _dense_cells(rows: _Rows, cell: np.ndarray, *, shape: tuple[int, int, int]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Scatter the rows into (n_t, D, N_all) cells: (start from the step's origin,
    duration, traced mask), and each step's traced time (N_all,)."""
    num_steps = shape[2]
    # per-step origin: the earliest start of the step (the study's traces are already 0)
    step_first = np.full(num_steps, np.inf)
    np.minimum.at(step_first, rows.step_idx, rows.start)
    rel_start = rows.start - step_first[rows.step_idx]
    step_time = np.full(num_steps, -np.inf)
    np.maximum.at(step_time, rows.step_idx, rel_start + rows.duration)
    start = np.zeros(shape)
    duration = np.zeros(shape)
    traced = np.zeros(shape, bool)
    start.reshape(-1)[cell] = rel_start
    duration.reshape(-1)[cell] = rows.duration
    traced.reshape(-1)[cell] = True
    return start, duration, traced, step_time


def _whole_steps(observed: _Observed, *, num_stages: int, where: str) -> _Kept:
    """The template ops of the job's usual program, and the steps that run it whole.

    The usual program is the set of (op, DP rank) most undamaged steps run, the
    earliest of equals (the job's own micro-batch split before a plan changed it); a
    step whose ops differ from it (truncated, an unmatched p2p, another split) is
    dropped, like a step with a damaged row. An op expected wherever half the steps
    had it mixed two programs when a plan split the traced steps evenly (the demo: 11
    steps on 8,8 and 11 on S2's 10,6 gave replica 0 the ops of 10 micro-batches and
    replica 1 those of 8, a program no step ran, and no post-mortem).
    """
    traced, D = observed.traced, observed.traced.shape[1]
    notes = observed.notes
    usable = ~observed.damaged_step
    expected = np.zeros(traced.shape[:2], bool)  # (n_t, D)
    if usable.any():
        programs, first, counts = np.unique(traced[:, :, usable].reshape(-1, int(usable.sum())).T, axis=0,
                                            return_index=True, return_counts=True)
        expected = programs[np.lexsort((first, -counts))[0]].reshape(traced.shape[:2])
    mismatch = (traced != expected[:, :, None]).any(axis=(0, 1))
    # a damaged step misses its damaged rows: it is already in the damaged-rows note
    mismatched = mismatch & usable
    if mismatched.any():
        notes += (f"{int(mismatched.sum())} step(s) with missing or extra ops (truncated, unmatched, "
                  f"or another micro-batch split) dropped: steps {_fmt_list(observed.step_numbers[mismatched])}",)
    keep_steps = usable & ~mismatch
    if not keep_steps.any():
        raise InputError(f"{where}: no whole step in the trace (every step has missing or damaged ops)")
    keep_ops = expected.any(axis=1)
    start, duration = observed.start, observed.duration
    if not (keep_ops.all() and keep_steps.all()):
        cells = np.ix_(keep_ops, np.ones(D, bool), keep_steps)
        start, duration = start[cells], duration[cells]
    keys, radix = observed.keys[keep_ops], len(OPTYPES)
    occ = keys % observed.max_occ
    code = (keys // observed.max_occ) % radix
    pp = keys // observed.max_occ // radix
    empty = np.setdiff1d(np.arange(num_stages), pp)
    if empty.size:
        raise InputError(
            f"{where}: pipeline stage(s) {_fmt_list(empty)} have no op that recurs in most steps; "
            f"every stage of the job's pp={num_stages} needs its ops in the trace"
        )
    steps = _Steps(observed.step_numbers[keep_steps], observed.step_time[keep_steps])
    template = _Template(pp, code, occ, start, duration, expected[keep_ops])
    return _Kept(template, steps, observed.gc_events, notes)


def _ordered_with_step_starts(template: _Template, *, num_stages: int) -> _Template:
    """The template with one step-start op per stage (its work the worker's first start
    in the step; see the module doc), ops ordered on each worker by mean start over their
    present instances (ties by op code), the step-start op first."""
    P, n_t = num_stages, template.pp.size
    D, N = template.present.shape[1], template.start.shape[2]
    first_start = np.stack([
        np.where(template.present[on_stage][:, :, None], template.start[on_stage], np.inf).min(axis=0)
        for on_stage in (template.pp == p for p in range(P))
    ])  # (P, D, N)
    first_start[~np.isfinite(first_start)] = 0.0  # a stage with no op on a DP rank (never in practice)
    pp = np.concatenate([template.pp, np.arange(P)])
    code = np.concatenate([template.code, np.full(P, STEP_START_CODE)])
    occ = np.concatenate([template.occ, np.zeros(P, template.occ.dtype)])
    present = np.concatenate([template.present, np.ones((P, D), bool)])
    # start * present is start itself when every op is present (x * 1.0 == x): skip the copy
    weighted = template.start if template.present.all() else template.start * template.present[:, :, None]
    instances = np.maximum(template.present.sum(axis=1) * N, 1)
    replica_sum = weighted.sum(axis=2)  # (n_t, D)
    mean_start = np.concatenate([replica_sum.sum(axis=1) / instances, np.full(P, -1.0)])
    order = np.lexsort((occ, code, mean_start, pp))
    # each DP replica's own order: its mean start over its instances
    replica_start = np.concatenate([replica_sum / N, np.full((P, D), -1.0)])
    order = _consistent_order(order, pp, code, occ, replica_start, present)
    # gather the ordered tensors straight from the template's and the step-start ops'
    # rows: one copy of each (n_t, D, N) tensor, not a concatenation and then a permutation
    is_step_start = order >= n_t
    source = np.where(is_step_start, 0, order)
    start = template.start[source]
    start[is_step_start] = 0.0
    duration = template.duration[source]
    duration[is_step_start] = first_start[order[is_step_start] - n_t]
    return _Template(pp[order], code[order], occ[order], start, duration, present[order])


def _consistent_order(order: np.ndarray, pp: np.ndarray, code: np.ndarray, occ: np.ndarray,
                      replica_start: np.ndarray, present: np.ndarray) -> np.ndarray:
    """``order`` (by stage, then mean start over every replica), changed where needed so
    that on each stage it keeps every DP replica's own order of its ops.

    Replicas that run different micro-batch counts (a re-split such as greyhound's S2
    plan: 14 and 2 micro-batches) run different 1F1B schedules: a replica's first
    backward comes after 3 forwards on one and after 2 on the other, and the mean start
    over both can put it before a forward that it follows on the first, which turns the
    stage's chain into a cycle through the p2p groups.  Such a stage is ordered by a
    topological merge of the replicas' orders (ties by mean start); one that has no such
    merge (the replicas truly disagree) keeps the mean-start order.
    """
    D = present.shape[1]
    stage = pp[order]
    bounds = np.flatnonzero(np.diff(stage)) + 1
    out = []
    for ops in np.split(order, bounds):
        consistent = True
        for d in range(D):
            mine = replica_start[ops[present[ops, d]], d]
            if (np.diff(mine) < 0).any():
                consistent = False
                break
        out.append(ops if consistent else _merged_order(ops, code, occ, replica_start, present))
    return np.concatenate(out) if out else order


def _merged_order(ops: np.ndarray, code: np.ndarray, occ: np.ndarray, replica_start: np.ndarray,
                  present: np.ndarray) -> np.ndarray:
    """A topological merge of the replicas' orders of one stage's ``ops`` (given in mean
    start order, which breaks ties); ``ops`` unchanged when the orders conflict."""
    import heapq

    rank_of = {int(op): i for i, op in enumerate(ops)}
    succ: list[list[int]] = [[] for _ in ops]
    indeg = [0] * len(ops)
    for d in range(present.shape[1]):
        mine = ops[present[ops, d]]
        mine = mine[np.lexsort((occ[mine], code[mine], replica_start[mine, d]))]
        for a, b in zip(mine[:-1].tolist(), mine[1:].tolist()):
            succ[rank_of[a]].append(rank_of[b])
            indeg[rank_of[b]] += 1
    ready = [i for i, n in enumerate(indeg) if n == 0]
    heapq.heapify(ready)
    merged = []
    while ready:
        i = heapq.heappop(ready)
        merged.append(i)
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                heapq.heappush(ready, j)
    return ops[merged] if len(merged) == len(ops) else ops


def _groups(template: _Template, *, num_stages: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """The cross-rank groups of the template (see the module doc).

    Returns ((n_t,) group of each op, numbered 0 .. n_groups - 1, (n_groups,) bool: the
    group reduces over DP ranks too).  InputError for a p2p op whose peer is
    on no stage.
    """
    pp, code, occ = template.pp, template.code, template.occ
    n_t = pp.size
    op_at = {
        (int(stage), int(op_code), int(occurrence)): i
        for i, (stage, op_code, occurrence) in enumerate(zip(pp, code, occ))
    }
    group = np.arange(n_t)
    op_spans = np.zeros(n_t, bool)  # the op's group reduces over DP ranks
    for i in range(n_t):  # template size, not op count: O(PP x ops per stage)
        op_code = int(code[i])
        if op_code in P2P_PEER:
            recv_code, offset = P2P_PEER[op_code]
            peer = op_at.get((int(pp[i]) + offset, recv_code, int(occ[i])))
            if peer is None:
                raise InputError(
                    f"{where}: unmatched p2p: {OPTYPES[op_code]} #{int(occ[i])} of stage {int(pp[i])} "
                    f"has no {OPTYPES[recv_code]} on stage {int(pp[i]) + offset}"
                )
            group[peer] = group[i]
        elif op_code in DP_GROUP_CODES:
            op_spans[i] = True
        elif op_code == _C["embedding-grads-all-reduce"] and pp[i] == num_stages - 1 and num_stages > 1:
            first_stage_op = op_at.get((0, op_code, int(occ[i])))
            if first_stage_op is not None:
                group[i] = group[first_stage_op]
        elif op_code == _C["optimizer-clip-main-grad"]:
            first_stage_op = op_at.get((0, op_code, int(occ[i])))
            group[i] = group[first_stage_op] if first_stage_op is not None else i
            op_spans[i] = True
    # a send joins its receive's group above: a receive still alone has no send
    for i in range(n_t):
        if code[i] in (_C["forward-recv"], _C["backward-recv"]) and group[i] == i:
            raise InputError(
                f"{where}: unmatched p2p: {OPTYPES[int(code[i])]} #{int(occ[i])} of stage {int(pp[i])} "
                "has no matching send"
            )
    _, group = np.unique(group, return_inverse=True)
    group_spans = np.zeros(group.max() + 1, bool)
    np.logical_or.at(group_spans, group, op_spans)
    return group, group_spans


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
    order, index_in_run = _sorted_runs(step_idx, dp, pp, code, start, D=D, P=P, N=N)
    occ = np.empty_like(index_in_run)
    occ[order] = index_in_run
    return occ


def _sorted_runs(step_idx, dp, pp, code, start, *, D: int, P: int, N: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows in (step, dp, pp, optype, start) order: (the order (n,), each sorted
    row's index within its (step, dp, pp, optype) run (n,)).

    Each helper's temporaries (sorted keys and starts, run marks and ids) are as large
    as the rows, millions on a large trace: they die when the helper returns.
    """
    order, run_start = _start_order(step_idx, dp, pp, code, start, D=D, P=P, N=N)
    return order, _index_in_run(run_start)


def _start_order(step_idx, dp, pp, code, start, *, D: int, P: int, N: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows sorted by (step, dp, pp, optype), then start: (the order (n,), (n,) bool:
    the sorted row begins a new (step, dp, pp, optype) run)."""
    n_codes = len(OPTYPES)
    key_max = N * D * P * n_codes
    key_dtype = np.int32 if key_max < np.iinfo(np.int32).max else np.int64
    worker_key = ((step_idx.astype(key_dtype) * D + dp.astype(key_dtype)) * P
                  + pp.astype(key_dtype)) * n_codes + code.astype(key_dtype)
    order = np.argsort(worker_key, kind="stable")
    sorted_key = worker_key[order]
    sorted_start = start[order]
    run_start = np.empty(sorted_key.size, bool)
    run_start[0] = True
    np.not_equal(sorted_key[1:], sorted_key[:-1], out=run_start[1:])
    if not (run_start[1:] | (sorted_start[1:] >= sorted_start[:-1])).all():
        order = np.lexsort((start, worker_key))
        sorted_key = worker_key[order]
        np.not_equal(sorted_key[1:], sorted_key[:-1], out=run_start[1:])
    return order, run_start


def _index_in_run(run_start: np.ndarray) -> np.ndarray:
    """(n,) each sorted row's index within its run (``run_start`` marks each run's first row),
    on the smallest integer dtype that holds it."""
    first = np.flatnonzero(run_start)
    index_dtype = np.int32 if run_start.size < np.iinfo(np.int32).max else np.int64
    run_id = np.cumsum(run_start, dtype=index_dtype) - 1
    return np.arange(run_start.size, dtype=index_dtype) - first.astype(index_dtype)[run_id]


_TRANSFER_CHUNK_CELLS = 1 << 21  # cells per temporary of the transfer pass (16 MB)


def _transfer(start, duration, present, group, group_spans, is_comm) -> np.ndarray:
    """(n_t, D, N) work of each op: its duration, or for communication its end minus the
    latest start among its group (over DP ranks too for DP groups), clipped to
    [0, duration]; 0 where the op is absent.

    Only communication rows are touched, group by group and a few steps at a time, so
    the temporaries stay small (fresh memory is what a large trace pays for).
    """
    transfer = duration.copy()
    comm = np.flatnonzero(is_comm)
    if comm.size:
        # the communication ops sorted by group: each group is one run of rows
        rows = comm[np.argsort(group[comm], kind="stable")]
        row_group = group[rows]
        group_first = np.flatnonzero(np.r_[True, row_group[1:] != row_group[:-1]])
        group_size = np.diff(np.r_[group_first, row_group.size])
        group_last = group_first + group_size - 1
        group_of_row = np.repeat(np.arange(group_first.size), group_size)
        spans_dp = group_spans[row_group[group_first]]
        any_spans_dp = bool(spans_dp.any())
        row_present = present[rows][:, :, None]  # (n_c, D, 1)
        all_present = bool(row_present.all())
        D, N = start.shape[1], start.shape[2]
        chunk = max(1, _TRANSFER_CHUNK_CELLS // max(rows.size * D, 1))
        for n0 in range(0, N, chunk):
            steps = slice(n0, min(N, n0 + chunk))
            row_start, row_duration = start[rows, :, steps], duration[rows, :, steps]
            # an absent op's start must not count towards its group's latest start
            counted_start = row_start if all_present else np.where(row_present, row_start, -np.inf)
            latest_start = counted_start[group_first]
            for member in range(1, int(group_size.max())):
                np.maximum(latest_start, counted_start[np.minimum(group_first + member, group_last)],
                           out=latest_start)
            if any_spans_dp:
                latest_start[spans_dp] = latest_start[spans_dp].max(axis=1, keepdims=True)
            end = row_start + row_duration
            end -= latest_start[group_of_row]
            np.clip(end, 0.0, row_duration, out=end)
            transfer[rows, :, steps] = end
    if not present.all():
        transfer[~present] = 0.0
    return transfer


def _fmt_list(values, limit: int = 10) -> str:
    vals = [str(int(v)) for v in values[:limit]]
    return ", ".join(vals) + (f" ... ({len(values)} in all)" if len(values) > limit else "")


def _chain_preds(template: _Template) -> np.ndarray:
    """Padded predecessor lists (n_t, K), K the most predecessors of any op; the sentinel
    n_t means 'the step's start'."""
    t_pp, t_code, start, present = template.pp, template.code, template.start, template.present
    n_t, num_steps = t_pp.size, start.shape[2]
    # fused slots: consecutive p2p ops on one worker that start together in most instances
    same_pp = np.zeros(n_t, bool)
    same_pp[1:] = t_pp[1:] == t_pp[:-1]
    both_p2p = np.zeros(n_t, bool)
    is_p2p = np.isin(t_code, list(P2P_CODES))
    both_p2p[1:] = is_p2p[1:] & is_p2p[:-1]
    fused = np.zeros(n_t, bool)  # fused[i]: op i is in the same slot as op i-1
    candidates = np.flatnonzero(same_pp & both_p2p)
    if candidates.size:
        both_present = (present[candidates] & present[candidates - 1])[:, :, None]  # (n_cand, D, 1)
        close = (np.abs(start[candidates] - start[candidates - 1]) <= FUSE_TOLERANCE_S) & both_present
        fused[candidates] = (close.sum(axis=(1, 2)) * 2
                             >= np.maximum(both_present.sum(axis=(1, 2)) * num_steps, 1))
    preds: list[list[int]] = [[] for _ in range(n_t)]
    i = 0
    while i < n_t:
        stage = t_pp[i]
        prev_slot: list[int] = []
        pending_async: list[int] = []
        last_dp_async: int | None = None
        while i < n_t and t_pp[i] == stage:
            slot = [i]
            while i + 1 < n_t and fused[i + 1]:
                i += 1
                slot.append(i)
            for j in slot:
                op_code = int(t_code[j])
                extra = []
                if op_code in DP_GROUP_CODES and last_dp_async is not None:
                    extra.append(last_dp_async)
                if op_code in SYNC_POINT_CODES:
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
    # not max(1, *lengths) (ruff's PLW3301): flattened, no preds would raise TypeError
    max_preds = max(1, max(len(op_preds) for op_preds in preds))  # noqa: PLW3301
    pred = np.full((n_t, max_preds), n_t, dtype=np.int64)
    for j, op_preds in enumerate(preds):
        pred[j, : len(op_preds)] = op_preds
    return pred


def _levels(pred: np.ndarray, group: np.ndarray, spans: np.ndarray, *, where: str) -> tuple[tuple[Level, ...], int]:
    """Topological levels of groups (a group's level is 1 + the max level of its preds),
    and the live-buffer plan of the walk.  Returns (levels, buffer rows).

    Built with whole-graph array operations and split per level at the end: a Python
    loop per level costs more than the walk itself on small traces.
    """
    n_t = pred.shape[0]
    group_level = _group_levels(pred, group, where=where)
    # within a level: singletons, then per group size, member 0 of every group, member
    # 1 of every group, ... (see Level.group_blocks)
    group_size = np.bincount(group)[group]  # (n_t,) member count of each op's group
    by_group = np.lexsort((np.arange(n_t), group))
    sorted_groups = group[by_group]
    # (n_groups,) position in by_group of each group's first member
    group_first = np.flatnonzero(np.r_[True, sorted_groups[1:] != sorted_groups[:-1]])
    member = np.empty(n_t, np.int64)  # (n_t,) the op's index among its group's members
    member[by_group] = np.arange(n_t) - np.repeat(group_first, np.diff(np.r_[group_first, n_t]))
    order = np.lexsort((group, member, group_size, group_level))  # the walk order
    level_in_order = group_level[order]
    new_level = np.r_[True, level_in_order[1:] != level_in_order[:-1]]
    level_start = np.flatnonzero(new_level)  # (L,) first position of each level
    level_end = np.r_[level_start[1:], n_t]
    level_no = np.empty(n_t, np.int64)
    level_no[order] = np.cumsum(new_level) - 1

    # the walk keeps an op's end only until its last successor's level has read it;
    # ops nobody waits for (sinks) are only folded into the step time
    rows, cols = np.nonzero(pred != n_t)
    last_use = np.full(n_t, -1, np.int64)
    np.maximum.at(last_use, pred[rows, cols], level_no[rows])
    buffer_row, block, buffer_rows = _assign_blocks(order, level_no, last_use, level_start, level_end)
    buffer_row = np.r_[buffer_row, buffer_rows]  # the step's start: the buffer's last (all-zero) row

    pred_count_in_order = (pred != n_t).sum(axis=1)[order]
    # each level's pred width: its ops' max pred count (at least 1 column)
    level_width = np.maximum(np.maximum.reduceat(pred_count_in_order, level_start), 1)
    pred_in_order = pred[order]
    read_in_order = buffer_row[pred_in_order]
    is_sink_in_order = last_use[order] < 0
    spans_in_order = spans[order]
    group_size_in_order = group_size[order]
    # runs of one group size within a level: a run of groups of k > 1 members is k blocks
    run_start = np.flatnonzero(new_level | np.r_[True, group_size_in_order[1:] != group_size_in_order[:-1]])
    run_length = np.diff(np.r_[run_start, n_t])
    group_blocks: list[list[tuple[int, int, int]]] = [[] for _ in level_start]
    for first, length in zip(run_start.tolist(), run_length.tolist()):
        run_group_size = int(group_size_in_order[first])
        if run_group_size > 1:
            level = int(level_no[order[first]])
            group_blocks[level].append((first - int(level_start[level]), length // run_group_size, run_group_size))

    levels = []
    for level, (first, end) in enumerate(zip(level_start.tolist(), level_end.tolist())):
        width = int(level_width[level])
        span_positions = np.flatnonzero(spans_in_order[first:end])
        sink_positions = np.flatnonzero(is_sink_in_order[first:end])
        levels.append(
            Level(
                ops=order[first:end],
                pred=pred_in_order[first:end, :width],
                spans=span_positions if span_positions.size else None,
                group_blocks=tuple(group_blocks[level]),
                read=read_in_order[first:end, :width],
                block=int(block[level]),
                sinks=sink_positions if sink_positions.size else None,
            )
        )
    return tuple(levels), buffer_rows


def _assign_blocks(
    order: np.ndarray, level_no: np.ndarray, last_use: np.ndarray, level_start: np.ndarray, level_end: np.ndarray
) -> tuple[np.ndarray, np.ndarray, int]:
    """Buffer rows for the walk: each level's ends go to one contiguous block (so they
    are written in place, not scattered), and a row is reused once its op is dead.

    An op's row is free for the block of level L when L >= its last reader's level (the
    walk reads all of a level's preds before it writes the level) or, for a sink, when
    L is past its own level.  First fit over the free rows.  Returns (row per op,
    first row of each level's block, buffer rows).
    """
    n_t, n_levels = order.size, level_start.size
    free_from = np.where(last_use >= 0, last_use, level_no + 1)  # first level that may reuse the op's row
    by_free_from = np.argsort(free_from, kind="stable")
    # released[level]: the ops whose rows become free for that level's block
    released = np.split(by_free_from, np.searchsorted(free_from[by_free_from], np.arange(1, n_levels + 1)))
    row_of_op = np.full(n_t, -1, np.int64)
    block = np.empty(n_levels, np.int64)
    used = np.zeros(0, bool)  # per buffer row: it holds a live op's end
    for level in range(n_levels):
        if released[level].size:
            used[row_of_op[released[level]]] = False
        block_size = int(level_end[level] - level_start[level])
        free = ~used
        # free_prefix[r]: free rows before row r, so that rows r .. r + n - 1 are all free
        # when free_prefix[r + n] - free_prefix[r] == n: one vectorised test for every r
        free_prefix = np.concatenate([[0], np.cumsum(free)])
        fits = (
            np.flatnonzero(free_prefix[block_size:] - free_prefix[:-block_size] == block_size)
            if used.size >= block_size
            else np.zeros(0, np.int64)
        )
        if fits.size:
            first_row = int(fits[0])
        else:  # append, reusing a free tail
            busy = np.flatnonzero(used)
            first_row = int(busy[-1]) + 1 if busy.size else 0
            used = np.concatenate([used, np.zeros(max(0, first_row + block_size - used.size), bool)])
        used[first_row : first_row + block_size] = True
        row_of_op[order[level_start[level] : level_end[level]]] = np.arange(first_row, first_row + block_size)
        block[level] = first_row
    return row_of_op, block, int(used.size)


def _group_levels(pred: np.ndarray, group: np.ndarray, *, where: str) -> np.ndarray:
    """(n_t,) level of each op's group: the longest path from the step's start, in groups.

    Kahn's algorithm over the group graph (an edge per pred): a group is placed once
    all its preds are, at 1 + the max of theirs.  A group that is never placed (a cycle,
    or an op waiting on its own group) deadlocks.  Plain Python: the group graph has a
    few edges per template op, and a numpy pass per frontier costs more than a loop.
    """
    n_t = pred.shape[0]
    num_groups = int(group.max()) + 1
    rows, cols = np.nonzero(pred != n_t)
    succ: list[list[int]] = [[] for _ in range(num_groups)]
    indeg = [0] * num_groups
    # an edge from the group of each pred to the group of the op waiting for it
    for pred_group, op_group in zip(group[pred[rows, cols]].tolist(), group[rows].tolist()):
        succ[pred_group].append(op_group)
        indeg[op_group] += 1
    level = [1] * num_groups
    queue = [g for g in range(num_groups) if indeg[g] == 0]
    for placed in queue:  # grows while it is walked
        next_level = level[placed] + 1
        for succ_group in succ[placed]:
            if level[succ_group] < next_level:
                level[succ_group] = next_level
            indeg[succ_group] -= 1
            if indeg[succ_group] == 0:
                queue.append(succ_group)
    if len(queue) < num_groups:
        raise InputError(f"{where}: the ops' order deadlocks (a cycle through p2p or collective groups)")
    return np.asarray(level, np.int64)[group]
