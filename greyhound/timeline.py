"""In-process timeline recorder of a training rank: one row per op on sampled steps.

A training job creates one :class:`TimelineRecorder` per rank and wraps each op of its
step in :meth:`TimelineRecorder.span` (forward/backward compute per micro-batch, the PP
sends and receives, the DP gradient sync, the optimizer).  Python GC pauses are caught
with ``gc.callbacks``.  Only sampled steps are recorded (default every 10th), so the
recorder costs a few attribute lookups on the other steps.

Each rank appends to its own file ``<trace_dir>/rank-<NNNNN>.jsonl`` (JSON lines):

* line 1, the header: ``{"format": "greyhound-timeline", "version": 1, "rank", "dp_rank",
  "pp_rank", "node", "device", "job": {...}}`` where ``job`` holds what the merge step
  needs for the trace's TraceMeta (dp, pp, tp, num_microbatches, microbatches_per_dp,
  schedule, job_id, ...).
* one line per sampled step, written when the step ends: ``{"step", "num_microbatches",
  "ops": [[optype, microbatch, chunk, start_s, duration_s], ...], "seqlens":
  [[microbatch, [len, ...]], ...]}``.

A line is written whole at the end of its step, so a killed job leaves at most one torn
last line, which the merge step (``postmortem.merge``) skips.  Times are seconds on one
clock for the job: ``time.perf_counter()`` shifted to the wall clock once at start, so
ranks on one host share it and ranks on different hosts are as close as their NTP.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from greyhound.errors import InputError

log = logging.getLogger(__name__)

FORMAT_NAME = "greyhound-timeline"
FORMAT_VERSION = 1


def rank_file_name(rank: int) -> str:
    """Name of rank ``rank``'s file inside a trace dir."""
    return f"rank-{rank:05d}.jsonl"


@dataclass(frozen=True, kw_only=True)
class TimelineConfig:
    """Where and when a rank records its timeline."""

    trace_dir: str
    """Directory that receives one ``rank-NNNNN.jsonl`` file per rank."""
    every: int = 10
    """Record every ``every``-th step: steps s with (s + 1) % every == 0 (the 10th, 20th,
    ... step by default); 1 records every step."""
    record_gc: bool = True
    """Record Python GC pauses (gc.callbacks) on sampled steps."""
    append: bool = False
    """Continue an existing rank file (a resumed job) instead of starting it afresh."""

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"TimelineConfig.every must be an integer >= 1, got {self.every!r}")
        if not self.trace_dir:
            raise ValueError("TimelineConfig.trace_dir must be a directory path, got ''")


class _NullSpan:
    """The span of an unsampled step: does nothing, shared by every call."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


_NULL_SPAN = _NullSpan()


class _Span:
    __slots__ = ("_rec", "_optypes", "_microbatches", "_chunk", "_start")

    def __init__(self, rec: TimelineRecorder, optypes, microbatches, chunk: int):
        self._rec = rec
        self._optypes = optypes
        self._microbatches = microbatches
        self._chunk = chunk

    def __enter__(self) -> None:
        rec = self._rec
        if rec._sync is not None:
            rec._sync()  # a GPU op's time is its kernels' time, not the launch
        rec._current_mb = self._microbatches[0]
        self._start = rec.now()

    def __exit__(self, *exc) -> None:
        rec = self._rec
        if rec._sync is not None:
            rec._sync()
        end = rec.now()
        start = self._start
        # A combined op (send + recv batched together) is one row per part with the same
        # start and duration, as in the What-if study's traces.
        for optype, mb in zip(self._optypes, self._microbatches):
            rec._ops.append((optype, mb, self._chunk, start, end - start))
        rec._current_mb = -1


class TimelineRecorder:
    """Records the ops of one training rank on sampled steps and appends them to its file.

    Usage::

        rec = TimelineRecorder(config, rank=r, dp_rank=d, pp_rank=p, node=n, device="cpu",
                               job={"dp": 2, "pp": 4, ...})
        for step in ...:
            rec.start_step(step, num_microbatches=m)
            with rec.span("forward-compute", microbatch=i): ...
            with rec.span("forward-send", "backward-recv", microbatch=(i, j)): ...
            rec.seqlens(i, lengths)
            rec.end_step()
        rec.close()

    Args:
        config: the TimelineConfig.
        rank, dp_rank, pp_rank: this rank's place in the job.
        node: host (Slurm node) name; device: "cpu" or "cuda:N".
        job: JSON-serialisable job metadata for the merged trace (see module doc).
        sync: called before each clock read on sampled steps (``torch.cuda.synchronize``
            on GPUs, so that an op's time is its kernels' time); None on CPUs.
    """

    def __init__(
        self,
        config: TimelineConfig,
        *,
        rank: int,
        dp_rank: int,
        pp_rank: int,
        node: str,
        device: str,
        job: dict,
        sync: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self._sync = sync
        self._active = False
        self._step = -1
        self._num_microbatches = 0
        self._ops: list[tuple] = []
        self._seqlens: list[list] = []
        self._current_mb = -1
        self._gc_start = 0.0
        self._offset = time.time() - time.perf_counter()
        self.self_time_s = 0.0
        """Seconds spent writing step lines (the recorder's own I/O cost)."""
        path = Path(config.trace_dir)
        try:
            path.mkdir(parents=True, exist_ok=True)
            self.path = path / rank_file_name(rank)
            continuing = config.append and self.path.exists() and self.path.stat().st_size > 0
            self._file = open(self.path, "a" if continuing else "w", encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            raise InputError(f"timeline: cannot write trace dir {str(path)!r}: {exc.strerror}") from None
        header = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "rank": rank,
            "dp_rank": dp_rank,
            "pp_rank": pp_rank,
            "node": node,
            "device": device,
            "job": job,
        }
        if continuing:
            self._file.write("\n")  # end a line torn by the kill, if any; blank lines are skipped
        else:
            self._file.write(json.dumps(header) + "\n")
        self._file.flush()
        if config.record_gc:
            gc.callbacks.append(self._on_gc)

    # -- clock -----------------------------------------------------------------------
    def now(self) -> float:
        """Seconds on the job's clock (perf_counter resolution, wall-clock origin)."""
        return time.perf_counter() + self._offset

    # -- steps -----------------------------------------------------------------------
    def is_sampled(self, step: int) -> bool:
        """Whether step ``step`` is recorded."""
        return (step + 1) % self.config.every == 0

    @property
    def active(self) -> bool:
        """True between start_step and end_step of a sampled step."""
        return self._active

    def start_step(self, step: int, *, num_microbatches: int) -> None:
        """Begin step ``step`` (this rank runs ``num_microbatches`` micro-batches in it)."""
        self._step = step
        self._num_microbatches = num_microbatches
        self._active = self.is_sampled(step)
        self._ops.clear()
        self._seqlens.clear()

    def span(self, *optypes: str, microbatch: int | tuple[int, ...] = -1, chunk: int | None = None):
        """A context manager timing one op (or a combined op of several types).

        ``microbatch`` is one index for all parts, or one index per op type. ``chunk``
        defaults to 0 for ops with a micro-batch and -1 for ops without one.
        """
        if not self._active:
            return _NULL_SPAN
        if isinstance(microbatch, int):
            microbatches = (microbatch,) * len(optypes)
        else:
            microbatches = tuple(microbatch)
            if len(microbatches) != len(optypes):
                raise ValueError(f"span: {len(optypes)} op types but {len(microbatches)} micro-batches")
        if chunk is None:
            chunk = 0 if microbatches[0] >= 0 else -1
        return _Span(self, optypes, microbatches, chunk)

    def record(self, optype: str, *, microbatch: int = -1, start: float, duration: float,
               chunk: int | None = None) -> None:
        """Add an op timed elsewhere (e.g. with CUDA events), on the recorder's clock."""
        if self._active:
            if chunk is None:
                chunk = 0 if microbatch >= 0 else -1
            self._ops.append((optype, int(microbatch), chunk, float(start), float(duration)))

    def seqlens(self, microbatch: int, lengths) -> None:
        """Note the sample lengths (tokens) of micro-batch ``microbatch`` of this step."""
        if self._active:
            self._seqlens.append([int(microbatch), [int(x) for x in lengths]])

    def end_step(self) -> None:
        """End the step; a sampled step's line is appended to the rank file."""
        if not self._active:
            return
        self._active = False
        t0 = time.perf_counter()
        line = {
            "step": self._step,
            "num_microbatches": self._num_microbatches,
            "ops": self._ops,
            "seqlens": self._seqlens,
        }
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()
        self._ops = []
        self._seqlens = []
        self.self_time_s += time.perf_counter() - t0

    def close(self) -> None:
        """Stop recording GC pauses and close the file (idempotent)."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> TimelineRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- GC --------------------------------------------------------------------------
    def _on_gc(self, phase: str, info: dict) -> None:
        if not self._active:
            return
        if phase == "start":
            self._gc_start = self.now()
        elif phase == "stop" and self._gc_start:
            end = self.now()
            # The pause delayed whatever op was running (or none, -1).
            mb = self._current_mb
            self._ops.append(("gc", mb, 0 if mb >= 0 else -1, self._gc_start, end - self._gc_start))
            self._gc_start = 0.0
