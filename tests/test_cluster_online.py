"""The job's control plane on the real local cluster: the reference job (DP=2 x PP=4 on
4 nodes) under `sbatch --greyhound`, its control plane started by the plugin, and what
another user can reach of it.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, SlurmJob

pytestmark = pytest.mark.cluster

GREYHOUND = str(REPO / ".venv/bin/greyhound")
RUN_DIR_BASE = Path("/var/tmp/greyhound")


def submit(out: Path, steps: int, *extra: str, env: dict | None = None) -> SlurmJob:
    out.mkdir(mode=0o755, exist_ok=True)
    env = dict(os.environ, GREYHOUND_REPO=str(REPO), OUT_DIR=str(out), **(env or {}))
    proc = subprocess.run(
        ["sbatch", "--parsable", "--greyhound", f"--output={out}/job.out", str(REPO / "examples/gpt_hybrid.sbatch"),
         "--steps", str(steps), "--trace-every", "1000", *extra],
        capture_output=True, text=True, env=env, cwd=out, check=True, timeout=60,
    )
    return SlurmJob(proc.stdout.strip().split(";")[0], out / "job.out")


def status(job_id: str) -> dict:
    proc = subprocess.run([GREYHOUND, "status", "--json", job_id], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def wait_tracking(job_id: str, iterations: int = 15, timeout_s: float = 240) -> dict:
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


def test_another_user_can_neither_read_the_password_nor_use_the_jobs_redis(cluster, tmp_path):
    from greyhound.control.redis_server import ADDRESS_FILE, SECRET_FILE

    nobody = pwd.getpwnam("nobody")
    job = submit(tmp_path / "out", 60)
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
