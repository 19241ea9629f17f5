"""The job's control plane on the real local cluster: the SPANK plugin starts it from
the batch step of every greyhound job (plugstack python=), it comes up on every node
without being recorded and without holding up the user's srun, and it ends with the
job; when it cannot start, the job runs on with one line that says why."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import CLUSTER_STATE, PREFIX, REPO
from greyhound.plugstack import read_plugstack

pytestmark = pytest.mark.cluster

PLUGSTACK_ENTRY = Path("/etc/slurm/plugstack.conf.d/greyhound.conf")
CLUSTER_LOGS = CLUSTER_STATE / "log"
GREYHOUND = REPO / ".venv/bin/greyhound"
HOOK = str(PREFIX / "lib/greyhound/libgreyhound_hook.so")
CAPTURE = str(PREFIX / "lib/greyhound/python")
NODES = ["n1", "n2", "n3", "n4"]
RUNDIR = read_plugstack(PLUGSTACK_ENTRY).rundir

# Run inside a job: one JSON line per process of this job's control plane (the
# launcher, the plane's ranks, its Redis), found by the run dir in its environment.
INSPECT = r"""
import json, os, sys

run_dir = os.environ["GREYHOUND_RUN_DIR"]


def listening(pid):
    # Port by inode of each TCP socket in LISTEN (state 0A) in its network namespace.
    ports = {}
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A":
                ports[cols[9]] = int(cols[1].rsplit(":", 1)[1], 16)
    return ports


for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode().strip()
        environ = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace").split("\0")
        env = dict(v.split("=", 1) for v in environ if "=" in v)
        status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
        maps = open(f"/proc/{pid}/maps").read()
        stdin = os.readlink(f"/proc/{pid}/fd/0")
        cwd = os.readlink(f"/proc/{pid}/cwd")
        links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        inodes = listening(pid)
        nice = sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")})
        autogroup = open(f"/proc/{pid}/autogroup").read().split()
    except OSError:
        continue
    ports = sorted({inodes[link[8:-1]] for link in links if link.startswith("socket:[") and link[8:-1] in inodes})
    # redis-server rewrites its command line over its environment: known by its cwd.
    ours = "greyhound.control" in cmd and env.get("GREYHOUND_RUN_DIR") == run_dir
    redis = status["Name"].strip() == "redis-server" and cwd == run_dir
    if not (ours or redis):
        continue
    print("proc|" + json.dumps({"pid": int(pid), "ppid": int(status["PPid"]), "uid": int(status["Uid"].split()[0]),
                                "cmd": cmd, "redis": redis, "ld_preload": env.get("LD_PRELOAD"),
                                "pythonpath": env.get("PYTHONPATH"), "marker": env.get("GREYHOUND_CONTROL_PLANE"),
                                "hook_mapped": "libgreyhound_hook" in maps, "stdin": stdin,
                                "ports": ports, "nice": nice, "autogroup": autogroup}), flush=True)
print("script_autogroup|" + json.dumps(open(f"/proc/{os.getppid()}/autogroup").read().split()))
"""

# Waits (at most a minute) until the plane says it started, then shows it.
WAIT_FOR_PLANE = """
for _ in $(seq 240); do
    grep -q control_plane_started "$GREYHOUND_RUN_DIR/events.jsonl" 2>/dev/null && break
    sleep 0.25
done
"""


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def greyhound_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "greyhound:" in line]


def procs(text: str) -> list[dict]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("proc|")]


def field(text: str, name: str) -> str:
    values = [line.split("|", 1)[1] for line in text.splitlines() if line.startswith(name + "|")]
    assert len(values) == 1, (name, text)
    return values[0]


def plane_processes(run_dir: Path) -> list[str]:
    """The processes left anywhere on this host by the control plane of run_dir: the
    launcher, srun, the plane's ranks (by the run dir in their environment) and its
    redis-server (by its working directory)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if ("greyhound.control" in cmd and f"GREYHOUND_RUN_DIR={run_dir}" in env) or \
                ("redis-server" in cmd and cwd == str(run_dir)):
            found.append(f"{pid}: {cmd}")
    return found


def wait_gone(run_dir: Path, timeout_s: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := plane_processes(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def steps(job_id: str) -> list[tuple[str, str]]:
    out = subprocess.run(["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,JobName"], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return [tuple(line.split("|")) for line in out.splitlines() if line]


@pytest.fixture
def inspect_py(tmp_path) -> Path:
    path = tmp_path / "inspect_plane.py"
    path.write_text(INSPECT)
    path.chmod(0o644)
    return path


@pytest.fixture
def plugstack_python(cluster):
    """Points greyhound's plugstack line at another python=; restores it afterwards."""
    saved = PLUGSTACK_ENTRY.read_text()

    def set_python(value: str | None) -> None:
        """python=value on greyhound's line; None: no python= at all."""
        lines = []
        for line in saved.splitlines():
            if line.startswith("optional") or line.startswith("required"):
                line = " ".join(w for w in line.split() if not w.startswith("python="))
                line += f" python={value}" if value is not None else ""
            lines.append(line)
        PLUGSTACK_ENTRY.write_text("\n".join(lines) + "\n")

    try:
        yield set_python
    finally:
        PLUGSTACK_ENTRY.write_text(saved)


@pytest.fixture(scope="module", autouse=True)
def configured(cluster):
    if not any(w.startswith("python=") for line in PLUGSTACK_ENTRY.read_text().splitlines()
               if line.startswith(("optional", "required")) for w in line.split()):
        pytest.skip(f"no python= in {PLUGSTACK_ENTRY}: run 'scripts/cluster default off' (or on) to write it")


def test_the_control_plane_comes_up_on_every_node_and_goes_with_the_job(sbatch, inspect_py):
    script = f"""#!/bin/bash
sleep 8
{WAIT_FOR_PLANE}
echo "script|$$"
{sys.executable} {inspect_py}
{GREYHOUND} status "$SLURM_JOB_ID"
"""
    job = sbatch(script, "-N4", "--greyhound")
    assert job.wait() == "COMPLETED", job.text()
    text = job.text()
    run_dir = RUNDIR / job.job_id
    started = [e for e in events(run_dir) if e["kind"] == "control_plane_started"]
    assert len(started) == 1, events(run_dir)
    assert sorted(started[0]["nodes"]) == NODES
    assert f"Job {job.job_id}: control plane tracking" in text
    # Nothing of greyhound's or srun's in the user's output.
    assert greyhound_lines(text) == [], text
    assert not [line for line in text.splitlines() if line.startswith(("srun:", "slurmstepd"))], text

    seen = procs(text)
    launchers = [p for p in seen if "greyhound.control.launch" in p["cmd"]]
    ranks = [p for p in seen if "greyhound.control.plane" in p["cmd"] and not p["cmd"].startswith("srun")]
    assert len(launchers) == 1, seen
    # A child of the batch script (proctrack/linuxproc ends it with the job), its stdin not the job's.
    assert launchers[0]["ppid"] == int(field(text, "script"))
    assert launchers[0]["stdin"] == "/dev/null"
    assert len(ranks) == 4, seen
    redis = [p for p in seen if p["redis"]]
    assert len(redis) == 1 and redis[0]["ppid"] in {r["pid"] for r in ranks}, seen
    # None of them loads the hook or the Python capture; all are marked as the plane's.
    assert not redis[0]["hook_mapped"]
    for p in seen:
        if p["redis"]:
            continue
        assert not p["hook_mapped"], p
        assert HOOK not in (p["ld_preload"] or ""), p
        assert CAPTURE not in (p["pythonpath"] or ""), p
        assert p["marker"] == "1", p
    # The plane yields the CPU to the job: every thread of every rank at nice 19, and
    # their session's autogroup too where the kernel has autogroups; its Redis (read by
    # training ranks for plans) and the job's own processes keep their priority.
    autogroups = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    for rank in ranks:
        assert rank["nice"] == [19], rank
        assert not autogroups or rank["autogroup"][-1] == "19", rank
    assert redis[0]["nice"] == [0] and redis[0]["autogroup"][-1] == "0", redis
    assert json.loads(field(text, "script_autogroup"))[-1] == "0"
    assert redis[0]["autogroup"][0] not in {rank["autogroup"][0] for rank in ranks}, seen
    # Each rank's MPI listens on ports the kernel chose, not Open MPI's first free port
    # from 1024: a plane that just ended, on the same node, used that one (launch.py).
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for rank in ranks:
        assert rank["ports"] and all(low <= port <= high for port in rank["ports"]), (rank["ports"], low, high)
    # The plane's step is the job's only other step.
    assert [name for _, name in steps(job.job_id)].count("greyhound") == 1

    assert wait_gone(run_dir) == [], "the control plane outlived its job"


def test_the_users_srun_does_not_wait_for_the_plane(sbatch):
    # The plane's step starts with the batch script; the user's srun right away must
    # not queue behind it (srun --overlap shares the job's CPUs and memory).
    script = f"""#!/bin/bash
t0=$(date +%s%N)
srun -n4 hostname >/dev/null
t1=$(date +%s%N)
echo "srun_ms|$(( (t1 - t0) / 1000000 ))"
{WAIT_FOR_PLANE}
"""
    job = sbatch(script, "-N4", "--ntasks=4", "--greyhound")
    assert job.wait() == "COMPLETED", job.text()
    assert int(field(job.text(), "srun_ms")) < 5000, job.text()
    run_dir = RUNDIR / job.job_id
    assert [e["kind"] for e in events(run_dir)].count("control_plane_started") == 1
    assert greyhound_lines(job.text()) == [], job.text()


MPI_STEP = """
import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
x = np.ones(4)
y = np.empty_like(x)
for _ in range(5):
    comm.Allreduce(x, y)
comm.Barrier()
"""


def test_the_plane_leaves_no_rings_only_the_training_step_does(sbatch, tmp_path):
    prog = tmp_path / "mpi_step.py"
    prog.write_text(MPI_STEP)
    prog.chmod(0o644)
    # Listed from inside the job: the job's end removes every ring.
    script = f"""#!/bin/bash
{WAIT_FOR_PLANE}
sleep 3   # the plane polls: its allgather, barriers and allreduces go by
echo "before|$(cd "$GREYHOUND_RUN_DIR" && ls -d ring.* 2>/dev/null | sort | tr '\\n' ' ')"
srun --mpi=pmix -n4 {sys.executable} {prog}
sleep 2
echo "after|$(cd "$GREYHOUND_RUN_DIR" && ls -d ring.* 2>/dev/null | sort | tr '\\n' ' ')"
"""
    job = sbatch(script, "-N4", "--ntasks=4", "--greyhound")
    assert job.wait() == "COMPLETED", job.text()
    run_dir = RUNDIR / job.job_id
    assert [e["kind"] for e in events(run_dir)].count("control_plane_started") == 1
    assert field(job.text(), "before").split() == []
    assert field(job.text(), "after").split() == ["ring.0", "ring.1", "ring.2", "ring.3"]


def test_two_steps_one_after_another_share_one_control_plane(sbatch):
    script = f"""#!/bin/bash
srun -n2 true
{WAIT_FOR_PLANE}
srun -n2 true
sleep 1
"""
    job = sbatch(script, "-N2", "--ntasks=2", "--greyhound")
    assert job.wait() == "COMPLETED", job.text()
    run_dir = RUNDIR / job.job_id
    assert [e["kind"] for e in events(run_dir)].count("control_plane_started") == 1
    assert [name for _, name in steps(job.job_id)].count("greyhound") == 1
    assert wait_gone(run_dir) == []


def test_a_job_without_greyhound_starts_no_control_plane(sbatch):
    script = """#!/bin/bash
sleep 4
echo "run_dir|${GREYHOUND_RUN_DIR-}"
echo "planes|$(pgrep -f -c 'greyhound[.]control[.]' -s 0)"
"""
    job = sbatch(script, "-N2")
    assert job.wait() == "COMPLETED", job.text()
    assert field(job.text(), "run_dir") == ""
    assert field(job.text(), "planes") == "0"
    assert "greyhound" not in [name for _, name in steps(job.job_id)]
    assert greyhound_lines(job.text()) == []


def test_the_plane_runs_as_the_jobs_user(cluster):
    nobody = pwd.getpwnam("nobody")
    out_dir = Path(tempfile.mkdtemp(prefix="greyhound-plane-", dir="/tmp"))  # pytest's tmp_path is root's alone
    out_dir.chmod(0o1777)
    (out_dir / "inspect_plane.py").write_text(INSPECT)
    (out_dir / "inspect_plane.py").chmod(0o644)
    script = f"""#!/bin/bash
{WAIT_FOR_PLANE}
{sys.executable} {out_dir}/inspect_plane.py
"""
    try:
        proc = subprocess.run(
            ["runuser", "-u", "nobody", "--", "sbatch", "--parsable", "--wait", "-N2", "--greyhound",
             f"--output={out_dir}/job.out", f"--chdir={out_dir}"],
            input=script, capture_output=True, text=True, timeout=180,
        )
        text = (out_dir / "job.out").read_text()
        assert proc.returncode == 0, proc.stderr + text
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    seen = procs(text)
    assert len([p for p in seen if "greyhound.control.plane" in p["cmd"] and not p["cmd"].startswith("srun")]) == 2
    assert {p["uid"] for p in seen} == {nobody.pw_uid}, seen
    assert greyhound_lines(text) == [], text


def test_without_python_there_is_no_control_plane_and_one_log_line(plugstack_python, sbatch):
    plugstack_python(None)
    job = sbatch("#!/bin/bash\nsleep 3\necho \"run_dir|$GREYHOUND_RUN_DIR\"\n", "-N2", "--greyhound")
    assert job.wait() == "COMPLETED", job.text()
    run_dir = Path(field(job.text(), "run_dir"))
    assert run_dir == RUNDIR / job.job_id    # greyhound still records
    assert events(run_dir) == [] and not (run_dir / "control-plane.log").exists()
    assert "greyhound" not in [name for _, name in steps(job.job_id)]
    assert greyhound_lines(job.text()) == []
    needle = f"greyhound: remote: no python= in plugstack.conf; no control plane for job {job.job_id} "
    logged = [line for log in CLUSTER_LOGS.glob("slurmd-n*.log") for line in log.read_text().splitlines()
              if needle in line]
    assert len(logged) == 1, logged            # the batch step's, once per job


def test_a_python_that_cannot_run_is_one_line_and_the_job_runs_on(plugstack_python, sbatch):
    plugstack_python("/nonexistent/greyhound/python")
    job = sbatch("#!/bin/bash\necho \"run_dir|$GREYHOUND_RUN_DIR\"\nsrun -n1 true && echo done\n", "-N1", "--greyhound")
    assert job.wait() == "COMPLETED", job.text()
    lines = greyhound_lines(job.text())
    assert len(lines) == 1, job.text()
    assert "greyhound: remote: control plane not started for job " + job.job_id in lines[0]
    assert "python=/nonexistent/greyhound/python: No such file or directory" in lines[0]
    # Greyhound itself is still on: the run dir is there, the job ran to its end.
    assert field(job.text(), "run_dir") == str(RUNDIR / job.job_id)
    assert "done" in job.text().splitlines()


def test_a_plane_that_cannot_start_is_one_line_and_the_job_runs_on(sbatch):
    # No srun on the job's PATH: the launcher cannot start the plane's step.
    job = sbatch("#!/bin/bash\n/usr/bin/sleep 2\necho done\n", "-N1", "--greyhound",
                 "--export=ALL,PATH=/nonexistent/bin")
    assert job.wait() == "COMPLETED", job.text()
    lines = greyhound_lines(job.text())
    assert len(lines) == 1, job.text()
    assert lines[0].startswith("greyhound: control plane not started: srun: No such file or directory"), lines
    assert "done" in job.text().splitlines()
