"""Schedule files, specs, the truth log and listpids parsing: pure, no root needed."""

from __future__ import annotations

import threading

import pytest
import yaml
from click.testing import CliRunner

from greyhound.cli import main
from greyhound.errors import InputError
from greyhound.inject import targets, truth
from greyhound.inject.schedule import Planned, parse_schedule
from greyhound.inject.spec import ComputeSpec, LinkSpec, parse_rate_bps, parse_size_bytes


def test_rates_sizes_and_default_burst():
    assert parse_rate_bps("200mbit") == 200e6
    assert parse_rate_bps("1.5gbit") == 1.5e9
    assert parse_rate_bps("25mbps") == 200e6  # tc: bps = bytes per second
    assert parse_rate_bps("8kbit") == 8000
    assert parse_size_bytes("64kb") == 65536 and parse_size_bytes("2m") == 2 << 20
    assert parse_size_bytes("1600") == 1600
    for bad in ("200", "200 mbit", "fast", "-5mbit", "1kbit"):
        with pytest.raises(ValueError):
            parse_rate_bps(bad)
    # 5 ms at the rate, at least 64 KiB.
    assert LinkSpec(dev="x", rate="200mbit").burst_bytes == 125_000
    assert LinkSpec(dev="x", rate="10mbit").burst_bytes == 65536
    assert LinkSpec(dev="x", rate="10mbit", burst="32kb").burst_bytes == 32768


def test_node_maps_to_both_ends_of_its_veth():
    spec = LinkSpec(node="n3", rate="100mbit")
    assert spec.links == ((None, "gh-veth3"), ("gh-n3", "eth0"))
    for bad in (dict(node="node3"), dict(node="n3", dev="eth0"), dict(), dict(node="n3", netns="x"),
                dict(dev="a-name-longer-than-15"), dict(dev="x", latency="0ms")):
        with pytest.raises(ValueError):
            LinkSpec(rate="100mbit", **bad)


def test_compute_spec_bounds():
    assert ComputeSpec(pid=5).severity == 0.5
    ComputeSpec(pid=5, severity=0.95)
    ComputeSpec(job="12", rank=0, step="1")
    for bad in (dict(pid=5, severity=0.951), dict(pid=5, severity=0.0), dict(pid=5, severity=-0.1),
                dict(pid=0), dict(pid=5, rank=1), dict(pid=5, step="0"), dict(job="12"),
                dict(job="12", rank=-1), dict(job="12.0", rank=1), dict(pid=5, cpus=0)):
        with pytest.raises(ValueError):
            ComputeSpec(**bad)


GOOD = """
injections:
  - {kind: compute, job: 42, rank: 3, severity: 0.6, start: 10, duration: 20}
  - {kind: compute, pid: 77, duration: 5}
  - {kind: link, node: n2, rate: 200mbit, start: 5, duration: 30}
  - {kind: link, dev: vA, netns: ns1, rate: 1gbit, burst: 128kb, latency: 20ms, duration: 1.5}
  - {kind: compute, job: 42, rank: 3, start: 30, duration: 1}
"""


def test_a_good_schedule():
    plans = parse_schedule(GOOD)
    assert plans[0] == Planned(spec=ComputeSpec(job="42", rank=3, severity=0.6), start_s=10, duration_s=20)
    assert plans[1] == Planned(spec=ComputeSpec(pid=77), start_s=0.0, duration_s=5)
    assert plans[2].spec == LinkSpec(node="n2", rate="200mbit") and plans[2].end_s == 35
    assert plans[3].spec.burst_bytes == 131072 and plans[3].spec.links == (("ns1", "vA"),)
    # The same target back to back (ends at 30, starts at 30) is no overlap.
    assert plans[4].start_s == plans[0].end_s
    # The list form needs no `injections` key.
    assert parse_schedule(yaml.safe_dump(yaml.safe_load(GOOD)["injections"])) == plans


@pytest.mark.parametrize("text, message", [
    ("injections: [", "s.yaml:1: "),
    ("", "expected a non-empty list"),
    ("injections: []", "expected a non-empty list"),
    ("{injections: [], extra: 1}", "unknown top-level keys ['extra']"),
    ("- 5", "entry 1: an entry must be a mapping"),
    ("- {kind: disk, duration: 1}", "entry 1: kind 'disk' is unknown; allowed: compute, link"),
    ("- {kind: compute, pid: 5}", "entry 1: duration is missing"),
    ("- {kind: compute, pid: 5, duration: 1, severty: 0.4}", "entry 1: unknown keys ['severty']"),
    ("- {kind: compute, pid: 5, duration: 1}\n- {kind: compute, pid: 5, duration: 1, severity: 1.2}",
     "entry 2: severity 1.2 is out of range; allowed (0, 0.95]"),
    ("- {kind: compute, pid: '5', duration: 1}", "entry 1: pid '5' is not an integer"),
    ("- {kind: compute, pid: 5, duration: 1, severity: high}", "entry 1: severity 'high' is not a number"),
    ("- {kind: compute, pid: 5, duration: -1}", "entry 1: duration -1 is out of range"),
    ("- {kind: compute, pid: 5, duration: 0}", "entry 1: duration 0 is out of range"),
    ("- {kind: compute, pid: 5, duration: 1, start: -2}", "entry 1: start -2 is out of range"),
    ("- {kind: compute, pid: 5, duration: .inf}", "entry 1: duration inf is not a number"),
    ("- {kind: link, node: n1, duration: 1}", "entry 1: missing 1 required keyword-only argument: 'rate'"),
    ("- {kind: link, node: n1, rate: 9, duration: 1}", "entry 1: rate '9' is not a tc rate"),
    ("- {kind: compute, pid: 5, start: 0, duration: 10}\n- {kind: compute, pid: 5, start: 9, duration: 1}",
     "entry 1 and entry 2 act on the same target (pid5) at overlapping times [0, 10) and [9, 10) s"),
    ("- {kind: link, node: n2, rate: 1mbit, duration: 10}\n"
     "- {kind: link, dev: gh-veth2, rate: 5mbit, start: 5, duration: 10}",
     "entry 1 and entry 2 act on the same target (n2)"),
])
def test_schedule_errors_name_the_entry(text, message):
    with pytest.raises(InputError) as err:
        parse_schedule(text, source="s.yaml")
    assert str(err.value).startswith("s.yaml")
    assert "\n" not in str(err.value)
    assert message in str(err.value)


def test_run_reports_a_bad_schedule_in_one_line(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("- {kind: compute, pid: 5, duration: 1, nice: 3}\n")
    result = CliRunner().invoke(main, ["inject", "--state-dir", str(tmp_path), "run", str(path)])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"greyhound: inject: {path}: entry 1: unknown keys ['nice']")
    assert result.stderr.count("\n") == 1
    result = CliRunner().invoke(main, ["inject", "--state-dir", str(tmp_path), "run", str(tmp_path / "none.yaml")])
    assert result.exit_code == 1 and "cannot read the schedule" in result.stderr


def test_truth_appends_never_interleave(tmp_path):
    path = tmp_path / "sub" / "truth.jsonl"

    def writer(num: int) -> None:
        for i in range(50):
            truth.append(path, truth.new_record(id=f"{num}-{i}", kind="compute", pids=list(range(200))))

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = truth.read(path)
    assert sorted(r["id"] for r in records) == sorted(f"{n}-{i}" for n in range(8) for i in range(50))
    assert all(set(r) == set(truth.FIELDS) for r in records)
    with pytest.raises(ValueError):
        truth.new_record(colour="red")


LISTPIDS = """PID      JOBID    STEPID   LOCALID GLOBALID
4101     57       batch    0       0
4200     57       0        0       2
4201     57       0        1       3
4300     57       1        0       2
4301     57       extern   -       -
"""


def test_listpids_rows_pick_the_rank_of_numbered_steps():
    rows = targets.parse_listpids(LISTPIDS)
    assert [r.pid for r in rows] == [4101, 4200, 4201, 4300, 4301]
    assert rows[4].local_id is None and rows[4].global_id is None
    assert targets.rank_pids_from_listpids(rows, job="57", rank=2, step=None) == {"0": [4200], "1": [4300]}
    assert targets.rank_pids_from_listpids(rows, job="57", rank=2, step="1") == {"1": [4300]}
    assert targets.rank_pids_from_listpids(rows, job="57", rank=0, step=None) == {}  # batch is no rank
    assert targets.rank_pids_from_listpids(rows, job="58", rank=2, step=None) == {}
