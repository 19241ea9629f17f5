"""Merge the per-rank timeline files of a trace dir into greyhound's HDF5 trace.

The training ranks write ``rank-NNNNN.jsonl`` files (:mod:`greyhound.timeline`); at job
end this module reads them all and writes one trace with
:func:`postmortem.schema.write_trace`.

A step that some worker did not record completely (a rank killed mid-step, a torn last
line) is dropped from every worker, so the trace holds only whole steps; what was
dropped is listed in ``meta.extra["dropped_steps"]``.  When the micro-batch split changed
during the job (mitigation S2), the trace's ``microbatches_per_dp`` is the split of the
first kept step and ``meta.extra["microbatches_per_dp_by_step"]`` keeps every step's.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import click
import numpy as np

from greyhound.errors import InputError
from greyhound.timeline import FORMAT_NAME, FORMAT_VERSION
from postmortem.schema import MAX_DEGREE, OP_COLUMNS, TraceMeta, optype_code, write_trace

log = logging.getLogger(__name__)

TRACE_FILE_NAME = "trace.h5"
"""Default name of the merged trace inside the trace dir."""


@dataclass
class RankTimeline:
    """What one rank file holds."""

    path: Path
    header: dict
    steps: dict[int, dict] = field(default_factory=dict)
    """step -> step record (``num_microbatches``, ``ops``, ``seqlens``); a step recorded
    twice (re-run after a resume) keeps its last record."""
    torn_lines: int = 0


def read_rank_file(path: str | os.PathLike) -> RankTimeline:
    """Read one ``rank-NNNNN.jsonl`` file; a torn or garbled step line is skipped.

    Raises:
        InputError: the header is missing, not a timeline header, or of a newer version.
    """
    path = Path(path)
    try:
        # bytes that are not UTF-8 (a torn write) garble their line, not the whole file
        lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    except OSError as exc:
        raise InputError(f"{path}: cannot read timeline file: {exc.strerror}") from None
    try:
        header = json.loads(lines[0]) if lines else None
    except (ValueError, RecursionError):  # ValueError: also an integer of > 4300 digits
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        raise InputError(f"{path}: not a greyhound timeline file (bad or missing header line)")
    if header.get("version") != FORMAT_VERSION:
        raise InputError(
            f"{path}: timeline format version {header.get('version')!r}, this greyhound reads {FORMAT_VERSION}"
        )
    for key in ("rank", "dp_rank", "pp_rank", "node", "device", "job"):
        if key not in header:
            raise InputError(f"{path}: timeline header lacks {key!r}")
    _check_header(path, header)
    out = RankTimeline(path=path, header=header)
    for line in lines[1:]:
        if not line.strip():  # a resumed rank starts its lines on a fresh line
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            record = None
        if not _is_step_record(record):
            out.torn_lines += 1
            continue
        out.steps[record["step"]] = record
    return out


_I16, _I32 = np.iinfo(np.int16), np.iinfo(np.int32)


def _is_int(value, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _is_number(value) -> bool:
    """A JSON number that is a float64 (NaN and inf are, and are dropped as damaged rows later)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, float) or (isinstance(value, int) and abs(value) < 1 << 63)


def _check_header(path: Path, header: dict) -> None:
    """InputError for a header field of the wrong type or outside greyhound's columns."""
    for key, lo, hi in (("rank", 0, _I32.max), ("dp_rank", 0, _I16.max), ("pp_rank", 0, _I16.max)):
        if not _is_int(header[key], lo, hi):
            raise InputError(f"{path}: timeline header {key!r} must be an integer from {lo} to {hi}, "
                             f"got {header[key]!r}")
    job = header["job"]
    if not isinstance(job, dict):
        raise InputError(f"{path}: timeline header 'job' must be an object, got {job!r}")
    for key in ("dp", "pp"):
        if not _is_int(job.get(key), 1, MAX_DEGREE):
            raise InputError(f"{path}: timeline header job {key!r} must be an integer from 1 to {MAX_DEGREE}, "
                             f"got {job.get(key)!r}")
    if "tp" in job and not _is_int(job["tp"], 1, _I32.max):
        raise InputError(f"{path}: timeline header job 'tp' must be an integer >= 1, got {job['tp']!r}")
    split = job.get("microbatches_per_dp")
    if split is not None and not (isinstance(split, list) and all(_is_int(c, 0, _I32.max) for c in split)):
        raise InputError(f"{path}: timeline header job 'microbatches_per_dp' must be a list of integers, got {split!r}")
    if not isinstance(job.get("extra", {}) or {}, dict):
        raise InputError(f"{path}: timeline header job 'extra' must be an object")


def _is_step_record(record) -> bool:
    """A step line as greyhound.timeline writes it, with values that fit the trace's
    columns; anything else is garbled (and skipped like a torn line)."""
    if not isinstance(record, dict):
        return False
    ops, seqlens = record.get("ops"), record.get("seqlens")
    if not (_is_int(record.get("step"), _I32.min, _I32.max) and _is_int(record.get("num_microbatches"), 0, _I32.max)
            and isinstance(ops, list) and isinstance(seqlens, list)):
        return False
    for op in ops:
        if not (isinstance(op, list) and len(op) == 5 and isinstance(op[0], str)
                and _is_int(op[1], _I32.min, _I32.max) and _is_int(op[2], _I16.min, _I16.max)
                and _is_number(op[3]) and _is_number(op[4])):
            return False
    for entry in seqlens:
        if not (isinstance(entry, list) and len(entry) == 2 and _is_int(entry[0], _I32.min, _I32.max)
                and isinstance(entry[1], list) and all(_is_int(x, 0, _I32.max) for x in entry[1])):
            return False
    return True


def _job_meta(headers: list[dict], *, split_by_step: dict[int, tuple[int, ...]], job_id: str | None,
              dropped: list[int], where: str) -> TraceMeta:
    job = dict(headers[0]["job"])
    for h in headers[1:]:
        for key in ("dp", "pp", "tp", "schedule"):
            if h["job"].get(key) != job.get(key):
                raise InputError(f"{where}: rank files disagree on job {key}: "
                                 f"{h['job'].get(key)!r} vs {job.get(key)!r}")
    dp, pp = int(job["dp"]), int(job["pp"])
    extra = dict(job.get("extra") or {})
    if split_by_step:
        first = split_by_step[min(split_by_step)]
        if len(set(split_by_step.values())) > 1:
            extra["microbatches_per_dp_by_step"] = {str(s): list(v) for s, v in sorted(split_by_step.items())}
    elif job.get("microbatches_per_dp") is not None:
        first = tuple(job["microbatches_per_dp"])
    else:
        raise InputError(
            f"{where}: no step has every DP replica's micro-batch count and the header gives no "
            "microbatches_per_dp"
        )
    if dropped:
        extra["dropped_steps"] = dropped
    even = len(set(first)) == 1
    return TraceMeta(
        dp=dp,
        pp=pp,
        tp=int(job.get("tp", 1)),
        num_microbatches=int(sum(first)),
        microbatches_per_dp=None if even else first,
        schedule=job.get("schedule", "1F1B"),
        job_id=job_id if job_id is not None else job.get("job_id"),
        trial_name=job.get("trial_name"),
        extra=extra,
    )


def merge_trace_dir(
    trace_dir: str | os.PathLike,
    out_path: str | os.PathLike | None = None,
    *,
    job_id: str | None = None,
) -> Path:
    """Merge every ``rank-*.jsonl`` of ``trace_dir`` into one HDF5 trace.

    Args:
        trace_dir: the directory the ranks wrote.
        out_path: the trace to write; default ``<trace_dir>/trace.h5``.
        job_id: overrides the job id the ranks recorded.
    Returns:
        The path written.
    Raises:
        InputError: no rank files, unreadable files, ranks that disagree on the job, a
            duplicate (dp, pp) worker, or no step that every worker recorded.
    """
    trace_dir = Path(trace_dir)
    where = str(trace_dir)
    ranks = _read_rank_files(trace_dir, where=where)
    complete, dropped = _complete_steps(ranks, where=where)
    headers = [r.header for r in ranks]
    split_by_step = _microbatch_split_by_step(ranks, complete, dp=int(headers[0]["job"]["dp"]))
    ops = _op_columns(ranks, complete)
    try:
        meta = _job_meta(headers, split_by_step=split_by_step, job_id=job_id, dropped=dropped, where=where)
    except ValueError as exc:
        raise InputError(f"{where}: inconsistent job metadata: {exc}") from None
    out = Path(out_path) if out_path is not None else trace_dir / TRACE_FILE_NAME
    write_trace(out, ops=ops, workers=_worker_columns(headers), meta=meta,
                seqlens=_seqlen_columns(ranks, complete))
    log.info("%s: merged %d ops of %d steps from %d ranks into %s",
             where, ops["step"].size, len(complete), len(ranks), out)
    return out


def _read_rank_files(trace_dir: Path, *, where: str) -> list[RankTimeline]:
    """Every rank file of the trace dir, in file-name order; InputError for none or for
    two ranks that claim one (dp, pp) worker."""
    files = sorted(trace_dir.glob("rank-*.jsonl"))
    if not files:
        raise InputError(f"{where}: no rank-*.jsonl timeline files in this directory")
    ranks = [read_rank_file(p) for p in files]
    seen: dict[tuple[int, int], int] = {}
    for h in (r.header for r in ranks):
        key = (int(h["dp_rank"]), int(h["pp_rank"]))
        if key in seen:
            raise InputError(
                f"{where}: ranks {seen[key]} and {h['rank']} both claim dp_rank {key[0]}, pp_rank {key[1]}")
        seen[key] = int(h["rank"])
    job = ranks[0].header["job"]
    dp, pp = int(job["dp"]), int(job["pp"])
    if len(ranks) != dp * pp:
        log.warning("%s: %d rank files for a dp=%d x pp=%d job; merging what is there", where, len(ranks), dp, pp)
    return ranks


def _complete_steps(ranks: list[RankTimeline], *, where: str) -> tuple[list[int], list[int]]:
    """(the steps every rank recorded, the others), both sorted; InputError for none."""
    all_steps = set().union(*(r.steps for r in ranks))
    complete = sorted(s for s in all_steps if all(s in r.steps for r in ranks))
    dropped = sorted(all_steps - set(complete))
    if dropped:
        log.warning("%s: steps %s were not recorded by every rank; dropped", where, dropped)
    if not complete:
        raise InputError(f"{where}: no step was recorded by every rank ({len(ranks)} rank files)")
    return complete, dropped


def _microbatch_split_by_step(ranks: list[RankTimeline], steps: list[int], *, dp: int) -> dict[int, tuple[int, ...]]:
    """Micro-batches of each DP replica per step, from the replica's first stage; a step
    some replica's first stage did not record is left out."""
    split_by_step: dict[int, tuple[int, ...]] = {}
    for step in steps:
        counts = [0] * dp
        for r in ranks:
            if int(r.header["pp_rank"]) == 0 and int(r.header["dp_rank"]) < dp:
                counts[int(r.header["dp_rank"])] = int(r.steps[step]["num_microbatches"])
        if all(counts):
            split_by_step[step] = tuple(counts)
    return split_by_step


def _op_columns(ranks: list[RankTimeline], steps: list[int]) -> dict[str, np.ndarray]:
    """The op rows of ``steps`` from every rank, sorted by (step, dp, pp, start)."""
    cols: dict[str, list] = {name: [] for name in OP_COLUMNS}
    for r in ranks:
        d, p = int(r.header["dp_rank"]), int(r.header["pp_rank"])
        for step in steps:
            for optype, mb, chunk, start, duration in r.steps[step]["ops"]:
                cols["step"].append(step)
                cols["microbatch"].append(mb)
                cols["pp_rank"].append(p)
                cols["dp_rank"].append(d)
                cols["chunk"].append(chunk)
                cols["optype"].append(optype_code(optype))
                cols["start"].append(start)
                cols["duration"].append(duration)
    ops = {name: np.asarray(values, dtype=OP_COLUMNS[name]) for name, values in cols.items()}
    order = np.lexsort((ops["start"], ops["pp_rank"], ops["dp_rank"], ops["step"]))
    return {name: col[order] for name, col in ops.items()}


def _seqlen_columns(ranks: list[RankTimeline], steps: list[int]) -> dict[str, np.ndarray] | None:
    """The sequence lengths of ``steps`` per (step, dp, micro-batch), sorted; None if no
    rank noted any.  Any stage may note them: the first copy in rank-file order is kept."""
    seq_step, seq_dp, seq_mb, seq_lengths = [], [], [], []
    seen: set[tuple[int, int, int]] = set()
    for r in ranks:
        d = int(r.header["dp_rank"])
        for step in steps:
            for mb, lengths in r.steps[step]["seqlens"]:
                key = (step, d, int(mb))
                if key in seen:
                    continue
                seen.add(key)
                seq_step.append(step)
                seq_dp.append(d)
                seq_mb.append(int(mb))
                seq_lengths.append(lengths)
    if not seq_step:
        return None
    order = np.lexsort((np.asarray(seq_mb), np.asarray(seq_dp), np.asarray(seq_step)))
    counts = np.asarray([len(seq_lengths[i]) for i in order], dtype=np.int64)
    return {
        "step": np.asarray(seq_step)[order],
        "dp_rank": np.asarray(seq_dp)[order],
        "microbatch": np.asarray(seq_mb)[order],
        "offsets": np.concatenate([[0], np.cumsum(counts)]),
        "lengths": np.asarray([x for i in order for x in seq_lengths[i]], dtype=np.int32),
    }


def _worker_columns(headers: list[dict]) -> dict[str, np.ndarray]:
    """One row per traced worker, by global rank."""
    by_rank = sorted(headers, key=lambda h: int(h["rank"]))
    return {
        "rank": np.asarray([int(h["rank"]) for h in by_rank]),
        "dp_rank": np.asarray([int(h["dp_rank"]) for h in by_rank]),
        "pp_rank": np.asarray([int(h["pp_rank"]) for h in by_rank]),
        "node": np.asarray([str(h["node"]) for h in by_rank]),
        "device": np.asarray([str(h["device"]) for h in by_rank]),
    }


@click.command("merge-trace")
@click.argument("trace_dir", type=click.Path(file_okay=False))
@click.option("-o", "--out", "out_path", type=click.Path(dir_okay=False), default=None,
              help="Trace file to write (default: TRACE_DIR/trace.h5).")
@click.option("--job-id", default=None, help="Slurm job id to store in the trace.")
def merge_command(trace_dir: str, out_path: str | None, job_id: str | None) -> None:
    """Merge a training job's per-rank timeline files into one HDF5 trace."""
    path = merge_trace_dir(trace_dir, out_path, job_id=job_id)
    click.echo(str(path))
