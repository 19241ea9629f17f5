"""The control plane's launcher waiting for the plane to come up (real processes in
place of srun: the deadline is the launcher's, whatever runs under it)."""

from __future__ import annotations

import os
import subprocess
import time

from greyhound.control import launch


def test_a_start_that_does_not_come_up_in_time_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "START_TIMEOUT_S", 1.0)
    # A requeued job's run dir keeps the first run's address file: it does not count.
    address = tmp_path / "redis.address"
    address.write_text("10.0.0.1:6379\n")
    os.utime(address, (time.time() - 600, time.time() - 600))
    hung = subprocess.Popen(["sleep", "120"])
    t0 = time.monotonic()
    started, ended = launch._wait(hung, address, ending=[])
    assert (started, ended) == (False, "not up within 1 s, stopped")
    assert hung.returncode is not None and time.monotonic() - t0 < 10


def test_a_start_that_comes_up_is_waited_for_to_its_end(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "START_TIMEOUT_S", 1.0)
    address = tmp_path / "redis.address"
    plane = subprocess.Popen(["sh", "-c", f"sleep 0.3; echo 10.0.0.1:6379 > {address}; sleep 2; exit 3"])
    assert launch._wait(plane, address, ending=[]) == (True, "srun exited with status 3")


def test_a_start_that_crashes_is_not_up(tmp_path):
    crashed = subprocess.Popen(["sh", "-c", "exit 139"])
    assert launch._wait(crashed, tmp_path / "redis.address", ending=[]) == (False, "srun exited with status 139")


def _starts(tmp_path, monkeypatch, outcomes: list[str]) -> list[float]:
    """Runs the launcher with each start replaced by a shell running the next of
    ``outcomes``; the times of the starts."""
    monkeypatch.setattr(launch, "RETRY_AFTER_S", 0.2)
    monkeypatch.setenv("GREYHOUND_RUN_DIR", str(tmp_path))
    starts: list[float] = []

    def start_overlap_step(cmd, *, num_nodes, log_fd, env):
        assert env["GREYHOUND_CONTROL_PLANE"] == "1" and num_nodes >= 1
        starts.append(time.monotonic())
        return subprocess.Popen(["sh", "-c", outcomes[len(starts) - 1]], stdout=log_fd, stderr=log_fd)

    monkeypatch.setattr(launch, "start_overlap_step", start_overlap_step)
    assert launch.main() == 0
    return starts


def test_a_plane_that_crashes_is_started_again_after_a_growing_wait(tmp_path, monkeypatch, capsys):
    address = tmp_path / launch.ADDRESS_FILE
    starts = _starts(tmp_path, monkeypatch, ["exit 139", "exit 139", f"echo 10.0.0.1:6379 > {address}; exit 0"])
    assert len(starts) == 3
    assert starts[1] - starts[0] >= 0.2 and starts[2] - starts[1] >= 0.4
    log = (tmp_path / launch.LOG_FILE).read_text()
    assert "start 1 failed (srun exited with status 139); starting again in 0.2 s" in log
    assert "start 2 failed" in log and capsys.readouterr().err == ""


def test_a_plane_that_never_comes_up_costs_one_line_in_the_jobs_output(tmp_path, monkeypatch, capsys):
    starts = _starts(tmp_path, monkeypatch, ["echo boom; exit 139"] * launch.STARTS)
    assert len(starts) == launch.STARTS
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("greyhound: control plane not started:"), err
    assert "the job runs without online detection" in err[0]
