"""The node agent's per-rank tracker (greyhound.analytics.tracker) and its clock
(greyhound.analytics.period.IterationClock)."""

import json
import signal
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from greyhound import ring
from greyhound.analytics.detect import detect_series
from greyhound.analytics.period import (
    ClockConfig,
    IterationClock,
    collect_steps,
    iteration_times_from_calls,
    iteration_times_from_ring_records,
)
from greyhound.analytics.scenarios import labelled_set, render_calls, ring_records
from greyhound.analytics.synthetic import CallTrace, FailSlow, call_trace
from greyhound.analytics.tracker import ARRIVAL_DTYPE, COMM_TIME_DTYPE, RankTracker, TrackerConfig
from greyhound.cli import main
from greyhound.detect_cli import read_detect_input


def _feed_in_batches(tracker, records, rng, max_batches=60):
    cuts = np.sort(rng.integers(0, len(records) + 1, int(rng.integers(0, max_batches))))
    bounds = [0, *cuts.tolist(), len(records)]
    updates = [tracker.feed(records[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
    updates.append(tracker.finish())
    return updates


def _records(x, *, seed=0, layout="ddp", async_fraction=0.3, **render):
    rng = np.random.default_rng(seed)
    trace, _ = render_calls(rng, x, layout=layout, **render)
    return ring_records(trace, rng=rng, async_fraction=async_fraction)


def CallTraceOf(op, comm, nbytes, t):
    return CallTrace(op=op, comm=comm, nbytes=nbytes, time=t)


def _csv(records, path):
    calls = ring.call_records(records)
    names = ring.op_names(calls)
    lines = ["time,op,comm,bytes"]
    for t, op, comm, nbytes in zip(calls["t_start_ns"], names, calls["comm_id"], calls["size_bytes"]):
        lines.append(f"{float(int(t) * 1e-9)!r},{op},{int(comm):#x},{int(nbytes)}")
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- the tracker gives greyhound detect's answer, however the calls come --------------


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_give_the_whole_trace_answer_and_greyhound_detects(seed, tmp_path):
    rng = np.random.default_rng(100 + seed)
    jobs = labelled_set(split="tune", jobs_per_generator=1, generators=("gc_bursts", "steps"),
                        seed=seed, positive_fraction=1.0, min_iterations=300,
                        max_iterations=600)
    for job in jobs:
        layout = ("ddp", "hybrid")[seed % 2]
        records = _records(job.x, seed=seed, layout=layout, pause=job.truth.pause)
        online = RankTracker()
        updates = _feed_in_batches(online, records, rng)
        whole = RankTracker()
        whole.feed(records)
        whole.finish()
        calls = iteration_times_from_ring_records(ring.call_records(records))
        batch = detect_series(calls.iteration_times)
        assert online.period == whole.period == calls.period
        np.testing.assert_array_equal(online.iteration_times, calls.iteration_times)
        np.testing.assert_array_equal(whole.iteration_times, calls.iteration_times)
        assert online.changepoints == whole.changepoints == batch.changepoints
        assert online.detection() == whole.detection() == batch
        # The updates carried exactly the series and the change points, in order.
        np.testing.assert_array_equal(
            np.concatenate([u.iteration_times for u in updates]), calls.iteration_times
        )
        assert [cp for u in updates for cp in u.changepoints] == list(batch.changepoints)
        assert [u.first_iteration for u in updates if len(u.iteration_times)] == sorted(
            u.first_iteration for u in updates if len(u.iteration_times)
        )
        # greyhound detect on the rank's calls exported to CSV: the same JSON.
        out = CliRunner().invoke(main, ["detect", "--json", str(_csv(records, tmp_path / "t.csv"))])
        assert out.exit_code == 0, out.output
        got = json.loads(out.output)
        assert got["period"] == online.period and got["iterations"] == online.num_iterations
        assert got["changepoints"] == [cp.as_dict() for cp in online.changepoints]
        assert got["slow_intervals"] == [si.as_dict() for si in online.slow_intervals()]
        assert got["fail_slow"] is online.fail_slow


def test_updates_report_iterations_when_their_calls_are_in():
    x = np.full(300, 0.5)
    records = _records(x, async_fraction=0.0, layout="hybrid")
    tracker = RankTracker()
    seen = 0
    for k in range(len(records)):
        update = tracker.feed(records[k : k + 1])
        if len(update.iteration_times):
            # Never a time from a call that has not arrived.
            assert int(update.available_at_ns.max()) <= int(records["t_start_ns"][k])
            assert update.first_iteration == seen
            seen += len(update.iteration_times)
    assert seen == tracker.num_iterations >= 290


# ---- the cases ----------------------------------------------------------------


def test_a_partial_first_iteration_is_no_fail_slow_and_an_injection_is_found():
    # Rank 0 of the reference job: the first iteration 0.151 s, the rest about 0.19 s;
    # a compute injection (1.4x) on iterations 150-199.
    rng = np.random.default_rng(7)
    x = 0.19 * np.exp(rng.normal(0, 0.01, 260))
    x[0] = 0.151
    healthy = RankTracker()
    _feed_in_batches(healthy, _records(x, layout="ddp"), rng)
    assert healthy.changepoints == () and not healthy.fail_slow
    assert healthy.detection().baseline_iteration_time == pytest.approx(0.19, rel=0.02)
    x[150:200] *= 1.4
    tracker = RankTracker()
    _feed_in_batches(tracker, _records(x, layout="ddp"), rng)
    onset, recovery = tracker.changepoints
    assert (onset.index, onset.detected_at) == (150, 153)
    assert (recovery.index, recovery.detected_at) == (200, 203)
    (interval,) = tracker.slow_intervals()
    assert (interval.start_index, interval.end_index) == (150, 200)
    assert interval.slowdown == pytest.approx(1.4, rel=0.03)


def test_a_candidate_change_is_pending_from_its_first_slow_iterations_until_it_is_accepted():
    # What the agent's polls in between key on: the detector weighs the 1.4x step at
    # 150 before it accepts it at 153 (its 4th slow iteration), and nothing is pending
    # while the series is steady.
    rng = np.random.default_rng(7)
    x = 0.19 * np.exp(rng.normal(0, 0.01, 200))
    x[150:] *= 1.4
    records = _records(x, layout="ddp")
    tracker, pending = RankTracker(), {}
    for lo in range(0, len(records), 7):          # a few calls at a time: every iteration seen
        tracker.feed(records[lo:lo + 7])
        pending.setdefault(tracker.num_iterations, tracker.pending_change)
    (onset,) = tracker.changepoints
    assert (onset.index, onset.detected_at) == (150, 153)
    assert all(pending[n] is None for n in range(40, 150) if n in pending)
    assert {pending.get(n) for n in (152, 153)} == {150}     # 2 and 3 slow iterations seen
    assert pending[max(pending)] is None


@pytest.mark.parametrize("layout", ["ddp", "hybrid"])
def test_brief_disturbances_are_no_fail_slow(layout):
    # A GC pause, an evaluation, a GC pause with 2 slow iterations after it, a
    # data-loader stall: 1-3 iterations each, every 40 iterations.
    rng = np.random.default_rng(8)
    x = np.exp(rng.normal(0, 0.01, 400))
    pause = np.zeros(400)
    for at, factors, point in [(50, [2.0], 1), (90, [3.0, 3.0], 2), (130, [2.2, 1.5, 1.4], 1),
                               (170, [1.8], 1), (210, [2.0, 1.6, 1.6], 1), (250, [4.0], 1)]:
        x[at : at + len(factors)] *= factors
        pause[at : at + point] = x[at : at + point] * (1 - 1 / np.array(factors[:point]))
    tracker = RankTracker()
    _feed_in_batches(tracker, _records(x, layout=layout, pause=pause), rng)
    assert [cp for cp in tracker.changepoints if cp.ratio > 1] == []
    assert not tracker.fail_slow


# ---- numbering ----------------------------------------------------------------------


def test_the_numbering_never_shifts_and_gives_the_hooks_call_numbers():
    trace, truth = call_trace(np.random.default_rng(3), num_iterations=120, warmup_calls=30)
    records = ring_records(trace)
    p = truth.calls_per_iteration
    tracker = RankTracker()
    promised = {}
    for lo in range(0, len(records), 97):
        tracker.feed(records[lo : lo + 97])
        if tracker.locked:
            # A future iteration's first call, asked ahead of time, is where it starts.
            k = tracker.num_iterations + 5
            promised.setdefault(k, tracker.call_number_of_iteration(k))
    assert tracker.period == p
    for k, number in promised.items():
        assert number == 30 + k * p + 1  # the hook numbers calls 1, 2, ...
        assert tracker.iteration_of_call_number(number) == k
        assert tracker.iteration_of_call_number(number - 1) == k - 1
    arrivals = tracker.arrivals()
    assert arrivals.dtype == ARRIVAL_DTYPE
    np.testing.assert_array_equal(arrivals["call_number"], np.arange(1, len(trace.op) + 1))
    body = arrivals[arrivals["iteration"] >= 0]
    np.testing.assert_array_equal(body["iteration"], (np.arange(len(body))) // p)
    np.testing.assert_array_equal(body["position"], np.arange(len(body)) % p)
    assert np.all(arrivals["iteration"][:30] == -1)  # the warm-up


def test_a_new_pattern_is_locked_again_and_the_numbers_go_on():
    # 300 iterations of one layout, then a re-split (another pattern, 80 iterations).
    a, _ = call_trace(np.random.default_rng(1), num_iterations=300, tp=2, pp=2, microbatches=4, warmup_calls=20)
    b, truth_b = call_trace(np.random.default_rng(2), num_iterations=200, tp=2, pp=2, microbatches=2,
                            warmup_calls=0)
    op = np.concatenate((a.op, b.op))
    comm = np.concatenate((a.comm, b.comm))
    nbytes = np.concatenate((a.nbytes, b.nbytes))
    t = np.concatenate((a.time, b.time + a.time[-1] + 1.0))
    clock = IterationClock()
    steps = [clock.feed(op[lo : lo + 500], comm[lo : lo + 500], nbytes[lo : lo + 500],
                        t[lo : lo + 500]) for lo in range(0, len(op), 500)]
    steps.append(clock.finish())
    assert [s.period for s in clock.segments] == [51, truth_b.calls_per_iteration]
    second = clock.segments[1]
    # The new lock starts where the new pattern repeats (a's last calls may be b's).
    assert len(a.op) - truth_b.calls_per_iteration < second.start_call < len(a.op) + 200
    # The iterations measured with the old period over the new pattern (the evidence)
    # are withdrawn if they were reported, and their numbers go to the new lock. (The
    # pattern shrank, 51 -> 27 calls: its evidence ends the lock within two old
    # iterations, and with 500-call feeds none had been reported.)
    assert all(s.withdrawn_from == second.first_iteration for s in steps if s.withdrawn_from is not None)
    assert 300 - 8 <= second.first_iteration <= 300
    times, _, first = collect_steps(steps)
    assert len(times) == second.first_iteration + (len(op) - 1 - second.start_call) // 27
    assert np.all(np.diff(first) > 0)
    # (1 s iterations, a GC pause every 50th.)
    assert np.median(times[: second.first_iteration]) == pytest.approx(1.0, rel=0.03)
    assert np.median(times[second.first_iteration :]) == pytest.approx(1.0, rel=0.03)
    whole = iteration_times_from_calls(op, comm, nbytes, t)
    np.testing.assert_array_equal(whole.iteration_times, times)
    # The tracker forgets them too, and finds no fail-slow in the change.
    records = ring_records(CallTraceOf(op, comm, nbytes, t))
    tracker = RankTracker()
    updates = [tracker.feed(records[lo : lo + 700]) for lo in range(0, len(records), 700)]
    assert all(u.withdrawn_from == second.first_iteration for u in updates if u.withdrawn_from is not None)
    np.testing.assert_allclose(tracker.iteration_times, times, rtol=1e-8)  # ns records
    assert not tracker.fail_slow


def test_a_short_micro_batch_re_split_ends_the_lock_where_it_began_and_keeps_the_history():
    # S2 on a pipeline stage: 8 micro-batches a step (35 calls), 3 for 55 steps (15
    # calls), then 8 again. The young lock's check falls inside the split: it must end
    # the lock where the split began, not withdraw every iteration since the job began
    # (each rank lost its healthy reference at every split change on the local
    # cluster), and the split must lock at its own period, not at lcm(35, 15) = 105 of
    # the mixed calls.
    parts = [call_trace(np.random.default_rng(seed), num_iterations=n, tp=1, pp=2, microbatches=mb, layers=1,
                        warmup_calls=warmup)
             for seed, (n, mb, warmup) in enumerate([(120, 8, 20), (55, 3, 0), (100, 8, 0)])]
    assert [truth.calls_per_iteration for _, truth in parts] == [35, 15, 35]
    times, offset = [], 0.0
    for trace, _ in parts:
        times.append(trace.time + offset)
        offset = times[-1][-1] + 1.0
    op, comm, nbytes = (np.concatenate([getattr(trace, f) for trace, _ in parts]) for f in ("op", "comm", "nbytes"))
    t = np.concatenate(times)
    clock = IterationClock()
    steps = [clock.feed(op[lo : lo + 300], comm[lo : lo + 300], nbytes[lo : lo + 300], t[lo : lo + 300])
             for lo in range(0, len(op), 300)]
    steps.append(clock.finish())
    assert [(s.period, s.first_iteration) for s in clock.segments] == [(35, 0), (15, 119), (35, 174)]
    # Nothing before the split is withdrawn (nothing at all, when the shrunk pattern
    # ended the lock before the old period's iterations over it were reported).
    assert all(s.withdrawn_from >= 119 for s in steps if s.withdrawn_from is not None)
    measured, _, _ = collect_steps(steps)
    assert np.median(measured[:119]) == pytest.approx(1.0, rel=0.03)
    assert np.median(measured[120:173]) == pytest.approx(1.0, rel=0.03)


@pytest.mark.parametrize("split", [13, 4])
def test_a_re_split_to_more_or_fewer_micro_batches_and_back_is_locked_each_time(split):
    # A stage's calls are a few tokens: with 13 micro-batches (55 calls) 90% of them
    # still equal the call 35 earlier, and a lock that waited for fewer than half to
    # match never let go of 35.
    parts = [call_trace(np.random.default_rng(seed), num_iterations=n, tp=1, pp=2, microbatches=mb, layers=1,
                        warmup_calls=warmup)
             for seed, (n, mb, warmup) in enumerate([(150, 8, 20), (60, split, 0), (100, 8, 0)])]
    periods = [truth.calls_per_iteration for _, truth in parts]
    op, comm, nbytes = (np.concatenate([getattr(trace, f) for trace, _ in parts]) for f in ("op", "comm", "nbytes"))
    t = np.concatenate([trace.time + 1000.0 * k for k, (trace, _) in enumerate(parts)])
    clock = IterationClock()
    for lo in range(0, len(op), 400):
        clock.feed(op[lo : lo + 400], comm[lo : lo + 400], nbytes[lo : lo + 400], t[lo : lo + 400])
    assert [s.period for s in clock.segments] == periods
    assert [s.first_iteration for s in clock.segments] == [0, 149, 209]


def _stage0_calls(microbatches: int, count: int) -> np.ndarray:
    """Ops of ``count`` steps of the reference job's stage 0: per micro-batch a send and
    a receive, then the gradient all-reduce (op 3, on its own communicator) and the
    plan broadcast."""
    return np.array(([1] * microbatches + [2] * microbatches + [3, 4]) * count)


def test_a_pattern_that_shrinks_to_a_divisor_of_the_period_is_locked_again():
    # Stage 0 of the reference job: 8 micro-batches are 8 sends, 8 receives, the
    # gradient all-reduce and the plan broadcast (18 calls); an S2 split of 2 leaves 6,
    # and every call still equals the one 18 later.
    op = np.concatenate((_stage0_calls(8, 150), _stage0_calls(2, 200)))
    comm = np.where(op == 3, 7, 9)
    t = np.cumsum(np.full(len(op), 1e-3))
    clock = IterationClock()
    for lo in range(0, len(op), 500):
        clock.feed(op[lo : lo + 500], comm[lo : lo + 500], np.zeros(len(op[lo : lo + 500]), dtype=np.int64),
                   t[lo : lo + 500])
    assert [(s.period, s.first_iteration) for s in clock.segments] == [(18, 0), (6, 149)]


@pytest.mark.parametrize("microbatches", [2, 3])
def test_a_pattern_that_shrinks_ends_the_lock_within_a_few_old_iterations(microbatches):
    # 8 micro-batches (18 calls a step), then 2 or 3 (6 or 8: a divisor of 18 or not).
    # One old iteration spans 2-3 new steps, each reported as one slow iteration while
    # the lock lasts: the lock must go within 5 old iterations of the change (it took
    # 160 calls here, about 9, when every shrink waited for relock_blocks).
    change = 18 * 150
    op = np.concatenate((_stage0_calls(8, 150), _stage0_calls(microbatches, 200)))
    comm = np.where(op == 3, 7, 9)
    t = np.cumsum(np.full(len(op), 1e-3))
    clock = IterationClock()
    ended_at = None
    for lo in range(0, len(op), 20):
        clock.feed(op[lo : lo + 20], comm[lo : lo + 20], np.zeros(len(op[lo : lo + 20]), dtype=np.int64),
                   t[lo : lo + 20])
        if ended_at is None and lo > change and not (clock.locked and clock.period == 18):
            ended_at = lo + 20
    assert ended_at is not None and ended_at - change <= 5 * 18, ended_at - change
    assert [(s.period, s.first_iteration) for s in clock.segments] == [(18, 0), (2 * microbatches + 2, 149)]


def test_a_rank_moved_by_s2_and_s3_is_tracked_through_both_in_bounded_time():
    # Real records (tests/assets/reference_job/README.md): the lock found after S3's
    # move matched its own first calls below the re-lock bar, and was ended there and
    # found there again, without end.
    path = Path(__file__).parent / "assets" / "reference_job" / "rank2_s2_then_s3_ring.npz"
    records = np.load(path)["records"]
    tracker = RankTracker(rank=2)

    def give_up(signum, frame):
        raise TimeoutError("the tracker did not return from a poll within 60 s")

    previous = signal.signal(signal.SIGALRM, give_up)
    signal.alarm(60)
    try:
        for lo in range(0, len(records), 150):
            tracker.feed(records[lo : lo + 150])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert [lock.period for lock in tracker.locks] == [34, 54, 8]
    assert tracker.num_iterations >= 320


def test_a_motif_inside_the_iteration_is_not_locked():
    # 128 identical TP AllReduces forward, 128 backward (other bytes), then DP calls.
    pattern = [(1, 1, 4), ] * 128 + [(1, 1, 8)] * 128 + [(2, 2, 64), (3, 2, 64), (1, 3, 8)]
    op = np.array([c[0] for c in pattern] * 40)
    comm = np.array([c[1] for c in pattern] * 40)
    nbytes = np.array([c[2] for c in pattern] * 40)
    t = np.arange(len(op)) * 1e-3
    warm = 300  # warm-up broadcasts of varying size
    op = np.concatenate((np.full(warm, 4), op))
    comm = np.concatenate((np.full(warm, 9), comm))
    nbytes = np.concatenate((np.random.default_rng(0).integers(1, 64, warm), nbytes))
    t = np.concatenate((np.arange(warm) * 1e-4, t + 1.0))
    clock = IterationClock()
    step = clock.feed(op, comm, nbytes, t)
    # Locked online once 16 periods after the first clean one confirmed it.
    assert clock.period == 259 and clock.segments[0].start_call == warm
    np.testing.assert_allclose(step.iteration_times, 0.259)


def test_data_parallel_iterations_are_measured_between_last_calls():
    # Compute before the calls (forward, then the backward pass with the buckets):
    # measured between first calls, a slow iteration would spread into its neighbour.
    rng = np.random.default_rng(4)
    x = 1.0 + 0.05 * rng.standard_normal(600)
    clock = IterationClock()
    trace, starts = render_calls(rng, x, layout="ddp", first_call_at=(0.5, 0.5))
    step = clock.feed(trace.op, trace.comm, trace.nbytes, trace.time)
    assert clock.segments[0].backward
    # Iteration k spans the last call of k - 1 to the last of k: the 7% after the last
    # call is all that leaks.
    np.testing.assert_allclose(step.iteration_times[1:], 0.93 * x[1:] + 0.07 * x[:-1], rtol=1e-9)
    trace, _ = render_calls(rng, x, layout="hybrid")
    clock = IterationClock()
    clock.feed(trace.op, trace.comm, trace.nbytes, trace.time)
    assert not clock.segments[0].backward


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), cuts=st.lists(st.integers(0, 20_000), max_size=30))
def test_the_clock_does_not_depend_on_the_batches(seed, cuts):
    rng = np.random.default_rng(seed)
    layout = dict(tp=int(rng.choice([1, 2, 8])), pp=int(rng.choice([1, 2])),
                  microbatches=int(rng.choice([1, 4, 16])), warmup_calls=int(rng.integers(0, 300)),
                  eval_every=int(rng.choice([0, 30])))
    trace, _ = call_trace(np.random.default_rng(seed), num_iterations=60, **layout)
    n = len(trace.op)
    whole = iteration_times_from_calls(trace.op, trace.comm, trace.nbytes, trace.time)
    clock = IterationClock(ClockConfig(confirm_calls=256))
    bounds = [0, *sorted(c for c in cuts if c <= n), n]
    steps = [clock.feed(trace.op[lo:hi], trace.comm[lo:hi], trace.nbytes[lo:hi], trace.time[lo:hi])
             for lo, hi in zip(bounds, bounds[1:])]
    steps.append(clock.finish())
    other = IterationClock(ClockConfig(confirm_calls=256))
    single = [other.feed(trace.op, trace.comm, trace.nbytes, trace.time), other.finish()]
    for got, want in ((steps, single),):
        np.testing.assert_array_equal(np.concatenate([s.iteration_times for s in got]),
                                      np.concatenate([s.iteration_times for s in want]))
        np.testing.assert_array_equal(np.concatenate([s.first_call for s in got]),
                                      np.concatenate([s.first_call for s in want]))
    assert clock.segments == other.segments
    # Examples with no iteration at all say nothing about batches: not counted. (A
    # 3-call DP step with an evaluation every 30 steps, 60 steps long, locks on no
    # period: seed 2340; see the session note.)
    assume(len(whole.iteration_times) > 0)


# ---- the first lock: the reference job's real records, generated traces -----------------

REAL_RINGS = Path(__file__).parent / "data" / "rings" / "gpt_hybrid_dp2_pp4_ranks0_2.npz"


@pytest.fixture(scope="module")
def real_rings():
    """Ring records of ranks 0 and 2 of a real run of the reference job (see
    tests/data/rings/README.md)."""
    with np.load(REAL_RINGS) as z:
        return {0: z["rank0"], 2: z["rank2"]}


def _polls(n, rng, smallest=20, largest=500):
    """Bounds of polls of smallest..largest records over n records."""
    bounds = [0]
    while bounds[-1] < n:
        bounds.append(min(n, bounds[-1] + int(rng.integers(smallest, largest + 1))))
    return bounds


def _feed_polls(tracker, records, bounds):
    """Feed the polls; the updates, and the index of the poll after which the tracker
    was first locked (None if never)."""
    updates, first = [], None
    for lo, hi in zip(bounds, bounds[1:]):
        updates.append(tracker.feed(records[lo:hi]))
        if first is None and tracker.locked:
            first = len(updates) - 1
    return updates, first


@pytest.mark.parametrize("rank, period", [(0, 17), (2, 33)])
@pytest.mark.parametrize("seed", range(4))
def test_real_records_lock_16_iterations_after_the_warm_up_in_any_polls(
    real_rings, rank, period, seed, tmp_path
):
    # The case: fed online, the tracker never locked (a candidate waited for
    # 1024 calls, checked only at 2048, 4096, ... calls) while finish() locked at once.
    records = real_rings[rank]
    assert records.dtype == ring.RECORD_DTYPE
    whole = iteration_times_from_ring_records(ring.call_records(records))
    assert (whole.period, whole.start, len(whole.iteration_times)) == (period, 1, 66)
    rng = np.random.default_rng(100 * rank + seed)
    bounds = _polls(len(records), rng)
    tracker = RankTracker(rank=rank)
    updates, k = _feed_polls(tracker, records, bounds)
    # Locked online, at the call that completes 16 periods after the warm-up (one
    # Barrier): in the poll that brought that call, whatever the polls.
    (lock,) = tracker.locks
    assert (lock.period, lock.start_call, lock.first_iteration) == (period, 1, 0)
    assert lock.locked_at == 1 + 16 * period
    calls_before = sum(len(ring.call_records(records[lo:hi]))
                       for lo, hi in zip(bounds[:k], bounds[1 : k + 1]))
    assert calls_before < lock.locked_at <= calls_before + updates[k].calls
    # Nothing before it; then the iterations whose calls were in, at once (the
    # 16th needs the next one's first call), from iteration 0.
    assert all(len(u.iteration_times) == 0 for u in updates[:k])
    assert updates[k].first_iteration == 0 and len(updates[k].iteration_times) >= 15
    assert all(u.withdrawn_from is None for u in updates)
    tracker.finish()
    # The same iterations as finish() on all the records and as greyhound detect.
    at_end = RankTracker(rank=rank)
    at_end.feed(records)
    at_end.finish()
    assert at_end.locks == tracker.locks
    np.testing.assert_array_equal(
        np.concatenate([u.iteration_times for u in updates]), whole.iteration_times
    )
    np.testing.assert_array_equal(tracker.iteration_times, whole.iteration_times)
    np.testing.assert_array_equal(at_end.iteration_times, whole.iteration_times)
    for name in ("iteration", "position", "call_number"):
        np.testing.assert_array_equal(tracker.arrivals()[name], at_end.arrivals()[name])
    # Iteration k starts at call 1 + k p (the hook's call number 2 + k p).
    assert [tracker.call_number_of_iteration(i) for i in (0, 16, 65)] == [
        2, 2 + 16 * period, 2 + 65 * period]
    assert tracker.iteration_of_call_number(2 + 16 * period) == 16
    path = _csv(records, tmp_path / "calls.csv")
    source = read_detect_input(str(path))
    assert source.period == period
    np.testing.assert_array_equal(source.iteration_times, tracker.iteration_times)
    out = CliRunner().invoke(main, ["detect", "--json", str(path)])
    assert out.exit_code == 0, out.output
    got = json.loads(out.output)
    assert got["period"] == period and got["iterations"] == tracker.num_iterations == 66
    assert got["changepoints"] == [cp.as_dict() for cp in tracker.changepoints]
    assert got["slow_intervals"] == [si.as_dict() for si in tracker.slow_intervals()]
    assert tracker.detection() == at_end.detection() == detect_series(whole.iteration_times)


@pytest.mark.parametrize("rank, period", [(0, 17), (2, 33)])
def test_real_records_lock_at_one_call_one_record_or_all_at_once(real_rings, rank, period):
    records = real_rings[rank]
    for size in (1, len(records)):
        tracker = RankTracker(rank=rank)
        _, k = _feed_polls(tracker, records, list(range(0, len(records), size)) + [len(records)])
        assert tracker.locks[0].locked_at == 1 + 16 * period
        if size == 1:
            # Locked by the record of call 1 + 16 p: 15 iterations reported then.
            assert ring.call_records(records[: k + 1])["seq"][-1] == records["seq"][k]
            assert len(ring.call_records(records[: k + 1])) == 1 + 16 * period
        assert tracker.period == period


@pytest.mark.parametrize("layout, period, iterations", [("ddp", 4, 64), ("hybrid", 35, 16)])
def test_time_to_the_first_lock_on_generated_traces(layout, period, iterations):
    # 1 s iterations. The lock comes max(256, 16 p) calls after the warm-up: for a
    # data-parallel job's 4 calls (3 gradient buckets and the loss), 64 iterations,
    # about 64 s; for the hybrid job's 35 calls, 16 iterations, about 16 s. Exactly
    # there, whatever the warm-up and the polls.
    for seed in range(6):
        rng = np.random.default_rng(seed)
        x = np.exp(rng.normal(0.0, 0.02, 200))
        warmup = int(rng.integers(5, 200))
        trace, starts = render_calls(rng, x, layout=layout, warmup_calls=warmup)
        records = ring_records(trace, rng=rng)
        tracker = RankTracker()
        updates, k = _feed_polls(tracker, records, _polls(len(records), rng, 1, 300))
        (lock,) = tracker.locks
        assert (lock.period, lock.start_call) == (period, warmup)
        assert lock.locked_at - lock.start_call == iterations * period
        assert k is not None and all(u.withdrawn_from is None for u in updates)
        # The call that locked it is the last of iteration `iterations - 1`.
        assert starts[iterations - 1] <= trace.time[lock.locked_at - 1] < starts[iterations]


def test_one_call_per_iteration_locks_after_256_calls():
    # A Barrier, then one AllReduce of one size per iteration (1 s apart): the floor
    # of 256 calls (a burst of identical calls looks the same until it ends).
    n = 400
    op = np.array([ring.OP["Barrier"]] + [ring.OP["AllReduce"]] * n)
    comm = np.full(n + 1, 7)
    nbytes = np.array([0] + [1 << 20] * n)
    t = np.arange(n + 1, dtype=float)
    clock = IterationClock()
    steps = [clock.feed(op[lo : lo + 7], comm[lo : lo + 7], nbytes[lo : lo + 7], t[lo : lo + 7])
             for lo in range(0, n + 1, 7)]
    (lock,) = clock.segments
    assert (lock.period, lock.start_call, lock.locked_at) == (1, 1, 257)
    times, _, first = collect_steps(steps)
    np.testing.assert_array_equal(times, 1.0)
    np.testing.assert_array_equal(first, np.arange(1, n))


def test_a_lock_on_a_motif_is_withdrawn_once_the_calls_show_the_iteration():
    # 32 micro-batches of (Recv, Send) forward and backward, then the DP calls: 131
    # calls, of which the first 128 repeat at lag 2. With no warm-up, 256 calls of
    # them confirm period 2; the check at 512 calls (3.9 iterations) finds 131, the
    # iterations of period 2 are withdrawn, and 131 locks after 16 periods.
    trace, truth = call_trace(np.random.default_rng(5), num_iterations=60, tp=1, pp=2, microbatches=32,
                              layers=1, warmup_calls=0)
    assert truth.calls_per_iteration == 131
    records = ring_records(trace)
    tracker = RankTracker()
    periods, withdrawn = [], []
    for lo in range(0, len(records), 300):
        update = tracker.feed(records[lo : lo + 300])
        periods.append(tracker.period)
        if update.withdrawn_from is not None:
            withdrawn.append(update.withdrawn_from)
    assert periods[0] == 2 and periods[-1] == 131 and withdrawn == [0]
    (lock,) = tracker.locks
    assert (lock.start_call, lock.first_iteration, lock.locked_at) == (0, 0, 16 * 131)
    tracker.finish()
    whole = iteration_times_from_ring_records(ring.call_records(records))
    assert whole.period == 131
    np.testing.assert_array_equal(tracker.iteration_times, whole.iteration_times)
    assert np.median(tracker.iteration_times) == pytest.approx(1.0, rel=0.02)


# ---- lost records ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_an_iteration_held_at_the_pause_gate_is_measured_without_the_hold(seed):
    # Validation parks every rank at a step boundary for seconds (greyhound's doing):
    # the iteration that spans the hold counts only the job's own time, in whatever
    # batches the records come, and the numbering is that of a tracker told nothing.
    rng = np.random.default_rng(seed)
    x = 0.2 * np.exp(rng.normal(0, 0.02, 160))
    held = x.copy()
    held[100] += 3.0
    records = _records(held, layout="hybrid", seed=seed)
    told_nothing = RankTracker()
    updates = _feed_in_batches(told_nothing, records, np.random.default_rng(seed))
    ends_ns = np.concatenate([u.available_at_ns for u in updates]).astype(np.int64)
    assert told_nothing.iteration_times[100] > 3.0
    told = RankTracker()
    start_ns = int(ends_ns[100] - 3_000_000_000)
    told.hold(start_ns, start_ns + 2_000_000_000)       # told twice, the second time longer
    told.hold(start_ns, int(ends_ns[100]))
    _feed_in_batches(told, records, np.random.default_rng(seed + 1))
    assert told.num_iterations == told_nothing.num_iterations
    assert told.iteration_times[100] == pytest.approx(told_nothing.iteration_times[100] - 3.0, abs=1e-6)
    assert told.iteration_times.max() < 0.5
    others = np.arange(told.num_iterations) != 100
    np.testing.assert_array_equal(told.iteration_times[others], told_nothing.iteration_times[others])


def test_lost_records_are_counted_and_their_iterations_marked():
    rng = np.random.default_rng(9)
    x = np.exp(rng.normal(0, 0.01, 300))
    records = _records(x, layout="hybrid", async_fraction=0.2)
    kept = np.concatenate((records[:4000], records[4700:]))  # the ring overwrote 700
    tracker = RankTracker()
    updates = [tracker.feed(kept[lo : lo + 1000], lost=700 if lo == 4000 else 0)
               for lo in range(0, len(kept), 1000)]
    assert tracker.lost_records == 700 and tracker.reported_lost == 700
    assert sum(u.lost for u in updates) == 700
    (k,) = tracker.gap_iterations
    # The iteration that spans the gap is measured on calls after it (its first call
    # that equals the call one period later): no iteration holds the lost time, the
    # ~16 lost iterations are missing from the numbering.
    lost_calls = len(ring.call_records(records)) - len(ring.call_records(kept))
    assert tracker.num_iterations == 299 - lost_calls // 35
    np.testing.assert_allclose(tracker.iteration_times, 1.0, rtol=0.05)
    assert 0 < k < tracker.num_iterations and not tracker.fail_slow


# ---- durations and arrivals -------------------------------------------------------------


def _record(seq, op, t0, t1, comm=0xA, size=8, flags=0, req=0):
    r = np.zeros(1, dtype=ring.RECORD_DTYPE)
    r["seq"], r["op"], r["t_start_ns"], r["t_end_ns"] = seq, ring.OP[op], t0, t1
    r["comm_id"], r["size_bytes"], r["flags"], r["req_id"] = comm, size, flags, req
    return r


def test_comm_times_exact_on_tiny_records():
    # Period 2 (AllReduce on comm A, blocking; Send on comm B, async + its WAIT), 20
    # iterations of 1 s, and a DONE record with the device time of one AllReduce.
    recs, seq = [], 1
    for k in range(20):
        base = 1_000_000_000 * (k + 1)
        recs.append(_record(seq, "AllReduce", base, base + 100_000, comm=0xA, size=64))
        seq += 1
        recs.append(_record(seq, "Send", base + 500_000, base + 501_000, comm=0xB, size=32,
                            flags=ring.F_ASYNC, req=k + 1))
        seq += 1
        recs.append(_record(seq, "Wait", base + 800_000, base + 900_000, req=k + 1))
        seq += 1
    recs.append(_record(seq, "Done", 5_000_000_000, 5_000_040_000, flags=ring.F_DEVICE_TIMED,
                        req=int(recs[12]["seq"][0])))  # iteration 4's AllReduce
    records = np.concatenate(recs)
    tracker = RankTracker()
    tracker.feed(records)
    tracker.finish()
    assert tracker.period == 2
    np.testing.assert_allclose(tracker.iteration_times, 1.0)
    times = tracker.comm_times(0, 3)
    assert times.dtype == COMM_TIME_DTYPE
    a = times[times["comm_id"] == 0xA]
    b = times[times["comm_id"] == 0xB]
    np.testing.assert_array_equal(a["iteration"], [0, 1, 2, 3])
    np.testing.assert_allclose(a["seconds"], 100e-6)
    np.testing.assert_allclose(b["seconds"], 400e-6)  # enqueue to the WAIT's return
    assert np.all(a["calls"] == 1) and np.all(a["pending"] == 0)
    assert np.all(a["size_bytes"] == 64)
    device = tracker.comm_times(4, 4)
    assert device[device["comm_id"] == 0xA]["seconds"][0] == pytest.approx(40e-6)
    arrivals = tracker.arrivals(0, 1)
    np.testing.assert_array_equal(arrivals["comm_ordinal"], [0, 0, 1, 1])
    np.testing.assert_array_equal(arrivals["position"], [0, 1, 0, 1])
    assert arrivals["t_start_ns"][2] == 2_000_000_000


@pytest.mark.parametrize("settle_records", [1, 1 << 14])
def test_a_device_time_wins_over_the_wait_in_either_order_and_across_batches(settle_records):
    # Period 2 (AllReduce on comm A; an async Send on comm B and its WAIT), 20 iterations.
    # Device times (DONE) of three Sends: iteration 4's before its WAIT, 6's after it
    # (in the same batch), 8's in the batch before its WAIT.
    recs, sends, dones = [], {}, {}
    for k in range(20):
        base = 1_000_000_000 * (k + 1)
        recs.append(_record(0, "AllReduce", base, base + 100_000, comm=0xA, size=64))
        sends[k] = _record(0, "Send", base + 500_000, base + 501_000, comm=0xB, size=32, flags=ring.F_ASYNC,
                           req=k + 1)
        recs.append(sends[k])
        wait = _record(0, "Wait", base + 800_000, base + 900_000, req=k + 1)
        dones[k] = _record(0, "Done", base, base + 7_000, flags=ring.F_DEVICE_TIMED)
        recs += {4: [dones[k], wait], 6: [wait, dones[k]], 8: [dones[k], wait]}.get(k, [wait])
    for seq, r in enumerate(recs, start=1):
        r["seq"] = seq
    for k, done in dones.items():
        done["req_id"] = sends[k]["seq"]      # a DONE names its call by sequence number
    cut = next(i for i, r in enumerate(recs) if r is dones[8]) + 1
    tracker = RankTracker(config=TrackerConfig(settle_records=settle_records))
    tracker.feed(np.concatenate(recs[:cut]))
    tracker.feed(np.concatenate(recs[cut:]))
    tracker.finish()
    b = tracker.comm_times(0, 19)
    b = b[b["comm_id"] == 0xB]
    expected = np.full(20, 400e-6)
    expected[[4, 6, 8]] = 7e-6
    np.testing.assert_allclose(b["seconds"], expected)


@pytest.mark.parametrize("seed", range(3))
def test_the_call_table_filed_later_equals_the_table_filed_batch_by_batch(seed):
    # The tracker files a poll's calls when arrivals are read or settle_records have
    # come: whenever that is, the table is the one filed as each batch came.
    rng = np.random.default_rng(300 + seed)
    x = 0.2 * (1 + 0.03 * rng.standard_normal(200))
    records = _records(x, seed=seed, layout="hybrid", async_fraction=0.5)
    at_once = RankTracker(config=TrackerConfig(settle_records=1))
    later = RankTracker(config=TrackerConfig(settle_records=int(rng.integers(500, 5000)), history_calls=4000))
    bounds = [0, *np.sort(rng.integers(0, len(records) + 1, 80)).tolist(), len(records)]
    for lo, hi in zip(bounds, bounds[1:]):
        at_once.feed(records[lo:hi])
        later.feed(records[lo:hi])
        if rng.random() < 0.1:                  # a read now and then, as the agent's
            later.arrivals(last_calls=100)
    a = at_once.arrivals()[-4000:]
    b = later.arrivals()
    assert len(b) == 4000 and np.isfinite(a["seconds"]).mean() > 0.9
    for name in ARRIVAL_DTYPE.names:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_collectives_are_numbered_apart_from_point_to_point_calls_on_the_same_communicator():
    # A pipeline stage on the default group: one plan broadcast a step, then its
    # sends, 3 a step and later 5 (a new micro-batch split). The n-th broadcast is the
    # n-th on every member whatever its sends, so broadcasts count steps.
    recs, seq = [], 1
    for step in range(30):
        base = 1_000_000_000 * (step + 1)
        recs.append(_record(seq, "Broadcast", base, base + 1000, comm=0xA, size=16))
        seq += 1
        for i in range(3 if step < 15 else 5):
            recs.append(_record(seq, "Send", base + 10_000 * (i + 1), base + 10_000 * (i + 1) + 1000,
                                comm=0xA, size=64))
            seq += 1
    tracker = RankTracker()
    tracker.feed(np.concatenate(recs))
    rows = tracker.arrivals()
    broadcasts = rows[rows["op"] == ring.OP["Broadcast"]]
    sends = rows[rows["op"] == ring.OP["Send"]]
    np.testing.assert_array_equal(broadcasts["comm_ordinal"], np.arange(30))
    np.testing.assert_array_equal(sends["comm_ordinal"], np.arange(15 * 3 + 15 * 5))


def test_history_is_bounded():
    x = np.full(400, 0.1)
    records = _records(x, layout="hybrid", async_fraction=0.0)
    from greyhound.analytics.tracker import TrackerConfig

    tracker = RankTracker(config=TrackerConfig(history_calls=1000))
    for lo in range(0, len(records), 333):
        tracker.feed(records[lo : lo + 333])
    arrivals = tracker.arrivals()
    assert len(arrivals) == 1000
    np.testing.assert_array_equal(arrivals["call_number"],
                                  np.arange(len(records) - 999, len(records) + 1))
    # One batch of more calls than the table keeps: the same rows, the calls it could
    # not keep still counted in each communicator's ordinals.
    at_once = RankTracker(config=TrackerConfig(history_calls=1000))
    at_once.feed(records)
    assert at_once.num_calls > 1000
    np.testing.assert_array_equal(at_once.arrivals(), arrivals)


def test_bad_input_is_refused():
    tracker = RankTracker()
    with pytest.raises(ValueError, match="ring record fields"):
        tracker.feed(np.zeros(3))
    with pytest.raises(ValueError, match="lost must be >= 0"):
        tracker.feed(np.zeros(0, dtype=ring.RECORD_DTYPE), lost=-1)
    tracker.finish()
    with pytest.raises(ValueError, match="finished"):
        tracker.feed(np.zeros(0, dtype=ring.RECORD_DTYPE))
    with pytest.raises(ValueError, match="window"):
        ClockConfig(window=8)


def test_healthy_fail_slow_and_numbers_on_a_labelled_sample():
    # A few held-out jobs through the tracker (the benchmark runs them all).
    rng = np.random.default_rng(11)
    jobs = labelled_set(split="heldout", jobs_per_generator=2, min_iterations=300,
                        max_iterations=500)
    for job in jobs:
        tracker = RankTracker()
        records = _records(job.x, seed=int(rng.integers(1 << 30)),
                           layout=str(rng.choice(["ddp", "hybrid"])), pause=job.truth.pause)
        _feed_in_batches(tracker, records, rng, max_batches=10)
        assert tracker.fail_slow == job.truth.positive, job.seed
        for fs in job.truth.fail_slows:
            assert any(fs.onset - 3 <= cp.index < fs.end and cp.detected_at < fs.end
                       for cp in tracker.changepoints if cp.ratio > 1), (job.seed, fs)


def test_fail_slow_in_a_generated_hybrid_trace():
    fs = FailSlow(onset=80, end=140, factor=1.6, ramp=0)
    trace, truth = call_trace(np.random.default_rng(2), num_iterations=200, fail_slows=(fs,))
    tracker = RankTracker()
    tracker.feed(ring_records(trace))
    (interval,) = tracker.slow_intervals()
    assert abs(interval.start_index - 80) <= 1 and abs(interval.end_index - 140) <= 1
    assert tracker.current_slow_interval is None
    tracker2 = RankTracker()
    tracker2.feed(ring_records(trace)[: 51 * 110 + 120])
    assert tracker2.current_slow_interval is not None
    assert tracker2.current_slow_interval.start_index == interval.start_index


@pytest.mark.parametrize("history_calls", [1 << 17, 700])
def test_arrivals_of_a_range_equal_the_rows_of_that_range(history_calls):
    # arrivals(first, last) starts at the first call of `first` instead of building
    # every kept row: the same rows as filtering all of them, with a window that is
    # all kept and one that begins before the oldest kept call.
    from greyhound.analytics.tracker import TrackerConfig

    x = np.r_[np.full(120, 0.2), np.full(60, 0.3), np.full(60, 0.2)]
    records = _records(x, seed=3)
    tracker = RankTracker(rank=0, config=TrackerConfig(history_calls=history_calls))
    _feed_in_batches(tracker, records, np.random.default_rng(4))
    everything = tracker.arrivals()
    n = tracker.num_iterations
    assert n > 200
    for first, last in [(n - 10, n - 1), (n - 1, n - 1), (0, n - 1), (5, 40)]:
        it = everything["iteration"]
        want = everything[(it >= first) & (it <= last) & (it >= 0)]
        np.testing.assert_array_equal(tracker.arrivals(first, last), want)
