"""The dependency model on tiny hand-made traces: exact answers for each stage of
``build_model`` (rows kept, GC events, template ops and their order, step-start ops,
groups, transfer times, predecessors, steps dropped and why)."""

import numpy as np
import pytest

from greyhound.errors import InputError
from postmortem.model import STEP_START_CODE, build_model, optype_label
from postmortem.schema import OPTYPE_CODE, Trace, TraceMeta

# one micro-batch through two stages, one DP replica: (pp_rank, optype, start, duration)
# within a step; stage 1 starts its step 0.5 s after stage 0
TWO_STAGES = [
    (0, "forward-compute", 0.0, 1.0),
    (0, "forward-send", 1.0, 0.25),
    (0, "backward-recv", 1.5, 2.0),
    (0, "backward-compute", 3.5, 2.0),
    (0, "optimizer", 6.0, 0.5),
    (1, "forward-recv", 0.5, 0.75),
    (1, "forward-compute", 1.25, 1.0),
    (1, "backward-compute", 2.25, 1.0),
    (1, "backward-send", 3.25, 0.25),
    (1, "optimizer", 4.0, 0.5),
]


def _trace(rows_per_step: list[list[tuple]], *, dp: int = 1, pp: int = 2, step_s: float = 10.0) -> Trace:
    """A trace of the given (pp_rank, optype, start, duration[, dp_rank]) rows per step,
    each step ``step_s`` after the previous one on the trace's clock."""
    cols: dict[str, list] = {k: [] for k in ("step", "microbatch", "pp_rank", "dp_rank", "chunk", "optype",
                                             "start", "duration")}
    for step, rows in enumerate(rows_per_step):
        for row in rows:
            p, name, start, duration = row[:4]
            cols["step"].append(step)
            cols["microbatch"].append(0)
            cols["pp_rank"].append(p)
            cols["dp_rank"].append(row[4] if len(row) > 4 else 0)
            cols["chunk"].append(0)
            cols["optype"].append(OPTYPE_CODE[name])
            cols["start"].append(100.0 + step * step_s + start)
            cols["duration"].append(duration)
    dtypes = {"step": np.int32, "microbatch": np.int32, "pp_rank": np.int16, "dp_rank": np.int16,
              "chunk": np.int16, "optype": np.int8, "start": np.float64, "duration": np.float64}
    ops = {k: np.asarray(v, dtypes[k]) for k, v in cols.items()}
    workers = {"rank": np.arange(dp * pp, dtype=np.int32),
               "dp_rank": np.repeat(np.arange(dp), pp).astype(np.int16),
               "pp_rank": np.tile(np.arange(pp), dp).astype(np.int16),
               "node": np.asarray(["n1"] * (dp * pp)), "device": np.asarray(["cpu"] * (dp * pp))}
    return Trace(meta=TraceMeta(dp=dp, pp=pp, num_microbatches=dp), ops=ops, workers=workers, path="tiny")


def _names(model, p: int) -> list[str]:
    return [optype_label(c) for c in model.t_optype[model.t_pp == p]]


def test_template_order_step_starts_groups_and_transfer():
    m = build_model(_trace([TWO_STAGES, TWO_STAGES]))
    assert m.steps.tolist() == [0, 1] and m.dropped == ()
    # each stage's ops in start order, after its step-start op
    assert _names(m, 0) == ["step-start", "forward-compute", "forward-send", "backward-recv", "backward-compute",
                            "optimizer"]
    assert _names(m, 1) == ["step-start", "forward-recv", "forward-compute", "backward-compute", "backward-send",
                            "optimizer"]
    # the step-start op's work is the worker's first start in the step
    ss = np.flatnonzero(m.t_optype == STEP_START_CODE)
    assert m.duration[ss, 0, :].tolist() == [[0.0, 0.0], [0.5, 0.5]]
    assert m.start[ss].tolist() == [[[0.0, 0.0]], [[0.0, 0.0]]]
    # starts are from the step's first start; the traced step is last end - first start
    assert m.real_step_time.tolist() == [6.5, 6.5]
    fwd_send = np.flatnonzero(m.t_optype == OPTYPE_CODE["forward-send"])[0]
    fwd_recv = np.flatnonzero(m.t_optype == OPTYPE_CODE["forward-recv"])[0]
    bwd_send = np.flatnonzero(m.t_optype == OPTYPE_CODE["backward-send"])[0]
    bwd_recv = np.flatnonzero(m.t_optype == OPTYPE_CODE["backward-recv"])[0]
    assert m.group[fwd_send] == m.group[fwd_recv] and m.group[bwd_send] == m.group[bwd_recv]
    assert len(set(m.group.tolist())) == m.num_template_ops - 2
    # transfer = end - the latest start in the group, clipped to [0, duration]
    assert m.transfer[fwd_recv, 0].tolist() == [0.25, 0.25]  # ends 1.25, the send starts at 1.0
    assert m.transfer[fwd_send, 0].tolist() == [0.25, 0.25]  # the same group, the same end
    assert m.transfer[bwd_recv, 0].tolist() == [0.25, 0.25]  # ends 3.5, the send starts at 3.25
    compute = ~m.t_is_comm
    assert np.array_equal(m.transfer[compute], m.duration[compute])
    # the chain: each op waits for the previous one on its worker; the first for the step's start
    for p in range(2):
        ops = np.flatnonzero(m.t_pp == p)
        assert m.pred[ops[0], 0] == m.num_template_ops
        assert [int(m.pred[i, 0]) for i in ops[1:]] == ops[:-1].tolist()


def test_fused_p2p_ops_share_a_slot():
    # stage 0 posts its backward-recv together with the forward-send (Megatron's fused
    # send_forward_recv_backward): the next op waits for both, neither waits for the other
    fused = [r if r[1] != "backward-recv" else (0, "backward-recv", 1.0, 2.5) for r in TWO_STAGES]
    m = build_model(_trace([fused, fused]))
    send = np.flatnonzero(m.t_optype == OPTYPE_CODE["forward-send"])[0]
    recv = np.flatnonzero(m.t_optype == OPTYPE_CODE["backward-recv"])[0]
    bwd = np.flatnonzero((m.t_optype == OPTYPE_CODE["backward-compute"]) & (m.t_pp == 0))[0]
    assert m.pred[send].tolist() == m.pred[recv].tolist()
    assert sorted(int(x) for x in m.pred[bwd]) == sorted([send, recv])


def test_damaged_and_truncated_steps_are_dropped_with_one_note_each():
    damaged = [r if r[1] != "backward-compute" or r[0] else (0, "backward-compute", np.nan, 2.0)
               for r in TWO_STAGES]
    truncated = TWO_STAGES[:-1]
    m = build_model(_trace([TWO_STAGES, damaged, TWO_STAGES, truncated]))
    assert m.steps.tolist() == [0, 2]
    assert m.dropped == (
        "1 op rows with NaN/negative times or ranks out of range (dp < 1, pp < 2); their steps are dropped",
        "1 step(s) with missing or extra ops (truncated, unmatched, or another micro-batch split) dropped: steps 3",
    )


def test_a_damaged_step_alone_gives_no_missing_ops_note():
    damaged = [r if r[1] != "optimizer" or r[0] else (0, "optimizer", 6.0, -1.0) for r in TWO_STAGES]
    m = build_model(_trace([TWO_STAGES, damaged, TWO_STAGES]))
    assert m.steps.tolist() == [0, 2]
    assert len(m.dropped) == 1 and "NaN/negative" in m.dropped[0]


def test_no_usable_row_is_an_input_error():
    nan = [(p, name, np.nan, d) for p, name, _, d in TWO_STAGES]
    with pytest.raises(InputError, match="tiny: no usable op row"):
        build_model(_trace([nan, nan]))
    with pytest.raises(InputError, match="tiny: no usable op row"):  # only irregular GC pauses
        build_model(_trace([[(0, "gc", 0.0, 0.1)], []]))


def test_irregular_gc_rows_become_events_and_regular_ones_stay_ops():
    with_gc = [*TWO_STAGES, (1, "gc", 4.6, 0.2)]
    m = build_model(_trace([TWO_STAGES, with_gc, TWO_STAGES]))
    assert m.steps.tolist() == [0, 1, 2] and m.gc_events.tolist() == [0.2]
    assert OPTYPE_CODE["gc"] not in m.t_optype
    assert m.dropped == ("1 irregular GC pauses (automatic Python GC) kept as events, not as ops of the step",)
    every_step = [*TWO_STAGES, (0, "gc", 6.6, 0.1), (1, "gc", 4.6, 0.2)]
    m = build_model(_trace([every_step, every_step]))
    assert m.gc_events.size == 0 and m.dropped == ()
    assert np.count_nonzero(m.t_optype == OPTYPE_CODE["gc"]) == 2


def test_ops_missing_on_one_dp_rank_are_absent_there_only():
    rows = [(*r, d) for d in range(2) for r in TWO_STAGES if not (d == 1 and r[1] == "optimizer")]
    m = build_model(_trace([rows, rows], dp=2))
    opt = m.t_optype == OPTYPE_CODE["optimizer"]
    assert m.present[opt].tolist() == [[True, False], [True, False]]
    assert m.present[~opt].all()
    assert m.transfer[opt][:, 1].tolist() == [[0.0, 0.0], [0.0, 0.0]]



def _uneven_trace(even_steps: int, uneven_steps: int) -> Trace:
    """DP=2 x PP=4: ``even_steps`` steps of 8 + 8 micro-batches, then ``uneven_steps`` of
    14 + 2 (a re-split such as greyhound's S2 plan), each replica its own 1F1B schedule."""
    from postmortem.generate import SyntheticJob, generate

    parts = []
    if even_steps:
        even, _ = generate(SyntheticJob(dp=2, pp=4, num_microbatches=8, num_steps=even_steps),
                           rng=np.random.default_rng(1))
        parts.append(even.ops)
    for dp, m in ((0, 14), (1, 2)):
        replica, _ = generate(SyntheticJob(dp=1, pp=4, num_microbatches=m, num_steps=uneven_steps),
                              rng=np.random.default_rng(2 + dp))
        ops = dict(replica.ops)
        ops["step"] = ops["step"] + even_steps
        ops["dp_rank"] = np.full_like(ops["dp_rank"], dp)
        parts.append(ops)
    ops = {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}
    workers = {"rank": np.arange(8, dtype=np.int32), "dp_rank": np.repeat(np.arange(2, dtype=np.int16), 4),
               "pp_rank": np.tile(np.arange(4, dtype=np.int16), 2), "node": np.array(["n1"] * 8),
               "device": np.array([f"cuda:{i}" for i in range(8)])}
    return Trace(meta=TraceMeta(dp=2, pp=4, num_microbatches=16), ops=ops, workers=workers)


def test_replicas_of_an_uneven_micro_batch_split_keep_their_own_order():
    # The replicas' 1F1B schedules differ (14 micro-batches against 2): on stage 0 the
    # first backward follows 3 forwards on one and 1 on the other. Ordered by the mean
    # start over both, it came before a forward it follows on the first replica, and on
    # the demo's trace after S2's plan that made a cycle through the p2p groups ("the
    # ops' order deadlocks": no post-mortem). Each replica's order is kept now.
    m = build_model(_uneven_trace(even_steps=0, uneven_steps=6))
    assert m.steps.tolist() == list(range(6)) and m.dropped == ()
    for d in range(2):
        for p in range(4):
            mine = np.flatnonzero((m.t_pp == p) & m.present[:, d] & (m.t_optype != STEP_START_CODE))
            starts = m.start[mine, d, :]            # (ops of the stage on d, steps), template order
            assert (np.diff(starts, axis=0) >= 0).all(), (d, p)


def test_the_reference_jobs_trace_under_s2s_plan_is_analysed():
    # A real run (tests/assets/reference_job/README.md): 42 traced steps on the job's
    # 8,8 split, then 58 on S2's 13,3. Refused before ("the ops' order deadlocks").
    from postmortem.analysis import analyze
    from postmortem.schema import read_trace

    from conftest import REPO

    result = analyze(read_trace(REPO / "tests/assets/reference_job/s2_split_13_3.h5"))
    report = result.to_json()
    assert len(result.model.steps) == 58
    assert any(note.startswith("42 step(s) with missing or extra ops (truncated, unmatched, or another "
                               "micro-batch split)") for note in report["dropped"]), report["dropped"]
    # the replay of the real durations gives the real step times back
    assert abs(report["simulation_error"]) < 0.05, report["simulation_error"]
    assert report["slowdown"] > 1.5        # rank 5 ran at a quarter of its CPU throughout


def test_a_trace_split_evenly_between_two_micro_batch_splits_keeps_the_first():
    # The demo: S2's plan came half way through the traced steps (11 on 8,8, then 11 on
    # 10,6). Expecting every op that half the steps had mixed both programs, no step
    # matched, and the job had no post-mortem.
    m = build_model(_uneven_trace(even_steps=3, uneven_steps=3))
    assert m.steps.tolist() == [0, 1, 2]
    assert len(m.dropped) == 1 and m.dropped[0].endswith("dropped: steps 3, 4, 5"), m.dropped
