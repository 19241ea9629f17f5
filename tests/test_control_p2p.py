"""P2P link tests: the judgement (pure) and the measurement under real Open MPI."""

from __future__ import annotations

import json
import os
import sys

import pytest

from greyhound.control.p2p import link_ends, link_name, slow_links
from hook_support import mpirun


def test_a_node_with_a_slow_link_is_named():
    bw = {"n1<->n2": 1e9, "n2<->n3": 1e9, "n3<->n4": 2e7, "n4<->n1": 2.2e7, "n1<->n3": 1.1e9}
    slow = slow_links(bw)
    assert [s["link"] for s in slow] == ["n3<->n4", "n4<->n1"]
    assert {s["node"] for s in slow} == {"n4"}
    assert slow[0]["ratio"] == pytest.approx(2e7 / 1e9)


def test_one_slow_link_names_the_pair_not_a_node():
    slow = slow_links({"n1<->n2": 1e9, "n2<->n3": 1e9, "n3<->n1": 1e8})
    assert [(s["link"], s["node"]) for s in slow] == [("n3<->n1", None)]


def test_even_links_are_all_healthy():
    assert slow_links({"n1<->n2": 1e9, "n2<->n3": 0.9e9, "n3<->n1": 1.1e9}) == []
    assert slow_links({"n1<->n2": 1e3}) == []


def test_node_names_with_hyphens_are_kept_whole():
    # Real clusters name nodes "gpu-a100-01"; a link's name must give both back.
    names = ["gpu-a-1", "gpu-a-2", "gpu-a-3", "gpu-a-4"]
    bw = {link_name(a, b): speed for a, b, speed in zip(names, names[1:] + names[:1], [1e9, 1e9, 1e7, 1e7])}
    assert link_ends(link_name("gpu-a-1", "gpu-a-2")) == ("gpu-a-1", "gpu-a-2")
    assert [s["node"] for s in slow_links(bw)] == ["gpu-a-4", "gpu-a-4"]


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
    assert links == {f"n{i}<->n{(i + 1) % size}" for i in range(size)}
    for r in rows:                      # each rank measured its two ring links, > 0 bytes/s
        assert len(r["bw"]) == 2 and all(v > 0 for v in r["bw"].values())


ROUNDS = """
import json, sys
from mpi4py import MPI
from greyhound.control.links import job_links, link_passes
from greyhound.control.pause import link_bandwidth
from greyhound.control.p2p import measure_passes, slow_links
comm = MPI.COMM_WORLD
nodes = [f"n{i}" for i in range(comm.size)]
passes = link_passes(job_links([nodes]))
rounds = []
measured = []
slow_in = {"burst": {0}, "fail-slow": {0, 1}}[sys.argv[1]]

def measure(comm, node, passes, *, nodes):
    measured.append([[list(link) for link in links] for links in passes])
    # The real measurement; link n1-n2 is then reported at a tenth in the rounds of
    # `slow_in` (a burst of other work: the first only; a fail-slow link: both).
    bw = measure_passes(comm, node, passes, nodes=nodes, nbytes=1 << 20, repeats=2)
    bw = {link: 1e9 for link in bw}    # even figures: loopback on a busy machine is not
    if len(rounds) in slow_in and "n1<->n2" in bw:
        bw["n1<->n2"] = 1e6
    rounds.append(1)
    return bw

bw = link_bandwidth(comm, nodes[comm.rank], passes, nodes=nodes, measure=measure)
if comm.rank == 0:
    print(json.dumps({"rounds": len(rounds), "slow": [s["link"] for s in slow_links(bw)],
                      "passes": measured[1:]}), flush=True)
"""


@pytest.mark.parametrize("case, rounds, slow", [("burst", 2, []), ("fail-slow", 2, ["n1<->n2"])])
def test_a_link_is_named_only_when_it_is_slow_in_both_rounds(case, rounds, slow):
    proc = mpirun(4, [sys.executable, "-c", ROUNDS, case], env=dict(os.environ), timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    # The second round measures the slow-looking link alone: no other pair competes.
    assert got == {"rounds": rounds, "slow": slow, "passes": [[[["n1", "n2"]]]]}


def test_links_that_look_even_are_measured_once():
    program = ROUNDS.replace('{"burst": {0}, "fail-slow": {0, 1}}[sys.argv[1]]', "set()")
    proc = mpirun(4, [sys.executable, "-c", program, "none"], env=dict(os.environ), timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert got == {"rounds": 1, "slow": [], "passes": []}


SLOW_PEER = """
import json, sys, time
from mpi4py import MPI
from greyhound.control.p2p import measure_passes

class Delayed:
    '''The world communicator, with rank 1's data exchanges held back 0.3 s each: a
    narrow link as both ends see it.'''
    def __init__(self, comm, delay):
        self.comm, self.delay, self.exchanges = comm, delay, 0
    def __getattr__(self, name):
        return getattr(self.comm, name)
    def Sendrecv(self, *args, sendtag=0, **kw):
        if sendtag == 7:
            self.exchanges += 1
            time.sleep(self.delay)
        return self.comm.Sendrecv(*args, sendtag=sendtag, **kw)

comm = Delayed(MPI.COMM_WORLD, float(sys.argv[1]) if MPI.COMM_WORLD.rank == 1 else 0.0)
comm.alltoall([None] * comm.size)   # connected first, as the control plane does at its start
bw = measure_passes(comm, f"n{comm.rank}", [[("n0", "n1")]], nodes=["n0", "n1"], nbytes=1 << 16, repeats=3)
counts = MPI.COMM_WORLD.gather(comm.exchanges, root=0)
if comm.rank == 0:
    print(json.dumps({"exchanges": counts, "bw": bw}), flush=True)
"""


@pytest.mark.parametrize("delay, exchanges", [(0.3, 1), (0.0, 3)])
def test_a_link_slow_at_one_end_is_measured_once_by_both_ends(delay, exchanges):
    proc = mpirun(2, [sys.executable, "-c", SLOW_PEER, str(delay)], env=dict(os.environ), timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    # Both ends stop together (else one would wait for ever for the other's next send).
    assert got["exchanges"] == [exchanges, exchanges]
    assert list(got["bw"]) == ["n0<->n1"]
