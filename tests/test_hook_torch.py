"""torch.distributed (gloo) recorded through sitecustomize, with no change to the program."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from greyhound.capture._greyhound_capture import FNV_OFFSET, fnv1a_i32
from greyhound.ring import (F_ASYNC, F_ERROR, F_GROUPED, OP, RingReader, call_records, op_names,
                            ring_paths)
from hook_support import PYTHON, ROOT, base_env, free_port, hook_lib, run, run_torch_pair

torch = pytest.importorskip("torch")
PROG = str(ROOT / "tests" / "hook_progs" / "torch_ops.py")
CAPTURE = ROOT / "greyhound" / "capture"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    env = base_env(run_dir, hook_lib(), PYTHONPATH=str(CAPTURE))
    with_capture, outs = run_torch_pair(PROG, tmp_path_factory.mktemp("out"), env)
    plain, _ = run_torch_pair(PROG, tmp_path_factory.mktemp("out"), base_env(None))
    return run_dir, with_capture, plain, outs


def test_results_identical_and_nothing_printed(pair):
    _, with_capture, plain, outs = pair
    assert with_capture == plain
    assert with_capture[1]["all_reduce"] == [1.0, 3.0, 5.0, 7.0]
    assert all("greyhound" not in out + err for out, err in outs)


EXPECTED = [  # (op, bytes, peer of rank 0, peer of rank 1, flags)
    ("AllReduce", 16, -1, -1, 0),
    ("ReduceScatter", 32, -1, -1, 0),
    ("AllGather", 24, -1, -1, 0),
    ("AllGather", 16, -1, -1, 0),
    ("Broadcast", 20, 1, 1, 0),
    ("Send|Recv", 48, 1, 0, 0),
    ("AllReduce", 8, -1, -1, F_ASYNC),
    ("Wait", 0, -1, -1, 0),
    ("Send", 12, 1, 0, F_ASYNC | F_GROUPED),
    ("Recv", 12, 1, 0, F_ASYNC | F_GROUPED),
    ("Group", 2, -1, -1, 0),
    ("Wait", 0, -1, -1, 0),
    ("Wait", 0, -1, -1, 0),
    ("Barrier", 0, -1, -1, 0),
    ("AllReduce", 4, -1, -1, 0),
]


@pytest.mark.parametrize("rank", [0, 1])
def test_every_call_recorded(pair, rank):
    run_dir = pair[0]
    assert [p.name for p in ring_paths(run_dir)] == ["ring.0", "ring.1"]
    with RingReader(run_dir / f"ring.{rank}") as ring:
        recs = ring.read().records
        comms = ring.comms()
    recs = recs[recs["op"] != OP["CommInit"]]
    got = list(zip(op_names(recs), recs["size_bytes"].tolist(), recs["peer"].tolist(),
                   (recs["flags"] & (F_ASYNC | F_GROUPED)).tolist(), strict=True))
    want = [(op.split("|")[rank] if "|" in op else op, n, p0 if rank == 0 else p1, f)
            for op, n, p0, p1, f in EXPECTED]
    assert got == want
    world = fnv1a_i32(fnv1a_i32(FNV_OFFSET, [0, 1]), [0])
    pair_id = fnv1a_i32(fnv1a_i32(FNV_OFFSET, [0, 1]), [1])   # same members, 2nd group
    calls = recs[~((recs["op"] == OP["Wait"]) | (recs["op"] == OP["Group"]))]
    assert calls["comm_id"].tolist() == [world] * (len(calls) - 1) + [pair_id]
    assert set(recs["source"].tolist()) == {3}
    # Each async op's Wait names it.
    assert recs[7]["req_id"] == recs[6]["req_id"] != 0
    assert sorted(recs["req_id"][11:13].tolist()) == sorted(recs["req_id"][8:10].tolist())
    assert {(int(c["comm_id"]), int(c["size"]), int(c["rank"])) for c in comms} == {
        (world, 2, rank), (pair_id, 2, rank)}


@pytest.mark.parametrize("rank", [0, 1])
def test_calls_counter_numbers_every_call_record(pair, rank):
    # The capture numbers its calls as the C hook does (gh_py_begin_call, a batch
    # gh_py_begin_calls(n), the C fast path too): one number per call record, none
    # for Waits, Groups or communicator records.
    with RingReader(pair[0] / f"ring.{rank}", publish=False) as ring:
        recs = ring.read().records
        assert ring.calls == len(call_records(recs)) == 11


def test_no_greyhound_environment_is_a_no_op(tmp_path):
    code = ("import torch.distributed as d, sys; "
            "print(hasattr(d.all_reduce, '__greyhound_wrapped__'), "
            "'_greyhound_capture' in sys.modules)")
    env = base_env(None, None, PYTHONPATH=str(CAPTURE))
    proc = run([PYTHON, "-c", code], env)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "False False\n", "")
    env = base_env(tmp_path, hook_lib(), PYTHONPATH=str(CAPTURE))
    proc = run([PYTHON, "-c", code], env)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "True True\n", "")
    assert list(tmp_path.iterdir()) == []   # importing torch opens no ring


def test_chains_the_sitecustomize_it_shadows(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITE'] = 'ran'\n")
    env = base_env(None, None, PYTHONPATH=f"{CAPTURE}:{other}")
    proc = run([PYTHON, "-c", "import os, sitecustomize; print(os.environ.get('OTHER_SITE'), "
                "sitecustomize.__file__)"], env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"ran {CAPTURE / 'sitecustomize.py'}\n"


def test_pause_gate_holds_captured_calls(tmp_path):
    # The capture obeys the same gate as the C hook: set, the next all_reduce waits.
    import time

    from hook_support import ready_ring

    proc = subprocess.Popen([PYTHON, str(ROOT / "tests" / "hook_progs" / "torch_loop.py"),
                             "300", "0.002", str(free_port())],
                            env=base_env(tmp_path, hook_lib(), PYTHONPATH=str(CAPTURE)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with RingReader(ready_ring(tmp_path)) as ring:
            deadline = time.monotonic() + 60
            while ring.head < 5 and time.monotonic() < deadline:
                time.sleep(0.01)
            ring.pause()
            while ring.parked != 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            held = ring.head
            time.sleep(0.3)
            assert ring.parked == 1 and ring.head == held      # nothing went through
            ring.resume()
            out, err = proc.communicate(timeout=60)
            recs = ring.read().records
    finally:
        proc.kill()
    assert (proc.returncode, out, err) == (0, "300\n", "")
    assert np.count_nonzero(recs["op"] == OP["AllReduce"]) == 300
    pauses = recs[recs["op"] == OP["Pause"]]
    assert len(pauses) == 1 and (pauses[0]["t_end_ns"] - pauses[0]["t_start_ns"]) >= 0.3e9


FASTPATH = ROOT / "spank" / "build" / "python" / "_greyhound_fastpath.abi3.so"


def run_paths(run_dir, **extra):
    run_dir.mkdir()
    proc = run([PYTHON, str(ROOT / "tests" / "hook_progs" / "torch_paths.py"), str(free_port())],
               base_env(run_dir, hook_lib(), PYTHONPATH=str(CAPTURE), **extra))
    assert proc.returncode == 0, proc.stderr
    (path,) = ring_paths(run_dir)   # ring.pid<pid>: no launcher rank here
    with RingReader(path) as ring:
        recs = ring.read().records
    return proc.stdout, recs[recs["op"] != OP["CommInit"]]


def test_c_fast_path_records_what_the_python_wrapper_records(tmp_path):
    # scripts/setup builds the fast path (make -C spank); the 2 us target rests on it.
    assert FASTPATH.is_file(), f"{FASTPATH} is not built (make -C spank)"
    fast_out, fast = run_paths(tmp_path / "fast")
    py_out, py = run_paths(tmp_path / "python", GREYHOUND_CAPTURE_FASTPATH="0")
    assert fast_out.splitlines()[-1].startswith("FastCall ")
    assert py_out.splitlines()[-1].startswith("function ")
    # The same results and the same error from torch, either way.
    assert fast_out.splitlines()[0] == py_out.splitlines()[0] == "raised TypeError"
    assert fast_out.splitlines()[-1].split(" ", 1)[1] == py_out.splitlines()[-1].split(" ", 1)[1]
    fields = ["op", "flags", "peer", "size_bytes", "comm_id"]
    assert [tuple(r[f] for f in fields) for r in fast] == [tuple(r[f] for f in fields) for r in py]
    names = op_names(fast).tolist()
    assert names == ["AllReduce"] * 6 + ["Broadcast"] * 2 + ["AllGather", "ReduceScatter", "AllReduce",
                                                             "Wait", "Barrier", "AllReduce"]
    assert fast["size_bytes"].tolist()[:6] == [16, 16, 16, 16, 16, 24]
    assert fast["flags"][-1] & F_ERROR and not (fast["flags"][:-1] & F_ERROR).any()
    assert (fast["t_end_ns"] >= fast["t_start_ns"]).all()
    assert len(set(fast["seq"].tolist())) == len(fast)
