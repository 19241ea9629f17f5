"""Online detection on the real local cluster: the reference job (DP=2 x PP=4 on 4 nodes)
under `sbatch --greyhound`, its control plane started by the plugin, real fail-slows
injected with `greyhound inject` (a CPU quota on one rank, a narrowed link on one node, which
S3 then moves the gradient rings off under --greyhound=mitigate)
and the verdicts read back from the event log and `greyhound status --json`; what
another user can reach of it; the job going on when its master is killed mid-pause.
Healthy runs (no false alarm) are counted by scripts/bench_online.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import time

import numpy as np
import pytest

from conftest import REPO
from greyhound.analytics.detect import slow_spans
from greyhound.control.events import read_events
from reference_job import GREYHOUND, RUN_DIR_BASE, losses, status, step_times, submit, timeline, wait_tracking

pytestmark = pytest.mark.cluster

def test_a_compute_fail_slow_is_detected_validated_named_and_its_end_seen(unmitigated):
    # conftest's run: a CPU quota on rank 5 for 40 s under --greyhound=detect, from step 50 or so.
    out, record, events = unmitigated.out, unmitigated.truth, unmitigated.events
    seen = timeline(events, out, record)
    # A detection before the injection is noise (scripts/bench_online counts those):
    # validation must not name a culprit for it.
    named = [e for e in events if e["kind"] == "verdict" and e["time"] < record["start"]
             and e["verdict"]["kind"] != "unknown"]
    assert not named, seen
    by_kind: dict = {}
    for e in events:                     # the first of each from the onset: the injected episode
        if e["time"] >= record["start"]:
            by_kind.setdefault(e["kind"], e)
    # A false alarm that began as the injection did may take the episode's first verdict
    # ("unknown"); the master examines the still slow job again and names the straggler.
    named_after = [e["verdict"] for e in events if e["kind"] == "verdict" and e["time"] >= record["start"]
                   and e["verdict"]["kind"] != "unknown"]
    assert "detected" in by_kind and named_after, seen
    assert all((v["kind"], v["ranks"], v["nodes"]) == ("compute", [5], ["n3"]) for v in named_after), seen
    # Validated, if not at the first try: a pause the ranks cannot reach in time names
    # the straggler from profiling alone, and the master examines again as the job
    # slows further (CI rehearsal: the quota deepened from 2.3x to 9x as the first
    # pause was placed; the second round, 13 s later, measured its GEMM at 7.4x).
    assert any(v["validated"] is True for v in named_after), seen
    # GEMMs of a few ranks sized to 0.2 s (the throttled one slower), P2P of 1 MiB: seconds.
    assert 0 < by_kind["paused"]["seconds"] < 30, by_kind["paused"]
    # Steps the job finished between the onset and the detection (scripts/bench_online
    # measured 4 to 5 on this machine; the detector's own delay, 3 iterations past the
    # onset, is in the event, and the target, 3, is measured there).
    finished = sum(record["start"] < end <= by_kind["detected"]["time"] for end, _ in step_times(out))
    assert 1 <= finished <= 8, seen
    assert 1 <= by_kind["detected"]["delay_iterations"] <= 6, seen
    # The recovery, where the job's own steps show one: in one run this VM went on 1.19x
    # slower than before the injection to the job's end, and the steps' detector, like
    # the plane's, kept the slowdown open (by the paper's 10% it had not ended).
    ends, times = map(np.array, zip(*step_times(out)))
    injected = [(a, b) for a, b in slow_spans(ends, times) if a - 5 <= record["start"] <= (b or np.inf)]
    assert injected, ("the job's own steps show no slowdown at the injection", seen)
    if injected[0][1] is not None:
        assert "recovered" in by_kind and by_kind["recovered"]["time"] > record["end"], seen
    # The master writes its last event as Slurm ends the step, just after the job's end.
    deadline = time.monotonic() + 20
    while (shown := status(unmitigated.job_id))["control_plane"] != "stopped" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert shown["control_plane"] == "stopped", shown


def test_another_user_can_neither_read_the_password_nor_use_the_jobs_redis(cluster, tmp_path):
    from greyhound.control.redis_server import ADDRESS_FILE, SECRET_FILE

    nobody = pwd.getpwnam("nobody")
    # Long enough to outlast the probes: in a CI rehearsal a job of 60 steps had ended
    # (its Redis with it) by the time the trackers were ready and the probe connected.
    job = submit(tmp_path / "out", 150)
    wait_tracking(job.job_id, iterations=1)
    run_dir = RUN_DIR_BASE / job.job_id
    host, port = (run_dir / ADDRESS_FILE).read_text().strip().rsplit(":", 1)
    peek = subprocess.run(["runuser", "-u", "nobody", "--", "cat", str(run_dir / SECRET_FILE)],
                          capture_output=True, text=True)
    assert peek.returncode != 0 and peek.stdout == ""
    probe = (f"import redis\nr = redis.Redis(host={host!r}, port={port}, socket_timeout=5)\n"
             "try:\n    r.get('plane')\nexcept redis.AuthenticationError:\n    print('refused')\n")
    proc = subprocess.run(["runuser", "-u", "nobody", "--", str(REPO / ".venv/bin/python"), "-I", "-c", probe],
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "refused", (proc.stdout, proc.stderr)
    assert nobody.pw_uid != os.getuid()
    shown = subprocess.run(["runuser", "-u", "nobody", "--", GREYHOUND, "status", job.job_id],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 1 and "only the job's user and root" in shown.stderr
    assert job.wait(600) == "COMPLETED"


def test_killing_the_master_while_the_job_is_paused_changes_nothing_in_the_job(cluster, tmp_path):
    # The pause gate lets the ranks go by themselves after GREYHOUND_PAUSE_TIMEOUT_S when
    # nobody resumes them: the master is killed (SIGKILL: no clean-up) while every rank
    # is held, Slurm ends the rest of the plane, and the job trains on to the same losses
    # as a run without greyhound.
    from greyhound.ring import RingReader, ring_paths

    # The pause came at step 60 in a run at 0.3 s a step; at 0.13 s a step (a faster
    # CI machine) the plane was tracking only by step 80, and 100 steps ended first.
    steps, timeout_s = 240, 8
    job = submit(tmp_path / "out", steps, env={"GREYHOUND_PAUSE_TIMEOUT_S": str(timeout_s)})
    wait_tracking(job.job_id)
    run_dir = RUN_DIR_BASE / job.job_id
    readers = [RingReader(path, publish=False) for path in ring_paths(run_dir)]
    # `greyhound inject` holds the fail-slow for its duration (at most 60 s; it is ended
    # once the master is dead): it runs alongside.
    inject = subprocess.Popen([GREYHOUND, "inject", "compute", "--job", job.job_id, "--rank", "5",
                               "--duration", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert len(readers) == 8
    deadline = time.monotonic() + 180
    while not all(r.parked for r in readers):
        assert time.monotonic() < deadline, f"no pause within 180 s: {read_events(run_dir)}"
        assert job.state() == "RUNNING", job.text()
        time.sleep(0.01)
    master = next(e for e in read_events(run_dir) if e["kind"] == "control_plane_started")
    os.kill(master["pid"], 9)
    killed = time.monotonic()
    while any(r.parked for r in readers):
        assert time.monotonic() - killed < timeout_s + 20, [r.counters() for r in readers]
        time.sleep(0.05)
    held_s = time.monotonic() - killed
    # The fail-slow has done its part (a pause): ended now, it does not slow the rest.
    inject.send_signal(signal.SIGTERM)
    timeouts = [r.counters()["gate_timeouts"] for r in readers]
    shown = status(job.job_id)
    for r in readers:
        r.close()
    assert job.wait(900) == "COMPLETED", job.text()
    assert inject.wait(120) == 128 + signal.SIGTERM, inject.stderr.read()   # undone, then exits so
    assert timeouts == [1] * 8, timeouts            # each rank let itself go, once
    assert held_s < timeout_s + 5, held_s
    assert shown["control_plane"] == "failed", shown
    undisturbed = submit(tmp_path / "plain", steps, greyhound="off")
    assert undisturbed.wait(900) == "COMPLETED", undisturbed.text()
    got, want = losses(tmp_path / "out"), losses(tmp_path / "plain")
    assert len(got) == len(want) == steps
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-6


def test_a_narrowed_link_on_one_node_is_named_on_that_node_and_s3_moves_the_rings_off_it(netns_cluster, unmitigated,
                                                                                          tmp_path):
    # tc tbf on n2's veth and eth0 (the netns cluster): every path in or out of n2 runs
    # at 20 Mbit/s. Profiling points at n2's groups; the P2P tests find n2's links slow.
    # Under --greyhound=mitigate, with the ranks placed replica by replica (pp-fast: n2
    # holds stages 2 and 3 of replica 0, and both stages' gradient rings cross its link
    # to the other replica), S3 then gives n2's ranks one stage's DP pair inside the
    # node (issue 10's link case, in the same job as issue 9's).
    out = tmp_path / "out"
    job = submit(out, 150, "--rank-order", "pp-fast", greyhound="mitigate")
    wait_tracking(job.job_id)
    run_dir = RUN_DIR_BASE / job.job_id
    truth = tmp_path / "truth.jsonl"
    inject = subprocess.Popen([GREYHOUND, "inject", "link", "--node", "n2", "--rate", "20mbit",
                               "--duration", "50", "--truth", str(truth)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # What `greyhound status` says all along, the validation pause (seconds) included:
    # the master beats while it validates, so it is never taken for dead. Read in this
    # process (the CLI's own function), every 0.2 s: with a `greyhound status` process
    # per sample (0.6 s each here, idle) the samples of one clean-clone CI run caught
    # none of the 13 s of validation (why is not known; the message now shows them).
    from greyhound.status_cli import job_status

    shown: dict = {}
    samples: list[tuple[float, str]] = []     # (time, state), for the failure message
    while job.state() in ("PENDING", "RUNNING"):
        now = job_status(job.job_id)
        shown.setdefault(now["control_plane"], now.get("why"))
        samples.append((time.time(), now["control_plane"]))
        time.sleep(0.2)
    assert job.wait(900) == "COMPLETED", job.text()
    assert inject.wait(120) == 0, inject.stderr.read()
    events = read_events(run_dir)
    injected = json.loads(truth.read_text().splitlines()[-1])
    seen = timeline(events, out, injected) + "\nstatus: " + " ".join(
        f"{t - events[0]['time']:+.1f}:{state}" for t, state in samples)
    verdicts = [e["verdict"] for e in events if e["kind"] == "verdict"]
    assert verdicts, seen
    assert (verdicts[0]["kind"], verdicts[0]["nodes"], verdicts[0]["validated"]) == ("link", ["n2"], True), seen
    assert "validating" in shown and "failed" not in shown, (shown, seen)
    moved = [e for e in events if e["kind"] == "mitigation" and e["level"] == "S3"]
    assert moved, seen
    placement = moved[0]["placement"]
    assert placement[2][1] == placement[3][1], (placement, seen)        # one stage: its ring inside n2
    relaid = [e for e in events if e["kind"] == "relaid"]
    assert relaid and relaid[0]["pause_s"] > 0 and relaid[0]["bytes"] > 0, seen
    # Step time under the congested link, before the validation pause and after the
    # move (measured 1.0-1.25 s a step against 0.42-0.45 s in a bench_online run).
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    paused = next(e for e in events if e["kind"] == "paused")

    def median_step_s(start: float, end: float) -> float:
        inside = [r["step_time"] for r in rows if start < r["time"] - r["step_time"] and r["time"] <= end]
        assert len(inside) >= 3, (start, end, seen)
        return float(np.median(inside))

    before = median_step_s(injected["start"], paused["time"])
    after = median_step_s(relaid[0]["time"] + 2, injected["end"])
    assert after < 0.7 * before, (after, before, seen)
    # Every step's loss was logged once, by whichever rank computed it after the move,
    # and the move changed nothing that was learned: the losses are those of the run
    # left alone (the job is the same whatever its rank order, seed and step count: a
    # step's loss depends on neither; the unmitigated run's first 150 steps).
    assert [r["step"] for r in rows] == list(range(150)), seen
    got, want = [r["loss"] for r in rows], losses(unmitigated.out)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-6, seen
