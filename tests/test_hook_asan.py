"""The hook built with ASan + UBSan (`make -C spank asan`), under MPI, NCCL and the gate."""

from __future__ import annotations

import numpy as np
import pytest

from greyhound.ring import OP, RingReader, ring_paths
from hook_support import (PYTHON, ROOT, asan_preload, base_env, hook_lib_asan, mpirun,
                          nccl_prog, ready_ring, run)

SAN = {"ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=0",
       "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}


def san_env(run_dir, **extra):
    env = base_env(run_dir, None, **SAN, **extra)
    env["LD_PRELOAD"] = f"{asan_preload()}:{hook_lib_asan()}"
    return env


def assert_clean(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    for marker in ("AddressSanitizer", "runtime error", "LeakSanitizer", "greyhound: hook:"):
        assert marker not in proc.stderr, proc.stderr[-3000:]


@pytest.fixture(scope="module", autouse=True)
def built():
    if not asan_preload().startswith("/"):
        pytest.skip("gcc has no ASan runtime here")
    hook_lib_asan()


def test_mpi_two_ranks_under_sanitizers(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = mpirun(2, [PYTHON, str(ROOT / "tests" / "hook_progs" / "mpi_ops.py"), str(out)],
                  san_env(tmp_path), timeout=120)
    assert_clean(proc)
    for path in ring_paths(tmp_path):
        with RingReader(path) as ring:
            recs = ring.read().records
        assert np.count_nonzero(recs["op"] == OP["AllReduce"]) == 3


def test_nccl_double_with_device_timing_under_sanitizers(tmp_path):
    (tmp_path / "run").mkdir()
    proc = run([str(nccl_prog()), str(tmp_path / "id"), "20"],
               san_env(tmp_path / "run", GREYHOUND_TRACE="on"))
    assert_clean(proc)
    assert proc.stdout == "ok\n"
    (path,) = ring_paths(tmp_path / "run")
    with RingReader(path) as ring:
        assert np.count_nonzero(ring.read().records["op"] == OP["Done"]) >= 160


def test_overflow_and_gate_timeout_under_sanitizers(tmp_path):
    import subprocess

    env = san_env(tmp_path, GREYHOUND_RING_RECORDS="16", GREYHOUND_PAUSE_TIMEOUT_S="0.2")
    proc = subprocess.Popen([PYTHON, str(ROOT / "tests" / "hook_progs" / "mpi_loop.py"), "200",
                             "0.001"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        with RingReader(ready_ring(tmp_path)) as ring:
            ring.pause()
            out, err = proc.communicate(timeout=120)
            counters = ring.counters()
            recs = ring.read().records
    finally:
        proc.kill()
    assert_clean(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    assert out == "200\n"
    # One CommInit (the world), 200 AllReduce and one Pause (the gate held one call and
    # timed out) were written; the 16-record ring keeps the last 16, all AllReduce: the
    # Pause was at one of the first calls (the ring was paused as soon as it was up).
    assert counters["calls"] == 200 and counters["head"] == 1 + 200 + 1
    assert counters["gate_waits"] == counters["gate_timeouts"] == 1
    assert counters["drops"] == counters["head"] - 16
    assert recs["seq"].tolist() == list(range(counters["head"] - 15, counters["head"] + 1))
    assert set(recs["op"].tolist()) == {OP["AllReduce"]}
