"""`greyhound detect`: through click's CliRunner and through the installed script."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from greyhound import ring
from greyhound.analytics.synthetic import FailSlow, call_trace
from greyhound.cli import main

SCRIPT = Path(sys.executable).parent / "greyhound"


def _run(*args):
    return CliRunner().invoke(main, ["detect", *args])


def _write_series(path, x, with_time=False):
    lines = ["time,iteration_time" if with_time else "iteration_time"]
    t = np.cumsum(x)
    for i, v in enumerate(x):
        lines.append(f"{float(t[i])!r},{float(v)!r}" if with_time else repr(float(v)))
    path.write_text("\n".join(lines) + "\n")
    return path


def _write_trace(path, trace):
    lines = ["time,op,comm,bytes"]
    for t, op, comm, nbytes in zip(trace.time, trace.op, trace.comm, trace.nbytes):
        lines.append(f"{float(t)!r},{ring.OP_NAMES[op]},{int(comm):#x},{int(nbytes)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_series_json_has_the_fixed_fields(tmp_path):
    x = [1.0] * 40 + [1.5] * 40 + [1.0] * 40
    result = _run("--json", str(_write_series(tmp_path / "s.csv", x, with_time=True)))
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["period"] is None and out["iterations"] == 120
    assert out["baseline_iteration_time"] == 1.0 and out["fail_slow"] is True
    assert out["changepoints"] == [
        {"index": 40, "detected_at": 43, "before": 1.0, "after": 1.5, "ratio": 1.5},
        {"index": 80, "detected_at": 83, "before": 1.5, "after": 1.0, "ratio": 1.0 / 1.5},
    ]
    assert out["slow_intervals"] == [{"start_index": 40, "end_index": 80, "slowdown": 1.5}]


def test_call_trace_json_reports_period_and_fail_slow(tmp_path):
    fs = FailSlow(onset=80, end=140, factor=1.6, ramp=0)
    trace, truth = call_trace(np.random.default_rng(2), num_iterations=200, fail_slows=(fs,))
    result = _run("--json", str(_write_trace(tmp_path / "t.csv", trace)))
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["period"] == truth.calls_per_iteration
    assert out["iterations"] == 199
    assert out["fail_slow"] is True
    (interval,) = out["slow_intervals"]
    assert abs(interval["start_index"] - 80) <= 1 and abs(interval["end_index"] - 140) <= 1
    assert interval["slowdown"] == pytest.approx(1.6, rel=0.03)
    assert out["baseline_iteration_time"] == pytest.approx(np.median(truth.iteration_times[:80]), rel=0.02)


@pytest.mark.parametrize("method", ["bocd", "window"])
def test_methods_are_selectable(tmp_path, method):
    x = [2.0] * 60 + [3.0] * 60
    result = _run("--method", method, "--json", str(_write_series(tmp_path / "s.csv", x)))
    out = json.loads(result.output)
    assert out["method"] == method and out["fail_slow"] is True


def test_summary_is_short_and_readable(tmp_path):
    x = [1.0] * 40 + [1.5] * 40
    result = _run(str(_write_series(tmp_path / "s.csv", x)))
    assert result.exit_code == 0
    assert "fail-slow detected" in result.output
    assert "slow from iteration 40, still slow: 1.50x slower" in result.output
    assert len(result.output.splitlines()) <= 6


def test_stdin_is_read_for_dash():
    result = CliRunner().invoke(main, ["detect", "--json", "-"], input="iteration_time\n1\n1\n1\n")
    assert result.exit_code == 0 and json.loads(result.output)["iterations"] == 3


BAD_INPUTS = [
    ("missing.csv", None, "no such file"),
    ("empty.csv", "", "empty file"),
    ("header.csv", "iteration_time\n", "header but no rows"),
    ("cols.csv", "time,op\n1,AllReduce\n", "missing column(s) comm,bytes"),
    ("text.csv", "iteration_time\n1.0\nslow\n", "line 3: column iteration_time must be a finite number, got 'slow'"),
    ("zero.csv", "iteration_time\n1.0\n0\n", "line 3: iteration_time must be > 0"),
    ("blank.csv", "time,op,comm,bytes\n1,AllReduce,,8\n", "line 2: column comm is empty"),
    ("unsorted.csv", "time,op,comm,bytes\n2,AllReduce,1,8\n1,AllReduce,1,8\n", "line 3: times must not decrease"),
    ("frac.csv", "time,op,comm,bytes\n1,AllReduce,1,8.5\n", "bytes must be a whole number"),
    ("ragged.csv", "iteration_time,x\n1,2\n3\n", "not a readable CSV"),
    ("random.csv", "time,op,comm,bytes\n" + "".join(
        f"{i},{['AllReduce', 'Send', 'Recv'][i * 7 % 3 if i % 5 else i % 2]},{i % 4},{(i * 37) % 11}\n"
        for i in range(60)), "no periodic call pattern"),
]


@pytest.mark.parametrize("name,content,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_one_line_through_clirunner(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    result = _run(str(path))
    assert result.exit_code == 1
    assert message in result.output
    assert "Traceback" not in result.output


@pytest.mark.skipif(not SCRIPT.exists(), reason=f"console script not installed at {SCRIPT}")
@pytest.mark.parametrize("name,content,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_one_line_through_the_script(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    proc = subprocess.run(
        [str(SCRIPT), "detect", "--json", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("greyhound: ") and message in lines[0]


@pytest.mark.skipif(not SCRIPT.exists(), reason=f"console script not installed at {SCRIPT}")
def test_script_prints_json_for_a_good_file(tmp_path):
    path = _write_series(tmp_path / "s.csv", [1.0] * 30 + [2.0] * 30)
    proc = subprocess.run(
        [str(SCRIPT), "detect", "--json", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["slow_intervals"] == [
        {"start_index": 30, "end_index": None, "slowdown": 2.0}
    ]
