"""DistributedDataParallel (gloo, 2 ranks) recorded through sitecustomize, unchanged.

tests/hook_progs/torch_ddp.py trains five models with a dist.barrier() after each
step, then two with uneven inputs in a Join context (one barrier after each); it
runs once plainly and once with the capture. Results must be the same bits, and
each rank's ring must hold one AllReduce per gradient bucket per step, with the
bucket sizes DDP itself reports.
"""

from __future__ import annotations


import pytest

from greyhound.capture._greyhound_capture import FNV_OFFSET, fnv1a_i32
from greyhound.ring import OP, RingReader, call_records, op_names
from hook_support import PYTHON, ROOT, base_env, hook_lib, run, run_torch_pair

torch = pytest.importorskip("torch")
PROG = str(ROOT / "tests" / "hook_progs" / "torch_ddp.py")
CAPTURE = ROOT / "greyhound" / "capture"
STEPS = {"default": 4, "user": 3, "late": 3, "broken": 2, "norecord": 2}   # as in PROG
JOINS = ("join", "join_live")      # then these: rank 0 trains 3 steps, rank 1 2
WORLD_ID = fnv1a_i32(fnv1a_i32(FNV_OFFSET, [0, 1]), [0])
SKEW_NS = 200_000   # the hook's TSC clock against CLOCK_MONOTONIC, generously


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    env = base_env(run_dir, hook_lib(), PYTHONPATH=str(CAPTURE))
    captured, outs = run_torch_pair(PROG, tmp_path_factory.mktemp("out"), env)
    plain, plain_outs = run_torch_pair(PROG, tmp_path_factory.mktemp("out"), base_env(None))
    return run_dir, captured, outs, plain, plain_outs


def _steps(run_dir, rank):
    """{model: [records of each step]} (a join model: [all its records]): the ring
    split at the Barrier records."""
    with RingReader(run_dir / f"ring.{rank}") as ring:
        recs = ring.read().records
    recs = recs[recs["op"] != OP["CommInit"]]
    names = op_names(recs)
    steps, cur, prev_barrier_end = [], [], 0
    for rec, name in zip(recs, names, strict=True):
        if name == "Barrier":
            for r in cur:  # issued after the last step ended, complete before this one
                assert r["t_start_ns"] + SKEW_NS >= prev_barrier_end
                assert r["t_end_ns"] <= rec["t_start_ns"] + SKEW_NS
            steps.append(cur)
            cur, prev_barrier_end = [], int(rec["t_end_ns"])
        else:
            assert name == "AllReduce" or len(steps) >= sum(STEPS.values())
            cur.append(rec)
    assert cur == []
    assert len(steps) == sum(STEPS.values()) + len(JOINS)
    out, i = {}, 0
    for model, n in [*STEPS.items(), *((m, 1) for m in JOINS)]:
        out[model], i = steps[i:i + n], i + n
    return out


def test_results_are_the_same_bits(runs):
    _, captured, _, plain, _ = runs
    for rank in (0, 1):
        for model in [*STEPS, *JOINS]:
            assert captured[rank][model]["params"] == plain[rank][model]["params"], model
            assert captured[rank][model]["hook_calls"] == plain[rank][model]["hook_calls"]
    # The ranks agree (the all-reduce happened) and the program's own hooks ran.
    assert all(captured[0][m] == captured[1][m] for m in STEPS)
    assert captured[0]["user"]["hook_calls"] == 1 + 2 * (STEPS["user"] - 1)
    assert captured[0]["late"]["hook_calls"] == 2 * (STEPS["late"] - 1)
    # The Join models differ only in their divisor once rank 1 has joined: the
    # capture's hook follows the reducer's.
    assert captured[0]["join"]["params"] != captured[0]["join_live"]["params"]


def test_failures_fall_back_with_one_line_each(runs):
    _, _, outs, _, plain_outs = runs
    assert all(out == err == "" for out, err in plain_outs)
    for out, err in outs:
        assert out == ""
        lines = err.splitlines()
        assert [line.split(":")[:3] for line in lines] == [
            ["greyhound", " capture", " cannot record DistributedDataParallel"],
            ["greyhound", " capture", " cannot record a DDP bucket"]]
        assert "injected failure (broken)" in lines[0]
        assert "injected failure (norecord)" in lines[1]


@pytest.mark.parametrize("rank", [0, 1])
def test_one_record_per_bucket_per_step(runs, rank):
    run_dir, captured, _, _, _ = runs
    steps = _steps(run_dir, rank)
    for model in ("default", "user", "late"):
        info = captured[rank][model]
        first, rebuilt = info["bucket_sizes"], info["rebuilt_bucket_sizes"]
        assert len(rebuilt) == 2 and sum(first) == sum(rebuilt) == info["grad_bytes"]
        for i, recs in enumerate(steps[model]):
            # DDP rebuilds its buckets before the second forward; gloo may finish
            # them out of order.
            want = first if i == 0 else rebuilt
            assert sorted(int(r["size_bytes"]) for r in recs) == sorted(want), (model, i)
            for r in recs:
                assert (int(r["comm_id"]), int(r["peer"]), int(r["flags"]),
                        int(r["source"])) == (WORLD_ID, -1, 0, 3)
                assert r["t_end_ns"] >= r["t_start_ns"] > 0
    # The program's hook is recorded for each of its calls; before it came, ours.
    assert sum(map(len, steps["user"])) == captured[rank]["user"]["hook_calls"]
    assert sum(map(len, steps["late"][1:])) == captured[rank]["late"]["hook_calls"]
    # Set-up failed: DDP untouched, nothing recorded. Recording failed: nothing either.
    assert all(recs == [] for recs in steps["broken"] + steps["norecord"])
    # Join: both ranks reduce 3 steps of buckets (rank 1's last for a rank that
    # has joined); Join's and DDP's own small all_reduces are recorded besides.
    info = captured[rank]["default"]    # the same network (logged on every rank)
    sizes = set(info["bucket_sizes"] + info["rebuilt_bucket_sizes"])
    for model in JOINS:
        buckets = [int(r["size_bytes"]) for r in steps[model][0]
                   if r["op"] == OP["AllReduce"] and int(r["size_bytes"]) in sizes]
        assert sorted(buckets) == sorted(info["bucket_sizes"] + 2 * info["rebuilt_bucket_sizes"])


@pytest.mark.parametrize("rank", [0, 1])
def test_calls_counter_numbers_every_call_record(runs, rank):
    # A bucket's AllReduce is numbered when it is issued (the gate can hold it there)
    # and recorded when it completes: one number per record all the same, except
    # where "norecord" makes writing the record fail after the number was taken.
    run_dir, captured, _, _, _ = runs
    # Its 2 steps: the first buckets, then the rebuilt ones (as the default model's:
    # DDP does not log them for this model).
    unrecorded = (len(captured[rank]["norecord"]["bucket_sizes"])
                  + len(captured[rank]["default"]["rebuilt_bucket_sizes"]))
    with RingReader(run_dir / f"ring.{rank}", publish=False) as ring:
        recs = ring.read().records
        assert ring.calls == len(call_records(recs)) + unrecorded
    assert unrecorded == 3


def test_ddp_untouched_without_greyhound(tmp_path):
    code = ("import torch.nn.parallel as p; "
            "print(getattr(p.DistributedDataParallel, '__greyhound_ddp__', False))")
    proc = run([PYTHON, "-c", code], base_env(None, None, PYTHONPATH=str(CAPTURE)))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "False\n", "")
    proc = run([PYTHON, "-c", code], base_env(tmp_path, hook_lib(), PYTHONPATH=str(CAPTURE)))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "True\n", "")
    assert list(tmp_path.iterdir()) == []   # and no ring until something communicates
