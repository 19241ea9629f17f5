"""Profiling on hand-made agent stats: who arrives last, which group is slow."""

from __future__ import annotations

import pytest

from greyhound.control.profile import find_suspects

NODES = {0: "n1", 1: "n1", 2: "n2", 3: "n2", 4: "n3", 5: "n3", 6: "n4", 7: "n4"}
SHARE = {r: 0.80 for r in NODES}


def _ar(seconds, nbytes=4e6):
    return {"bytes_per_iter": nbytes, "seconds_per_iter": seconds, "op": "AllReduce"}


def dp_groups(times):
    """Four DP groups of two ranks (r, r+4), all moving the same bytes."""
    stats = {r: {} for r in NODES}
    for g in range(4):
        for r in (g, g + 4):
            stats[r][f"dp{g}"] = _ar(times.get(r, 0.10 if r == g else 0.11))
    return stats


def test_healthy_groups_give_no_suspect():
    assert find_suspects(dp_groups({}), rank_nodes=NODES, compute_share=SHARE) == []


def test_the_rank_that_computes_longer_than_its_peer_is_the_compute_suspect():
    # Rank 5 computes 90% of the time; its DP peer (rank 1) only 50%: it waits for 5.
    share = {**SHARE, 1: 0.50, 5: 0.90}
    suspects = find_suspects(dp_groups({1: 0.50, 5: 0.10}), rank_nodes=NODES, compute_share=share)
    assert [(s.kind, s.ranks, s.nodes) for s in suspects] == [("compute", (5,), ("n3",))]
    assert abs(suspects[0].score - 0.40) < 1e-9


def test_a_group_slower_than_its_cluster_is_a_link_suspect():
    # dp2 (ranks 2 and 6) takes 0.3 s on both members: its transfer is slow, nobody waits.
    suspects = find_suspects(dp_groups({2: 0.30, 6: 0.30}), rank_nodes=NODES, compute_share=SHARE)
    assert [(s.kind, s.comm, s.nodes) for s in suspects] == [("link", "dp2", ("n2", "n4"))]
    assert abs(suspects[0].score - 3.0) < 1e-9     # 0.30 s against the median 0.10 s


def test_groups_moving_other_bytes_are_not_compared():
    stats = dp_groups({})
    for r in NODES:     # every rank also has a p2p link of its own size and speed
        stats[r][f"pp{r}"] = {"bytes_per_iter": 1e3 * (r + 1), "seconds_per_iter": 0.05 * (r + 1), "op": "Send"}
    assert find_suspects(stats, rank_nodes=NODES, compute_share=SHARE) == []


def test_a_small_wait_is_jitter_not_a_straggler():
    assert find_suspects(dp_groups({}), rank_nodes=NODES, compute_share={**SHARE, 5: 0.83}) == []


def test_a_group_slowed_by_its_compute_straggler_is_not_a_link_suspect():
    # Rank 5 is slow, and so is its group's allreduce (gloo moves data on the CPU).
    stats = dp_groups({1: 0.50, 5: 0.30})
    suspects = find_suspects(stats, rank_nodes=NODES, compute_share={**SHARE, 1: 0.5, 5: 0.9})
    assert [(s.kind, s.ranks) for s in suspects] == [("compute", (5,))]



def test_the_rank_whose_own_work_rose_is_named_not_the_one_busier_than_its_peers():
    # Rank 5 (stage 1 of replica 1) under a CPU quota: its work per iteration rose 2.4x;
    # replica 1's other stages wait in pipeline calls, so rank 0 computes a larger share
    # than its DP peer rank 4 (the share comparison's wrong answer here).
    share = {**SHARE, 0: 0.25, 4: 0.12, 5: 0.24, 1: 0.16}
    rise = {r: 1.0 for r in NODES} | {5: 2.4, 0: 1.03}
    suspects = find_suspects(dp_groups({}), rank_nodes=NODES, compute_share=share, compute_rise=rise)
    assert [(s.kind, s.ranks, s.nodes) for s in suspects] == [("compute", (5,), ("n3",))]
    assert suspects[0].score == 2.4 and "rose 2.40x" in suspects[0].why


def test_a_rise_every_rank_shares_names_nobody():
    # A busier machine: every rank's work per iteration rose about 1.3x.
    rise = {r: 1.3 + 0.02 * (r % 3) for r in NODES}
    assert find_suspects(dp_groups({}), rank_nodes=NODES, compute_share=SHARE, compute_rise=rise) == []


def test_without_enough_history_the_ranks_are_compared_with_their_peers():
    # Only 3 of 8 ranks have a baseline: the share comparison decides (rank 5 vs rank 1).
    share = {**SHARE, 5: 0.9, 1: 0.5}
    rise = {5: 1.0, 6: 1.0, 7: 3.0}
    suspects = find_suspects(dp_groups({}), rank_nodes=NODES, compute_share=share, compute_rise=rise)
    assert [(s.kind, s.ranks) for s in suspects] == [("compute", (5,))]


def test_a_slow_group_within_one_node_is_not_a_link_suspect():
    # DP groups of two ranks on one node each (0-1 on n1, ..., 6-7 on n4): the n3 group
    # is 1.5x the others, but no network link carries it.
    stats = {r: {f"dp{r // 2}": _ar(0.15 if r // 2 == 2 else 0.10)} for r in NODES}
    assert find_suspects(stats, rank_nodes=NODES, compute_share=SHARE) == []
    # The same groups across nodes (r, r + 4): the slow one is a link suspect.
    assert [s.kind for s in find_suspects(dp_groups({2: 0.15, 6: 0.15}), rank_nodes=NODES,
                                          compute_share=SHARE)] == ["link"]


def _waits(now: dict[int, float], before: dict[int, float]) -> dict[int, tuple[float, float]]:
    return {r: (now.get(r, 0.02), before.get(r, 0.25)) for r in NODES}


def test_a_rank_starved_of_cpu_is_a_compute_suspect_even_when_its_work_per_iteration_fell():
    # The two-straggler cluster test: ranks 2 and 5 under a CPU quota waited 0.53 and
    # 0.60 of their time (0.38 and 0.30 before), the others 0.02 (0.21-0.29 before);
    # rank 2's work per iteration read 0.3x its past (its stops fell inside calls).
    rise = {r: 1.0 for r in NODES} | {2: 0.3, 5: 6.5}
    waits = _waits({2: 0.53, 5: 0.60}, {2: 0.38, 5: 0.30})
    suspects = find_suspects(dp_groups({}), rank_nodes=NODES, compute_share=SHARE, compute_rise=rise, cpu_wait=waits)
    assert sorted(s.ranks for s in suspects) == [(2,), (5,)]
    starved = next(s for s in suspects if s.ranks == (2,))
    assert starved.kind == "compute" and starved.nodes == ("n2",) and "CPU" in starved.why
    assert starved.score == pytest.approx((1 - 0.38) / (1 - 0.53))
    # Named by its work already: one suspect for rank 5, its work's.
    assert next(s for s in suspects if s.ranks == (5,)).score == pytest.approx(6.5)


def test_a_busier_machine_or_a_rank_that_always_waited_more_names_nobody():
    rise = {r: 1.0 for r in NODES}
    everyone = _waits({r: 0.6 for r in NODES}, {})          # every rank waits more
    assert find_suspects(dp_groups({}), rank_nodes=NODES, compute_share=SHARE, compute_rise=rise,
                         cpu_wait=everyone) == []
    always = _waits({r: 0.25 for r in NODES} | {3: 0.55}, {3: 0.55})   # rank 3 waited as much before
    assert find_suspects(dp_groups({}), rank_nodes=NODES, compute_share=SHARE, compute_rise=rise,
                         cpu_wait=always) == []
    fell = _waits({3: 0.30}, {3: 0.80})     # waits more than the others, but less than it did
    assert find_suspects(dp_groups({}), rank_nodes=NODES, compute_share=SHARE, compute_rise=rise,
                         cpu_wait=fell) == []
