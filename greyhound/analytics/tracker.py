"""One rank's online tracking state, for the node agent: ring records in, iteration
times, change points and slow intervals out. Pure: no I/O, no clock, no threads.

The agent polls the rank's ring (:meth:`greyhound.ring.RingReader.read`) and hands
each batch to :meth:`RankTracker.feed`::

    tracker = RankTracker(rank=reader.info.rank)
    while running:
        batch = reader.read()
        update = tracker.feed(batch.records, lost=batch.lost)
        publish(update.iteration_times, update.changepoints, tracker.current_slow_interval)

What it does with them:

- Communication calls (ops of :data:`greyhound.ring.CALL_OPS`) go, in ring order, to
  an :class:`~greyhound.analytics.period.IterationClock`: it locks onto the period
  (calls per iteration, by the ACF rule), numbers the iterations (once locked,
  iteration k of a lock starts at a fixed call; re-locked only when the pattern
  stops repeating, see the clock) and reports each iteration's time as soon as its
  calls are in. The first lock comes max(256 calls, 16 periods) after the first
  clean period, at a call count that does not depend on the polls: 16 iterations at
  16 or more calls per iteration, 64 at 4 (see
  :class:`~greyhound.analytics.period.ClockConfig`); the iterations before it are
  reported then, at once.
- The iteration times go, as they come, to one :class:`~greyhound.analytics.verify.BocdV`
  (the compiled BOCD+V); the slow intervals are
  :func:`~greyhound.analytics.intervals.slow_intervals` of the series and its change
  points. So the tracker's answer is, at the end of a stream, the answer of
  ``greyhound detect`` on the same calls (:func:`~greyhound.analytics.period.iteration_times_from_calls`,
  then :func:`~greyhound.analytics.detect.detect_series`), however the calls were
  split into polls.
- Lost records (overwritten in the ring before the agent read them, or left
  unfinished by a dying writer) show as gaps in ``seq``; they are counted
  (:attr:`RankTracker.lost_records`), and the iterations whose calls span a gap are
  listed (:attr:`TrackerUpdate.gap_iterations`): their time may include calls that
  were never seen, and the iteration numbers after a gap lag the job's by the
  iterations lost (up to ``lost / period``). BOCD+V sees such an iteration as one
  brief disturbance and does not report it.
- Per call, kept for the last ``history_calls`` calls: its iteration and position in
  it, its number among its communicator's collectives (the n-th collective on a
  communicator is the same one on every member, so ranks' arrivals match on
  (comm_id, comm_ordinal); point-to-point calls are numbered apart), its enqueue
  time, and its duration once known (the call's own return for a blocking call, its
  WAIT record for an async one, its DONE record's device time where the hook times
  the device). :meth:`RankTracker.arrivals` and
  :meth:`RankTracker.comm_times` read them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from greyhound.analytics.bocd import BocdConfig
from greyhound.analytics.changepoint import ChangePoint
from greyhound.analytics.detect import Detection
from greyhound.analytics.intervals import SlowInterval, healthy_level, slow_intervals
from greyhound.analytics.period import ClockConfig, IterationClock, Segment
from greyhound.analytics.verify import BocdV, VerifyConfig
from greyhound.ring import COLLECTIVE_OPS, F_ASYNC, F_DEVICE_TIMED, IS_CALL, OP, op_mask

__all__ = ["TrackerConfig", "TrackerUpdate", "RankTracker", "ARRIVAL_DTYPE", "COMM_TIME_DTYPE"]

_WAIT, _DONE = OP["Wait"], OP["Done"]
_IS_COLLECTIVE = op_mask(COLLECTIVE_OPS)
_NEEDED = ("seq", "t_start_ns", "t_end_ns", "size_bytes", "comm_id", "req_id", "op", "flags")

ARRIVAL_DTYPE = np.dtype([
    ("iteration", "<i8"),      # -1: before the first lock (warm-up) or between locks
    ("position", "<i4"),       # index of the call within its iteration
    ("call_number", "<i8"),    # the hook's call number (1, 2, ...; see RingReader.calls)
    ("comm_id", "<u8"),
    ("comm_ordinal", "<i8"),   # 0, 1, ... among this rank's collectives (or p2p calls) on comm_id
    ("op", "<u2"),
    ("size_bytes", "<u8"),
    ("t_start_ns", "<u8"),     # enqueue time (CLOCK_MONOTONIC)
    ("t_end_ns", "<u8"),       # return of the call
    ("seconds", "<f8"),        # duration once known, else NaN
])
"""One row per communication call (:meth:`RankTracker.arrivals`)."""

COMM_TIME_DTYPE = np.dtype([
    ("iteration", "<i8"),
    ("comm_id", "<u8"),
    ("calls", "<i4"),
    ("pending", "<i4"),        # calls whose duration is not known yet
    ("seconds", "<f8"),        # sum of the known durations
    ("size_bytes", "<u8"),
])
"""One row per (iteration, communicator) (:meth:`RankTracker.comm_times`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrackerConfig:
    """Parameters of a rank's tracker."""

    clock: ClockConfig = dataclasses.field(default_factory=ClockConfig)
    """Period lock and iteration numbering."""
    bocd: BocdConfig | None = None
    """BOCD model (default :class:`~greyhound.analytics.bocd.BocdConfig`)."""
    verify: VerifyConfig | None = None
    """BOCD+V verification (default :class:`~greyhound.analytics.verify.VerifyConfig`)."""
    history_calls: int = 1 << 17
    """Calls whose arrival and duration are kept (the newest)."""
    settle_records: int = 1 << 14
    """Records fed (kept as they came) at most before the call table is brought up to
    date; reading arrivals or comm times brings it up to date at once."""

    def __post_init__(self) -> None:
        if self.history_calls < 1:
            raise ValueError(f"history_calls must be >= 1, got {self.history_calls!r}")
        if self.settle_records < 1:
            raise ValueError(f"settle_records must be >= 1, got {self.settle_records!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrackerUpdate:
    """What one :meth:`RankTracker.feed` added."""

    first_iteration: int
    """Number of the first iteration in ``iteration_times``."""
    withdrawn_from: int | None
    """Iterations from this number on that earlier updates reported are withdrawn
    (with the change points detected at or after it): the call pattern had changed
    under them, or more calls showed that a young lock's period was a motif inside
    the iteration, and the clock locked again; the numbers are reused."""
    iteration_times: np.ndarray
    """(m,) seconds of the iterations completed by this batch."""
    available_at_ns: np.ndarray
    """(m,) uint64: enqueue time of the call that completed each (CLOCK_MONOTONIC)."""
    changepoints: tuple[ChangePoint, ...]
    """Change points accepted during this batch (iteration numbers)."""
    gap_iterations: tuple[int, ...]
    """Iterations among these whose calls span lost records."""
    records: int
    """Records in the batch."""
    calls: int
    """Communication calls among them."""
    lost: int
    """Records lost right before or inside this batch (gaps in ``seq``)."""


def held_seconds(starts: np.ndarray, ends: np.ndarray, holds: list[tuple[float, float]]) -> np.ndarray:
    """Seconds of each span [starts[i], ends[i]] that fall inside the holds (disjoint
    (start, end) pairs, same clock)."""
    held = np.zeros(len(ends))
    for start, end in holds:
        held += np.clip(np.minimum(ends, end) - np.maximum(starts, start), 0.0, None)
    return held


class RankTracker:
    """One rank's online state (see the module docstring).

    Args:
        rank: the rank, for the caller's bookkeeping only.
        config: parameters.
    """

    def __init__(self, *, rank: int | None = None, config: TrackerConfig | None = None) -> None:
        self.rank = rank
        self.config = config or TrackerConfig()
        self._clock = IterationClock(self.config.clock)
        self._detector = BocdV(bocd=self.config.bocd, verify=self.config.verify)
        self._x = np.empty(1024)
        self._n = 0
        self._changepoints: list[ChangePoint] = []
        self._last_seq = 0
        self.lost_records = 0
        """Records lost so far (gaps in ``seq``)."""
        self.reported_lost = 0
        """Sum of the ``lost`` the caller passed (the reader's count)."""
        self.num_records = 0
        self._gap_calls: list[int] = []  # call index right after each gap
        self._gap_iterations: list[int] = []
        self._comm_counts: dict[tuple[int, bool], int] = {}
        self._table = _CallTable(self.config.history_calls)
        self._async: dict[int, int] = {}  # req_id -> call index (unfinished async calls)
        self._finished = False
        self._holds: list[tuple[float, float]] = []  # (start, end) s, not yet behind the fed iterations
        # (index of the first call, calls, other records) of the batches fed since the
        # last _settle, in order.
        self._unsettled: list[tuple[int, np.ndarray, np.ndarray | None]] = []
        self._unsettled_records = 0

    # ---- feeding --------------------------------------------------------------------

    def feed(self, records: np.ndarray, *, lost: int = 0) -> TrackerUpdate:
        """Add the next batch of ring records (in ring order).

        Args:
            records: (n,) structured array with the fields of
                ``greyhound.ring.RECORD_DTYPE`` (at least seq, t_start_ns, t_end_ns,
                size_bytes, comm_id, req_id, op, flags), as
                :meth:`greyhound.ring.RingReader.read` returns them: all kinds of
                records, the tracker picks the calls.
            lost: records the reader counted as lost for this batch (kept as
                :attr:`reported_lost`; the tracker counts gaps in ``seq`` itself).

        Returns:
            A :class:`TrackerUpdate`.
        """
        if self._finished:
            raise ValueError("tracker: the stream was finished; a new stream needs a new tracker")
        records = np.asarray(records)
        names = records.dtype.names or ()
        missing = [f for f in _NEEDED if f not in names]
        if missing or records.ndim != 1:
            raise ValueError(
                f"tracker: records must be a 1-D array with the ring record fields; "
                f"missing {', '.join(missing) or 'none'}, ndim {records.ndim}"
            )
        if lost < 0:
            raise ValueError(f"tracker: lost must be >= 0, got {lost!r}")
        self.reported_lost += int(lost)
        self.num_records += len(records)
        gap = self._count_gaps(records["seq"])
        is_call = IS_CALL[records["op"]]
        # Most batches are calls only (no WAIT or DONE records): no copy then.
        only_calls = bool(is_call.all())
        calls = records if only_calls else records[is_call]
        first_new = self._clock.num_calls
        if gap:
            # The next call seen is the first after lost records (a gap inside the
            # batch is placed at its first call after it: close enough for marking).
            self._gap_calls.append(first_new + self._first_call_after_gap(records, is_call))
        # The call table is filed later, in one go (:meth:`_settle`): only arrivals
        # and comm_times read it, every few seconds, and filing each poll's few hundred
        # records at once cost a rank's poll half its time in numpy's per-call overhead.
        self._unsettled.append((first_new, calls, None if only_calls else records[~is_call]))
        self._unsettled_records += len(records)
        if self._unsettled_records >= self.config.settle_records:
            self._settle()
        step = self._clock.feed(
            calls["op"], calls["comm_id"], calls["size_bytes"],
            calls["t_start_ns"].astype(np.float64) * 1e-9,
        )
        return self._take(step, len(records), len(calls), gap)

    def hold(self, start_ns: int, end_ns: int) -> None:
        """The rank was held at greyhound's pause gate from ``start_ns`` to ``end_ns``
        (CLOCK_MONOTONIC, the records' clock): the iteration that spans the hold is
        measured without it, when it is fed (call this before feeding the records
        after the hold). A validation pause is greyhound's doing, not the job's; left
        in, it is one iteration many times the others, and BOCD's estimate of the
        regime's spread grows so wide that the job's return to speed after a
        fail-slow went unseen for 50 iterations on the local cluster."""
        if end_ns <= start_ns:
            return
        start, end = start_ns * 1e-9, end_ns * 1e-9
        # One hold told twice (the gate cleared, the thread not yet gone from it) or
        # two that overlap count once: the holds stay disjoint.
        overlapping = [h for h in self._holds if h[0] <= end and start <= h[1]]
        for h in overlapping:
            self._holds.remove(h)
            start, end = min(start, h[0]), max(end, h[1])
        self._holds.append((start, end))

    def finish(self) -> TrackerUpdate:
        """The stream ended (the rank exited): lock on what is there if nothing is
        locked yet (as ``greyhound detect`` does on a whole trace)."""
        step = self._clock.finish()
        self._finished = True
        return self._take(step, 0, 0, 0)

    def _withdraw(self, first: int) -> None:
        """Iterations from ``first`` on were measured under a lock that had ended (the
        clock withdrew them): forget them, and bring BOCD+V back to where it stood
        before them by replaying the series (a rare event: a change of pattern)."""
        self._n = first
        self._changepoints = [cp for cp in self._changepoints if cp.detected_at < first]
        self._gap_iterations = [k for k in self._gap_iterations if k < first]
        self._detector = BocdV(bocd=self.config.bocd, verify=self.config.verify)
        replayed = self._detector.feed(self._x[:first])
        if replayed != self._changepoints:  # pragma: no cover - BocdV is online
            raise AssertionError("tracker: replaying BOCD+V gave other change points")

    def _count_gaps(self, seq: np.ndarray) -> int:
        if not len(seq):
            return 0
        # In ring order seq only grows: a batch whose first and last are one batch
        # apart, next to the last one seen, is consecutive (the usual case: two
        # reads, where a pass over the batch was a tenth of a feed).
        first, last = int(seq[0]), int(seq[-1])
        if first == self._last_seq + 1 and last == first + len(seq) - 1:
            self._last_seq = last
            self._gap_at = -1
            return 0
        seq = seq.astype(np.int64)
        expected = np.concatenate(([self._last_seq + 1], seq[:-1] + 1))
        gaps = np.maximum(seq - expected, 0)
        self._last_seq = max(self._last_seq, int(seq[-1]))
        total = int(gaps.sum())
        self.lost_records += total
        self._gap_at = int(np.argmax(gaps > 0)) if total else -1
        return total

    def _first_call_after_gap(self, records: np.ndarray, is_call: np.ndarray) -> int:
        """Calls of the batch before the first gap's position."""
        return int(is_call[: self._gap_at].sum())

    def _take(self, step, num_records: int, num_calls: int, lost: int) -> TrackerUpdate:
        if step.withdrawn_from is not None and step.withdrawn_from < self._n:
            self._withdraw(step.withdrawn_from)
        times = step.iteration_times
        m = len(times)
        if m and self._holds:
            times = times - held_seconds(step.available_at - times, step.available_at, self._holds)
            self._holds = [h for h in self._holds if h[1] > step.available_at[-1]]
        if self._n + m > len(self._x):
            grown = np.empty(max(2 * len(self._x), self._n + m))
            grown[: self._n] = self._x[: self._n]
            self._x = grown
        self._x[self._n : self._n + m] = times
        self._n += m
        cps = tuple(self._detector.feed(times)) if m else ()
        self._changepoints.extend(cps)
        gaps: list[int] = []
        if m and self._gap_calls:
            p = self._clock.segments[-1].period if self._clock.segments else 1
            first_call = step.first_call
            for g in self._gap_calls:
                # The iteration whose span [first call, first call + period] holds the
                # first call after the gap.
                hit = np.flatnonzero((first_call < g) & (first_call + p >= g))
                gaps.extend(int(step.first_iteration + h) for h in hit)
            # Keep gaps that later iterations may still span.
            last = int(first_call[-1]) + p
            self._gap_calls = [g for g in self._gap_calls if g > last]
        self._gap_iterations.extend(gaps)
        return TrackerUpdate(
            withdrawn_from=step.withdrawn_from,
            first_iteration=step.first_iteration, iteration_times=times,
            available_at_ns=np.rint(step.available_at * 1e9).astype(np.uint64),
            changepoints=cps, gap_iterations=tuple(gaps), records=num_records,
            calls=num_calls, lost=lost,
        )

    # ---- calls: arrivals and durations ------------------------------------------------

    def _record_calls(self, calls: np.ndarray, first_index: int) -> None:
        if not len(calls):
            return
        # Ordinal of each call among this rank's collectives on its communicator (or
        # among its point-to-point calls there), counting the calls of a batch too large
        # for the table too. Collectives are counted apart: every member makes the same
        # ones in the same order, so the n-th is the same collective everywhere, while
        # the point-to-point calls on a communicator differ from rank to rank and from
        # step to step (a pipeline stage's sends follow its micro-batch count).
        comm_ids, collective = calls["comm_id"], _IS_COLLECTIVE[calls["op"]]
        if (comm_ids == comm_ids[0]).all():
            # The usual batch: every call on one communicator. Two running counts
            # number it, without np.unique and a sort (12 us a 500-call batch, not 25-36).
            comm = int(comm_ids[0])
            keys = [(comm, False), (comm, True)]
            p2p_base, coll_base = (self._comm_counts.get(key, 0) for key in keys)
            before = np.cumsum(collective) - collective       # collectives before each call
            ordinals = np.where(collective, coll_base + before, p2p_base + np.arange(len(calls)) - before)
            num_collective = int(before[-1]) + int(collective[-1])
            bases, counts = [p2p_base, coll_base], [len(calls) - num_collective, num_collective]
        else:
            # Grouped by (communicator, kind) in one sort: a pass per group was a fifth
            # of a rank's poll.
            comms, inverse = np.unique(comm_ids, return_inverse=True)
            group = inverse.reshape(-1) * 2 + collective
            group_counts = np.bincount(group, minlength=2 * len(comms))
            keys = [(c, kind) for c in comms.tolist() for kind in (False, True)]
            group_bases = np.array([self._comm_counts.get(key, 0) for key in keys], dtype=np.int64)
            ordinals = np.empty(len(calls), dtype=np.int64)
            ordinals[np.argsort(group, kind="stable")] = \
                np.arange(len(calls)) - np.repeat(np.cumsum(group_counts) - group_counts, group_counts)
            ordinals += group_bases[group]
            bases, counts = group_bases.tolist(), group_counts.tolist()
        for key, base, count in zip(keys, bases, counts):
            if count:
                self._comm_counts[key] = base + count
        dropped = max(0, len(calls) - self.config.history_calls)
        calls, ordinals, first_index = calls[dropped:], ordinals[dropped:], first_index + dropped
        k = len(calls)
        rows = self._table.extend(k)          # filled in place: every field is set below
        rows["index"] = np.arange(first_index, first_index + k)
        for name in ("seq", "op", "comm_id", "req_id", "size_bytes", "t_start_ns", "t_end_ns",
                     "flags"):
            rows[name] = calls[name]
        rows["comm_ordinal"] = ordinals
        blocking = (rows["flags"] & F_ASYNC) == 0
        done = blocking & (rows["t_end_ns"] >= rows["t_start_ns"]) & (rows["t_end_ns"] > 0)
        rows["seconds"] = np.nan
        rows["seconds"][done] = (rows["t_end_ns"][done] - rows["t_start_ns"][done]) * 1e-9
        rows["device"] = False
        for req, index in zip(rows["req_id"][~blocking].tolist(), rows["index"][~blocking].tolist()):
            self._async[req] = index
        oldest = self._table.first_index
        if len(self._async) > 2 * self.config.history_calls:
            self._async = {r: i for r, i in self._async.items() if i >= oldest}

    def _settle(self) -> None:
        """Files the calls fed since the last settle into the call table, then their
        WAIT and DONE records: the table is then as if each batch had been filed as
        it came (a WAIT or DONE always follows its call in ring order)."""
        if not self._unsettled:
            return
        batches, self._unsettled, self._unsettled_records = self._unsettled, [], 0
        calls = [b[1] for b in batches if len(b[1])]
        if calls:
            self._record_calls(np.concatenate(calls) if len(calls) > 1 else calls[0], batches[0][0])
        others = [b[2] for b in batches if b[2] is not None and len(b[2])]
        if others:
            self._complete(np.concatenate(others) if len(others) > 1 else others[0])

    def _complete(self, others: np.ndarray) -> None:
        """Durations of async calls from their WAIT records, device times from DONE (a
        DONE's device time wins over its call's WAIT, whichever came first)."""
        table = self._table
        if not len(others) or not len(table):
            return
        rows, first = table.rows, table.first_index
        waits = others[others["op"] == _WAIT]
        if len(waits):
            pop = self._async.pop
            index = np.array([pop(r, -1) for r in waits["req_id"].tolist()], dtype=np.int64)
            row = index - first
            kept = (index >= 0) & (row >= 0) & (row < len(rows))
            row, end = row[kept], waits["t_end_ns"][kept]
            start = rows["t_start_ns"][row]
            timed = (end >= start) & ~rows["device"][row]
            rows["seconds"][row[timed]] = (end[timed] - start[timed]) * 1e-9
        done = others[(others["op"] == _DONE) & ((others["flags"] & F_DEVICE_TIMED) != 0)]
        if len(done):
            seq = rows["seq"]
            row = np.minimum(np.searchsorted(seq, done["req_id"]), len(rows) - 1)
            timed = (seq[row] == done["req_id"]) & (done["t_end_ns"] >= done["t_start_ns"])
            row = row[timed]
            rows["seconds"][row] = (done["t_end_ns"][timed] - done["t_start_ns"][timed]) * 1e-9
            rows["device"][row] = True

    def arrivals(self, first_iteration: int | None = None, last_iteration: int | None = None, *,
                 last_calls: int | None = None) -> np.ndarray:
        """The kept calls, one row each (:data:`ARRIVAL_DTYPE`), of iterations in
        [first_iteration, last_iteration] (default: all kept, warm-up included with
        iteration -1), or the last ``last_calls`` of them.

        ``call_number`` is the hook's call number (see ``RingReader.calls``): exact
        while no record was lost; after a loss it lags by the calls among the lost
        records (at most :attr:`lost_records`).
        """
        self._settle()
        calls = self._table.rows
        if last_calls is not None:
            calls = calls[max(0, len(calls) - last_calls):]
        start = None if first_iteration is None else self._clock.iteration_start_call(first_iteration)
        if start is not None:
            # Calls are numbered consecutively: the iterations asked for begin at row
            # ``start - first index`` (the agent asks for the last few of 10^5 kept).
            calls = calls[max(0, start - self._table.first_index):]
        out = np.zeros(len(calls), dtype=ARRIVAL_DTYPE)
        iteration, position = self._iterations_of(calls["index"])
        out["iteration"] = iteration
        out["position"] = position
        out["call_number"] = calls["index"] + 1
        for name in ("comm_id", "comm_ordinal", "op", "size_bytes", "t_start_ns", "t_end_ns",
                     "seconds"):
            out[name] = calls[name]
        keep = np.ones(len(out), dtype=bool)
        if first_iteration is not None:
            keep &= out["iteration"] >= first_iteration
        if last_iteration is not None:
            keep &= (out["iteration"] <= last_iteration) & (out["iteration"] >= 0)
        return out[keep]

    def comm_times(self, first_iteration: int | None = None, last_iteration: int | None = None) -> np.ndarray:
        """Per iteration and communicator: calls, the sum of their known durations,
        bytes (:data:`COMM_TIME_DTYPE`), for the kept calls of iterations in
        [first_iteration, last_iteration] (default: all kept iterations >= 0)."""
        rows = self.arrivals(0 if first_iteration is None else first_iteration, last_iteration)
        rows = rows[rows["iteration"] >= 0]
        if not len(rows):
            return np.zeros(0, dtype=COMM_TIME_DTYPE)
        key = np.stack([rows["iteration"].astype(np.uint64), rows["comm_id"]], axis=1)
        uniq, inverse = np.unique(key, axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        out = np.zeros(len(uniq), dtype=COMM_TIME_DTYPE)
        out["iteration"] = uniq[:, 0].astype(np.int64)
        out["comm_id"] = uniq[:, 1]
        known = ~np.isnan(rows["seconds"])
        out["calls"] = np.bincount(inverse, minlength=len(uniq))
        out["pending"] = np.bincount(inverse, weights=~known, minlength=len(uniq))
        out["seconds"] = np.bincount(inverse, weights=np.where(known, rows["seconds"], 0.0),
                                     minlength=len(uniq))
        out["size_bytes"] = np.bincount(inverse, weights=rows["size_bytes"].astype(np.float64),
                                        minlength=len(uniq)).astype(np.uint64)
        return out

    def _iterations_of(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Iteration (-1 if none) and position in it of calls by their index."""
        iteration = np.full(len(index), -1, dtype=np.int64)
        position = np.full(len(index), -1, dtype=np.int32)
        segments = self._clock.segments
        for k, seg in enumerate(segments):
            if k + 1 < len(segments):
                end_iteration: int | None = segments[k + 1].first_iteration
            else:
                end_iteration = None if self._clock.locked else self._clock.num_iterations
            hi = (seg.start_call + (end_iteration - seg.first_iteration) * seg.period
                  if end_iteration is not None else None)
            inside = index >= seg.start_call
            if hi is not None:
                inside &= index < hi
            offset = index[inside] - seg.start_call
            iteration[inside] = seg.first_iteration + offset // seg.period
            position[inside] = offset % seg.period
        return iteration, position

    # ---- state ----------------------------------------------------------------------

    @property
    def period(self) -> int | None:
        """Calls per iteration of the current lock; None while unlocked."""
        return self._clock.period

    @property
    def locked(self) -> bool:
        return self._clock.locked

    @property
    def pending_change(self) -> int | None:
        """The iteration where a candidate change starts while BOCD+V weighs it (it is
        accepted from its ``min_after``-th iteration on, or dropped); None when none is."""
        return self._detector.pending

    @property
    def locks(self) -> tuple[Segment, ...]:
        """The clock's locks, oldest first (the current one last while :attr:`locked`):
        period, first call and first iteration of each, and ``locked_at``, the calls
        seen when it was made. A lock whose iterations were all withdrawn (a motif,
        see :attr:`~greyhound.analytics.period.ClockConfig.verify_calls`) is not
        listed."""
        return tuple(self._clock.segments)

    @property
    def num_calls(self) -> int:
        """Communication calls seen."""
        return self._clock.num_calls

    @property
    def num_iterations(self) -> int:
        """Iterations reported (the next one gets this number)."""
        return self._n

    @property
    def iteration_times(self) -> np.ndarray:
        """(num_iterations,) seconds so far (a read-only view; 8 bytes an iteration)."""
        view = self._x[: self._n]
        view.flags.writeable = False
        return view

    @property
    def gap_iterations(self) -> tuple[int, ...]:
        """Iterations whose calls spanned lost records."""
        return tuple(self._gap_iterations)

    @property
    def changepoints(self) -> tuple[ChangePoint, ...]:
        return tuple(self._changepoints)

    def slow_intervals(self) -> list[SlowInterval]:
        """Slow intervals of the series so far (as ``greyhound detect`` reports them)."""
        if not self._n:
            return []
        return slow_intervals(self._x[: self._n], self._changepoints,
                              min_slowdown=1.0 + self._detector.verify.min_change)

    @property
    def current_slow_interval(self) -> SlowInterval | None:
        """The slow interval still open (end_index None), if any."""
        intervals = self.slow_intervals()
        return intervals[-1] if intervals and intervals[-1].end_index is None else None

    @property
    def fail_slow(self) -> bool:
        return bool(self.slow_intervals())

    def detection(self) -> Detection:
        """Everything as one :class:`~greyhound.analytics.detect.Detection` (the
        object ``greyhound detect`` prints)."""
        intervals = self.slow_intervals()
        x = self._x[: self._n]
        return Detection(
            method="bocd+v", iterations=self._n,
            baseline_iteration_time=healthy_level(x, intervals) if self._n else float("nan"),
            changepoints=tuple(self._changepoints), slow_intervals=tuple(intervals),
        )

    def call_number_of_iteration(self, iteration: int) -> int | None:
        """The hook's number of the first call of ``iteration`` (reported or future,
        of the current lock): what ``RingReader.pause(at_call=...)`` takes to park the
        rank right before that iteration. None when unknown. Exact while no record was
        lost (see :meth:`arrivals`)."""
        start = self._clock.iteration_start_call(iteration)
        return None if start is None else start + 1

    def iteration_of_call_number(self, call_number: int) -> int | None:
        """The iteration a hook call number falls in, if the lock says (inverse of
        :meth:`call_number_of_iteration`)."""
        iteration, _ = self._iterations_of(np.array([call_number - 1], dtype=np.int64))
        return None if iteration[0] < 0 else int(iteration[0])


_CALL_TABLE = np.dtype([
    ("index", "<i8"), ("seq", "<u8"), ("op", "<u2"), ("comm_id", "<u8"), ("req_id", "<u8"),
    ("comm_ordinal", "<i8"), ("size_bytes", "<u8"), ("t_start_ns", "<u8"),
    ("t_end_ns", "<u8"), ("flags", "<u4"), ("seconds", "<f8"), ("device", "?"),
])


class _CallTable:
    """The newest ``capacity`` call rows, appended in place (amortised O(1))."""

    def __init__(self, capacity: int) -> None:
        self._cap = capacity
        # Twice the capacity, allocated once: np.zeros maps zero pages that are only
        # touched as rows arrive, and a full buffer is compacted in place (one copy
        # of ``capacity`` rows every ``capacity`` calls) instead of regrown.
        self._buf = np.zeros(2 * capacity, dtype=_CALL_TABLE)
        self._lo = 0
        self._hi = 0

    def __len__(self) -> int:
        return self._hi - self._lo

    @property
    def rows(self) -> np.ndarray:
        """The kept rows, oldest first (a view: writes go to the table)."""
        return self._buf[self._lo : self._hi]

    @property
    def first_index(self) -> int:
        return int(self._buf["index"][self._lo]) if self._hi > self._lo else 0

    def extend(self, k: int) -> np.ndarray:
        """``k`` (<= capacity) new rows at the end, for the caller to fill (a view; their
        old contents are left as they were): the oldest rows beyond the capacity go."""
        if not 0 <= k <= self._cap:
            raise ValueError(f"call table: {k} rows do not fit a capacity of {self._cap}")
        if self._hi + k > len(self._buf):
            # The kept rows start past ``capacity`` (hi + k > 2 capacity): they do not
            # overlap their new place, and move without a temporary (a fresh 10 MB copy
            # each time, whose pages the kernel had to fault in and zero).
            first = max(self._lo, self._hi - (self._cap - k))
            self._buf[: self._hi - first] = self._buf[first : self._hi]
            self._lo, self._hi = 0, self._hi - first
        rows = self._buf[self._hi : self._hi + k]
        self._hi += k
        if self._hi - self._lo > self._cap:
            self._lo = self._hi - self._cap
        return rows
