"""Reader of the hook's per-rank shared-memory rings.

The C hook (spank/hook/) writes one ring file per rank into ``GREYHOUND_RUN_DIR``:
``ring.<rank>`` (rank from SLURM_PROCID, RANK, OMPI_COMM_WORLD_RANK or PMI_RANK),
``ring.pid<pid>`` when no launcher variable names a rank, and ``ring.<rank>.<pid>``
when ``ring.<rank>`` is already taken (a later job step, a forked child). The header
says whose ring it is; never rely on the name alone.

The layout is defined once, in spank/hook/gh_ring.h; the dtypes below mirror it and
tests/test_hook_layout.py checks every offset against the compiled header.

:class:`RingReader` tails a ring incrementally: each :meth:`RingReader.read` returns
the records committed since the last call, as a copy, and publishes how far it read
so that the hook counts as ``drops`` only records overwritten before anyone read them.
It also drives the ring's pause gate (:meth:`RingReader.pause`, at the next call or
before a given call number, :meth:`RingReader.resume`) and the GEMM benchmark a parked
rank runs in its own process (:meth:`RingReader.request_bench`,
:meth:`RingReader.bench_result`, :func:`bench_n_for`).
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from greyhound.errors import GreyhoundError, InputError

logger = logging.getLogger(__name__)

MAGIC = b"GHRING1\x00"
VERSION = 2
HEADER_BYTES = 512

# enum gh_op, in order; names as in the What-if study where it has them.
OP_NAMES: tuple[str, ...] = (
    "None", "AllReduce", "ReduceScatter", "AllGather", "Broadcast", "Reduce", "Send",
    "Recv", "SendRecv", "Barrier", "Wait", "Group", "CommInit", "CommSplit",
    "CommDestroy", "Pause", "Done",
)
OP = {name: code for code, name in enumerate(OP_NAMES)}
# Ops that are communication calls (what the period analytics consume).
CALL_OPS = frozenset(OP[n] for n in (
    "AllReduce", "ReduceScatter", "AllGather", "Broadcast", "Reduce", "Send", "Recv",
    "SendRecv", "Barrier",
))
# Communication calls every member of a communicator makes together.
COLLECTIVE_OPS = frozenset(OP[n] for n in (
    "AllReduce", "ReduceScatter", "AllGather", "Broadcast", "Reduce", "Barrier",
))

SOURCE_NAMES = {1: "mpi", 2: "nccl", 3: "torch", 4: "hook"}

F_ASYNC = 0x0001
F_GROUPED = 0x0002
F_GATE_TIMEOUT = 0x0004
F_ERROR = 0x0008
F_DEVICE_TIMED = 0x0010
F_LOCAL_COMM = 0x0020
F_IN_PLACE = 0x0040

HOOK_TRACE = 0x1
HOOK_TSC = 0x2  # times read from the TSC, fitted to CLOCK_MONOTONIC (set ~1 ms in)

COMM_EMPTY, COMM_LIVE, COMM_DESTROYED = 0, 1, 2

# struct gh_record: 64 bytes.
RECORD_DTYPE = np.dtype({
    "names": ["seq", "t_start_ns", "t_end_ns", "size_bytes", "comm_id", "req_id",
              "peer", "op", "source", "flags", "rc"],
    "formats": ["<u8", "<u8", "<u8", "<u8", "<u8", "<u8", "<i4", "<u2", "u1", "<u4", "<i4"],
    "offsets": [0, 8, 16, 24, 32, 40, 48, 52, 54, 56, 60],
    "itemsize": 64,
})

# struct gh_comm_entry: 48 bytes.
COMM_DTYPE = np.dtype({
    "names": ["comm_id", "parent_id", "t_create_ns", "size", "rank", "source", "state",
              "color"],
    "formats": ["<u8", "<u8", "<u8", "<i4", "<i4", "<u2", "<u2", "<i4"],
    "offsets": [0, 8, 16, 24, 28, 32, 34, 36],
    "itemsize": 48,
})

# struct gh_ring_header: 512 bytes.
HEADER_DTYPE = np.dtype({
    "names": ["magic", "version", "header_bytes", "record_bytes", "capacity",
              "records_offset", "comms_offset", "comm_bytes", "comm_capacity", "rank",
              "pid", "t0_monotonic_ns", "t0_realtime_ns", "pause_timeout_ns",
              "hook_flags", "job_id", "hostname", "head", "calls", "reader_pos", "drops",
              "gate_waits", "gate_timeouts", "parked_since_ns", "gate", "parked",
              "num_comms", "comm_overflow", "events_skipped", "gate_at_call",
              "parked_at_call", "bench_ns", "bench_cpu_ns", "bench_n", "bench_request",
              "bench_done", "bench_status", "node"],
    "formats": ["S8", "<u4", "<u4", "<u4", "<u4", "<u8", "<u8", "<u4", "<u4", "<i4",
                "<i4", "<u8", "<u8", "<u8", "<u4", "S32", "S64", "<u8", "<u8", "<u8", "<u8",
                "<u8", "<u8", "<u8", "<u4", "<u4", "<u4", "<u4", "<u8", "<u8",
                "<u8", "<u8", "<u8", "<u4", "<u4",
                "<u4", "<u4", "S64"],
    "offsets": [0, 8, 12, 16, 20, 24, 32, 40, 44, 48, 52, 56, 64, 72, 80, 88, 120,
                192, 200, 256, 320, 328, 336, 344, 352, 356, 360, 364, 368, 376,
                384, 392, 400, 408, 412, 416, 420, 448],
    "itemsize": HEADER_BYTES,
})

# enum gh_bench_status: how the hook answered a benchmark request.
BENCH_NONE, BENCH_OK, BENCH_TIMEOUT, BENCH_RESUMED, BENCH_BAD_SIZE, BENCH_NO_MEMORY, \
    BENCH_NOT_PARKED = range(7)
BENCH_STATUS_NAMES = {
    BENCH_NONE: "not answered", BENCH_OK: "ok",
    BENCH_TIMEOUT: "stopped at the pause timeout",
    BENCH_RESUMED: "stopped: the rank was resumed",
    BENCH_BAD_SIZE: "matrix size out of range",
    BENCH_NO_MEMORY: "the rank could not map the matrices",
    BENCH_NOT_PARKED: "the rank left the gate before it ran",
}
BENCH_MIN_N, BENCH_MAX_N = 16, 4096   # GH_BENCH_MIN_N, GH_BENCH_MAX_N
BENCH_TARGET_S = 0.2
"""How long a benchmark should take on a healthy rank (see :func:`bench_n_for`)."""
BENCH_PROBE_N = 256
"""The size a calibration probe runs at (milliseconds on any CPU)."""


class RingError(GreyhoundError):
    """A ring file is missing, not a greyhound ring, or of another layout version."""


@dataclass(frozen=True, kw_only=True)
class BenchResult:
    """How the hook answered one benchmark request (:meth:`RingReader.request_bench`)."""

    n: int
    """Matrix size of the GEMM."""
    status: int
    """BENCH_OK, or why there is no result (BENCH_STATUS_NAMES says it in words)."""
    wall_s: float | None
    """Wall-clock seconds of the GEMM; None unless status is BENCH_OK."""
    cpu_s: float | None
    """CPU seconds of the thread that ran it: wall_s well above cpu_s means the rank
    did not get its CPU (a quota, a shared core); None unless status is BENCH_OK."""


def bench_n_for(probe_s: float, *, probe_n: int = BENCH_PROBE_N,
                target_s: float = BENCH_TARGET_S) -> int:
    """The GEMM size that takes about target_s where a probe of size probe_n took probe_s.

    The work grows as n^3, so n = probe_n (target_s / probe_s)^(1/3), rounded to a
    multiple of 16 and clamped to [BENCH_MIN_N, BENCH_MAX_N]. How a master sizes the
    validation GEMM: park the suspects and some healthy ranks, request probe_n on all
    of them, take the median time (a healthy majority's), and request
    ``bench_n_for(median)`` on each. Size it from healthy ranks, never from the
    suspect alone: a rank under a CPU quota would get a smaller n and look healthy.
    A probe of a few milliseconds also fits in one quota period (100 ms), so even a
    throttled rank's probe says little; the target of 0.2 s spans several.

    Raises:
        InputError: a time or size that is not positive.
    """
    if not (probe_s > 0 and target_s > 0) or probe_n < 1:
        raise InputError(f"bench_n_for: probe_s={probe_s!r}, probe_n={probe_n!r} and "
                         f"target_s={target_s!r} must be positive")
    n = probe_n * (target_s / probe_s) ** (1 / 3)
    return int(min(BENCH_MAX_N, max(BENCH_MIN_N, 16 * round(n / 16))))


@dataclass(frozen=True, kw_only=True)
class RingInfo:
    """Who wrote a ring: the fixed part of its header."""

    path: Path
    """The ring file."""
    rank: int
    """Global rank the hook found in the launcher's environment, -1 if none."""
    pid: int
    """Process id of the writer."""
    job_id: str
    """GREYHOUND_JOB_ID of the writer ('' if unset)."""
    hostname: str
    """Host the writer ran on."""
    node: str
    """Slurm node the writer ran on (SLURMD_NODENAME, else the hostname): several
    emulated nodes (``slurmd -N``) may share one host."""
    capacity: int
    """Records the ring holds before it overwrites the oldest."""
    t0_monotonic_ns: int
    """CLOCK_MONOTONIC at ring creation; with t0_realtime_ns converts record times."""
    t0_realtime_ns: int
    """CLOCK_REALTIME at the same moment."""
    pause_timeout_s: float
    """How long the pause gate holds a call before letting it go."""
    trace: bool
    """GREYHOUND_TRACE=on: NCCL ops are device-timed (DONE records)."""

    def unix_seconds(self, t_ns: np.ndarray | int) -> np.ndarray | float:
        """Converts record times (CLOCK_MONOTONIC ns) to Unix seconds.

        Uses the offset between the two clocks at ring creation: exact unless
        the system clock was stepped since.
        """
        return (np.asarray(t_ns, dtype=np.int64) - self.t0_monotonic_ns
                + self.t0_realtime_ns) / 1e9


@dataclass(frozen=True, kw_only=True)
class Batch:
    """What one :meth:`RingReader.read` returned."""

    records: np.ndarray
    """Committed records in write order, RECORD_DTYPE, shape (n,)."""
    lost: int
    """Records that were overwritten (or never committed) before this reader got them."""


def ring_paths(run_dir: str | os.PathLike) -> list[Path]:
    """The ring files in a run dir, ordered by the rank in their name, then by name."""
    def key(p: Path) -> tuple[int, str]:
        head = p.name.split(".")[1]
        return (int(head), p.name) if head.isdigit() else (1 << 40, p.name)

    return sorted((p for p in Path(run_dir).glob("ring.*") if p.is_file()), key=key)


class RingReader:
    """Tails one ring file.

    Args:
        path: the ring file.
        publish: write the read position back into the ring (the agent does; a
            passive inspector passes False and opens the file read-only, and
            then cannot drive the gate).

    Raises:
        RingError: the file cannot be opened or is not a ring of this version.
    """

    def __init__(self, path: str | os.PathLike, *, publish: bool = True) -> None:
        self.path = Path(path)
        self._publish = publish
        try:
            fd = os.open(self.path, (os.O_RDWR if publish else os.O_RDONLY) | os.O_CLOEXEC)
        except OSError as exc:
            raise RingError(f"ring: cannot open {self.path}: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise RingError(f"ring: {self.path} is {size} bytes, smaller than a ring header")
            access = mmap.ACCESS_WRITE if publish else mmap.ACCESS_READ
            self._map = mmap.mmap(fd, size, access=access)
        finally:
            os.close(fd)
        self._hdr = np.ndarray((), dtype=HEADER_DTYPE, buffer=self._map, offset=0)
        self._check(size)
        h = self._hdr
        self.info = RingInfo(
            path=self.path, rank=int(h["rank"]), pid=int(h["pid"]),
            job_id=h["job_id"].item().decode(errors="replace"),
            hostname=h["hostname"].item().decode(errors="replace"),
            node=h["node"].item().decode(errors="replace"),
            capacity=int(h["capacity"]), t0_monotonic_ns=int(h["t0_monotonic_ns"]),
            t0_realtime_ns=int(h["t0_realtime_ns"]),
            pause_timeout_s=int(h["pause_timeout_ns"]) / 1e9,
            trace=bool(int(h["hook_flags"]) & HOOK_TRACE),
        )
        cap = self.info.capacity
        self._records = np.ndarray((cap,), dtype=RECORD_DTYPE, buffer=self._map,
                                   offset=int(h["records_offset"]))
        self._comms = np.ndarray((int(h["comm_capacity"]),), dtype=COMM_DTYPE,
                                 buffer=self._map, offset=int(h["comms_offset"]))
        self._pos = 0
        self._pending_since: int | None = None
        self._epoch = 0
        self._bench_epoch = 0

    def _check(self, size: int) -> None:
        h = self._hdr
        if h["magic"].item().ljust(8, b"\0") != MAGIC:
            raise RingError(f"ring: {self.path} is not a greyhound ring (or not ready yet)")
        if int(h["version"]) != VERSION:
            raise RingError(f"ring: {self.path} has layout version {int(h['version'])}; "
                            f"this reader knows version {VERSION}")
        if (int(h["header_bytes"]) != HEADER_BYTES
                or int(h["record_bytes"]) != RECORD_DTYPE.itemsize
                or int(h["comm_bytes"]) != COMM_DTYPE.itemsize):
            raise RingError(f"ring: {self.path} has record sizes {int(h['record_bytes'])}/"
                            f"{int(h['comm_bytes'])}; expected {RECORD_DTYPE.itemsize}/"
                            f"{COMM_DTYPE.itemsize}")
        cap = int(h["capacity"])
        records_offset = int(h["records_offset"])
        end = records_offset + cap * RECORD_DTYPE.itemsize
        if (cap <= 0 or cap & (cap - 1) or records_offset < HEADER_BYTES
                or records_offset % 8 or end > size):
            raise RingError(f"ring: {self.path} claims {cap} records at offset "
                            f"{records_offset}, which do not fit its {size} bytes")
        comms_offset, comm_capacity = int(h["comms_offset"]), int(h["comm_capacity"])
        comms_end = comms_offset + comm_capacity * COMM_DTYPE.itemsize
        if (comms_offset < HEADER_BYTES or comms_offset % 8
                or comms_end > size):
            raise RingError(f"ring: {self.path} claims {comm_capacity} communicators at "
                            f"offset {comms_offset}, which do not fit its {size} bytes")

    # ---- records ----------------------------------------------------------------

    @property
    def head(self) -> int:
        """Records written so far (including overwritten ones)."""
        return int(self._hdr["head"])

    @property
    def clock(self) -> str:
        """Where the hook reads record times now: "tsc" or "monotonic".

        Either way they are CLOCK_MONOTONIC nanoseconds; "tsc" means read from the
        TSC through a line the hook refits to clock_gettime (within about a
        microsecond). A ring starts on "monotonic" and switches after ~1 ms.
        """
        return "tsc" if int(self._hdr["hook_flags"]) & HOOK_TSC else "monotonic"

    @property
    def calls(self) -> int:
        """Communication calls (ops of :data:`CALL_OPS`) the rank has begun: numbered
        1, 2, ... as they reach the hook, the one held at the gate included. A rank
        that makes one call at a time writes each call's record before its next call
        begins, so its k-th call record in this ring is call number k."""
        return int(self._hdr["calls"])

    @property
    def position(self) -> int:
        """Index of the next record this reader will return."""
        return self._pos

    def counters(self) -> dict[str, int]:
        """The hook's counters: records, calls, drops, gate waits and timeouts, events
        skipped."""
        h = self._hdr
        return {k: int(h[k]) for k in ("head", "calls", "drops", "gate_waits", "gate_timeouts",
                                        "parked", "comm_overflow", "events_skipped")}

    def read(self, max_records: int | None = None) -> Batch:
        """Returns the records committed since the last read.

        A record still being written stops the read there (it is returned next
        time); one that stays unfinished while later ones are committed (its
        writer died) is skipped and counted as lost.
        """
        cap = self.info.capacity
        head = self.head
        start, lost = self._pos, 0
        if head - start > cap:
            lost = head - cap - start
            start = head - cap
        stop = head if max_records is None else min(head, start + max_records)
        if stop <= start:
            return Batch(records=np.empty(0, dtype=RECORD_DTYPE), lost=lost)
        idx = np.arange(start, stop, dtype=np.uint64)
        copy = self._slots(start, stop, self._records)
        # Re-read seq after the copy: a slot rewritten meanwhile had seq cleared
        # before its fields changed, so equal seqs mean an untorn copy.
        again = self._slots(start, stop, self._records["seq"])
        want = idx + np.uint64(1)
        ok = (copy["seq"] == want) & (again == want)
        if ok.all():  # the usual case, in three operations fewer
            self._pending_since = None
            self._advance(stop)
            return Batch(records=copy, lost=lost)
        overwritten = (copy["seq"] > want) | (again > want)
        unfinished = ~ok & ~overwritten
        end = stop
        if unfinished.any():
            first = int(np.argmax(unfinished))
            if self._pending_since == start + first and ok[first + 1:].any():
                # Unfinished a read ago too, with newer records committed since:
                # its writer died mid-record. Skip it.
                unfinished[first] = False
                lost += 1
            if unfinished.any():
                end = start + int(np.argmax(unfinished))
        self._pending_since = end if end < stop else None
        n = end - start
        lost += int(overwritten[:n].sum())
        self._advance(end)
        return Batch(records=copy[:n][ok[:n]], lost=lost)

    def _slots(self, start: int, stop: int, column: np.ndarray) -> np.ndarray:
        """A copy of ring slots [start, stop) (at most one capacity): one or two slices,
        as the range wraps (twice as fast as fancy indexing)."""
        cap = self.info.capacity
        lo, hi = start & (cap - 1), stop & (cap - 1)
        if lo < hi or stop == start:
            return column[lo:hi].copy()
        return np.concatenate((column[lo:], column[:hi]))

    def _advance(self, pos: int) -> None:
        self._pos = pos
        if self._publish:
            # An aligned 8-byte store: atomic for the hook's relaxed load.
            self._hdr["reader_pos"] = pos

    def comms(self) -> np.ndarray:
        """Communicators described so far, COMM_DTYPE, shape (k,)."""
        n = min(int(self._hdr["num_comms"]), len(self._comms))
        table = self._comms[:n].copy()
        return table[table["state"] != COMM_EMPTY]

    # ---- pause gate -----------------------------------------------------------

    def pause(self, at_call: int | None = None) -> int:
        """Sets the gate; returns its epoch.

        Args:
            at_call: None holds the rank's next intercepted call, whatever it is
                (a Wait too). A number holds it before the first communication call
                numbered ``>= at_call`` (see :attr:`calls`): earlier calls, and calls
                that are not communication calls, go on. For a consistent pause of a
                job, give every rank the number of the first call of the same future
                iteration: each then parks where no peer owes it anything, whereas
                "the next call" can leave a rank blocked inside a receive from a
                parked peer, out of the gate's reach. A number the rank has already
                passed holds its next communication call.

        A held rank goes on at :meth:`resume`, or by itself once the ring's pause
        timeout (``info.pause_timeout_s``) has passed since it parked.
        """
        if not self._publish:
            raise RingError(f"ring: {self.path} was opened read-only; it cannot be paused")
        if at_call is not None and (isinstance(at_call, bool) or not isinstance(at_call, int)
                                    or not 1 <= at_call < 1 << 63):
            raise InputError(f"ring: pause at_call={at_call!r} is not a call number; "
                             "allowed: None or an int >= 1")
        self._epoch = (max(self._epoch, int(self._hdr["gate"])) % 0xFFFFFFFE) + 1
        # gate_at_call before gate: the hook reads it after it sees the epoch.
        self._hdr["gate_at_call"] = at_call or 0
        self._hdr["gate"] = self._epoch
        return self._epoch

    def resume(self) -> None:
        """Clears the gate: held calls go on within about a millisecond (a benchmark
        running in the rank stops at once, see :meth:`request_bench`)."""
        if not self._publish:
            raise RingError(f"ring: {self.path} was opened read-only; it cannot be resumed")
        self._hdr["gate"] = 0

    @property
    def parked(self) -> int:
        """Threads of the rank held at the gate right now."""
        return int(self._hdr["parked"])

    @property
    def parked_since_ns(self) -> int | None:
        """When the first of the threads held now parked (CLOCK_MONOTONIC ns, the
        records' clock); None when none is held."""
        return int(self._hdr["parked_since_ns"]) or None

    @property
    def parked_at_call(self) -> int | None:
        """The number of the communication call the rank is held before (see
        :attr:`calls`); 0 when it is held at a call that is not one (a pause of the
        next call, see :meth:`pause`); None when no thread is held."""
        if not int(self._hdr["parked"]):
            return None
        at = int(self._hdr["parked_at_call"])
        # The hook stores it just after it counts the thread in: read again once.
        return at if int(self._hdr["parked"]) else None

    # ---- the GEMM benchmark, in the parked rank's own process -----------------

    def request_bench(self, n: int) -> int:
        """Asks the parked rank to run an n x n x n single-precision GEMM; returns
        the request's epoch for :meth:`bench_result`.

        The GEMM runs in C, on one thread of the rank's own process (its CPU set,
        its cgroup: a CPU quota or a throttled core confined to that rank shows
        only there), while the rank is held at the gate, which holds it after the
        GEMM too, until :meth:`resume`. The matrices (3 n^2 floats) are mapped on
        the first request and kept for later ones. A GEMM that would keep the rank
        past the pause timeout, or is still running at :meth:`resume`, stops, and
        its result says so. CPU only: on a GPU rank the same request would run in
        the rank's CUDA context (not built). :func:`bench_n_for` picks n.

        Raises:
            InputError: n is outside [BENCH_MIN_N, BENCH_MAX_N].
            RingError: the ring was opened read-only.
        """
        if not self._publish:
            raise RingError(f"ring: {self.path} was opened read-only; it cannot run a benchmark")
        if isinstance(n, bool) or not isinstance(n, int) or not BENCH_MIN_N <= n <= BENCH_MAX_N:
            raise InputError(f"ring: benchmark size n={n!r} is out of range; allowed: an int "
                             f"in [{BENCH_MIN_N}, {BENCH_MAX_N}]")
        self._bench_epoch = (max(self._bench_epoch, int(self._hdr["bench_request"]))
                             % 0xFFFFFFFE) + 1
        # bench_n before bench_request: the hook reads it after it sees the request.
        self._hdr["bench_n"] = n
        self._hdr["bench_request"] = self._bench_epoch
        return self._bench_epoch

    def bench_detail(self, epoch: int) -> BenchResult | None:
        """The answer to request ``epoch``: None while it is pending.

        Raises:
            RingError: a later request replaced this one before it was answered.
        """
        h = self._hdr
        if int(h["bench_done"]) != epoch:
            if int(h["bench_request"]) != epoch:
                raise RingError(f"ring: {self.path}: benchmark request {epoch} was replaced "
                                f"by request {int(h['bench_request'])} before it ran")
            return None
        # bench_done is stored after the result (release): read the result after it.
        status = int(h["bench_status"])
        return BenchResult(n=int(h["bench_n"]), status=status,
                           wall_s=int(h["bench_ns"]) / 1e9 if status == BENCH_OK else None,
                           cpu_s=int(h["bench_cpu_ns"]) / 1e9 if status == BENCH_OK else None)

    def bench_result(self, epoch: int) -> float | None:
        """Wall-clock seconds of request ``epoch``'s GEMM; None while it is pending.

        Raises:
            RingError: the rank answered without a result (stopped at the pause
                timeout or by a resume, bad size, no memory, not parked), or a later
                request replaced this one.
        """
        detail = self.bench_detail(epoch)
        if detail is None:
            return None
        if detail.status != BENCH_OK:
            raise RingError(f"ring: {self.path}: benchmark request {epoch} (n={detail.n}) "
                            f"has no result: {BENCH_STATUS_NAMES.get(detail.status, detail.status)}")
        return detail.wall_s

    def wait_bench(self, epoch: int, timeout_s: float) -> float:
        """:meth:`bench_result`, polled every millisecond until it is there.

        Raises:
            RingError: no answer within timeout_s, or as :meth:`bench_result`.
        """
        end = time.monotonic() + timeout_s
        while True:
            result = self.bench_result(epoch)
            if result is not None:
                return result
            if time.monotonic() > end:
                raise RingError(f"ring: {self.path}: benchmark request {epoch} not answered "
                                f"within {timeout_s} s (is the rank parked?)")
            time.sleep(0.001)

    def close(self) -> None:
        """Releases the mapping (arrays returned by read stay valid: they are copies)."""
        # Drops the views so that the map can close; a closed reader is not read again.
        self._hdr = None  # type: ignore[assignment]
        self._records = None  # type: ignore[assignment]
        self._comms = None  # type: ignore[assignment]
        self._map.close()

    def __enter__(self) -> RingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def op_names(records: np.ndarray) -> np.ndarray:
    """Op names of records, shape (n,) of str."""
    names = np.asarray(OP_NAMES + ("?",), dtype=object)
    return names[np.minimum(records["op"], len(OP_NAMES))]


def op_mask(ops) -> np.ndarray:
    """A lookup table for a set of op codes: ``op_mask(ops)[records["op"]]`` marks the
    records of those ops (ten times faster than np.isin on a poll's batch)."""
    table = np.zeros(1 << 16, dtype=bool)  # every uint16 op code indexes it
    table[np.fromiter(ops, dtype=np.int64)] = True
    return table


IS_CALL = op_mask(CALL_OPS)


def call_records(records: np.ndarray) -> np.ndarray:
    """The communication calls among records (no waits, groups, comm events, pauses)."""
    return records[IS_CALL[records["op"]]]
