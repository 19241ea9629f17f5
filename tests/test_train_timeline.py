"""The timeline recorder (greyhound.timeline) and the merge into the HDF5 trace
(postmortem.merge), without a training job: a hand-driven recorder per fake rank."""

from __future__ import annotations

import gc
import json

import numpy as np
import pytest

from greyhound.errors import InputError
from greyhound.timeline import TimelineConfig, TimelineRecorder, rank_file_name
from postmortem.merge import merge_trace_dir, read_rank_file
from postmortem.schema import OPTYPE_CODE, read_trace

JOB = {"dp": 2, "pp": 2, "tp": 1, "num_microbatches": 3, "microbatches_per_dp": [1, 2], "schedule": "1F1B",
       "job_id": "77", "trial_name": "t"}


def _recorder(tmp_path, rank, dp_rank, pp_rank, every=2, **kw):
    return TimelineRecorder(TimelineConfig(trace_dir=str(tmp_path), every=every, **kw), rank=rank,
                            dp_rank=dp_rank, pp_rank=pp_rank, node=f"n{rank // 2 + 1}", device="cpu", job=JOB)


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_only_sampled_steps_are_written(tmp_path):
    rec = _recorder(tmp_path, 0, 0, 0, every=3)
    for step in range(7):
        rec.start_step(step, num_microbatches=1)
        with rec.span("forward-compute", microbatch=0):
            pass
        rec.end_step()
    rec.close()
    lines = _lines(tmp_path / rank_file_name(0))
    assert lines[0]["format"] == "greyhound-timeline" and lines[0]["job"] == JOB
    assert [x["step"] for x in lines[1:]] == [2, 5]  # the 3rd and 6th step
    assert [rec.is_sampled(s) for s in range(4)] == [False, False, True, False]


def test_spans_record_start_duration_and_combined_ops(tmp_path):
    rec = _recorder(tmp_path, 0, 0, 0, every=1)
    rec.start_step(0, num_microbatches=2)
    t_before = rec.now()
    with rec.span("forward-compute", microbatch=1):
        sum(range(10000))
    with rec.span("forward-send", "backward-recv", microbatch=(1, 0)):
        pass
    with rec.span("optimizer"):
        pass
    rec.seqlens(1, np.array([3, 5]))
    rec.end_step()
    rec.close()
    ops = _lines(tmp_path / rank_file_name(0))[1]["ops"]
    ops = [op for op in ops if op[0] != "gc"]
    assert [(o[0], o[1], o[2]) for o in ops] == [
        ("forward-compute", 1, 0), ("forward-send", 1, 0), ("backward-recv", 0, 0), ("optimizer", -1, -1)]
    assert ops[0][3] >= t_before and ops[0][4] > 0
    assert ops[1][3:] == ops[2][3:]  # one combined op: same start and duration
    assert ops[1][3] >= ops[0][3] + ops[0][4]  # in order on one clock
    assert _lines(tmp_path / rank_file_name(0))[1]["seqlens"] == [[1, [3, 5]]]


def test_gc_pauses_are_recorded_on_sampled_steps_only(tmp_path):
    rec = _recorder(tmp_path, 0, 0, 0, every=2)
    for step in range(2):
        rec.start_step(step, num_microbatches=1)
        with rec.span("backward-compute", microbatch=0):
            gc.collect()
        gc.collect()
        rec.end_step()
    rec.close()
    assert rec._on_gc not in gc.callbacks
    lines = _lines(tmp_path / rank_file_name(0))
    assert [x["step"] for x in lines[1:]] == [1]
    gcs = [op for op in lines[1]["ops"] if op[0] == "gc"]
    assert [op[1] for op in gcs] == [0, -1]  # inside micro-batch 0's span, then outside any
    assert all(op[4] >= 0 for op in gcs)


def _fake_job(tmp_path, steps=(1, 3)):
    """A DP=2 x PP=2 job's timelines, with a (1, 2) micro-batch split, driven by hand."""
    recs = {}
    for d in range(2):
        for p in range(2):
            rank = p * 2 + d
            recs[rank] = _recorder(tmp_path, rank, d, p)
    t = 0.0
    for step in range(max(steps) + 1):
        for rank, rec in recs.items():
            d, p = rank % 2, rank // 2
            m = JOB["microbatches_per_dp"][d]
            rec.start_step(step, num_microbatches=m)
            if rec.active:
                for i in range(m):
                    rec.record("forward-compute", microbatch=i, start=t + i, duration=0.5)
                    rec.record("forward-send" if p == 0 else "forward-recv", microbatch=i, start=t + i + 0.5,
                               duration=0.1)
                    rec.record("backward-compute", microbatch=i, start=t + 5 + i, duration=1.0)
                    rec.record("backward-recv" if p == 0 else "backward-send", microbatch=i, start=t + 6 + i,
                               duration=0.1)
                    if p == 0:
                        rec.seqlens(i, [4 + i, 2])
                rec.record("grads-all-reduce", start=t + 9, duration=0.2)
                rec.record("optimizer", start=t + 9.5, duration=0.1)
            rec.end_step()
        t += 10
    for rec in recs.values():
        rec.close()


def test_merge_writes_the_schema(tmp_path):
    _fake_job(tmp_path)
    out = merge_trace_dir(tmp_path)
    trace = read_trace(out)
    assert (trace.meta.dp, trace.meta.pp, trace.meta.num_microbatches) == (2, 2, 3)
    assert trace.meta.microbatches_per_dp == (1, 2) and trace.meta.job_id == "77"
    assert trace.workers["rank"].tolist() == [0, 1, 2, 3]
    assert trace.workers["node"].tolist() == ["n1", "n1", "n2", "n2"]
    ops = trace.ops
    # 2 steps x (dp 0: 1 mb, dp 1: 2 mbs) x 2 stages x 4 ops per mb + 2 per rank-step
    assert trace.num_ops == 2 * 3 * 2 * 4 + 2 * 4 * 2
    assert sorted(set(ops["step"].tolist())) == [1, 3]
    assert np.count_nonzero(ops["optype"] == OPTYPE_CODE["grads-all-reduce"]) == 8
    sl = trace.seqlens
    assert sl["step"].tolist() == [1, 1, 1, 3, 3, 3]
    assert sl["dp_rank"].tolist() == [0, 1, 1, 0, 1, 1]
    assert sl["microbatch"].tolist() == [0, 0, 1, 0, 0, 1]
    assert sl["lengths"][sl["offsets"][2]:sl["offsets"][3]].tolist() == [5, 2]


def test_merge_drops_torn_and_incomplete_steps(tmp_path):
    _fake_job(tmp_path, steps=(1, 3, 5))
    # rank 3 was killed while writing step 5: its line is torn
    path = tmp_path / rank_file_name(3)
    text = path.read_text().splitlines()
    path.write_text("\n".join(text[:-1]) + "\n" + text[-1][: len(text[-1]) // 2])
    assert read_rank_file(path).torn_lines == 1
    trace = read_trace(merge_trace_dir(tmp_path, tmp_path / "out.h5"))
    assert sorted(set(trace.ops["step"].tolist())) == [1, 3]
    assert trace.meta.extra["dropped_steps"] == [5]


def test_resumed_rank_file_appends(tmp_path):
    rec = _recorder(tmp_path, 0, 0, 0, every=1)
    rec.start_step(0, num_microbatches=1)
    rec.end_step()
    rec.close()
    with open(tmp_path / rank_file_name(0), "a") as f:
        f.write('{"step": 1, "num_mi')  # torn by a kill
    rec = _recorder(tmp_path, 0, 0, 0, every=1, append=True)
    rec.start_step(1, num_microbatches=1)
    rec.end_step()
    rec.close()
    timeline = read_rank_file(tmp_path / rank_file_name(0))
    assert sorted(timeline.steps) == [0, 1] and timeline.torn_lines == 1


def test_merge_errors(tmp_path):
    with pytest.raises(InputError, match="no rank-\\*.jsonl timeline files"):
        merge_trace_dir(tmp_path)
    (tmp_path / rank_file_name(0)).write_text("not json\n")
    with pytest.raises(InputError, match="not a greyhound timeline file"):
        merge_trace_dir(tmp_path)
    _fake_job(tmp_path)
    dup = tmp_path / rank_file_name(9)
    dup.write_text((tmp_path / rank_file_name(1)).read_text())
    with pytest.raises(InputError, match="both claim dp_rank 1, pp_rank 0"):
        merge_trace_dir(tmp_path)


def test_config_checks():
    with pytest.raises(ValueError, match="every must be an integer >= 1"):
        TimelineConfig(trace_dir="x", every=0)
