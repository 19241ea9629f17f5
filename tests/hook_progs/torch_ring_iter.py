"""mpi_ring_iter.py in torch.distributed (gloo): RANK WORLD PORT OUT_DIR ITERATIONS COMPUTE_S.

No greyhound code here: the capture comes from sitecustomize alone. The same calls as
mpi_ring_iter.py: a barrier (call 1), then per iteration rank 0 computes (sleeps),
sends the token to rank 1 and receives it back from the last rank, every other rank
receives it, adds its rank and sends it on, and everyone all-reduces a one; so the
first call of iteration i is call number 2 + 3 i, as in the MPI program.

Writes OUT_DIR/out.<rank>.json: iterations, whether every token came back right, and
the all-reduce total.
"""
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
out_dir, iterations, compute_s = Path(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world)
token, total = torch.zeros(1), 0.0
tokens_ok = True
dist.barrier()
for it in range(iterations):
    if rank == 0:
        time.sleep(compute_s)
        token.fill_(it)
        dist.send(token, 1)
        dist.recv(token, world - 1)
        tokens_ok &= token.item() == it + world * (world - 1) / 2
    else:
        dist.recv(token, rank - 1)
        token += rank
        dist.send(token, (rank + 1) % world)
    one = torch.ones(1)
    dist.all_reduce(one)
    total += one.item()
(out_dir / f"out.{rank}.json").write_text(json.dumps(
    {"iterations": iterations, "tokens_ok": bool(tokens_ok), "all_reduce": total}))
sys.stdout.flush()
# No destroy_process_group: gloo's teardown aborts now and then on a loaded machine
# (see torch_loop.py). Everything this program checks is written by now.
os._exit(0)
