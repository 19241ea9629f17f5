"""The hook's timestamps: CLOCK_MONOTONIC ns whether read from the TSC or clock_gettime.

tests/hook_progs/mpi_clock.c brackets each MPI_Allreduce with clock_gettime readings;
every record the hook wrote for it must lie inside its bracket (give or take the
tolerance of the TSC line), convert to the bracket's CLOCK_REALTIME, never go back
on a rank, and overlap the same collective on the other rank.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import require
from greyhound.ring import HOOK_TSC, OP, RingReader
from hook_support import ROOT, base_env, build_dir, hook_lib, mpirun

TOL_NS = 10_000           # the TSC line is within ~100 ns here; 10 us leaves room for load


def realtime_offset_ns() -> int:
    """CLOCK_REALTIME minus CLOCK_MONOTONIC now: it moves when the wall clock is stepped
    (a time daemon, a VM's host: +0.5 ms every 100 ms once here), and the header's
    epoch, taken when the ring was made, moves with it no more."""
    import time

    return time.clock_gettime_ns(time.CLOCK_REALTIME) - time.clock_gettime_ns(time.CLOCK_MONOTONIC)
CALLS, NAP_EVERY, NAP_US = 3000, 20, 5000   # ~1.5 s: the line is refitted ~10 times


def tsc_expected() -> bool | None:
    """Whether the hook should use the TSC here; None when it cannot be told from Python."""
    if platform.machine() != "x86_64":
        return False
    try:
        source = Path("/sys/devices/system/clocksource/clocksource0/current_clocksource"
                      ).read_text().strip()
    except OSError:
        return None
    if source != "tsc":
        return False
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("flags")), "").split()
    return True if {"constant_tsc", "nonstop_tsc"} <= set(flags) else None


@pytest.fixture(scope="module")
def clock_prog() -> Path:
    require(None if shutil.which("mpicc") else "mpicc (Open MPI) is not installed: run scripts/setup")
    exe = build_dir() / "mpi_clock"
    subprocess.run(["mpicc", "-O1", "-g", "-o", str(exe),
                    str(ROOT / "tests" / "hook_progs" / "mpi_clock.c")], check=True)
    return exe


@pytest.mark.parametrize("clock", ["auto", "monotonic"])
def test_timestamps_follow_the_system_clocks(tmp_path, clock_prog, clock):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = base_env(run_dir, hook_lib(), GREYHOUND_CLOCK=clock)
    offset_before = realtime_offset_ns()
    proc = mpirun(2, ["sh", "-c", f'exec {clock_prog} {tmp_path}/rows.$OMPI_COMM_WORLD_RANK '
                      f'{CALLS} {NAP_EVERY} {NAP_US}'], env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    # However far the wall clock was stepped while the program ran, the epoch is off by.
    real_tol_ns = TOL_NS + abs(realtime_offset_ns() - offset_before)
    starts, ends = [], []
    for rank in (0, 1):
        rows = np.loadtxt(tmp_path / f"rows.{rank}", dtype=np.int64)
        with RingReader(run_dir / f"ring.{rank}", publish=False) as ring:
            recs = ring.read().records
            info, used = ring.info, ring.clock
        if clock == "monotonic":
            assert used == "monotonic"
        elif tsc_expected() is not None:
            assert used == ("tsc" if tsc_expected() else "monotonic")
        calls = recs[recs["op"] == OP["AllReduce"]]
        assert len(calls) == CALLS
        t0 = calls["t_start_ns"].astype(np.int64)
        t1 = calls["t_end_ns"].astype(np.int64)
        # Inside the CLOCK_MONOTONIC bracket of the call.
        assert np.all(t0 >= rows[:, 0] - TOL_NS), np.min(t0 - rows[:, 0])
        assert np.all(t1 <= rows[:, 1] + TOL_NS), np.max(t1 - rows[:, 1])
        # Converted with the header's epoch, inside the CLOCK_REALTIME bracket.
        real0 = np.round(np.asarray(info.unix_seconds(t0)) * 1e9).astype(np.int64)
        real1 = np.round(np.asarray(info.unix_seconds(t1)) * 1e9).astype(np.int64)
        assert np.all(real0 >= rows[:, 2] - real_tol_ns), (np.min(real0 - rows[:, 2]), real_tol_ns)
        assert np.all(real1 <= rows[:, 3] + real_tol_ns), (np.max(real1 - rows[:, 3]), real_tol_ns)
        # Never back on a rank: each call starts after the previous one ended (in
        # seq order), and no record (CommInit, written at first use, included)
        # ends before it starts.
        assert np.all(np.diff(np.stack([t0, t1], 1).ravel()) >= 0)
        assert np.all(recs["t_end_ns"] >= recs["t_start_ns"])
        starts.append(t0)
        ends.append(t1)
    # One host, one clock: an allreduce cannot end on one rank before it began on the other.
    assert np.all(ends[0] >= starts[1] - TOL_NS)
    assert np.all(ends[1] >= starts[0] - TOL_NS)


def test_ring_flag_constant_matches_the_header():
    text = (ROOT / "spank" / "hook" / "gh_ring.h").read_text()
    assert f"#define GH_HOOK_TSC 0x{HOOK_TSC:x}u" in text


def _clock_threads(sanitize: bool) -> Path:
    from hook_support import HOOK_DIR, _cc

    exe = build_dir() / ("clock_threads_san" if sanitize else "clock_threads")
    flags = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer"] \
        if sanitize else ["-O2", "-g"]
    _cc([*flags, "-std=gnu11", "-Wall", "-Wextra", "-Werror", f"-I{HOOK_DIR}", "-o", str(exe),
         str(ROOT / "tests" / "hook_progs" / "clock_threads.c"), "-lpthread"])
    return exe


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "asan-ubsan"])
@pytest.mark.parametrize("allow_tsc", [1, 0], ids=["auto", "monotonic"])
def test_clock_read_by_threads_while_refitted(sanitize, allow_tsc):
    # 4 threads read the clock for 1 s while the line is refitted ~8 times under
    # them (the seqlock, the refit try-lock and the per-thread floor at work).
    exe = _clock_threads(sanitize)
    env = {"UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
           "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1"}
    proc = subprocess.run([str(exe), "4", "1.0", str(allow_tsc)], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    words = proc.stdout.split()
    got = dict(zip(words[::2], (int(w) for w in words[1::2]), strict=True))
    assert got["readings"] > 10_000
    assert got["backwards"] == 0                  # never back on a thread
    assert got["early"] <= TOL_NS and got["late"] <= TOL_NS
    if not allow_tsc:
        assert got["tsc"] == 0 and got["early"] <= 0 and got["late"] <= 0
    elif tsc_expected() is not None:
        assert got["tsc"] == int(tsc_expected())


def test_forked_child_gets_its_own_ring_and_a_consistent_clock(tmp_path):
    from hook_support import _cc, run

    exe = build_dir() / "py_api_fork"
    _cc(["-O1", "-g", "-Wall", "-Wextra", "-Werror", "-o", str(exe),
         str(ROOT / "tests" / "hook_progs" / "py_api_fork.c"), "-ldl"])
    proc = run([str(exe), "200"], base_env(tmp_path, hook_lib(), RANK="0"))
    assert (proc.returncode, proc.stderr) == (0, "")
    rows = np.array([[int(x) for x in ln.split()] for ln in proc.stdout.splitlines()])
    parent, child = int(rows[0, 0]), int(rows[200, 0])
    assert parent != child and len(rows) == 600
    rings = {p.name: p for p in tmp_path.iterdir()}
    assert set(rings) == {"ring.0", f"ring.0.{child}"}
    for name, pid, comm in (("ring.0", parent, 7), (f"ring.0.{child}", child, 8)):
        with RingReader(rings[name], publish=False) as ring:
            recs = ring.read().records
            assert ring.info.pid == pid
        mine = rows[rows[:, 0] == pid]
        assert recs["comm_id"].tolist() == [comm] * len(mine)      # nobody else's records
        t0, t1 = recs["t_start_ns"].astype(np.int64), recs["t_end_ns"].astype(np.int64)
        assert np.all(t0 >= mine[:, 2] - TOL_NS) and np.all(t1 <= mine[:, 3] + TOL_NS)
        assert np.all(np.diff(np.stack([t0, t1], 1).ravel()) >= 0)
