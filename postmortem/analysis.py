"""The post-mortem in one call: trace in, result (numbers, causes, JSON) out. No I/O."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np

from greyhound.errors import InputError
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


MAX_TIME_S = 1e12
"""Largest |start| and duration (seconds, ~31,700 years) a row may have; beyond it a row
is damaged like a NaN one (sums of such times overflow to inf and the slowdown to NaN)."""


def analyze(trace: Trace, *, estimator: str = "robust", load_seconds: float = 0.0) -> Result:
    """Build the model, attribute the slowdown, find causes.

    Raises:
        InputError: the trace has no usable op row, declares far more DP replicas or
            stages than it has ops for, has no consistent structure (see
            :func:`postmortem.model.build_model`), or its idealised step takes no time.
    """
    t0 = time.perf_counter()
    trace = check_usable(trace)
    model = build_model(trace)
    attr = attribute(model, estimator=estimator)
    if not (attr.t_ideal > 0 and math.isfinite(attr.slowdown)):
        raise InputError(
            f"{trace.path or 'trace'}: the idealised step takes {attr.t_ideal!r} s, so there is no "
            "slowdown to compute; the trace needs ops of positive duration"
        )
    causes = find_causes(trace, model, attr)
    return Result(
        trace=trace,
        model=model,
        attribution=attr,
        causes=causes,
        load_seconds=load_seconds,
        analysis_seconds=time.perf_counter() - t0,
    )


def check_usable(trace: Trace) -> Trace:
    """The trace, checked, with rows the model cannot use marked as damaged.

    The model drops rows with NaN, infinite or negative times or ranks out of range (and
    their steps).  Rows with times beyond :data:`MAX_TIME_S`, and the rows of steps that
    take no time at all (every op of duration 0 at one instant), are damaged too: they
    get a NaN start here and a note in ``Trace.dropped``.

    Raises:
        InputError: no usable row is left; or the meta declares more than twice the DP
            replicas (stages) that have ops: every declared replica and stage costs the
            model memory and a what-if scenario, so that is a damaged meta, not a job
            with a few rank files missing.
    """
    where = trace.path or "trace"
    D, P = trace.meta.dp, trace.meta.pp
    ops = trace.ops
    n = trace.num_ops
    if n == 0:
        raise InputError(f"{where}: the trace has no ops")
    dp, pp, start, dur = ops["dp_rank"], ops["pp_rank"], ops["start"], ops["duration"]
    with np.errstate(invalid="ignore"):
        ranks_ok = (dp >= 0) & (dp < D) & (pp >= 0) & (pp < P)
        finite = np.isfinite(start) & np.isfinite(dur) & (dur >= 0)
        far = finite & ((np.abs(start) > MAX_TIME_S) | (dur > MAX_TIME_S))
    good = ranks_ok & finite & ~far
    notes = []
    if far.any():
        notes.append(f"{int(far.sum())} op rows with times beyond {MAX_TIME_S:.0e} s treated as damaged")
    if good.any():
        # steps that take no time: their ops all start together and last 0 s
        step = ops["step"][good].astype(np.int64)
        lo, hi = int(step.min()), int(step.max())
        if hi - lo <= 4 * step.size + 1024:  # step numbers span a small range: no sort
            values = np.arange(lo, hi + 1)
            slot = step - lo
        else:
            values, slot = np.unique(step, return_inverse=True)
        size = values.size
        first = np.full(size, np.inf)
        last = np.full(size, -np.inf)
        seen = np.zeros(size, bool)
        seen[slot] = True
        np.minimum.at(first, slot, start[good])
        np.maximum.at(last, slot, start[good] + dur[good])
        empty = values[seen & ~(last > first)]
        if empty.size:
            zero = good & np.isin(ops["step"], empty)
            notes.append(f"{empty.size} step(s) that take no time (all ops of 0 s at one instant) "
                         f"treated as damaged: steps {', '.join(map(str, empty[:10].tolist()))}"
                         + (" ..." if empty.size > 10 else ""))
            good &= ~zero
            far |= zero
    if not good.any():
        raise InputError(
            f"{where}: no usable op row: all {n} rows have NaN, infinite, negative or zero-length times, "
            f"times beyond {MAX_TIME_S:.0e} s, or ranks outside dp_rank < {D}, pp_rank < {P}; "
            "need finite start and duration >= 0 seconds and steps that take time"
        )
    for name, declared, ranks in (("DP replicas", D, dp[good]), ("pipeline stages", P, pp[good])):
        present = int(np.count_nonzero(np.bincount(ranks.astype(np.int64), minlength=declared)))
        if declared > 2 * present:
            raise InputError(
                f"{where}: the job metadata declares {declared} {name} but ops cover only {present}; "
                "at most half of them may be missing from a trace"
            )
    if not far.any():
        return trace
    marked = np.where(far, np.nan, start)
    return replace(trace, ops={**ops, "start": marked}, dropped=(*trace.dropped, *notes))


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
    name = max(by_optype, key=by_optype.__getitem__) if by_optype else "none"
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
