"""The reference job on the local cluster, for the online tests: submit it under
greyhound, wait for its trackers, read its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from conftest import REPO, SlurmJob

GREYHOUND = str(REPO / ".venv/bin/greyhound")
RUN_DIR_BASE = Path("/var/tmp/greyhound")


def submit(out: Path, steps: int, *extra: str, env: dict | None = None, greyhound: str = "on") -> SlurmJob:
    """The reference job (DP=2 x PP=4 on 4 nodes) under ``--greyhound=<greyhound>``."""
    out.mkdir(mode=0o755, exist_ok=True)
    env = dict(os.environ, GREYHOUND_REPO=str(REPO), OUT_DIR=str(out), **(env or {}))
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--greyhound={greyhound}", f"--output={out}/job.out",
         str(REPO / "examples/gpt_hybrid.sbatch"),
         "--steps", str(steps), "--trace-every", "1000", *extra],
        capture_output=True, text=True, env=env, cwd=out, check=True, timeout=60,
    )
    return SlurmJob(proc.stdout.strip().split(";")[0], out / "job.out")


def status(job_id: str) -> dict:
    proc = subprocess.run([GREYHOUND, "status", "--json", job_id], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


READY_ITERATIONS = 40
"""Iterations before an injection: the trackers take the first regime that lasts 20
iterations (intervals.slow_intervals' min_reference) as healthy, and the reference job's
first few steps are a regime of their own (warm-up). A fail-slow that starts before
that is the job's reference level: nothing to compare it with (CI once injected at the
tracker's 16th healthy iteration, and nothing was detected)."""


def wait_tracking(job_id: str, iterations: int = READY_ITERATIONS, timeout_s: float = 240) -> dict:
    """Waits until every rank's tracker reports iterations; the status then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            st = status(job_id)
        except AssertionError:
            st = {}
        ranks = st.get("ranks") or {}
        if len(ranks) == 8 and all(int(r.get("iterations") or 0) >= iterations for r in ranks.values()):
            return st
        time.sleep(1)
    raise AssertionError(f"job {job_id}: trackers did not report {iterations} iterations in {timeout_s}s: {st}")


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def step_times(out: Path) -> list[tuple[float, float]]:
    """(end time, step time) of each step."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["time"], r["step_time"]) for r in rows]


def timeline(events: list[dict], out: Path, truth: dict | None = None) -> str:
    """The event log as a failing test should show it: one line per event, its time
    from the injection's start (or the first event) and the steps finished by then."""
    ends = [end for end, _ in step_times(out)] if (out / "metrics.jsonl").exists() else []
    t0 = truth["start"] if truth else (events[0]["time"] if events else 0.0)
    lines = [f"injected {truth['end'] - truth['start']:.1f} s" if truth else "no injection"]
    for e in events:
        verdict = e.get("verdict")
        detail = (verdict.get("where", "") if isinstance(verdict, dict)
                  else " ".join(f"{k}={e[k]}" for k in ("microbatch_split", "seconds", "why") if k in e))
        lines.append(f"{e['time'] - t0:+8.1f} s  step {sum(end <= e['time'] for end in ends):4d}  "
                     f"{e['kind']} {detail}".rstrip())
    if ends:
        lines.append(f"{ends[-1] - t0:+8.1f} s  step {len(ends):4d}  (last step)")
    return "\n".join(lines)
