"""scripts/cluster as an admin uses it: status, down, up again, and its refusals."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, cluster_shape, shape_args

CLUSTER = str(REPO / "scripts/cluster")
pytestmark = pytest.mark.cluster


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([CLUSTER, *args], capture_output=True, text=True, timeout=300, check=check)


def test_status_says_what_runs(cluster):
    out = run("status").stdout
    for daemon in ("munged", "slurmdbd", "slurmctld", "slurmd-n1", "slurmd-n4"):
        assert any(line.startswith(daemon) and "running (pid" in line for line in out.splitlines()), out
    assert "n4 idle" in out
    assert "greyhound plugin: default=off" in out


def test_down_then_up_again(cluster):
    shape = cluster_shape()
    down = run("down")
    assert "stopped slurmctld" in down.stdout
    assert subprocess.run(["sinfo"], capture_output=True, timeout=60).returncode != 0
    status = run("status").stdout
    assert "running" not in status
    t0 = time.monotonic()
    up = run("up", *shape_args(shape))        # the shape it had: the tests after it use it
    took = time.monotonic() - t0
    print(f"scripts/cluster up from cold: {took:.1f}s")
    assert "up: 4 nodes idle" in up.stdout
    sinfo = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, check=True)
    assert sorted(sinfo.stdout.split()) == sorted(["n1", "idle", "n2", "idle", "n3", "idle", "n4", "idle"])
    again = run("up")  # idempotent: nothing to start
    assert "started" not in again.stdout


def test_up_refuses_a_slurm_conf_it_did_not_write(cluster, tmp_path):
    conf = Path("/etc/slurm/slurm.conf")
    saved = tmp_path / "slurm.conf"
    shutil.copy2(conf, saved)
    try:
        conf.write_text("ClusterName=someone-elses\n")
        proc = run("up", check=False)
        assert proc.returncode != 0
        assert "was not written by scripts/cluster; refusing to overwrite it" in proc.stderr
        assert conf.read_text() == "ClusterName=someone-elses\n"
    finally:
        shutil.copy2(saved, conf)


def test_bad_arguments_get_one_line(cluster):
    for args, message in ((("up", "--nodes", "zero"), "--nodes must be a number"),
                          (("restart",), "unknown command 'restart'"),
                          (("default", "maybe"), "default takes 'on' or 'off'")):
        proc = run(*args, check=False)
        assert proc.returncode != 0
        assert proc.stderr.strip().count("\n") == 0 and message in proc.stderr, proc.stderr
