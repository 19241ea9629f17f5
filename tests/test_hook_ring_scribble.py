"""A ring header scribbled on while the program runs: the program is not hurt.

Any process of the user can write into a ring file (a buggy reader, a stray tool). The
hook indexes the mapping only with its own copies of the layout, made when it created
the ring, so garbage in the header's capacity, offsets and sizes changes nothing it
writes: the program finishes with its results, and the records and communicator
entries land where the layout puts them.
"""

from __future__ import annotations

import concurrent.futures
import json
import mmap
import time

import numpy as np
import pytest

from greyhound.ring import COMM_DTYPE, HEADER_BYTES, HEADER_DTYPE, RECORD_DTYPE, ring_paths
from hook_support import (PYTHON, ROOT, asan_preload, base_env, hook_lib, hook_lib_asan,
                          mpirun)
from test_hook_asan import SAN

PROG = str(ROOT / "tests" / "hook_progs" / "mpi_scribbled.py")
ITERATIONS = 100          # after the scribbling starts; 5 before
# What a reader reads the layout from; the hook must not.
LAYOUT = ("header_bytes", "record_bytes", "capacity", "records_offset", "comms_offset",
          "comm_bytes", "comm_capacity")
COMM_CAPACITY = 256       # GH_COMM_CAPACITY
RECORDS = 65536           # GH_RING_DEFAULT_RECORDS


def scribble(path, fields, rng) -> None:
    """Writes random values into the named header fields of a ring file."""
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), HEADER_BYTES) as m:
        hdr = np.ndarray((), dtype=HEADER_DTYPE, buffer=m)
        for name in fields:
            dt = HEADER_DTYPE.fields[name][0]
            hdr[name] = rng.integers(0, np.iinfo(dt).max, dtype=dt, endpoint=True)
        del hdr


def header(path) -> np.void:
    return np.fromfile(path, dtype=HEADER_DTYPE, count=1)[0]


def run_scribbled(tmp_path, fields, env):
    """Runs the program on 2 ranks and scribbles on both rings from its 6th iteration on."""
    rng = np.random.default_rng(7)
    run_dir, out = tmp_path / "run", tmp_path / "out"
    run_dir.mkdir()
    out.mkdir()
    ready, go = tmp_path / "ready", tmp_path / "go"
    rounds, heads = 0, {}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        job = pool.submit(mpirun, 2, [PYTHON, PROG, str(out), str(ready), str(go),
                                      str(ITERATIONS)], env, 180)
        while not ready.exists() and not job.done():
            time.sleep(0.005)
        paths = ring_paths(run_dir)
        if not job.done():
            assert [p.name for p in paths] == ["ring.0", "ring.1"]
            heads = {p: int(header(p)["head"]) for p in paths}
        # Scribble, let the program go on, and keep scribbling until it ends.
        while not job.done():
            for p in paths:
                scribble(p, fields, rng)
            rounds += 1
            go.touch()
            time.sleep(0.002)
        proc = job.result()
    return proc, out, paths, rounds, heads


def assert_results(out, iterations=5 + ITERATIONS):
    for rank in (0, 1):
        got = json.loads((out / f"out.{rank}.json").read_text())
        # 2 ranks: the duplicate sums 1 + 1, the world 0 + 1, the neighbour is the other.
        assert got == {"iterations": iterations, "dup": 2.0 * iterations,
                       "world": 1.0 * iterations, "neighbour": float(1 - rank) * iterations}


def assert_writes_where_the_layout_puts_them(path, head_before):
    """Records and communicator entries at the hook's own offsets, not the header's."""
    hdr = header(path)
    comms_offset = HEADER_BYTES
    records_offset = comms_offset + COMM_CAPACITY * COMM_DTYPE.itemsize
    head = int(hdr["head"])
    assert head > head_before + 4 * ITERATIONS            # it kept recording
    comms = np.fromfile(path, dtype=COMM_DTYPE, count=COMM_CAPACITY, offset=comms_offset)
    num_comms = int(hdr["num_comms"])
    # The world and one duplicate per iteration, each written in its slot.
    assert num_comms == 1 + 5 + ITERATIONS
    assert np.all(comms["state"][:num_comms] != 0) and np.all(comms["state"][num_comms:] == 0)
    assert (comms["state"][:num_comms] == 2).sum() == 5 + ITERATIONS   # duplicates, freed
    records = np.fromfile(path, dtype=RECORD_DTYPE, count=RECORDS, offset=records_offset)
    assert records["seq"][(head - 1) % RECORDS] == head
    assert np.all(records["seq"][:head] == np.arange(1, head + 1))


def test_scribbled_layout_leaves_program_and_ring_intact(tmp_path):
    proc, out, paths, rounds, heads = run_scribbled(tmp_path, LAYOUT,
                                                    base_env(tmp_path / "run", hook_lib()))
    # Before the hook kept its own layout: SIGSEGV at the first communicator described
    # after the scribbling (the comm table at a garbage offset).
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert rounds > 0
    assert_results(out)
    assert "greyhound" not in proc.stderr
    for p in paths:
        assert_writes_where_the_layout_puts_them(p, heads[p])


def test_scribbled_counters_too(tmp_path):
    # num_comms is a shared counter (the next free table slot): garbage there sends the
    # hook's index out of its table unless it is checked against its own capacity.
    proc, out, _, rounds, _ = run_scribbled(tmp_path, (*LAYOUT, "num_comms", "head"),
                                            base_env(tmp_path / "run", hook_lib()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert rounds > 0
    assert_results(out)


def test_scribbled_header_under_sanitizers(tmp_path):
    if not asan_preload().startswith("/"):
        pytest.skip("gcc has no ASan runtime here")
    env = base_env(tmp_path / "run", None, **SAN)
    env["LD_PRELOAD"] = f"{asan_preload()}:{hook_lib_asan()}"
    proc, out, _, rounds, _ = run_scribbled(tmp_path, (*LAYOUT, "num_comms", "head"), env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert rounds > 0
    assert_results(out)
    for marker in ("AddressSanitizer", "runtime error"):
        assert marker not in proc.stderr, proc.stderr[-3000:]
