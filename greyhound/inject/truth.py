"""The ground-truth log: one JSON line per injection that really happened.

A record is written when the injection has been undone, so it carries both wall-clock
times. Fields (``None`` where they do not apply):

    id, kind ("compute" | "link"), host, injector_pid
    severity       compute: fraction of CPU taken, link: the tc rate text
    rate_bps       link: the rate in bits per second
    quota_cpus     compute: CPUs left to the target ((1 - severity) x cpus)
    pids           compute: the processes moved into the cgroup
    job, step, rank  compute by rank
    node           link by node
    links          link: [{"netns": ..., "dev": ...}, ...] actually throttled
    start, end     wall-clock seconds (time.time()) when applied and when undone
    planned_start_s, planned_duration_s   the schedule's offsets
    ended_by       "duration" | "signal" | "target-exited" | "undo-all" | "error"

Appends take an exclusive flock and are single write() calls, so concurrent injectors
(threads or processes) never interleave lines.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from greyhound.errors import InputError

FIELDS = (
    "id", "kind", "host", "injector_pid", "severity", "rate_bps", "quota_cpus", "pids",
    "job", "step", "rank", "node", "links", "start", "end", "planned_start_s",
    "planned_duration_s", "ended_by",
)


def new_record(**fields) -> dict:
    """A truth record with every field present; unknown field names are a bug."""
    unknown = set(fields) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown truth fields {sorted(unknown)}")
    return {name: fields.get(name) for name in FIELDS}


def append(path: Path, record: dict) -> None:
    """Append one record as a JSON line (directory created if missing)."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise InputError(f"cannot write the truth log {path}: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path: Path) -> list[dict]:
    """Every record of a truth log, in order."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InputError(f"cannot read the truth log {path}: {exc.strerror}") from exc
    out = []
    for num, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError as exc:
                raise InputError(f"{path}:{num}: not a JSON line: {exc}") from exc
    return out
