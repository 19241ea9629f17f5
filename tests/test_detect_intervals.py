"""Slow intervals, the window baseline, the pipeline and the generators."""

import numpy as np
import pytest

from greyhound import ring
from greyhound.analytics.baselines import window_changepoints
from greyhound.analytics.changepoint import ChangePoint, RecentValues
from greyhound.analytics.detect import METHODS, detect_series
from greyhound.analytics.intervals import healthy_level, slow_intervals
from greyhound.analytics.synthetic import call_trace, iteration_series, labelled_series


def _cp(index):
    return ChangePoint(index=index, detected_at=index, before=1.0, after=1.0)


def test_one_slow_regime_is_one_interval():
    x = np.array([1.0] * 10 + [2.0] * 10 + [1.0] * 10)
    (interval,) = slow_intervals(x, [_cp(10), _cp(20)], min_reference=10)
    assert (interval.start_index, interval.end_index, interval.slowdown) == (10, 20, 2.0)
    assert healthy_level(x, [interval]) == 1.0


def test_interval_still_open_at_the_end_has_no_end():
    x = np.array([1.0] * 5 + [1.5] * 5)
    (interval,) = slow_intervals(x, [_cp(5)], min_reference=5)
    assert interval.end_index is None and interval.slowdown == 1.5


def test_consecutive_slow_regimes_merge_and_benign_shift_moves_healthy():
    # healthy 1.0, benign 1.05 (new healthy), slow 1.3 then 1.6, back to 1.05.
    x = np.array([1.0] * 4 + [1.05] * 60 + [1.3] * 4 + [1.6] * 4 + [1.05] * 4)
    (interval,) = slow_intervals(x, [_cp(4), _cp(64), _cp(68), _cp(72)], min_reference=4)
    assert (interval.start_index, interval.end_index) == (64, 72)
    assert interval.slowdown == pytest.approx(np.median([1.3] * 4 + [1.6] * 4) / 1.05)


def test_a_slowdown_that_fades_without_a_change_point_ends_where_it_is_gone():
    # A VM drift: 1.17x for 60 iterations, easing back to 1.0 over 40 with no change
    # point, then 400 healthy ones. The regime's level (its first 50) is 1.17x: before,
    # the interval stayed open to the end (slowdown 1.009x on the local cluster).
    rng = np.random.default_rng(0)
    x = np.concatenate([np.full(100, 1.0), np.full(60, 1.17), np.linspace(1.17, 1.0, 40), np.full(400, 1.0)])
    x = x * (1 + 0.02 * rng.standard_normal(len(x)))
    (interval,) = slow_intervals(x, [_cp(100)])
    assert interval.start_index == 100
    # Windows of 50, 25 apart: the first whose median is under the hold level (1.05x).
    assert interval.end_index is not None and 150 <= interval.end_index <= 200
    assert interval.slowdown > 1.1


def test_a_lasting_slowdown_does_not_fade():
    rng = np.random.default_rng(1)
    x = np.concatenate([np.full(100, 1.0), np.full(2000, 1.12)]) * (1 + 0.05 * rng.standard_normal(2100))
    (interval,) = slow_intervals(x, [_cp(100)])
    assert (interval.start_index, interval.end_index) == (100, None)


def test_small_rise_is_not_slow():
    x = np.array([1.0] * 5 + [1.08] * 5)
    assert slow_intervals(x, [_cp(5)], min_reference=5) == []


def test_change_points_must_increase():
    with pytest.raises(ValueError, match="increase"):
        slow_intervals(np.ones(10), [_cp(5), _cp(5)])


def test_window_baseline_exact_on_a_step():
    x = np.array([1.0] * 30 + [1.5] * 30)
    (cp,) = window_changepoints(x, window=10)
    # The median of 10 turns when 5 of them are new (it averages 1.0 and 1.5): t = 34.
    assert (cp.index, cp.detected_at, cp.before, cp.after) == (30, 34, 1.0, 1.5)


def test_window_baseline_ignores_spikes_and_misses_short_blips():
    x = np.ones(100)
    x[[20, 50, 51]] = 3.0  # spikes
    x[70:74] = 1.5  # 4 slow iterations: shorter than half the window
    assert window_changepoints(x, window=10) == []


def test_recent_values_are_addressed_by_absolute_index():
    values = RecentValues(4)
    for v in range(10):
        values.append(float(v))
    np.testing.assert_array_equal(values.window(0, 10), [6.0, 7.0, 8.0, 9.0])
    np.testing.assert_array_equal(values.window(7, 9), [7.0, 8.0])
    assert len(values.window(20, 30)) == 0


@pytest.mark.parametrize("method", METHODS)
def test_every_method_finds_a_clean_fail_slow(method):
    x = np.array([1.0] * 60 + [1.5] * 60 + [1.0] * 60)
    d = detect_series(x, method=method)
    assert d.fail_slow and d.iterations == 180 and d.baseline_iteration_time == 1.0
    (interval,) = d.slow_intervals
    assert abs(interval.start_index - 60) <= 1 and abs(interval.end_index - 120) <= 1
    assert interval.slowdown == 1.5


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="method must be one of"):
        detect_series(np.ones(5), method="magic")


def test_generators_are_deterministic_per_seed():
    a = labelled_series(np.random.default_rng(3), num_jobs=4, min_iterations=300, max_iterations=400)
    b = labelled_series(np.random.default_rng(3), num_jobs=4, min_iterations=300, max_iterations=400)
    for (xa, ta), (xb, tb) in zip(a, b):
        np.testing.assert_array_equal(xa, xb)
        assert ta == tb
    c = labelled_series(np.random.default_rng(4), num_jobs=4, min_iterations=300, max_iterations=400)
    assert not np.array_equal(a[0][0], c[0][0])


@pytest.mark.parametrize("seed", range(5))
def test_generated_fail_slows_follow_their_spec(seed):
    x, truth = iteration_series(np.random.default_rng(seed), num_iterations=1500, num_fail_slows=2)
    assert len(x) == 1500 and np.all(x > 0) and truth.positive
    events = truth.fail_slows
    assert events[0].end < events[1].onset
    for fs in events:
        assert 1.1 <= fs.factor <= 2.0 and 20 <= fs.end - fs.onset <= 600
        assert 0 <= fs.ramp <= (fs.end - fs.onset) // 2
        inside = np.median(x[fs.onset + fs.ramp : fs.end])
        before = np.median(x[fs.onset - 50 : fs.onset])
        assert inside / before == pytest.approx(fs.factor, rel=0.12)
    for _, factor in truth.level_shifts:
        assert 0.02 <= abs(factor - 1) <= 0.05


def test_call_trace_has_one_op_sequence_per_iteration():
    trace, truth = call_trace(np.random.default_rng(1), num_iterations=5, warmup_calls=3)
    per_iter = truth.calls_per_iteration
    assert len(trace.op) == 3 + 5 * per_iter
    np.testing.assert_array_equal(trace.op[3 : 3 + per_iter], trace.op[3 + per_iter : 3 + 2 * per_iter])
    assert np.all(np.diff(trace.time) > 0)
    assert {ring.OP_NAMES[o] for o in trace.op[3:]} == {"Recv", "Send", "AllReduce", "ReduceScatter", "AllGather"}
    owner = truth.call_iteration
    for i in range(5):
        t = trace.time[owner == i]
        assert truth.iteration_start[i] <= t.min() and t.max() < truth.iteration_start[i + 1]


def test_short_step_does_not_move_healthy_and_hysteresis_holds():
    # A ramp's short first step at 1.08, then 1.15 (slow against 1.0, not against
    # 1.08), then 1.06 (over the 5% hold), then healthy again.
    x = np.array([1.0] * 60 + [1.08] * 5 + [1.15] * 10 + [1.06] * 5 + [1.0] * 5)
    (interval,) = slow_intervals(x, [_cp(60), _cp(65), _cp(75), _cp(80)])
    assert (interval.start_index, interval.end_index) == (65, 80)
    # A long regime at 1.08 does become the reference: 1.15 is then no fail-slow.
    y = np.array([1.0] * 60 + [1.08] * 60 + [1.15] * 10 + [1.0] * 5)
    assert slow_intervals(y, [_cp(60), _cp(120), _cp(130)]) == []


def test_warm_up_regimes_are_neither_slow_nor_the_reference():
    # 10 slow warm-up iterations (compilation), then healthy, then a 1.5x fail-slow.
    x = np.array([3.0] * 10 + [1.0] * 100 + [1.5] * 50 + [1.0] * 40)
    (interval,) = slow_intervals(x, [_cp(10), _cp(110), _cp(160)])
    assert (interval.start_index, interval.end_index, interval.slowdown) == (110, 160, 1.5)
    # A partial first iteration: its regime is warm-up too.
    y = np.array([0.8] * 4 + [1.0] * 100 + [1.2] * 30)
    (interval,) = slow_intervals(y, [_cp(4), _cp(104)])
    assert interval.start_index == 104 and interval.slowdown == pytest.approx(1.2)
    # Until a regime lasts min_reference iterations there is no reference at all.
    assert slow_intervals(x[:130], [_cp(10), _cp(110)], min_reference=200) == []


def test_the_reference_is_where_a_drifting_level_stood_before_the_change():
    # The healthy level drifts down 6% over 500 iterations; then +12% from there.
    x = np.concatenate([np.linspace(1.06, 1.0, 500), np.full(60, 1.12)])
    (interval,) = slow_intervals(x, [_cp(500)])
    assert interval.slowdown == pytest.approx(1.12 / np.median(x[450:500]))
    # The whole first regime's median (1.03) would have made it 1.087x: not slow.
    assert 1.12 / np.median(x[:500]) < 1.1


def test_a_change_accepted_as_slower_opens_at_the_hold_level():
    # The detector judged the onset 10% slower than the level right before it; the
    # regime's level is 1.07x the reference (a drift in between): still slow.
    x = np.array([1.0] * 100 + [1.07] * 50)
    onset = ChangePoint(index=100, detected_at=103, before=0.97, after=1.07)
    (interval,) = slow_intervals(x, [onset])
    assert interval.start_index == 100
    assert slow_intervals(x, [_cp(100)]) == []


def test_a_drop_accepted_as_faster_must_itself_be_slow_to_keep_the_interval_open():
    # The reference job back from a 2.6x fail-slow at 1.051x its reference (noise: the
    # same level as before it, within 5%); at the hold level (1.05) the episode stayed
    # open to the job's end, and the master never said "recovered" (a CI run).
    onset = ChangePoint(index=60, detected_at=63, before=1.0, after=2.6)
    x = np.array([1.0] * 60 + [2.6] * 22 + [1.051] * 46)
    back = ChangePoint(index=82, detected_at=85, before=2.6, after=1.051)
    (interval,) = slow_intervals(x, [onset, back])
    assert (interval.start_index, interval.end_index) == (60, 82)
    # Still 1.2x after the drop: the fail-slow eased, it did not end.
    y = np.array([1.0] * 60 + [2.6] * 22 + [1.2] * 46)
    eased = ChangePoint(index=82, detected_at=85, before=2.6, after=1.2)
    (interval,) = slow_intervals(y, [onset, eased])
    assert interval.end_index is None
    # A change not accepted as 10% faster leaves the hold level in force: 1.06 holds.
    z = np.array([1.0] * 60 + [1.15] * 10 + [1.06] * 10)
    hover = ChangePoint(index=70, detected_at=73, before=1.15, after=1.06)
    (interval,) = slow_intervals(z, [ChangePoint(index=60, detected_at=63, before=1.0, after=1.15), hover])
    assert interval.end_index is None
