"""A token ring plus an all-reduce per iteration: OUT_DIR ITERATIONS COMPUTE_S.

Calls: one Barrier (call 1), then per iteration three communication calls, so the
first call of iteration i is call number 2 + 3 i:
- rank 0 computes (sleeps COMPUTE_S), sends the token to rank 1 and receives it back
  from the last rank; every other rank receives it from its left neighbour, adds its
  rank and sends it on;
- everyone all-reduces a one.
So while rank 0 computes, every other rank is blocked inside a receive: a pause of
"the next call" parks rank 0 and leaves the others there, out of the gate's reach.

Writes OUT_DIR/out.<rank>.json: iterations, the token sums rank 0 got back and the
all-reduce total, so a test can check the results are intact.
"""
import json
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

out_dir, iterations, compute_s = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
token, one, total = np.zeros(1), np.ones(1), np.zeros(1)
tmp = np.empty(1)
tokens_ok = True
comm.Barrier()
for it in range(iterations):
    if rank == 0:
        time.sleep(compute_s)
        token[0] = it
        comm.Send(token, dest=1)
        comm.Recv(token, source=size - 1)
        tokens_ok &= token[0] == it + size * (size - 1) / 2
    else:
        comm.Recv(token, source=rank - 1)
        token[0] += rank
        comm.Send(token, dest=(rank + 1) % size)
    comm.Allreduce(one, tmp)
    total += tmp
(out_dir / f"out.{rank}.json").write_text(json.dumps(
    {"iterations": iterations, "tokens_ok": bool(tokens_ok), "allreduce": float(total[0])}))
