"""Async torch.distributed (gloo) handles used the ways torch's own code uses them.

Argv: rank, world size (2), port, out dir. No greyhound code here: the capture comes
from sitecustomize alone. Each step writes what the program saw into out.<rank>.json,
exceptions included, so a test can compare runs with and without the capture.
"""
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

rank, world, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world)
peer = 1 - rank
out = {}


def outcome(fn):
    """fn()'s value, or the exception it raised as (type, message)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001  (what the program saw is the result)
        return [type(exc).__name__, str(exc).splitlines()[0]]


def describe(work):
    return [isinstance(work, dist.Work), type(work).__qualname__]


# 1. An async all_reduce's handle handed to C++: torch's work registry takes only a
#    c10d::Work, and wait_tensor then waits on it there. Then waited in Python.
t = torch.arange(4, dtype=torch.float32) + rank                        # 16 async
w = dist.all_reduce(t, async_op=True)
out["all_reduce"] = describe(w)


def registered():
    torch._C._distributed_c10d._register_work(t, w)
    return torch.ops._c10d_functional.wait_tensor(t).tolist()


out["register_work"] = outcome(registered)
out["wait"] = outcome(lambda: w.wait())  # noqa: PLW0108  (looked up inside outcome's try)
out["is_completed"] = outcome(lambda: w.is_completed())  # noqa: PLW0108  (looked up inside outcome's try)

# 2. Its future: torch's own (what a DDP comm hook hands back), chained; wait(timeout).
u = torch.full((3,), 1.0 + rank, dtype=torch.float64)                   # 24 async
w = dist.all_reduce(u, async_op=True)
fut = w.get_future()
out["future"] = [isinstance(fut, torch._C.Future), type(fut).__qualname__]
out["future_value"] = outcome(lambda: [x.tolist() for x in fut.wait()])
out["future_then"] = outcome(lambda: fut.then(lambda f: f.value()[0] * 2).wait().tolist())
out["wait_timeout"] = outcome(lambda: w.wait(timedelta(seconds=60)))

# 3. isend / irecv.
if rank == 0:
    w = dist.isend(torch.arange(3, dtype=torch.int32), dst=peer)        # 12 async
else:
    got = torch.empty(3, dtype=torch.int32)
    w = dist.irecv(got, src=peer)
out["p2p"] = describe(w)
out["p2p_wait"] = outcome(lambda: w.wait())  # noqa: PLW0108  (looked up inside outcome's try)
if rank == 1:
    out["p2p_value"] = got.tolist()

# 4. batch_isend_irecv.
buf = torch.empty(5)
works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((5,), float(rank)), peer),
                                dist.P2POp(dist.irecv, buf, peer)])     # 20 + 20
out["batch"] = [describe(q) for q in works]
for q in works:
    q.wait()
out["batch_value"] = buf.tolist()

# 5. A wait that fails: rank 0 waits for a message rank 1 never sends. Last, since
#    gloo closes the pair after a timeout; rank 1 stays up until rank 0 is done, so
#    the error is the timeout, not a closed connection.
mine = f"{out_dir}/out.{rank}.json"
if rank == 0:
    w = dist.irecv(torch.empty(2), src=peer, tag=7)                      # 8 async
    out["failed_wait"] = outcome(lambda: w.wait(timedelta(milliseconds=300)))
    out["failed_wait"][1] = out["failed_wait"][1].split("] ", 1)[-1]   # no source path
with open(mine + ".tmp", "w") as f:
    json.dump(out, f)
os.rename(mine + ".tmp", mine)
if rank == 1:
    deadline = time.monotonic() + 100
    while not os.path.exists(f"{out_dir}/out.0.json") and time.monotonic() < deadline:
        time.sleep(0.01)
# No destroy_process_group: gloo's teardown can abort on a loaded machine, and
# rank 0's pair is closed. Everything this program checks is written by now.
sys.stdout.flush()
os._exit(0)
