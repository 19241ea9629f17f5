"""The online control plane's events in the post-mortem: read, placed on steps, told.

While the job ran, greyhound's control plane (``greyhound.control``) appended each of
its decisions to the event log in the job's run dir (detections, suspects, pauses,
validations, verdicts, recoveries). The report lists them beside the What-if analysis
and marks them on its per-step slowdown plot, so one page shows both answers: what
the online detector saw and did while the job ran, and what the trace says after.

Events carry wall-clock times; a greyhound trace's times are wall-clock seconds too
(``greyhound.timeline``), so an event is placed on the step that was running at its
time (:func:`place_events` states the rule). Everything here is pure but
:func:`load_online_events`, which reads the log (bounded, see
``greyhound.control.events.read_event_log``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from greyhound.control.events import read_event_log
from greyhound.errors import InputError
from postmortem.schema import Trace

MARKERS: dict[str, str] = {
    "detected": "detection", "verdict": "verdict", "paused": "pause",
    "recovered": "recovery", "back_to_tracking": "recovery", "reexamining": "detection",
    "mitigation": "mitigation", "mitigation_ended": "mitigation", "relaid": "mitigation",
}
"""Event kind -> the plot marker it gets (the other kinds are listed, not marked)."""
MARKER_STYLE: dict[str, tuple[str, str]] = {
    "detection": ("tab:orange", "--"), "verdict": ("tab:red", "-"),
    "pause": ("tab:purple", ":"), "recovery": ("tab:green", "-."), "mitigation": ("tab:blue", "-"),
}
"""Marker -> (colour, line style) on the per-step plot."""
MAX_MARKERS = 200
"""Most markers drawn per kind of marker (the table and the JSON have every event)."""
MAX_SUMMARY_CHARS = 240
NO_RUN_DIR = "No event log given: this post-mortem ran on a trace alone."
DID_NOT_RUN = "The online control plane did not run for this job (no event log in its run dir)."


@dataclass(frozen=True, kw_only=True)
class StepClock:
    """When each traced step started, on the trace's clock. Shapes: n traced steps."""

    steps: np.ndarray
    """(n,) step numbers, increasing."""
    starts: np.ndarray
    """(n,) the earliest start of any op of the step (the model's step origin), never
    decreasing with the step number."""
    ends: np.ndarray
    """(n,) the latest end of any op of the step."""


@dataclass(frozen=True, kw_only=True)
class PlacedEvent:
    """One event of the log, placed on the job's steps."""

    event: dict
    """The event as logged (``time``, ``kind`` and its fields)."""
    at_s: float
    """Where it is placed (Unix s): its time; for ``paused``, when the pause began."""
    since_start_s: float
    """at_s in seconds from the job's first record (its first traced step or first
    event, whichever came first)."""
    step: int | None
    """The step running at at_s; None outside the traced steps."""
    step_text: str
    """The step as the table shows it: "62", "~57" (between two traced steps, from
    their times), "before step 9", "after step 149"."""
    plot_x: float | None
    """Position on the per-step plot's x axis (analysed step i is at i; a time inside
    it lies between i and i + 1); None when outside the analysed steps."""
    marker: str | None
    """The plot marker (a value of :data:`MARKERS`), None for kinds listed only."""
    summary: str
    """One line for a person, e.g. "verdict: compute fail-slow at rank 5 on n3, ..."."""

    def to_json(self) -> dict:
        detail = {k: _plain(v) for k, v in self.event.items() if k not in ("time", "kind")}
        return {"time": self.event["time"], "kind": self.event["kind"], "since_start_s": round(self.since_start_s, 3),
                "step": self.step, "step_text": self.step_text,
                "plot_x": None if self.plot_x is None else round(self.plot_x, 4),
                "marker": self.marker, "summary": self.summary, "detail": detail}


@dataclass(frozen=True, kw_only=True)
class OnlineEvents:
    """The event section of a report."""

    placed: list[PlacedEvent]
    """The events in log order."""
    note: str
    """One line about the log: how many events, lines skipped, or why there are none."""

    def to_json(self) -> list[dict]:
        return [p.to_json() for p in self.placed]


MAX_DETAIL_DEPTH = 6


def _plain(value, depth: int = 0):
    """A logged field as strict JSON: NaN and infinities as null, nesting deeper than
    MAX_DETAIL_DEPTH as "..." (the log is the job user's to write)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (dict, list)) and depth >= MAX_DETAIL_DEPTH:
        return "..."
    if isinstance(value, dict):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, depth + 1) for v in value]
    return value


def step_clock(trace: Trace) -> StepClock | None:
    """Each traced step's first start and last end (rows with non-finite times left
    out); None when no row has finite times."""
    ops = trace.ops
    start = np.asarray(ops["start"], dtype=np.float64)
    end = start + np.asarray(ops["duration"], dtype=np.float64)
    ok = np.isfinite(start) & np.isfinite(end)
    if not ok.any():
        return None
    step, start, end = np.asarray(ops["step"])[ok], start[ok], end[ok]
    if not (step[1:] >= step[:-1]).all():   # writers keep step order; sort when they did not
        order = np.argsort(step, kind="stable")
        step, start, end = step[order], start[order], end[order]
    bounds = np.flatnonzero(np.r_[True, step[1:] != step[:-1]])
    steps = step[bounds].astype(np.int64)
    first, last = np.minimum.reduceat(start, bounds), np.maximum.reduceat(end, bounds)
    # A step cannot start before the one before it (bad clocks): keep the order.
    return StepClock(steps=steps, starts=np.maximum.accumulate(first), ends=last)


def place_events(events: list[dict], clock: StepClock | None, *, analysed_steps: np.ndarray) -> list[PlacedEvent]:
    """Places each event on the step running at its time.

    The rule: a step starts at the earliest start of any of its ops (the model's step
    origin), and the step running at time t is the last step started at or before t.
    A trace holds only sampled steps (the timeline recorder's every N-th); between two
    traced steps a < b that started at t_a <= t < t_b, the untraced steps are taken as
    equally long, so t falls in step a + floor((t - t_a) / (t_b - t_a) * (b - a)),
    shown as "~step" unless b = a + 1. After the last traced step's start, t is in it
    until its last op ends, then "after" it; before the first one, "before" it. A
    ``paused`` event is written when the pause ends: it is placed where the pause
    began (its time less its ``seconds``).

    ``analysed_steps`` (the model's kept steps, the plot's points) give ``plot_x``:
    analysed step i at i, a time between its start and the next analysed step's start
    proportionally between i and i + 1, the last one ending at N; None outside.
    """
    if not events:
        return []
    at = np.array([_placed_time(e) for e in events])
    origin = float(at.min()) if clock is None else min(float(at.min()), float(clock.starts[0]))
    return [PlacedEvent(event=e, at_s=float(t), since_start_s=float(t) - origin, step=step, step_text=text,
                        plot_x=x, marker=MARKERS.get(e["kind"]), summary=event_summary(e))
            for e, t, (step, text), x in zip(events, at, _steps_at(at, clock), _plot_x(at, clock, analysed_steps))]


def _placed_time(event: dict) -> float:
    t = float(event["time"])
    if event["kind"] == "paused":
        seconds = _num(event.get("seconds"))
        if seconds is not None and 0 <= seconds <= 86400:
            return t - seconds
    return t


def _steps_at(at: np.ndarray, clock: StepClock | None) -> list[tuple[int | None, str]]:
    if clock is None:
        return [(None, "-")] * at.size
    s, t0, end = clock.steps, clock.starts, float(clock.ends[-1])
    out: list[tuple[int | None, str]] = []
    for t in at:
        if t < t0[0]:
            out.append((None, f"before step {int(s[0])}"))
            continue
        if t > end:
            out.append((None, f"after step {int(s[-1])}"))
            continue
        i = int(np.searchsorted(t0, t, side="right")) - 1   # last step started at or before t
        if i == s.size - 1 or s[i + 1] == s[i] + 1:
            out.append((int(s[i]), str(int(s[i]))))
            continue
        span = float(t0[i + 1] - t0[i])
        gap = int(s[i + 1] - s[i])
        step = int(s[i]) + min(gap - 1, int(math.floor((t - t0[i]) / span * gap))) if span > 0 else int(s[i])
        out.append((step, str(step) if step == s[i] else f"~{step}"))
    return out


def _plot_x(at: np.ndarray, clock: StepClock | None, analysed_steps: np.ndarray) -> list[float | None]:
    if clock is None or np.size(analysed_steps) == 0:
        return [None] * at.size
    idx = np.searchsorted(clock.steps, analysed_steps)
    idx = idx[(idx < clock.steps.size) & (clock.steps[np.minimum(idx, clock.steps.size - 1)] == analysed_steps)]
    if idx.size == 0:
        return [None] * at.size
    xp = np.append(clock.starts[idx], max(float(clock.ends[idx[-1]]), float(clock.starts[idx[-1]])))
    fp = np.arange(xp.size, dtype=np.float64)
    return [float(np.interp(t, xp, fp)) if xp[0] <= t <= xp[-1] else None for t in at]


def event_summary(event: dict) -> str:
    """One line for a person about one event (the log's fields are untrusted: any
    field of an unexpected type is left out, never raised on)."""
    kind = event["kind"]
    text = _SUMMARIES.get(kind, lambda e: kind.replace("_", " "))(event)
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if len(text) <= MAX_SUMMARY_CHARS else text[: MAX_SUMMARY_CHARS - 3] + "..."


def _num(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _str(value, limit: int = 80) -> str | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value[:limit] if isinstance(value, str) and value else None


def _ranks(value) -> str | None:
    """[0, 1, 2, 5] -> "0-2, 5" (None unless a list of ints)."""
    if not isinstance(value, list) or not value or not all(isinstance(r, int) and not isinstance(r, bool)
                                                           for r in value):
        return None
    rs = sorted(set(value))
    parts, lo = [], rs[0]
    for a, b in zip(rs, rs[1:] + [None]):
        if b != a + 1:
            parts.append(str(lo) if lo == a else f"{lo}-{a}")
            lo = b
    return ", ".join(parts[:8]) + (" ..." if len(parts) > 8 else "")


def _x(value) -> str | None:
    v = _num(value)
    return None if v is None else f"{v:.2f}x"


def _join(head: str, *parts: str | None) -> str:
    return head + "".join(p for p in parts if p)


def _detected(e: dict) -> str:
    ranks = _ranks(e.get("ranks"))
    onset = _str(e.get("onset_iteration"))
    return _join("detected: job slower", f" {_x(e.get('slowdown'))}" if _x(e.get("slowdown")) else None,
                 f" since tracker iteration {onset}" if onset else None, f" (ranks {ranks})" if ranks else None)


def _suspects(e: dict) -> str:
    found = [s for s in e.get("suspects") or [] if isinstance(s, dict)] if isinstance(e.get("suspects"), list) else []
    names = [f"{_str(s.get('kind')) or '?'} at {_str(s.get('where')) or '?'}" for s in found[:4]]
    more = f" (+{len(found) - 4} more)" if len(found) > 4 else ""
    return "suspects: " + ("; ".join(names) + more if names else "none stood out")


def _paused(e: dict) -> str:
    seconds = _num(e.get("seconds"))
    return "paused" + (f" {seconds:.3g} s" if seconds is not None else "")


def _measured(m, *, rank: bool = False) -> str | None:
    """A measurement: "GEMM 5.70x" ("GEMM rank 5: 5.70x" with ``rank``) or "P2P n3-n4 at
    5% of the median bandwidth"."""
    if isinstance(m, dict) and _num(m.get("ratio")) is not None and "rank" in m:
        who = f" rank {_str(m['rank']) or '?'}:" if rank else ""
        return f"GEMM{who} {_num(m['ratio']):.2f}x"
    links = m.get("slow_links") if isinstance(m, dict) else m
    if isinstance(links, list) and links and isinstance(links[0], dict):
        ratio = _num(links[0].get("ratio"))
        link = _str(links[0].get("link")) or "?"
        return f"P2P {link}" + (f" at {ratio:.0%} of the median bandwidth" if ratio is not None else "")
    return None


def _validated(e: dict) -> str:
    if e.get("paused") is not True:
        why = _str(e.get("why"), 160)
        return "not validated" + (f": {why}" if why else "")
    results = [r for r in e.get("results") or [] if isinstance(r, dict)] if isinstance(e.get("results"), list) else []
    parts = []
    for r in results[:4]:
        what = _measured(r, rank=True) or _str(r.get("key")) or "?"
        parts.append(what + (" confirmed" if r.get("confirmed") is True else " not confirmed"))
    slow = _measured(e.get("slow_links")) if not results else None
    nxt = _str(e.get("next"), 80)
    return "validated: " + ("; ".join(parts) if parts else slow or "nothing stood out") + (f"; {nxt}" if nxt else "")


def _verdict(e: dict) -> str:
    v = e.get("verdict")
    if not isinstance(v, dict):
        return "verdict"
    kind, where = _str(v.get("kind")) or "?", _str(v.get("where")) or "?"
    head = "verdict: no culprit named" if kind == "unknown" else f"verdict: {kind} fail-slow at {where}"
    since = _str(v.get("since"))
    measured = _measured(v.get("measured"))
    how = (f", validated by {measured}" if measured else ", validated") if v.get("validated") is True \
        else ", not validated"
    return _join(head, f", {_x(v.get('severity'))}" if _x(v.get("severity")) else None,
                 f" since tracker iteration {since}" if since else None, how)


def _recovered(e: dict) -> str:
    lasted = _num(e.get("lasted_s"))
    kind, where, level = _str(e.get("verdict")), _str(e.get("where")), _str(e.get("under_mitigation"), 8)
    return _join("recovered", f" after {lasted:.0f} s" if lasted is not None else None,
                 f" ({kind} at {where})" if kind and where else None,
                 f": the job's pace, under mitigation {level}" if level else None)


def _back(e: dict) -> str:
    why = _str(e.get("why"), 160)
    return "back to tracking" + (f": {why}" if why else "")


def _reexamining(e: dict) -> str:
    why, after = _str(e.get("why"), 160), _num(e.get("after_s"))
    slowdown, cost = _x(e.get("slowdown")), _num(e.get("rounds_cost_s"))
    measures = [f"job {slowdown} slower" if slowdown else None,
                f"its last rounds cost {cost:.3g} s" if cost is not None else None]
    said = "; ".join(m for m in measures if m)
    return _join("re-examining", f" after {after:.3g} s" if after is not None else None,
                 f" ({said})" if said else None, f": {why}" if why else None)


def _started(e: dict) -> str:
    nodes = e.get("nodes")
    num_nodes = len(nodes) if isinstance(nodes, list) else None
    node, poll = _str(e.get("master_node")), _num(e.get("poll_s"))
    parts = [f"master on {node}" if node else None, f"{num_nodes} nodes" if num_nodes is not None else None,
             f"polling every {poll:g} s" if poll is not None else None]
    shown = ", ".join(p for p in parts if p)
    return "control plane started" + (f" ({shown})" if shown else "")


def _split(value) -> str | None:
    """[13, 3] -> "13,3" (None unless a short list of ints)."""
    if not isinstance(value, list) or not value or len(value) > 64 or \
            not all(isinstance(m, int) and not isinstance(m, bool) for m in value):
        return None
    return ",".join(map(str, value))


def _mitigation(e: dict) -> str:
    level = _str(e.get("level"), 8) or "?"
    split, previous = _split(e.get("microbatch_split")), _split(e.get("previous"))
    speedup, loss, cost = _x(e.get("expected_speedup")), _num(e.get("loss_s")), _num(e.get("cost_s"))
    action = _str(e.get("action"), 120)
    return _join(f"mitigation {level}",
                 f": micro-batches per DP replica {previous or '?'} -> {split}" if split else None,
                 f": {action}" if action and not split else None,
                 f", expected {speedup} faster" if speedup else None,
                 f" (lost so far {loss:.3g} s" if loss is not None else None,
                 (f"; cost about {cost:.3g} s)" if loss is not None else f" (cost about {cost:.3g} s)")
                 if cost is not None else (")" if loss is not None else None))


def _requeued(e: dict) -> str:
    nodes = e.get("nodes")
    where = ",".join(_str(n, 40) or "?" for n in nodes[:8]) if isinstance(nodes, list) else "?"
    step, why = _str(e.get("step"), 12), _str(e.get("why"), 120)
    return _join(f"requeued without {where}", f" after step {step} (checkpoint)" if step else None,
                 f": {why}" if why else None)


def _relaid(e: dict) -> str:
    pause, step, nbytes = _num(e.get("pause_s")), _str(e.get("step"), 12), _num(e.get("bytes"))
    return _join("ranks moved to their new stages (S3)", f" before step {step}" if step else None,
                 f": paused {pause:.3g} s" if pause is not None else None,
                 f", {nbytes / 1e6:.3g} MB moved" if nbytes is not None else None)


def _mitigation_ended(e: dict) -> str:
    split = _split(e.get("microbatch_split"))
    return "mitigation ended" + (f": micro-batches back to {split}" if split else "")


def _failed(e: dict) -> str:
    why = _str(e.get("why"), 160)
    return "control plane failed" + (f": {why}" if why else "")


_SUMMARIES = {
    "detected": _detected, "suspects": _suspects, "paused": _paused, "validated": _validated,
    "verdict": _verdict, "recovered": _recovered, "back_to_tracking": _back, "reexamining": _reexamining,
    "control_plane_started": _started, "control_plane_failed": _failed,
    "control_plane_stopped": lambda e: "control plane stopped", "resumed": lambda e: "resumed",
    "mitigation": _mitigation, "mitigation_ended": _mitigation_ended, "requeued": _requeued, "relaid": _relaid,
    "mitigation_skipped": lambda e: "mitigation skipped" + (f": {why}" if (why := _str(e.get("why"), 160)) else ""),
}


def load_online_events(run_dir: str | os.PathLike | None, trace: Trace, *,
                       analysed_steps: np.ndarray) -> OnlineEvents:
    """The job's events, placed on ``trace``'s steps, with the note the report shows.

    Never raises on a bad log: an unreadable one (a symlink, a FIFO, no permission)
    is the note, bad lines are counted in it.
    """
    if run_dir is None:
        return OnlineEvents(placed=[], note=NO_RUN_DIR)
    try:
        log = read_event_log(run_dir)
    except InputError as exc:
        return OnlineEvents(placed=[], note=f"The online control plane's event log was not read: {exc}")
    if log is None:
        return OnlineEvents(placed=[], note=DID_NOT_RUN)
    clock = step_clock(trace)
    placed = place_events(log.events, clock, analysed_steps=analysed_steps)
    note = f"{len(placed)} event{'s' if len(placed) != 1 else ''} of the online control plane"
    extra = []
    if log.num_skipped:
        extra.append(f"{log.num_skipped} line{'s' if log.num_skipped != 1 else ''} that are not events skipped")
    if log.bytes_not_read or log.num_dropped:
        extra.append(f"older events left out (the report reads the last {len(log.events)} events"
                     f"{f', {log.bytes_not_read} bytes before them not read' if log.bytes_not_read else ''})")
    outside = sum(p.step is None for p in placed)
    if clock is not None and placed and outside == len(placed):
        extra.append("none falls within the traced steps' times: is the trace's clock the wall clock?")
    elif outside:
        extra.append(f"{outside} outside the traced steps")
    return OnlineEvents(placed=placed, note=note + (f" ({'; '.join(extra)})" if extra else "") + ".")
