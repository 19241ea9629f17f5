"""Inputs that made `greyhound postmortem` or `greyhound detect` print a traceback, hang,
wrap a value or half-write a report, run through the real CLI: each must now be one
stderr line `greyhound: ...`, exit status 1, and nothing else.

Files are in tests/data/fuzz/: the fuzzer's findings (scripts/fuzz-readers) as they were
found, and base-small.h5, a small trace from postmortem.generate to which the bit-flip
cases apply their flips. The rest are built here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from conftest import STUDY_TRACES
from greyhound.cli import main

FUZZ = Path(__file__).resolve().parent / "data" / "fuzz"
SCRIPT = Path(sys.executable).parent / "greyhound"


def cli(*args: str) -> subprocess.CompletedProcess:
    """The installed `greyhound` script (falls back to python -m greyhound.cli)."""
    cmd = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "greyhound.cli"]
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, timeout=300)


def assert_one_line_error(cp, *contains: str) -> str:
    """Exit 1, nothing on stdout, exactly one stderr line `greyhound: ...`, no traceback."""
    stderr = cp.stderr if isinstance(cp, subprocess.CompletedProcess) else cp.stderr
    stdout = cp.stdout if isinstance(cp, subprocess.CompletedProcess) else cp.stdout
    code = cp.returncode if isinstance(cp, subprocess.CompletedProcess) else cp.exit_code
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert code == 1, (code, stderr)
    assert len(lines) == 1 and lines[0].startswith("greyhound: "), stderr
    assert stdout == "", stdout
    for text in contains:
        assert text in lines[0], lines[0]
    return lines[0]


def flipped(tmp_path: Path, flips: list[tuple[int, int]], name: str = "flipped.h5") -> Path:
    data = bytearray((FUZZ / "base-small.h5").read_bytes())
    for offset, mask in flips:
        data[offset] ^= mask
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return path


# -------------------------------------------------------------- postmortem, HDF5

def test_base_trace_is_sound():
    """The base of the bit-flip cases is analysed (so each flip is what breaks it)."""
    cp = cli("postmortem", "--json", FUZZ / "base-small.h5")
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout)["job"]["dp"] == 2


# (offset, xor mask) of bit flips found by flipping random bits of base-small.h5; the
# comment is what the CLI printed before.
BIT_FLIPS = {
    "link-heap": ([(6753, 8), (20216, 4), (24405, 2), (35896, 2)],
                  "RuntimeError: Unable to synchronously check link existence"),
    "dataspace-dim": ([(3976, 16), (6133, 16), (29897, 2), (31070, 2)],
                      "KeyError: dataspace dim 0 size of 562949953421316"),
    "optypes-json": ([(2454, 32), (2894, 8), (22283, 4), (22917, 8)], "JSONDecodeError in the optypes attribute"),
    "optypes-json-2": ([(2505, 8)], "JSONDecodeError in the optypes attribute"),
    "node-not-utf8": ([(2729, 128), (35907, 1)], "UnicodeDecodeError in /workers/node"),
}


@pytest.mark.parametrize("name", sorted(BIT_FLIPS))
def test_bit_flipped_hdf5_is_one_line(tmp_path, name):
    flips, _before = BIT_FLIPS[name]
    assert_one_line_error(cli("postmortem", flipped(tmp_path, flips)), "flipped.h5: ")


def test_hdf5_that_hangs_libhdf5_is_refused_after_the_time_limit(tmp_path, monkeypatch):
    """One flipped bit in the root group's attribute area makes libhdf5 2.0 loop forever
    in H5Aread (before: greyhound hung). The parse runs in a child that is killed."""
    import postmortem.schema as schema

    monkeypatch.setattr(schema, "READ_TIMEOUT_S", 2.0)
    path = flipped(tmp_path, [(2721, 8)])
    result = CliRunner().invoke(main, ["postmortem", str(path)])
    assert isinstance(result.exception, SystemExit), result.exception
    assert_one_line_error(result, "the HDF5 library did not finish reading the file")


@pytest.mark.parametrize(
    "name, message",
    [
        ("libhdf5-hang-1.h5", "did not finish reading the file in 2 s"),  # greyhound hung
        ("libhdf5-crash-1.h5", "the HDF5 library crashed reading the file (SIGSEGV"),  # greyhound segfaulted
    ],
)
def test_hdf5_contained_fuzz_findings_are_one_line(monkeypatch, name, message):
    """Inputs on which the fuzzer saw libhdf5 2.0 hang or crash; the parse runs in a child."""
    import postmortem.schema as schema

    monkeypatch.setattr(schema, "READ_TIMEOUT_S", 2.0)
    result = CliRunner().invoke(main, ["postmortem", str(FUZZ / name)])
    assert isinstance(result.exception, SystemExit), (name, result.exception)
    assert_one_line_error(result, f"{name}: ", message)


def test_hdf5_chunk_stored_short_without_filters_is_refused():
    """Fuzz finding: /ops/step's chunk has a filter mask saying "not compressed" and 1
    stored byte for 240 rows; libhdf5 returned the rest of the buffer uninitialised, a
    different step column on every read (the analysis gave a NaN slowdown, or not)."""
    line = assert_one_line_error(cli("postmortem", "--json", FUZZ / "hdf5-chunk-mask-uninitialised.h5"))
    assert "/ops/step chunk 0 stores 1 bytes uncompressed, its 240 rows take 960" in line


def _generated(tmp_path: Path, **ops_override) -> Path:
    from postmortem.generate import SyntheticJob, generate
    from postmortem.schema import write_trace

    trace, _ = generate(SyntheticJob(dp=2, pp=2, num_microbatches=2, num_steps=3))
    path = tmp_path / "t.h5"
    write_trace(path, ops={**trace.ops, **ops_override}, workers=trace.workers, meta=trace.meta)
    return path


def test_all_nan_durations_are_one_line(tmp_path):
    """Before: IndexError in the model's occurrence numbering (every row dropped)."""
    from postmortem.schema import read_trace

    path = _generated(tmp_path)
    n = read_trace(path).num_ops
    path = _generated(tmp_path, duration=np.full(n, np.nan))
    assert_one_line_error(cli("postmortem", "--json", path), "no usable op row", "finite start and duration")


def _rewrite(path: Path, group: str, name: str, data) -> None:
    with h5py.File(path, "r+") as f:
        del f[group][name]
        f[group].create_dataset(name, data=data)


def test_hdf5_rank_outside_int16_is_refused_not_wrapped(tmp_path):
    """Before: an int64 dp_rank of 65537 was cast to int16 (= 1) without a word."""
    path = _generated(tmp_path)
    with h5py.File(path, "r") as f:
        dp = f["ops/dp_rank"][()].astype(np.int64)
    dp[dp == 1] = 65537
    _rewrite(path, "ops", "dp_rank", dp)
    assert_one_line_error(cli("postmortem", path), "/ops/dp_rank holds 65537", "int16 (-32768..32767)")


def test_hdf5_dataset_claiming_more_rows_than_stored_is_refused(tmp_path):
    """A damaged dataspace can claim 2^40 rows of a chunked dataset that stores none;
    HDF5 would hand out fill values (before: MemoryError, a traceback)."""
    path = _generated(tmp_path)
    with h5py.File(path, "r+") as f:
        del f["ops"]["step"]
        f["ops"].create_dataset("step", shape=(1 << 40,), dtype=np.int32, chunks=(1 << 16,))
    assert_one_line_error(cli("postmortem", path), "/ops/step claims 1099511627776 rows")


@pytest.mark.parametrize(
    "meta, message",
    [
        ("[1, 2]", "job metadata must be a JSON object"),
        ('{"dp": 40000, "pp": 2, "num_microbatches": 40000}', "dp must be at most 32768"),
        ('{"dp": 2, "pp": 2, "num_microbatches": 4, "extra": [1]}', "'extra' must be a JSON object"),
    ],
)
def test_hdf5_bad_job_metadata_is_one_line(tmp_path, meta, message):
    path = _generated(tmp_path)
    with h5py.File(path, "r+") as f:
        f.attrs["meta"] = meta
    assert_one_line_error(cli("postmortem", path), "bad job metadata", message)


def test_hdf5_seqlens_row_without_samples_is_left_out(tmp_path):
    """A last seqlens row without samples (offsets [..., k, k]) made the sequence-length
    cause's np.add.reduceat index past the end (IndexError); a row of a DP rank the job
    does not have indexed the per-replica sums out of range. Both rows are left out."""
    from postmortem.generate import SyntheticJob, generate

    trace, _ = generate(SyntheticJob(dp=2, pp=2, num_microbatches=4, num_steps=4, seqlen_max=64,
                                     samples_per_microbatch=2))
    path = _generated(tmp_path)
    s = trace.seqlens
    offsets = s["offsets"].copy()
    offsets[-1] = offsets[-2]
    dp_rank = s["dp_rank"].astype(np.int64)
    dp_rank[0] = 7
    with h5py.File(path, "r+") as f:
        g = f.create_group("seqlens")
        for name, data in (("step", s["step"]), ("dp_rank", dp_rank.astype(np.int16)), ("microbatch", s["microbatch"]),
                           ("offsets", offsets), ("lengths", s["lengths"][: offsets[-1]])):
            g.create_dataset(name, data=data)
    cp = cli("postmortem", "--json", path)
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout)["job"]["dp"] == 2


# -------------------------------------------------------------- postmortem, parquet

@pytest.mark.parametrize(
    "name, message",
    [
        # before: ValueError in the model's per-stage step-start (np.min of an empty stage);
        # now refused earlier, as a trace without a whole step
        ("stage-without-ops", "no whole step in the trace"),
        # before: UnicodeDecodeError from pyarrow decoding a column name
        ("name-not-utf8", "not UTF-8"),
    ],
)
def test_parquet_fuzz_findings_are_one_line(name, message):
    assert_one_line_error(cli("postmortem", "--json", FUZZ / f"trace-{name}.parquet"), message)


def test_stage_whose_ops_are_in_too_few_steps_is_one_line(tmp_path):
    """What the first parquet finding reached: a stage none of whose ops recurs in most
    steps has no template op, and the model's per-stage reduction had nothing to reduce."""
    from postmortem.generate import SyntheticJob, generate
    from postmortem.schema import write_trace

    trace, _ = generate(SyntheticJob(dp=1, pp=3, num_microbatches=2, num_steps=4))
    ops = trace.ops
    keep = ~((ops["pp_rank"] == 2) & (ops["step"] != ops["step"].min()))
    path = tmp_path / "t.h5"
    write_trace(path, ops={k: v[keep] for k, v in ops.items()}, workers=trace.workers, meta=trace.meta)
    assert_one_line_error(cli("postmortem", path), "pipeline stage(s) 2 have no op that recurs in most steps")


@pytest.mark.parametrize(
    "meta, message",
    [
        ("dp_size: 2\npp_size: 4\ntp_size: abc\n", "meta key 'tp_size' must be an integer >= 1"),  # was ValueError
        ("dp_size: 2\npp_size: 4\nrun_date: 2024-13-01\n", "not valid YAML: month must be in 1..12"),  # was ValueError
        ("dp_size: true\npp_size: 4\n", "meta key 'dp_size' must be an integer from 1 to 32768"),
        ("dp_size: 2\npp_size: 99999999999\n", "meta key 'pp_size' must be an integer from 1 to 32768"),
        (b"dp_size: 2\npp_size: 4\ntrial_name: \xff\xfe\n", "not valid YAML"),  # was UnicodeDecodeError
    ],
)
def test_parquet_bad_meta_is_one_line(tmp_path, meta, message):
    path = tmp_path / "meta.yaml"
    path.write_bytes(meta if isinstance(meta, bytes) else meta.encode())
    assert_one_line_error(cli("postmortem", "--meta", path, STUDY_TRACES / "trace-ST.parquet"), message)


def test_parquet_rank_outside_int16_is_refused_not_wrapped(tmp_path):
    """Before: a dp_rank of 65536 became 0 (astype int16) and its ops landed on replica 0."""
    table = pq.read_table(STUDY_TRACES / "trace-ST.parquet")
    dp = table.column("dp_rank").to_numpy().astype(np.int64)
    dp[dp == 1] = 65537
    table = table.set_column(table.column_names.index("dp_rank"), "dp_rank", pa.array(dp))
    pq.write_table(table, tmp_path / "trace-X.parquet")
    shutil.copy(STUDY_TRACES / "meta-ST.yaml", tmp_path / "meta-X.yaml")
    assert_one_line_error(cli("postmortem", tmp_path / "trace-X.parquet"), "column 'dp_rank' holds 65537")


# -------------------------------------------------------------- postmortem --out

def test_report_into_a_path_under_a_file_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "rep"
    assert_one_line_error(cli("postmortem", "--out", out, FUZZ / "base-small.h5"), "cannot write the report")


def test_report_into_a_symlink_is_one_line(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert_one_line_error(cli("postmortem", "--out", tmp_path / "link", FUZZ / "base-small.h5"), "is a symlink")
    assert list((tmp_path / "real").iterdir()) == []


def test_report_writing_is_all_or_nothing(tmp_path, monkeypatch):
    """A failure while writing (here: no space left for the second plot) leaves the
    report directory as it was: the old report whole, no new file, no temporary."""
    import postmortem.report as report

    out = tmp_path / "rep"
    assert CliRunner().invoke(main, ["postmortem", "--out", str(out), str(FUZZ / "base-small.h5")]).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(before) == set(report.REPORT_FILES)

    def no_space(*_args):  # (result, path, online events)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "_steps_png", no_space)
    result = CliRunner().invoke(main, ["postmortem", "--out", str(out), str(FUZZ / "base-small.h5")])
    assert_one_line_error(result, "cannot write the report: No space left on device")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep"]
    # and a new directory is not created at all
    result = CliRunner().invoke(main, ["postmortem", "--out", str(tmp_path / "new"), str(FUZZ / "base-small.h5")])
    assert_one_line_error(result, "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep"]


# -------------------------------------------------------------- detect, CSV

def _calls_csv(nbytes_of) -> str:
    """A call trace of period 4 that only its byte counts (nbytes_of(j)) make periodic."""
    lines, t = ["time,op,comm,bytes"], 0.0
    for i in range(30):
        for j in range(4):
            t += 0.01 * (1 + j) * (1.5 if i >= 15 else 1.0)
            lines.append(f"{t:.6f},AllReduce,0x1,{nbytes_of(j)}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "name, content, message",
    [
        # KeyError: Field "iteration_time" exists 2 times in schema
        ("dup.csv", "iteration_time,iteration_time\n1,2\n1,2\n", "column 'iteration_time' appears 2 times"),
        ("dup-spaced.csv", "time,op,comm,bytes, bytes\n1,a,1,8,8\n", "column 'bytes' appears 2 times"),
        # silently wrapped through float64 -> int64
        ("bytes-2-64.csv", "time,op,comm,bytes\n1,AllReduce,1,18446744073709551616\n2,AllReduce,1,8\n",
         "line 2: bytes must be a whole number from 0 to 18446744073709551615 (2^64 - 1), got '18446744073709551616'"),
        ("bytes-huge.csv", "time,op,comm,bytes\n1,AllReduce,1,8\n2,AllReduce,1,1e400\n",
         "line 3: bytes must be a whole number"),
        ("bytes-negative.csv", "time,op,comm,bytes\n1,AllReduce,1,-8\n", "line 2: bytes must be a whole number"),
        ("bytes-empty.csv", "time,op,comm,bytes\n1,AllReduce,1,8\n2,AllReduce,1,\n",
         "line 3: bytes must be a whole number from 0 to 18446744073709551615 (2^64 - 1), got empty"),
        ("bool.csv", "iteration_time\ntrue\nfalse\n",
         "line 2: column iteration_time must be a finite number, got True"),
    ],
)
def test_detect_bad_csv_is_one_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    assert_one_line_error(cli("detect", "--json", path), message)


def test_detect_header_not_utf8_is_one_line():
    """Fuzz finding: UnicodeDecodeError from pyarrow's schema names."""
    assert_one_line_error(cli("detect", FUZZ / "detect-header-not-utf8.csv"), "the header is not UTF-8 text")


def test_detect_byte_counts_up_to_2_64_are_exact(tmp_path):
    """Byte counts near 2^64 are distinct calls (before: they went through float64 and
    int64 and collapsed into one value, and the period was lost); the period and
    iterations match the same trace with small byte counts."""
    small = tmp_path / "small.csv"
    small.write_text(_calls_csv(lambda j: 1024 << j))
    big = tmp_path / "big.csv"
    big.write_text(_calls_csv(lambda j: (1 << 64) - 1 - j))  # 4 values one apart near 2^64
    a, b = cli("detect", "--json", small), cli("detect", "--json", big)
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
    assert json.loads(a.stdout) == json.loads(b.stdout)
    assert json.loads(b.stdout)["period"] == 4


def test_detect_spaced_header_with_numeric_op_is_read(tmp_path):
    """Before: ' op ' kept its spaces while pyarrow typed it, so numeric op codes came
    out int64 and the trim kernel raised ArrowNotImplementedError."""
    rows = "".join(f"{(i * 4 + j) * 0.01:.2f},{j},1,{8 << j}\n" for i in range(30) for j in range(4))
    path = tmp_path / "spaced.csv"
    path.write_text("time, op ,comm, bytes\n" + rows)
    cp = cli("detect", "--json", path)
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout)["period"] == 4


# -------------------------------------------------------------- merge-trace (timeline files)

_HEADER = {"format": "greyhound-timeline", "version": 1, "rank": 0, "dp_rank": 0, "pp_rank": 0,
           "node": "n1", "device": "cpu", "job": {"dp": 1, "pp": 1, "microbatches_per_dp": [1]}}


def _step(step: int, mb=0, start=0.0) -> dict:
    return {"step": step, "num_microbatches": 1, "ops": [["forward-compute", mb, 0, start, 1.0]], "seqlens": []}


@pytest.mark.parametrize(
    "job, message",
    [
        # ValueError
        ({"dp": "one", "pp": 1}, "timeline header job 'dp' must be an integer from 1 to 32768, got 'one'"),
        ({"dp": 1, "pp": 1, "microbatches_per_dp": "x"}, "'microbatches_per_dp' must be a list of integers"),
        ([1], "timeline header 'job' must be an object"),  # TypeError
    ],
)
def test_merge_bad_timeline_header_is_one_line(tmp_path, job, message):
    (tmp_path / "rank-00000.jsonl").write_text(json.dumps({**_HEADER, "job": job}) + "\n")
    assert_one_line_error(cli("merge-trace", tmp_path), message)


def test_merge_skips_a_step_line_whose_values_do_not_fit(tmp_path):
    """Before: OverflowError (a micro-batch of 99999999999 into int32) from the whole
    merge; now that line is garbled like a torn one and the other step is merged."""
    lines = [_HEADER, _step(0, mb=99999999999), _step(1, start=2.0)]
    (tmp_path / "rank-00000.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    cp = cli("merge-trace", tmp_path)
    assert cp.returncode == 0, cp.stderr
    with h5py.File(cp.stdout.strip(), "r") as f:
        assert f["ops/step"][()].tolist() == [1]


# -------------------------------------------------------------- the reader's child process

def _segfault():
    import ctypes

    ctypes.string_at(0)  # what a libhdf5 crash looks like to the parent


def _sleep():
    import time

    time.sleep(60)


def _raise_value_error():
    raise ValueError("a bug, not bad input")


def test_isolated_reader_turns_a_crash_and_a_hang_into_input_errors():
    from greyhound.errors import InputError
    from postmortem._isolate import ReaderFailed, run_isolated

    assert run_isolated(lambda: {"a": np.arange(3)}, timeout=30, what="x")["a"].tolist() == [0, 1, 2]
    with pytest.raises(ReaderFailed, match=r"^t\.h5: the HDF5 library crashed reading the file \(SIGSEGV"):
        run_isolated(_segfault, timeout=30, what="t.h5: the HDF5 library")
    with pytest.raises(ReaderFailed, match="did not finish reading the file in 1 s"):
        run_isolated(_sleep, timeout=1, what="t.h5: the HDF5 library")
    with pytest.raises(InputError, match="as it was"):
        run_isolated(lambda: (_ for _ in ()).throw(InputError("as it was")), timeout=30, what="x")
    with pytest.raises(ValueError, match="a bug, not bad input") as info:  # a bug stays a bug
        run_isolated(_raise_value_error, timeout=30, what="x")
    assert "in the reader's child process" in "".join(getattr(info.value, "__notes__", []))


def test_a_stage_without_backward_computes_gives_a_report_and_no_warning():
    """Fuzz finding (HDF5 target): stage 0 of a DP=2 x PP=2 trace holds no
    backward-compute op, so its typical backward time is NaN; the stage-imbalance check
    averaged the earlier stages with np.nanmean, and numpy printed "RuntimeWarning: Mean
    of empty slice" (two lines) on stderr beside the CLI's answer."""
    cp = cli("postmortem", "--json", FUZZ / "hdf5-stage-without-backward-compute.h5")
    assert cp.returncode == 0, cp.stderr
    assert cp.stderr == ""
    result = json.loads(cp.stdout, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert result["slowdown"] > 1.0


def test_a_float128_column_beyond_float64_is_one_line(tmp_path):
    """Fuzz finding (HDF5 target): /ops/start stored as float128 with values near 4.5e309
    became inf in the cast to float64, with numpy's "overflow encountered in cast"
    warning (seen in-process; the CLI's reader child hid it) instead of an error."""
    path = _generated(tmp_path)
    with h5py.File(path, "r+") as f:
        start = f["ops/start"][:].astype(np.longdouble)
        start[3] = np.longdouble(1e308) * 100
        del f["ops/start"]
        f["ops/start"] = start
    line = assert_one_line_error(cli("postmortem", "--json", path))
    assert "/ops/start holds 1.000e+310, outside its type float64" in line


def test_a_trace_whose_idealised_step_takes_no_time_is_one_line_and_no_warning():
    """Fuzz finding (HDF5 target, 2026-12-02): every op of the trace's model lasts 0 s
    once idealised; the attribution divided by that zero and numpy printed ten lines of
    "RuntimeWarning: divide by zero" on stderr before the CLI's one-line refusal."""
    assert_one_line_error(cli("postmortem", FUZZ / "hdf5-idealised-step-zero.h5"),
                          "the idealised step takes 0.0 s, so there is no slowdown to compute")
