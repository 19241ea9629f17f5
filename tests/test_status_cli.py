"""`greyhound status` on a job whose Redis is gone: ended well, or died."""

from __future__ import annotations

import shutil
import threading

import pytest

from greyhound import status_cli
from greyhound.control.events import append_event
from greyhound.control.redis_server import start_redis, stop_redis

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed: run scripts/setup")


@pytest.fixture
def ended_job(tmp_path):
    """A run directory whose plane started, then whose Redis went away (the job's end)."""
    run_dir = tmp_path / "4242"
    run_dir.mkdir()
    proc, _ = start_redis(run_dir, host="127.0.0.1")
    append_event(run_dir, "control_plane_started", master_node="n1", nodes=["n1"], poll_s=0.5, pid=1)
    stop_redis(proc)
    return tmp_path, run_dir


def test_a_stopped_event_written_just_after_redis_went_is_seen_as_stopped(ended_job):
    # Slurm signals Redis and the master together: Redis is gone first, the master's
    # last event follows (it has KillWait to write it).
    rundir, run_dir = ended_job
    late = threading.Timer(0.5, append_event, (run_dir, "control_plane_stopped"))
    late.start()
    try:
        shown = status_cli.job_status("4242", rundir=rundir)
    finally:
        late.join()
    assert shown["control_plane"] == "stopped", shown
    assert shown["events"][-1]["kind"] == "control_plane_stopped"


def test_a_plane_that_never_says_it_stopped_is_failed_after_the_grace(ended_job, monkeypatch):
    rundir, _ = ended_job
    monkeypatch.setattr(status_cli, "STOP_GRACE_S", 0.3)
    shown = status_cli.job_status("4242", rundir=rundir)
    assert shown["control_plane"] == "failed" and "does not answer" in shown["why"], shown


def test_a_job_requeued_by_s4_says_so_until_its_next_run_starts_its_plane(ended_job):
    rundir, run_dir = ended_job
    append_event(run_dir, "requeued", nodes=["n3"], step=188, why="link fail-slow at n3")
    append_event(run_dir, "control_plane_stopped")
    shown = status_cli.job_status("4242", rundir=rundir)
    assert shown["control_plane"] == "requeued", shown
    assert shown["why"].startswith("S4 requeued the job without n3 after step 188"), shown
    append_event(run_dir, "control_plane_started", master_node="n1", nodes=["n1"], poll_s=0.5, pid=2)
    append_event(run_dir, "control_plane_stopped")
    assert status_cli.job_status("4242", rundir=rundir)["control_plane"] == "stopped"


def test_a_plane_whose_master_has_not_written_yet_is_starting_not_failed(tmp_path):
    run_dir = tmp_path / "4243"
    run_dir.mkdir()
    proc, _ = start_redis(run_dir, host="127.0.0.1")
    try:
        shown = status_cli.job_status("4243", rundir=tmp_path)
    finally:
        stop_redis(proc)
    assert shown["control_plane"] == "starting", shown
