"""The event log: one JSON object a line, appended whole, read back in order."""

from __future__ import annotations

import multiprocessing

import pytest

from greyhound.control.events import EVENTS_FILE, append_event, read_events


def test_events_come_back_in_order_with_their_fields(tmp_path):
    append_event(tmp_path, "detected", rank=5, index=40, ratio=1.8)
    append_event(tmp_path, "paused", seconds=0.31)
    events = read_events(tmp_path)
    assert [e["kind"] for e in events] == ["detected", "paused"]
    assert events[0]["rank"] == 5 and events[0]["ratio"] == 1.8 and events[1]["seconds"] == 0.31
    assert events[0]["time"] <= events[1]["time"]
    assert (tmp_path / EVENTS_FILE).stat().st_mode & 0o077 == 0


def test_an_unknown_kind_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown event kind 'oops'"):
        append_event(tmp_path, "oops")


def test_a_torn_last_line_is_skipped(tmp_path):
    append_event(tmp_path, "detected", rank=1)
    with open(tmp_path / EVENTS_FILE, "a") as f:
        f.write('{"time": 1, "kind": "pau')
    assert [e["kind"] for e in read_events(tmp_path)] == ["detected"]
    assert read_events(tmp_path / "missing") == []


def _writer(run_dir, n):
    for i in range(n):
        append_event(run_dir, "validated", i=i, padding="x" * 500)


def test_concurrent_writers_never_interleave_lines(tmp_path):
    procs = [multiprocessing.Process(target=_writer, args=(tmp_path, 200)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    lines = (tmp_path / EVENTS_FILE).read_text().splitlines()
    assert len(lines) == 800 and len(read_events(tmp_path)) == 800


def test_a_symlink_at_the_log_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / EVENTS_FILE).symlink_to(victim)
    with pytest.raises(OSError):
        append_event(tmp_path, "detected")
    assert victim.read_text() == "keep"
