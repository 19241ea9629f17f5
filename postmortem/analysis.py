"""The post-mortem in one call: trace in, result (numbers, causes, JSON) out. No I/O."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from postmortem.attribution import Attribution, attribute
from postmortem.causes import Cause, find_causes
from postmortem.model import STEP_START, Model, build_model
from postmortem.schema import Trace


@dataclass(frozen=True, kw_only=True)
class Result:
    trace: Trace
    model: Model
    attribution: Attribution
    causes: list[Cause]
    load_seconds: float
    analysis_seconds: float

    def to_json(self) -> dict:
        a = self.attribution
        m = self.model
        top = _top_worker(self)
        return {
            "slowdown": round(a.slowdown, 6),
            "gpu_time_lost": round(1.0 - 1.0 / a.slowdown, 6) if a.slowdown > 0 else 0.0,
            "simulation_error": round(a.simulation_error, 6),
            "t_real": a.t_real,
            "t_replay": a.t_replay,
            "t_ideal": a.t_ideal,
            "by_optype": {k: round(v, 6) for k, v in sorted(a.by_optype.items(), key=lambda x: -x[1])},
            "by_dp_rank": {k: round(v, 6) for k, v in a.by_dp_rank.items()},
            "by_pp_rank": {k: round(v, 6) for k, v in a.by_pp_rank.items()},
            "mw": round(a.mw, 6),
            "ms": round(a.ms, 6),
            "mw_workers": [{"dp_rank": d, "pp_rank": p} for d, p in a.mw_workers],
            "top_worker": top,
            "heatmap": {
                "worker_slowdown": np.round(a.worker_slowdown, 4).tolist(),
                "worker_slowdown_exact": a.worker_slowdown_exact,
                "compute_ratio": np.round(a.ideal.cell_ratio, 4).tolist(),
                "axes": "rows dp_rank, columns pp_rank",
            },
            "step_slowdown": {str(int(s)): round(float(v), 6) for s, v in zip(m.steps, a.step_slowdown)},
            "causes": [c.to_json() for c in self.causes],
            "estimator": a.ideal.estimator,
            "job": {
                "dp": m.dp,
                "pp": m.pp,
                "steps_analysed": int(m.steps.size),
                "ops": self.trace.num_ops,
                "job_id": self.trace.meta.job_id,
                "source": self.trace.meta.source,
                "trace": self.trace.path,
            },
            "dropped": list(m.dropped),
            "timing": {
                "load_seconds": round(self.load_seconds, 4),
                "analysis_seconds": round(self.analysis_seconds, 4),
            },
        }


def analyze(trace: Trace, *, estimator: str = "robust", load_seconds: float = 0.0) -> Result:
    """Build the model, attribute the slowdown, find causes."""
    t0 = time.perf_counter()
    model = build_model(trace)
    attr = attribute(model, estimator=estimator)
    causes = find_causes(trace, model, attr)
    return Result(
        trace=trace,
        model=model,
        attribution=attr,
        causes=causes,
        load_seconds=load_seconds,
        analysis_seconds=time.perf_counter() - t0,
    )


def _top_worker(result: Result) -> dict:
    a = result.attribution
    ws = a.worker_slowdown
    # the hottest cell by S_w, ties broken by the raw compute ratio
    flat = np.lexsort((-a.ideal.cell_ratio.ravel(), -ws.ravel()))[0]
    d, p = divmod(int(flat), result.model.pp)
    return {
        "dp_rank": d,
        "pp_rank": p,
        "node": result.trace.node_of().get((d, p), "?"),
        "s_w": round(float(ws[d, p]), 4),
    }


def _dominant_kind(by_optype: dict[str, float]) -> str:
    name = max(by_optype, key=by_optype.get) if by_optype else "none"
    if name.endswith("-compute") or name == "optimizer":
        return "compute"
    if name == "gc":
        return "gc"
    if name == STEP_START:
        return "step-skew"
    if "pp-comm" in name:
        return "pp-comm"
    return "dp-comm"


def summary_line(result: Result, report_path: str) -> str:
    """One line for the job's accounting record (<= 1024 characters, case kept).

    e.g. ``greyhound: S=1.34 (25% GPU-time lost) top: compute dp1/pp2 on n3; report <path>``
    """
    a = result.attribution
    top = _top_worker(result)
    lost = max(0.0, 1.0 - 1.0 / a.slowdown) if a.slowdown > 0 else 0.0
    kind = _dominant_kind(a.by_optype)
    cause = f"; cause: {result.causes[0].cause}" if result.causes else ""
    line = (
        f"greyhound: S={a.slowdown:.2f} ({lost * 100:.0f}% GPU-time lost) "
        f"top: {kind} dp{top['dp_rank']}/pp{top['pp_rank']} on {top['node']}{cause}; report {report_path}"
    )
    line = " ".join(line.split())  # no newlines on an accounting record
    if len(line) > 1024:
        keep = 1024 - len(" ...")
        line = line[:keep] + " ..."
    return line
