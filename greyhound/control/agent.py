"""The node agent: reads this node's rings, tracks every rank, publishes to the job's Redis.

One agent runs on each node of the job (one rank of the control plane's MPI world).
Every poll it

1. opens the rings that appeared in the run directory and belong to this node (the
   ring header names the Slurm node its writer ran on: emulated nodes share a host
   and a run directory), one per training process;
2. reads what each ring gained since the last poll and feeds it to that process's
   tracker (:class:`greyhound.analytics.tracker.RankTracker`: period, iteration
   numbering, BOCD+V, lost records);
3. sums each communicator's calls over a window of recent polls: bytes, seconds and
   calls per iteration, for the master's comparison of groups that move the same bytes
   (a collective's duration on the rank that arrives last is its transfer time; on the
   others it includes the wait, so the member with the shortest durations arrives last);
4. publishes each rank's state and new iteration times (store.py says where).

It owns nothing in the rings but its read position; the gate belongs to the master's
pause, which it carries out for the ranks of its node (:meth:`NodeAgent.pause`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from pathlib import Path

import numpy as np

from greyhound.control import store
from greyhound.ring import CALL_OPS, OP_NAMES, RingError, RingReader, ring_paths

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AgentConfig:
    poll_s: float = 0.5
    """Seconds between polls of the rings (at most 1 s keeps detection within seconds)."""
    comm_window_polls: int = 20
    """Polls the per-communicator sums cover."""

    def __post_init__(self) -> None:
        if not 0 < self.poll_s <= 10:
            raise ValueError(f"poll_s={self.poll_s} must be in (0, 10] seconds")
        if self.comm_window_polls < 1:
            raise ValueError(f"comm_window_polls={self.comm_window_polls} must be >= 1")


@dataclasses.dataclass
class _Process:
    """One training process on this node: its ring, its tracker, its recent comm sums."""

    reader: RingReader
    tracker: object
    comm_window: collections.deque
    published_iterations: int = 0


def comm_sums(records: np.ndarray) -> dict[int, np.ndarray]:
    """Per communicator: [bytes, seconds, calls] of the call records, shape (3,) each."""
    calls = records[np.isin(records["op"], list(CALL_OPS))]
    out: dict[int, np.ndarray] = {}
    if len(calls) == 0:
        return out
    seconds = (calls["t_end_ns"].astype(np.int64) - calls["t_start_ns"].astype(np.int64)).clip(min=0) / 1e9
    comms, inverse = np.unique(calls["comm_id"], return_inverse=True)
    for i, comm in enumerate(comms):
        mine = inverse == i
        out[int(comm)] = np.array([float(calls["size_bytes"][mine].sum()), float(seconds[mine].sum()),
                                   float(mine.sum())])
    return out


def comm_ops(records: np.ndarray) -> dict[int, str]:
    """The op name each communicator's calls are mostly of."""
    calls = records[np.isin(records["op"], list(CALL_OPS))]
    out = {}
    for comm in np.unique(calls["comm_id"]):
        ops, counts = np.unique(calls["op"][calls["comm_id"] == comm], return_counts=True)
        out[int(comm)] = OP_NAMES[int(ops[np.argmax(counts)])]
    return out


class NodeAgent:
    """The rings of one node and their trackers."""

    def __init__(self, run_dir: str | os.PathLike, node: str, *, tracker_factory,
                 config: AgentConfig | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.node = node
        self.config = config or AgentConfig()
        self._tracker_factory = tracker_factory
        self.processes: dict[Path, _Process] = {}
        self._foreign: set[Path] = set()
        self._ops: dict[int, str] = {}

    def discover(self) -> None:
        """Opens the rings of this node that appeared since the last call."""
        for path in ring_paths(self.run_dir):
            if path in self.processes or path in self._foreign:
                continue
            try:
                reader = RingReader(path)
            except RingError as exc:   # not ready yet (magic written last), or not ours
                log.debug("%s", exc)
                continue
            if reader.info.node != self.node:
                reader.close()
                self._foreign.add(path)
                continue
            self.processes[path] = _Process(reader=reader, tracker=self._tracker_factory(reader.info),
                                            comm_window=collections.deque(maxlen=self.config.comm_window_polls))

    def poll(self) -> None:
        """Reads every ring and feeds its tracker."""
        self.discover()
        for proc in self.processes.values():
            batch = proc.reader.read()
            proc.tracker.feed(batch.records, lost=batch.lost)
            proc.comm_window.append((comm_sums(batch.records), proc.tracker.iterations))
            self._ops.update(comm_ops(batch.records))

    def comm_stats(self, proc: _Process) -> dict[str, dict]:
        """Per communicator over the window: bytes, seconds and calls per iteration."""
        if len(proc.comm_window) < 2:
            return {}
        iterations = proc.comm_window[-1][1] - proc.comm_window[0][1]
        if iterations <= 0:
            return {}
        total: dict[int, np.ndarray] = {}
        for sums, _ in list(proc.comm_window)[1:]:
            for comm, v in sums.items():
                total[comm] = total.get(comm, 0) + v
        return {str(c): {"bytes_per_iter": v[0] / iterations, "seconds_per_iter": v[1] / iterations,
                         "calls_per_iter": v[2] / iterations, "op": self._ops.get(c, "?")}
                for c, v in total.items()}

    def publish(self, client) -> None:
        """Each rank's state, new iteration times and comm sums; the agent's heartbeat."""
        ranks = []
        for proc in self.processes.values():
            info, tracker = proc.reader.info, proc.tracker
            rank = info.rank if info.rank >= 0 else info.pid
            ranks.append(rank)
            times = tracker.iteration_times
            new = [float(t) for t in times[proc.published_iterations - tracker.iterations:]] \
                if tracker.iterations > proc.published_iterations else []
            new = new[-store.ITERATIONS_KEPT:]
            proc.published_iterations = tracker.iterations
            store.publish_rank(client, rank, new_times=new, fields={
                "node": self.node, "pid": info.pid, **tracker.summary(),
                "counters": proc.reader.counters(),
            })
            stats = self.comm_stats(proc)
            if stats:
                client.hset(store.comms_key(rank), mapping={c: store.dumps(v) for c, v in stats.items()})
        client.hset(store.agent_key(self.node), mapping={
            "heartbeat": time.time(), "ranks": store.dumps(sorted(ranks)),
            "cpu_s": time.process_time(),
        })

    # ---- the pause, carried out on this node's ranks -------------------------------

    def pause(self) -> None:
        for proc in self.processes.values():
            proc.reader.pause()

    def resume(self) -> None:
        for proc in self.processes.values():
            proc.reader.resume()

    def parked(self) -> int:
        """How many of this node's processes have a thread held at the gate now."""
        return sum(1 for proc in self.processes.values() if proc.reader.parked > 0)

    def close(self) -> None:
        for proc in self.processes.values():
            proc.reader.close()
        self.processes.clear()

