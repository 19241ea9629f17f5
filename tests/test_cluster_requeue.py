"""S4's Slurm step on the real cluster: a job's own, unprivileged user requeues the
running job away from a node (greyhound.slurm_client.requeue_excluding), and Slurm runs
it again elsewhere."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO, ensure_user

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


def test_the_jobs_own_user_requeues_it_away_from_a_node_and_it_runs_again_elsewhere(cluster):
    user = ensure_user("gh-victim")
    # Under /tmp itself: pytest's tmp_path lies below a directory only root may enter.
    tmp_path = Path(tempfile.mkdtemp(prefix="gh-requeue-", dir="/tmp"))
    tmp_path.chmod(0o777)
    (tmp_path / "job.sh").write_text(SCRIPT)
    out = tmp_path / "out.txt"
    job_id = subprocess.run(["runuser", "-u", user.pw_name, "--", "sbatch", "--parsable", f"--output={out}",
                             str(tmp_path / "job.sh")], capture_output=True, text=True, check=True,
                            cwd=tmp_path, timeout=60).stdout.strip()
    try:
        first = _until(lambda: _runs(out), 60)
        assert first and first[0][0] == 0, out.read_text() if out.exists() else "no output"
        bad = first[0][1][0]
        requeue = (f"from greyhound.slurm_client import CommandLineClient\n"
                   f"CommandLineClient().requeue_excluding({job_id!r}, [{bad!r}])\n")
        t0 = time.monotonic()
        proc = subprocess.run(["runuser", "-u", user.pw_name, "--", str(REPO / ".venv/bin/python"), "-I", "-c",
                               requeue], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        # Slurm holds a requeued job back for about two minutes (its begin time).
        runs = _until(lambda: len(_runs(out)) == 2 and _runs(out), 200)
        assert runs, f"not run again within 200 s: {out.read_text()}"
        print(f"requeued and running again after {time.monotonic() - t0:.0f} s")
        assert runs[1][0] == 1 and bad not in runs[1][1] and len(runs[1][1]) == 2, runs
        shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
        assert f"ExcNodeList={bad}" in shown and "Restarts=1" in shown, shown
    finally:
        subprocess.run(["scancel", job_id], check=False)
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_bad_node_name_is_refused_before_anything_changes(cluster):
    from greyhound.errors import InputError
    from greyhound.slurm_client import CommandLineClient

    with pytest.raises(InputError, match="node names are"):
        CommandLineClient().requeue_excluding("1", ["n1;reboot"])
