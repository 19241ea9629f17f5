"""S3's gathering of compute stragglers into the fewest replicas (greyhound.mitigate.gather):
checked against every placement reachable by DP-rank exchanges within stages."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from greyhound.mitigate.gather import MAX_STRAGGLERS, gather_stragglers
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
