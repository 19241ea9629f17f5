"""S3, the placement planner (greyhound.mitigate.placement): the paper's role swap and
straggler consolidation by hand, a brute force over every placement of small jobs with
an independent cost model, the layout for the training side, timings, and every error
path as one line."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from greyhound.mitigate.placement import (
    CostModel,
    PlacementPlan,
    default_placement,
    layout,
    plan_placement,
    step_cost,
)

MODEL = CostModel(dp_bytes=100.0, pp_bytes=10.0, bandwidth=1.0)
# The reference job: dp=2, pp=4, rank = s*dp + d, two ranks per node.
REF_NODES = ("n1", "n1", "n2", "n2", "n3", "n3", "n4", "n4")


def _pair(a, b):
    return frozenset({a, b})


def _ring_links(cells, nodes, dp, pp):
    """{stage: set of node pairs its DP ring crosses between nodes}."""
    lay = layout(cells, dp=dp, pp=pp)
    out = {}
    for s, group in enumerate(lay.dp_groups):
        edges = [(group[d], group[(d + 1) % dp]) for d in range(dp)] if dp > 1 else []
        out[s] = {_pair(nodes[a], nodes[b]) for a, b in edges if nodes[a] != nodes[b]}
    return out


def _pipe_links(cells, nodes, dp, pp):
    """Node pairs the pipelines' hops cross between nodes, with repeats."""
    lay = layout(cells, dp=dp, pp=pp)
    hops = [(p[s], p[s + 1]) for p in lay.pipelines for s in range(pp - 1)]
    return [_pair(nodes[a], nodes[b]) for a, b in hops if nodes[a] != nodes[b]]


def _model_cost(cells, nodes, dp, pp, slow, stragglers, dp_bytes, pp_bytes, bandwidth, w):
    """The module docstring's T, written out again from its definition."""
    rank_at = {cell: r for r, cell in enumerate(cells)}

    def inv(r1, r2):
        n1, n2 = nodes[r1], nodes[r2]
        if n1 == n2:
            return 1.0
        return 1.0 / min(slow.get(_pair(n1, n2), 1.0), slow.get(n1, 1.0), slow.get(n2, 1.0))

    compute = sum(w[s] * max(stragglers.get(rank_at[(d, s)], 1.0) for d in range(dp)) for s in range(pp))
    dp_term = 0.0
    if dp > 1:
        dp_term = max(
            dp_bytes[s] * 2 * (dp - 1) / dp / bandwidth
            * max(inv(rank_at[(d, s)], rank_at[((d + 1) % dp, s)]) for d in range(dp))
            for s in range(pp)
        )
    pp_term = 0.0
    if pp > 1:
        pp_term = pp_bytes / bandwidth * max(
            sum(inv(rank_at[(d, s)], rank_at[(d, s + 1)]) for s in range(pp - 1)) for d in range(dp)
        )
    return compute + dp_term + pp_term


def _stage_moves(before, after):
    return sum(1 for a, b in zip(before, after) if a[1] != b[1])


def _cell_changes(before, after):
    return sum(1 for a, b in zip(before, after) if a != b)


def _check_plan(plan: PlacementPlan, current, dp, pp):
    """The plan is a bijection and its move lists agree with it."""
    lay = layout(plan.placement, dp=dp, pp=pp)
    assert sorted(lay.cells) == sorted(default_placement(dp, pp))
    moved = {m.rank: (m.from_stage, m.to_stage) for m in plan.moves}
    for r, (old, new) in enumerate(zip(current, plan.placement)):
        assert (r in moved) == (old[1] != new[1])
        if r in moved:
            assert moved[r] == (old[1], new[1])
        assert (r in plan.reshuffled) == (old[1] == new[1] and old != new)
    assert plan.improves == (plan.cost_after < plan.cost_before)
    assert "\n" not in plan.reason


# -- the paper's moves ------------------------------------------------------------------
def test_figure_11_the_congested_link_leaves_the_dp_ring():
    """Figure 11: four nodes, DP rings {1,2} and {3,4}, pipelines 1-3 and 2-4; the 3-4
    link is at 5%. Swapping the roles of two nodes takes it off the DP rings. The exact
    optimum needs only two ranks to change stage, as the paper's swap of nodes 2 and 3
    does, and pairs the pipelines so that the link carries nothing at all."""
    nodes = ("1", "2", "3", "4")
    slow = {_pair("3", "4"): 0.05}
    before = default_placement(2, 2)
    assert _pair("3", "4") in _ring_links(before, nodes, 2, 2)[1]
    plan = plan_placement(dp=2, pp=2, node_of_rank=nodes, model=MODEL, slow_links=slow)
    _check_plan(plan, before, 2, 2)
    assert plan.improves and len(plan.moves) == 2
    assert all(_pair("3", "4") not in links for links in _ring_links(plan.placement, nodes, 2, 2).values())
    healthy = step_cost(plan.placement, dp=2, pp=2, node_of_rank=nodes, model=MODEL)
    assert plan.cost_after == healthy
    # The paper's swap of nodes 2 and 3 (DP rings {1,3}, {2,4}; PP 1-2, 3-4) is no better.
    paper = ((0, 0), (0, 1), (1, 0), (1, 1))
    assert _pipe_links(paper, nodes, 2, 2).count(_pair("3", "4")) == 1
    assert plan.cost_after < step_cost(paper, dp=2, pp=2, node_of_rank=nodes, model=MODEL, slow_links=slow)
    assert plan.cost_before == pytest.approx(2.3 + 100 / 0.05 + 10)


def test_figure_11_an_unavoidable_congested_link_ends_under_pp():
    """Nodes 3 and 4 host a pipeline each, so the slow 3-4 link carries both DP rings;
    it cannot be avoided (every cell neighbours the other node), and the swap of DP and
    PP roles puts it under the light PP traffic: each node becomes a stage."""
    nodes = ("3", "3", "4", "4")
    before = ((0, 0), (0, 1), (1, 0), (1, 1))
    plan = plan_placement(
        dp=2, pp=2, node_of_rank=nodes, model=MODEL, placement=before, slow_links={_pair("3", "4"): 0.05}
    )
    _check_plan(plan, before, 2, 2)
    assert plan.improves
    assert [m.rank for m in plan.moves] == [1, 2]
    assert _ring_links(plan.placement, nodes, 2, 2) == {0: set(), 1: set()}
    assert _pipe_links(plan.placement, nodes, 2, 2) == [_pair("3", "4")] * 2
    assert plan.cost_before == pytest.approx(2.3 + 100 / 0.05 + 10)
    assert plan.cost_after == pytest.approx(2.3 + 100 + 10 / 0.05)


def test_a_slow_node_on_the_reference_job_goes_to_an_end_stage():
    """n2's NIC at 5%: n2 hosts stage 1, whose pipelines cross n2's links twice each.
    Moved to an end stage they cross once; its DP ring stays inside the node."""
    plan = plan_placement(dp=2, pp=4, node_of_rank=REF_NODES, model=MODEL, slow_links={"n2": 0.05})
    _check_plan(plan, default_placement(2, 4), 2, 4)
    rings = _ring_links(plan.placement, REF_NODES, 2, 4)
    assert all(not any("n2" in pair for pair in links) for links in rings.values())
    assert {plan.placement[2][1], plan.placement[3][1]} == {0}
    assert sorted((m.rank, m.from_stage, m.to_stage) for m in plan.moves) == [
        (0, 0, 1), (1, 0, 1), (2, 1, 0), (3, 1, 0)
    ]
    assert plan.cost_before == pytest.approx(4.3 + 100 + 10 * (2 / 0.05 + 1))
    assert plan.cost_after == pytest.approx(4.3 + 100 + 10 * (1 / 0.05 + 2))
    assert "node n2 at 5%" in plan.reason and "4 ranks change stage" in plan.reason


def test_a_slow_link_between_dp_rings_moves_nothing_when_it_carries_no_dp():
    # n1-n2 carries PP on the reference job; any placement must cross nodes somewhere,
    # and n1-n3 / n2-n4 are as good: the planner swaps stages so n1-n2 carries nothing.
    plan = plan_placement(dp=2, pp=4, node_of_rank=REF_NODES, model=MODEL, slow_links={_pair("n1", "n2"): 0.5})
    _check_plan(plan, default_placement(2, 4), 2, 4)
    assert plan.improves
    assert _pair("n1", "n2") not in _pipe_links(plan.placement, REF_NODES, 2, 4)


@pytest.mark.parametrize(
    ("stragglers", "stage", "num_moves"),
    [
        ({1: 2.0, 5: 2.0}, 2, 2),  # stages 0 and 2: into stage 2, one swap
        ({0: 2.0, 7: 2.0}, 1, 4),  # stages 0 and 3: into an inner stage, the lower one
        ({2: 3.0, 4: 1.5}, 1, 2),  # stages 1 and 2: into stage 1, ties to the lower stage
    ],
)
def test_two_stragglers_in_different_stages_end_in_one_inner_stage(stragglers, stage, num_moves):
    plan = plan_placement(dp=2, pp=4, node_of_rank=REF_NODES, model=MODEL, stragglers=stragglers)
    _check_plan(plan, default_placement(2, 4), 2, 4)
    assert {plan.placement[r][1] for r in stragglers} == {stage}
    assert len(plan.moves) == num_moves
    assert plan.improves


def test_stragglers_fill_the_fewest_stages_inner_first():
    stragglers = {0: 2.0, 3: 2.0, 6: 2.0}  # three stragglers, dp = 2: two stages
    plan = plan_placement(dp=2, pp=4, node_of_rank=REF_NODES, model=MODEL, stragglers=stragglers)
    assert sorted(plan.placement[r][1] for r in stragglers) in ([1, 1, 2], [1, 2, 2])
    # pp = 6, four stragglers in the end stages: they go to inner stages 1..4, two each
    nodes = tuple(f"n{r // 2}" for r in range(12))
    stragglers = {0: 2.0, 1: 2.0, 10: 2.0, 11: 2.0}
    plan = plan_placement(dp=2, pp=6, node_of_rank=nodes, model=MODEL, stragglers=stragglers)
    stages = [plan.placement[r][1] for r in stragglers]
    assert len(set(stages)) == 2 and all(0 < s < 5 for s in stages)


def test_nothing_to_gain_returns_the_current_placement():
    current = default_placement(2, 4)
    for kwargs in ({}, {"stragglers": {2: 2.0, 3: 1.5}}, {"slow_links": {_pair("n1", "n3"): 0.1}}):
        plan = plan_placement(dp=2, pp=4, node_of_rank=REF_NODES, model=MODEL, **kwargs)
        assert not plan.improves
        assert plan.placement == current and plan.moves == () and plan.reshuffled == ()
        assert plan.cost_after == plan.cost_before
        assert plan.reason.startswith("S3: no placement beats the current one")


def test_every_inter_node_link_equally_slow_changes_nothing():
    nodes = ("a", "b", "c", "d")
    slow = {n: 0.2 for n in nodes}
    plan = plan_placement(dp=2, pp=2, node_of_rank=nodes, model=MODEL, slow_links=slow)
    assert not plan.improves and plan.moves == ()


def test_a_reshuffle_within_stages_moves_no_parameters():
    # one rank per node, dp = 4: the ring order alone puts n1-n2 off the ring
    nodes = tuple(f"n{r}" for r in range(8))
    plan = plan_placement(dp=4, pp=2, node_of_rank=nodes, model=MODEL, slow_links={_pair("n0", "n1"): 0.05})
    _check_plan(plan, default_placement(4, 2), 4, 2)
    assert plan.improves and plan.moves == () and plan.reshuffled


# -- the layout --------------------------------------------------------------------------
def test_layout_of_the_reference_job():
    lay = layout(default_placement(2, 4), dp=2, pp=4)
    assert lay.cells[5] == (1, 2)
    assert lay.dp_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert lay.pipelines == ((0, 2, 4, 6), (1, 3, 5, 7))


def test_layout_after_a_plan():
    plan = plan_placement(dp=2, pp=4, node_of_rank=REF_NODES, model=MODEL, slow_links={"n2": 0.05})
    lay = layout(plan.placement, dp=2, pp=4)
    assert lay.dp_groups == ((2, 3), (0, 1), (4, 5), (6, 7))
    assert lay.pipelines == ((2, 0, 4, 6), (3, 1, 5, 7))
    for s, group in enumerate(lay.dp_groups):
        for d, r in enumerate(group):
            assert lay.cells[r] == (d, s) and lay.pipelines[d][s] == r


# -- brute force over every placement ----------------------------------------------------
def _random_instance(rng, dp, pp):
    num_ranks = dp * pp
    num_nodes = int(rng.integers(2, min(4, num_ranks) + 1))
    nodes = tuple(f"n{i}" for i in sorted(rng.integers(0, num_nodes, num_ranks)))
    names = sorted(set(nodes))
    slow = {}
    for _ in range(int(rng.integers(0, 3))):
        if rng.random() < 0.3:
            link = names[int(rng.integers(len(names)))]
        else:
            if len(names) < 2:
                continue
            a, b = rng.choice(len(names), 2, replace=False)
            link = _pair(names[a], names[b])
        slow[link] = float(rng.choice([0.05, 0.25, 0.5, 1.0]))
    slow_ranks = rng.choice(num_ranks, int(rng.integers(0, 3)), replace=False)
    stragglers = {int(r): float(rng.choice([1.5, 2.0, 3.0])) for r in slow_ranks}
    current = tuple(tuple(int(x) for x in c) for c in rng.permutation(default_placement(dp, pp)))
    dp_bytes = [float(rng.choice([5.0, 20.0, 100.0])) for _ in range(pp)]
    model = CostModel(dp_bytes=dp_bytes, pp_bytes=float(rng.choice([1.0, 10.0, 50.0])), bandwidth=2.0,
                      stage_seconds=[float(x) for x in rng.choice([1.0, 1.5, 4.0], pp)])
    return nodes, slow, stragglers, current, model


@pytest.mark.parametrize(
    ("dp", "pp", "seeds"),
    [(2, 3, range(30)), (3, 2, range(30, 45)), (2, 4, range(45, 49)), (1, 5, range(49, 53)), (5, 1, range(53, 57))],
)
def test_matches_a_brute_force_over_every_placement(dp, pp, seeds):
    for seed in seeds:
        rng = np.random.default_rng(seed)
        nodes, slow, stragglers, current, model = _random_instance(rng, dp, pp)
        plan = plan_placement(dp=dp, pp=pp, node_of_rank=nodes, model=model, placement=current,
                              slow_links=slow, stragglers=stragglers)
        _check_plan(plan, current, dp, pp)
        args = (nodes, dp, pp, slow, stragglers, list(model.dp_bytes), model.pp_bytes, model.bandwidth,
                list(model.stage_seconds))
        best = None
        for cells in itertools.permutations(default_placement(dp, pp)):
            key = (_model_cost(cells, *args), _stage_moves(current, cells), _cell_changes(current, cells))
            if best is None or key[0] < best[0] * (1 - 1e-12):
                best = key
            elif math.isclose(key[0], best[0], rel_tol=1e-12):
                best = min(best, key, key=lambda k: k[1:])
        assert plan.cost_after == pytest.approx(best[0], rel=1e-12), seed
        assert _model_cost(plan.placement, *args) == pytest.approx(best[0], rel=1e-12), seed
        assert (len(plan.moves), _cell_changes(current, plan.placement)) == best[1:], seed
        assert plan.cost_before == pytest.approx(_model_cost(current, *args), rel=1e-12)


def test_step_cost_matches_the_definition():
    rng = np.random.default_rng(7)
    for _ in range(20):
        nodes, slow, stragglers, current, model = _random_instance(rng, 3, 3)
        args = (nodes, 3, 3, slow, stragglers, list(model.dp_bytes), model.pp_bytes, model.bandwidth,
                list(model.stage_seconds))
        got = step_cost(current, dp=3, pp=3, node_of_rank=nodes, model=model, slow_links=slow, stragglers=stragglers)
        assert got == pytest.approx(_model_cost(current, *args), rel=1e-12)


def test_deterministic():
    kwargs = {"dp": 2, "pp": 4, "node_of_rank": REF_NODES, "model": MODEL, "stragglers": {0: 2.0, 7: 2.0}}
    assert plan_placement(**kwargs).placement == plan_placement(**kwargs).placement


# -- sizes and timings -------------------------------------------------------------------
def test_the_reference_job_is_fast():
    plan = plan_placement(dp=2, pp=4, node_of_rank=REF_NODES, model=MODEL, slow_links={"n2": 0.05},
                          stragglers={1: 2.0})
    assert plan.solve_seconds < 0.2


@pytest.mark.parametrize(
    ("dp", "pp", "per_node", "kwargs", "num_moves"),
    [
        (8, 8, 8, {"slow_links": {"n3": 0.05}}, 16),
        (2, 32, 2, {"slow_links": {"n5": 0.05}}, 4),
        (8, 8, 8, {"stragglers": {3: 2.0, 20: 1.5, 45: 3.0}}, 4),
        (8, 8, 1, {"slow_links": {_pair("n5", "n6"): 0.05}}, 0),
    ],
)
def test_64_ranks_in_seconds(dp, pp, per_node, kwargs, num_moves):
    nodes = tuple(f"n{r // per_node + 1}" for r in range(dp * pp))
    plan = plan_placement(dp=dp, pp=pp, node_of_rank=nodes, model=MODEL, **kwargs)
    _check_plan(plan, default_placement(dp, pp), dp, pp)
    assert plan.improves and len(plan.moves) == num_moves
    assert plan.solve_seconds < 5.0


def test_beyond_the_limits_is_a_value_error():
    nodes = ("a",) * 70 + ("b",) * 10
    with pytest.raises(ValueError, match="at most 64"):
        plan_placement(dp=2, pp=40, node_of_rank=nodes, model=MODEL, slow_links={"a": 0.5})
    with pytest.raises(ValueError, match="more than the 1024"):
        plan_placement(dp=64, pp=17, node_of_rank=("a",) * 1088, model=MODEL)
    with pytest.raises(ValueError, match="passed 20 branches"):
        plan_placement(dp=2, pp=4, node_of_rank=REF_NODES, model=MODEL, slow_links={"n2": 0.05}, max_branches=20)


# -- bad input -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"placement": ((0, 0), (0, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3))}, "not a bijection"),
        ({"placement": default_placement(2, 4)[:7]}, "placement has 7 cells"),
        ({"placement": ((0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (2, 3))}, "placement of rank 7"),
        ({"placement": ((0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, -1))}, "stage must be"),
        ({"placement": ((0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, 3), 7)}, "placement of rank 7"),
        ({"slow_links": {"n9": 0.5}}, "unknown node 'n9'"),
        ({"slow_links": {_pair("n1", "n9"): 0.5}}, "unknown node 'n9'"),
        ({"slow_links": {frozenset({"n1"}): 0.5}}, "frozenset of two node names"),
        ({"slow_links": {("n1", "n2"): 0.5}}, "frozenset of two node names"),
        ({"slow_links": {"n1": 0.0}}, r"factor of slow link n1 must be a finite number in \(0, 1\]"),
        ({"slow_links": {_pair("n1", "n2"): 1.5}}, r"factor of slow link n1-n2 must be .* in \(0, 1\]"),
        ({"slow_links": {"n1": -0.1}}, "factor of slow link"),
        ({"slow_links": {"n1": float("nan")}}, "factor of slow link"),
        ({"slow_links": {"n1": "fast"}}, "must be a number"),
        ({"stragglers": {8: 2.0}}, "straggler rank 8 is out of range; ranks are 0..7"),
        ({"stragglers": {-1: 2.0}}, "straggler rank must be a whole number >= 0"),
        ({"stragglers": {1: 0.5}}, "slowdown of straggler rank 1"),
        ({"node_of_rank": REF_NODES[:7]}, "node_of_rank has 7 entries"),
        ({"node_of_rank": "n1n1n2n2"}, "not one string"),
        ({"node_of_rank": REF_NODES[:7] + ("",)}, "node of rank 7"),
        ({"dp": 0}, "dp must be a whole number >= 1"),
        ({"pp": 2.5}, "pp must be a whole number >= 1"),
        ({"model": CostModel(dp_bytes=[1.0, 2.0], pp_bytes=1.0, bandwidth=1.0)}, "dp_bytes has 2 entries"),
        ({"model": CostModel(dp_bytes=1.0, pp_bytes=-1.0, bandwidth=1.0)}, "pp_bytes must be"),
        ({"model": CostModel(dp_bytes=1.0, pp_bytes=1.0, bandwidth=0.0)}, "bandwidth must be"),
        ({"model": CostModel(dp_bytes=1.0, pp_bytes=1.0, bandwidth=1.0, stage_seconds=[1.0])}, "stage_seconds has 1"),
        ({"model": CostModel(dp_bytes=1.0, pp_bytes=1.0, bandwidth=1.0, stage_seconds=[1, 1, 0, 1])},
         "stage_seconds of stage 2"),
        ({"model": {"dp_bytes": 1.0}}, "model must be a CostModel"),
    ],
)
def test_bad_input_is_one_line(kwargs, message):
    args = {"dp": 2, "pp": 4, "node_of_rank": REF_NODES, "model": MODEL} | kwargs
    with pytest.raises(ValueError, match=message) as caught:
        plan_placement(**args)
    assert "\n" not in str(caught.value)


def test_layout_refuses_a_non_bijection():
    with pytest.raises(ValueError, match="not a bijection: cell \\(0, 0\\) is given to ranks 0 and 1"):
        layout(((0, 0), (0, 0)), dp=2, pp=1)
    with pytest.raises(ValueError, match="placement has 1 cells"):
        layout(((0, 0),), dp=2, pp=1)
