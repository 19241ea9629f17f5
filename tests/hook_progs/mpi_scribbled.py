"""MPI calls while another process scribbles on the ring headers: OUT_DIR READY GO N.

Each iteration duplicates MPI_COMM_WORLD, reduces on the duplicate and on the world,
exchanges with the neighbour and frees the duplicate, so that the hook describes and
retires a communicator in its ring's table every time (where a header's offsets would
matter). After 5 iterations rank 0 creates READY and waits for GO (the test scribbles
on the headers in between and goes on scribbling), then every rank runs N more.
Writes out.<rank>.json: the sums, which the test checks exactly.
"""
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

out_dir, ready, go, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
one, mine, tmp = np.ones(1), np.array([float(rank)]), np.empty(1)
sums = {"dup": 0.0, "world": 0.0, "neighbour": 0.0}


def iteration():
    dup = world.Dup()
    dup.Allreduce(one, tmp)
    sums["dup"] += tmp[0]
    world.Allreduce(mine, tmp)
    sums["world"] += tmp[0]
    world.Sendrecv(mine, dest=(rank + 1) % size, recvbuf=tmp, source=(rank - 1) % size)
    sums["neighbour"] += tmp[0]
    dup.Free()


for _ in range(5):
    iteration()
if rank == 0:
    open(ready, "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.005)
world.Barrier()
for _ in range(n):
    iteration()
with open(os.path.join(out_dir, f"out.{rank}.json"), "w") as f:
    json.dump({"iterations": 5 + n, **sums}, f)
