"""Validation decisions: the common pause iteration, the GEMM size, the judgements."""

from __future__ import annotations

import dataclasses

import pytest

from greyhound.control.validate import (
    RankClock, doubtful_suspects, judge_gemm, judge_links, pause_iterations, pause_lead_s, pause_steps,
    reference_ranks,
)


def test_lockstep_ranks_pause_at_the_same_iteration_whatever_their_numbering():
    # Two ranks in lockstep (0.2 s iterations, starts 10 ms apart); rank 1's tracker
    # counts from an iteration later (it missed the first, partial one).
    clocks = [RankClock(rank=0, iteration=50, started_s=100.00, iteration_s=0.2),
              RankClock(rank=1, iteration=49, started_s=100.01, iteration_s=0.2)]
    target = pause_iterations(clocks, at_s=100.95)
    # 100.95 is nearest the start at 101.0 (rank 0: iteration 55; rank 1: its 54).
    assert target == {0: 55, 1: 54}


def test_the_pause_is_never_the_iteration_already_running():
    clocks = [RankClock(rank=0, iteration=7, started_s=10.0, iteration_s=1.0)]
    assert pause_iterations(clocks, at_s=10.1) == {0: 8}


def test_a_rank_without_a_period_cannot_be_paused_consistently():
    with pytest.raises(ValueError, match="rank 3 has no iteration time"):
        pause_iterations([RankClock(rank=3, iteration=0, started_s=0.0, iteration_s=0.0)], at_s=1.0)


def test_the_lead_covers_the_agents_polls_and_two_slow_iterations():
    clocks = [RankClock(rank=0, iteration=1, started_s=0, iteration_s=0.2),
              RankClock(rank=1, iteration=1, started_s=0, iteration_s=0.5)]
    assert pause_lead_s(clocks, poll_s=0.5) == pytest.approx(2.0)


def test_references_are_healthy_and_spread():
    assert reference_ranks([5], list(range(8))) == [0, 7]
    assert reference_ranks([0, 1], [0, 1, 2]) == [2]


def test_a_slow_gemm_is_confirmed_and_a_normal_one_is_not():
    times = {0: 0.20, 5: 0.62, 7: 0.21, 3: 0.22}
    out = judge_gemm(times, suspects=[5, 3], references=[0, 7])
    assert [(o["rank"], o["confirmed"]) for o in out] == [(5, True), (3, False)]
    assert out[0]["ratio"] == pytest.approx(0.62 / 0.21)


def test_a_suspect_is_judged_against_the_slowest_reference():
    # A validation round on the local cluster: 2 shared cores, the healthy references
    # 0.125 and 0.184 s; rank 4 (healthy) 0.215 s is 1.39x their median, not slow.
    times = {5: 3.302, 2: 3.502, 4: 0.215, 0: 0.125, 7: 0.184}
    out = judge_gemm(times, suspects=[5, 2, 4], references=[0, 7])
    assert [(o["rank"], o["confirmed"]) for o in out] == [(5, True), (2, True), (4, False)]
    assert out[2]["reference_s"] == 0.184


def test_only_a_suspect_just_over_the_bar_is_run_again():
    # The local cluster, before any injection: rank 3 read 1.33x the slowest reference
    # in both runs. Rank 5 under a quota reads 15x, rank 2 (capped) at least 10x, rank 4 1.1x.
    times = {0: 0.1784, 7: 0.1798, 3: 0.2384, 5: 2.7, 2: 1.8, 4: 0.198}
    assert doubtful_suspects(times, suspects=[3, 5, 2, 4], references=[0, 7], clearly_slow=4.0,
                             capped=[2]) == [3]
    times[3] = 0.2011           # its third run: 1.12x, under the bar
    assert doubtful_suspects(times, suspects=[3, 5, 2, 4], references=[0, 7], clearly_slow=4.0,
                             capped=[2]) == []


def test_a_link_suspect_is_confirmed_by_a_slow_link_on_its_node():
    slow = [{"link": "n3<->n4", "node": "n4"}]
    out = judge_links(slow, suspect_nodes=[("n4",), ("n1", "n2")])
    assert [(o["key"], o["confirmed"]) for o in out] == [("link:n4", True), ("link:n1,n2", False)]


def test_ranks_cut_at_the_same_step_by_their_step_counts_whatever_their_timing():
    # Stage 0 ends its step 0.3 s after the last stage; their trackers number from
    # different phases. By step count they are cut at the same step.
    clocks = [RankClock(rank=0, iteration=40, started_s=100.3, iteration_s=0.5, cut_position=16, cut_step=41,
                        step_calls=18),
              RankClock(rank=6, iteration=39, started_s=100.0, iteration_s=0.5, cut_position=16, cut_step=41,
                        step_calls=18),
              RankClock(rank=2, iteration=38, started_s=100.1, iteration_s=0.5, cut_position=32, cut_step=40,
                        step_calls=34)]
    steps = pause_steps(clocks, lead_s=1.2)
    # First step every rank can still reach: 41 + 1 + ceil(1.2 / 0.5) = 45.
    assert steps == {0: 4, 6: 4, 2: 5}
    # A rank whose last step's length is unknown cannot be placed by count.
    assert pause_steps([*clocks[:2], dataclasses.replace(clocks[2], step_calls=0)], lead_s=1.2) is None


def test_step_counts_that_disagree_by_more_than_the_ranks_can_be_apart_place_the_cut_by_time():
    # One tracker counts two steps as one iteration: its count is half the others'.
    # Cut by these counts, rank 0 would be parked 40 steps after the others.
    clocks = [RankClock(rank=0, iteration=40, started_s=100.3, iteration_s=0.5, cut_position=16, cut_step=82,
                        step_calls=18),
              RankClock(rank=1, iteration=20, started_s=100.1, iteration_s=1.0, cut_position=40, cut_step=41,
                        step_calls=36)]
    assert pause_steps(clocks, lead_s=1.2) is None
    # Read a lead apart, lockstep ranks differ by a few of the fastest rank's steps.
    near = [clocks[0], dataclasses.replace(clocks[1], cut_step=82 - 4, iteration_s=0.5)]
    assert pause_steps(near, lead_s=1.2) is not None


def test_without_step_counts_the_cut_is_placed_by_time():
    assert pause_steps([RankClock(rank=0, iteration=1, started_s=0, iteration_s=1.0)], lead_s=1) is None
