"""Trace schema round trip, importer and bad-input errors."""

import json
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import STUDY_TRACES
from greyhound.errors import InputError
from postmortem.analysis import analyze
from postmortem.generate import SyntheticJob, generate
from postmortem.model import build_model
from postmortem.schema import OPTYPES, SCHEMA_VERSION, TraceMeta, optype_code, read_trace, write_trace
from postmortem.whatif_import import load_any


def _write(tmp_path, trace, name="t.h5", **ops_override):
    ops = {**trace.ops, **ops_override}
    p = tmp_path / name
    write_trace(p, ops=ops, workers=trace.workers, meta=trace.meta, seqlens=trace.seqlens)
    return p


def test_round_trip(tmp_path):
    trace, _ = generate(SyntheticJob(seqlen_max=512))
    p = _write(tmp_path, trace)
    back = read_trace(p)
    assert back.meta == trace.meta
    for k, v in trace.ops.items():
        np.testing.assert_array_equal(back.ops[k], v)
    np.testing.assert_array_equal(back.seqlens["lengths"], trace.seqlens["lengths"])
    assert back.node_of()[(0, 0)] == "n1"
    with h5py.File(p) as f:
        assert f.attrs["schema_version"] == SCHEMA_VERSION
        assert f["ops/start"].compression == "gzip"
    assert not list(tmp_path.glob(".*tmp*"))  # atomic: no temporary left behind


def test_optype_strings_and_codes():
    assert optype_code("grads-all-reduce") == OPTYPES.index("grads-all-reduce")
    with pytest.raises(InputError, match="unknown op type 'nope'"):
        optype_code("nope")


def test_meta_validation():
    with pytest.raises(ValueError, match="multiple of dp"):
        TraceMeta(dp=3, pp=1, num_microbatches=4)
    m = TraceMeta(dp=2, pp=1, num_microbatches=5, microbatches_per_dp=(2, 3))
    assert m.microbatches_of(1) == 3


def test_missing_column_and_wrong_dtype(tmp_path):
    trace, _ = generate(SyntheticJob())
    ops = dict(trace.ops)
    del ops["duration"]
    with pytest.raises(InputError, match="missing op column"):
        write_trace(tmp_path / "x.h5", ops=ops, workers=trace.workers, meta=trace.meta)
    p = _write(tmp_path, trace)
    with h5py.File(p, "a") as f:
        del f["ops/step"]
        f["ops/step"] = np.zeros(trace.num_ops, dtype=np.float32)
    with pytest.raises(InputError, match=r"/ops/step has dtype float32"):
        read_trace(p)


def test_truncated_file(tmp_path):
    trace, _ = generate(SyntheticJob())
    p = _write(tmp_path, trace)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="truncated or corrupt"):
        read_trace(p)


def test_damaged_step_is_dropped_and_reported(tmp_path):
    trace, truth = generate(SyntheticJob(num_steps=5, slow_workers=((1, 1, 1.5),)))
    dur = trace.ops["duration"].copy()
    step = trace.ops["step"]
    dur[np.flatnonzero(step == 2)[3]] = np.nan
    keep = ~((step == 4) & (trace.ops["optype"] == optype_code("backward-compute")) & (trace.ops["dp_rank"] == 0))
    ops = {k: v[keep] for k, v in {**trace.ops, "duration": dur}.items()}
    p = tmp_path / "d.h5"
    write_trace(p, ops=ops, workers=trace.workers, meta=trace.meta)
    r = analyze(read_trace(p))
    assert list(r.model.steps) == [0, 1, 3]
    assert any("NaN" in d for d in r.model.dropped) and any("missing or extra" in d for d in r.model.dropped)
    assert r.to_json()["dropped"] == list(r.model.dropped)
    assert abs(r.attribution.slowdown / truth.measured_slowdown - 1) < 0.03


def test_unmatched_p2p(tmp_path):
    trace, _ = generate(SyntheticJob(pp=2))
    keep = trace.ops["optype"] != optype_code("forward-recv")
    ops = {k: v[keep] for k, v in trace.ops.items()}
    with pytest.raises(InputError, match="unmatched p2p: forward-send"):
        build_model(type(trace)(meta=trace.meta, ops=ops, workers=trace.workers, path="x"))


def test_parquet_import():
    t = load_any(STUDY_TRACES / "trace-ST.parquet")
    assert (t.meta.dp, t.meta.pp, t.meta.num_microbatches) == (2, 4, 8)
    assert t.num_ops == 6784
    fs = t.ops["optype"] == optype_code("forward-send")
    assert t.ops["microbatch"][fs].max() == 3  # seq_id became the micro-batch


def test_parquet_missing_meta(tmp_path):
    target = tmp_path / "trace-Q.parquet"
    target.write_bytes((STUDY_TRACES / "trace-ST.parquet").read_bytes())
    with pytest.raises(InputError, match="no such meta file"):
        load_any(target)
    (tmp_path / "meta-Q.yaml").write_text("dp_size: two\npp_size: 4\n")
    with pytest.raises(InputError, match="dp_size"):
        load_any(target)


def test_cli_json_and_report(tmp_path):
    trace, _ = generate(SyntheticJob(slow_workers=((1, 2, 1.5),)))
    p = _write(tmp_path, trace)
    out = tmp_path / "rep"
    cp = subprocess.run(
        [sys.executable, "-m", "greyhound.cli", "postmortem", "--json", "--out", str(out), str(p)],
        capture_output=True, text=True, timeout=120,
    )
    assert cp.returncode == 0, cp.stderr
    data = json.loads(cp.stdout)
    for key in ("slowdown", "simulation_error", "by_optype", "by_dp_rank", "by_pp_rank", "mw", "ms", "causes",
                "timing"):
        assert key in data
    assert set(data["by_dp_rank"]) == {"0", "1", "2", "3"}
    assert "forward-pp-comm" in data["by_optype"] and "forward-send" not in data["by_optype"]
    assert set(data["timing"]) == {"load_seconds", "analysis_seconds"}
    for f in ("report.html", "heatmap.png", "step_slowdown.png", "postmortem.json", "timeline.trace.json"):
        assert (out / f).stat().st_size > 0
    tl = json.loads((out / "timeline.trace.json").read_text())
    pids = {e["pid"] for e in tl["traceEvents"] if e["ph"] == "X"}
    assert pids == {1, 2}
    assert "S_t" in (out / "report.html").read_text()


def test_cli_bad_input_is_one_line(tmp_path):
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 100)
    cp = subprocess.run([sys.executable, "-m", "greyhound.cli", "postmortem", str(bad)], capture_output=True, text=True,
                        timeout=120)
    assert cp.returncode == 1
    assert cp.stderr.count("\n") == 1 and cp.stderr.startswith("greyhound: ") and "Traceback" not in cp.stderr
