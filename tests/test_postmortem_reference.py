"""The What-if study's three real traces against its analyzer's reference results."""

import json

import pytest

from conftest import STUDY_TRACES
from postmortem.attribution import attribute
from postmortem.model import build_model
from postmortem.whatif_import import read_whatif_trace

_cache: dict = {}


def _load(name: str):
    if name not in _cache:
        model = build_model(read_whatif_trace(STUDY_TRACES / f"trace-{name}.parquet"))
        ref = json.loads((STUDY_TRACES / f"result-{name}.json").read_text())
        ms = json.loads((STUDY_TRACES / f"ms-{name}.json").read_text())["Ms"]
        mw = json.loads((STUDY_TRACES / f"mw-{name}.json").read_text())["Mw"]
        _cache[name] = (model, ref, ms, mw, {e: attribute(model, estimator=e) for e in ("mean", "robust")})
    return _cache[name]


def _top(d: dict) -> str:
    return max(d, key=d.get)


@pytest.mark.parametrize("name", ["ST", "AR", "SE"])
def test_study_estimator_reproduces_reference(name):
    model, ref, ms, mw, res = _load(name)
    a = res["mean"]
    assert model.dropped == ()
    assert abs(a.slowdown / ref["blocking_slowdown"] - 1) <= 0.02
    assert _top(a.by_optype) == _top(ref["blocking_decompose_by_optype"])
    assert _top(a.by_pp_rank) == _top(ref["blocking_decompose_by_stage"])
    assert abs(a.ms - ms) <= 0.05
    assert abs(a.mw - mw) <= 0.05
    # replay error of the same order as the study's (launch_slowdown - 1), and below 5%
    assert abs(a.simulation_error) < 0.05


@pytest.mark.parametrize("name", ["ST", "SE"])
def test_robust_estimator_matches_reference_without_worker_straggler(name):
    _, ref, ms, mw, res = _load(name)
    a = res["robust"]
    assert abs(a.slowdown / ref["blocking_slowdown"] - 1) <= 0.02
    assert _top(a.by_optype) == _top(ref["blocking_decompose_by_optype"])
    assert _top(a.by_pp_rank) == _top(ref["blocking_decompose_by_stage"])
    assert abs(a.ms - ms) <= 0.05 and abs(a.mw - mw) <= 0.05


def test_robust_estimator_on_ar_is_deliberately_higher():
    """AR has one worker slowed on purpose: the study's ideal (the job-wide mean) includes
    that worker's slow ops, greyhound's excludes them (postmortem/idealize.py), so S is
    higher by the share the straggler added to the mean -- and nothing else moves."""
    model, ref, ms, mw, res = _load("AR")
    rob, mean = res["robust"], res["mean"]
    assert rob.slowdown > mean.slowdown * 1.05
    # the slow worker (dp0/pp0) is excluded from the ideal in every step; of the other
    # 15 workers' cells only a thin noise tail (<5%) is
    cells = rob.ideal.outlier_cells  # (P, D, N)
    assert cells[0, 0].all()
    others = cells.sum() - cells[0, 0].sum()
    assert others <= 0.05 * (cells.size - cells[0, 0].size)
    assert _top(rob.by_optype) == _top(ref["blocking_decompose_by_optype"])
    assert _top(rob.by_pp_rank) == _top(ref["blocking_decompose_by_stage"])
    assert _top(rob.by_dp_rank) == _top(ref["blocking_decompose_by_dp_rank"])
    assert abs(rob.ms - ms) <= 0.05 and abs(rob.mw - mw) <= 0.05
