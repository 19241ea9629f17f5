"""S3's gathering of compute stragglers into the fewest replicas (greyhound.mitigate.gather):
checked against every placement reachable by DP-rank exchanges within stages."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from greyhound.mitigate.gather import MAX_STRAGGLERS, choose_straggler_plan, gather_stragglers, pipeline_step
from greyhound.mitigate.microbatch import split_microbatches
from greyhound.mitigate.placement import default_placement


def _makespan(cells, stragglers, dp, microbatches):
    paces = [max([x for r, x in stragglers.items() if cells[r][0] == d], default=1.0) for d in range(dp)]
    return split_microbatches(np.array(paces), total=microbatches).makespan


def _exchanges(cells, dp, pp):
    """Every placement that keeps each rank's stage (each stage's ranks permuted over its
    DP ranks)."""
    by_stage = [[r for r, c in enumerate(cells) if c[1] == s] for s in range(pp)]
    for orders in itertools.product(*(itertools.permutations(range(dp)) for _ in range(pp))):
        new = list(cells)
        for s, order in enumerate(orders):
            for r, d in zip(by_stage[s], order):
                new[r] = (d, s)
        yield new


@pytest.mark.parametrize("seed", range(40))
def test_the_gathering_is_the_best_exchange_and_moves_no_stage(seed):
    rng = random.Random(seed)
    dp, pp = rng.choice([(2, 2), (2, 3), (2, 4), (3, 2), (3, 3)])
    cells = list(default_placement(dp, pp))
    rng.shuffle(cells)                  # any current placement
    stragglers = {r: round(rng.uniform(1.1, 6.0), 2) for r in rng.sample(range(dp * pp), rng.randint(1, 4))}
    microbatches = dp * rng.randint(2, 6)
    plan, split = gather_stragglers(cells, stragglers=stragglers, microbatches=microbatches)
    best = min(_makespan(c, stragglers, dp, microbatches) for c in _exchanges(cells, dp, pp))
    now = _makespan(cells, stragglers, dp, microbatches)
    assert plan.cost_before == pytest.approx(now)
    assert plan.cost_after == pytest.approx(best if best < now else now)
    assert plan.improves == (best < now)
    assert not plan.moves and all(new[1] == old[1] for new, old in zip(plan.placement, cells))
    assert sorted(plan.placement) == sorted(cells)
    assert _makespan(plan.placement, stragglers, dp, microbatches) == pytest.approx(plan.cost_after)
    assert sum(split) == microbatches and len(split) == dp
    # The fewest stragglers change replica among the best placements.
    fewest = min(sum(c[r][0] != cells[r][0] for r in stragglers) for c in _exchanges(cells, dp, pp)
                 if _makespan(c, stragglers, dp, microbatches) == pytest.approx(plan.cost_after))
    assert sum(plan.placement[r][0] != cells[r][0] for r in stragglers) == fewest


def test_two_stragglers_in_two_replicas_end_in_one_and_the_other_takes_the_micro_batches():
    cells = default_placement(2, 4)        # rank s*2 + d at (d, s): ranks 2 and 5 in replicas 0 and 1
    plan, split = gather_stragglers(cells, stragglers={2: 7.2, 5: 3.1}, microbatches=16)
    assert plan.improves and plan.placement[2][0] == plan.placement[5][0]
    assert plan.reshuffled == (4, 5)       # rank 5 and the rank whose cell it took
    assert split[plan.placement[2][0]] == 2 and sum(split) == 16


def test_stragglers_of_one_stage_stay_in_different_replicas_and_nothing_better_is_claimed():
    plan, split = gather_stragglers(default_placement(2, 4), stragglers={2: 3.0, 3: 3.0}, microbatches=16)
    assert not plan.improves and plan.placement == default_placement(2, 4) and split == (8, 8)
    assert "no gathering" in plan.reason


@pytest.mark.parametrize("stragglers, message", [
    ({9: 2.0}, "straggler rank 9 is out of range; ranks are 0..7"),
    ({1: 0.5}, "slowness of straggler rank 1 must be >= 1"),
    ({r: 2.0 for r in range(MAX_STRAGGLERS + 1)}, f"at most {MAX_STRAGGLERS} are gathered at once"),
])
def test_bad_input_is_one_clear_line(stragglers, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        gather_stragglers(default_placement(2, 8 if len(stragglers) > 8 else 4), stragglers=stragglers,
                          microbatches=16)


def test_a_placement_that_is_not_a_grid_is_refused():
    with pytest.raises(ValueError, match="bijection"):
        gather_stragglers([(0, 0), (0, 0), (1, 1), (1, 0)], stragglers={0: 2.0}, microbatches=4)


# ---- choosing between gathering into replicas and consolidating into stages ----------

NODES = [f"n{r // 2 + 1}" for r in range(8)]


def _candidates(stragglers, microbatches, multiple=1):
    from greyhound.mitigate.placement import CostModel, plan_placement

    now = default_placement(2, 4)            # rank s * 2 + d at (d, s)
    gathered, _ = gather_stragglers(now, stragglers=stragglers, microbatches=microbatches, multiple=multiple)
    consolidated = plan_placement(dp=2, pp=4, node_of_rank=NODES, placement=now, stragglers=stragglers,
                                  model=CostModel(dp_bytes=4e6, pp_bytes=1e5, bandwidth=1e9))
    return now, [gathered, consolidated]


def test_the_1f1b_step_adds_every_slow_stage_once_and_the_slowest_per_micro_batch():
    now = default_placement(2, 4)
    assert pipeline_step(now, stragglers={}, split=(4, 4)) == 3 + 4
    # Ranks 2 and 4: replica 0's stages 1 and 2, 4x: 3 x 4 + 4 + 4 + 1 + 1.
    assert pipeline_step(now, stragglers={2: 4.0, 4: 4.0}, split=(4, 4)) == 22
    # Ranks 2 and 3: stage 1 of each replica: 3 x 4 + 4 + 3 in both.
    assert pipeline_step(now, stragglers={2: 4.0, 3: 4.0}, split=(4, 4)) == 19
    assert pipeline_step(now, stragglers={2: 4.0, 4: 4.0}, split=(2, 6)) == max(1 * 4 + 10, 5 + 4)


def test_where_s2_can_move_micro_batches_the_stragglers_are_gathered_into_one_replica():
    # Ranks 2 (replica 0, stage 1) and 5 (replica 1, stage 2), 4x, 8 + 8 micro-batches:
    # 35 as they are; one stage, 35 (every replica slow); one replica with 3 + 13, 18.
    now, candidates = _candidates({2: 4.0, 5: 4.0}, 16)
    plan, split = choose_straggler_plan(now, candidates, stragglers={2: 4.0, 5: 4.0}, microbatches=16)
    assert plan.improves and plan.moves == () and (plan.cost_before, plan.cost_after) == (35, 18)
    slow_replica = plan.placement[2][0]
    assert plan.placement[5][0] == slow_replica and (split[slow_replica], sum(split)) == (3, 16)
    assert "gather" in plan.reason


def test_where_no_split_helps_the_stragglers_are_consolidated_into_one_inner_stage():
    # Ranks 2 and 4 in replica 0's stages 1 and 2, and a job whose replicas keep multiples
    # of 4 micro-batches (4 + 4: nothing to re-split): one stage gives 19 against 22.
    stragglers = {2: 4.0, 4: 4.0}
    now, candidates = _candidates(stragglers, 8, multiple=4)
    plan, split = choose_straggler_plan(now, candidates, stragglers=stragglers, microbatches=8, multiple=4)
    assert plan.improves and (plan.cost_before, plan.cost_after) == (22, 19) and split == (4, 4)
    assert plan.placement[2][1] == plan.placement[4][1] in (1, 2) and plan.placement[2][0] != plan.placement[4][0]
    assert len(plan.moves) == 2 and "consolidate" in plan.reason
    # With ones, S2 unloads replica 0 where they are (3 + 13: 2 x 4 + 10 = 18, against 35
    # in one stage).
    now, candidates = _candidates(stragglers, 16)
    plan, split = choose_straggler_plan(now, candidates, stragglers=stragglers, microbatches=16)
    assert not plan.improves and plan.placement == now and plan.cost_before == plan.cost_after == 18
    assert split == (3, 13) and "neither" in plan.reason


@pytest.mark.parametrize("seed", range(30))
def test_the_choice_is_never_worse_than_the_placement_in_force_and_is_scored_as_it_runs(seed):
    rng = random.Random(seed)
    stragglers = {r: rng.choice([1.5, 2.0, 4.0, 8.0]) for r in rng.sample(range(8), rng.randint(1, 3))}
    total, multiple = rng.choice([(8, 4), (16, 4), (16, 1), (12, 2)])
    now, candidates = _candidates(stragglers, total, multiple)
    plan, split = choose_straggler_plan(now, candidates, stragglers=stragglers, microbatches=total,
                                        multiple=multiple)
    assert plan.cost_after <= plan.cost_before
    assert plan.cost_after == pipeline_step(plan.placement, stragglers=stragglers, split=split)
    assert sum(split) == total and all(m % multiple == 0 for m in split)
    for cand in candidates:        # each candidate under its own S2 split is no better
        dp_paces = [max([x for r, x in stragglers.items() if cand.placement[r][0] == d], default=1.0)
                    for d in range(2)]
        own = split_microbatches(np.array(dp_paces), total=total, multiple=multiple).allocation
        assert pipeline_step(cand.placement, stragglers=stragglers, split=own) >= plan.cost_after
