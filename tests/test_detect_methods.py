"""Every detection method is one online Detector; the analytics run without the
compiled kernel; the BOCD constants have one source."""

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from greyhound.analytics.baselines import WindowDetector, window_changepoints
from greyhound.analytics.bocd import BocdConfig, derived_constants
from greyhound.analytics.detect import METHODS, detect_series, make_detector, slow_spans
from greyhound.analytics.scenarios import ring_records
from greyhound.analytics.synthetic import FailSlow, call_trace, labelled_series
from greyhound.analytics.tracker import RankTracker
from greyhound.analytics.verify import HAVE_KERNEL, BocdV, CompiledBocdV, ReferenceBocdV


def _splits(rng, n):
    cuts = np.sort(rng.integers(0, n + 1, int(rng.integers(0, 12))))
    return [0, *cuts.tolist(), n]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_is_a_detector_whatever_the_batches(method):
    jobs = labelled_series(np.random.default_rng(4), num_jobs=6, min_iterations=300,
                           max_iterations=700)
    rng = np.random.default_rng(9)
    found = 0
    for x, _ in jobs:
        want = list(detect_series(x, method=method).changepoints)
        one_by_one = make_detector(method)
        assert [cp for cp in map(one_by_one.update, x.tolist()) if cp is not None] == want
        batches = make_detector(method)
        bounds = _splits(rng, len(x))
        got = [cp for lo, hi in zip(bounds, bounds[1:]) for cp in batches.feed(x[lo:hi])]
        assert got == want
        found += len(want)
    assert found >= 3  # the series do hold changes


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match=r"^method must be one of bocd\+v, bocd, window, got 'x'$"):
        make_detector("x")
    with pytest.raises(ValueError, match="method must be one of"):
        detect_series(np.ones(5), method="x")


def test_window_detector_exact_on_a_step_and_its_bad_input():
    x = np.repeat([1.0, 1.3], [40, 40])
    (cp,) = window_changepoints(x, window=10)
    assert (cp.index, cp.detected_at, cp.before, cp.after) == (40, 44, 1.0, 1.3)
    detector = WindowDetector(window=10)
    assert detector.feed(x[:42]) == [] and detector.feed(x[42:]) == [cp]
    with pytest.raises(ValueError, match=r"^iteration time must be finite and > 0, got 0.0$"):
        detector.update(0.0)
    with pytest.raises(ValueError, match=r"^window must be >= 1, got 0$"):
        WindowDetector(window=0)
    with pytest.raises(ValueError, match=r"^band must be in \(0, 1\), got 1.0$"):
        WindowDetector(band=1.0)


def test_bocd_constants_have_one_source():
    # The posterior and the kernel take every derived value from derived_constants:
    # changing it changes both, the same way.
    c = BocdConfig(expected_run=40.0, outlier_prob=0.05, kappa0=0.3, alpha0=2.0,
                   prune_log=-10.0)
    k = derived_constants(c)
    assert k.log_h == math.log(1 / 40.0) and k.log_1mh == math.log1p(-1 / 40.0)
    assert k.prune_factor == math.exp(-10.0)
    assert (k.kappa_first, k.alpha_first) == (1.3, 2.5)
    x = np.repeat([1.0, 1.4, 1.0], [60, 40, 60]) * np.exp(
        np.random.default_rng(1).normal(0, 0.01, 160))
    if HAVE_KERNEL:
        kernel = CompiledBocdV(bocd=c)
        reference = ReferenceBocdV(bocd=c)
        assert kernel.feed(x) == reference.feed(x)
        a, b = kernel.posterior_state(), reference.posterior_state()
        np.testing.assert_array_equal(a.starts, b.starts)
        np.testing.assert_allclose(a.probs, b.probs, rtol=1e-9)


def _tracked():
    """The node agent's tracker on a call trace with a fail-slow: its change points."""
    fs = FailSlow(onset=100, end=200, factor=1.5, ramp=0)
    trace, _ = call_trace(np.random.default_rng(2), num_iterations=200, fail_slows=(fs,))
    tracker = RankTracker()
    tracker.feed(ring_records(trace))
    tracker.finish()
    return [[c.index, c.detected_at] for c in tracker.detection().changepoints]


# A finder that refuses the compiled kernel, as an install that skipped the build.
_BLOCK_KERNEL = """
import importlib.abc, sys
class _NoKernel(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "greyhound.analytics._bocdv":
            raise ImportError("blocked by the test")
        return None
sys.meta_path.insert(0, _NoKernel())
"""


def test_the_analytics_run_without_the_compiled_kernel():
    script = _BLOCK_KERNEL + textwrap.dedent("""
        import json
        import numpy as np
        import greyhound.analytics
        from greyhound.analytics import verify
        from greyhound.analytics.detect import METHODS, detect_series
        from greyhound.analytics.synthetic import labelled_series
        from tests.test_detect_methods import _tracked
        assert "greyhound.analytics._bocdv" not in sys.modules
        jobs = labelled_series(np.random.default_rng(4), num_jobs=3, min_iterations=300,
                               max_iterations=500)
        out = {"have_kernel": verify.HAVE_KERNEL, "bocdv": verify.BocdV.__name__,
               "tracker": _tracked(),
               "changepoints": [[[c.index, c.detected_at, c.before, c.after]
                                 for c in detect_series(x, method=m).changepoints]
                                for x, _ in jobs for m in METHODS]}
        print(json.dumps(out))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parents[1])
    got = json.loads(run.stdout)
    assert got["have_kernel"] is False
    assert got["bocdv"] == "ReferenceBocdV"
    assert got["tracker"] == _tracked() and got["tracker"]
    assert "cannot be imported: blocked by the test; run scripts/setup" in run.stderr
    jobs = labelled_series(np.random.default_rng(4), num_jobs=3, min_iterations=300,
                           max_iterations=500)
    want = [[[c.index, c.detected_at, c.before, c.after]
             for c in detect_series(x, method=m).changepoints] for x, _ in jobs for m in METHODS]
    # The same change points (levels to rounding: the kernel's exp/log may be libmvec's).
    assert [[cp[:2] for cp in cps] for cps in got["changepoints"]] == [
        [cp[:2] for cp in cps] for cps in want]
    np.testing.assert_allclose(
        [v for cps in got["changepoints"] for cp in cps for v in cp[2:]],
        [v for cps in want for cp in cps for v in cp[2:]], rtol=1e-12)
    assert sum(map(len, want)) >= 3


def test_the_kernel_is_used_where_it_is_built():
    assert HAVE_KERNEL, "the compiled kernel is not built: run scripts/setup"
    assert BocdV is CompiledBocdV


def test_slow_spans_place_a_jobs_slowdowns_on_its_clock_and_leave_an_unended_one_open():
    # 0.25 s steps, 2x for steps 100-159, then 1.2x from step 260 to the end.
    rng = np.random.default_rng(3)
    times = 0.25 * np.r_[np.full(100, 1.0), np.full(60, 2.0), np.full(100, 1.0), np.full(80, 1.2)]
    times *= 1 + 0.01 * rng.standard_normal(len(times))
    ends = 1000.0 + np.cumsum(times)
    spans = slow_spans(ends, times)
    assert len(spans) == 2, spans
    (a, b), (c, d) = spans
    assert a == pytest.approx(ends[99], abs=0.3) and b == pytest.approx(ends[160], abs=0.6)
    assert c == pytest.approx(ends[259], abs=0.6) and d is None
    with pytest.raises(ValueError, match="differ in shape"):
        slow_spans(ends[:-1], times)
