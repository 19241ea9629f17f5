"""Starts the job's control plane: what the SPANK plugin runs in the batch step.

``python -I -m greyhound.control.launch``, as the job's user, in the batch step, a child
of the batch script (so Slurm ends it with the job). It runs

    srun --overlap --nodes=N --ntasks-per-node=1 --mpi=pmix --gres=none ...
         python -I -m greyhound.control.plane

``--overlap`` makes the step share every CPU, memory and GRES with the job's other
steps, so the user's own ``srun`` never waits for it (Slurm >= 21.08). srun's own
messages and the plane's output go to ``<run dir>/control-plane.log``, not the job's
output; if the plane cannot start, one ``greyhound:`` line in the job's output says
why and the job runs on. When the job ends, Slurm signals this process and the step;
that is not a failure and says nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from greyhound.control.redis_server import ADDRESS_FILE
from greyhound.slurm_client import start_overlap_step

LOG_FILE = "control-plane.log"
STARTS = 3
"""Attempts to start the plane before one line says it could not."""
RETRY_AFTER_S = 5.0
"""Seconds before the second start, doubled before each later one."""
START_TIMEOUT_S = 60.0
"""How long one start may take to bring the master's Redis up. It took 3-4 s from the
batch step's start on the local cluster with 8 training ranks starting beside it
(interpreter, mpi4py and Open MPI's start, redis-server); the rest is for a loaded
node."""
STOP_GRACE_S = 10.0


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def _wait(proc: subprocess.Popen, address: Path, ending: list) -> tuple[bool, str]:
    """(whether the plane came up, how the step ended) once the step ends. A start
    that has not brought the master's Redis up (its address file) within
    ``START_TIMEOUT_S`` is stopped: a plane task that crashed in MPI_Init has been seen
    to leave srun waiting on the others until the job ended."""
    since = time.time()
    deadline = time.monotonic() + START_TIMEOUT_S
    while proc.poll() is None:
        up = _written_since(address, since)
        if up or ending:
            return up, f"srun exited with status {proc.wait()}"
        if time.monotonic() > deadline:
            proc.terminate()                   # srun passes it on to the step's tasks
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return False, f"not up within {START_TIMEOUT_S:.0f} s, stopped"
        time.sleep(0.2)
    return _written_since(address, since), f"srun exited with status {proc.returncode}"


def _written_since(path: Path, since: float) -> bool:
    """Whether ``path`` was written at or after ``since`` (a requeued job's run dir
    still holds its first run's address file)."""
    try:
        return path.stat().st_mtime >= since - 1.0
    except OSError:
        return False


def main() -> int:
    run_dir = os.environ.get("GREYHOUND_RUN_DIR")
    if not run_dir:
        return 0
    ending = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCONT):
        signal.signal(sig, lambda s, _f: ending.append(s) if s != signal.SIGCONT else None)
    num_nodes = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
    log_path = Path(run_dir) / LOG_FILE
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        print(f"greyhound: control plane not started: cannot open {log_path}: {exc.strerror}", file=sys.stderr)
        return 0
    # The plane runs on the interpreter that runs this (the plugstack's python=).
    # A plane rank that waits in a blocking MPI call yields its core (Open MPI polls in a
    # busy loop otherwise): the cores are the job's.
    # Each rank listens on a port the kernel picks, not Open MPI's first free one from
    # 1024 (the same port on a node for every plane): a rank of a plane that just ended
    # cannot reach the next one there.
    # All peers are added inside MPI_Init (add_procs_cutoff), not on a first message:
    # one per node, a few thousand at most.
    env = {**os.environ, "GREYHOUND_CONTROL_PLANE": "1", "OMPI_MCA_mpi_add_procs_cutoff": "1000000",
           "OMPI_MCA_mpi_yield_when_idle": "1", "OMPI_MCA_btl_tcp_port_min_v4": "0",
           "OMPI_MCA_btl_tcp_port_min_v6": "0"}
    for attempt in range(1, STARTS + 1):
        try:
            proc = start_overlap_step([sys.executable, "-I", "-m", "greyhound.control.plane"],
                                      num_nodes=num_nodes, log_fd=fd, env=env)
        except OSError as exc:
            os.close(fd)
            print(f"greyhound: control plane not started: srun: {exc.strerror}; the job runs without online "
                  "detection", file=sys.stderr)
            return 0
        started, ended = _wait(proc, Path(run_dir) / ADDRESS_FILE, ending)
        if ending or started:
            break
        # A start can fail for reasons of the moment: a node's slurmd slow to answer
        # srun, or a crash inside MPI_Init. The crashes (9 in about 260 starts, in runs:
        # twice in a row in two jobs, each start within seconds of a job ending there)
        # are a NULL handler called for a message from a peer of the rank's own world
        # that had left MPI_Init while this rank had not yet registered its handlers
        # (the cores: a MATCH fragment, its sender's vpid in the same job id), which the
        # PMIx fence at the end of MPI_Init should rule out. A later start, a few
        # seconds on, finds the nodes quieter.
        if attempt < STARTS:
            wait_s = RETRY_AFTER_S * 2 ** (attempt - 1)
            os.write(fd, f"greyhound: control plane: start {attempt} failed ({ended}); starting again "
                         f"in {wait_s:g} s\n".encode())
            deadline = time.monotonic() + wait_s
            while not ending and time.monotonic() < deadline:
                time.sleep(0.2)
    os.close(fd)
    if not ending and not started:
        why = _last_line(log_path) or ended
        print(f"greyhound: control plane not started: {why} (see {log_path}); the job runs without online "
              "detection", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
