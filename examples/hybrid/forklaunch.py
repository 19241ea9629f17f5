"""Run the job's ranks as forked processes on 127.0.0.1 (tests and benchmarks).

torchrun starts every rank as a fresh interpreter that imports torch again (seconds of
CPU each, i.e. most of a short test run on a 2-core machine).  Here the ranks are forked
from a multiprocessing fork server that imported torch and the job's modules once and
has run no torch op (so there is no thread pool to inherit, which forking a busy pytest
process could not promise).  Like torchrun, when one rank fails the others are killed,
so a crashed job does not hang in its collectives.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import time


_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "gpt_hybrid", "hybrid.train", "greyhound.timeline",
            "postmortem.merge"]


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, argv: list[str], log_path: str | None, env: dict[str, str]) -> None:
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for var in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        os.environ.pop(var, None)
    if log_path is not None:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    from gpt_hybrid import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_local(argv: list[str], *, nproc: int, timeout_s: float = 300.0, log_dir: str | None = None,
              port: int | None = None, env: dict[str, str] | None = None) -> list[int]:
    """Run ``gpt_hybrid.main(argv)`` on ``nproc`` forked ranks; returns their exit codes
    (negative: killed by that signal).  On a failure or the timeout the rest are killed.

    ``log_dir``: each rank's stdout and stderr go to ``<log_dir>/rank-N.log``.
    ``env``: variables the ranks get besides the fork server's environment (which is
    the one of the process that first started it, not this caller's now).
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    port = port or free_port()
    procs = []
    for rank in range(nproc):
        log_path = os.path.join(log_dir, f"rank-{rank}.log") if log_dir else None
        p = ctx.Process(target=_child, args=(rank, nproc, port, list(argv), log_path, dict(env or {})), daemon=False)
        p.start()
        procs.append(p)
    deadline = time.monotonic() + timeout_s
    failed = False
    while any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
            failed = True
            break
        time.sleep(0.05)
    if failed:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
        for p in procs:
            p.join(5)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join()
    for p in procs:
        p.join()
    return [p.exitcode for p in procs]


if __name__ == "__main__":  # python examples/hybrid/forklaunch.py NPROC ARGS...
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    codes = run_local(sys.argv[2:], nproc=int(sys.argv[1]))
    sys.exit(max((abs(c) for c in codes), default=0))
