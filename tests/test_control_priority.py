"""The control plane yields the CPU: every thread and its session's autogroup at nice
19, its Redis started before at the job's priority (priority.py). Lowering a
priority cannot be undone, so each test does it in a process of its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

AUTOGROUPS = Path("/proc/sys/kernel/sched_autogroup_enabled").exists() and \
    Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"

# A process with a second thread already running (as Open MPI's are when the plane
# lowers itself), then a thread started after: all of them must end at nice 19.
YIELDING = r"""
import json, os, sys, threading, time
from greyhound.control.priority import yield_cpu

os.setsid()     # a session of its own: its autogroup is this process's alone
go = threading.Event()
early = threading.Thread(target=go.wait)
early.start()
lowered = yield_cpu()
late = threading.Thread(target=go.wait)
late.start()
nice = {t: os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}
print(json.dumps({"lowered": lowered, "nice": nice,
                  "autogroup": open("/proc/self/autogroup").read().split()}))
go.set()
"""


def run_python(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60,
                         check=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    return json.loads(out.stdout)


def test_every_thread_of_the_plane_and_its_autogroup_go_to_nice_19():
    seen = run_python(YIELDING)
    assert len(seen["nice"]) == 3, seen
    assert set(seen["nice"].values()) == {19}, seen
    assert "threads" in seen["lowered"]
    if AUTOGROUPS:
        assert "autogroup" in seen["lowered"]
        assert seen["autogroup"][-1] == "19", seen
    else:
        assert "autogroup" not in seen["lowered"]


def test_the_parent_that_started_it_keeps_its_priority():
    before = os.getpriority(os.PRIO_PROCESS, 0)
    run_python(YIELDING)
    assert os.getpriority(os.PRIO_PROCESS, 0) == before


@pytest.mark.skipif(shutil.which("redis-server") is None,
                    reason="redis-server is not installed: run scripts/setup")
def test_the_jobs_redis_started_before_keeps_the_jobs_priority(tmp_path):
    # The plane's order: Redis first (a session of its own), then the plane yields.
    seen = run_python(r"""
import json, os, sys
from greyhound.control.redis_server import start_redis, stop_redis
from greyhound.control.priority import yield_cpu

os.setsid()
proc, address = start_redis(sys.argv[1], host="127.0.0.1")
try:
    lowered = yield_cpu()
    print(json.dumps({"lowered": lowered, "sid": os.getsid(proc.pid), "pid": proc.pid,
                      "nice": os.getpriority(os.PRIO_PROCESS, proc.pid),
                      "autogroup": open(f"/proc/{proc.pid}/autogroup").read().split(),
                      "answers": address.client().ping()}))
finally:
    stop_redis(proc)
""", str(tmp_path))
    assert seen["sid"] == seen["pid"], seen        # a session of its own
    assert seen["nice"] == 0, seen
    assert seen["autogroup"][-1] == "0", seen
    assert seen["answers"] is True
