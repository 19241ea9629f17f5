"""Link schedules: every link the job uses, tested in the fewest node-disjoint passes."""

from __future__ import annotations

import random

import pytest

from greyhound.control.links import job_links, link_passes


def _check(passes, links):
    assert sorted(map(frozenset, (link for p in passes for link in p)), key=sorted) == \
        sorted(map(frozenset, links), key=sorted)
    for p in passes:
        nodes = [n for link in p for n in link]
        assert len(nodes) == len(set(nodes)), p


@pytest.mark.parametrize("size", [2, 4, 6, 8, 16, 64, 512])
def test_an_even_ring_takes_two_passes(size):
    links = job_links([[f"n{i}" for i in range(size)]])
    passes = link_passes(links)
    _check(passes, links)
    assert len(passes) == (1 if size == 2 else 2)


@pytest.mark.parametrize("size", [3, 5, 7, 33, 511])
def test_an_odd_ring_takes_three_passes(size):
    links = job_links([[f"n{i}" for i in range(size)]])
    passes = link_passes(links)
    _check(passes, links)
    assert len(passes) == 3


@pytest.mark.parametrize("size", [3, 7, 15, 100, 1000])
def test_a_binary_tree_takes_at_most_four_passes(size):
    # NCCL-style tree: node i's parent is (i - 1) // 2; breadth-first edge order.
    links = job_links([[f"n{(i - 1) // 2}", f"n{i}"] for i in range(1, size)])
    passes = link_passes(links)
    _check(passes, links)
    assert len(passes) <= 4


def test_dp_and_pp_groups_give_each_link_once():
    # DP=2 x PP=4, one PP stage per node pair: DP groups (n1,n3) (n1,n3) (n2,n4) (n2,n4),
    # PP chains n1-n2 and n3-n4.
    groups = [["n1", "n3"], ["n1", "n3"], ["n2", "n4"], ["n2", "n4"],
              ["n1", "n1", "n2", "n2"], ["n3", "n3", "n4", "n4"]]
    links = job_links(groups)
    assert links == [("n1", "n3"), ("n2", "n4"), ("n1", "n2"), ("n3", "n4")]
    passes = link_passes(links)
    _check(passes, links)
    assert len(passes) == 2


def test_passes_cover_random_graphs_without_sharing_a_node():
    rng = random.Random(7)
    for _ in range(50):
        nodes = [f"n{i}" for i in range(rng.randint(2, 30))]
        groups = [rng.sample(nodes, rng.randint(2, len(nodes))) for _ in range(rng.randint(1, 6))]
        links = job_links(groups)
        _check(link_passes(links), links)
