"""DistributedDataParallel (gloo, CPU) training; rank, world size, port, out dir in argv.

No greyhound code here: the capture comes from sitecustomize alone. Trains five
small models one after another, with a dist.barrier() after every step (the
test splits the ring at the Barrier records), and writes each model's final
parameters (exact bytes), DDP's own bucket sizes and its comm-hook call counts.

  default   no comm hook: the capture stands in for the reducer's all-reduce
  user      a comm hook registered right after construction (fp16 compression)
  late      the same hook registered after the first step
  broken    (with the capture loaded) its DDP set-up fails: DDP must be untouched
  norecord  (with the capture loaded) writing the records fails: results intact
  join      uneven inputs (rank 0: 3 steps, rank 1: 2) in a Join context, one
            barrier after it
  join_live the same, dividing by the ranks not yet joined
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

rank, world, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world)
STEPS = {"default": 4, "user": 3, "late": 3, "broken": 2, "norecord": 2,
         "join": 3 - rank, "join_live": 3 - rank}
calls = {"user": 0, "late": 0}


def counting(name):
    def hook(state, bucket):
        calls[name] += 1
        return default_hooks.fp16_compress_hook(state, bucket)
    return hook


def break_capture(name):
    """Fault injection for the fallback checks; returns its undo. A no-op without
    the capture."""
    cap, ddp = sys.modules.get("_greyhound_capture"), sys.modules.get("_greyhound_ddp")
    if cap is None or ddp is None:
        return lambda: None

    def fail(*args, **kwargs):
        raise RuntimeError(f"injected failure ({name})")
    owner, attr = (ddp.DDPCapture, "unsuitable") if name == "broken" else (cap.HOOK, "record")
    saved = getattr(owner, attr)
    setattr(owner, attr, fail)
    return lambda: setattr(owner, attr, saved)


out = {}
for name, steps in STEPS.items():
    undo = break_capture(name) if name in ("broken", "norecord") else (lambda: None)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                              torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    model = DDP(net, bucket_cap_mb=0.004)   # 4 KiB buckets: two once DDP rebuilds them
    if name == "user":
        model.register_comm_hook(None, counting(name))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    joined = name.startswith("join")
    with Join([model], enable=joined, divide_by_initial_world_size=name != "join_live"):
        for step in range(steps):
            x = torch.randn(8, 16, generator=gen)
            y = torch.randn(8, 8, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if not joined:
                dist.barrier()
            if name == "late" and step == 0:
                model.register_comm_hook(None, counting(name))
    if joined:
        dist.barrier()
    undo()
    logged = model._get_ddp_logging_data()
    out[name] = {
        "params": [p.detach().numpy().tobytes().hex() for p in net.parameters()],
        "grad_bytes": sum(p.numel() * p.element_size() for p in net.parameters()),
        "bucket_sizes": [int(v) for v in str(logged.get("bucket_sizes", "")).split(",") if v],
        "rebuilt_bucket_sizes": [int(v) for v in
                                 str(logged.get("rebuilt_bucket_sizes", "")).split(",") if v],
        "hook_calls": calls.get(name),
    }
with open(f"{out_dir}/out.{rank}.json", "w") as f:
    json.dump(out, f)
# No destroy_process_group: on a loaded machine gloo's teardown aborts ("terminate
# called without an active exception") in 10-30 % of 2-rank runs, with or without
# greyhound. Everything this program checks is written by now.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
