"""The compiled BOCD+V kernel (greyhound.analytics.verify.BocdV) against the Python
reference (ReferenceBocdV): same change points, same posterior, any batch split."""

import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import skip_for_hardware
from greyhound.analytics.bocd import BocdConfig
from greyhound.analytics.synthetic import labelled_series
from greyhound.analytics.verify import (
    BocdV,
    ReferenceBocdV,
    VerifyConfig,
    bocdv_changepoints,
)


def _reference(x, **configs):
    r = ReferenceBocdV(**configs)
    return [cp for cp in map(r.update, np.asarray(x).tolist()) if cp is not None], r


def _assert_same_changepoints(got, want):
    assert [(c.index, c.detected_at) for c in got] == [(c.index, c.detected_at) for c in want]
    for g, w in zip(got, want):
        assert g.before == pytest.approx(w.before, rel=1e-12)
        assert g.after == pytest.approx(w.after, rel=1e-12)


def _assert_same_posterior(kernel, reference, rel=1e-9):
    a, b = kernel.posterior_state(), reference.posterior_state()
    assert a.t == b.t
    np.testing.assert_array_equal(a.starts, b.starts)  # same hypotheses, same slots
    np.testing.assert_allclose(a.probs, b.probs, rtol=rel, atol=1e-300)
    assert a.noise_scale == pytest.approx(b.noise_scale, rel=1e-12)


def _libm_is_numpys():
    """Whether numpy's float64 exp/log/log1p are libm's here (no AVX-512 versions)."""
    x = np.random.default_rng(0).normal(0, 20, 4096)
    y = np.abs(x) + 1e-3
    return (
        all(np.exp(x) == [math.exp(v) for v in x])
        and all(np.log(y) == [math.log(v) for v in y])
        and all(np.log1p(y) == [math.log1p(v) for v in y])
    )


@pytest.mark.parametrize("exact_math", [False, True])
def test_labelled_jobs_give_the_references_change_points(exact_math):
    # The benchmark's generator with other seeds; scripts/bench_detect checks all 400.
    jobs = labelled_series(np.random.default_rng(7), num_jobs=60, min_iterations=300, max_iterations=900)
    found = 0
    for x, _ in jobs:
        kernel = BocdV(exact_math=exact_math)
        got = kernel.feed(x)
        want, reference = _reference(x)
        _assert_same_changepoints(got, want)
        _assert_same_posterior(kernel, reference)
        found += len(want)
    assert found >= 30  # the jobs do hold fail-slows: the comparison is not vacuous


def test_exact_math_posterior_is_bit_identical_to_the_reference():
    if not _libm_is_numpys():
        skip_for_hardware("AVX-512", "numpy's float64 exp/log are not libm's on this CPU")
    x, _ = labelled_series(np.random.default_rng(3), num_jobs=1, min_iterations=600, max_iterations=600)[0]
    kernel, reference = BocdV(exact_math=True), ReferenceBocdV()
    for value in x.tolist():
        assert kernel.update(value) == reference.update(value)
        a, b = kernel.posterior_state(), reference.posterior_state()
        np.testing.assert_array_equal(a.starts, b.starts)
        np.testing.assert_array_equal(a.probs, b.probs)
        assert a.noise_scale == b.noise_scale


def test_posterior_matches_step_by_step_with_untruncated_and_tiny_caps():
    rng = np.random.default_rng(11)
    x = np.concatenate([np.full(120, 1.0), np.full(80, 1.4), np.linspace(1.4, 2.0, 60)])
    x *= np.exp(rng.normal(0, 0.02, len(x)))
    x[[30, 150]] *= 2.5
    for bocd in (
        # > 128 hypotheses: numpy's pairwise sum recurses; the gammaln table grows.
        BocdConfig(max_hypotheses=300, prune_log=-700.0, expected_run=20.0),
        BocdConfig(max_hypotheses=2, noise_min_samples=1, noise_window=3),
    ):
        for exact_math in (False, True):
            kernel = BocdV(bocd=bocd, exact_math=exact_math)
            reference = ReferenceBocdV(bocd=bocd)
            for value in x.tolist():
                got, want = kernel.update(value), reference.update(value)
                _assert_same_changepoints([got] if got else [], [want] if want else [])
                _assert_same_posterior(kernel, reference, rel=1e-8)


@st.composite
def series(draw):
    """Spikes, steps, ramps, constant and noisy series at tiny to huge time scales."""
    n = draw(st.integers(1, 260))
    kind = draw(st.sampled_from(["constant", "steps", "spikes", "ramp", "mixed"]))
    scale = draw(st.sampled_from([1e-150, 1e-6, 0.37, 1.0, 60.0, 1e9, 1e150]))
    jitter = draw(st.sampled_from([0.0, 0.001, 0.01, 0.05]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = np.ones(n)
    if kind in ("steps", "mixed"):
        for at in rng.integers(0, n, rng.integers(1, 4)):
            x[at:] *= rng.uniform(0.5, 2.5)
    if kind in ("spikes", "mixed"):
        at = rng.integers(0, n, rng.integers(1, 6))
        x[at] *= rng.uniform(1.5, 4.0, len(at))
    if kind in ("ramp", "mixed"):
        a = int(rng.integers(0, n))
        b = min(n, a + int(rng.integers(5, 60)))
        x[a:b] *= np.linspace(1.0, rng.uniform(1.1, 1.6), b - a)
        x[b:] *= x[b - 1] if b < n and b > a else 1.0
    if kind != "constant":
        x *= np.exp(rng.normal(0, jitter, n))
    return x * scale


@settings(max_examples=60, deadline=None)
@given(x=series())
def test_generated_series_give_the_references_change_points(x):
    want, reference = _reference(x)
    for exact_math in (False, True):
        kernel = BocdV(exact_math=exact_math)
        _assert_same_changepoints(kernel.feed(x), want)
        _assert_same_posterior(kernel, reference)


@settings(max_examples=60, deadline=None)
@given(
    x=series(),
    cuts=st.lists(st.integers(0, 260), max_size=8),
    min_after=st.integers(1, 5),
    creep_every=st.integers(1, 5),
    before_window=st.sampled_from([1, 7, 50]),
    hold_newest=st.integers(1, 5),
    min_before=st.integers(1, 6),
    max_visited=st.sampled_from([0.01, 0.05, 0.5, 1.0]),
)
def test_any_batch_split_gives_the_one_batch_result(
    x, cuts, min_after, creep_every, before_window, hold_newest, min_before, max_visited
):
    verify = VerifyConfig(
        min_after=min_after, max_pending=max(min_after, 6), creep_every=creep_every,
        before_window=before_window, hold_newest=hold_newest, min_before=min_before,
        max_visited=max_visited,
    )
    whole = BocdV(verify=verify).feed(x)
    split = BocdV(verify=verify)
    got = []
    bounds = [0, *sorted(c for c in cuts if c <= len(x)), len(x)]
    for lo, hi in zip(bounds, bounds[1:]):
        got += split.feed(x[lo:hi])  # empty batches included
    assert got == whole
    assert split.count == len(x)
    _assert_same_changepoints(whole, _reference(x, verify=verify)[0])


def test_feed_takes_lists_and_strided_arrays():
    x = np.repeat([1.0, 1.5, 1.0], 40)
    want = bocdv_changepoints(x)
    assert [(c.index, c.detected_at) for c in want] == [(40, 43), (80, 83)]
    assert BocdV().feed(x.tolist()) == want
    assert BocdV().feed(np.repeat(x, 2)[::2]) == want
    assert BocdV().feed(x.astype(np.float32)) == want


def test_bad_input_is_refused_with_the_references_messages_and_no_state_change():
    kernel = BocdV()
    kernel.feed(np.ones(20))
    for bad, message in [
        (np.array([1.0, float("nan")]), r"^iteration times must be finite and > 0, got np.float64\(nan\) at 1$"),
        (np.array([1.0, 1.0, 0.0]), r"^iteration times must be finite and > 0, got np.float64\(0.0\) at 2$"),
        (np.array([-1.0]), r"finite and > 0, got np.float64\(-1.0\) at 0$"),
        (np.ones((2, 2)), r"^iteration times must be 1-D, got shape \(2, 2\)$"),
    ]:
        with pytest.raises(ValueError, match=message):
            kernel.feed(bad)
        with pytest.raises(ValueError, match=message):
            bocdv_changepoints(bad)
    for bad in (float("nan"), float("inf"), 0.0, -2.0):
        with pytest.raises(ValueError) as got:
            kernel.update(bad)
        with pytest.raises(ValueError) as want:
            ReferenceBocdV().update(bad)
        assert str(got.value) == str(want.value)
    with pytest.raises(TypeError):
        kernel.update("fast")
    # Nothing was added: the detector goes on as if the bad input never came.
    assert kernel.count == 20
    x = np.repeat([1.0, 1.6], 30)
    fresh = BocdV()
    fresh.feed(np.ones(20))
    assert kernel.feed(x) == fresh.feed(x) and len(kernel.feed(x)) >= 1


def test_pending_candidate_is_the_references():
    x = np.repeat([1.0, 1.05, 1.05], [60, 2, 10]) * np.exp(
        np.random.default_rng(2).normal(0, 0.003, 72)
    )
    kernel, reference = BocdV(), ReferenceBocdV()
    seen = set()
    for value in x.tolist():
        kernel.update(value)
        reference.update(value)
        assert kernel.pending == reference.pending
        seen.add(kernel.pending)
    assert len(seen) > 1  # a candidate was pending at some point


def test_the_extension_is_built_and_imported_from_the_package():
    # A fresh process (not this one's import state): the editable install serves the
    # compiled module from greyhound/analytics/.
    out = subprocess.run(
        [sys.executable, "-c",
         "import greyhound.analytics._bocdv as m; print(m.__file__); print(m.VECTOR_MATH)"],
        capture_output=True, text=True, check=True, cwd="/",
    ).stdout.split()
    assert out[0].endswith(".so") and "greyhound/analytics/_bocdv" in out[0]
    assert out[1] in ("libm", "libmvec-avx2")
    assert BocdV().math == out[1] and BocdV(exact_math=True).math == "libm"
