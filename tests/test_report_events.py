"""The post-mortem report lists the online control plane's events and marks them on
its per-step plot: events written with the real append_event at known times, placed on
the steps of a generated trace whose step start times are known."""

from __future__ import annotations

import json
import os
import time
import types
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from greyhound.control import events as events_mod
from greyhound.control.events import EVENTS_FILE, append_event, read_event_log, read_events
from postmortem.analysis import analyze
from postmortem.generate import SyntheticJob, generate
from postmortem.online_events import DID_NOT_RUN, NO_RUN_DIR, event_summary, load_online_events, step_clock
from postmortem.report import mark_events, write_report

T0 = 1_760_000_000.0   # the trace on the wall clock, as greyhound.timeline writes it


def _trace(num_steps: int, keep=None):
    trace, _ = generate(SyntheticJob(dp=2, pp=2, num_microbatches=4, num_steps=num_steps,
                                     slow_workers=((1, 1, 1.5),), seed=3))
    ops = dict(trace.ops)
    ops["start"] = ops["start"] + T0
    if keep is not None:  # only sampled steps, as the timeline recorder keeps them
        rows = np.isin(ops["step"], keep)
        ops = {k: v[rows] for k, v in ops.items()}
    return replace(trace, ops=ops)


@pytest.fixture(scope="module")
def trace():
    return _trace(12)


@pytest.fixture(scope="module")
def result(trace):
    return analyze(trace)


def _starts(trace) -> dict[int, float]:
    """Each step's start (its earliest op), computed here independently of the code."""
    out: dict[int, float] = {}
    for s, t in zip(trace.ops["step"].tolist(), trace.ops["start"].tolist()):
        out[s] = min(out.get(s, np.inf), t)
    return out


def _write(run_dir: Path, monkeypatch, timed_events: list[tuple[float, str, dict]]) -> None:
    """Appends the events with the real append_event, each at its given wall-clock time."""
    clock = iter([t for t, _, _ in timed_events])
    monkeypatch.setattr(events_mod, "time", types.SimpleNamespace(time=lambda: next(clock)))
    for _, kind, fields in timed_events:
        append_event(run_dir, kind, **fields)
    monkeypatch.undo()


VERDICT = {"kind": "compute", "where": "rank 3 on n1", "ranks": [3], "nodes": ["n1"], "why": "computes 90%",
           "measured": {"key": "compute:3", "rank": 3, "gemm_s": 1.14, "reference_s": 0.2, "ratio": 5.7,
                        "confirmed": True},
           "severity": 1.8, "since": 62, "validated": True, "detected_at": T0}


def _episode(trace) -> list[tuple[float, str, dict]]:
    """A whole episode, each event 30% into a known step (the pause: into step 7, its
    event written 0.1 s after step 8 began, when the pause ended)."""
    st = _starts(trace)

    def into(step: int) -> float:
        return st[step] + 0.3 * (st[step + 1] - st[step])

    return [
        (st[0] - 2.0, "control_plane_started", {"master_node": "n1", "nodes": ["n1", "n2"], "poll_s": 0.5, "pid": 7}),
        (into(3), "detected", {"onset_iteration": 60, "slowdown": 1.8, "ranks": [0, 1, 2, 3, 7]}),
        (into(5), "suspects", {"suspects": [{"kind": "compute", "where": "rank 3 on n1"}], "polls": 2}),
        (st[8] + 0.1, "paused", {"seconds": 0.1 + 0.5 * (st[8] - st[7]), "park_s": 0.2}),
        (into(8), "validated", {"paused": True, "pause_s": 4.6, "park_s": 0.2,
                                "results": [VERDICT["measured"]]}),
        (into(9), "verdict", {"verdict": VERDICT}),
        (into(10), "recovered", {"verdict": "compute", "where": "rank 3 on n1", "lasted_s": 38.2}),
        (st[11] + 60.0, "control_plane_stopped", {}),
    ]


def test_the_report_lists_the_events_on_the_steps_running_at_their_times(tmp_path, monkeypatch, trace, result):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    episode = _episode(trace)
    _write(run_dir, monkeypatch, episode)
    page = write_report(result, tmp_path / "report", run_dir=run_dir)
    data = json.loads((tmp_path / "report" / "postmortem.json").read_text())
    rows = [(e["kind"], e["step_text"], e["summary"]) for e in data["events"]]
    assert rows == [
        ("control_plane_started", "before step 0",
         "control plane started (master on n1, 2 nodes, polling every 0.5 s)"),
        ("detected", "3", "detected: job slower 1.80x since tracker iteration 60 (ranks 0-3, 7)"),
        ("suspects", "5", "suspects: compute at rank 3 on n1"),
        ("paused", "7", f"paused {0.1 + 0.5 * (_starts(trace)[8] - _starts(trace)[7]):.3g} s"),
        ("validated", "8", "validated: GEMM rank 3: 5.70x confirmed"),
        ("verdict", "9", "verdict: compute fail-slow at rank 3 on n1, 1.80x since tracker iteration 62, "
                         "validated by GEMM 5.70x"),
        ("recovered", "10", "recovered after 38 s (compute at rank 3 on n1)"),
        ("control_plane_stopped", "after step 11", "control plane stopped"),
    ]
    assert [e["step"] for e in data["events"]] == [None, 3, 5, 7, 8, 9, 10, None]
    # time from the job's first record: the control plane started 2 s before step 0
    assert data["events"][0]["since_start_s"] == 0.0
    assert data["events"][1]["since_start_s"] == pytest.approx(episode[1][0] - episode[0][0], abs=2e-3)
    assert data["events"][5]["detail"]["verdict"]["measured"]["ratio"] == 5.7
    assert data["events_note"] == "8 events of the online control plane (2 outside the traced steps)."
    text = page.read_text()
    assert "<td>9</td><td>verdict</td><td>verdict: compute fail-slow at rank 3 on n1, 1.80x" in text
    assert "<td>before step 0</td><td>control_plane_started</td>" in text
    # everything else as without events
    rest = {k: v for k, v in data.items() if k not in ("events", "events_note")}
    assert rest == json.loads(json.dumps(result.to_json()))


def test_the_markers_sit_at_the_events_steps_with_one_legend_entry_a_kind(tmp_path, monkeypatch, trace, result):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    episode = _episode(trace)
    _write(run_dir, monkeypatch, episode + [(episode[2][0], "detected", {"onset_iteration": 70})])
    online = load_online_events(run_dir, trace, analysed_steps=result.model.steps)
    fig, ax = plt.subplots()
    try:
        assert mark_events(ax, online) == 5
        lines = {(ln.get_gid(), round(ln.get_xdata()[0], 3)) for ln in ax.lines}
        labels = ax.get_legend_handles_labels()[1]
    finally:
        plt.close(fig)
    st = _starts(trace)
    pause_x = 7 + (st[8] + 0.1 - episode[3][2]["seconds"] - st[7]) / (st[8] - st[7])
    # every step of this trace is analysed: step k at x = k, 30% into it at k + 0.3
    assert lines == {("event:detection", 3.3), ("event:detection", 5.3), ("event:pause", round(pause_x, 3)),
                     ("event:verdict", 9.3), ("event:recovery", 10.3)}
    assert labels == ["detection", "pause", "verdict", "recovery"]
    assert [p.plot_x is None for p in online.placed] == [True] + [False] * 6 + [True, False]
    assert [p.marker for p in online.placed] == [None, "detection", None, "pause", None, "verdict", "recovery",
                                                 None, "detection"]


def test_between_sampled_steps_the_step_comes_from_their_times(tmp_path, monkeypatch):
    trace = _trace(30, keep=[9, 19, 29])
    st = _starts(_trace(30))          # the full run: where the untraced steps really began
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    s9, s19 = st[9], st[19]
    at_55 = s9 + 0.55 * (s19 - s9)    # 55% of the way from step 9 to 19: step 9 + 5
    _write(run_dir, monkeypatch, [(st[3], "detected", {}), (st[9] + 0.01, "detected", {}),
                                  (at_55, "detected", {}), (st[29] + 0.01, "detected", {}),
                                  (st[29] + 100, "recovered", {})])
    online = load_online_events(run_dir, trace, analysed_steps=np.array([9, 19, 29]))
    assert [(p.step, p.step_text) for p in online.placed] == [
        (None, "before step 9"), (9, "9"), (14, "~14"), (29, "29"), (None, "after step 29")]
    assert online.placed[2].plot_x == pytest.approx(0.55, abs=1e-6)
    clock = step_clock(trace)
    assert clock.steps.tolist() == [9, 19, 29] and clock.starts[1] == s19


def test_without_an_event_log_the_report_says_the_plane_did_not_run(tmp_path, result):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    page = write_report(result, tmp_path / "report", run_dir=run_dir)
    data = json.loads((tmp_path / "report" / "postmortem.json").read_text())
    assert data["events"] == [] and data["events_note"] == DID_NOT_RUN
    assert {k: v for k, v in data.items() if k not in ("events", "events_note")} == \
        json.loads(json.dumps(result.to_json()))
    text = page.read_text()
    assert f"<h2>Online control plane</h2><p>{DID_NOT_RUN}</p>\n" in text and "<th>event</th>" not in text
    write_report(result, tmp_path / "alone")
    assert json.loads((tmp_path / "alone" / "postmortem.json").read_text())["events_note"] == NO_RUN_DIR


def test_the_epilog_step_passes_the_run_dir(tmp_path, monkeypatch, trace):
    """analyze_job (the job user's step of the epilog) finds the trace and the events
    in the run dir and the report shows both."""
    from postmortem.epilog import analyze_job
    from postmortem.schema import write_trace

    run_dir = tmp_path / "1234"
    (run_dir / "timeline").mkdir(parents=True)
    write_trace(run_dir / "timeline" / "trace.h5", ops=trace.ops, workers=trace.workers, meta=trace.meta)
    _write(run_dir, monkeypatch, _episode(trace))
    summary = analyze_job("1234", tmp_path)
    assert summary.startswith("greyhound: S=") and summary.endswith(str(run_dir / "report" / "report.html"))
    data = json.loads((run_dir / "report" / "postmortem.json").read_text())
    assert [e["step"] for e in data["events"]] == [None, 3, 5, 7, 8, 9, 10, None]


def test_the_jobs_record_says_what_s4_did_even_without_a_post_mortem(tmp_path):
    """The run's own note on the comment does not outlive the requeue: the epilog's
    summary carries it, after whatever the post-mortem said."""
    from postmortem.epilog import analyze_job

    run_dir = tmp_path / "77"
    run_dir.mkdir()
    assert analyze_job("77", tmp_path).startswith("greyhound: no post-mortem:")
    assert "S4" not in analyze_job("77", tmp_path)
    append_event(run_dir, "requeued", nodes=["n3"], step=309, why="link fail-slow at n3", loss_s=137.5, cost_s=135.7)
    summary = analyze_job("77", tmp_path)
    assert summary.startswith("greyhound: no post-mortem:")
    assert summary.endswith("; S4 requeued it without n3 after step 309: link fail-slow at n3"), summary
    append_event(run_dir, "requeued", nodes=["n\x1b[31m4"], step=400, why="link\nfail-slow\x07 at n4")
    summary = analyze_job("77", tmp_path)
    assert summary.isprintable()
    assert summary.endswith("; S4 requeued it without n [31m4 after step 400: link fail-slow at n4"), summary


def _record_steps(trace_dir: Path, steps: range, *, resume: bool) -> None:
    from greyhound.timeline import TimelineConfig, TimelineRecorder

    job = {"dp": 2, "pp": 1, "tp": 1, "num_microbatches": 2, "microbatches_per_dp": [1, 1],
           "schedule": "1F1B", "job_id": "5", "trial_name": "requeued"}
    for rank in range(2):
        rec = TimelineRecorder(TimelineConfig(trace_dir=str(trace_dir), every=1, append=resume), rank=rank,
                               dp_rank=rank, pp_rank=0, node="n1", device="cpu", job=job)
        for step in steps:
            rec.start_step(step, num_microbatches=1)
            rec.record("forward-compute", microbatch=0, start=step * 0.1, duration=0.01)
            rec.record("backward-compute", microbatch=0, start=step * 0.1 + 0.02, duration=0.02)
            rec.end_step()
        rec.close()


def test_a_requeued_jobs_trace_is_merged_again_with_its_next_runs_steps(tmp_path):
    """The epilog merges the timeline at a requeue; the next run (same run dir, --resume)
    appends to the rank files, and the post-mortem at its end takes every step, not the
    first run's merged trace."""
    from postmortem.epilog import find_trace
    from postmortem.schema import read_trace

    timeline = tmp_path / "5" / "timeline"
    _record_steps(timeline, range(0, 3), resume=False)
    first = find_trace(tmp_path / "5", "5")
    assert sorted(set(read_trace(first).ops["step"].tolist())) == [0, 1, 2]
    os.utime(first, (time.time() - 60, time.time() - 60))      # the restart comes later
    _record_steps(timeline, range(3, 6), resume=True)
    again = find_trace(tmp_path / "5", "5")
    assert again == first and sorted(set(read_trace(again).ops["step"].tolist())) == list(range(6))
    assert find_trace(tmp_path / "5", "5") == again              # up to date: taken as it is


def test_the_epilog_finishes_no_requeue_without_a_requeued_event_in_the_users_own_run_dir(tmp_path):
    """finish_requeue (the job user's S4 step of the epilog) touches Slurm only for a
    ``requeued`` event in a run dir of the caller's own: none, or a symlinked run dir,
    and it returns before any Slurm command (none runs here)."""
    from postmortem.epilog import finish_requeue

    assert finish_requeue("77", tmp_path, "n[1-4]") is None                 # no run dir
    (tmp_path / "77").mkdir()
    append_event(tmp_path / "77", "mitigation", level="S2")
    assert finish_requeue("77", tmp_path, "n[1-4]") is None                 # no requeued event
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    append_event(elsewhere, "requeued", nodes=["n3"], step=1, why="x")
    (tmp_path / "78").symlink_to(elsewhere)
    assert finish_requeue("78", tmp_path, "n[1-4]") is None                 # not a directory of its own


# --- a hostile or broken event log: one line in the report, never a traceback ---------


def _report_note(tmp_path, result, run_dir) -> tuple[str, float]:
    t = time.monotonic()
    write_report(result, tmp_path / "report", run_dir=run_dir)
    seconds = time.monotonic() - t
    return json.loads((tmp_path / "report" / "postmortem.json").read_text())["events_note"], seconds


def test_a_symlinked_log_is_not_followed(tmp_path, result):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    victim = tmp_path / "victim.jsonl"
    victim.write_text(json.dumps({"time": T0, "kind": "detected", "secret": "x"}) + "\n")
    (run_dir / EVENTS_FILE).symlink_to(victim)
    note, _ = _report_note(tmp_path, result, run_dir)
    assert note == f"The online control plane's event log was not read: {run_dir / EVENTS_FILE}: " \
                   "cannot read the event log: is a symlink"
    assert read_events(run_dir) == []


def test_a_fifo_does_not_block(tmp_path, result):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.mkfifo(run_dir / EVENTS_FILE)
    note, seconds = _report_note(tmp_path, result, run_dir)
    assert note.endswith("cannot read the event log: not a regular file") and seconds < 30


def test_50_mb_of_junk_is_read_bounded(tmp_path, result):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rng = np.random.default_rng(0)
    with open(run_dir / EVENTS_FILE, "wb") as f:
        for _ in range(50):
            f.write(rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
        f.write(b"\n")   # else the event below would continue the junk's last line
    append_event(run_dir, "paused", seconds=4.6)   # the last line, after the junk
    log = read_event_log(run_dir)
    size = (run_dir / EVENTS_FILE).stat().st_size
    assert [e["kind"] for e in log.events] == ["paused"] and log.num_skipped > 0
    assert size - log.bytes_not_read <= events_mod.MAX_LOG_BYTES and log.bytes_not_read > 45 << 20
    note, seconds = _report_note(tmp_path, result, run_dir)
    assert note.startswith("1 event of the online control plane (") and "lines that are not events skipped" in note
    assert "older events left out" in note and seconds < 60


def test_bad_lines_are_skipped_and_counted(tmp_path):
    good = {"time": T0, "kind": "verdict", "verdict": "not a dict"}      # an event, odd fields
    lines = [
        json.dumps(good),
        '{"time": NaN, "kind": "detected"}',           # a time that is not finite
        '{"time": true, "kind": "detected"}',          # a bool is not a time
        '{"time": 1, "kind": "no such kind"}',
        '[' * 200_000,                                  # nesting deeper than the parser goes
        '{"time": 1, "kind": "detected", "n": ' + '9' * 10_000 + '}',   # a number too long
        '"just a string"',
        '{"time": 1, "kind": "pau',                     # torn
    ]
    data = "\n".join(lines).encode() + b"\n\xff\xfe{bad utf-8}\n\n"
    (tmp_path / EVENTS_FILE).write_bytes(data)
    log = read_event_log(tmp_path)
    assert log.events == [good] and log.num_skipped == 8 and log.bytes_not_read == 0
    placed = load_online_events(tmp_path, _trace(3), analysed_steps=np.arange(3)).placed
    assert [p.summary for p in placed] == ["verdict"]


def test_the_json_detail_is_strict_and_shallow(tmp_path):
    """NaN (a GEMM ratio without references) becomes null, deep nesting "..."."""
    append_event(tmp_path, "validated", paused=True, results=[{"key": "compute:5", "rank": 5, "ratio": float("nan")}],
                 deep={"a": {"b": {"c": {"d": {"e": {"f": {"g": 1}}}}}}})
    placed = load_online_events(tmp_path, _trace(3), analysed_steps=np.arange(3)).placed
    detail = placed[0].to_json()["detail"]
    assert detail["results"][0]["ratio"] is None
    assert detail["deep"] == {"a": {"b": {"c": {"d": {"e": {"f": "..."}}}}}}   # 6 levels below the field
    json.dumps(placed[0].to_json(), allow_nan=False)
    assert placed[0].summary == "validated: compute:5 not confirmed"


def test_the_count_cap_keeps_the_last_events(tmp_path):
    with open(tmp_path / EVENTS_FILE, "w") as f:
        for i in range(events_mod.MAX_EVENTS + 50):
            f.write(json.dumps({"time": T0 + i, "kind": "paused", "seconds": 1}) + "\n")
    log = read_event_log(tmp_path)
    assert len(log.events) == events_mod.MAX_EVENTS and log.num_dropped == 50
    assert log.events[0]["time"] == T0 + 50 and read_event_log(tmp_path / "nowhere") is None


def test_the_size_cap_starts_at_a_whole_line(tmp_path):
    line = json.dumps({"time": T0, "kind": "resumed", "pad": "x" * 75}) + "\n"
    assert len(line) == 128
    (tmp_path / EVENTS_FILE).write_text(line * 100)
    log = read_event_log(tmp_path, max_bytes=1000)   # 7 whole lines and a part of one
    assert len(log.events) == 7 and log.num_skipped == 0 and log.bytes_not_read == 93 * 128
    log = read_event_log(tmp_path, max_bytes=1024)   # exactly 8 lines: none cut
    assert len(log.events) == 8 and log.num_skipped == 0 and log.bytes_not_read == 92 * 128
    log = read_event_log(tmp_path, max_bytes=1025)   # 8 lines and the newline of the one before
    assert len(log.events) == 8 and log.num_skipped == 0 and log.bytes_not_read == 92 * 128


@pytest.mark.parametrize("event, summary", [
    ({"kind": "verdict", "verdict": {"kind": "link", "where": "n4", "measured": [
        {"link": "n3-n4", "node": "n4", "ratio": 0.05, "bandwidth_Bps": 2e7}], "severity": 1.3, "since": 40,
        "validated": True}},
     "verdict: link fail-slow at n4, 1.30x since tracker iteration 40, validated by P2P n3-n4 at 5% of the "
     "median bandwidth"),
    ({"kind": "verdict", "verdict": {"kind": "compute", "where": "rank 5 on n3", "severity": 1.5, "since": 40,
                                     "validated": False}},
     "verdict: compute fail-slow at rank 5 on n3, 1.50x since tracker iteration 40, not validated"),
    ({"kind": "verdict", "verdict": {"kind": "unknown", "where": "-", "severity": 1.5, "validated": True}},
     "verdict: no culprit named, 1.50x, validated"),
    ({"kind": "validated", "paused": False, "why": "not every rank reached the pause iteration in time"},
     "not validated: not every rank reached the pause iteration in time"),
    ({"kind": "validated", "paused": True, "results": [
        {"key": "link:n3,n4", "nodes": ["n3", "n4"], "confirmed": True,
         "slow_links": [{"link": "n3-n4", "ratio": 0.05}]}]},
     "validated: P2P n3-n4 at 5% of the median bandwidth confirmed"),
    ({"kind": "mitigation", "level": "S4", "action": "checkpoint, then requeue without n3", "loss_s": 160.2,
      "cost_s": 150.0},
     "mitigation S4: checkpoint, then requeue without n3 (lost so far 160 s; cost about 150 s)"),
    ({"kind": "requeued", "nodes": ["n3"], "step": 812, "why": "link fail-slow at n3"},
     "requeued without n3 after step 812 (checkpoint): link fail-slow at n3"),
    ({"kind": "validated", "paused": True, "next": "nothing confirmed: profiling again",
      "results": [{"key": "compute:0", "rank": 0, "ratio": 1.02, "confirmed": False}]},
     "validated: GEMM rank 0: 1.02x not confirmed; nothing confirmed: profiling again"),
    ({"kind": "back_to_tracking", "why": "the slowdown ended while profiling"},
     "back to tracking: the slowdown ended while profiling"),
    ({"kind": "reexamining", "why": "the job is still slow after a verdict that named nobody", "after_s": 10.04},
     "re-examining after 10 s: the job is still slow after a verdict that named nobody"),
    ({"kind": "reexamining", "why": "the job is still slow after a verdict that named nobody", "after_s": 42.4,
      "slowdown": 1.187, "rounds_cost_s": 6.8},
     "re-examining after 42.4 s (job 1.19x slower; its last rounds cost 6.8 s): the job is still slow after a "
     "verdict that named nobody"),
    ({"kind": "reexamining", "after_s": "soon", "slowdown": "x"}, "re-examining"),
    ({"kind": "recovered", "verdict": "compute", "where": "rank 5 on n3", "lasted_s": 8.2, "under_mitigation": "S2"},
     "recovered after 8 s (compute at rank 5 on n3): the job's pace, under mitigation S2"),
    ({"kind": "control_plane_failed", "why": "redis-server\x1b[31m did not start"},
     "control plane failed: redis-server [31m did not start"),
    ({"kind": "detected", "slowdown": "1.5", "ranks": "all"}, "detected: job slower"),
    ({"kind": "mitigation", "level": "S2", "microbatch_split": [13, 3], "previous": [8, 8],
      "expected_speedup": 2.35, "loss_s": 4.255, "cost_s": 0.251},
     "mitigation S2: micro-batches per DP replica 8,8 -> 13,3, expected 2.35x faster (lost so far 4.25 s; "
     "cost about 0.251 s)"),
    ({"kind": "mitigation", "level": "S2", "microbatch_split": "13,3", "cost_s": 0.25},
     "mitigation S2 (cost about 0.25 s)"),
    ({"kind": "mitigation_ended", "microbatch_split": [8, 8]}, "mitigation ended: micro-batches back to 8,8"),
    ({"kind": "mitigation", "level": "S3", "action": "ranks 2,5 swap stages: n2's links carry PP, not DP",
      "placement": [[0, 0], [0, 1]], "loss_s": 12.5, "cost_s": 2.0},
     "mitigation S3: ranks 2,5 swap stages: n2's links carry PP, not DP (lost so far 12.5 s; cost about 2 s)"),
    ({"kind": "relaid", "level": "S3", "version": 3, "step": 140, "pause_s": 1.734, "bytes": 25165824},
     "ranks moved to their new stages (S3) before step 140: paused 1.73 s, 25.2 MB moved"),
    ({"kind": "relaid", "pause_s": "long"}, "ranks moved to their new stages (S3)"),
])
def test_each_kind_is_said_in_one_line(event, summary):
    assert event_summary({"time": T0, **event}) == summary
