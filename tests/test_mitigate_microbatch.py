"""S2, the micro-batch re-split (greyhound.mitigate.microbatch) and `greyhound plan microbatches`:
exact answers by hand, invariants, a brute force over every allocation, a cvxpy MILP
solved with HiGHS, and every error path as one line."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import cvxpy as cp
import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from greyhound.cli import main
from greyhound.mitigate.microbatch import Allocation, even_split, makespan, split_microbatches

SCRIPT = Path(sys.executable).parent / "greyhound"


def _finish(m, t):
    """Each group's seconds, the float products the solver optimises."""
    return [float(mi) * ti for mi, ti in zip(m, t)]


def _check_allowed(result: Allocation, t, total, multiple=1, minimum=None):
    least = multiple if minimum is None else minimum
    m = result.allocation
    assert len(m) == len(t)
    assert sum(m) == total
    assert all(mi % multiple == 0 and mi >= least for mi in m)
    assert result.makespan == max(_finish(m, t))


# -- exact answers ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("times", "kwargs", "allocation", "span"),
    [
        ([1, 1, 2], {"total": 10}, (4, 4, 2), 4.0),
        # equal times: the even split, the extra micro-batches on the first groups
        ([1, 1, 1, 1], {"total": 10}, (3, 3, 2, 2), 3.0),
        ([2, 1], {"total": 3}, (1, 2), 2.0),
        # the spare micro-batch goes to the fastest of the groups that can take it
        ([1, 1, 1, 2], {"total": 8}, (3, 2, 2, 1), 3.0),
        ([1, 0.5, 1, 2], {"total": 8}, (2, 3, 2, 1), 2.0),
        # multiples of P: units of 4 micro-batches
        ([1, 1, 1, 3], {"total": 32, "multiple": 4}, (12, 8, 8, 4), 12.0),
        ([1, 3], {"total": 8, "multiple": 2}, (6, 2), 6.0),
        # the default minimum keeps one micro-batch (one P-block) on a very slow group
        ([1, 100], {"total": 10}, (9, 1), 100.0),
        ([1, 100], {"total": 16, "multiple": 4}, (12, 4), 400.0),
        # minimum 0 drains it
        ([1, 100], {"total": 10, "minimum": 0}, (10, 0), 10.0),
        # a minimum above the optimum's share binds
        ([1, 1, 4], {"total": 12, "minimum": 3}, (5, 4, 3), 12.0),
        # a minimum that is not a multiple of P acts as the next multiple
        ([1, 1, 9], {"total": 24, "multiple": 4, "minimum": 3}, (12, 8, 4), 36.0),
        ([0.25], {"total": 7}, (7,), 1.75),
    ],
)
def test_known_answers(times, kwargs, allocation, span):
    result = split_microbatches(times, **kwargs)
    assert result.allocation == allocation
    assert result.makespan == span
    _check_allowed(result, times, kwargs["total"], kwargs.get("multiple", 1), kwargs.get("minimum"))


@pytest.mark.parametrize("num_groups", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("multiple", [1, 2, 4])
@pytest.mark.parametrize("blocks_per_group", [1, 2.5, 4])
def test_equal_times_get_the_even_split(num_groups, multiple, blocks_per_group):
    total = int(num_groups * blocks_per_group) * multiple
    total = max(total, num_groups * multiple)
    result = split_microbatches(np.full(num_groups, 0.37), total=total, multiple=multiple)
    assert result.allocation == even_split(num_groups, total=total, multiple=multiple)
    assert result.makespan == makespan(result.allocation, np.full(num_groups, 0.37))


def test_as_dict_has_the_fixed_fields():
    d = split_microbatches([1, 1, 2], total=10).as_dict()
    assert set(d) == {"allocation", "makespan", "solve_seconds"}
    assert d["allocation"] == [4, 4, 2] and d["makespan"] == 4.0 and d["solve_seconds"] >= 0
    json.dumps(d)


def test_even_split():
    assert even_split(3, total=12, multiple=2) == (4, 4, 4)
    assert even_split(4, total=10) == (3, 3, 2, 2)
    assert even_split(3, total=16, multiple=4) == (8, 4, 4)
    with pytest.raises(ValueError, match="not a multiple"):
        even_split(3, total=10, multiple=4)


# -- optimality at scale: a certificate instead of a solver ----------------------------
def _certify_optimal(t, total, multiple, least):
    """T is optimal iff no allowed allocation finishes strictly before it: either a
    group's minimum alone takes T, or the groups cannot fit the total strictly below T."""
    result = split_microbatches(t, total=total, multiple=multiple, minimum=least)
    _check_allowed(result, t, total, multiple, least)
    span = result.makespan
    lo = -(-least // multiple)
    below = 0
    for ti in t.tolist():
        if float(lo * multiple) * ti >= span:
            return  # the minimum binds: nothing can beat span
        k = int(span / (multiple * ti))
        while float((k + 1) * multiple) * ti < span:
            k += 1
        while float(k * multiple) * ti >= span:
            k -= 1
        below += k
    assert below < total // multiple, "an allocation strictly below the makespan fits"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_groups", [512, 4096])
def test_large_instances_are_optimal(seed, num_groups):
    rng = np.random.default_rng(seed)
    t = rng.uniform(0.9, 1.1, num_groups)
    slow = rng.choice(num_groups, 1 + num_groups // 64, replace=False)
    t[slow] *= rng.uniform(1.5, 3.0, len(slow))
    multiple = [1, 4, 3][seed % 3]
    for total in (4 * num_groups * multiple, 10**12 * multiple):
        _certify_optimal(t, total, multiple, multiple)
    _certify_optimal(t, 4 * num_groups * multiple, multiple, 0)


def test_huge_total_is_fast_and_exact():
    t = np.array([1.0, 1.0, 3.0, 0.1])
    result = split_microbatches(t, total=10**15)
    assert sum(result.allocation) == 10**15
    assert result.solve_seconds < 0.5
    _certify_optimal(t, 10**15, 1, 1)


# -- brute force over every allocation ---------------------------------------------------
def _even_units(n, units):
    return [units // n + (1 if i < units % n else 0) for i in range(n)]


def _brute_force(t, total, multiple, least):
    """(best makespan, least squared distance to the even split among the optimal)."""
    n, units = len(t), total // multiple
    lo = -(-least // multiple)
    even = _even_units(n, units)
    best = None
    for head in itertools.product(range(lo, units + 1), repeat=n - 1):
        last = units - sum(head)
        if last < lo:
            continue
        x = (*head, last)
        key = (max(_finish([xi * multiple for xi in x], t)), sum((a - b) ** 2 for a, b in zip(x, even)))
        best = key if best is None or key < best else best
    return best


_times = st.lists(
    st.one_of(st.sampled_from([1.0, 2.0, 3.0, 0.5, 1.5]), st.floats(0.01, 10.0, allow_nan=False)),
    min_size=1, max_size=4,
)


@settings(max_examples=400, deadline=None)
@given(t=_times, units=st.integers(1, 12), multiple=st.sampled_from([1, 2, 3]),
       least=st.sampled_from([None, 0, 1, 2, 4]))
def test_matches_a_brute_force(t, units, multiple, least):
    total = units * multiple
    effective = multiple if least is None else least
    if len(t) * -(-effective // multiple) > units:
        with pytest.raises(ValueError, match="is less than"):
            split_microbatches(t, total=total, multiple=multiple, minimum=least)
        return
    result = split_microbatches(t, total=total, multiple=multiple, minimum=least)
    _check_allowed(result, t, total, multiple, effective)
    span, distance = _brute_force(t, total, multiple, effective)
    assert result.makespan == span
    even = [u * multiple for u in _even_units(len(t), units)]
    assert sum(((a - b) // multiple) ** 2 for a, b in zip(result.allocation, even)) == distance
    # deterministic
    assert split_microbatches(t, total=total, multiple=multiple, minimum=least).allocation == result.allocation


# -- an independent solver: the MILP in cvxpy, solved with HiGHS ------------------------
def _milp_makespan(t, total, multiple, least):
    """min T s.t. m_i t_i <= T, sum m_i = M, m_i = P k_i, k_i integer, m_i >= least."""
    n = len(t)
    k = cp.Variable(n, integer=True)
    span = cp.Variable()
    m = multiple * k
    problem = cp.Problem(cp.Minimize(span), [cp.multiply(m, t) <= span, cp.sum(m) == total, m >= least])
    problem.solve(solver=cp.HIGHS, mip_rel_gap=0.0, mip_abs_gap=0.0, time_limit=60.0)
    assert problem.status == cp.OPTIMAL, problem.status
    counts = np.rint(k.value).astype(int) * multiple
    assert counts.sum() == total and np.all(counts >= least)
    return max(_finish(counts, t))


def _random_instances(count, seed=20250707):
    """(t, total, multiple, minimum): n <= 8 groups, total <= 64, a few groups 1.5-3x slower."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        n = int(rng.integers(1, 9))
        multiple = int(rng.choice([1, 1, 2, 3, 4]))
        least = [None, 0, 1, multiple, 2 * multiple][int(rng.integers(0, 5))]
        lo_units = -(-(multiple if least is None else least) // multiple)
        max_units = 64 // multiple
        if n * lo_units > max_units:
            continue
        t = rng.uniform(0.2, 1.0, n)
        t[rng.random(n) < 0.3] *= rng.uniform(1.5, 3.0)
        out.append((t, int(rng.integers(max(1, n * lo_units), max_units + 1)) * multiple, multiple, least))
    return out


@pytest.mark.parametrize(("t", "total", "multiple", "least"), _random_instances(60))
def test_matches_a_cvxpy_milp(t, total, multiple, least):
    effective = multiple if least is None else least
    result = split_microbatches(t, total=total, multiple=multiple, minimum=least)
    _check_allowed(result, t, total, multiple, effective)
    theirs = _milp_makespan(t, total, multiple, effective)
    assert result.makespan <= theirs
    assert result.makespan == pytest.approx(theirs, rel=1e-6)


# -- errors: one line, what is wrong and what is allowed --------------------------------
@pytest.mark.parametrize(
    ("times", "kwargs", "match"),
    [
        ([], {"total": 4}, "no DP groups"),
        ([1, 0], {"total": 4}, "DP group 1 is 0.0; each must be a finite number > 0"),
        ([1, -2], {"total": 4}, "DP group 1 is -2.0"),
        ([np.nan], {"total": 4}, "DP group 0 is nan"),
        ([np.inf], {"total": 4}, "DP group 0 is inf"),
        ([[1, 2]], {"total": 4}, "flat list"),
        (["a"], {"total": 4}, "must be numbers"),
        ([1], {"total": 0}, "total must be a whole number >= 1, got 0"),
        ([1], {"total": 2.0}, "total must be a whole number >= 1, got 2.0"),
        ([1], {"total": True}, "total must be a whole number"),
        ([1], {"total": 4, "multiple": 0}, "multiple must be a whole number >= 1"),
        ([1], {"total": 4, "minimum": -1}, "minimum must be a whole number >= 0"),
        ([1, 1], {"total": 10, "multiple": 4}, "total 10 is not a multiple of 4"),
        ([1, 1, 1], {"total": 2}, "total 2 is less than 3 DP groups x 1 micro-batches each = 3"),
        ([1, 1], {"total": 8, "multiple": 4, "minimum": 5}, "rounded up to a multiple of 4"),
        ([1], {"total": 2**53 + 1}, "more than 2\\*\\*53"),
        ([1e308], {"total": 4}, "overflows"),
    ],
)
def test_bad_input_raises_one_line(times, kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        split_microbatches(times, **kwargs)
    assert "\n" not in str(info.value)


# -- the CLI ---------------------------------------------------------------------------
def _cli(*args):
    return CliRunner().invoke(main, ["plan", "microbatches", *args])


def test_cli_json():
    res = _cli("--times", "1,1,2", "--total", "10", "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert set(d) == {"allocation", "makespan", "solve_seconds"}
    assert d["allocation"] == [4, 4, 2] and d["makespan"] == 4.0


def test_cli_table_compares_with_the_even_split():
    res = _cli("--times", "1, 1, 2", "--total", "10")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].split() == ["group", "s/micro-batch", "micro-batches", "seconds"]
    assert [line.split() for line in lines[1:4]] == [["0", "1", "4", "4"], ["1", "1", "4", "4"], ["2", "2", "2", "4"]]
    # even split (4, 3, 3): 6 s
    assert "even split: 6 s; re-split: 4 s (50.0% faster)" in res.output


def test_cli_multiple_and_min():
    res = _cli("--times", "1,1,1,3", "--total", "32", "--multiple", "4", "--min", "0", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["allocation"] == [12, 8, 8, 4]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ([], "--times is required"),
        (["--times", "1,1"], "--total is required"),
        (["--times", "1,x", "--total", "4"], "--times: item 2 'x' is not a number"),
        (["--times", "1,,2", "--total", "4"], "--times: item 2 '' is not a number"),
        (["--times", "1,0", "--total", "4"], "DP group 1 is 0.0"),
        (["--times", "1,-1", "--total", "4"], "DP group 1 is -1.0"),
        (["--times", "1,nan", "--total", "4"], "DP group 1 is nan"),
        (["--times", "1", "--total", "2.5"], "--total: '2.5' is not a whole number"),
        (["--times", "1", "--total", "0"], "total must be a whole number >= 1"),
        (["--times", "1", "--total", "4", "--multiple", "x"], "--multiple: 'x' is not a whole number"),
        (["--times", "1", "--total", "4", "--multiple", "0"], "multiple must be a whole number >= 1"),
        (["--times", "1", "--total", "4", "--min", "-1"], "minimum must be a whole number >= 0"),
        (["--times", "1,1", "--total", "6", "--multiple", "4"], "total 6 is not a multiple of 4"),
        (["--times", "1,1,1", "--total", "2"], "total 2 is less than 3 DP groups"),
        (["--times", "1e308", "--total", "4"], "overflows"),
    ],
)
def test_cli_errors_are_one_line(args, match):
    proc = subprocess.run([str(SCRIPT), "plan", "microbatches", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("greyhound: plan microbatches: ")
    assert match in lines[0]
