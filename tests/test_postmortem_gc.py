"""Automatic (irregular) Python GC pauses: events beside the model, not damaged steps."""

from __future__ import annotations

import dataclasses

import numpy as np

from postmortem.analysis import analyze
from postmortem.generate import SyntheticJob, generate
from postmortem.schema import OPTYPE_CODE


def with_irregular_gc(trace, *, keep_every: int, pause_s: float):
    """The trace with GC rows only on every keep_every-th (step, dp, pp) cell, as
    automatic GC leaves them, and each kept pause set to pause_s."""
    ops = {k: v.copy() for k, v in trace.ops.items()}
    gc = ops["optype"] == OPTYPE_CODE["gc"]
    cell = (ops["step"].astype(np.int64) * 97 + ops["dp_rank"] * 13 + ops["pp_rank"])
    drop = gc & (cell % keep_every != 0)
    ops["duration"][gc & ~drop] = pause_s
    ops = {k: v[~drop] for k, v in ops.items()}
    return dataclasses.replace(trace, ops=ops)


def test_irregular_gc_drops_no_step_and_is_named_a_cause():
    trace, _ = generate(SyntheticJob(dp=2, pp=4, num_microbatches=8, num_steps=12, gc_prob=1.0,
                                     gc_pause_s=0.0, seed=3))
    regular = analyze(trace)
    assert regular.model.steps.size == 12 and regular.model.gc_events.size == 0
    irregular = with_irregular_gc(trace, keep_every=5, pause_s=0.05)
    result = analyze(irregular)
    assert result.model.steps.size == 12, result.model.dropped
    n_gc = int((irregular.ops["optype"] == OPTYPE_CODE["gc"]).sum())
    assert 0 < n_gc < 12 * 8
    assert result.model.gc_events.size == n_gc
    assert any("irregular GC pauses" in note for note in result.model.dropped)
    causes = {c.cause: c for c in result.causes}
    assert "Python GC pauses" in causes
    assert causes["Python GC pauses"].evidence["pauses"] == n_gc


def test_short_irregular_gc_is_not_a_cause():
    trace, _ = generate(SyntheticJob(dp=2, pp=2, num_microbatches=4, num_steps=8, gc_prob=1.0,
                                     gc_pause_s=0.0, seed=4))
    result = analyze(with_irregular_gc(trace, keep_every=3, pause_s=0.002))
    assert result.model.steps.size == 8
    assert "Python GC pauses" not in {c.cause for c in result.causes}
