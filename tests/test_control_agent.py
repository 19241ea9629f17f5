"""The node agent's per-rank figures from its polls (pure: no ring needed)."""

from __future__ import annotations

import pytest

from greyhound.control.agent import HISTORY_S, MIN_ITERATIONS, RECENT_S, PollWindow, _Process, polls_in


def _proc(poll_s: float = 0.5) -> _Process:
    return _Process(reader=None, tracker=None, polls=PollWindow(poll_s))


def test_work_per_iteration_recently_and_before():
    proc = _proc()
    for _ in range(30):                     # 2 iterations a poll, 0.1 s of work each
        proc.polls.append((0.5, 0.3, 2))
    for _ in range(proc.polls.recent_polls):           # then 0.2 s each: 0.4 s of 0.5 s outside calls
        proc.polls.append((0.5, 0.1, 2))
    recent, before = proc.compute_per_iteration()
    assert recent == pytest.approx(0.2) and before == pytest.approx(0.1)
    assert proc.compute_share() == pytest.approx(0.8)


def test_no_figure_without_iterations_and_the_history_is_bounded():
    proc = _proc()
    assert proc.compute_per_iteration() == (None, None) and proc.compute_share() is None
    for _ in range(proc.polls.recent_polls):
        proc.polls.append((0.5, 0.5, 0))    # held in calls the whole time: no iteration
    assert proc.compute_per_iteration() == (None, None)
    for _ in range(3 * proc.polls.history_polls):
        proc.polls.append((0.5, 0.25, 1))
    assert len(proc.polls) == proc.polls.history_polls
    assert proc.compute_per_iteration() == (pytest.approx(0.25), pytest.approx(0.25))


def test_recent_median_is_numpys_median_of_the_last_three():
    import numpy as np

    from greyhound.control.agent import recent_median

    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 4, 9):
        times = rng.random(n)
        assert recent_median(times) == float(np.median(times[-3:]))


def test_running_figures_equal_the_sums_over_the_kept_polls():
    # The figures are kept as running sums: after every poll they must equal the sums
    # over the last history_polls polls worked out afresh, however many came before.
    import random

    rng = random.Random(3)
    proc = _proc()
    history, recent_polls = proc.polls.history_polls, proc.polls.recent_polls
    kept: list[tuple[float, float, int]] = []
    for _ in range(4 * history):
        wall = rng.uniform(0.4, 0.6)
        poll = (wall, rng.uniform(0.0, wall), rng.choice((0, 1, 2, 5)))
        proc.polls.append(poll)
        kept = [*kept, poll][-history:]
        recent, before = kept[-recent_polls:], kept[:-recent_polls]

        def per_iteration(polls):
            k = sum(p[2] for p in polls)
            return None if k < MIN_ITERATIONS else pytest.approx(sum(p[0] - p[1] for p in polls) / k, abs=1e-9)

        assert proc.compute_per_iteration() == (per_iteration(recent), per_iteration(before))
        share = 1 - sum(p[1] for p in recent) / sum(p[0] for p in recent)
        assert proc.compute_share() == pytest.approx(share, abs=1e-9)
        assert len(proc.polls) == len(kept)


@pytest.mark.parametrize("poll_s", [0.25, 0.5, 1.0, 2.0, 3.0])
def test_the_windows_cover_the_same_seconds_at_any_poll_interval(poll_s):
    # To the nearest whole poll.
    window = PollWindow(poll_s)
    assert abs(window.recent_polls * poll_s - RECENT_S) <= poll_s / 2
    assert abs((window.history_polls - window.recent_polls) * poll_s - HISTORY_S) <= poll_s / 2


def test_a_window_is_whole_polls_and_at_least_one():
    assert polls_in(1.5, 1.0) == 2 and polls_in(1.5, 0.5) == 3 and polls_in(0.2, 1.0) == 1


def test_waiting_for_a_cpu_recently_and_before():
    proc = _proc()
    assert proc.cpu_wait_share() == (None, None)        # no schedstat read yet
    proc.run_delay_ns = 0
    for _ in range(30):
        proc.polls.append((0.5, 0.3, 2, 0.1))
    for _ in range(proc.polls.recent_polls):
        proc.polls.append((0.5, 0.3, 2, 0.4))
    assert proc.cpu_wait_share() == (pytest.approx(0.8), pytest.approx(0.2))
    proc.polls.append((0.5, 0.3, 2))                    # a poll without a figure waited nothing
    assert proc.compute_per_iteration() == (pytest.approx(0.1), pytest.approx(0.1))


def test_run_delay_is_read_from_schedstat_and_grows_while_a_busy_process_waits():
    import multiprocessing
    import os

    from greyhound.control.agent import run_delay_ns

    if not os.path.exists("/proc/self/schedstat"):
        pytest.skip("this kernel has no /proc/PID/schedstat (CONFIG_SCHEDSTATS)")
    assert run_delay_ns(2 ** 22 + 12345) is None        # beyond pid_max: no such process
    # Two busy processes on one CPU for a second: each waits for it about half the time.
    ctx = multiprocessing.get_context("fork")
    waited = ctx.Queue()
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        busy = [ctx.Process(target=_spin, args=(1.0, waited)) for _ in range(2)]
        for p in busy:
            p.start()
        delays = [waited.get(timeout=30) for _ in busy]
        for p in busy:
            p.join()
    finally:
        os.sched_setaffinity(0, cpus)
    assert all(0.25 < d < 0.75 for d in delays), delays


def _spin(seconds: float, waited) -> None:
    import os
    import time

    from greyhound.control.agent import run_delay_ns

    start = run_delay_ns(os.getpid())
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    waited.put((run_delay_ns(os.getpid()) - start) / 1e9)


def test_a_slow_interval_is_news_until_it_is_published(tmp_path):
    # While a verdict's episode lasts, a quiet plane's agents post news only: a slow
    # interval the master has seen is not news, one opened or closed since is.
    from greyhound.analytics.tracker import RankTracker
    from greyhound.control.agent import NodeAgent

    agent = NodeAgent(tmp_path, "n1")
    proc = _Process(reader=None, tracker=RankTracker(rank=0), polls=PollWindow(1.0))
    agent.processes[tmp_path / "ring.0"] = proc
    assert agent._news()                                  # never published
    proc.summary_cache = (0, {"slow_since": 40})
    assert agent._news()                                  # opened, not yet sent
    proc.sent["slow_since"] = 40
    assert not agent._news()                              # the master has it
    proc.summary_cache = (0, {"slow_since": None})
    assert agent._news()                                  # closed (a fade), not yet sent
    proc.sent["slow_since"] = ""
    assert not agent._news()
