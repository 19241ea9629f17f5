"""Where this process is: rank, world and rendezvous under torchrun or under srun.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.  Under srun
each task has SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID; the rendezvous address is
MASTER_ADDR when the batch script exported it, else the first node of the job's node
list (asked of Slurm through greyhound.slurm_client; its NodeAddr when Slurm knows one,
because emulated nodes share a host and their names need not resolve), and the port
MASTER_PORT or one derived from the job id, so that two jobs on one node do not collide.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from greyhound.errors import InputError, SlurmError
from greyhound.slurm_client import connect


class LaunchError(RuntimeError):
    """The process cannot tell its rank or rendezvous (one-line message)."""


@dataclass(frozen=True, kw_only=True)
class ProcessEnv:
    """This process's place in the launch."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    node: str
    """Node name for traces (SLURMD_NODENAME under Slurm: emulated nodes share a host)."""
    job_id: str | None
    launcher: str
    """"torchrun", "srun" or "single"."""


def _int_env(env: dict, name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise LaunchError(f"environment variable {name}={env[name]!r} is not an integer") from None


def first_node_address(nodelist: str) -> str:
    """Address of the first node of a Slurm node list (NodeAddr, else its name)."""
    client = connect()
    try:
        names = client.hostnames(nodelist)
    except SlurmError as exc:
        raise LaunchError(f"{exc}; export MASTER_ADDR instead") from None
    if not names:
        raise LaunchError(f"Slurm node list {nodelist!r} names no node")
    try:
        return client.node_address(names[0])
    except (SlurmError, InputError):
        return names[0]


def detect(env: dict | None = None) -> ProcessEnv:
    """Read the launch environment (``os.environ`` by default)."""
    env = dict(os.environ if env is None else env)
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    job_id = env.get("SLURM_JOB_ID")
    if "RANK" in env and "WORLD_SIZE" in env:
        return ProcessEnv(
            rank=_int_env(env, "RANK"),
            world_size=_int_env(env, "WORLD_SIZE"),
            local_rank=_int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int_env(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500,
            node=node,
            job_id=job_id,
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        if "MASTER_ADDR" in env:
            addr = env["MASTER_ADDR"]
        else:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
            if not nodelist:
                raise LaunchError("under srun but SLURM_JOB_NODELIST is unset; export MASTER_ADDR")
            addr = first_node_address(nodelist)
        if "MASTER_PORT" in env:
            port = _int_env(env, "MASTER_PORT")
        else:
            port = 20000 + int(job_id) % 20000 if job_id and job_id.isdigit() else 29500
        return ProcessEnv(
            rank=_int_env(env, "SLURM_PROCID"),
            world_size=_int_env(env, "SLURM_NTASKS"),
            local_rank=_int_env(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            master_addr=addr,
            master_port=port,
            node=node,
            job_id=job_id,
            launcher="srun",
        )
    return ProcessEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                      master_port=_int_env(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500,
                      node=node, job_id=job_id, launcher="single")
