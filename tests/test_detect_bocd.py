"""BOCD and BOCD+V (greyhound.analytics.bocd, greyhound.analytics.verify)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from greyhound.analytics.baselines import PlainBocd, bocd_changepoints
from greyhound.analytics.bocd import BocdConfig, RunLengthPosterior
from greyhound.analytics.intervals import slow_intervals
from greyhound.analytics.synthetic import iteration_series, labelled_series
from greyhound.analytics.verify import BocdV, VerifyConfig, bocdv_changepoints


def _step(levels, length=40, jitter=0.0, seed=0):
    rng = np.random.default_rng(seed)
    x = np.concatenate([np.full(length, level) for level in levels])
    return x * np.exp(rng.normal(0, jitter, len(x))) if jitter else x


def test_bocdv_exact_on_a_clean_step_and_recovery():
    x = _step([1.0, 1.5, 1.0], length=30)
    cps = bocdv_changepoints(x)
    assert [(c.index, c.detected_at) for c in cps] == [(30, 33), (60, 63)]
    assert [c.before for c in cps] == [1.0, 1.5]
    assert [c.after for c in cps] == [1.5, 1.0]
    assert cps[0].ratio == 1.5 and cps[1].ratio == pytest.approx(2 / 3)


def test_constant_series_has_no_change():
    x = np.full(300, 0.7)
    assert bocdv_changepoints(x) == []
    assert bocd_changepoints(x) == []


def test_single_spikes_are_not_change_points():
    x = _step([1.0], length=400, jitter=0.01, seed=1)
    x[[100, 200, 201, 300]] *= [2.0, 1.8, 1.7, 3.0]  # GC pauses, one of them doubled
    assert bocdv_changepoints(x) == []


@pytest.mark.parametrize("burst", [
    [2.0], [1.8, 1.7], [3.0, 3.0, 3.0],  # GC pauses, eval / checkpoint iterations
    [2.0, 1.5, 1.4],  # a GC pause and 2 slow iterations after it
    [1.2, 1.15, 1.25],  # a mild 3-iteration burst, just over 10%
])
def test_disturbances_of_up_to_three_iterations_are_no_change(burst):
    x = _step([1.0], length=300, jitter=0.01, seed=7)
    for at in (60, 120, 180, 240):
        x[at : at + len(burst)] *= burst
    assert bocdv_changepoints(x) == []


def test_a_disturbance_after_a_small_benign_shift_is_no_change():
    # +5% (benign) and, 2 iterations later, a GC pause with 2 slow iterations.
    x = _step([1.0, 1.05], length=100, jitter=0.003, seed=8)
    x[102:105] *= [2.4, 1.3, 1.25]
    assert bocdv_changepoints(x) == []


def test_four_iterations_are_a_regime_reported_on_the_fourth():
    x = np.array([1.0] * 50 + [1.5] * 5 + [1.0] * 50)
    cps = bocdv_changepoints(x)
    assert [(c.index, c.detected_at, c.ratio) for c in cps] == [(50, 53, 1.5), (55, 58, 1 / 1.5)]
    # A 3-iteration disturbance is none.
    assert bocdv_changepoints(np.array([1.0] * 50 + [1.5] * 3 + [1.0] * 50)) == []


def test_a_partial_first_iteration_is_no_baseline():
    # The trace: iteration 0 is partial (0.151 s), the rest about 0.19 s.
    x = _step([0.19], length=200, jitter=0.005, seed=9)
    x[0] = 0.151
    assert bocdv_changepoints(x) == []
    x[120:] *= 1.3
    (cp,) = bocdv_changepoints(x)
    assert (cp.index, cp.detected_at) == (120, 123)
    assert cp.before == pytest.approx(0.19, rel=0.01)
    # Slow warm-up iterations: the regime restarts after them, no change reported.
    y = _step([1.0], length=200, jitter=0.005, seed=10)
    y[:3] *= [4.0, 2.0, 1.5]
    assert bocdv_changepoints(y) == []


def test_dwelling_on_a_mode_of_the_mix_is_no_new_level():
    # Two sequence-length buckets 15% apart, drawn at random (30% the long one):
    # runs of 4 or more long batches come by chance, but that level is no news.
    rng = np.random.default_rng(12)
    x = np.where(rng.random(3000) < 0.3, 1.15, 1.0) * np.exp(rng.normal(0, 0.005, 3000))
    runs = np.convolve(x > 1.1, np.ones(4), mode="valid") == 4
    assert runs.sum() >= 5  # the case is there
    assert [c for c in bocdv_changepoints(x) if c.ratio > 1] == []
    # A fail-slow to a level the job never visited is still found.
    x[2000:] *= 1.5
    assert any(2000 <= c.index <= 2006 and c.ratio > 1.3 for c in bocdv_changepoints(x))


def test_benign_shift_is_flagged_by_bocd_and_rejected_by_verification():
    x = _step([1.0, 1.05], length=200, jitter=0.003, seed=2)
    plain = bocd_changepoints(x)
    assert any(195 <= c.index <= 205 for c in plain)
    assert bocdv_changepoints(x) == []


@pytest.mark.parametrize("factor", [1.12, 1.3, 2.0])
def test_fail_slow_detected_within_three_iterations(factor):
    x = _step([1.0, factor, 1.0], length=100, jitter=0.01, seed=3)
    cps = bocdv_changepoints(x)
    assert len(cps) == 2
    onset, recovery = cps
    assert onset.index == 100 and onset.detected_at - 100 <= 3
    assert onset.ratio == pytest.approx(factor, rel=0.03)
    assert recovery.index == 200 and recovery.ratio == pytest.approx(1 / factor, rel=0.03)


def test_ramp_is_detected_before_it_ends_at_full_level():
    rng = np.random.default_rng(4)
    x = np.ones(300)
    x[100:130] = np.linspace(1.0, 1.3, 31)[1:]
    x[130:] = 1.3
    x *= np.exp(rng.normal(0, 0.01, 300))
    cps = bocdv_changepoints(x)
    # The ramp may be reported in steps of >= 10%; the first comes while it climbs.
    assert 100 <= cps[0].index and cps[0].detected_at < 130
    assert all(c.ratio >= 1.1 for c in cps)
    intervals = slow_intervals(x, cps)
    assert len(intervals) == 1
    assert intervals[0].start_index == cps[0].index and intervals[0].end_index is None
    assert intervals[0].slowdown == pytest.approx(1.3, rel=0.05)


def test_batch_equals_online():
    x, _ = iteration_series(np.random.default_rng(5), num_iterations=800, num_fail_slows=2)
    online = BocdV()
    streamed = [cp for cp in map(online.update, x.tolist()) if cp is not None]
    assert streamed == bocdv_changepoints(x)
    plain = PlainBocd()
    assert [cp for cp in map(plain.update, x.tolist()) if cp is not None] == bocd_changepoints(x)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.sampled_from([0.01, 0.37, 8.0, 1000.0]))
def test_change_points_do_not_depend_on_the_time_unit(seed, scale):
    x, _ = iteration_series(
        np.random.default_rng(seed), num_iterations=400, num_fail_slows=1, base=1.0
    )
    a = [(c.index, c.detected_at) for c in bocdv_changepoints(x)]
    b = [(c.index, c.detected_at) for c in bocdv_changepoints(x * scale)]
    assert a == b


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), cap=st.integers(4, 40))
def test_posterior_stays_normalised_and_truncated(seed, cap):
    rng = np.random.default_rng(seed)
    post = RunLengthPosterior(BocdConfig(max_hypotheses=cap))
    y = np.log(_step([1.0, 1.4, 0.9], length=60, jitter=0.02, seed=seed))
    for value in y:
        post.update(float(value))
        assert post.num_hypotheses <= cap
        assert post.probs.sum() == pytest.approx(1.0)
        starts = post.starts
        assert len(set(starts.tolist())) == len(starts)
        assert starts.min() >= 0 and starts.max() == post.t  # the newest start is kept
    del rng


def _reference_posterior(y, config):
    """Untruncated BOCD written out per hypothesis, with scipy's Student-t."""
    c = config
    h = 1.0 / c.expected_run
    sigma = c.noise_default
    beta0 = c.alpha0 * sigma**2
    scale0 = math.sqrt(beta0 * (c.kappa0 + 1) / (c.alpha0 * c.kappa0))
    logpred0 = stats.t.logpdf(0.0, df=2 * c.alpha0, scale=scale0)
    hyps = []  # [start, kappa, mu, alpha, beta_data, prob]
    for t, value in enumerate(y):
        grown = []
        for start, kappa, mu, alpha, beta_data, prob in hyps:
            scale = math.sqrt((beta0 + beta_data) * (kappa + 1) / (alpha * kappa))
            pred = math.exp(stats.t.logpdf(value, df=2 * alpha, loc=mu, scale=scale))
            pred = (1 - c.outlier_prob) * pred + c.outlier_prob * math.exp(logpred0)
            z = min(max(value - mu, -c.clip * scale), c.clip * scale)
            grown.append([
                start, kappa + 1, mu + z / (kappa + 1), alpha + 0.5,
                beta_data + kappa * z * z / (2 * (kappa + 1)), prob * pred * (1 - h),
            ])
        new_prob = (h if hyps else 1.0) * math.exp(logpred0)
        grown.append([t, c.kappa0 + 1, value, c.alpha0 + 0.5, 0.0, new_prob])
        total = sum(g[5] for g in grown)
        hyps = [g[:5] + [g[5] / total] for g in grown]
    return {g[0]: g[5] for g in hyps}


def test_vectorised_posterior_matches_a_per_hypothesis_reference():
    config = BocdConfig(
        max_hypotheses=1000, prune_log=-700.0, noise_min_samples=1000, expected_run=20.0
    )
    y = np.log(_step([1.0, 1.2, 1.1], length=12, jitter=0.03, seed=6))
    post = RunLengthPosterior(config)
    for value in y:
        post.update(float(value))
    expected = _reference_posterior(y, config)
    got = dict(zip(post.starts.tolist(), post.probs.tolist()))
    assert set(got) == set(expected)
    for start, prob in expected.items():
        assert got[start] == pytest.approx(prob, rel=1e-9, abs=1e-300)


def test_labelled_jobs_are_classified_correctly():
    # Seeds different from the benchmark's; small jobs so the test stays fast.
    jobs = labelled_series(np.random.default_rng(11), num_jobs=8, min_iterations=400, max_iterations=600)
    for x, truth in jobs:
        cps = bocdv_changepoints(x)
        slow = [c for c in cps if c.ratio > 1]
        if not truth.positive:
            assert slow == []
            continue
        for fs in truth.fail_slows:
            hits = [c for c in slow if fs.onset - 3 <= c.index <= fs.end and c.detected_at < fs.end]
            assert hits, f"missed {fs}"


def test_config_is_validated():
    with pytest.raises(ValueError, match="threshold"):
        BocdConfig(threshold=1.5)
    with pytest.raises(ValueError, match="expected_run"):
        BocdConfig(expected_run=0.5)
    with pytest.raises(ValueError, match="min_change"):
        VerifyConfig(min_change=0.0)
    with pytest.raises(ValueError, match="max_pending"):
        VerifyConfig(min_after=5, max_pending=3)
    with pytest.raises(ValueError, match="hold_newest"):
        VerifyConfig(hold_newest=0)
    with pytest.raises(ValueError, match="min_before"):
        VerifyConfig(min_before=0)
    with pytest.raises(ValueError, match="max_visited"):
        VerifyConfig(max_visited=0.0)


def test_bad_iteration_times_are_refused():
    with pytest.raises(ValueError, match="finite and > 0"):
        bocdv_changepoints(np.array([1.0, -1.0]))
    with pytest.raises(ValueError, match="finite and > 0"):
        BocdV().update(float("nan"))
    with pytest.raises(ValueError, match="1-D"):
        bocdv_changepoints(np.ones((2, 2)))
