"""``greyhound detect``: the tracking analytics, offline, on one rank's CSV.

FILE is a CSV with a header, either a call trace (``time,op,comm,bytes``; time = call
start in seconds) or an iteration-time series (``iteration_time``, optional ``time``).
Extra columns are ignored. A call trace is turned into iteration times through its
period (:mod:`greyhound.analytics.period`); both then go through the same detector,
exactly as the node agent runs it online.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import sys

import click
import numpy as np

from greyhound.analytics.detect import METHODS, Detection, detect_series
from greyhound.analytics.period import iteration_times_from_calls
from greyhound.errors import InputError, first_line, read_input_file

logger = logging.getLogger(__name__)

_TRACE_COLUMNS = ("time", "op", "comm", "bytes")
_SERIES_COLUMN = "iteration_time"
_WHAT = "a call trace needs columns time,op,comm,bytes; a series needs iteration_time"
_TEXT_COLUMNS = ("op", "comm", "bytes")
"""Read as text: op and comm become category codes, bytes is parsed exactly."""
MAX_BYTES = (1 << 64) - 1
"""The largest byte count: the hook records bytes as an unsigned 64-bit integer."""
_BYTES_ALLOWED = f"a whole number from 0 to {MAX_BYTES} (2^64 - 1)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DetectInput:
    """Iteration times read from FILE, and where they came from."""

    iteration_times: np.ndarray
    """(n,) seconds."""
    period: int | None
    """Calls per iteration for a call trace, None for a series."""
    num_calls: int | None


def read_detect_input(path: str) -> DetectInput:
    """Read FILE ('-' for stdin) into iteration times; InputError on anything malformed."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    data = _read_bytes(path)
    if not data.strip():
        raise InputError(f"{path}: empty file; {_WHAT}")
    try:
        # The header as pyarrow reads it (names may carry spaces), so that the text
        # columns get their type whatever spaces surround their names.
        # One thread: a read-ahead thread still running at exit aborted it once (apache/arrow#34314).
        serial = pacsv.ReadOptions(use_threads=False)
        with pacsv.open_csv(io.BytesIO(data), read_options=serial) as reader:
            raw_names = reader.schema.names
        names = [name.strip() for name in raw_names]
        _check_unique(path, names)
        table = pacsv.read_csv(
            io.BytesIO(data), read_options=serial,
            convert_options=pacsv.ConvertOptions(
                column_types={
                    raw: pa.string() for raw, name in zip(raw_names, names) if name in _TEXT_COLUMNS
                },
                strings_can_be_null=True,
            ),
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise InputError(f"{path}: not a readable CSV: {first_line(exc)}") from None
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a readable CSV: the header is not UTF-8 text") from None
    table = table.rename_columns(names)
    columns = set(table.column_names)
    if _SERIES_COLUMN in columns:
        if table.num_rows == 0:
            raise InputError(f"{path}: header but no rows; {_WHAT}")
        x = _numeric(path, table, _SERIES_COLUMN)
        bad = np.flatnonzero(~(x > 0))
        if len(bad):
            raise InputError(
                f"{path}: line {bad[0] + 2}: iteration_time must be > 0 seconds, "
                f"got {float(x[bad[0]])!r}"
            )
        if "time" in columns:
            _check_sorted(path, _numeric(path, table, "time"))
        return DetectInput(iteration_times=x, period=None, num_calls=None)
    missing = [c for c in _TRACE_COLUMNS if c not in columns]
    if missing:
        raise InputError(
            f"{path}: missing column(s) {','.join(missing)}; {_WHAT} "
            f"(found: {','.join(table.column_names) or 'none'})"
        )
    if table.num_rows == 0:
        raise InputError(f"{path}: header but no rows; {_WHAT}")
    t = _numeric(path, table, "time")
    _check_sorted(path, t)
    nbytes = _byte_counts(path, table)
    op = _codes(path, table, "op")
    comm = _codes(path, table, "comm")
    calls = iteration_times_from_calls(op, comm, nbytes, t)
    if calls.period is None:
        raise InputError(
            f"{path}: no periodic call pattern in {len(t)} calls (no lag with ACF >= 0.95); "
            "a trace of one rank over several iterations is needed"
        )
    if len(calls.iteration_times) == 0:
        raise InputError(
            f"{path}: period {calls.period} calls, but fewer than two whole periods "
            f"after the warm-up in {len(t)} calls"
        )
    if not np.all(calls.iteration_times > 0):
        raise InputError(f"{path}: calls one period apart share a start time; need increasing times")
    if not np.all(np.isfinite(calls.iteration_times)):
        raise InputError(
            f"{path}: calls one period apart are further apart than a float holds; "
            f"times must span less than {np.finfo(np.float64).max:.3g} s"
        )
    return DetectInput(
        iteration_times=calls.iteration_times, period=calls.period, num_calls=len(t)
    )


def _read_bytes(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    return read_input_file(path, expected="a CSV file")


def _check_unique(path: str, names: list[str]) -> None:
    """InputError for a column name that appears twice (spaces around names ignored)."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise InputError(
                f"{path}: column {name!r} appears {names.count(name)} times in the header; "
                f"each column at most once ({_WHAT})"
            )
        seen.add(name)


def _byte_counts(path: str, table) -> np.ndarray:
    """The ``bytes`` column as exact uint64 values, or InputError naming the first bad line.

    Read as text, so a count is never rounded through a float or wrapped: a whole
    number from 0 to 2^64 - 1 (decimal, also as ``8.0`` or ``1e3``, or hex ``0x..``).
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    col = table.column("bytes")
    if pa.types.is_string(col.type) and not col.null_count:
        try:
            return pc.cast(col, pa.uint64()).to_numpy(zero_copy_only=False)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass  # some cell is not a plain integer: parse cell by cell below
    out = np.empty(table.num_rows, dtype=np.uint64)
    for row, cell in enumerate(col.to_pylist()):
        value = _whole_bytes(cell)
        if value is None:
            shown = "empty" if cell is None or str(cell).strip() == "" else repr(cell)
            raise InputError(f"{path}: line {row + 2}: bytes must be {_BYTES_ALLOWED}, got {shown}")
        out[row] = value
    return out


def _whole_bytes(cell) -> int | None:
    """An exact byte count from a CSV cell, or None when it is not one."""
    from decimal import Decimal, InvalidOperation

    if cell is None or isinstance(cell, bool):
        return None
    text = str(cell).strip()
    try:
        if text[:2].lower() == "0x":
            value = int(text, 16)
        else:
            number = Decimal(text)
            # adjusted(): the power of ten of the leading digit; 2^64 - 1 has 20 digits,
            # so larger numbers are refused before an exact int of them is built.
            if not number.is_finite() or number.adjusted() > 20:
                return None
            if number != number.to_integral_value():
                return None
            value = int(number)
    except (ValueError, InvalidOperation, OverflowError):
        return None
    return value if 0 <= value <= MAX_BYTES else None


def _numeric(path: str, table, column: str) -> np.ndarray:
    """A column as finite float64, or InputError naming the first bad line."""
    import pyarrow as pa

    col = table.column(column)
    if pa.types.is_integer(col.type) or pa.types.is_floating(col.type):
        values = col.to_numpy(zero_copy_only=False).astype(np.float64)
        bad = np.flatnonzero(~np.isfinite(values))
        if len(bad):
            cell = "empty" if col[int(bad[0])].as_py() is None else repr(float(values[bad[0]]))
            raise InputError(
                f"{path}: line {bad[0] + 2}: column {column} must be a finite number, got {cell}"
            )
        return values
    for row, cell in enumerate(col.to_pylist()):
        try:
            if cell is None or isinstance(cell, bool) or not math.isfinite(float(cell)):
                raise ValueError
        except (TypeError, ValueError):
            shown = "empty" if cell is None else repr(cell)
            raise InputError(
                f"{path}: line {row + 2}: column {column} must be a finite number, got {shown}"
            ) from None
    # Every cell parsed as a number, but pyarrow kept strings (e.g. mixed forms).
    return np.array([float(cell) for cell in col.to_pylist()])


def _codes(path: str, table, column: str) -> np.ndarray:
    """A text column as integer category codes (fast for millions of rows)."""
    import pyarrow.compute as pc

    col = table.column(column)
    if col.null_count:
        row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise InputError(f"{path}: line {row + 2}: column {column} is empty")
    encoded = pc.dictionary_encode(pc.utf8_trim_whitespace(col)).combine_chunks()
    return encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)


def _check_sorted(path: str, t: np.ndarray) -> None:
    bad = np.flatnonzero(np.diff(t) < 0)
    if len(bad):
        row = int(bad[0]) + 1
        raise InputError(
            f"{path}: line {row + 2}: times must not decrease, got {float(t[row])!r} after "
            f"{float(t[row - 1])!r}"
        )


def detection_json(source: DetectInput, detection: Detection) -> dict:
    """The fixed JSON object of ``greyhound detect --json`` (DESIGN.md, Interfaces)."""
    return {
        "period": source.period,
        "iterations": detection.iterations,
        "baseline_iteration_time": detection.baseline_iteration_time,
        "fail_slow": detection.fail_slow,
        "changepoints": [cp.as_dict() for cp in detection.changepoints],
        "slow_intervals": [si.as_dict() for si in detection.slow_intervals],
        "method": detection.method,
    }


def _summary(path: str, source: DetectInput, detection: Detection) -> str:
    if source.period is None:
        lines = [f"{path}: iteration-time series, {detection.iterations} iterations"]
    else:
        lines = [
            f"{path}: call trace, {source.num_calls} calls, period {source.period} "
            f"calls/iteration, {detection.iterations} iterations"
        ]
    lines.append(f"baseline iteration time {detection.baseline_iteration_time:.4g} s")
    verdict = "fail-slow detected" if detection.fail_slow else "no fail-slow"
    lines.append(
        f"{detection.method}: {verdict}, {len(detection.changepoints)} change point(s)"
    )
    for cp in detection.changepoints:
        lines.append(
            f"  change at iteration {cp.index} (reported at {cp.detected_at}): "
            f"{cp.before:.4g} s -> {cp.after:.4g} s ({cp.ratio:.2f}x)"
        )
    for si in detection.slow_intervals:
        end = "still slow" if si.end_index is None else f"recovered at {si.end_index}"
        lines.append(
            f"  slow from iteration {si.start_index}, {end}: {si.slowdown:.2f}x slower"
        )
    return "\n".join(lines)


@click.command("detect")
@click.option(
    "--method", type=click.Choice(METHODS), default="bocd+v", show_default=True,
    help="BOCD with 10% verification (GREYHOUND), or one of the paper's baselines.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.argument("file", metavar="FILE")
def detect(method: str, as_json: bool, file: str) -> None:
    """Find fail-slows in one rank's call trace or iteration times (CSV; '-' = stdin).

    A call trace has columns time,op,comm,bytes (time = call start, seconds); a series
    has iteration_time (seconds) and optionally time.
    """
    source = read_detect_input(file)
    detection = detect_series(source.iteration_times, method=method)
    if as_json:
        click.echo(json.dumps(detection_json(source, detection)))
    else:
        click.echo(_summary(file, source, detection))
