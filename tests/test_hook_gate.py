"""The pause gate: it holds a rank's next call, lets it go on resume or timeout."""

from __future__ import annotations

import subprocess
import time

import numpy as np

from greyhound.ring import F_GATE_TIMEOUT, OP, RingReader
from hook_support import PYTHON, ROOT, base_env, hook_lib, ready_ring

LOOP = str(ROOT / "tests" / "hook_progs" / "mpi_loop.py")


def wait_for(pred, timeout=20.0, step=0.01):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(step)
    raise AssertionError("condition not reached in time")


def start_loop(run_dir, n, nap, **env):
    return subprocess.Popen([PYTHON, LOOP, str(n), str(nap)], env=base_env(run_dir, hook_lib(), **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_pause_holds_and_resume_releases(tmp_path):
    proc = start_loop(tmp_path, 400, 0.002)
    try:
        path = ready_ring(tmp_path)
        with RingReader(path) as ring:
            wait_for(lambda: ring.head > 5)
            ring.pause()
            wait_for(lambda: ring.parked == 1)
            held = ring.head
            time.sleep(0.4)
            assert ring.head == held and ring.parked == 1   # nothing went through
            ring.resume()
            wait_for(lambda: ring.parked == 0 and ring.head > held)
            out, err = proc.communicate(timeout=60)
            recs = ring.read().records
            counters = ring.counters()
    finally:
        proc.kill()
    assert (proc.returncode, out, err) == (0, "400\n", "")
    pauses = recs[recs["op"] == OP["Pause"]]
    assert len(pauses) == 1 and not pauses[0]["flags"] & F_GATE_TIMEOUT
    assert (pauses[0]["t_end_ns"] - pauses[0]["t_start_ns"]) / 1e9 >= 0.4
    assert counters["gate_waits"] == 1 and counters["gate_timeouts"] == 0
    assert np.count_nonzero(recs["op"] == OP["AllReduce"]) == 400


def test_gate_timeout_lets_calls_go_and_is_recorded(tmp_path):
    proc = start_loop(tmp_path, 300, 0.002, GREYHOUND_PAUSE_TIMEOUT_S="0.3")
    try:
        path = ready_ring(tmp_path)
        with RingReader(path) as ring:
            assert ring.info.pause_timeout_s == 0.3
            wait_for(lambda: ring.head > 5)
            ring.pause()                        # and never resumed: the agent "died"
            out, err = proc.communicate(timeout=60)
            recs = ring.read().records
            counters = ring.counters()
            assert ring.parked == 0
    finally:
        proc.kill()
    assert (proc.returncode, out, err) == (0, "300\n", "")
    pauses = recs[recs["op"] == OP["Pause"]]
    # One timeout: the same pause epoch is not obeyed again by later calls.
    assert len(pauses) == 1 and pauses[0]["flags"] & F_GATE_TIMEOUT
    held = (pauses[0]["t_end_ns"] - pauses[0]["t_start_ns"]) / 1e9
    assert 0.3 <= held < 1.0
    assert counters["gate_timeouts"] == 1
