"""Report files of a post-mortem: HTML, heatmap PNG, per-step plot, JSON, Chrome trace.

The only module here that writes files; everything it shows comes from ``Result``.
"""

from __future__ import annotations

import html
import json
import logging
import os
import secrets
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np

from greyhound.atomic_file import atomic_file, open_dir, write_atomic
from greyhound.errors import OutputError
from postmortem.analysis import Result, summary_line
from postmortem.idealize import __doc__ as IDEAL_DOC
from postmortem.model import optype_label
from postmortem.online_events import MARKER_STYLE, MAX_MARKERS, OnlineEvents, load_online_events
from postmortem.simulate import simulate

log = logging.getLogger(__name__)
MAX_TRACE_EVENTS = 200_000


REPORT_FILES = ("postmortem.json", "heatmap.png", "step_slowdown.png", "timeline.trace.json", "report.html")
"""What :func:`write_report` writes into its directory."""


def write_report(result: Result, out_dir: str | os.PathLike, *, run_dir: str | os.PathLike | None = None) -> Path:
    """Write the report into ``out_dir`` (created); returns the HTML path.

    ``run_dir``, the job's run dir, holds the online control plane's event log: the
    report lists its events and marks them on the per-step plot (see
    :mod:`postmortem.online_events`); without it the report says there is none.

    All or nothing: every file is first written (with :func:`write_atomic`) into a
    fresh directory of an unpredictable name beside ``out_dir``, and moved into place
    only when all of them are complete: the whole directory when ``out_dir`` does not
    exist yet, else file by file.  A failure (a full disk, a plot that cannot be drawn)
    leaves ``out_dir`` as it was.  The moves are made relative to descriptors of the
    directories, opened without following a symlink at their last component, so
    neither directory can be swapped for another between the writes and the moves.

    Raises:
        OutputError: ``out_dir`` or its parent cannot be created or written (or
            ``out_dir`` is a symlink).
    """
    out = Path(out_dir)
    online = load_online_events(run_dir, result.trace, analysed_steps=result.model.steps)

    def fail(exc: OSError) -> OutputError:
        return OutputError(f"{out}: cannot write the report: {exc.strerror or exc}")

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputError(f"{out}: cannot write the report: a parent is not a directory") from None
    except OSError as exc:
        raise fail(exc) from None
    if out.is_symlink():  # refused below in any case (O_NOFOLLOW); this says why
        raise OutputError(f"{out}: cannot write the report: is a symlink; give the directory itself")
    stage_name = f".{out.name}.{secrets.token_hex(8)}.tmp"
    fds: list[int] = []
    staged = False
    try:
        parent_fd = open_dir(out.parent)
        fds.append(parent_fd)
        try:
            out_fd = os.open(out.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
            fds.append(out_fd)
        except FileNotFoundError:
            out_fd = None
        os.mkdir(stage_name, 0o777, dir_fd=parent_fd)  # less the umask, as out_dir would get
        staged = True
        stage = out.parent / stage_name
        page = out / "report.html"
        data = result.to_json()
        data["events"], data["events_note"] = online.to_json(), online.note
        write_atomic(stage / "postmortem.json", json.dumps(data, indent=2), mode=0o644)
        _heatmap_png(result, stage / "heatmap.png")
        _steps_png(result, stage / "step_slowdown.png", online)
        write_atomic(stage / "timeline.trace.json", json.dumps(chrome_trace(result)), mode=0o644)
        write_atomic(stage / "report.html", _html(result, data, summary_line(result, str(page))), mode=0o644)
        if out_fd is None:  # the whole directory at once
            os.rename(stage_name, out.name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
            staged = False
        else:  # each file atomically, once all were written
            stage_fd = os.open(stage_name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                               dir_fd=parent_fd)
            fds.append(stage_fd)
            for name in REPORT_FILES:
                os.replace(name, name, src_dir_fd=stage_fd, dst_dir_fd=out_fd)
    except OSError as exc:
        raise fail(exc) from None
    finally:
        if staged:
            shutil.rmtree(out.parent / stage_name, ignore_errors=True)
        for fd in fds:
            os.close(fd)
    return page


def _heatmap_png(result: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = result.attribution
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, mat, title in (
        (axes[0], a.worker_slowdown, "S_w per worker" + ("" if a.worker_slowdown_exact else " (min of DP/PP S_w)")),
        (axes[1], a.ideal.cell_ratio, "compute time / ideal"),
    ):
        im = ax.imshow(mat.T, aspect="auto", origin="lower", cmap="Reds")
        num_dp, num_pp = mat.shape
        # Integer ticks only (ranks), thinned on big grids.
        ax.set_xticks(np.arange(0, num_dp, max(1, num_dp // 16)))
        ax.set_yticks(np.arange(0, num_pp, max(1, num_pp // 16)))
        ax.set_xlabel("DP rank")
        ax.set_ylabel("PP rank")
        ax.set_title(title)
        fig.colorbar(im, ax=ax)
        if num_dp * num_pp <= 64:  # small grids: the number in each cell
            lo, hi = im.get_clim()
            for d in range(num_dp):
                for p in range(num_pp):
                    v = mat[d, p]
                    dark = hi > lo and (v - lo) / (hi - lo) > 0.6
                    ax.text(d, p, f"{v:.2f}", ha="center", va="center", fontsize=8,
                            color="white" if dark else "black")
    fig.tight_layout()
    with atomic_file(path, mode=0o644) as f:
        fig.savefig(f, dpi=90, format="png")
    plt.close(fig)


def _steps_png(result: Result, path: Path, online: OnlineEvents | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, m = result.attribution, result.model
    fig, ax = plt.subplots(figsize=(8, 3))
    x = np.arange(m.steps.size)
    ax.plot(x, a.step_slowdown, marker="o", ms=3)
    ax.axhline(a.slowdown, color="grey", ls="--", lw=1, label=f"S = {a.slowdown:.3f}")
    ax.set_xticks(x[:: max(1, x.size // 12)])
    ax.set_xticklabels([str(int(s)) for s in m.steps[:: max(1, x.size // 12)]])
    ax.set_xlabel("step")
    ax.set_ylabel("slowdown")
    if online is not None and mark_events(ax, online):  # the legend beside the plot, not over it
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend()
    fig.tight_layout()
    with atomic_file(path, mode=0o644) as f:
        fig.savefig(f, dpi=90, format="png")
    plt.close(fig)


def mark_events(ax, online: OnlineEvents) -> int:
    """Vertical lines on the per-step plot at the events that have a marker (at most
    MAX_MARKERS of each kind), one legend entry per kind: detection, verdict, pause,
    recovery; returns how many were drawn."""
    drawn: dict[str, int] = {}
    for p in online.placed:
        if p.marker is None or p.plot_x is None or drawn.get(p.marker, 0) >= MAX_MARKERS:
            continue
        colour, style = MARKER_STYLE[p.marker]
        ax.axvline(p.plot_x, color=colour, ls=style, lw=1.2, gid=f"event:{p.marker}",
                   label=p.marker if p.marker not in drawn else None)
        drawn[p.marker] = drawn.get(p.marker, 0) + 1
    return sum(drawn.values())


MAX_EVENT_ROWS = 500
"""Most events the HTML table lists (postmortem.json has them all)."""


def _events_html(data: dict) -> str:
    """The event section: the note, then a table (time, step, kind, what happened)."""
    events = data.get("events") or []
    note = f"<p>{html.escape(data.get('events_note', ''))}</p>"
    if not events:
        return note
    rows = [(f"{e['since_start_s']:.1f}", e["step_text"], e["kind"], e["summary"]) for e in events[:MAX_EVENT_ROWS]]
    more = (f"<p>{len(events) - MAX_EVENT_ROWS} more events in postmortem.json.</p>"
            if len(events) > MAX_EVENT_ROWS else "")
    return (note + "<p>Time in seconds from the job's first record; the step running then "
            "(~: between two traced steps, from their times).</p>"
            "<style>.events td:last-child{text-align:left}</style><div class=\"events\">"
            + _table(rows, ("time (s)", "step", "event", "what happened")) + "</div>" + more)


def chrome_trace(result: Result) -> dict:
    """Chrome/Perfetto trace of the first analysed step: real (pid 1) and idealised (pid 2)."""
    m, a = result.model, result.attribution
    one = replace(
        m,
        steps=m.steps[:1],
        start=m.start[:, :, :1],
        duration=m.duration[:, :, :1],
        transfer=m.transfer[:, :, :1],
        real_step_time=m.real_step_time[:1],
    )
    keep = np.zeros((1, m.num_template_ops, m.dp), bool)
    sim = simulate(one, ideal=a.ideal.work, keep_real=keep, record=True)
    assert sim.launch is not None and sim.end is not None  # recorded
    n_t = m.num_template_ops
    ranks = list(range(m.dp))
    if n_t * m.dp * 2 > MAX_TRACE_EVENTS:
        top = a.mw_workers[0][0] if a.mw_workers else 0
        per = max(1, MAX_TRACE_EVENTS // (2 * n_t))
        ranks = sorted({top, *range(min(m.dp, per - 1))})
    events: list[dict] = []
    for pid, name in ((1, f"real (step {int(m.steps[0])})"), (2, "idealised")):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
    for d in ranks:
        for p in range(m.pp):
            tid = d * m.pp + p
            for pid in (1, 2):
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                               "args": {"name": f"dp{d}/pp{p}"}})
    names = [optype_label(c) for c in m.t_optype]
    for d in ranks:
        for t in range(n_t):
            if not m.present[t, d]:
                continue
            tid = d * m.pp + int(m.t_pp[t])
            args = {"occurrence": int(m.t_occ[t])}
            events.append(
                {"ph": "X", "pid": 1, "tid": tid, "name": names[t], "ts": float(m.start[t, d, 0]) * 1e6,
                 "dur": float(m.duration[t, d, 0]) * 1e6, "args": args}
            )
            st = float(sim.launch[0, t, d, 0])
            events.append(
                {"ph": "X", "pid": 2, "tid": tid, "name": names[t], "ts": st * 1e6,
                 "dur": max(0.0, float(sim.end[0, t, d, 0]) - st) * 1e6, "args": args}
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _table(rows: list[tuple], head: tuple) -> str:
    h = "".join(f"<th>{html.escape(str(c))}</th>" for c in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{h}</tr>{body}</table>"


def _html(result: Result, data: dict, line: str) -> str:
    a = result.attribution
    causes = "".join(
        f"<li><b>{html.escape(c['cause'])}</b> (confidence {c['confidence']:.2f}): "
        f"<code>{html.escape(json.dumps(c['evidence']))}</code><br>remedy: {html.escape(c['remedy'])}</li>"
        for c in data["causes"]
    ) or "<li>no straggler signature above its threshold</li>"
    dropped = "".join(f"<li>{html.escape(x)}</li>" for x in data["dropped"]) or "<li>nothing</li>"
    optypes = _table([(k, f"{v:.4f}") for k, v in data["by_optype"].items()], ("op type", "S_t"))
    dps = _table([(k, f"{v:.4f}") for k, v in data["by_dp_rank"].items()], ("DP rank", "S_w"))
    pps = _table([(k, f"{v:.4f}") for k, v in data["by_pp_rank"].items()], ("PP rank", "S_w"))
    job = data["job"]
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>greyhound post-mortem</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:2em auto}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}code{{font-size:85%}}</style></head><body>
<h1>greyhound post-mortem</h1>
<p><b>{html.escape(line)}</b></p>
<h2>Summary</h2>
<ul><li>slowdown S = T / T_ideal = {a.slowdown:.4f} \
({data['gpu_time_lost'] * 100:.1f}% of GPU time lost to stragglers)</li>
<li>mean step: traced {a.t_real:.4f} s, replayed {a.t_replay:.4f} s (simulation error {a.simulation_error * 100:+.2f}%),
idealised {a.t_ideal:.4f} s</li>
<li>M_W (top 3% workers) = {a.mw:.3f}; M_S (last stage) = {a.ms:.3f}</li>
<li>job: DP {job['dp']} x PP {job['pp']}, {job['steps_analysed']} steps analysed, {job['ops']} ops, \
source {html.escape(str(job['source']))}</li>
<li>estimator: {html.escape(a.ideal.estimator)}</li></ul>
<h2>Dropped or set aside while loading</h2><ul>{dropped}</ul>
<h2>Causes</h2><ul>{causes}</ul>
<h2>Heatmap</h2><img src="heatmap.png" alt="DP x PP heatmap">
<h2>Per-step slowdown</h2><img src="step_slowdown.png" alt="per-step slowdown">
<h2>Online control plane</h2>{_events_html(data)}
<h2>Per op type (S_t)</h2>{optypes}
<h2>Per DP rank and PP rank (S_w)</h2><div style="display:flex;gap:2em">{dps}{pps}</div>
<h2>Timeline</h2><p>timeline.trace.json: the first analysed step, real and idealised; open it in
<a href="https://ui.perfetto.dev">Perfetto</a> or chrome://tracing.</p>
<h2>How the ideal is estimated</h2><pre>{html.escape(IDEAL_DOC or '')}</pre>
</body></html>"""
