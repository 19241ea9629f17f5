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

from greyhound.errors import InputError
from postmortem.schema import OPTYPE_CODE, OPTYPES, P2P_OPTYPES, Trace, TraceMeta

log = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("dp_rank", "stage", "step", "optype", "start_ts", "duration")
META_KEYS = ("dp_size", "pp_size")


def meta_path_for(trace_path: str | Path) -> Path:
    """``trace-X.parquet`` -> ``meta-X.yaml`` beside it."""
    p = Path(trace_path)
    name = p.name
    if name.startswith("trace-") and name.endswith(".parquet"):
        return p.with_name("meta-" + name[len("trace-") : -len(".parquet")] + ".yaml")
    return p.with_suffix(".yaml")


def read_whatif_meta(path: str | Path) -> dict:
    import yaml

    where = str(path)
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise InputError(f"{where}: no such meta file; give --meta FILE") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{where}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise InputError(f"{where}: meta must be a YAML mapping")
    for key in META_KEYS:
        if not isinstance(raw.get(key), int) or raw[key] < 1:
            raise InputError(f"{where}: meta key {key!r} must be an integer >= 1")
    if int(raw.get("vpp_size", 1) or 1) != 1:
        raise InputError(f"{where}: vpp_size {raw['vpp_size']} not supported; allowed: 1")
    return raw


def read_whatif_trace(path: str | Path, *, meta_path: str | Path | None = None) -> Trace:
    """Read a What-if parquet trace into greyhound's in-memory :class:`Trace`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    where = str(path)
    raw_meta = read_whatif_meta(meta_path or meta_path_for(path))
    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise InputError(f"{where}: no such file") from None
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputError(f"{where}: not a readable parquet file (truncated or corrupt?): {exc}") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise InputError(f"{where}: missing column(s) {', '.join(missing)}")

    def ints(name: str) -> np.ndarray:
        col = table.column(name)
        if not pa.types.is_integer(col.type):
            raise InputError(f"{where}: column {name!r} must be integer, got {col.type}")
        return col.to_numpy()

    def floats(name: str) -> np.ndarray:
        col = table.column(name)
        if not (pa.types.is_floating(col.type) or pa.types.is_integer(col.type)):
            raise InputError(f"{where}: column {name!r} must be numeric, got {col.type}")
        return col.to_numpy().astype(np.float64)

    optype_col = table.column("optype")
    if pa.types.is_dictionary(optype_col.type):
        optype_col = optype_col.combine_chunks()
        names = np.asarray(optype_col.dictionary.to_pylist(), dtype=object)
        idx = optype_col.indices.to_numpy(zero_copy_only=False)
    elif pa.types.is_string(optype_col.type) or pa.types.is_large_string(optype_col.type):
        names, idx = np.unique(np.asarray(optype_col.to_pylist(), dtype=str), return_inverse=True)
    else:
        raise InputError(f"{where}: column 'optype' must be categorical or string, got {optype_col.type}")
    used = np.zeros(len(names), bool)
    used[np.unique(idx)] = True  # a categorical may list categories no row uses
    unknown = [str(n) for n, u in zip(names, used) if u and n not in OPTYPE_CODE]
    if unknown:
        raise InputError(f"{where}: unknown op type(s) {', '.join(unknown)}; allowed: {', '.join(OPTYPES)}")
    table_codes = np.array([OPTYPE_CODE.get(str(n), -1) for n in names], dtype=np.int8)
    optype = table_codes[idx]

    mb = ints("mb_id").astype(np.int32) if "mb_id" in table.column_names else None
    seq = ints("seq_id").astype(np.int32) if "seq_id" in table.column_names else None
    n = table.num_rows
    if mb is None:
        mb = np.full(n, -1, np.int32)
    if seq is not None:
        p2p = np.isin(optype, [OPTYPE_CODE[o] for o in P2P_OPTYPES])
        mb = np.where(p2p, seq, mb).astype(np.int32)
    chunk = ints("mc").astype(np.int16) if "mc" in table.column_names else np.zeros(n, np.int16)
    ops = {
        "step": ints("step").astype(np.int32),
        "microbatch": mb,
        "pp_rank": ints("stage").astype(np.int16),
        "dp_rank": ints("dp_rank").astype(np.int16),
        "chunk": chunk,
        "optype": optype,
        "start": floats("start_ts"),
        "duration": floats("duration"),
    }
    dp, pp = int(raw_meta["dp_size"]), int(raw_meta["pp_size"])
    steps = np.unique(ops["step"])
    # micro-batches per DP replica: forward computes per (step, dp, stage 0)
    fwd = (optype == OPTYPE_CODE["forward-compute"]) & (ops["pp_rank"] == 0)
    per = np.bincount(ops["dp_rank"][fwd].astype(np.int64), minlength=dp)[:dp] // max(len(steps), 1)
    num_mb = int(per.max()) if per.size and per.max() > 0 else 1
    meta = TraceMeta(
        dp=dp,
        pp=pp,
        tp=int(raw_meta.get("tp_size", 1) or 1),
        num_microbatches=num_mb * dp,
        trial_name=str(raw_meta.get("trial_name")) if raw_meta.get("trial_name") is not None else None,
        source="whatif-parquet",
        extra={k: v for k, v in raw_meta.items() if isinstance(v, (int, float, str))},
    )
    workers = _workers_from(ops, table, dp=dp, pp=pp)
    return Trace(meta=meta, ops=ops, workers=workers, path=where)


def _workers_from(ops: dict, table, *, dp: int, pp: int) -> dict[str, np.ndarray]:
    """One worker per (dp, pp); the study's traces carry no host names."""
    d, p = np.meshgrid(np.arange(dp), np.arange(pp), indexing="ij")
    d, p = d.ravel(), p.ravel()
    rank = np.full(d.size, -1, np.int32)
    if "rank" in table.column_names:
        r = table.column("rank").to_numpy()
        key = ops["dp_rank"].astype(np.int64) * pp + ops["pp_rank"]
        ok = (key >= 0) & (key < dp * pp)
        rank[key[ok]] = r[ok]
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
    if not p.exists():
        raise InputError(f"{p}: no such file")
    with open(p, "rb") as f:
        magic = f.read(8)
    if magic.startswith(b"PAR1") or p.suffix == ".parquet":
        return read_whatif_trace(p, meta_path=meta_path)
    if magic.startswith(b"\x89HDF"):
        return read_trace(p)
    raise InputError(f"{p}: neither a greyhound HDF5 trace nor a What-if parquet trace")
