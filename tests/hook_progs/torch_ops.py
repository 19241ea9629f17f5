"""torch.distributed (gloo) calls with known sizes; rank, world size, port, out dir in argv.

No greyhound code here: the capture comes from sitecustomize alone.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

rank, world, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world)
out = {}
t = torch.arange(4, dtype=torch.float32) + rank
dist.all_reduce(t)                                                     # 16
out["all_reduce"] = t.tolist()
o = torch.empty(2, dtype=torch.float64)
dist.reduce_scatter_tensor(o, torch.ones(2 * world, dtype=torch.float64))   # 16*world
out["reduce_scatter_tensor"] = o.tolist()
g = torch.empty(3 * world, dtype=torch.int32)
dist.all_gather_into_tensor(g, torch.full((3,), rank, dtype=torch.int32))  # 12*world
out["all_gather_into_tensor"] = g.tolist()
lst = [torch.empty(2) for _ in range(world)]
dist.all_gather(lst, torch.full((2,), float(rank)))                     # 8*world
out["all_gather"] = [x.tolist() for x in lst]
b = torch.full((5,), float(rank))
dist.broadcast(b, src=world - 1)                                        # 20
out["broadcast"] = b.tolist()
peer = 1 - rank
if rank == 0:
    dist.send(torch.arange(6, dtype=torch.int64), dst=1)                # 48
else:
    r = torch.empty(6, dtype=torch.int64)
    dist.recv(r, src=0)
    out["recv"] = r.tolist()
w = dist.all_reduce(torch.ones(8, dtype=torch.int8), async_op=True)     # 8 async
w.wait()
buf = torch.empty(3)
reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((3,), float(rank)), peer),
                               dist.P2POp(dist.irecv, buf, peer)])      # 12 + 12
for q in reqs:
    q.wait()
out["batch"] = buf.tolist()
dist.barrier()
pair = dist.new_group([0, 1])
x = torch.ones(1)
dist.all_reduce(x, group=pair)                                          # 4 on a new group
out["pair"] = x.tolist()
with open(f"{out_dir}/out.{rank}.json", "w") as f:
    json.dump(out, f)
# No destroy_process_group: on a loaded machine gloo's teardown aborts ("terminate
# called without an active exception") in 10-30 % of 2-rank runs, with or without
# greyhound. Everything this program checks is written by now.
sys.stdout.flush()
os._exit(0)
