"""The fast paths of the post-mortem against their plain counterparts, bit for bit.

The live-buffer walk (``simulate`` without ``record``) must give exactly the step times
of the walk that keeps every op's end (``record=True``), and the model must not depend on
the order of the trace's rows (the stable integer sort versus the float lexsort).
"""

import dataclasses

import numpy as np
import pytest

from greyhound.errors import InputError
from postmortem.attribution import attribute
from postmortem.generate import SyntheticJob, generate
from postmortem.idealize import idealize
from postmortem.model import _dense_unique, _group_levels, build_model
from postmortem.simulate import simulate

JOBS = [
    dict(dp=4, pp=4, num_microbatches=6, num_steps=5, noise=0.03, slow_workers=((1, 2, 1.5),)),
    dict(dp=3, pp=1, num_microbatches=4, num_steps=4, noise=0.05, slow_dp=((2, 1.3),)),
    dict(dp=2, pp=5, num_microbatches=7, num_steps=3, gc_prob=0.3, gc_pause_s=0.02, seed=4),
    dict(dp=5, pp=3, num_microbatches=3, num_steps=6, noise=0.02, stage_weights=(1.0, 1.0, 1.7)),
]


def _uneven(trace):
    """Drop the last micro-batch of DP replica 1 on every stage and step (as mitigation
    S2 does): its ops are absent on one rank only, so ``present`` is not uniform."""
    ops = trace.ops
    last = int(ops["microbatch"].max())
    keep = ~((ops["dp_rank"] == 1) & (ops["microbatch"] == last))
    return dataclasses.replace(trace, ops={k: v[keep] for k, v in ops.items()})


def _scenarios(model, rng):
    """Random masks plus the structured ones attribution uses (one DP rank, one worker)."""
    n_t, D = model.num_template_ops, model.dp
    masks = [np.ones((n_t, D), bool), np.zeros((n_t, D), bool)]
    masks += [rng.random((n_t, D)) < q for q in (0.1, 0.5, 0.9)]
    masks.append(np.repeat((rng.random(n_t) < 0.3)[:, None], D, axis=1))
    for d in range(D):
        m = np.zeros((n_t, D), bool)
        m[:, d] = True
        masks.append(m)
        w = np.zeros((n_t, D), bool)
        w[model.t_pp == d % model.pp, d] = True
        masks.append(w)
    return np.stack(masks)


@pytest.mark.parametrize("narrow", [True, False])
@pytest.mark.parametrize("uneven", [False, True])
@pytest.mark.parametrize("kw", JOBS)
def test_live_walk_equals_full_walk(kw, uneven, narrow, monkeypatch):
    import postmortem.simulate as sim

    # narrow: every scenario that can runs on its real ranks + one stand-in; else all full
    monkeypatch.setattr(sim, "_WALK_COST_CELLS", 0 if narrow else 10**12)
    trace, _ = generate(SyntheticJob(**kw))
    if uneven:
        trace = _uneven(trace)
    model = build_model(trace)
    if uneven:
        assert not model.present.all()
    keep = _scenarios(model, np.random.default_rng(0))
    ideal = idealize(model).work
    fast = simulate(model, ideal=ideal, keep_real=keep).step_time
    full = simulate(model, ideal=ideal, keep_real=keep, record=True)
    np.testing.assert_array_equal(fast, full.step_time)
    # and the step time is the latest end of any op
    np.testing.assert_array_equal(fast, full.end.max(axis=(1, 2)))


def test_live_walk_with_per_cell_ideal_and_small_chunks(monkeypatch):
    import postmortem.simulate as sim

    trace, _ = generate(SyntheticJob(**JOBS[0]))
    model = build_model(trace)
    rng = np.random.default_rng(1)
    ideal = rng.random(model.transfer.shape) * 0.01  # (n_t, D, N): no rank stand-in
    keep = _scenarios(model, rng)
    full = simulate(model, ideal=ideal, keep_real=keep, record=True).step_time
    monkeypatch.setattr(sim, "_ROW_CELLS", 7)  # forces step chunks and one scenario a batch
    monkeypatch.setattr(sim, "_WALK_COST_CELLS", 0)
    np.testing.assert_array_equal(simulate(model, ideal=ideal, keep_real=keep).step_time, full)
    np.testing.assert_array_equal(simulate(model, ideal=ideal[:, 0, 0], keep_real=keep).step_time,
                                  simulate(model, ideal=ideal[:, 0, 0], keep_real=keep, record=True).step_time)


def test_buffer_is_much_smaller_than_the_graph():
    model = build_model(generate(SyntheticJob(dp=2, pp=8, num_microbatches=32, num_steps=2))[0])
    assert 0 < model.buffer_rows <= model.num_template_ops // 10


@pytest.mark.parametrize("seed", [0, 1])
def test_model_does_not_depend_on_row_order(seed):
    trace, _ = generate(SyntheticJob(dp=3, pp=3, num_microbatches=5, num_steps=4, noise=0.05, seed=seed))
    perm = np.random.default_rng(seed).permutation(trace.num_ops)
    shuffled = dataclasses.replace(trace, ops={k: v[perm] for k, v in trace.ops.items()})
    a, b = build_model(trace), build_model(shuffled)
    for f in ("steps", "t_pp", "t_optype", "t_occ", "start", "duration", "transfer", "present", "pred", "group"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    ra, rb = attribute(a), attribute(b)
    assert ra.slowdown == rb.slowdown and ra.by_optype == rb.by_optype and ra.mw == rb.mw


def test_equal_starts_keep_row_order():
    """Two ops of one type starting together on a worker are numbered in row order (the
    lexsort's tie-break), whichever sort path runs."""
    trace, _ = generate(SyntheticJob(dp=2, pp=2, num_microbatches=3, num_steps=2))
    ops = {k: v.copy() for k, v in trace.ops.items()}
    fwd = np.flatnonzero((ops["optype"] == 0) & (ops["pp_rank"] == 0) & (ops["dp_rank"] == 0) & (ops["step"] == 0))
    ops["start"][fwd[1]] = ops["start"][fwd[0]]  # a tie; rows stay in time order otherwise
    ops["duration"][fwd[0]] = 0.5
    m = build_model(dataclasses.replace(trace, ops=ops))
    t0 = np.flatnonzero((m.t_optype == 0) & (m.t_pp == 0) & (m.t_occ == 0))[0]
    s0 = np.flatnonzero(m.steps == 0)[0]
    assert m.duration[t0, 0, s0] == 0.5


@pytest.mark.parametrize("span", [10, 10**9])
def test_dense_unique_matches_np_unique(span):
    rng = np.random.default_rng(span % 97)
    keys = rng.integers(-span, span, size=1000).astype(np.int64)
    v, inv = _dense_unique(keys)
    ev, einv = np.unique(keys, return_inverse=True)
    np.testing.assert_array_equal(v, ev)
    np.testing.assert_array_equal(inv, einv)


def test_levels_are_longest_paths_and_cycles_deadlock():
    # 0 <- 1 <- 2, 0 <- 2 (pred sentinel 3 = the step's start); ops 1 and 3? no: 3 ops
    pred = np.array([[3, 3], [0, 3], [1, 0]])
    group = np.array([0, 1, 2])
    np.testing.assert_array_equal(_group_levels(pred, group, where="t"), [1, 2, 3])
    # ops 1 and 2 in one group: the group waits for op 1, which is in it -> cycle
    with pytest.raises(InputError, match="deadlocks"):
        _group_levels(pred, np.array([0, 1, 1]), where="t")
