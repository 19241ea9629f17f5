"""The calls the capture's C fast path takes and the ones it hands to Python, 1 rank.

Argv: PORT. No greyhound code here. Prints the type of the installed
dist.all_reduce and the results, so a test can compare runs with the fast path on
and off.
"""
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
sub = dist.new_group([0])
t = torch.arange(4, dtype=torch.float32)
dist.all_reduce(t)                         # first call on WORLD: described in Python
dist.all_reduce(t)                         # then the fast path
dist.all_reduce(t, group=None)             # keyword, default group
dist.all_reduce(t, group=sub)              # a new group: Python
dist.all_reduce(t, dist.ReduceOp.SUM, sub)  # positional group: fast
dist.all_reduce(torch.ones(3, dtype=torch.float64), group=dist.group.WORLD)
dist.broadcast(t, src=0)
dist.broadcast(t, 0, group=sub)            # a global src in a subgroup: Python
dist.all_gather_single(torch.empty(4), t)
dist.reduce_scatter_single(torch.empty(4), t)
dist.all_reduce(t, async_op=True).wait()   # async: Python
dist.barrier()
try:
    dist.all_reduce(t, op="no such op")    # raises inside torch: recorded as an error
except (TypeError, ValueError, RuntimeError) as exc:
    print("raised", type(exc).__name__)
print(type(dist.all_reduce).__name__, t.tolist(), flush=True)
os._exit(0)   # gloo's teardown can abort on a loaded machine; all is printed
