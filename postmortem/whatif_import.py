"""Importer for the What-if study's trace format: ``trace-X.parquet`` + ``meta-X.yaml``.

The parquet has one row per op (columns ``dp_rank, stage, rank, step, optype, start_ts,
duration, seq_id, mc, mb_id, gmc``; ``optype`` is a dictionary/categorical column), each
step's start shifted to 0.  p2p ops carry no micro-batch id (``mb_id`` = -1); for the
non-interleaved schedules these traces come from, their ``seq_id`` (index in start order
per step, rank and op type) is the micro-batch, which is what greyhound's schema stores.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from greyhound.errors import InputError, first_line, read_input_file
from postmortem.schema import MAX_DEGREE, OPTYPE_CODE, OPTYPES, P2P_OPTYPES, Trace, TraceMeta

log = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("dp_rank", "stage", "step", "optype", "start_ts", "duration")
OPTIONAL_COLUMNS = ("rank", "seq_id", "mc", "mb_id")
READ_COLUMNS = REQUIRED_COLUMNS + OPTIONAL_COLUMNS
"""Every column the importer reads; others are ignored."""
META_KEYS = ("dp_size", "pp_size")


def meta_path_for(trace_path: str | Path) -> Path:
    """``trace-X.parquet`` -> ``meta-X.yaml`` beside it."""
    p = Path(trace_path)
    name = p.name
    if name.startswith("trace-") and name.endswith(".parquet"):
        return p.with_name("meta-" + name[len("trace-") : -len(".parquet")] + ".yaml")
    return p.with_suffix(".yaml")


def read_whatif_meta(path: str | Path) -> dict:
    """The meta YAML of a What-if trace, checked; InputError when malformed."""
    import yaml

    where = str(path)
    # bytes: YAML detects the encoding, bad bytes are a YAMLError
    text = read_input_file(where, expected="the meta YAML file", missing="no such meta file; give --meta FILE")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InputError(f"{where}: not valid YAML: {first_line(exc)}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # e.g. a date 2024-13-01
        raise InputError(f"{where}: not valid YAML: {first_line(exc)}") from None
    if not isinstance(raw, dict):
        raise InputError(f"{where}: meta must be a YAML mapping")
    for key in META_KEYS:
        if not _is_int(raw.get(key)) or not 1 <= raw[key] <= MAX_DEGREE:
            raise InputError(
                f"{where}: meta key {key!r} must be an integer from 1 to {MAX_DEGREE}, got {raw.get(key)!r}"
            )
    for key in ("tp_size", "vpp_size"):
        value = raw.get(key)
        if value is not None and (not _is_int(value) or value < 1):
            raise InputError(f"{where}: meta key {key!r} must be an integer >= 1, got {value!r}")
    if (raw.get("vpp_size") or 1) != 1:
        raise InputError(f"{where}: vpp_size {raw['vpp_size']} not supported; allowed: 1")
    return raw


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_whatif_trace(path: str | Path, *, meta_path: str | Path | None = None) -> Trace:
    """Read a What-if parquet trace into greyhound's in-memory :class:`Trace`.

    Raises:
        InputError: the meta file or the parquet is missing, unreadable or malformed
            (missing or mistyped columns, integers outside greyhound's column types,
            unknown op types).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    where = str(path)
    raw_meta = read_whatif_meta(meta_path or meta_path_for(path))
    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise InputError(f"{where}: no such file") from None
    except (pa.ArrowException, OSError, ValueError, MemoryError) as exc:
        raise InputError(
            f"{where}: not a readable parquet file (truncated or corrupt?): {first_line(exc)}"
        ) from None
    try:
        return _trace_from_table(table, raw_meta, where=where)
    except UnicodeDecodeError:
        raise InputError(f"{where}: a column name or op type is not UTF-8 text (corrupt file?)") from None
    except pa.ArrowException as exc:
        raise InputError(f"{where}: malformed parquet data (corrupt file?): {first_line(exc)}") from None


def _trace_from_table(table, raw_meta: dict, *, where: str) -> Trace:
    import pyarrow as pa

    names = table.column_names
    duplicated = sorted({c for c in names if c in READ_COLUMNS and names.count(c) > 1})
    if duplicated:
        raise InputError(f"{where}: column(s) {', '.join(duplicated)} appear more than once; each at most once")
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise InputError(f"{where}: missing column(s) {', '.join(missing)}")

    def ints(name: str, dtype) -> np.ndarray:
        """An integer column as ``dtype``; InputError for empty cells or values that
        do not fit (never a silent wrap)."""
        col = table.column(name)
        if not pa.types.is_integer(col.type):
            raise InputError(f"{where}: column {name!r} must be integer, got {col.type}")
        if col.null_count:
            raise InputError(f"{where}: column {name!r} has {col.null_count} empty cell(s)")
        values = col.to_numpy()
        info = np.iinfo(dtype)
        if values.size and (int(values.min()) < info.min or int(values.max()) > info.max):
            bad = int(values.min()) if int(values.min()) < info.min else int(values.max())
            raise InputError(
                f"{where}: column {name!r} holds {bad}, outside {np.dtype(dtype)} ({info.min}..{info.max})"
            )
        return values.astype(dtype)

    def floats(name: str) -> np.ndarray:
        col = table.column(name)
        if not (pa.types.is_floating(col.type) or pa.types.is_integer(col.type)):
            raise InputError(f"{where}: column {name!r} must be numeric, got {col.type}")
        with np.errstate(invalid="ignore"):  # a signalling NaN in float32 is a NaN like the rest
            return col.to_numpy().astype(np.float64)  # empty cells: NaN (damaged rows, dropped later)

    n = table.num_rows
    optype = _optype_codes(table.column("optype"), n, where=where)
    mb = ints("mb_id", np.int32) if "mb_id" in names else None
    seq = ints("seq_id", np.int32) if "seq_id" in names else None
    if mb is None:
        mb = np.full(n, -1, np.int32)
    if seq is not None:
        p2p = np.isin(optype, [OPTYPE_CODE[o] for o in P2P_OPTYPES])
        mb = np.where(p2p, seq, mb).astype(np.int32)
    chunk = ints("mc", np.int16) if "mc" in names else np.zeros(n, np.int16)
    ops = {
        "step": ints("step", np.int32),
        "microbatch": mb,
        "pp_rank": ints("stage", np.int16),
        "dp_rank": ints("dp_rank", np.int16),
        "chunk": chunk,
        "optype": optype,
        "start": floats("start_ts"),
        "duration": floats("duration"),
    }
    dp, pp = int(raw_meta["dp_size"]), int(raw_meta["pp_size"])
    steps = np.unique(ops["step"])
    # micro-batches per DP replica: forward computes per (step, dp, stage 0)
    fwd = (optype == OPTYPE_CODE["forward-compute"]) & (ops["pp_rank"] == 0)
    fwd &= (ops["dp_rank"] >= 0) & (ops["dp_rank"] < dp)  # other rows are damaged, dropped later
    per = np.bincount(ops["dp_rank"][fwd].astype(np.int64), minlength=dp)[:dp] // max(len(steps), 1)
    num_mb = int(per.max()) if per.size and per.max() > 0 else 1
    try:
        meta = TraceMeta(
            dp=dp,
            pp=pp,
            tp=int(raw_meta.get("tp_size", 1) or 1),
            num_microbatches=num_mb * dp,
            trial_name=str(raw_meta.get("trial_name")) if raw_meta.get("trial_name") is not None else None,
            source="whatif-parquet",
            extra={k: v for k, v in raw_meta.items() if isinstance(k, str) and isinstance(v, (int, float, str))},
        )
    except ValueError as exc:
        raise InputError(f"{where}: inconsistent job metadata: {exc}") from None
    workers = _workers_from(ops, table, dp=dp, pp=pp, where=where)
    return Trace(meta=meta, ops=ops, workers=workers, path=where)


def _optype_codes(col, n: int, *, where: str) -> np.ndarray:
    """(n,) int8 codes into OPTYPES of the ``optype`` column (categorical or string)."""
    import pyarrow as pa

    if pa.types.is_dictionary(col.type):
        col = col.combine_chunks()
        names = np.asarray(col.dictionary.to_pylist(), dtype=object)
        if col.indices.null_count:
            raise InputError(f"{where}: column 'optype' has {col.indices.null_count} empty cell(s)")
        idx = col.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(names)):
            raise InputError(f"{where}: column 'optype' has a category code outside its {len(names)} categories")
    elif pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        if col.null_count:
            raise InputError(f"{where}: column 'optype' has {col.null_count} empty cell(s)")
        names, idx = np.unique(np.asarray(col.to_pylist(), dtype=str), return_inverse=True)
        idx = idx.reshape(-1)
    else:
        raise InputError(f"{where}: column 'optype' must be categorical or string, got {col.type}")
    used = np.zeros(len(names), bool)
    used[np.unique(idx)] = True  # a categorical may list categories no row uses
    unknown = [str(name) for name, u in zip(names, used) if u and name not in OPTYPE_CODE]
    if unknown:
        raise InputError(f"{where}: unknown op type(s) {', '.join(unknown)}; allowed: {', '.join(OPTYPES)}")
    table_codes = np.array([OPTYPE_CODE.get(name, -1) if isinstance(name, str) else -1 for name in names],
                           dtype=np.int8)
    return table_codes[idx] if n else np.zeros(0, np.int8)


def _workers_from(ops: dict, table, *, dp: int, pp: int, where: str) -> dict[str, np.ndarray]:
    """One worker per (dp, pp); the study's traces carry no host names."""
    import pyarrow as pa

    if dp * pp > max(4 * table.num_rows, 1 << 16):
        raise InputError(
            f"{where}: meta declares dp_size x pp_size = {dp} x {pp} = {dp * pp} workers, but the trace "
            f"has only {table.num_rows} op rows; dp_size and pp_size must be the traced job's"
        )
    grid_d, grid_p = np.meshgrid(np.arange(dp), np.arange(pp), indexing="ij")
    d, p = grid_d.ravel(), grid_p.ravel()
    rank = np.full(d.size, -1, np.int32)
    if "rank" in table.column_names:
        col = table.column("rank")
        if not pa.types.is_integer(col.type) or col.null_count:
            raise InputError(f"{where}: column 'rank' must be integer without empty cells, got {col.type}")
        r = col.to_numpy()
        info = np.iinfo(np.int32)
        if r.size and (int(r.min()) < info.min or int(r.max()) > info.max):
            raise InputError(f"{where}: column 'rank' holds values outside int32 ({info.min}..{info.max})")
        dr, pr = ops["dp_rank"].astype(np.int64), ops["pp_rank"].astype(np.int64)
        ok = (dr >= 0) & (dr < dp) & (pr >= 0) & (pr < pp)  # other rows are damaged, dropped later
        rank[(dr * pp + pr)[ok]] = r[ok]
    return {
        "rank": rank,
        "dp_rank": d.astype(np.int16),
        "pp_rank": p.astype(np.int16),
        "node": np.asarray([f"rank{r}" if r >= 0 else "?" for r in rank]),
        "device": np.asarray(["?"] * d.size),
    }


def load_any(path: str | Path, *, meta_path: str | Path | None = None) -> Trace:
    """Load greyhound HDF5 or a What-if parquet trace, by content/extension."""
    from postmortem.schema import read_trace

    p = Path(path)
    magic = read_input_file(p, expected="a trace file", max_bytes=8)
    if magic.startswith(b"PAR1") or p.suffix == ".parquet":
        return read_whatif_trace(p, meta_path=meta_path)
    if magic.startswith(b"\x89HDF"):
        return read_trace(p)
    raise InputError(f"{p}: neither a greyhound HDF5 trace nor a What-if parquet trace")
