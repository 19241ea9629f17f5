"""The node agent: reads this node's rings, tracks every rank, publishes to the job's Redis.

One agent runs on each node of the job (one rank of the control plane's MPI world).
Every poll it

1. opens the rings that appeared in the run directory and belong to this node (the
   ring header names the Slurm node its writer ran on: emulated nodes share a host
   and a run directory), one per training process;
2. reads what each ring gained since the last poll and feeds it to that process's
   tracker (:class:`greyhound.analytics.tracker.RankTracker`: period, iteration
   numbering, BOCD+V, lost records);
3. sums each communicator's calls over the last iterations: bytes, seconds and calls
   per iteration, for the master's comparison of groups that move the same bytes
   (a collective's duration on the rank that arrives last is its transfer time; on the
   others it includes the wait, so the member with the shortest durations arrives last);
4. publishes each rank's state and new iteration times (store.py says where); while
   the plane is quiet, only what is new (:meth:`NodeAgent.publish`).

It owns nothing in the rings but its read position; the gate belongs to the master's
pause, which it carries out for the ranks of its node (:meth:`NodeAgent.pause`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import time
from pathlib import Path

import numpy as np

from greyhound.analytics.tracker import RankTracker
from greyhound.control import store
from greyhound.control.validate import RankClock
from greyhound.ring import CALL_OPS, COLLECTIVE_OPS, OP, OP_NAMES, RingError, RingReader, op_mask, ring_paths

log = logging.getLogger(__name__)


def polls_in(seconds: float, poll_s: float) -> int:
    """The whole polls (at least one) that make up a window of ``seconds``: the plane's
    windows are set in seconds, so a different poll interval keeps what they cover."""
    return max(1, round(seconds / poll_s))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AgentConfig:
    poll_s: float = 1.0
    """Seconds between polls of the rings (at most 1 s keeps detection within seconds;
    half a second cost the plane twice the CPU, almost all of it per poll)."""
    watch_poll_s: float = 0.25
    """Seconds between the polls in between (:meth:`NodeAgent.watching`) while a rank's
    detector weighs a candidate change: it accepts one on the candidate's 4th slow
    iteration, and a poll a second apart reported that up to a second later (median 4
    iterations past the onset at the 1 s poll, 3 at 0.5 s). No effect at ``poll_s`` at
    or below it."""
    comm_window_iterations: int = 10
    """Iterations the per-communicator figures cover."""
    comm_every_s: float = 2.0
    """Seconds between updates of the per-communicator figures (profiling reads them),
    appends to the published iteration times, and updates of the figures only
    ``greyhound status`` shows (``window_s``, ``counters``)."""
    summary_every_s: float = 10.0
    """Seconds between full recomputations of a rank's slow interval and baseline when
    no change point came (a change point recomputes them at once)."""
    quiet_publish_s: float = 5.0
    """Seconds between publishes while the plane is quiet (store.QUIET) and this node's
    ranks have nothing new (:meth:`NodeAgent.publish`): the figures only ``greyhound
    status`` reads then are at most this old."""

    def __post_init__(self) -> None:
        if not 0 < self.poll_s <= 10:
            raise ValueError(f"poll_s={self.poll_s} must be in (0, 10] seconds")
        if not self.watch_poll_s > 0:
            raise ValueError(f"watch_poll_s={self.watch_poll_s} must be > 0 seconds")
        if not (self.comm_every_s > 0 and self.summary_every_s > 0 and self.quiet_publish_s > 0):
            raise ValueError("comm_every_s, summary_every_s and quiet_publish_s must be > 0")
        if self.comm_window_iterations < 1:
            raise ValueError(f"comm_window_iterations={self.comm_window_iterations} must be >= 1")


class PollWindow:
    """(wall, inside calls, iterations completed, waiting for a CPU) of a rank's last
    ``history`` polls, with running sums over the newest ``recent`` (:attr:`recent`)
    and the ones before them (:attr:`older`): both are read every poll, and summing
    seventy tuples was a fifth of a rank's publish. Seconds are kept as integer
    nanoseconds, so the running sums are exact however long the job runs."""

    def __init__(self, poll_s: float) -> None:
        self.recent_polls = polls_in(RECENT_S, poll_s)
        self.history_polls = polls_in(HISTORY_S, poll_s) + self.recent_polls
        self._recent: collections.deque[tuple[int, ...]] = collections.deque()
        self._older: collections.deque[tuple[int, ...]] = collections.deque()
        self.recent: tuple[int, ...] = (0, 0, 0, 0)
        self.older: tuple[int, ...] = (0, 0, 0, 0)

    def append(self, poll: tuple[float, ...]) -> None:
        """One poll: (wall s, inside calls s, iterations[, waiting for a CPU s])."""
        wall_s, blocked_s, iterations, *waited = poll
        entry = (round(wall_s * 1e9), round(blocked_s * 1e9), int(iterations), round((waited or [0.0])[0] * 1e9))
        self._recent.append(entry)
        self.recent = _plus(self.recent, entry)
        if len(self._recent) > self.recent_polls:
            moved = self._recent.popleft()
            self.recent = _plus(self.recent, moved, -1)
            self._older.append(moved)
            self.older = _plus(self.older, moved)
            if len(self._older) > self.history_polls - self.recent_polls:
                self.older = _plus(self.older, self._older.popleft(), -1)

    def __len__(self) -> int:
        return len(self._recent) + len(self._older)


def _plus(sums: tuple, entry: tuple, sign: int = 1) -> tuple:
    return tuple(a + sign * b for a, b in zip(sums, entry, strict=True))


@dataclasses.dataclass
class _Process:
    """One training process on this node: its ring and its tracker."""

    reader: RingReader
    tracker: RankTracker
    polls: PollWindow
    """(wall seconds, seconds inside calls, iterations completed) of the recent polls."""
    published_iterations: int = 0
    republish: bool = False
    """The published iteration times were withdrawn: send the list anew."""
    summary_cache: tuple | None = None
    """(change points seen, the slow-interval fields) of the last full summary."""
    last_poll: float | None = None
    unwindowed: tuple[float, float, int, float] = (0.0, 0.0, 0, 0.0)
    """The polls in between since the last poll that went into :attr:`polls`, summed:
    a window's entry covers a whole ``poll_s`` however often the agent looked."""
    sent: dict = dataclasses.field(default_factory=dict)
    """The rank's fields as last published (``store.publish_rank`` sends the changed ones)."""
    run_delay_ns: int | None = None
    """The process's main thread's seconds waiting for a CPU (schedstat) at the last
    poll, in ns; None where the kernel does not say."""

    def compute_share(self) -> float | None:
        """Fraction of the recent wall time the process spent outside communication calls."""
        wall, blocked, _, _ = self.polls.recent
        if wall <= 0:
            return None
        return max(0.0, 1.0 - blocked / wall)

    def compute_per_iteration(self) -> tuple[float | None, float | None]:
        """(recent, baseline) seconds a training iteration spends outside communication
        calls: over the last ``RECENT_S`` seconds of polls, and over the ones before them.

        A rank's own work per iteration stays what it was unless that rank slows: the
        ranks that wait for a slow one wait inside calls. So the rank whose figure rose
        against its own past is the compute straggler, whatever its pipeline stage
        (stages differ in their share of compute; a rank is compared with itself).
        """
        return _per_iteration(self.polls.recent), _per_iteration(self.polls.older)

    def cpu_wait_share(self) -> tuple[float | None, float | None]:
        """(recent, baseline) fraction of the wall time the process's main thread was
        ready to run and waited for a CPU: a CPU quota that throttles it, or other work
        on its cores. Its work per iteration misses such a rank where the stops land
        inside its calls (a throttled rank's work per iteration read 0.3x its own past
        in the two-straggler cluster test); this does not: throttled ranks waited
        0.6-0.9 of each second, the others 0.01-0.03 (before the quota, all of them
        0.1-0.5 on 2 shared cores)."""
        if self.run_delay_ns is None:
            return None, None
        return _waited(self.polls.recent), _waited(self.polls.older)


def _waited(sums: tuple[int, ...]) -> float | None:
    wall, _, _, waited = sums
    return waited / wall if wall > 0 else None


def run_delay_ns(pid: int) -> int | None:
    """Nanoseconds the process's main thread has waited on a run queue
    (/proc/PID/schedstat, second field: CPU quota throttling counts too); None where
    the kernel has no schedstat or the process is gone."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _per_iteration(sums: tuple[int, ...]) -> float | None:
    wall, blocked, iterations, _ = sums
    if iterations < MIN_ITERATIONS:
        return None
    return max(0, wall - blocked) / iterations * 1e-9


RECENT_S = 5.0
"""Seconds of polls the recent figures cover."""
HISTORY_S = 30.0
"""Seconds of polls before the recent ones that the baseline covers (a slowdown found
within seconds of its onset leaves it clean)."""
MIN_ITERATIONS = 3
STALLED_S = 2.0
"""A poll this long (and at least two intervals) after the previous one spans a stall of
the plane (a validation round): its figures are not counted."""
_IS_BLOCKING = op_mask(CALL_OPS | {OP["Wait"]})
_IS_COLLECTIVE = op_mask(COLLECTIVE_OPS)
CLOCK_ITERATIONS = 3
"""Iterations a rank's clock reads back: its last two step ends at least."""
CLOCK_CALLS = 4096
"""Calls a rank's clock reads back while its tracker has no lock: several steps of a
pipeline stage with many micro-batches."""


def _syncs(collective: np.ndarray) -> np.ndarray:
    """The rows of a step's gradient sync: the collectives of the communicator whose
    collectives move the most bytes (a plan broadcast or a loss all-reduce is small).
    Cutting every rank right after its sync keeps them in step, wherever each
    tracker's iteration begins within a step."""
    comms, inverse = np.unique(collective["comm_id"], return_inverse=True)
    moved = np.bincount(inverse.reshape(-1), weights=collective["size_bytes"].astype(np.float64),
                        minlength=len(comms))
    return collective[collective["comm_id"] == comms[int(np.argmax(moved))]]


def _step_ends(sync: np.ndarray, per_step: int) -> tuple[np.ndarray, int]:
    """The syncs that end a step (the last of each step's ``per_step``), oldest first,
    and the calls between the last of them and the one a step before (0: not kept)."""
    ends = sync[sync["comm_ordinal"] % per_step == per_step - 1]
    if not len(ends):
        return ends, 0
    cut = ends[-1]
    before = ends[ends["comm_ordinal"] == cut["comm_ordinal"] - per_step]
    return ends, int(cut["call_number"] - before["call_number"][0]) if len(before) else 0


def blocked_seconds(records: np.ndarray) -> float:
    """Seconds the process spent inside communication calls and waits among records
    (an async call's record is its enqueue; its wait is timed by its Wait record)."""
    # The two time fields alone: selecting whole 64-byte records first was a tenth of
    # an agent's poll.
    inside = _IS_BLOCKING[records["op"]]
    if not inside.any():
        return 0.0
    spans = records["t_end_ns"][inside].astype(np.int64) - records["t_start_ns"][inside].astype(np.int64)
    return float(spans.clip(min=0).sum()) / 1e9


def _unlocked_clock(proc: _Process) -> RankClock | None:
    """A rank's clock from its last ``CLOCK_CALLS`` calls, without its tracker's
    iterations: after an S2 split change the tracker re-locks for up to 16 steps, and
    a validation round then could not place the pause. The step's syncs are the runs of
    consecutive collectives on the sync communicator (the first run and the last may
    be cut by the window or in progress), the step time the time between the last
    step ends. Placed by step count only (``iteration`` is -1: no time path)."""
    rows = proc.tracker.arrivals(last_calls=CLOCK_CALLS)
    collective = rows[_IS_COLLECTIVE[rows["op"]]]
    if not len(collective):
        return None
    sync = _syncs(collective)
    breaks = np.flatnonzero(np.diff(sync["call_number"]) != 1) + 1
    runs = np.diff(np.concatenate(([0], breaks, [len(sync)])))[1:-1]
    if len(runs) < 2:
        return None
    per_step = max(1, int(np.median(runs)))
    ends, step_calls = _step_ends(sync, per_step)
    if len(ends) < 3 or not step_calls:
        return None
    cut, info = ends[-1], proc.reader.info
    return RankClock(
        rank=info.rank, iteration=-1, iteration_s=float(np.median(np.diff(ends["t_end_ns"][-4:]))) * 1e-9,
        started_s=float(info.unix_seconds(int(cut["t_end_ns"]))), cut_step=int(cut["comm_ordinal"]) // per_step,
        cut_call=int(cut["call_number"]), step_calls=step_calls)


def recent_median(times: np.ndarray) -> float:
    """Median of the last three iteration times (one slow iteration does not move it);
    in Python: np.median on three numbers cost 40 us, a tenth of a rank's poll."""
    last = sorted(float(t) for t in times[-3:])
    return last[len(last) // 2] if len(last) % 2 else (last[0] + last[1]) / 2


def release(proc: _Process) -> None:
    """Lets the rank go on from the pause gate. The seconds it was held there are
    greyhound's, not the job's: its tracker measures the iteration without them."""
    since = proc.reader.parked_since_ns
    if since is not None:
        proc.tracker.hold(since, time.monotonic_ns())
    proc.reader.resume()


class NodeAgent:
    """The rings of one node and their trackers."""

    def __init__(self, run_dir: str | os.PathLike, node: str, *, config: AgentConfig | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.node = node
        self.config = config or AgentConfig()
        self.processes: dict[Path, _Process] = {}
        self._foreign: set[Path] = set()
        self._polls = 0
        self.between_polls = 0
        """Polls in between (:meth:`watching`) so far."""
        self._comm_every = polls_in(self.config.comm_every_s, self.config.poll_s)
        self._summary_every = polls_in(self.config.summary_every_s, self.config.poll_s)
        self._listed: int | None = None
        """The run dir's mtime (ns) when it was last listed with every ring opened."""
        self.quiet = False
        """The master's store.QUIET as last read: nothing waits for this node's figures."""
        self._published_at = -math.inf
        """When (monotonic s) the last regular publish went out."""
        self._comms_at: int | None = None
        """The regular poll whose publish last carried the comm figures."""

    def discover(self) -> None:
        """Opens the rings of this node that appeared since the last call.

        The run dir is listed again only when its mtime changed (a ring file was
        created), it had changed within the last second, or a ring was not ready at
        the last listing: listing it every poll was a twentieth of an agent's cost."""
        try:
            mtime = os.stat(self.run_dir).st_mtime_ns
        except OSError:
            mtime = None
        if mtime is not None and mtime == self._listed:
            return
        ready = True
        for path in ring_paths(self.run_dir):
            if path in self.processes or path in self._foreign:
                continue
            try:
                reader = RingReader(path)
            except RingError as exc:   # not ready yet (magic written last), or not ours
                log.debug("%s", exc)
                ready = False
                continue
            if reader.info.node != self.node:
                reader.close()
                self._foreign.add(path)
                continue
            self.processes[path] = _Process(reader=reader, tracker=RankTracker(rank=reader.info.rank),
                                            polls=PollWindow(self.config.poll_s))
        # A file created in the same tick of the kernel's coarse clock as the listing
        # leaves the mtime as it was: trust an mtime only once it is a second old.
        settled = mtime is not None and time.time_ns() - mtime > 1_000_000_000
        self._listed = mtime if ready and settled else None

    def poll(self, *, between: bool = False) -> None:
        """Reads every ring and feeds its tracker; ``between``: a poll in between
        (:meth:`watching`), whose figures join the next regular poll's window entry."""
        self.discover()
        self.between_polls += between
        now = time.monotonic()
        for proc in self.processes.values():
            batch = proc.reader.read()
            before_ns, now_ns = proc.run_delay_ns, run_delay_ns(proc.reader.info.pid)
            proc.run_delay_ns = now_ns
            waited_s = (now_ns - before_ns) / 1e9 if now_ns is not None and before_ns is not None else 0.0
            was_locked = proc.tracker.locked
            update = proc.tracker.feed(batch.records, lost=batch.lost)
            # The poll that locks on reports every iteration since the warm-up at once,
            # and a re-lock withdraws some: neither is this poll's work. Nor is a poll
            # that spans a validation round: its parked seconds are outside any call's
            # record yet, and would read as seconds of work on every rank.
            if proc.last_poll is not None and was_locked and update.withdrawn_from is None and \
                    now - proc.last_poll < max(STALLED_S, 2 * self.config.poll_s):
                proc.unwindowed = _plus(proc.unwindowed, (now - proc.last_poll, blocked_seconds(batch.records),
                                                          len(update.iteration_times), waited_s))
            if not between:
                if proc.unwindowed[0] > 0:
                    proc.polls.append(proc.unwindowed)
                proc.unwindowed = (0.0, 0.0, 0, 0.0)
            proc.last_poll = now
            if update.withdrawn_from is not None:     # a re-lock renumbered these iterations
                proc.published_iterations = min(proc.published_iterations, update.withdrawn_from)
                proc.republish = True

    def watching(self) -> bool:
        """Whether a rank's detector weighs a candidate change now: the plane then polls
        every ``watch_poll_s`` until the next regular poll, so the change is reported
        as soon as the detector accepts it. A healthy job's candidates are rare and
        short (a spike is dropped at the next normal iteration)."""
        return any(proc.tracker.pending_change is not None for proc in self.processes.values())

    def comm_stats(self, proc: _Process) -> dict[str, dict]:
        """Per communicator over the last iterations: bytes, seconds and calls per
        iteration, and the op its calls are mostly of."""
        tracker = proc.tracker
        last = tracker.num_iterations - 1
        first = max(0, last - self.config.comm_window_iterations + 1)
        if last < 0:
            return {}
        rows = tracker.arrivals(first, last)
        if not len(rows):
            return {}
        iterations = last - first + 1
        out = {}
        for comm in np.unique(rows["comm_id"]):
            mine = rows[rows["comm_id"] == comm]
            ops, counts = np.unique(mine["op"], return_counts=True)
            out[str(int(comm))] = {
                "bytes_per_iter": float(mine["size_bytes"].sum()) / iterations,
                "seconds_per_iter": float(np.nansum(mine["seconds"])) / iterations,
                "calls_per_iter": len(mine) / iterations,
                "op": OP_NAMES[int(ops[np.argmax(counts)])],
            }
        return out

    def summary(self, proc: _Process, *, refresh: bool = False) -> dict:
        """A rank's tracking state as the store keeps it (``rank:{rank}``). The slow
        interval and baseline are worked out again (a pass over the whole series) only
        when the change points changed or on ``refresh`` (every ``summary_every_s``)."""
        tracker = proc.tracker
        n = tracker.num_iterations
        cached = proc.summary_cache
        if cached is None or cached[0] != len(tracker.changepoints) or refresh:
            detection = tracker.detection()
            slow = detection.slow_intervals[-1] if detection.slow_intervals and \
                detection.slow_intervals[-1].end_index is None else None
            cached = (len(tracker.changepoints), {
                "baseline_s": None if not n else float(detection.baseline_iteration_time),
                "slowdown": None if slow is None else round(float(slow.slowdown), 4),
                "slow_since": None if slow is None else slow.start_index,
                # Encoded once here, not at every publish of the unchanged list.
                "changepoints": store.dumps([c.as_dict() for c in detection.changepoints[-5:]]),
            })
            proc.summary_cache = cached
        times = tracker.iteration_times
        return {"period": tracker.period, "iterations": n,
                "current_s": recent_median(times) if n else None,
                "lost": tracker.lost_records, **cached[1]}

    @staticmethod
    def clock(proc: _Process) -> RankClock | None:
        """Where the rank stands (for the consistent pause): its last step's gradient
        sync (the cut point: its time, position, call number and the steps done by
        then), the calls of its last step, and its iteration time; None until the
        tracker has locked on, or (re-locking after a split change) its last step's
        sync and step length from its last calls alone (:func:`_unlocked_clock`)."""
        tracker = proc.tracker
        n = tracker.num_iterations
        if proc.reader.info.rank < 0:
            return None
        if not tracker.locked or n < 2:
            return _unlocked_clock(proc)
        rows = tracker.arrivals(max(0, n - CLOCK_ITERATIONS), n - 1)
        last = rows[rows["iteration"] == n - 1]
        if not len(last):
            return None
        info, iteration_s = proc.reader.info, recent_median(tracker.iteration_times)
        collective = rows[_IS_COLLECTIVE[rows["op"]]]
        if not len(collective):
            first = last[np.argmin(last["position"])]
            return RankClock(rank=info.rank, iteration=n - 1, iteration_s=iteration_s,
                             started_s=float(info.unix_seconds(int(first["t_start_ns"]))))
        sync = _syncs(collective)
        # The syncs of one step: those of the last iteration over the runs they come in
        # (a tracker that took two steps for one iteration sees two runs, one a step).
        in_last = sync["position"][sync["iteration"] == n - 1]
        per_step = max(1, len(in_last) // max(1, 1 + int(np.count_nonzero(np.diff(in_last) != 1))))
        ends, step_calls = _step_ends(sync, per_step)
        if not len(ends):
            return None
        cut = ends[-1]
        return RankClock(
            rank=info.rank, iteration=int(cut["iteration"]), iteration_s=iteration_s,
            # A collective ends at the same moment on all its members, however early each
            # entered it (a replica ahead waits inside): its end is the step's time.
            started_s=float(info.unix_seconds(int(cut["t_end_ns"]))), cut_position=int(cut["position"]),
            cut_step=int(cut["comm_ordinal"]) // per_step, cut_call=int(cut["call_number"]),
            step_calls=step_calls)

    def publish(self, client, *, between: bool = False) -> None:
        """Each rank's state, new iteration times and (every few polls) comm figures,
        and the agent's heartbeat: one round trip to Redis. ``between``: after a poll
        in between, the state alone (the regular polls keep their count).

        While the master says the plane is quiet (no episode open, no plan watched) and
        no rank here has news (:meth:`_news`), a regular poll sends only a read of that
        flag, and everything goes out every ``quiet_publish_s``: a healthy job's
        figures change by noise from poll to poll, nobody acts on them, and sending
        them was a third of an agent's CPU. News goes out at once, and every poll
        while the master profiles, validates or watches a plan."""
        now = time.monotonic()
        if not between:
            self._polls += 1
        refresh = not between and self._polls % self._summary_every == 0
        news = between or self._news()
        if not between and self.quiet and not refresh and not news \
                and now - self._published_at < self.config.quiet_publish_s:
            self.quiet = client.hget(store.PLANE, store.QUIET) == "1"
            if self.quiet:
                return          # else the master wants the figures again: now
        with_comms = not between and (self._comms_at is None or self._polls - self._comms_at >= self._comm_every)
        if with_comms:
            self._comms_at = self._polls
        pipe = client.pipeline(transaction=False)
        ranks = []
        for proc in self.processes.values():
            info, tracker = proc.reader.info, proc.tracker
            rank = info.rank if info.rank >= 0 else info.pid
            ranks.append(rank)
            n = tracker.num_iterations
            # The iteration list is appended every few polls, with the comm figures:
            # it was two of the three commands a rank's poll sent, and no decision
            # reads it (the fields below carry what the master uses).
            restart, new = proc.republish, []
            if restart or with_comms:
                proc.republish = False
                first = 0 if restart else proc.published_iterations
                new = tracker.iteration_times[max(first, n - store.ITERATIONS_KEPT):].tolist()
                proc.published_iterations = n
            fields = {
                "node": self.node, "pid": info.pid, **self.summary(proc, refresh=refresh),
                "compute_share": proc.compute_share(),
                **dict(zip(("compute_s", "compute_base_s"), proc.compute_per_iteration())),
                **dict(zip(("cpu_wait", "cpu_wait_base"), proc.cpu_wait_share())),
            }
            if with_comms:      # shown by `greyhound status` only: no decision waits for them
                window = tracker.iteration_times[-self.config.comm_window_iterations:]
                fields["window_s"] = float(window.mean()) if len(window) else None
                fields["counters"] = proc.reader.counters()
            store.publish_rank(pipe, rank, new_times=new, restart=restart, fields=fields,
                               comms=self.comm_stats(proc) if with_comms else None, sent=proc.sent)
        pipe.hset(store.agent_key(self.node), mapping={
            "heartbeat": time.time(), "ranks": store.dumps(sorted(ranks)),
            "cpu_s": time.process_time(), "between_polls": self.between_polls,
        })
        if news:
            pipe.incr(store.NEWS)
        pipe.hget(store.PLANE, store.QUIET)
        self.quiet = pipe.execute()[-1] == "1"
        if not between:
            self._published_at = now

    def _news(self) -> bool:
        """Whether a rank of this node has what the master acts on and it has not seen:
        a candidate change being weighed, a change point, a slow interval opened or
        closed since the last publish, a re-numbering, or a rank not published yet. A
        slow interval the master has seen is not news: it reads the ranks every
        ``quiet_reread_s`` anyway."""
        for proc in self.processes.values():
            tracker, cached = proc.tracker, proc.summary_cache
            if proc.republish or tracker.pending_change is not None or cached is None \
                    or cached[0] != len(tracker.changepoints) \
                    or proc.sent.get("slow_since", "") != store.encode_field(cached[1]["slow_since"]):
                return True
        return False

    # ---- the pause, carried out on this node's ranks -------------------------------

    def pause(self) -> None:
        for proc in self.processes.values():
            proc.reader.pause()

    def resume(self) -> None:
        for proc in self.processes.values():
            release(proc)

    def parked(self) -> int:
        """How many of this node's processes have a thread held at the gate now."""
        return sum(1 for proc in self.processes.values() if proc.reader.parked > 0)

    def close(self) -> None:
        for proc in self.processes.values():
            proc.reader.close()
        self.processes.clear()

