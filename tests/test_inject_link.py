"""Link injection for real: a TCP stream through a veth pair between two namespaces.

Both ends live in network namespaces made here (10.250.0.0/30 exists only inside them,
so no traffic can leave the machine); the fixtures delete the namespaces, and with
them the veth pair, also when a test fails. Needs root, ip and tc (skips otherwise).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from greyhound.errors import InputError
from greyhound.inject import link, runner, truth
from greyhound.inject.schedule import Planned
from greyhound.inject.spec import LinkSpec
from greyhound.inject.state import InjectEnv

GREYHOUND = Path(sys.executable).with_name("greyhound")
ADDR_A, ADDR_B = "10.250.0.1", "10.250.0.2"
PORT = 5201

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="needs root, ip and tc (iproute2)",
)

# Receiver: for each connection, count bytes from the first to the last, then answer
# with the count and the seconds between them (a receiver-side rate is not inflated by
# the sender's socket buffer).
RECEIVER = f"""
import json, socket, time
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("{ADDR_B}", {PORT}))
srv.listen(4)
srv.settimeout(60)
print("ready", flush=True)
while True:
    conn, _ = srv.accept()
    conn.settimeout(10)
    total, first, last = 0, None, None
    while True:
        data = conn.recv(1 << 20)
        if not data:
            break
        last = time.monotonic()
        first = first or last
        total += len(data)
    conn.sendall(json.dumps({{"bytes": total, "seconds": (last or 0) - (first or 0)}}).encode())
    conn.close()
"""

# Sender: at most SECONDS and MAX_BYTES, then asks the receiver what it measured.
SENDER = f"""
import json, socket, sys, time
seconds, max_bytes = float(sys.argv[1]), int(sys.argv[2])
sock = socket.create_connection(("{ADDR_B}", {PORT}), timeout=10)
buf = b"x" * (1 << 16)
sent, end = 0, time.monotonic() + seconds
while sent < max_bytes and time.monotonic() < end:
    sent += sock.send(buf)
sock.shutdown(socket.SHUT_WR)
sock.settimeout(30)
print(sock.recv(4096).decode(), flush=True)
"""


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=20)


@pytest.fixture(scope="module")
def pair():
    """Namespaces A and B joined by veth vA (in A) - vB (in B); a receiver runs in B."""
    tag = os.getpid() % 100000
    ns_a, ns_b = f"ghtest-a{tag}", f"ghtest-b{tag}"
    receiver = None
    try:
        sh("ip", "netns", "add", ns_a)
        sh("ip", "netns", "add", ns_b)
        sh("ip", "-n", ns_a, "link", "add", "vA", "type", "veth", "peer", "name", "vB", "netns", ns_b)
        sh("ip", "-n", ns_a, "addr", "add", f"{ADDR_A}/30", "dev", "vA")
        sh("ip", "-n", ns_b, "addr", "add", f"{ADDR_B}/30", "dev", "vB")
        for ns, dev in ((ns_a, "vA"), (ns_b, "vB")):
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        receiver = subprocess.Popen(["ip", "netns", "exec", ns_b, sys.executable, "-c", RECEIVER],
                                    stdout=subprocess.PIPE, text=True)
        assert receiver.stdout.readline().strip() == "ready"
        yield {"a": ns_a, "b": ns_b}
    finally:
        if receiver is not None:
            receiver.kill()
            receiver.wait()
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def transfer_rate(pair, seconds: float = 1.0, max_bytes: int = 400 << 20) -> float:
    """Bytes per second of one bounded TCP stream from A to B."""
    done = subprocess.run(["ip", "netns", "exec", pair["a"], sys.executable, "-c", SENDER,
                           str(seconds), str(max_bytes)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["bytes"] > 0 and result["seconds"] > 0, result
    return result["bytes"] / result["seconds"]


@pytest.fixture
def env(tmp_path):
    return InjectEnv(state_dir=tmp_path / "state", cgroup_parent=f"ghtest-inject-{os.getpid()}")


def test_tbf_narrows_the_stream_and_undo_restores_it(pair, env, tmp_path):
    truth_path = tmp_path / "truth.jsonl"
    rate_bits = 50e6
    before = transfer_rate(pair)
    spec = LinkSpec(dev="vA", netns=pair["a"], rate="50mbit")
    stop = threading.Event()
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("outcomes", runner.run_plans(
        [Planned(spec=spec, duration_s=30.0)], env=env, truth_path=truth_path, stop=stop)))
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while link.root_qdisc(pair["a"], "vA") != "tbf":
            assert time.monotonic() < deadline, "the tbf qdisc never appeared"
            time.sleep(0.05)
        during = transfer_rate(pair)
    finally:
        stop.set()
        thread.join(15)
    assert link.root_qdisc(pair["a"], "vA") == "noqueue"
    after = transfer_rate(pair)
    print(f"TCP A->B before {before / 1e6:.1f} MB/s, throttled to 50mbit {during / 1e6:.2f} MB/s, "
          f"after {after / 1e6:.1f} MB/s")
    # tbf passes the rate plus one bucket (64 KiB) per measured second at most.
    assert during <= rate_bits / 8 * 1.1 + 65536
    assert before >= 5 * during and after >= 5 * during, (before, during, after)
    (outcome,) = result["outcomes"]
    assert outcome.error is None
    (record,) = truth.read(truth_path)
    assert record["kind"] == "link" and record["severity"] == "50mbit" and record["rate_bps"] == 50e6
    assert record["links"] == [{"netns": pair["a"], "dev": "vA"}]
    assert record["ended_by"] == "signal"
    assert not list(env.active_dir.glob("*.json"))


@pytest.fixture
def fake_node(pair):
    """gh-vethN (host side, no address, no bridge) with its peer eth0 in netns gh-nN:
    the shape `scripts/cluster up --netns` gives node nN, for a node number no
    cluster uses. Nothing is addressed, so no traffic flows through it."""
    num = 900 + os.getpid() % 99
    ns, host_dev = f"gh-n{num}", f"gh-veth{num}"
    try:
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", host_dev, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", host_dev, "up")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        yield f"n{num}", ns, host_dev
    finally:
        subprocess.run(["ip", "link", "del", host_dev], capture_output=True, timeout=20)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def test_node_link_is_throttled_both_ways_and_a_second_throttle_is_refused(fake_node, env, tmp_path):
    node, ns, host_dev = fake_node
    injection = runner.make_injection(LinkSpec(node=node, rate="200mbit"), env=env, injection_id="t")
    injection.preflight()
    try:
        injection.apply()
        assert link.root_qdisc(None, host_dev) == "tbf"
        assert link.root_qdisc(ns, "eth0") == "tbf"
        second = runner.make_injection(LinkSpec(node=node, rate="100mbit"), env=env, injection_id="u")
        with pytest.raises(InputError, match="already throttled"):
            second.preflight()
    finally:
        injection.undo()
    assert link.root_qdisc(None, host_dev) != "tbf"
    assert link.root_qdisc(ns, "eth0") != "tbf"
    assert injection.truth_fields()["links"] == [{"netns": None, "dev": host_dev}, {"netns": ns, "dev": "eth0"}]


def test_schedule_runs_injections_at_their_offsets(pair, env, tmp_path):
    """`greyhound inject run`: a link and a compute injection, concurrently, with the
    start and end times of the truth log where the schedule put them."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    truth_path = tmp_path / "truth.jsonl"
    schedule_file = tmp_path / "schedule.yaml"
    schedule_file.write_text(yaml.safe_dump({"injections": [
        {"kind": "link", "dev": "vA", "netns": pair["a"], "rate": "100mbit", "start": 0, "duration": 1.0},
        {"kind": "compute", "pid": sleeper.pid, "severity": 0.25, "start": 0.5, "duration": 1.0},
        {"kind": "link", "dev": "vB", "netns": pair["b"], "rate": "10mbit", "start": 1.0, "duration": 0.5},
    ]}))
    try:
        t0 = time.time()
        done = subprocess.run(
            [str(GREYHOUND), "inject", "--state-dir", str(env.state_dir), "--cgroup-parent",
             env.cgroup_parent, "run", str(schedule_file), "--truth", str(truth_path), "--json"],
            capture_output=True, text=True, timeout=60)
    finally:
        sleeper.kill()
        sleeper.wait()
        for path in sorted(env.cgroup_base.glob("*/"), reverse=True) + [env.cgroup_base]:
            if path.is_dir():
                path.rmdir()  # empty: the injector moved the sleeper back
    assert done.returncode == 0, done.stderr
    records = {(r["kind"], r["severity"]): r for r in truth.read(truth_path)}
    assert len(records) == 3
    by_id = lambda r: r["id"]  # noqa: E731
    assert sorted(map(json.loads, done.stdout.splitlines()), key=by_id) == sorted(records.values(), key=by_id)
    link_a, comp, link_b = records[("link", "100mbit")], records[("compute", 0.25)], records[("link", "10mbit")]
    assert comp["pids"] == [sleeper.pid] and link_b["links"] == [{"netns": pair["b"], "dev": "vB"}]
    # Offsets relative to the first start (the CLI's own start-up time is not the schedule's).
    base = link_a["start"]
    assert base >= t0
    assert comp["start"] - base == pytest.approx(0.5, abs=0.3)
    assert link_b["start"] - base == pytest.approx(1.0, abs=0.3)
    for record, duration in ((link_a, 1.0), (comp, 1.0), (link_b, 0.5)):
        assert record["ended_by"] == "duration"
        assert record["end"] - record["start"] == pytest.approx(duration, abs=0.3)
    assert link.root_qdisc(pair["a"], "vA") == "noqueue" and link.root_qdisc(pair["b"], "vB") == "noqueue"


def test_undo_all_removes_the_tbf_of_a_killed_injector(pair, env, tmp_path):
    truth_path = tmp_path / "truth.jsonl"
    proc = subprocess.Popen(
        [str(GREYHOUND), "inject", "--state-dir", str(env.state_dir), "link", "--dev", "vB",
         "--netns", pair["b"], "--rate", "20mbit", "--duration", "60", "--truth", str(truth_path)],
        stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert "applied" in line, line + proc.stderr.read()
        proc.kill()  # SIGKILL: no chance to undo
        proc.wait()
        assert link.root_qdisc(pair["b"], "vB") == "tbf"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        done = subprocess.run([str(GREYHOUND), "inject", "--state-dir", str(env.state_dir), "undo-all"],
                              capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["undone"]) == 1
    assert link.root_qdisc(pair["b"], "vB") == "noqueue"
    (record,) = truth.read(truth_path)
    assert record["ended_by"] == "undo-all" and record["severity"] == "20mbit"
    assert record["links"] == [{"netns": pair["b"], "dev": "vB"}]


def test_a_missing_node_link_says_how_to_get_one(env):
    injection = runner.make_injection(LinkSpec(node="n987", rate="1mbit"), env=env, injection_id="x")
    with pytest.raises(InputError, match=r"node n987: interface gh-veth987 does not exist.*"
                                         r"scripts/cluster up --netns"):
        injection.preflight()
