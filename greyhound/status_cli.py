"""`greyhound status [JOBID] [--json] [--watch]`: is my job straggling right now, and where?

Reads the job's own Redis (its address and password are in the job's run directory,
readable by the job's user and root only) and the job's event log. Run it where the
run directory is: on the local cluster anywhere, on a cluster with node-local run
directories on the job's first node (``srun --jobid=J --overlap -N1 -w NODE greyhound
status``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import click

from greyhound.control import store
from greyhound.control.events import read_events
from greyhound.control.redis_server import RedisError, read_address
from greyhound.errors import GreyhoundError
from greyhound.plugstack import read_plugstack
from greyhound.slurm_client import check_job_id

EVENTS_SHOWN = 10
STOP_GRACE_S = 3.0
"""How long status waits for the plane's last event once the job's Redis is gone."""


def job_status(job_id: str, *, rundir: Path | None = None) -> dict:
    """What `greyhound status` shows for job_id, as a dict (the --json output).

    Raises:
        GreyhoundError: the job has no greyhound run directory here, or it is not yours.
    """
    job_id = check_job_id(job_id)
    run_dir = (rundir or read_plugstack().rundir) / job_id
    if not run_dir.is_dir():
        raise GreyhoundError(_no_run_dir_reason(job_id, run_dir))
    if not os.access(run_dir, os.R_OK | os.X_OK):
        raise GreyhoundError(f"job {job_id}: only the job's user and root may see its status")
    out: dict = {"job_id": job_id, "run_dir": str(run_dir), "control_plane": "none",
                 "events": read_events(run_dir)[-EVENTS_SHOWN:]}
    try:
        address = read_address(run_dir)
    except RedisError:
        out["why"] = "no control plane has started for this job (yet)"
        if any(e["kind"] == "control_plane_failed" for e in out["events"]):
            out["control_plane"] = "failed"
            out["why"] = "the control plane could not start (see the events)"
        return out
    try:
        state = store.read_job(address.client(timeout_s=2.0))
    except Exception as exc:  # noqa: BLE001  (the server is gone: the job ended, or the master died)
        out["events"] = _events_once_redis_is_gone(run_dir)
        kinds = [e["kind"] for e in out["events"]]
        requeued = _requeued_since_start(out["events"])
        if requeued is not None:
            out["control_plane"] = "requeued"
            nodes = ",".join(str(n) for n in requeued.get("nodes", []))
            out["why"] = (f"S4 requeued the job without {nodes} after step {requeued.get('step')}; the control "
                          "plane starts again with its next run")
        elif "control_plane_stopped" in kinds:
            out["control_plane"] = "stopped"
            out["why"] = f"the job has ended; its post-mortem: greyhound report {job_id}"
        else:
            out["control_plane"] = "failed"
            out["why"] = (f"the job's Redis does not answer ({type(exc).__name__}); greyhound no longer "
                          "watches this job")
        return out
    plane = state["plane"]
    heartbeat = float(plane.get("heartbeat") or 0)
    out.update(state)
    out["control_plane"] = plane.get("state", "starting")
    if not heartbeat:
        out["control_plane"] = "starting"        # Redis is up, the master has not written yet
    elif out["control_plane"] not in ("stopped", "failed") and time.time() - heartbeat > store.HEARTBEAT_STALE_S:
        out["control_plane"] = "failed"
        out["why"] = f"the master has been silent for {time.time() - heartbeat:.0f}s"
    return out


def _events_once_redis_is_gone(run_dir: Path) -> list[dict]:
    """The latest events, read again once the job's Redis did not answer. Slurm signals
    the step's processes together at the job's end: Redis is gone in milliseconds, the
    master writes ``control_plane_stopped`` a moment later (it has KillWait). A plane
    that ended well says so within STOP_GRACE_S; one that died never does."""
    deadline = time.monotonic() + STOP_GRACE_S
    while True:
        events = read_events(run_dir)[-EVENTS_SHOWN:]
        if any(e["kind"] in ("control_plane_stopped", "control_plane_failed") for e in events) or \
                time.monotonic() >= deadline:
            return events
        time.sleep(0.1)


def _requeued_since_start(events: list[dict]) -> dict | None:
    """The ``requeued`` event of the last run, if S4 requeued it (a requeued job's next
    run goes on in the same run dir and starts its plane again); else None."""
    for e in reversed(events):
        if e["kind"] == "requeued":
            return e
        if e["kind"] == "control_plane_started":
            return None
    return None


def _no_run_dir_reason(job_id: str, run_dir: Path) -> str:
    from greyhound.slurm_client import connect

    try:
        record = connect().job(job_id)
    except GreyhoundError:
        return f"job {job_id} is unknown to Slurm here"
    if not record.running:
        return f"job {job_id} has ended; its post-mortem: greyhound report {job_id}"
    return f"job {job_id} does not run with greyhound (no {run_dir})"


def _fmt_s(value) -> str:
    try:
        return f"{float(value):.3f}s"
    except (TypeError, ValueError):
        return "-"


def render_text(status: dict) -> str:
    lines = [f"Job {status['job_id']}: control plane {status['control_plane']}"
             + (f" ({status['why']})" if status.get("why") else "")]
    plane = status.get("plane", {})
    if plane.get("since"):
        lines[0] += f", since {time.strftime('%H:%M:%S', time.localtime(float(plane['since'])))}"
    ranks = status.get("ranks", {})
    if ranks:
        lines.append(f"{'rank':>5} {'node':<10} {'iter':>6} {'current':>9} {'baseline':>9} {'ratio':>6}  state")
        for rank, r in ranks.items():
            ratio = r.get("slowdown")
            slow = r.get("slow_since") not in (None, "")
            lines.append(f"{rank:>5} {str(r.get('node', '?')):<10} {r.get('iterations', 0):>6} "
                         f"{_fmt_s(r.get('current_s')):>9} {_fmt_s(r.get('baseline_s')):>9} "
                         f"{(f'{float(ratio):.2f}' if ratio not in (None, '') else '-'):>6}  "
                         + (f"SLOW since iteration {r['slow_since']}" if slow else "ok"))
    for s in status.get("suspects") or []:
        lines.append(f"suspect: {s.get('kind')} {s.get('where', '')} ({s.get('why', '')})")
    for v in status.get("verdicts") or []:
        lines.append(f"fail-slow: {v.get('kind')} at {v.get('where')}, severity {v.get('severity', 0):.2f}x, "
                     f"since {v.get('since', '?')}")
    plan, applied = status.get("plan"), status.get("applied")
    if isinstance(plan, dict) and plan.get("version"):
        since = f", in force from step {applied['step']}" if isinstance(applied, dict) and \
            applied.get("version") == plan["version"] else ", not applied yet"
        lines.append(f"mitigation {plan.get('level', '?')} (plan {plan['version']}): micro-batches per DP "
                     f"replica {','.join(map(str, plan.get('microbatch_split', [])))}{since}; {plan.get('why', '')}")
    pauses = status.get("pauses") or {}
    if pauses:
        lines.append(f"pauses: {pauses.get('count', 0)}, {float(pauses.get('total_s', 0)):.2f}s in all")
    if status.get("events"):
        lines.append("last events:")
        for e in status["events"]:
            extra = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("time", "kind"))
            lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(e['time']))} {e['kind']}"
                         + (f": {extra}" if extra else ""))
    return "\n".join(lines)


@click.command("status")
@click.argument("job_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--watch", is_flag=True, help="Refresh every 2 seconds until interrupted or the job ends.")
def status(job_id: str | None, as_json: bool, watch: bool) -> None:
    """Show whether a running job straggles now, and where (default: $SLURM_JOB_ID)."""
    job_id = job_id or os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise GreyhoundError("give a job id (greyhound status JOBID), or run inside the job")
    while True:
        data = job_status(job_id)
        text = json.dumps(data, indent=2, default=str) if as_json else render_text(data)
        if not watch:
            click.echo(text)
            return
        click.clear()
        click.echo(text)
        if data["control_plane"] in ("stopped", "failed"):
            return
        try:
            time.sleep(2)
        except KeyboardInterrupt:
            return
