"""greyhound's HDF5 trace schema (version 1): one row per op of a DP x PP training job.

Writers (the merge step at job end, the reference training job, the test generators)
call :func:`write_trace`; the post-mortem calls :func:`read_trace`.  The file is the one
contract between them, so its layout is fixed here and versioned.

File layout (HDF5; every dataset 1-D, gzip-compressed and chunked)::

    /                     attrs: format="greyhound-trace", schema_version=1,
                                 meta=<JSON of TraceMeta>, optypes=<JSON list of names>
    /ops/step             int32    training step (iteration) number
    /ops/microbatch       int32    micro-batch index within the step on this DP rank,
                                   -1 for ops that belong to no micro-batch (DP sync,
                                   optimizer, gc).  p2p ops carry the micro-batch whose
                                   activation / gradient they move.
    /ops/pp_rank          int16    pipeline stage
    /ops/dp_rank          int16    data-parallel replica
    /ops/chunk            int16    model chunk on the stage (virtual pipeline), -1 if n/a
    /ops/optype           int8     code into the ``optypes`` attribute (see OPTYPES)
    /ops/start            float64  seconds; any origin, but one clock for the whole job
    /ops/duration         float64  seconds, >= 0
    /workers/rank         int32    global rank of the traced process (one TP rank per
                                   (dp, pp) worker is traced)
    /workers/dp_rank      int16
    /workers/pp_rank      int16
    /workers/node         str      host name
    /workers/device       str      device name ("cuda:3", "cpu")
    /seqlens/step         int32    optional: one row per (step, dp_rank, micro-batch)
    /seqlens/dp_rank      int16
    /seqlens/microbatch   int32
    /seqlens/offsets      int64    len rows + 1; sample lengths of row i are
    /seqlens/lengths      int32    lengths[offsets[i]:offsets[i+1]] (tokens)

Op types are the What-if study's names, plus one greyhound extension,
``grads-all-reduce``: a plain DDP gradient all-reduce after the last backward, which sits
in the DP sync stream exactly like ``grads-reduce-scatter``.  Python GC pauses are rows
of type ``gc`` (microbatch = the micro-batch they delayed, or -1).

Codes are stored with the file (the ``optypes`` attribute), so a reader never depends on
the order of :data:`OPTYPES` in the code that wrote the file.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from greyhound.atomic_file import atomic_file
from greyhound.errors import InputError, first_line

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
FORMAT_NAME = "greyhound-trace"

OPTYPES: tuple[str, ...] = (
    "forward-compute",
    "backward-compute",
    "forward-send",
    "forward-recv",
    "backward-send",
    "backward-recv",
    "params-all-gather",
    "grads-reduce-scatter",
    "separate-grads-all-reduce",
    "layernorm-grads-all-reduce",
    "embedding-grads-all-reduce",
    "optimizer-clip-main-grad",
    "optimizer",
    "gc",
    "grads-all-reduce",
)
"""Every op type greyhound knows; the index is the in-memory code."""

OPTYPE_CODE: dict[str, int] = {name: code for code, name in enumerate(OPTYPES)}
COMPUTE_OPTYPES: tuple[str, ...] = ("forward-compute", "backward-compute")
P2P_OPTYPES: tuple[str, ...] = ("forward-send", "forward-recv", "backward-send", "backward-recv")

OP_COLUMNS: dict[str, np.dtype] = {
    "step": np.dtype(np.int32),
    "microbatch": np.dtype(np.int32),
    "pp_rank": np.dtype(np.int16),
    "dp_rank": np.dtype(np.int16),
    "chunk": np.dtype(np.int16),
    "optype": np.dtype(np.int8),
    "start": np.dtype(np.float64),
    "duration": np.dtype(np.float64),
}
WORKER_COLUMNS: dict[str, np.dtype | None] = {
    "rank": np.dtype(np.int32),
    "dp_rank": np.dtype(np.int16),
    "pp_rank": np.dtype(np.int16),
    "node": None,  # str
    "device": None,  # str
}
SEQLEN_COLUMNS: dict[str, np.dtype] = {
    "step": np.dtype(np.int32),
    "dp_rank": np.dtype(np.int16),
    "microbatch": np.dtype(np.int32),
    "offsets": np.dtype(np.int64),
    "lengths": np.dtype(np.int32),
}
_CHUNK_ROWS = 1 << 16
MAX_DEGREE = int(np.iinfo(np.int16).max) + 1
"""The largest DP or PP degree: ranks are stored as int16."""


def optype_code(name: str) -> int:
    """The in-memory code of op type ``name``; InputError for an unknown name."""
    try:
        return OPTYPE_CODE[name]
    except KeyError:
        raise InputError(f"unknown op type {name!r}; allowed: {', '.join(OPTYPES)}") from None


def optype_name(code: int) -> str:
    """The name of in-memory op-type code ``code``."""
    if not 0 <= int(code) < len(OPTYPES):
        raise InputError(f"unknown op-type code {code}; allowed 0..{len(OPTYPES) - 1}")
    return OPTYPES[int(code)]


@dataclass(frozen=True, kw_only=True)
class TraceMeta:
    """What a trace says about the job that produced it."""

    dp: int
    """Data-parallel degree (number of DP replicas)."""
    pp: int
    """Pipeline-parallel degree (number of stages)."""
    tp: int = 1
    """Tensor-parallel degree; only one TP rank per (dp, pp) worker is traced."""
    num_microbatches: int
    """Micro-batches per step, summed over all DP replicas (the global batch)."""
    microbatches_per_dp: tuple[int, ...] | None = None
    """Micro-batches of each DP replica when uneven (mitigation S2); None = even split."""
    schedule: str = "1F1B"
    """Pipeline schedule: "1F1B" (PipeDream-flush / Megatron non-interleaved) or "GPipe"."""
    num_chunks: int = 1
    """Model chunks per stage (virtual pipeline size); the simulator supports 1."""
    job_id: str | None = None
    """Slurm job id, when known."""
    trial_name: str | None = None
    """Free-form run name (the What-if study's ``trial_name``)."""
    source: str = "greyhound"
    """Who wrote the trace: "greyhound" or "whatif-parquet"."""
    extra: dict = field(default_factory=dict)
    """Anything else the writer wants to keep (JSON-serialisable)."""

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "num_microbatches", "num_chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"TraceMeta.{name} must be an integer >= 1, got {value!r}")
        for name in ("dp", "pp"):  # ranks are int16 columns
            if getattr(self, name) > MAX_DEGREE:
                raise ValueError(f"TraceMeta.{name} must be at most {MAX_DEGREE}, got {getattr(self, name)!r}")
        if self.microbatches_per_dp is not None:
            counts = tuple(int(c) for c in self.microbatches_per_dp)
            object.__setattr__(self, "microbatches_per_dp", counts)
            if len(counts) != self.dp:
                raise ValueError(
                    f"TraceMeta.microbatches_per_dp has {len(counts)} entries, dp is {self.dp}"
                )
            if sum(counts) != self.num_microbatches or min(counts) < 1:
                raise ValueError(
                    "TraceMeta.microbatches_per_dp must be >= 1 each and sum to "
                    f"num_microbatches={self.num_microbatches}, got {counts}"
                )
        elif self.num_microbatches % self.dp:
            raise ValueError(
                f"TraceMeta.num_microbatches={self.num_microbatches} is not a multiple of "
                f"dp={self.dp}; give microbatches_per_dp for an uneven split"
            )
        if self.schedule not in ("1F1B", "GPipe"):
            raise ValueError(f"TraceMeta.schedule must be '1F1B' or 'GPipe', got {self.schedule!r}")

    def microbatches_of(self, dp_rank: int) -> int:
        """Micro-batches per step of DP replica ``dp_rank``."""
        if self.microbatches_per_dp is not None:
            return self.microbatches_per_dp[dp_rank]
        return self.num_microbatches // self.dp

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TraceMeta:
        """TraceMeta from its JSON; ValueError or TypeError when malformed."""
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError(f"job metadata must be a JSON object, got {type(raw).__name__}")
        if not isinstance(raw.get("extra", {}) or {}, dict):
            raise ValueError("job metadata 'extra' must be a JSON object")
        if raw.get("microbatches_per_dp") is not None and not isinstance(raw["microbatches_per_dp"], list):
            raise ValueError("job metadata 'microbatches_per_dp' must be a list of integers")
        known = set(cls.__dataclass_fields__)
        unknown = set(raw) - known
        extra = dict(raw.pop("extra", {}) or {})
        for key in unknown:  # a newer minor writer's fields are kept, not fatal
            extra[key] = raw.pop(key)
        if raw.get("microbatches_per_dp") is not None:
            raw["microbatches_per_dp"] = tuple(raw["microbatches_per_dp"])
        return cls(**raw, extra=extra)


@dataclass(frozen=True, kw_only=True)
class Trace:
    """A trace in memory: column arrays of equal length (struct of arrays)."""

    meta: TraceMeta
    ops: dict[str, np.ndarray]
    """Columns of OP_COLUMNS; ``optype`` holds in-memory codes into OPTYPES."""
    workers: dict[str, np.ndarray]
    seqlens: dict[str, np.ndarray] | None = None
    path: str | None = None
    dropped: tuple[str, ...] = ()
    """Human-readable notes on what was dropped while loading (damaged steps ...)."""

    @property
    def num_ops(self) -> int:
        return int(self.ops["step"].shape[0])

    def node_of(self) -> dict[tuple[int, int], str]:
        """(dp_rank, pp_rank) -> node name."""
        w = self.workers
        return {
            (int(d), int(p)): str(n) for d, p, n in zip(w["dp_rank"], w["pp_rank"], w["node"])
        }


def _as_optype_codes(values: np.ndarray, *, where: str) -> np.ndarray:
    values = np.asarray(values)
    if values.dtype.kind in "US" or values.dtype == object:
        names, inverse = np.unique(values.astype(str), return_inverse=True)
        table = np.array([optype_code(n) for n in names], dtype=np.int8)
        return table[inverse].astype(np.int8)
    if values.dtype.kind not in "iu":
        raise InputError(f"{where}: optype must be int8 codes or strings, got dtype {values.dtype}")
    if values.size and (values.min() < 0 or values.max() >= len(OPTYPES)):
        raise InputError(f"{where}: optype codes must be in 0..{len(OPTYPES) - 1}")
    return values.astype(np.int8)


def normalise_ops(ops: dict[str, np.ndarray], *, where: str) -> dict[str, np.ndarray]:
    """Check and cast op columns to the schema's dtypes (InputError on a problem)."""
    missing = [c for c in OP_COLUMNS if c not in ops]
    if missing:
        raise InputError(f"{where}: missing op column(s) {', '.join(missing)}")
    n = len(ops["step"])
    out: dict[str, np.ndarray] = {}
    for name, dtype in OP_COLUMNS.items():
        col = np.asarray(ops[name])
        if col.ndim != 1 or col.shape[0] != n:
            raise InputError(f"{where}: op column {name!r} has shape {col.shape}, expected ({n},)")
        if name == "optype":
            out[name] = _as_optype_codes(col, where=where)
            continue
        if dtype.kind == "f" and col.dtype.kind not in "fiu":
            raise InputError(f"{where}: op column {name!r} must be numeric, got dtype {col.dtype}")
        if dtype.kind == "i" and col.dtype.kind not in "iu":
            raise InputError(f"{where}: op column {name!r} must be integer, got dtype {col.dtype}")
        out[name] = _cast_checked(col, dtype, where=where, what=f"op column {name!r}")
    return out


def write_trace(
    path: str | os.PathLike,
    *,
    ops: dict[str, np.ndarray],
    workers: dict[str, np.ndarray],
    meta: TraceMeta,
    seqlens: dict[str, np.ndarray] | None = None,
) -> None:
    """Write a trace atomically (temporary file beside ``path``, then rename).

    Args:
        ops: OP_COLUMNS, each shape (n_ops,); ``optype`` as int8 codes into OPTYPES or
            as strings.
        workers: WORKER_COLUMNS, each shape (n_workers,).
        meta: the job's TraceMeta.
        seqlens: optional SEQLEN_COLUMNS: ``step``, ``dp_rank``, ``microbatch`` shape
            (n_rows,), ``offsets`` (n_rows + 1,), ``lengths`` (offsets[-1],).  Instead of
            ``offsets`` + ``lengths`` a 2-D ``lengths`` (n_rows, max_samples) padded with
            0 is accepted.
    Raises:
        InputError: a column is missing or malformed.
    """
    import h5py

    path = Path(path)
    where = str(path)
    cols = normalise_ops(ops, where=where)
    wcols = _normalise_workers(workers, where=where)
    scols = _normalise_seqlens(seqlens, where=where, dp=meta.dp) if seqlens is not None else None
    # h5py opens by name: /proc/self/fd/N names the temporary file itself.
    with atomic_file(path, mode=0o644) as out, h5py.File(f"/proc/self/fd/{out.fileno()}", "w") as f:
        f.attrs["format"] = FORMAT_NAME
        f.attrs["schema_version"] = SCHEMA_VERSION
        f.attrs["meta"] = meta.to_json()
        f.attrs["optypes"] = json.dumps(list(OPTYPES))
        _write_group(f, "ops", cols)
        _write_group(f, "workers", wcols)
        if scols is not None:
            _write_group(f, "seqlens", scols)


def _write_group(f, name: str, cols: dict[str, np.ndarray]) -> None:
    import h5py

    group = f.create_group(name)
    for key, col in cols.items():
        if col.dtype.kind in "UO":
            data = np.asarray([str(v) for v in col], dtype=object)
            group.create_dataset(key, data=data, dtype=h5py.string_dtype())
            continue
        chunks = (min(max(col.shape[0], 1), _CHUNK_ROWS),)
        group.create_dataset(
            key, data=col, chunks=chunks, compression="gzip", compression_opts=4, shuffle=True
        )


def _normalise_workers(workers: dict[str, np.ndarray], *, where: str) -> dict[str, np.ndarray]:
    missing = [c for c in WORKER_COLUMNS if c not in workers]
    if missing:
        raise InputError(f"{where}: missing worker column(s) {', '.join(missing)}")
    n = len(workers["rank"])
    out = {}
    for name, dtype in WORKER_COLUMNS.items():
        col = np.asarray(workers[name])
        if col.ndim != 1 or col.shape[0] != n:
            raise InputError(f"{where}: worker column {name!r} has shape {col.shape}, expected ({n},)")
        if dtype is None:
            out[name] = np.asarray([v.decode() if isinstance(v, bytes) else str(v) for v in col])
        elif col.dtype.kind not in "iu":
            raise InputError(f"{where}: worker column {name!r} must be integer, got dtype {col.dtype}")
        else:
            out[name] = _cast_checked(col, dtype, where=where, what=f"worker column {name!r}")
    return out


def _normalise_seqlens(seqlens: dict[str, np.ndarray], *, where: str, dp: int) -> dict[str, np.ndarray]:
    """Check and cast the seqlens columns; samples of 0 tokens are left out, and so are
    rows left without samples or with a DP rank outside 0..dp-1 (nothing to correlate)."""
    s = dict(seqlens)
    lengths = np.asarray(s.get("lengths"))
    if "offsets" not in s and lengths.ndim == 2:  # fixed max, 0-padded
        counts = (lengths > 0).sum(axis=1)
        s["offsets"] = np.concatenate([[0], np.cumsum(counts)])
        s["lengths"] = lengths[lengths > 0]
    missing = [c for c in SEQLEN_COLUMNS if c not in s]
    if missing:
        raise InputError(f"{where}: missing seqlens column(s) {', '.join(missing)}")
    out = {}
    for k, dt in SEQLEN_COLUMNS.items():
        col = np.asarray(s[k])
        if col.ndim != 1 or col.dtype.kind not in "iu":
            raise InputError(f"{where}: seqlens column {k!r} must be 1-D integers, got {col.dtype} {col.shape}")
        out[k] = _cast_checked(col, dt, where=where, what=f"seqlens column {k!r}")
    n = out["step"].shape[0]
    if out["dp_rank"].shape[0] != n or out["microbatch"].shape[0] != n:
        raise InputError(f"{where}: seqlens step/dp_rank/microbatch lengths differ")
    off = out["offsets"]
    if off.shape[0] != n + 1 or off[0] != 0 or np.any(np.diff(off) < 0) or off[-1] != out["lengths"].shape[0]:
        raise InputError(f"{where}: seqlens offsets must be non-decreasing, start at 0, end at len(lengths)")
    lengths = out["lengths"]
    if lengths.size and lengths.min() < 0:
        raise InputError(f"{where}: seqlens lengths must be >= 0 tokens, got {int(lengths.min())}")
    row = np.repeat(np.arange(n), np.diff(off))
    sample = lengths > 0
    counts = np.bincount(row[sample], minlength=n)
    keep = (counts > 0) & (out["dp_rank"] >= 0) & (out["dp_rank"] < dp)
    if keep.all() and sample.all():
        return out
    kept = {k: out[k][keep] for k in ("step", "dp_rank", "microbatch")}
    kept["offsets"] = np.concatenate([[0], np.cumsum(counts[keep])]).astype(np.int64)
    kept["lengths"] = lengths[sample & keep[row]]
    return kept


READ_TIMEOUT_S = 60.0
"""Time the HDF5 reader gets for a trace, plus :data:`READ_SECONDS_PER_BYTE` per byte of
the file; past it the file is refused (libhdf5 loops forever on some corrupt files)."""
READ_SECONDS_PER_BYTE = 1 / 10e6
_H5_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError, AttributeError, IndexError)
"""What h5py raises for a damaged file, depending on the structure that is damaged."""
_DEFLATE_MAX_RATIO = 1100
"""Deflate expands at most 1032:1; a dataset claiming more rows than its stored bytes
can hold is damaged (HDF5 would silently fill the missing chunks with zeros)."""


def read_trace(path: str | os.PathLike, *, isolate: bool = True) -> Trace:
    """Read a greyhound HDF5 trace.

    Structure problems (not HDF5, missing dataset, wrong dtype, unknown op type, newer
    schema, values outside a column's type) raise InputError naming the file.  Row-level
    damage (NaN or negative times) is not fatal here: the analysis drops the affected
    steps and says so.

    Args:
        isolate: parse the file in a forked child process (default where ``os.fork``
            exists).  libhdf5 can crash or loop forever on a corrupt file; in a child
            that becomes an InputError instead of a dead or hung greyhound.
    """
    where = str(path)
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise InputError(f"{where}: no such file") from None
    except OSError as exc:
        raise InputError(f"{where}: cannot read: {exc.strerror}") from None
    if not isolate or not hasattr(os, "fork"):
        return _read_trace_here(where)
    import h5py  # noqa: F401  imported here, once, not in every child

    from postmortem._isolate import run_isolated

    timeout = READ_TIMEOUT_S + size * READ_SECONDS_PER_BYTE
    return run_isolated(_read_trace_here, where, timeout=timeout, what=f"{where}: the HDF5 library")


def _read_trace_here(where: str) -> Trace:
    """:func:`read_trace` in this process."""
    import h5py

    try:
        f = h5py.File(where, "r")
    except FileNotFoundError:
        raise InputError(f"{where}: no such file") from None
    except _H5_ERRORS as exc:
        raise InputError(f"{where}: not a readable HDF5 file (truncated or corrupt?): {first_line(exc)}") from None
    try:
        with f:
            meta, file_optypes = _read_attrs(f, where=where)
            ops = _read_group(f, "ops", OP_COLUMNS, where=where)
            # remap the file's codes to this build's codes
            table = np.array([optype_code(n) for n in file_optypes], dtype=np.int8)
            codes = ops["optype"]
            if codes.size and (codes.min() < 0 or codes.max() >= table.size):
                raise InputError(
                    f"{where}: op-type code out of range of the file's optypes table (0..{table.size - 1})"
                )
            ops["optype"] = table[codes]
            workers = _read_group(f, "workers", WORKER_COLUMNS, where=where)
            seqlens = _read_group(f, "seqlens", SEQLEN_COLUMNS, where=where) if "seqlens" in f else None
    except _H5_ERRORS as exc:
        raise InputError(f"{where}: HDF5 read failed (truncated or corrupt?): {first_line(exc)}") from None
    ops = normalise_ops(ops, where=where)
    _check_same_length(workers, where=where, what="worker")
    if seqlens is not None:
        seqlens = _normalise_seqlens(seqlens, where=where, dp=meta.dp)
    return Trace(meta=meta, ops=ops, workers=workers, seqlens=seqlens, path=where)


def _read_attrs(f, *, where: str) -> tuple[TraceMeta, list[str]]:
    """The file's job metadata and its op-type table, checked."""
    if _attr_text(f, "format") != FORMAT_NAME:
        raise InputError(f"{where}: not a greyhound trace (format attribute missing or not {FORMAT_NAME!r})")
    version = f.attrs.get("schema_version", -1)
    if not isinstance(version, (int, np.integer)) or int(version) != SCHEMA_VERSION:
        raise InputError(f"{where}: trace schema version {version!r}, this greyhound reads {SCHEMA_VERSION}")
    try:
        # None (absent, or not text) raises TypeError: bad job metadata, as any other.
        meta = TraceMeta.from_json(_attr_text(f, "meta"))  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError, RecursionError) as exc:
        raise InputError(f"{where}: bad job metadata: {first_line(exc)}") from None
    try:
        file_optypes = json.loads(_attr_text(f, "optypes") or "[]")
    except (TypeError, ValueError, RecursionError) as exc:
        raise InputError(f"{where}: bad optypes attribute (a JSON list of op-type names): {first_line(exc)}") from None
    if not isinstance(file_optypes, list) or not all(isinstance(n, str) for n in file_optypes):
        raise InputError(f"{where}: bad optypes attribute: must be a JSON list of op-type names")
    if len(file_optypes) > np.iinfo(np.int8).max + 1:
        raise InputError(f"{where}: optypes attribute lists {len(file_optypes)} names; at most 128")
    return meta, file_optypes


def _attr_text(f, name: str) -> str | None:
    """A string attribute, or None when absent or not a string."""
    value = f.attrs.get(name)
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else None


def _check_same_length(cols: dict[str, np.ndarray], *, where: str, what: str) -> None:
    lengths = {name: col.shape for name, col in cols.items()}
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{name} {shape}" for name, shape in lengths.items())
        raise InputError(f"{where}: {what} columns differ in length: {shown}")


def _read_group(f, name: str, columns: dict, *, where: str) -> dict[str, np.ndarray]:
    import h5py

    if name not in f or not isinstance(f[name], h5py.Group):
        raise InputError(f"{where}: missing group /{name}")
    group = f[name]
    size = os.path.getsize(where)
    out = {}
    for key, dtype in columns.items():
        if key not in group or not isinstance(group[key], h5py.Dataset):
            raise InputError(f"{where}: missing dataset /{name}/{key}")
        dset = group[key]
        if dset.ndim != 1:
            raise InputError(f"{where}: /{name}/{key} has shape {dset.shape}, expected one dimension")
        claimed = dset.shape[0] * dset.dtype.itemsize
        stored = dset.id.get_storage_size()
        if claimed > _DEFLATE_MAX_RATIO * max(stored, 1) + 4096 or stored > size:
            raise InputError(
                f"{where}: /{name}/{key} claims {dset.shape[0]} rows but the file stores "
                f"{stored} bytes of it (truncated or corrupt?)"
            )
        if dset.dtype.kind in "iuf":
            _check_storage(dset, where=where, what=f"/{name}/{key}")
        data = dset[()]
        if dtype is None:
            if data.dtype.kind not in "OSU":
                raise InputError(f"{where}: /{name}/{key} has dtype {data.dtype}, expected strings")
            try:
                out[key] = np.asarray([v.decode() if isinstance(v, bytes) else str(v) for v in data])
            except UnicodeDecodeError:
                raise InputError(f"{where}: /{name}/{key} holds text that is not UTF-8") from None
            continue
        if data.dtype.kind != dtype.kind and not (dtype.kind == "f" and data.dtype.kind in "iu") \
                and not (dtype.kind == "i" and data.dtype.kind == "u"):
            raise InputError(f"{where}: /{name}/{key} has dtype {data.dtype}, expected {dtype}")
        out[key] = _cast_checked(data, dtype, where=where, what=f"/{name}/{key}")
    return out


_SIZE_KEEPING_FILTERS = {2: 0, 3: 4}
"""HDF5 filters that do not compress: shuffle (id 2) keeps a chunk's size, fletcher32
(id 3) adds a 4-byte checksum."""


def _check_storage(dset, *, where: str, what: str) -> None:
    """InputError unless every chunk of a numeric dataset is stored and its stored size
    fits its filters.

    libhdf5 hands out what a damaged layout implies without an error: fill values for a
    chunk that is not stored, and uninitialised memory for a chunk whose filter mask
    says "not compressed" but whose stored bytes are fewer than the chunk holds (a
    different array on every read).
    """
    rows = dset.shape[0]
    if dset.chunks is None:  # contiguous or compact: the bytes as they are
        if dset.id.get_storage_size() != rows * dset.dtype.itemsize:
            raise InputError(f"{where}: {what} stores {dset.id.get_storage_size()} bytes for {rows} rows "
                             "(truncated or corrupt?)")
        return
    chunk_rows = dset.chunks[0]
    expected = -(-rows // chunk_rows)
    num = dset.id.get_num_chunks()
    if num != expected:
        raise InputError(f"{where}: {what} stores {num} of its {expected} chunks (truncated or corrupt?)")
    plist = dset.id.get_create_plist()
    filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
    chunk_bytes = chunk_rows * dset.dtype.itemsize
    for i in range(num):
        info = dset.id.get_chunk_info(i)
        applied = [f for bit, f in enumerate(filters) if not info.filter_mask >> bit & 1]
        if all(f in _SIZE_KEEPING_FILTERS for f in applied):
            want = chunk_bytes + sum(_SIZE_KEEPING_FILTERS[f] for f in applied)
            if info.size != want:
                raise InputError(
                    f"{where}: {what} chunk {i} stores {info.size} bytes uncompressed, its {chunk_rows} rows "
                    f"take {want} (truncated or corrupt?)"
                )
        elif info.size < 1:
            raise InputError(f"{where}: {what} chunk {i} stores no bytes (truncated or corrupt?)")


def _cast_checked(col: np.ndarray, dtype: np.dtype, *, where: str, what: str) -> np.ndarray:
    """``col`` as ``dtype``; InputError instead of a silent wrap for an integer that
    does not fit (e.g. an int64 rank of 70000 into int16)."""
    if dtype.kind in "iu" and col.dtype.kind in "iu" and col.size:
        info = np.iinfo(dtype)
        lo, hi = col.min(), col.max()
        if int(lo) < info.min or int(hi) > info.max:
            bad = int(lo) if int(lo) < info.min else int(hi)
            raise InputError(
                f"{where}: {what} holds {bad}, outside its type {dtype} ({info.min}..{info.max})"
            )
    if dtype.kind in "iu" and col.dtype.kind == "f":
        raise InputError(f"{where}: {what} must be integer, got dtype {col.dtype}")
    if dtype.kind == "f" and col.dtype.kind == "f" and col.dtype.itemsize > dtype.itemsize and col.size:
        # A wider float (float128) would become inf, with numpy's warning, not an error.
        largest = np.abs(col[np.isfinite(col)]).max(initial=0)
        if largest > np.finfo(dtype).max:
            shown = np.format_float_scientific(largest, precision=3)  # float() would say inf
            raise InputError(f"{where}: {what} holds {shown}, outside its type {dtype} "
                             f"(magnitude up to {np.finfo(dtype).max:.4g})")
    return col.astype(dtype, copy=False)
