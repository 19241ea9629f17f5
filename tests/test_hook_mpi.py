"""The hook under real Open MPI ranks (mpi4py): what it records, and that it changes nothing."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from greyhound.capture._greyhound_capture import FNV_OFFSET, fnv1a_i32
from greyhound.ring import (F_ASYNC, F_LOCAL_COMM, OP, RingReader, call_records, op_names,
                            ring_paths)
from hook_support import PYTHON, ROOT, base_env, hook_lib, mpirun

PROG = str(ROOT / "tests" / "hook_progs" / "mpi_ops.py")


def comm_id(ranks: list[int], nth: int = 0) -> int:
    return fnv1a_i32(fnv1a_i32(FNV_OFFSET, ranks), [nth])


def results(out_dir) -> dict[int, dict]:
    return {r: json.loads((out_dir / f"out.{r}.json").read_text()) for r in (0, 1)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The program on 2 ranks with the hook, and once without it."""
    run_dir = tmp_path_factory.mktemp("run")
    out_hook, out_plain = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("out")
    with_hook = mpirun(2, [PYTHON, PROG, str(out_hook)], base_env(run_dir, hook_lib()))
    without = mpirun(2, [PYTHON, PROG, str(out_plain)], base_env(None))
    assert with_hook.returncode == 0, with_hook.stderr
    assert without.returncode == 0, without.stderr
    return run_dir, (with_hook, out_hook), (without, out_plain)


def test_results_identical_with_and_without_hook(two_ranks):
    _, (with_hook, out_hook), (_, out_plain) = two_ranks
    assert results(out_hook) == results(out_plain)
    assert "greyhound" not in with_hook.stderr
    assert results(out_hook)[1]["allreduce"] == [1.0 + 2 * i for i in range(8)]


def test_one_ring_per_rank_named_by_rank(two_ranks):
    run_dir, _, _ = two_ranks
    paths = ring_paths(run_dir)
    assert [p.name for p in paths] == ["ring.0", "ring.1"]
    for p in paths:
        assert p.stat().st_mode & 0o777 == 0o600
        with RingReader(p, publish=False) as r:
            assert r.info.rank == int(p.name.split(".")[1])


@pytest.mark.parametrize("rank", [0, 1])
def test_calls_counter_numbers_every_call_record(two_ranks, rank):
    # Every MPI call the hook records as a communication call (collectives, p2p,
    # Isend/Irecv) was numbered for the pause gate, and nothing else was.
    run_dir, _, _ = two_ranks
    with RingReader(run_dir / f"ring.{rank}", publish=False) as ring:
        recs = ring.read().records
        calls = [op for op, *_ in EXPECTED if op != "Wait"]
        assert ring.calls == len(call_records(recs)) == len(calls) == 13
    assert np.count_nonzero(recs["op"] == OP["Wait"]) == 2      # not numbered


# (op, bytes for 2 ranks, peer for rank 0, peer for rank 1, comm) in program order
EXPECTED = [
    ("AllReduce", 64, -1, -1, "world"),
    ("ReduceScatter", 16, -1, -1, "world"),
    ("ReduceScatter", 24, -1, -1, "world"),
    ("AllGather", 16, -1, -1, "world"),
    ("Broadcast", 40, 1, 1, "world"),
    ("Reduce", 48, 0, 0, "world"),
    ("Send|Recv", 10, 1, 0, "world"),
    ("SendRecv", 12, 1, 0, "world"),
    ("Recv", 28, 1, 0, "world"),      # Irecv (async)
    ("Send", 28, 1, 0, "world"),      # Isend (async)
    ("Wait", 0, -1, -1, None),
    ("Wait", 0, -1, -1, None),
    ("Barrier", 0, -1, -1, "world"),
    ("AllReduce", 16, -1, -1, "dup"),
    ("AllReduce", 8, -1, -1, "solo"),
]


@pytest.mark.parametrize("rank", [0, 1])
def test_every_call_recorded_with_op_bytes_peer_comm(two_ranks, rank):
    run_dir, _, _ = two_ranks
    with RingReader(run_dir / f"ring.{rank}") as r:
        batch = r.read()
        comms = r.comms()
    assert batch.lost == 0
    recs = batch.records
    recs = recs[~np.isin(recs["op"], [OP["CommInit"], OP["CommDestroy"]])]
    names = list(op_names(recs))
    ids = {"world": comm_id([0, 1]), "dup": comm_id([0, 1], 1), "solo": comm_id([rank])}
    assert len(names) == len(EXPECTED), names
    for rec, name, (op, nbytes, peer0, peer1, comm) in zip(recs, names, EXPECTED, strict=True):
        want_op = op.split("|")[rank] if "|" in op else op
        assert name == want_op
        assert int(rec["size_bytes"]) == nbytes, name
        assert int(rec["peer"]) == (peer0 if rank == 0 else peer1), name
        assert rec["source"] == 1
        assert rec["rc"] == 0
        assert rec["t_end_ns"] >= rec["t_start_ns"] > 0
        if comm is not None:
            assert int(rec["comm_id"]) == ids[comm], name
            assert not rec["flags"] & F_LOCAL_COMM
    # Isend/Irecv are async and their Waits name the same requests.
    assert recs[8]["flags"] & F_ASYNC and recs[9]["flags"] & F_ASYNC
    assert sorted(recs["req_id"][8:10].tolist()) == sorted(recs["req_id"][10:12].tolist())
    assert np.all(np.diff(recs["seq"].astype(np.int64)) > 0)
    # The communicator table: world, dup (freed), solo (freed), each of the right size.
    table = {int(c["comm_id"]): (int(c["size"]), int(c["rank"]), int(c["state"])) for c in comms}
    assert table[ids["world"]] == (2, rank, 1)
    assert table[ids["dup"]] == (2, rank, 2)
    assert table[ids["solo"]] == (1, 0, 2)


def test_comm_ids_agree_across_ranks(two_ranks):
    run_dir, _, _ = two_ranks
    per_rank = []
    for rank in (0, 1):
        with RingReader(run_dir / f"ring.{rank}", publish=False) as r:
            rec = r.read().records
        per_rank.append(rec["comm_id"][rec["op"] == OP["AllReduce"]].tolist())
    assert per_rank[0][:2] == per_rank[1][:2]      # world, dup: shared
    assert per_rank[0][2] != per_rank[1][2]        # one-member comms: each its own


def test_program_without_mpi_gets_nothing(tmp_path):
    from hook_support import run

    proc = run([PYTHON, "-c", "import numpy; print('hello')"], base_env(tmp_path, hook_lib()))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "hello\n", "")
    assert list(tmp_path.iterdir()) == []


def test_c_program_linked_to_libmpi(tmp_path):
    # MPI_COMM_WORLD is copy-relocated into such an executable: the hook must use
    # that copy (the one libmpi uses), not libmpi's unused original.
    exe = tmp_path / "mpi_c_ops"
    subprocess.run(["mpicc", "-O1", "-g", "-o", str(exe),
                    str(ROOT / "tests" / "hook_progs" / "mpi_c_ops.c")], check=True)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = mpirun(2, [str(exe)], base_env(run_dir, hook_lib()))
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["0 3 2 1", "1 3 2 0"]
    assert proc.stderr == ""
    for rank in (0, 1):
        with RingReader(run_dir / f"ring.{rank}") as r:
            recs = r.read().records
        calls = recs[~np.isin(recs["op"], [OP["CommInit"], OP["CommDestroy"]])]
        assert list(op_names(calls)) == ["AllReduce", "AllReduce", "Recv", "Send", "Wait",
                                         "Wait", "Barrier"]
        ids = calls["comm_id"].tolist()
        assert ids[0] == ids[2] == ids[3] == ids[6] == comm_id([0, 1])
        assert ids[1] == comm_id([0, 1], 1)
