"""The hook's own CUDA calls (device timing, GREYHOUND_TRACE=on) leave the program's CUDA
state as they found it.

- An event query of unfinished work returns cudaErrorNotReady, which becomes the
  thread's last error: PyTorch's check after its next kernel launch would raise it.
- An error the program has pending must still be there after an NCCL call.
- An event query during a stream capture in the global mode invalidates the capture (a
  CUDA graph), and an event recorded on a capturing stream becomes part of the graph.

Against the CUDA runtime double in tests/nccl_double/ (no GPU here);
scripts/gpu-check runs the same cases with torch on a real GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from greyhound.ring import OP, RingReader, ring_paths
from hook_support import asan_preload, base_env, hook_lib, hook_lib_asan, nccl_prog, run
from test_hook_asan import SAN

# Non-DONE records of nccl_prog: CommInit, then 9 per iteration.
PER_ITERATION = 9


def run_traced(tmp_path, modes: str, iterations: int, *, sanitized: bool = False, **env):
    """nccl_prog ID ITERATIONS MODES with device timing; its result and its ring's records."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    full_env = base_env(run_dir, hook_lib(), GREYHOUND_TRACE="on", **env)
    if sanitized:
        full_env.update(SAN, LD_PRELOAD=f"{asan_preload()}:{hook_lib_asan()}")
    proc = run([str(nccl_prog()), str(tmp_path / "id"), str(iterations), modes], full_env)
    (path,) = ring_paths(run_dir)
    with RingReader(path) as ring:
        return proc, ring.read().records


def timed(recs) -> dict[int, np.void]:
    """DONE records by the seq of the op they time."""
    return {int(d["req_id"]): d for d in recs[recs["op"] == OP["Done"]]}


def test_not_ready_events_leave_no_cuda_error(tmp_path):
    # Every event answers cudaErrorNotReady twice before it is complete; nccl_prog
    # checks cudaPeekAtLastError after each NCCL call (exit 5 if an error is left).
    proc, recs = run_traced(tmp_path, "", 10, CUDART_DOUBLE_NOT_READY="2")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "ok\n", "")
    # The timings still come, later: a not-ready event is asked again at a later call.
    ops = recs[recs["op"] != OP["Done"]][1:1 + 10 * PER_ITERATION]
    ops = ops[ops["op"] != OP["Group"]]
    done = timed(recs)
    assert len(done) >= 20
    assert set(done) <= {int(s) for s in ops["seq"]}


def test_a_pending_cuda_error_stays_the_programs(tmp_path):
    # nccl_prog's "p": its own error pending across an NCCL call must still be there
    # (exit 8 if the hook's query replaced it with cudaErrorNotReady or cleared it).
    proc, _ = run_traced(tmp_path, "p", 2, CUDART_DOUBLE_NOT_READY="1")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "ok\n", "")


def test_graph_capture_is_not_invalidated_and_captured_ops_not_timed(tmp_path):
    # nccl_prog's "c": three AllReduces captured on a stream in the global mode (exit 7
    # if cudaStreamEndCapture fails, 5 if a call left an error).
    proc, recs = run_traced(tmp_path, "c", 2)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "ok\n", "")
    calls = recs[recs["op"] != OP["Done"]]
    start = 1 + 2 * PER_ITERATION
    captured = calls[start:start + 3]
    assert list(captured["op"]) == [OP["AllReduce"]] * 3
    done = timed(recs)
    assert not {int(s) for s in captured["seq"]} & set(done)   # recorded, not device-timed
    before = calls[1:start]
    before = before[before["op"] != OP["Group"]]
    assert {int(s) for s in before["seq"]} <= set(done)        # the ops before all are


def test_cuda_state_under_sanitizers(tmp_path):
    if not asan_preload().startswith("/"):
        pytest.skip("gcc has no ASan runtime here")
    proc, recs = run_traced(tmp_path, "pc", 4, sanitized=True, CUDART_DOUBLE_NOT_READY="1")
    assert (proc.returncode, proc.stdout) == (0, "ok\n"), proc.stderr[-3000:]
    for marker in ("AddressSanitizer", "runtime error", "greyhound: hook:"):
        assert marker not in proc.stderr, proc.stderr[-3000:]
    assert (recs["op"] == OP["Done"]).sum() > 0
