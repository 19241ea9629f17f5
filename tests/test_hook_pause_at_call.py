"""The consistent pause: every rank held before the same future call number.

DESIGN.md, Validation: a rank blocked inside a call (a receive waiting for a parked
peer) can never reach the gate, so "park each rank at its next call" can deadlock the
pause itself; parking every rank before the first call of the same future iteration
cannot. The hook numbers each rank's communication calls (RingReader.calls) and
holds a rank before the call numbered gate_at_call (RingReader.pause(at_call=...)).
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import numpy as np
import pytest

from greyhound.errors import InputError
from greyhound.ring import CALL_OPS, OP, RingReader, call_records
from hook_support import (PYTHON, ROOT, base_env, free_port, hook_lib, mpirun_cmd, ready_ring,
                          ready_rings)

LOOP = str(ROOT / "tests" / "hook_progs" / "mpi_loop.py")
RING_ITER = str(ROOT / "tests" / "hook_progs" / "mpi_ring_iter.py")
TORCH_RING_ITER = str(ROOT / "tests" / "hook_progs" / "torch_ring_iter.py")
CAPTURE = ROOT / "greyhound" / "capture"
# Both ring programs: a Barrier (call 1), then 3 communication calls per iteration.
FIRST_CALL, CALLS_PER_ITERATION = 2, 3


def wait_for(pred, timeout=30.0, step=0.005):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(step)
    raise AssertionError("condition not reached in time")


def boundary_after(calls: int, margin: int = 2) -> tuple[int, int]:
    """(call number, iteration) of the first iteration starting more than margin
    iterations after call number `calls`: what a master would pick from the trackers'
    period and phase."""
    i = max(0, -(-(calls + margin * CALLS_PER_ITERATION - FIRST_CALL) // CALLS_PER_ITERATION))
    return FIRST_CALL + CALLS_PER_ITERATION * i, i


def nth_call_record(records: np.ndarray, k: int) -> tuple[int, np.void]:
    """(index in records, record) of the k-th communication-call record (k from 1)."""
    idx = np.flatnonzero(np.isin(records["op"], list(CALL_OPS)))
    return int(idx[k - 1]), records[idx[k - 1]]


# ---- one rank: the gate's rule ----------------------------------------------------

def test_a_single_rank_is_held_before_exactly_the_call_asked(tmp_path):
    proc = subprocess.Popen([PYTHON, LOOP, "2000", "0.001"], env=base_env(tmp_path, hook_lib()),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with RingReader(ready_ring(tmp_path)) as ring:
            wait_for(lambda: ring.calls > 5)
            assert ring.parked_at_call is None
            target = ring.calls + 40
            epoch = ring.pause(at_call=target)
            wait_for(lambda: ring.parked == 1)
            # Held before call `target`: it has begun (numbered), not been made.
            assert (ring.parked_at_call, ring.calls) == (target, target)
            head = ring.head
            time.sleep(0.3)
            assert (ring.head, ring.calls, ring.parked) == (head, target, 1)
            first = ring.read().records
            assert len(call_records(first)) == target - 1
            ring.resume()
            wait_for(lambda: ring.parked == 0 and ring.calls > target)
            assert ring.parked_at_call is None
            # A number already passed holds the next communication call.
            passed = ring.pause(at_call=1)
            wait_for(lambda: ring.parked == 1)
            held_at = ring.parked_at_call
            assert held_at == ring.calls > target
            ring.resume()
            out, err = proc.communicate(timeout=120)
            recs = ring.read().records
    finally:
        proc.kill()
    assert (proc.returncode, out, err) == (0, "2000\n", "")
    recs = np.concatenate([first, recs])
    pauses = np.flatnonzero(recs["op"] == OP["Pause"])
    assert recs["req_id"][pauses].tolist() == [epoch, passed]
    # Each Pause record sits right before the call it held, in the ring's call order.
    for p, k in zip(pauses, (target, held_at), strict=True):
        assert nth_call_record(recs, k)[0] == p + 1
    assert len(call_records(recs)) == 2000


def test_pause_rejects_what_is_not_a_call_number(tmp_path):
    proc = subprocess.Popen([PYTHON, LOOP, "5"], env=base_env(tmp_path, hook_lib()),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proc.communicate(timeout=60)
        with RingReader(ready_ring(tmp_path)) as ring:
            for bad in (0, -3, 1.5, True, "7", 1 << 63):
                with pytest.raises(InputError, match="is not a call number"):
                    ring.pause(at_call=bad)
            assert int(ring._hdr["gate"]) == 0
    finally:
        proc.kill()


# ---- several MPI ranks: the deadlock "next call" risks, and the consistent pause ---

def test_mpi_ranks_pause_at_the_same_future_iteration(tmp_path):
    ranks, iterations = 3, 250
    run_dir, out_dir = tmp_path / "run", tmp_path / "out"
    run_dir.mkdir()
    out_dir.mkdir()
    env = base_env(run_dir, hook_lib(), GREYHOUND_PAUSE_TIMEOUT_S="60")
    proc = subprocess.Popen(mpirun_cmd(ranks, [PYTHON, RING_ITER, str(out_dir), str(iterations),
                                               "0.02"], env),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rings: list[RingReader] = []
    try:
        rings = [RingReader(p) for p in ready_rings(run_dir, ranks)]
        assert [r.info.rank for r in rings] == list(range(ranks))
        wait_for(lambda: min(r.calls for r in rings) > FIRST_CALL + 3 * CALLS_PER_ITERATION)

        # 1. "The next call": rank 0 parks before its send; the others are inside a
        # receive of the token rank 0 now never sends, out of the gate's reach.
        for r in rings:
            r.pause()
        wait_for(lambda: rings[0].parked == 1)
        stuck = [r.calls for r in rings]
        time.sleep(0.5)
        assert [r.calls for r in rings] == stuck
        assert sum(r.parked for r in rings) < ranks, "every rank parked: no receive in flight?"
        for r in rings:
            r.resume()

        # 2. The same future call number: every rank parks before it, none is left
        # inside a call (all its earlier calls are recorded), and nothing moves.
        wait_for(lambda: all(r.parked == 0 for r in rings))
        target, iteration = boundary_after(max(r.calls for r in rings))
        epochs = [r.pause(at_call=target) for r in rings]
        wait_for(lambda: all(r.parked == 1 for r in rings))
        assert [r.parked_at_call for r in rings] == [target] * ranks
        assert [r.calls for r in rings] == [target] * ranks
        heads = [r.head for r in rings]
        time.sleep(0.3)
        assert [r.head for r in rings] == heads and all(r.parked == 1 for r in rings)
        before = [r.read().records for r in rings]
        assert [len(call_records(b)) for b in before] == [target - 1] * ranks
        for r in rings:
            r.resume()
        out, err = proc.communicate(timeout=180)
        after = [r.read().records for r in rings]
        calls = [r.calls for r in rings]
    finally:
        proc.kill()
        for r in rings:
            r.close()
    assert proc.returncode == 0, err[-3000:]
    results = [json.loads((out_dir / f"out.{k}.json").read_text()) for k in range(ranks)]
    assert results == [{"iterations": iterations, "tokens_ok": True,
                        "allreduce": float(ranks * iterations)}] * ranks
    for k in range(ranks):
        recs = np.concatenate([before[k], after[k]])
        assert calls[k] == len(call_records(recs)) == 1 + CALLS_PER_ITERATION * iterations
        # The call held is the first of iteration `iteration` on every rank (rank 0
        # sends the token, the others receive it), right after the pause's record.
        at, rec = nth_call_record(recs, target)
        assert OP_NAME[int(rec["op"])] == ("Send" if k == 0 else "Recv")
        assert (int(recs[at - 1]["op"]), int(recs[at - 1]["req_id"])) == (OP["Pause"], epochs[k])
        assert nth_call_record(recs, target - 1)[1]["op"] == OP["AllReduce"]
        assert (target - FIRST_CALL) // CALLS_PER_ITERATION == iteration


OP_NAME = {code: name for name, code in OP.items()}


# ---- torch (gloo) through the capture: the same numbers ----------------------------

@pytest.mark.parametrize("fastpath", ["1", "0"], ids=["c-fast-path", "python-wrapper"])
def test_torch_ranks_pause_at_the_same_future_iteration(tmp_path, fastpath):
    pytest.importorskip("torch")
    iterations = 150
    run_dir, out_dir = tmp_path / "run", tmp_path / "out"
    run_dir.mkdir()
    out_dir.mkdir()
    env = base_env(run_dir, hook_lib(), PYTHONPATH=str(CAPTURE),
                   GREYHOUND_CAPTURE_FASTPATH=fastpath)
    port = str(free_port())
    procs = [subprocess.Popen([PYTHON, TORCH_RING_ITER, str(r), "2", port, str(out_dir),
                               str(iterations), "0.02"], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    rings: list[RingReader] = []
    try:
        rings = [RingReader(p) for p in ready_rings(run_dir, 2)]
        wait_for(lambda: min(r.calls for r in rings) > FIRST_CALL + 3 * CALLS_PER_ITERATION)
        target, iteration = boundary_after(max(r.calls for r in rings))
        epochs = [r.pause(at_call=target) for r in rings]
        wait_for(lambda: all(r.parked == 1 for r in rings))
        assert [r.parked_at_call for r in rings] == [target, target]
        assert [r.calls for r in rings] == [target, target]
        heads = [r.head for r in rings]
        time.sleep(0.3)
        assert [r.head for r in rings] == heads
        before = [r.read().records for r in rings]
        assert [len(call_records(b)) for b in before] == [target - 1] * 2
        for r in rings:
            r.resume()
        outs = [p.communicate(timeout=120) for p in procs]
        after = [r.read().records for r in rings]
        calls = [r.calls for r in rings]
    finally:
        for p in procs:
            p.kill()
        for r in rings:
            r.close()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads((out_dir / f"out.{k}.json").read_text()) for k in (0, 1)]
    assert results == [{"iterations": iterations, "tokens_ok": True,
                        "all_reduce": 2.0 * iterations}] * 2
    for k in (0, 1):
        recs = np.concatenate([before[k], after[k]])
        assert calls[k] == len(call_records(recs)) == 1 + CALLS_PER_ITERATION * iterations
        at, rec = nth_call_record(recs, target)
        assert OP_NAME[int(rec["op"])] == ("Send" if k == 0 else "Recv")
        assert (int(recs[at - 1]["op"]), int(recs[at - 1]["req_id"])) == (OP["Pause"], epochs[k])
        assert (target - FIRST_CALL) // CALLS_PER_ITERATION == iteration


# ---- the node the ring was written on ----------------------------------------------

@pytest.mark.parametrize("node", ["n3", None])
def test_node_is_the_slurm_node_else_the_host(tmp_path, node):
    env = base_env(tmp_path, hook_lib())
    env.pop("SLURMD_NODENAME", None)
    if node:
        env["SLURMD_NODENAME"] = node
    proc = subprocess.run([PYTHON, LOOP, "3"], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert (proc.returncode, proc.stderr) == (0, "")
    with RingReader(ready_ring(tmp_path), publish=False) as ring:
        assert ring.info.hostname == os.uname().nodename
        assert ring.info.node == (node or os.uname().nodename)
