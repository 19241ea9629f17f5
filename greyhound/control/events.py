"""The job's event log: every decision of the control plane, one JSON object a line.

``<run dir>/events.jsonl`` is appended to by the master (detections, suspects, pauses
with their length, validation measurements, verdicts, recoveries) and read by
``greyhound status`` and the post-mortem report. Each event is one ``write`` to a file
opened with ``O_APPEND``, so concurrent writers never interleave within a line; a
reader skips a torn last line.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from greyhound.errors import InputError

log = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"

KINDS = (
    "control_plane_started", "control_plane_stopped", "control_plane_failed",
    "detected", "deepened", "recovered", "suspects", "back_to_tracking", "reexamining", "paused", "resumed",
    "validated", "verdict",
    "mitigation", "mitigation_ended", "mitigation_skipped", "mitigation_undone", "relaid", "requeued",
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


MAX_LOG_BYTES = 4 << 20
"""The most of the event log a reader reads: its last 4 MiB (a busy job writes a few KB)."""
MAX_EVENTS = 10_000
"""The most events a reader keeps: the last ones."""


@dataclass(frozen=True)
class EventLog:
    """What a bounded read of the event log found."""

    events: list[dict]
    """The events, in file order (the last :data:`MAX_EVENTS` at most)."""
    num_skipped: int = 0
    """Lines in the part read that are not events (torn, foreign, not JSON, no kind or time)."""
    num_dropped: int = 0
    """Events left out by the count cap (older ones)."""
    bytes_not_read: int = 0
    """Bytes before the part read, left out by the size cap (older events)."""


def read_event_log(run_dir: str | os.PathLike, *, max_bytes: int = MAX_LOG_BYTES,
                   max_events: int = MAX_EVENTS) -> EventLog | None:
    """The job's event log, bounded; None when there is none.

    The run dir is the job user's, so the file is untrusted: it is opened without
    following a symlink and without blocking (a FIFO), must be a regular file, and
    only its last ``max_bytes`` are read (the first, partial line of that tail is
    dropped). Lines that are not events are skipped and counted, never raised.

    Raises:
        InputError: the log exists but is not a readable regular file (one line, why).
    """
    path = Path(run_dir) / EVENTS_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = "is a symlink" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
        raise InputError(f"{path}: cannot read the event log: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{path}: cannot read the event log: not a regular file")
        skip = max(0, st.st_size - max_bytes)
        want = max_bytes + (1 if skip else 0)   # and the byte before the tail: does a line end there?
        chunks, size = [], 0
        try:
            os.lseek(fd, skip - 1 if skip else 0, os.SEEK_SET)
            while size < want:
                chunk = os.read(fd, min(1 << 20, want - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        except OSError as exc:
            raise InputError(f"{path}: cannot read the event log: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if skip:  # the tail starts after the first line end at or after its first byte - 1
        cut = data.find(b"\n") + 1
        skip, data = skip - 1 + cut, data[cut:]
    events, skipped = [], 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        event = _parse_line(line)
        if event is None:
            skipped += 1
        else:
            events.append(event)
    dropped = max(0, len(events) - max_events)
    return EventLog(events=events[dropped:], num_skipped=skipped, num_dropped=dropped, bytes_not_read=skip)


def _parse_line(line: bytes) -> dict | None:
    """One line's event, or None when it is not one (any parse failure included)."""
    try:
        event = json.loads(line.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):  # JSONDecodeError, too many digits, nesting
        return None
    if not isinstance(event, dict) or event.get("kind") not in KINDS:
        return None
    t = event.get("time")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        return None
    return event


def read_events(run_dir: str | os.PathLike) -> list[dict]:
    """The job's events in order ([] when there are none or the log is unreadable);
    bounded and hardened as :func:`read_event_log`."""
    try:
        log_ = read_event_log(run_dir)
    except InputError as exc:
        log.warning("%s", exc)
        return []
    return [] if log_ is None else log_.events
