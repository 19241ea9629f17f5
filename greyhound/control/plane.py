"""The control plane of one job: one MPI world, one rank per node (``python -m
greyhound.control.plane``, started by the SPANK plugin with ``srun --overlap``).

Every rank is its node's agent; rank 0 is also the master and runs the job's Redis.
Once Redis is up, every rank drops to the lowest CPU priority (priority.py): the job's
ranks come first.
Each poll: agents read their rings and publish, then the master decides (master.py).
While a rank's detector weighs a candidate change, its agent polls and publishes four
times as often until the next poll, and the master looks for a slow job each time.
When it asks for a validation round, it calls the other ranks into it with a one-byte
message each, which they test for once a poll; all ranks take part in the round (the
pause is job-wide and the P2P tests run between nodes). Nothing else passes between
the ranks while the job is tracked: a barrier and a broadcast every poll were a third
of a two-rank agent's CPU (each test of a request drives Open MPI's TCP transport).
A SIGTERM (the job ends, Slurm ends the step) stops the loop; the master then
marks the plane stopped and stops Redis.

It fails open: whatever breaks here (Redis, a ring, MPI, this code), the training job
runs on. The pause gate lets go by itself after its timeout if nobody resumes it, and
this process resumes every ring it paused before it exits.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from greyhound.control import mpi_wait, store
from greyhound.control.agent import AgentConfig, NodeAgent
from greyhound.control.events import append_event
from greyhound.control.master import Master, MasterConfig
from greyhound.control.pause import validation_round
from greyhound.control.priority import yield_cpu

log = logging.getLogger("greyhound.control")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlaneConfig:
    agent: AgentConfig = dataclasses.field(default_factory=AgentConfig)
    master: MasterConfig = dataclasses.field(default_factory=MasterConfig)


class _Stop:
    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._set)

    def _set(self, *_: object) -> None:
        self.requested = True


def run(run_dir: Path, *, node: str, config: PlaneConfig, stop: _Stop) -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    nodes = comm.allgather(node)
    # Every pair of agents connects now, while the links are healthy: Open MPI's TCP
    # transport connects a pair on its first message, and a first connect over a link
    # narrowed by a fail-slow failed ("connect() ... Operation now in progress") and
    # hung the plane mid-validation. One connection per pair of nodes.
    comm.alltoall([None] * comm.size)
    redis_proc, address = _start_redis(run_dir, node) if comm.rank == 0 else (None, None)
    address = comm.bcast(address, root=0)
    if address is None:
        return 0
    lowered = yield_cpu()       # after Redis started: it keeps the job's priority
    client = address.client()
    agent = NodeAgent(run_dir, node, config=config.agent)
    master = None
    try:
        if comm.rank == 0:
            master = Master(run_dir, client, nodes=nodes, config=config.master, poll_s=config.agent.poll_s,
                            planner=_planner(client, run_dir, config.agent.poll_s))
            append_event(run_dir, "control_plane_started", master_node=node, nodes=nodes,
                         poll_s=config.agent.poll_s, pid=os.getpid(), nice=lowered)
        # The master beats while it waits for the others too: an agent slowed by a
        # congested link (its Redis round trips take seconds) is not a dead master.
        beat = master.heartbeat if master is not None else (lambda: None)
        round_call = _RoundCall(comm)
        while not stop.requested:
            t0 = time.monotonic()
            agent.poll()
            agent.publish(client)
            request = None
            if master is not None and not stop.requested:   # the job is ending: Redis may be gone
                master.step()
                request = master.take_request()
                if request is not None:
                    round_call.call()
            if request is not None or round_call.called():
                if not _together(comm, stop, beat):       # every agent is in (within a poll)
                    break
                outcome = validation_round(comm, agent, comm.bcast(request, root=0), nodes=nodes, beat=beat,
                                           stopped=lambda: stop.requested)
                if master is not None:
                    master.complete_validation(outcome)
            until_next_poll(agent, client, master, until=t0 + config.agent.poll_s,
                            every_s=config.agent.watch_poll_s, stopped=lambda: stop.requested)
    except Exception as exc:
        agent.resume()
        if not stop.requested:      # at the job's end Redis or a peer may go first: not a failure
            log.debug("control plane failed", exc_info=True)
            print(f"greyhound: control plane: {node}: {type(exc).__name__}: {exc}; the job runs on without it",
                  file=sys.stderr, flush=True)
            if comm.rank == 0:
                _mark(client, run_dir, "failed", why=f"{type(exc).__name__}: {exc}")
    finally:
        agent.resume()
        agent.close()
    if comm.rank == 0:
        if stop.requested:
            _mark(client, run_dir, "stopped")
        from greyhound.control.redis_server import stop_redis

        assert redis_proc is not None  # rank 0 started it: the address is not None
        stop_redis(redis_proc)
    return 0


def _start_redis(run_dir: Path, node: str):
    """Starts the job's Redis on the master's node; (process, address), or (None, None)
    with one ``greyhound:`` line and an event when it cannot (fail open: the job runs)."""
    from greyhound.control.redis_server import start_redis
    from greyhound.slurm_client import connect

    try:
        host = connect().node_address(node)
    except Exception:  # noqa: BLE001  (no Slurm answer: the address the host name resolves to)
        host = socket.gethostbyname(socket.gethostname())
    try:
        return start_redis(run_dir, host=host)
    except Exception as exc:  # noqa: BLE001  (fail open: the job runs, only recorded)
        print(f"greyhound: control plane: cannot start the job's Redis: {exc}; greyhound only records "
              "this job", file=sys.stderr, flush=True)
        append_event(run_dir, "control_plane_failed", why=str(exc))
        return None, None


def until_next_poll(agent: NodeAgent, client, master: Master | None, *, until: float, every_s: float,
                    stopped: Callable[[], bool]) -> None:
    """Waits for the next regular poll at ``until`` (monotonic), polling in between while
    this node's detectors weigh a candidate change: poll, publish and (on the master's
    node) look for a slow job every ``every_s``. A healthy job's polls stay ``poll_s``
    apart: the plane's cost is per poll."""
    while not stopped() and agent.watching() and time.monotonic() + every_s < until:
        time.sleep(every_s)
        agent.poll(between=True)
        agent.publish(client, between=True)
        if master is not None and not stopped():
            master.watch()
    time.sleep(max(0.0, until - time.monotonic()))


def _planner(client, run_dir: Path, poll_s: float):
    """The mitigation planner under ``--greyhound=mitigate``; None in detect mode."""
    if os.environ.get("GREYHOUND_MODE") != "mitigate":
        return None
    from greyhound.mitigate.planner import Planner, PlannerConfig

    slurm = _slurm()
    config = PlannerConfig(requeue=os.environ.get("GREYHOUND_REQUEUE", "on") != "off",
                           requeue_hold_s=_requeue_hold_s(slurm))
    return Planner(client, run_dir, config=config, job=_slurm_job(), slurm=slurm, poll_s=poll_s)


def _requeue_hold_s(slurm) -> float:
    """The cluster's hold on a requeued job, for S4's cost; Slurm's default when it
    cannot be read (the planner is still useful with a rougher cost)."""
    from greyhound.slurm_client import DEFAULT_CRED_EXPIRE_S

    if slurm is None:
        return DEFAULT_CRED_EXPIRE_S
    try:
        return slurm.requeue_hold_s()
    except Exception:
        log.debug("cannot read the cluster's requeue hold", exc_info=True)
        return DEFAULT_CRED_EXPIRE_S


def _slurm_job() -> dict | None:
    """This job as S4 needs it (id, partition, node count), from the step's Slurm
    environment; None outside Slurm."""
    env = os.environ
    if not all(env.get(k) for k in ("SLURM_JOB_ID", "SLURM_JOB_PARTITION", "SLURM_JOB_NUM_NODES")):
        return None
    return {"id": env["SLURM_JOB_ID"], "partition": env["SLURM_JOB_PARTITION"],
            "num_nodes": int(env["SLURM_JOB_NUM_NODES"])}


def _slurm():
    try:
        from greyhound.slurm_client import connect

        return connect()
    except Exception:
        log.debug("no Slurm client", exc_info=True)
        return None


def _together(comm, stop: _Stop, beat) -> bool:
    """A barrier that a stop request (the job ending) interrupts: False then."""
    return _wait(comm.Ibarrier(), stop, beat)


class _RoundCall:
    """Rank 0 calls the other ranks into a validation round: a one-byte message to each,
    which they test for once a poll (one test, not a collective: an idle agent costs
    nothing in MPI). They join within a poll; the round starts with a barrier."""

    TAG = 0x6772    # "gr"
    _ONE = np.ones(1, dtype=np.int8)   # the send buffer must outlive the sends

    def __init__(self, comm) -> None:
        self._comm = comm
        self._flag = np.zeros(1, dtype=np.int8)
        self._recv = comm.Irecv(self._flag, source=0, tag=self.TAG) if comm.rank else None
        self._sends: list = []

    def call(self) -> None:
        """Rank 0: calls every other rank into the round."""
        self._sends = [s for s in self._sends if not s.Test()]
        self._sends += [self._comm.Isend(self._ONE, dest=r, tag=self.TAG) for r in range(1, self._comm.size)]

    def called(self) -> bool:
        """The other ranks: whether rank 0 has called this rank into a round (then
        listens for the next call)."""
        if self._recv is None or not self._recv.Test():
            return False
        self._recv = self._comm.Irecv(self._flag, source=0, tag=self.TAG)
        return True


def _wait(request, stop: _Stop, beat) -> bool:
    """Waits for a non-blocking MPI request; False when a stop request interrupts it."""
    return mpi_wait.wait(request, beat=beat, stopped=lambda: stop.requested)


def _mark(client, run_dir: Path, state: str, **fields) -> None:
    # The event log first: at the job's end Slurm signals Redis with this process and
    # kills both KillWait seconds later; the log is what `greyhound status` reads then.
    append_event(run_dir, "control_plane_stopped" if state == "stopped" else "control_plane_failed", **fields)
    try:
        store.set_plane_state(client, state, **fields)
    except Exception:  # noqa: BLE001  (Redis is gone too: the event log says it)
        pass


def main() -> None:
    logging.basicConfig(level=os.environ.get("GREYHOUND_LOG_LEVEL", "WARNING"),
                        format="greyhound: control plane: %(message)s")
    stop = _Stop()
    run_dir = os.environ.get("GREYHOUND_RUN_DIR")
    if not run_dir:
        print("greyhound: control plane: GREYHOUND_RUN_DIR is not set; nothing to watch", file=sys.stderr)
        return
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    try:
        config = PlaneConfig(agent=AgentConfig(poll_s=float(os.environ.get("GREYHOUND_POLL_S",
                                                                           AgentConfig().poll_s))))
    except ValueError as exc:
        config = PlaneConfig()
        print(f"greyhound: control plane: GREYHOUND_POLL_S: {exc}; using {config.agent.poll_s}", file=sys.stderr)
    try:
        run(Path(run_dir), node=node, config=config, stop=stop)
    except Exception as exc:  # noqa: BLE001  (fail open, always)
        print(f"greyhound: control plane: {type(exc).__name__}: {exc}; the job runs on without it",
              file=sys.stderr, flush=True)
    # No MPI_Finalize: at the job's end a peer may already be gone, and finalize would
    # wait for it until Slurm kills this process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
