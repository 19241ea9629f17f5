"""The job's event log: every decision of the control plane, one JSON object a line.

``<run dir>/events.jsonl`` is appended to by the master (detections, suspects, pauses
with their length, validation measurements, verdicts, recoveries) and read by
``greyhound status`` and the post-mortem report. Each event is one ``write`` to a file
opened with ``O_APPEND``, so concurrent writers never interleave within a line; a
reader skips a torn last line.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

EVENTS_FILE = "events.jsonl"

KINDS = (
    "control_plane_started", "control_plane_stopped", "control_plane_failed",
    "detected", "recovered", "suspects", "back_to_tracking", "paused", "resumed",
    "validated", "verdict",
)
"""What an event may be; ``kind`` is always one of these."""


def append_event(run_dir: str | os.PathLike, kind: str, **fields) -> dict:
    """Appends one event (``time`` in Unix seconds, ``kind``, the fields); returns it."""
    if kind not in KINDS:
        raise ValueError(f"unknown event kind {kind!r}; known: {', '.join(KINDS)}")
    event = {"time": round(time.time(), 6), "kind": kind, **fields}
    line = (json.dumps(event, sort_keys=False, default=float) + "\n").encode()
    fd = os.open(Path(run_dir) / EVENTS_FILE,
                 os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return event


def read_events(run_dir: str | os.PathLike) -> list[dict]:
    """The job's events in order ([] when there are none); torn or foreign lines skipped."""
    try:
        text = (Path(run_dir) / EVENTS_FILE).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    events = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and event.get("kind") in KINDS and isinstance(event.get("time"), (int, float)):
            events.append(event)
    return events
