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
