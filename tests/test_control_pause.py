"""The wait for the ranks to park (pause._wait_parked), on a real hooked rank.

A rank still on its way to its gate keeps the wait going past the planned deadline
while it makes calls; a rank that makes none, or one still far off at the cap, ends it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from greyhound.control.pause import PARK_STALL_S
from hook_support import PYTHON, ROOT, base_env, hook_lib, ready_ring

LOOP = str(ROOT / "tests" / "hook_progs" / "mpi_loop.py")

WAIT = """
import json, os, signal, sys, time
from types import SimpleNamespace
from mpi4py import MPI
from greyhound.control.pause import _wait_parked
from greyhound.ring import RingReader

path, pid, ahead, deadline_in, cap_in, stop = sys.argv[1:]
with RingReader(path) as ring:
    target = ring.calls + int(ahead)
    ring.pause(at_call=target)
    if stop == "stop":
        os.kill(int(pid), signal.SIGSTOP)
    t0 = time.time()
    parked = _wait_parked(MPI.COMM_SELF, {0: SimpleNamespace(reader=ring)}, {0: target},
                          beat=lambda: None, stopped=lambda: False,
                          deadline_s=t0 + float(deadline_in), cap_s=t0 + float(cap_in))
    print(json.dumps({"parked": parked, "waited_s": time.time() - t0,
                      "parked_at": ring.parked_at_call, "target": target}), flush=True)
    ring.resume()
"""


@pytest.mark.parametrize(("ahead", "deadline_s", "cap_s", "stop"), [
    (150, 0.3, 20.0, "go"),          # ~1.5 s of calls away: parks after the deadline
    (150, 0.3, 20.0, "stop"),        # stopped: given up once it has made no call for PARK_STALL_S
    (10 ** 6, 0.3, 2.0, "go"),       # calls, but hours away: given up at the cap
])
def test_the_wait_for_a_rank_to_park_lasts_while_it_moves_and_ends_when_it_stops_or_at_the_cap(
        tmp_path, ahead, deadline_s, cap_s, stop):
    rank = subprocess.Popen([PYTHON, LOOP, "1000000", "0.01"], env=base_env(tmp_path, hook_lib()),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        ring = ready_ring(tmp_path)
        proc = subprocess.run([sys.executable, "-c", WAIT, str(ring), str(rank.pid), str(ahead), str(deadline_s),
                               str(cap_s), stop], capture_output=True, text=True, timeout=60,
                              env=base_env(None, PYTHONPATH=str(ROOT)))
        assert proc.returncode == 0, proc.stderr
        got = json.loads(proc.stdout)
    finally:
        rank.send_signal(signal.SIGCONT)
        rank.kill()
        rank.wait(30)
    if stop == "go" and ahead < 1000:
        assert got["parked"] and got["parked_at"] == got["target"], got
        assert got["waited_s"] > deadline_s, got
    elif stop == "stop":
        assert not got["parked"], got
        # No call since the wait began: over PARK_STALL_S after it, the deadline long past.
        assert PARK_STALL_S <= got["waited_s"] < PARK_STALL_S + 3, got
    else:
        assert not got["parked"] and got["parked_at"] is None, got
        assert cap_s <= got["waited_s"] < cap_s + 2, got
