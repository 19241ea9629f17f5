"""torch.distributed.all_reduce (gloo, 1 rank) in a loop: ITERATIONS SLEEP_S PORT.

No greyhound code here: the capture comes from sitecustomize alone. Prints the final
value (= ITERATIONS) so a test can check the result is intact.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

n, nap, port = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
acc = torch.zeros(1)
for _ in range(n):
    t = torch.ones(1)
    dist.all_reduce(t)
    acc += t
    time.sleep(nap)
print(int(acc.item()), flush=True)
# No destroy_process_group: on a loaded machine gloo's teardown aborts ("terminate
# called without an active exception") in 10-30 % of 2-rank runs, with or without
# greyhound. Everything this program checks is written by now.
sys.stdout.flush()
os._exit(0)
