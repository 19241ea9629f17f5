"""S4's Slurm step on the real cluster: a step of the job, as its own unprivileged user,
requeues the running job away from a node (greyhound.slurm_client.requeue_excluding),
the epilog finishes what Slurm's end of that step cut short, and Slurm runs the job
again elsewhere."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import EPILOG_LOG, REPO, ensure_user

pytestmark = pytest.mark.cluster

SCRIPT = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --time=5
#SBATCH --open-mode=append
echo "run ${SLURM_RESTART_COUNT:-0} $(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd,)"
sleep 300
"""


def _runs(out) -> list[tuple[int, list[str]]]:
    lines = [line.split() for line in out.read_text().splitlines() if line.startswith("run ")] if out.exists() else []
    return [(int(count), nodes.split(",")) for _, count, nodes in lines]


def _until(what, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not (got := what()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return got


# S4 as the master runs it: from a step of the job itself, which Slurm ends with the
# others (SIGTERM, SIGKILL after KillWait). "hold-only" is a master killed right after
# its first command: only the epilog can finish the requeue.
IN_JOB_SCRIPT = """#!/bin/bash
#SBATCH --time=5
#SBATCH --open-mode=append
echo "run ${SLURM_RESTART_COUNT:-0} $(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd,)"
if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then
    srun --overlap -N1 -n1 "$GH_PYTHON" -I -c "$GH_S4" "$GH_HOW"
fi
sleep 300
"""
S4_STEP = """
import os, subprocess, sys, time
from greyhound.control.events import append_event
from greyhound.slurm_client import CommandLineClient
slurm = CommandLineClient()
job_id, bad = os.environ["SLURM_JOB_ID"], slurm.hostnames(os.environ["SLURM_JOB_NODELIST"])[-1]
append_event(os.environ["GREYHOUND_RUN_DIR"], "requeued", nodes=[bad, "n99", "n1;reboot"], step=7, why="test")
if sys.argv[1] == "hold-only":
    subprocess.run(["scontrol", "requeuehold", job_id], check=True)
    time.sleep(600)
else:
    slurm.requeue_excluding(job_id, [bad])
"""


def _submit_in_job(user, tmp_path: Path, how: str) -> tuple[str, Path]:
    (tmp_path / "job.sh").write_text(IN_JOB_SCRIPT)
    out = tmp_path / f"out-{how}.txt"
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "GH_PYTHON": str(REPO / ".venv/bin/python"), "GH_S4": S4_STEP, "GH_HOW": how}
    job_id = subprocess.run(["runuser", "-u", user.pw_name, "--", "sbatch", "--parsable", "--greyhound",
                             "--nodes=1", f"--output={out}", "--export=ALL", str(tmp_path / "job.sh")],
                            capture_output=True, text=True, check=True, cwd=tmp_path, env=env,
                            timeout=60).stdout.strip()
    return job_id, out


def test_a_step_of_the_job_requeues_it_away_from_its_node_and_it_runs_again_elsewhere(cluster):
    """Two jobs side by side (one wait for both holds): one whose step runs
    requeue_excluding as the master does, one whose step dies right after requeuehold."""
    from greyhound.control.events import read_events
    from greyhound.plugstack import read_plugstack
    from greyhound.slurm_client import CommandLineClient

    user = ensure_user("gh-victim")
    # Under /tmp itself: pytest's tmp_path lies below a directory only root may enter.
    tmp_path = Path(tempfile.mkdtemp(prefix="gh-requeue-", dir="/tmp"))
    tmp_path.chmod(0o777)
    jobs = {how: _submit_in_job(user, tmp_path, how) for how in ("requeue_excluding", "hold-only")}
    try:
        # Slurm holds a requeued job back for its credential lifetime (its begin time),
        # which the local cluster sets to 30 s (Slurm's default: 120 s).
        hold_s = CommandLineClient().requeue_hold_s()
        assert hold_s == 30.0
        for how, (job_id, out) in jobs.items():
            runs = _until(lambda out=out: len(_runs(out)) == 2 and _runs(out), hold_s + 180)
            assert runs, f"{how}: not run again: {out.read_text() if out.exists() else ''}\n{_epilog_lines(job_id)}"
            bad = runs[0][1][0]
            assert runs[1][0] == 1 and runs[1][1] != [bad], (how, runs, _epilog_lines(job_id))
            shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
            # Only the allocation's own node: n99 and "n1;reboot" in the event changed nothing.
            assert f"ExcNodeList={bad} " in shown and "Restarts=1" in shown, shown
            if how == "hold-only":
                assert any(f"S4: excluded {bad}; released" in line for line in _epilog_lines(job_id)), \
                    _epilog_lines(job_id)
            # The second run goes on in the first run's directory: its event log still says why.
            events = read_events(read_plugstack().rundir / job_id)
            assert [e["nodes"][0] for e in events if e["kind"] == "requeued"] == [bad], events
    finally:
        subprocess.run(["scancel", *(job_id for job_id, _ in jobs.values())], check=False)
        shutil.rmtree(tmp_path, ignore_errors=True)


def _epilog_lines(job_id: str) -> list[str]:
    return [line for line in EPILOG_LOG.read_text(errors="replace").splitlines()
            if f"job {job_id}: greyhound: S4:" in line] if EPILOG_LOG.exists() else []


def test_a_bad_node_name_is_refused_before_anything_changes(cluster):
    from greyhound.errors import InputError
    from greyhound.slurm_client import CommandLineClient

    with pytest.raises(InputError, match="node names are"):
        CommandLineClient().requeue_excluding("1", ["n1;reboot"])


def _planner(tmp_path, job: dict, **config):
    from greyhound.control import store
    from greyhound.control.redis_server import start_redis
    from greyhound.mitigate.planner import Planner, PlannerConfig
    from greyhound.slurm_client import CommandLineClient

    proc, address = start_redis(tmp_path, host="127.0.0.1")
    client = address.client()
    client.set(store.TRAINING_LAYOUT, json.dumps({"microbatch_split": [4, 4], "replicas": [[0], [1]]}))
    planner = Planner(client, tmp_path, config=PlannerConfig(**config), job=job, slurm=CommandLineClient())
    return proc, client, planner


SLOW = {r: {"baseline_s": 0.2, "current_s": 0.8, "iterations": 100, "slow_since": 50} for r in range(2)}
"""50 slow iterations, 0.6 s lost each: 30 s lost so far."""


def _link_verdict(node: str) -> dict:
    return {"kind": "link", "where": node, "nodes": [node], "ranks": [], "validated": True}


def test_s4_checkpoints_then_requeues_the_job_without_the_slow_node_once_the_loss_reaches_the_cost(cluster, tmp_path):
    from greyhound.control import store
    from greyhound.control.events import read_events
    from greyhound.control.redis_server import stop_redis

    script = tmp_path / "job.sh"
    script.write_text(SCRIPT)
    out = tmp_path / "out.txt"
    job_id = subprocess.run(["sbatch", "--parsable", f"--output={out}", str(script)], capture_output=True,
                            text=True, check=True, cwd=tmp_path, timeout=60).stdout.strip()
    proc = None
    try:
        first = _until(lambda: _runs(out), 60)
        assert first, "the job did not start"
        bad = first[0][1][1]
        partition = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%P"], capture_output=True, text=True,
                                   check=True).stdout.strip()
        # A 29 s restart (start-up 0 here, no hold, a 0.2 s step) against 30 s lost: go.
        proc, client, planner = _planner(tmp_path, {"id": job_id, "partition": partition, "num_nodes": 2},
                                         requeue_hold_s=29.0)
        planner.on_verdict(_link_verdict(bad), SLOW)
        planner.poll({**SLOW, 0: {**SLOW[0], "iterations": 60}})     # 20 s lost < 29 s: not yet
        assert client.get(store.PLAN) is None
        planner.poll(SLOW)
        plan = json.loads(client.get(store.PLAN))
        assert plan["checkpoint"] is True and plan["microbatch_split"] == [4, 4] and plan["level"] == "S4"
        planner.poll(SLOW)                                           # no checkpoint yet: waits
        assert [e["kind"] for e in read_events(tmp_path)] == ["mitigation"]
        client.set(store.TRAINING_CHECKPOINTED, json.dumps({"version": plan["version"], "step": 100}))
        planner.poll(SLOW)
        events = read_events(tmp_path)
        assert [e["kind"] for e in events] == ["mitigation", "requeued"], events
        assert events[1]["nodes"] == [bad] and events[1]["step"] == 100
        shown = _until(lambda: (s := subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                                                    text=True).stdout) and "Restarts=1" in s and s, 30)
        assert shown and f"ExcNodeList={bad}" in shown, shown
        assert f"Comment=greyhound S4: requeued without {bad} after step 100" in shown, shown
    finally:
        subprocess.run(["scancel", job_id], check=False)
        if proc is not None:
            stop_redis(proc)


def test_s4_is_refused_with_its_reason_when_too_few_nodes_would_be_left_or_it_is_turned_off(cluster, tmp_path):
    from greyhound.control import store
    from greyhound.control.events import read_events
    from greyhound.control.redis_server import stop_redis

    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %P"], capture_output=True, text=True,
                           check=True).stdout.split()
    partition = nodes[1].rstrip("*")
    count = len(set(nodes[0::2]))
    proc, client, planner = _planner(tmp_path, {"id": "999999", "partition": partition, "num_nodes": count},
                                     requeue_hold_s=0.0)
    try:
        planner.on_verdict(_link_verdict("n2"), SLOW)
        planner.poll(SLOW)
        skipped = read_events(tmp_path)
        assert [e["kind"] for e in skipped] == ["mitigation_skipped"] and client.get(store.PLAN) is None
        assert skipped[0]["why"] == (f"partition {partition} would keep {count - 1} usable node(s) without n2; "
                                     f"the job needs {count}"), skipped
    finally:
        stop_redis(proc)
    (tmp_path / "off").mkdir()
    proc, client, planner = _planner(tmp_path / "off", {"id": "999999", "partition": partition, "num_nodes": 1},
                                     requeue_hold_s=0.0, requeue=False)
    try:
        planner.on_verdict(_link_verdict("n2"), SLOW)
        planner.poll(SLOW)
        assert [e["why"] for e in read_events(tmp_path / "off")] == ["S4 (requeue) is turned off for this job"]
    finally:
        stop_redis(proc)
