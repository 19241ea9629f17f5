"""The NCCL path of the hook against the libnccl test double (no GPU here)."""

from __future__ import annotations

import numpy as np

from greyhound.capture._greyhound_capture import FNV_OFFSET, FNV_PRIME, fnv1a_i32
from greyhound.ring import (F_ASYNC, F_DEVICE_TIMED, F_GROUPED, OP, RingReader, call_records,
                            op_names, ring_paths)
from hook_support import base_env, hook_lib, nccl_prog, run

MASK = (1 << 64) - 1


def fnv_bytes(h: int, data: bytes) -> int:
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & MASK
    return h


# per iteration of nccl_prog: (op, bytes, peer)
ITERATION = [("AllReduce", 1024, -1), ("ReduceScatter", 512, -1), ("AllGather", 256, -1),
             ("Broadcast", 10, 0), ("Broadcast", 1024, 0), ("Reduce", 24, 0),
             ("Send", 32, 0), ("Recv", 32, 0), ("Group", 2, -1)]


def run_prog(tmp_path, run_dir, iterations=2, **env):
    run_dir.mkdir(exist_ok=True)
    proc = run([str(nccl_prog()), str(tmp_path / "id"), str(iterations)],
               base_env(run_dir, hook_lib(), **env))
    assert (proc.returncode, proc.stdout) == (0, "ok\n"), proc.stderr
    (path,) = ring_paths(run_dir)
    with RingReader(path) as ring:
        return proc, ring.read().records, ring.comms(), ring.counters()


def test_nccl_calls_recorded_in_order_with_bytes_and_comm(tmp_path):
    proc, recs, comms, _ = run_prog(tmp_path, tmp_path / "run")
    assert proc.stderr == ""
    world = fnv_bytes(FNV_OFFSET, (tmp_path / "id").read_bytes())
    split = fnv1a_i32(fnv_bytes(FNV_OFFSET, world.to_bytes(8, "little")), [7, 0])
    expected = ([("CommInit", 1, 0)] + ITERATION * 2 + [("CommSplit", 1, 0), ("AllReduce", 10, -1),
                ("CommDestroy", 0, 0), ("CommDestroy", 0, 0)])
    got = list(zip(op_names(recs), recs["size_bytes"].tolist(), recs["peer"].tolist(), strict=True))
    assert got == expected
    comm_of = dict(zip(range(len(recs)), recs["comm_id"].tolist(), strict=True))
    assert {comm_of[i] for i in range(1, 19) if got[i][0] != "Group"} == {world}
    assert comm_of[19] == comm_of[20] == split and recs[19]["req_id"] == world
    ops = recs[np.isin(recs["op"], [OP[n] for n in ("AllReduce", "Send", "Recv", "Broadcast")])]
    assert np.all(ops["flags"] & F_ASYNC) and np.all(ops["source"] == 2)
    p2p = recs[np.isin(recs["op"], [OP["Send"], OP["Recv"]])]
    assert np.all(p2p["flags"] & F_GROUPED)
    table = {int(c["comm_id"]): (int(c["parent_id"]), int(c["size"]), int(c["color"]), int(c["state"]))
             for c in comms}
    assert table == {world: (0, 1, -1, 2), split: (world, 1, 7, 2)}


def test_calls_counter_numbers_every_call_record(tmp_path):
    # The pause gate's call numbers (gh_gate_call in op_begin): one per call record.
    _, recs, _, counters = run_prog(tmp_path, tmp_path / "run", iterations=3)
    assert counters["calls"] == len(call_records(recs)) == 8 * 3 + 1


def test_same_unique_id_same_comm_id_in_two_processes(tmp_path):
    _, a, _, _ = run_prog(tmp_path, tmp_path / "a", iterations=1)
    _, b, _, _ = run_prog(tmp_path, tmp_path / "b", iterations=1)
    assert a[0]["comm_id"] == b[0]["comm_id"] != 0


def test_trace_on_times_device_work_with_cuda_events(tmp_path):
    _, recs, _, counters = run_prog(tmp_path, tmp_path / "run", GREYHOUND_TRACE="on")
    done = recs[recs["op"] == OP["Done"]]
    timed = {int(r["seq"]): r for r in recs if r["op"] in (OP["AllReduce"], OP["Send"], OP["Recv"])}
    assert np.all(done["flags"] & F_DEVICE_TIMED)
    # Every op of both iterations got its DONE (the last op of the run may still be pending).
    by_req = {int(d["req_id"]): d for d in done}
    calls = recs[recs["op"] != OP["Done"]][1:19]          # the two iterations
    ops_in_iterations = [r for r in calls if r["op"] != OP["Group"]]
    assert len(ops_in_iterations) == 16
    for r in ops_in_iterations:
        d = by_req[int(r["seq"])]
        assert d["size_bytes"] == r["size_bytes"] and d["comm_id"] == r["comm_id"]
        assert d["t_start_ns"] == r["t_start_ns"] and d["t_end_ns"] >= d["t_start_ns"]
    # Grouped p2p are closed at ncclGroupEnd: their device time covers the group's launch.
    assert set(timed) <= set(by_req) | {int(recs[recs["op"] == OP["AllReduce"]]["seq"][-1])}
    assert counters["events_skipped"] == 0


def test_trace_on_without_cuda_runtime_says_so_once(tmp_path):
    # Preloading the NCCL double alone into a program without libcudart.
    from hook_support import PYTHON

    # ctypes.CDLL(None) resolves in the global scope, as a linked program does
    # (a handle of libnccl itself would bypass every interposer).
    code = ("import ctypes,sys; n=ctypes.CDLL(None); c=ctypes.c_void_p(); "
            "U=type('U',(ctypes.Structure,),{'_fields_':[('i',ctypes.c_char*128)]}); "
            "uid=U(); n.ncclGetUniqueId(ctypes.byref(uid)); "
            "assert n.ncclCommInitRank(ctypes.byref(c),1,uid,0)==0; "
            "b=(ctypes.c_float*4)(1,2,3,4); o=(ctypes.c_float*4)(); "
            "[n.ncclAllReduce(b,o,ctypes.c_size_t(4),7,0,c,None) for _ in range(3)]; print(list(o))")
    lib = nccl_prog().parent / "libnccl.so.2"
    (tmp_path / "run").mkdir()
    env = base_env(tmp_path / "run", None, GREYHOUND_TRACE="on")
    env["LD_PRELOAD"] = f"{hook_lib()} {lib}"
    proc = run([PYTHON, "-c", code, str(lib)], env)
    assert (proc.returncode, proc.stdout) == (0, "[1.0, 2.0, 3.0, 4.0]\n"), proc.stderr
    assert proc.stderr.count("greyhound: hook:") == 1 and "no CUDA runtime" in proc.stderr
    (path,) = ring_paths(tmp_path / "run")
    with RingReader(path) as ring:
        assert list(op_names(ring.read().records)) == ["CommInit"] + ["AllReduce"] * 3
