"""MPI_Allreduce of 8 bytes in a loop: ITERATIONS [SLEEP_S [PAUSE_AFTER]].

With PAUSE_AFTER, stops after that many calls until a line arrives on stdin.
Prints the final sum (= ITERATIONS) so a test can check the result is intact.
"""
import sys
import time

import numpy as np
from mpi4py import MPI

n = int(sys.argv[1])
nap = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
stop_at = int(sys.argv[3]) if len(sys.argv) > 3 else -1
one, acc, tmp = np.ones(1), np.zeros(1), np.empty(1)
for i in range(n):
    if i == stop_at:
        print("waiting", flush=True)
        sys.stdin.readline()
    MPI.COMM_WORLD.Allreduce(one, tmp)
    acc += tmp
    if nap:
        time.sleep(nap)
print(int(acc[0]), flush=True)
