"""P2P link tests: the judgement (pure) and the measurement under real Open MPI."""

from __future__ import annotations

import json
import os
import sys

import pytest

from greyhound.control.p2p import slow_links
from hook_support import mpirun


def test_a_node_with_a_slow_link_is_named():
    bw = {"n1-n2": 1e9, "n2-n3": 1e9, "n3-n4": 2e7, "n4-n1": 2.2e7, "n1-n3": 1.1e9}
    slow = slow_links(bw)
    assert [s["link"] for s in slow] == ["n3-n4", "n4-n1"]
    assert {s["node"] for s in slow} == {"n4"}
    assert slow[0]["ratio"] == pytest.approx(2e7 / 1e9)


def test_one_slow_link_names_the_pair_not_a_node():
    slow = slow_links({"n1-n2": 1e9, "n2-n3": 1e9, "n3-n1": 1e8})
    assert [(s["link"], s["node"]) for s in slow] == [("n3-n1", None)]


def test_even_links_are_all_healthy():
    assert slow_links({"n1-n2": 1e9, "n2-n3": 0.9e9, "n3-n1": 1.1e9}) == []
    assert slow_links({"n1-n2": 1e3}) == []


PROGRAM = """
import json, sys
from mpi4py import MPI
from greyhound.control.links import job_links, link_passes
from greyhound.control.p2p import measure_passes
comm = MPI.COMM_WORLD
nodes = [f"n{i}" for i in range(comm.size)]
passes = link_passes(job_links([nodes]))
bw = measure_passes(comm, nodes[comm.rank], passes, nodes=nodes, nbytes=1 << 20, repeats=2)
rows = comm.gather({"rank": comm.rank, "passes": len(passes), "bw": bw}, root=0)
if comm.rank == 0:        # one writer: ranks' lines would interleave on mpirun's stdout
    print(json.dumps(rows), flush=True)
"""


@pytest.mark.parametrize("size", [3, 4])
def test_every_link_of_a_ring_is_measured_by_both_ends(size):
    proc = mpirun(size, [sys.executable, "-c", PROGRAM], env=dict(os.environ), timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("[")))
    assert len(rows) == size and {r["passes"] for r in rows} == {2 if size % 2 == 0 else 3}
    links = {link for r in rows for link in r["bw"]}
    assert links == {f"n{i}-n{(i + 1) % size}" for i in range(size)}
    for r in rows:                      # each rank measured its two ring links, > 0 bytes/s
        assert len(r["bw"]) == 2 and all(v > 0 for v in r["bw"].values())
