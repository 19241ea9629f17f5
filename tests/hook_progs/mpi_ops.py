"""Every intercepted MPI call once, with known sizes; writes OUT_DIR/out.<rank>.json.

Run on 2 ranks (tests/test_hook_mpi.py) or 1 (ASan run). Used with and without the
hook: the printed results must be identical.
"""
import json
import sys

import numpy as np
from mpi4py import MPI

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
out = {}

a = np.arange(8, dtype=np.float64) + rank
b = np.empty(8)
world.Allreduce(a, b)                                          # 64 bytes
out["allreduce"] = b.tolist()
rs = np.empty(2, dtype=np.int32)
world.Reduce_scatter_block(np.arange(2 * size, dtype=np.int32) * (rank + 1), rs)  # 8*size
out["reduce_scatter_block"] = rs.tolist()
rs3 = np.empty(3, dtype=np.float32)
world.Reduce_scatter(np.ones(3 * size, dtype=np.float32), rs3, [3] * size)     # 12*size
out["reduce_scatter"] = rs3.tolist()
g = np.empty(4 * size, dtype=np.int16)
world.Allgather(np.full(4, rank, dtype=np.int16), g)          # 8*size
out["allgather"] = g.tolist()
bc = np.full(5, rank, dtype=np.int64)
world.Bcast(bc, root=size - 1)                                 # 40
out["bcast"] = bc.tolist()
red = np.empty(6, dtype=np.float64)
world.Reduce(np.ones(6) * (rank + 1), red, root=0)             # 48
out["reduce"] = red.tolist() if rank == 0 else None
peer = (rank + 1) % size
src = (rank - 1) % size
if size > 1:
    if rank == 0:
        world.Send(np.arange(10, dtype=np.uint8), dest=1, tag=3)       # 10
    elif rank == 1:
        r = np.empty(10, dtype=np.uint8)
        world.Recv(r, source=0, tag=3)
        out["recv"] = r.tolist()
sr = np.empty(3, dtype=np.int32)
world.Sendrecv(np.full(3, rank, dtype=np.int32), dest=peer, recvbuf=sr, source=src)  # 12
out["sendrecv"] = sr.tolist()
ir = np.empty(7, dtype=np.float32)
reqs = [world.Irecv(ir, source=src, tag=9),
        world.Isend(np.full(7, rank, dtype=np.float32), dest=peer, tag=9)]          # 28
MPI.Request.Waitall(reqs)
out["irecv"] = ir.tolist()
world.Barrier()
dup = world.Dup()
d = np.empty(2)
dup.Allreduce(np.ones(2), d)                                  # 16 on the dup
out["dup"] = d.tolist()
dup.Free()
solo = world.Split(color=rank, key=0)
s = np.empty(1)
solo.Allreduce(np.ones(1) * rank, s)                          # 8 on a 1-member comm
out["split"] = s.tolist()
solo.Free()
# One file per rank: the ranks' stdout lines may interleave.
with open(f"{sys.argv[1]}/out.{rank}.json", "w") as f:
    json.dump(out, f)
