"""ACF period and iteration times from call sequences (greyhound.analytics.period)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from greyhound.analytics.period import (
    call_tokens,
    find_period,
    iteration_times_from_calls,
    iteration_times_from_ring_records,
    lag_agreement,
)
from greyhound.analytics.synthetic import FailSlow, call_trace


def _minimal_period(pattern: list[int]) -> int:
    """Brute force: the smallest p such that the pattern is a rotation-invariant repeat."""
    n = len(pattern)
    for p in range(1, n + 1):
        if n % p == 0 and pattern == pattern[:p] * (n // p):
            return p
    return n


def _brute_kappa(tokens: np.ndarray, lag: int) -> float:
    n = len(tokens)
    agree = np.mean(tokens[: n - lag] == tokens[lag:])
    p = np.bincount(tokens) / n
    chance = float(np.sum(p * p))
    return (agree - chance) / (1 - chance)


def test_tokens_distinguish_every_field():
    op = np.array([0, 0, 1, 1, 0])
    comm = np.array([5, 5, 5, 7, 5])
    nbytes = np.array([8, 16, 8, 8, 8])
    tokens, k = call_tokens(op, comm, nbytes)
    assert k == 4
    assert tokens[0] == tokens[4]
    assert len(set(tokens[:4].tolist())) == 4
    tokens, k = call_tokens(op, comm)
    assert k == 3 and tokens[0] == tokens[1] == tokens[4]


def test_simple_cycle_has_its_length_as_period():
    tokens = np.array([0, 1, 2] * 5)
    assert find_period(tokens, 3) == 3
    kappa = lag_agreement(tokens, 3, max_lag=6)
    assert kappa[0] == 1.0 and kappa[3] == pytest.approx(1.0) and kappa[6] == pytest.approx(1.0)
    assert kappa[1] == pytest.approx(-0.5)  # never agrees: (0 - 1/3) / (1 - 1/3)


def test_one_op_per_iteration_is_period_one():
    # A DDP job with one gradient bucket: a single AllReduce per iteration.
    assert find_period(np.zeros(10, dtype=np.int64), 1) == 1


def test_tensor_parallel_burst_does_not_win_at_lag_one():
    # 96 identical TP AllReduces + 4 others per iteration: 95% of neighbours agree.
    pattern = [0] * 96 + [1, 2, 3, 4]
    tokens = np.array(pattern * 10)
    assert np.mean(tokens[1:] == tokens[:-1]) > 0.95
    assert find_period(tokens, 5) == 100


@pytest.mark.parametrize("microbatches", [32, 128])
def test_many_microbatches_do_not_win_over_the_iteration(microbatches):
    # Send/Recv per micro-batch, then the DP ReduceScatter/AllGather.
    pattern = [1, 2] * microbatches + [3, 4]
    assert find_period(np.array(pattern * 6), 5) == len(pattern)


def test_long_bursts_of_one_call_do_not_win_at_lag_one():
    # 16 micro-batches x 8 layers of the same TP AllReduce, forward then backward.
    pattern = [0] * 128 + [1] * 128 + [2, 3, 4]
    tokens = np.array(pattern * 6)
    assert lag_agreement(tokens, 5, max_lag=1)[1] > 0.95
    assert find_period(tokens, 5) == len(pattern)


def test_a_rare_evaluation_step_does_not_stretch_the_period():
    # Every 50th iteration (of 20 calls) ends with an extra Barrier + AllReduce.
    iteration = [0, 1, 2, 0, 3, 1, 1, 2, 0, 0, 3, 2, 1, 0, 2, 3, 3, 0, 1, 2]
    tokens = np.array((iteration * 50 + [4, 0]) * 3)
    assert find_period(tokens, 5) == len(iteration)
    # Also when the iteration holds a burst that alone reaches 0.95 at lag 1.
    burst = [0] * 200 + [1, 2, 3]
    tokens = np.array((burst * 50 + [4, 1]) * 3)
    assert find_period(tokens, 5) == len(burst)


def test_aperiodic_sequence_has_no_period():
    tokens = np.random.default_rng(3).integers(0, 4, 400)
    assert find_period(tokens, 4) is None


def test_threshold_is_validated():
    with pytest.raises(ValueError, match="threshold"):
        find_period(np.zeros(4, dtype=np.int64), 1, threshold=1.5)


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 5), min_size=5, max_size=60),
    lag=st.integers(1, 4),
)
def test_fft_agreement_matches_brute_force(tokens, lag):
    tokens = np.array(tokens)
    _, tokens = np.unique(tokens, return_inverse=True)
    k = int(tokens.max()) + 1
    if k == 1:
        assert np.all(lag_agreement(tokens, k, max_lag=lag) == 1.0)
        return
    lag = min(lag, len(tokens) - 1)
    assert lag_agreement(tokens, k, max_lag=lag)[lag] == pytest.approx(
        _brute_kappa(tokens, lag), abs=1e-9
    )


@settings(max_examples=60, deadline=None)
@given(
    pattern=st.lists(st.integers(0, 6), min_size=1, max_size=30),
    repeats=st.integers(6, 12),
    warmup=st.lists(st.integers(7, 9), max_size=5),
)
def test_period_of_a_repeated_pattern_after_warmup(pattern, repeats, warmup):
    period = _minimal_period(pattern)
    # At least 40 periodic calls: the warm-up is then under a fifth of the trace.
    repeats = max(repeats, -(-40 // len(pattern)))
    tokens = np.array(warmup + pattern * repeats)
    zeros = np.zeros(len(tokens), dtype=np.int64)
    calls = iteration_times_from_calls(tokens, zeros, zeros, np.arange(len(tokens), dtype=float))
    assert calls.period == period
    assert calls.start <= len(warmup)
    # One call per second: every iteration takes `period` seconds.
    np.testing.assert_allclose(calls.iteration_times, float(period))


def test_iteration_times_exact_on_a_tiny_trace():
    # A warm-up Broadcast, then 6 iterations of (AllReduce, AllGather) that start at
    # 10, 11, 12, 14, 16, 17 s; each call 0.1 and 0.5 s into its iteration.
    op = np.array([9] + [0, 1] * 6)
    comm = np.array([0] + [1] * 12)
    nbytes = np.array([4] + [8] * 12)
    starts = [10.0, 11.0, 12.0, 14.0, 16.0, 17.0]
    t = np.array([9.0] + [s + d for s in starts for d in (0.1, 0.5)])
    calls = iteration_times_from_calls(op, comm, nbytes, t)
    assert calls.period == 2
    assert calls.start == 1
    np.testing.assert_allclose(calls.iteration_times, [1.0, 1.0, 2.0, 2.0, 1.0])
    # Known when the next iteration's first call comes.
    np.testing.assert_allclose(calls.available_at, [11.1, 12.1, 14.1, 16.1, 17.1])
    np.testing.assert_array_equal(calls.first_call, [1, 3, 5, 7, 9])


def test_a_late_call_does_not_move_its_iteration():
    op = np.tile([0, 1, 2], 6)
    t = np.repeat(np.arange(6.0), 3) + np.tile([0.1, 0.2, 0.3], 6)
    t[7] += 0.05  # one call of iteration 2 starts late
    calls = iteration_times_from_calls(op, np.zeros(18), np.zeros(18), t)
    np.testing.assert_allclose(calls.iteration_times, 1.0)


def test_bytes_that_vary_fall_back_to_op_and_comm():
    rng = np.random.default_rng(0)
    n_iter = 30
    op = np.tile([0, 1, 2], n_iter)
    comm = np.tile([1, 1, 2], n_iter)
    nbytes = rng.integers(1, 10_000, 3 * n_iter)  # sequence lengths change every call
    t = np.arange(3 * n_iter) / 3.0
    calls = iteration_times_from_calls(op, comm, nbytes, t)
    assert calls.period == 3 and not calls.tokens_use_bytes
    np.testing.assert_allclose(calls.iteration_times, 1.0)


def test_no_period_gives_no_iterations():
    rng = np.random.default_rng(1)
    n = 300
    calls = iteration_times_from_calls(
        rng.integers(0, 5, n), rng.integers(0, 3, n), rng.integers(0, 4, n), np.arange(n, dtype=float)
    )
    assert calls.period is None and len(calls.iteration_times) == 0


def test_ring_records_are_read_by_field_name():
    dtype = np.dtype([("op", "<u2"), ("comm_id", "<u8"), ("size_bytes", "<u8"), ("t_start_ns", "<u8")])
    rec = np.zeros(8, dtype=dtype)
    rec["op"] = [1, 3] * 4
    rec["comm_id"] = 0xABC
    rec["size_bytes"] = 1 << 20
    rec["t_start_ns"] = [int(1e9 * (i // 2) * 0.5 + 1e8 * (i % 2)) for i in range(8)]
    calls = iteration_times_from_ring_records(rec)
    assert calls.period == 2
    np.testing.assert_allclose(calls.iteration_times, 0.5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_generated_trace_iteration_times_are_close_to_truth(seed):
    trace, truth = call_trace(np.random.default_rng(seed), num_iterations=120, eval_every=40)
    calls = iteration_times_from_calls(trace.op, trace.comm, trace.nbytes, trace.time)
    assert calls.period == truth.calls_per_iteration
    assert calls.start == 120  # the warm-up calls
    # Eval iterations add 2 calls, so blocks drift from iteration boundaries; the
    # mean over the trace still matches.
    true_mean = truth.iteration_times.mean()
    assert calls.iteration_times.mean() == pytest.approx(true_mean, rel=0.02)


def test_generated_trace_shows_a_fail_slow():
    fs = FailSlow(onset=60, end=100, factor=1.5, ramp=0)
    trace, truth = call_trace(np.random.default_rng(4), num_iterations=150, fail_slows=(fs,))
    times = iteration_times_from_calls(trace.op, trace.comm, trace.nbytes, trace.time).iteration_times
    assert np.median(times[65:95]) / np.median(times[10:50]) == pytest.approx(1.5, rel=0.03)
