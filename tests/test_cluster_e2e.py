"""greyhound end to end on the real local cluster: sbatch --greyhound, the hook under
srun --mpi=pmix, the reference training job, the epilog's post-mortem on sacct."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, SlurmJob, comment_of, sacct_field
from greyhound.ring import CALL_OPS, OP, OP_NAMES, SOURCE_NAMES, RingError, RingReader, ring_paths

pytestmark = pytest.mark.cluster
sys.path.insert(0, str(REPO / "examples"))

GREYHOUND = str(REPO / ".venv/bin/greyhound")
RUN_DIR_BASE = Path("/var/tmp/greyhound")
NUM_ALLREDUCE = 6
SOURCE_TORCH = next(code for code, name in SOURCE_NAMES.items() if name == "torch")

MPI_PROGRAM = f"""
import sys, time
import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
x = np.full(8, float(comm.rank))             # 64 bytes
y = np.empty_like(x)
for _ in range({NUM_ALLREDUCE}):
    comm.Allreduce(x, y)
sub = comm.Split(comm.rank % 2, comm.rank)   # two communicators of 4
sub.Bcast(x[:2], root=0)                     # 16 bytes
comm.Barrier()
# A loop the test can pause at the gate: one allreduce per 50 ms for a while.
for i in range(int(sys.argv[2])):
    comm.Allreduce(x[:1], y[:1])
    time.sleep(0.05)
print(f"rank {{comm.rank}} of {{comm.size}} sum {{y[0]:.0f}}", flush=True)
"""


def wait_for_rings(run_dir: Path, n: int, timeout_s: float = 60) -> list[Path]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        paths = [p for p in ring_paths(run_dir) if p.name.split(".")[1].isdigit()]
        if len(paths) >= n:
            return paths
        time.sleep(0.2)
    raise AssertionError(f"{n} rings did not appear in {run_dir}: {list(run_dir.iterdir())}")


def test_mpi_job_is_recorded_on_every_rank_and_obeys_the_gate(cluster, sbatch, tmp_path):
    prog = tmp_path / "mpi_prog.py"
    prog.write_text(MPI_PROGRAM)
    # The rings are copied out before the job ends: the plugin's job epilog removes them.
    script = (f"#!/bin/bash\nsrun --mpi=pmix {sys.executable} {prog} {tmp_path} 60\n"
              f"mkdir -p {tmp_path}/rings && cp $GREYHOUND_RUN_DIR/ring.* {tmp_path}/rings/\n")
    job = sbatch(script, "--nodes=4", "--ntasks=8", "--ntasks-per-node=2", "--greyhound=mode=detect")
    run_dir = RUN_DIR_BASE / job.job_id
    for _ in range(240):
        if run_dir.is_dir():
            break
        time.sleep(0.25)
    rings = wait_for_rings(run_dir, 8)

    # Pause rank 5 at its gate: its calls stop, and so does everyone's progress at
    # the next collective; resuming lets the job finish.
    ring5 = None
    while ring5 is None:                 # the hook writes the header last
        try:
            ring5 = RingReader(run_dir / "ring.5")
        except RingError:
            time.sleep(0.05)
    with ring5:
        while ring5.counters()["head"] < NUM_ALLREDUCE + 4:
            time.sleep(0.05)
        ring5.pause()
        time.sleep(1.0)
        held_head = ring5.counters()["head"]
        time.sleep(1.0)
        assert ring5.counters()["head"] == held_head, "a paused rank went on calling"
        assert ring5.parked == 1
        ring5.resume()
    assert job.wait() == "COMPLETED", job.text()
    lines = sorted(line for line in job.text().splitlines() if line.startswith("rank "))
    # The Bcast left x[0] = 0 on even ranks and 1 on odd ones: 4 x 0 + 4 x 1.
    assert lines == sorted(f"rank {r} of 8 sum 4" for r in range(8))

    world_ids, sub_ids = set(), {0: set(), 1: set()}
    rings = [tmp_path / "rings" / p.name for p in rings]
    for path in rings:
        with RingReader(path, publish=False) as r:
            info, recs, counters = r.info, r.read().records, r.counters()
        assert info.job_id == job.job_id
        assert counters["drops"] == 0 and counters["gate_timeouts"] == 0
        rank = info.rank
        allreduce = recs[(recs["op"] == OP["AllReduce"]) & (recs["size_bytes"] == 64)]
        assert len(allreduce) == NUM_ALLREDUCE, (rank, len(allreduce))
        world_ids |= set(allreduce["comm_id"].tolist())
        bcast = recs[recs["op"] == OP["Broadcast"]]
        assert bcast["size_bytes"].tolist() == [16]
        sub_ids[rank % 2] |= set(bcast["comm_id"].tolist())
        assert (recs["op"] == OP["Barrier"]).sum() == 1
        calls = recs[np.isin(recs["op"], list(CALL_OPS))]
        assert np.all(calls["t_end_ns"] >= calls["t_start_ns"])
    assert len(world_ids) == 1, "ranks disagree on the world communicator's id"
    assert len(sub_ids[0]) == len(sub_ids[1]) == 1 and sub_ids[0] != sub_ids[1]
    assert sorted(int(p.name.split(".")[1]) for p in rings) == list(range(8))


# The reference job as training_job runs it: gpt_hybrid.sbatch's defaults (DP=2 x PP=4 on
# 8 tasks, 2 * PP micro-batches per replica, ranks numbered DP-fast) for STEPS steps.
DP, PP, STEPS, TRACE_EVERY = 2, 4, 8, 2
MICROBATCHES = 2 * PP


@pytest.fixture(scope="module")
def training_job(cluster, tmp_path_factory):
    """The reference job, DP=2 x PP=4 on 4 nodes, under sbatch --greyhound."""
    out = tmp_path_factory.mktemp("gpt")
    out.chmod(0o755)
    env = dict(os.environ, GREYHOUND_REPO=str(REPO), OUT_DIR=str(out))
    # The reference job's own script, then the rings copied out before the job ends
    # (the plugin's job epilog removes them).
    wrapper = out / "job.sh"
    wrapper.write_text(f"#!/bin/bash\nbash {REPO}/examples/gpt_hybrid.sbatch --steps {STEPS} "
                       f"--trace-every {TRACE_EVERY} || exit $?\n"
                       f"mkdir -p {out}/rings && cp $GREYHOUND_RUN_DIR/ring.* {out}/rings/\n")
    proc = subprocess.run(
        ["sbatch", "--parsable", "--greyhound", "--comment=My Run 7", f"--output={out}/job.out",
         "--nodes=4", "--ntasks-per-node=2", "--cpus-per-task=1", str(wrapper)],
        capture_output=True, text=True, env=env, cwd=out, check=True, timeout=60,
    )
    job_id = proc.stdout.strip().split(";")[0]
    SlurmJob(job_id, out / "job.out").wait(400)
    ended = time.monotonic()
    return job_id, out, ended


def counts_of(recs) -> dict[str, int]:
    """The rank's communication calls by op name (what the torch capture recorded)."""
    torch_calls = recs[(recs["source"] == SOURCE_TORCH) & np.isin(recs["op"], list(CALL_OPS))]
    return {OP_NAMES[op]: int(n) for op, n in zip(*np.unique(torch_calls["op"], return_counts=True))}


def expected_calls(rank: int) -> dict[str, int]:
    """The calls the job must make on ``rank``: in each step 1F1B sends every micro-batch's
    activations to the next stage and its gradient back to the previous one, receiving
    the same (batch_isend_irecv, one Send or Recv record per op); one all-reduce of the
    stage's gradients over its DP group; barriers after creating the DP groups, in the
    final checkpoint and before the trace merge."""
    from hybrid.layout import ParallelLayout

    _, pp_rank = ParallelLayout(dp=DP, pp=PP, world_size=DP * PP).coords_of(rank)
    neighbours = (pp_rank > 0) + (pp_rank < PP - 1)
    return {"AllReduce": STEPS, "Send": STEPS * MICROBATCHES * neighbours,
            "Recv": STEPS * MICROBATCHES * neighbours, "Barrier": 3}


def test_training_job_trains_and_is_captured_without_code_changes(training_job):
    job_id, out, _ = training_job
    text = (out / "job.out").read_text()
    assert sacct_field(job_id, "State").split()[0] == "COMPLETED", text
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert losses[-1] < losses[0], losses
    # gloo is invisible to the C hook: the sitecustomize capture recorded every rank,
    # every call the job makes.
    rings = [p for p in ring_paths(out / "rings") if p.name.split(".")[1].isdigit()]
    assert sorted(int(p.name.split(".")[1]) for p in rings) == list(range(DP * PP))
    for path in rings:
        with RingReader(path, publish=False) as r:
            rank, recs = r.info.rank, r.read().records
        assert counts_of(recs) == expected_calls(rank), path


def test_training_jobs_postmortem_is_on_its_record(training_job):
    job_id, _, ended = training_job
    comment = comment_of(job_id)
    print(f"post-mortem summary on the record by {time.monotonic() - ended:.1f}s after the job ended")
    assert comment.startswith("My Run 7 | greyhound: S="), comment
    assert f"report {RUN_DIR_BASE}/{job_id}/report/report.html" in comment
    out = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-o", "Comment%300"],
                         capture_output=True, text=True, check=True).stdout
    assert "greyhound: S=" in out
    report = subprocess.run([GREYHOUND, "report", job_id], capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    assert f"Job ID: {job_id}" in report.stdout
    assert comment[len("My Run 7 | "):] in report.stdout
    assert "Causes:" in report.stdout
    data = json.loads(subprocess.run([GREYHOUND, "report", "--json", job_id], capture_output=True,
                                     text=True, check=True).stdout)
    recorded = data["postmortem"]
    assert (recorded["job"]["dp"], recorded["job"]["pp"]) == (DP, PP)
    assert recorded["job"]["steps_analysed"] == STEPS // TRACE_EVERY   # steps 1, 3, 5, 7 sampled
    # The record is the analysis of this job's trace: the same figures as running it here.
    from postmortem.analysis import analyze
    from postmortem.whatif_import import load_any

    here = analyze(load_any(Path(recorded["job"]["trace"]))).to_json()
    for key in ("timing", "job"):
        del here[key], recorded[key]
    assert {key: recorded[key] for key in here} == here   # the record adds the online events
    report_dir = RUN_DIR_BASE / job_id / "report"
    assert report_dir.stat().st_mode & 0o777 == 0o700
    assert {"report.html", "heatmap.png", "postmortem.json", "timeline.trace.json"} <= {
        p.name for p in report_dir.iterdir()}


def test_job_without_a_trace_gets_a_record_that_says_so(cluster, sbatch):
    job = sbatch("#!/bin/bash\ntrue\n", "--greyhound")
    assert job.wait() == "COMPLETED"
    comment = comment_of(job.job_id)
    assert comment == (f"greyhound: no post-mortem: no timeline trace in {RUN_DIR_BASE}/{job.job_id} "
                       "(the job recorded none)")
    off = sbatch("#!/bin/bash\ntrue\n", "--greyhound=trace=off")
    assert off.wait() == "COMPLETED"
    comment = comment_of(off.job_id)
    assert comment == "greyhound: no post-mortem: tracing was off for this job (--greyhound=trace=off)"
    shown = subprocess.run([GREYHOUND, "report", off.job_id], capture_output=True, text=True, check=True)
    assert "tracing was off" in shown.stdout


def test_report_for_a_job_without_greyhound_is_a_clear_error(cluster, sbatch):
    job = sbatch("#!/bin/bash\ntrue\n")
    assert job.wait() == "COMPLETED"
    proc = subprocess.run([GREYHOUND, "report", job.job_id], capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"greyhound: job {job.job_id} has no greyhound summary on its record "
                                   "(not run with --greyhound, or its post-mortem has not finished yet)")


def test_epilog_hands_the_report_to_the_jobs_user_only(cluster):
    import pwd

    from postmortem.generate import SyntheticJob, generate
    from postmortem.schema import write_trace

    user = pwd.getpwnam("nobody")
    proc = subprocess.run(["runuser", "-u", "nobody", "--", "sbatch", "--parsable", "--wait",
                           "--output=/dev/null", "--chdir=/tmp", "--wrap=true"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    # As if the job had run with --greyhound and recorded a timeline with a slow worker.
    run_dir = RUN_DIR_BASE / job_id
    # Made aside and renamed into place whole: slurmctld's own epilog for this job may
    # look for the run directory at any moment and must find it complete or not at all.
    staged = RUN_DIR_BASE / f".staged-{job_id}"
    (staged / "timeline").mkdir(parents=True)
    # Worker dp1/pp0 computes 1.8x slower: truth.measured_slowdown is the step time with
    # it over the step time without (the generator runs both).
    trace, truth = generate(SyntheticJob(dp=4, pp=2, num_microbatches=4, num_steps=6,
                                         slow_workers=((1, 0, 1.8),), seed=11))
    write_trace(staged / "timeline/trace.h5", ops=trace.ops, workers=trace.workers, meta=trace.meta)
    for path in (staged, staged / "timeline", staged / "timeline/trace.h5"):
        os.chown(path, user.pw_uid, user.pw_gid)
    staged.chmod(0o700)
    staged.rename(run_dir)
    epilog = subprocess.run([str(REPO / ".venv/bin/python"), "-I", "-m", "postmortem.epilog", job_id],
                            capture_output=True, text=True, timeout=120, cwd="/")
    assert epilog.returncode == 0, epilog.stderr
    comment = comment_of(job_id, 10)
    assert comment.startswith("greyhound: S=") and "dp1/pp0" in comment, comment
    # The robust ideal leaves the one slow worker of 8 out, so S is the injection's own
    # slowdown: within 3% as on every injected trace (test_postmortem_injected.py), plus
    # the summary's rounding to 2 decimals.
    s = float(comment.split("S=", 1)[1].split()[0])
    assert abs(s - truth.measured_slowdown) <= 0.03 * truth.measured_slowdown + 0.005, (s, truth.measured_slowdown)
    report = run_dir / "report"
    st = report.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (user.pw_uid, 0o700)
    for f in report.iterdir():
        fst = f.stat()
        assert (fst.st_uid, fst.st_mode & 0o077) == (user.pw_uid, 0), f
