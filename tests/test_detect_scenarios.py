"""The wider labelled test set (greyhound.analytics.scenarios): generators, splits,
rendering and scoring."""

import numpy as np
import pytest

from greyhound import ring
from greyhound.analytics.changepoint import ChangePoint
from greyhound.analytics.intervals import SlowInterval
from greyhound.analytics.period import iteration_times_from_calls
from greyhound.analytics.scenarios import (
    GENERATORS,
    JobTruth,
    labelled_set,
    render_calls,
    ring_records,
    score_job,
    summarize,
)
from greyhound.analytics.synthetic import FailSlow


@pytest.mark.parametrize("name", sorted(GENERATORS))
@pytest.mark.parametrize("seed", range(3))
def test_every_generator_keeps_its_spec(name, seed):
    rng = np.random.default_rng(seed)
    x, truth = GENERATORS[name](rng, num_iterations=1500, num_fail_slows=2)
    assert truth.generator == name and len(x) == 1500
    assert np.all(np.isfinite(x) & (x > 0))
    assert truth.positive and len(truth.fail_slows) >= 2
    for fs in truth.fail_slows:
        assert 60 <= fs.onset < fs.end <= 1500 and fs.end - fs.onset >= 5
        assert fs.factor >= 1.1
    # Brief disturbances: 1-3 iterations, 4 apart.
    spans = sorted(truth.transients)
    assert all(1 <= length <= 3 for _, length in spans)
    assert all(b[0] - (a[0] + a[1]) >= 4 for a, b in zip(spans, spans[1:]))
    if truth.pause is not None:
        assert truth.pause.shape == x.shape and np.all((truth.pause >= 0) & (truth.pause < x))
    again, truth_again = GENERATORS[name](np.random.default_rng(seed), num_iterations=1500,
                                          num_fail_slows=2)
    np.testing.assert_array_equal(x, again)
    assert truth == truth_again


def test_healthy_jobs_have_no_fail_slow_and_shifts_stay_small():
    for name, gen in GENERATORS.items():
        x, truth = gen(np.random.default_rng(5), num_iterations=2000)
        assert not truth.positive
        if name in ("heavy_tailed", "ar1_jitter", "seqlen_mix", "mixed"):
            continue
        # Outside the brief disturbances the level stays within +-5% (and jitter) of
        # healthy: benign shifts never add up to a 10% slowdown.
        mask = np.ones(len(x), dtype=bool)
        for start, length in truth.transients:
            mask[start : start + length] = False
        mask[:10] = False  # a warm-up
        level = np.convolve(np.log(x[mask] / truth.base), np.ones(101) / 101, mode="valid")
        assert np.all(np.abs(level) < np.log(1.08)), name


def test_splits_are_disjoint_and_reproducible():
    tune = labelled_set(split="tune", jobs_per_generator=3, min_iterations=300, max_iterations=400)
    held = labelled_set(split="heldout", jobs_per_generator=3, min_iterations=300, max_iterations=400)
    assert {j.seed for j in tune}.isdisjoint({j.seed for j in held})
    again = labelled_set(split="heldout", jobs_per_generator=3, min_iterations=300,
                         max_iterations=400)
    for a, b in zip(held, again):
        np.testing.assert_array_equal(a.x, b.x)
    assert sum(j.truth.positive for j in held) == 2 * len(GENERATORS)  # round(3 * 0.5)
    with pytest.raises(ValueError, match="split"):
        labelled_set(split="train", jobs_per_generator=1)
    with pytest.raises(ValueError, match="unknown generator"):
        labelled_set(split="tune", jobs_per_generator=1, generators=("nope",))


def test_rendered_calls_give_back_the_series():
    x = np.exp(np.random.default_rng(1).normal(0, 0.05, 200))
    for layout in ("ddp", "hybrid"):
        trace, starts = render_calls(np.random.default_rng(2), x, layout=layout, warmup_calls=30)
        np.testing.assert_allclose(np.diff(starts), x)
        calls = iteration_times_from_calls(trace.op, trace.comm, trace.nbytes, trace.time)
        assert calls.start == 30
        # Measured between first (hybrid) or last (ddp) calls: within the few percent
        # of an iteration that lies beyond them.
        err = np.abs(calls.iteration_times - x[: len(calls.iteration_times)]) / x[: len(calls.iteration_times)]
        assert np.median(err) < 0.01
    records = ring_records(trace, rng=np.random.default_rng(3), async_fraction=0.5)
    assert np.array_equal(records["seq"], np.arange(1, len(records) + 1))
    calls = ring.call_records(records)
    assert len(calls) == len(trace.op)
    waits = records[records["op"] == ring.OP["Wait"]]
    assert len(waits) == int((calls["flags"] & ring.F_ASYNC).astype(bool).sum())


def _cp(index, detected_at, ratio):
    return ChangePoint(index=index, detected_at=detected_at, before=1.0, after=ratio)


def test_scoring_exact_on_a_tiny_case():
    truth = JobTruth(
        generator="steps", base=1.0, jitter=0.01, transients=(),
        fail_slows=(FailSlow(onset=100, end=150, factor=1.5, ramp=0),
                    FailSlow(onset=300, end=310, factor=2.0, ramp=0),
                    FailSlow(onset=500, end=600, factor=1.3, ramp=20)),
    )
    cps = [_cp(100, 103, 1.5), _cp(150, 153, 0.67),  # found, delay 3
           _cp(301, 311, 2.0),                        # reported after it ended: missed
           _cp(512, 515, 1.2),                        # ramp: 10% reached at 507
           _cp(800, 803, 1.2)]                        # a false onset
    intervals = [SlowInterval(start_index=100, end_index=150, slowdown=1.5),
                 SlowInterval(start_index=800, end_index=None, slowdown=1.2)]
    score = score_job(truth, cps, intervals)
    assert truth.detectable_onset(truth.fail_slows[2]) == 507
    assert (score.found, score.delays) == (2, (3, 8))
    assert (score.false_intervals, score.spurious_changepoints) == (1, 1)
    assert score.flagged and score.correct
    healthy = JobTruth(generator="steps", base=1.0, jitter=0.01, transients=(), fail_slows=())
    summary = summarize([score, score_job(healthy, [], []), score_job(healthy, cps, intervals)])
    assert summary["accuracy"] == pytest.approx(2 / 3)
    assert (summary["false_positives"], summary["negatives"]) == (1, 2)
    assert summary["episode_recall"] == pytest.approx(2 / 3)
    assert summary["delay"]["median"] == 5.5
