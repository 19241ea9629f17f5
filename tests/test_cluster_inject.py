"""Real fail-slows on the reference job: a CPU quota on one rank, a throttled node link.

Both run on the local cluster with each node in its own network namespace
(`scripts/cluster up --netns`), so a node's traffic really crosses its own veth.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, SlurmJob

pytestmark = pytest.mark.cluster

GREYHOUND = str(REPO / ".venv/bin/greyhound")


def start_training(out: Path, *extra: str) -> str:
    out.mkdir(mode=0o755)
    env = dict(os.environ, GREYHOUND_REPO=str(REPO), OUT_DIR=str(out))
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--output={out}/job.out", str(REPO / "examples/gpt_hybrid.sbatch"),
         "--steps", "150", "--trace-every", "1000", *extra],
        capture_output=True, text=True, env=env, cwd=out, check=True, timeout=60,
    )
    return proc.stdout.strip().split(";")[0]


def steps_done(out: Path) -> int:
    try:
        return len((out / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def wait_steps(out: Path, n: int, timeout_s: float = 240) -> int:
    deadline = time.monotonic() + timeout_s
    while steps_done(out) < n:
        assert time.monotonic() < deadline, f"fewer than {n} steps in {timeout_s}s: {(out / 'job.out').read_text()}"
        time.sleep(0.5)
    return steps_done(out)


def inject_and_measure(out: Path, job_id: str, inject_args: list[str], truth: Path) -> dict[str, float]:
    """Median step time before, during and after an injection of 10 s.

    The job runs 150 steps: at 0.12 s a step (a CI machine) 60 steps ended 1 s before
    the injection did, with no step after it.

    Steps are placed by their wall-clock end (metrics' ``time``) against the truth
    record's start and end: the injector's own start-up and its CPU measurement take a
    second or two, so counting steps around the injector's run would mix unslowed steps
    into "during".
    """
    wait_steps(out, 10)
    proc = subprocess.run([GREYHOUND, "inject", *inject_args, "--duration", "10", "--truth", str(truth)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert SlurmJob(job_id, out / "job.out").wait(300) == "COMPLETED", (out / "job.out").read_text()
    record = json.loads(truth.read_text().splitlines()[-1])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # Skip the warm-up steps; a step counts where it lies wholly on one side of an edge.
    spans = [(r["time"] - r["step_time"], r["time"], r["step_time"]) for r in rows[2:]]
    before = [d for s, e, d in spans if e < record["start"]]
    during = [d for s, e, d in spans if s > record["start"] and e < record["end"]]
    after = [d for s, e, d in spans if s > record["end"]]
    assert min(map(len, (before, during, after))) >= 3, (len(before), len(during), len(after))
    result = {k: statistics.median(v) for k, v in (("before", before), ("during", during), ("after", after))}
    print(f"step time medians {inject_args[0]}: " + ", ".join(f"{k} {v:.3f}s" for k, v in result.items()))
    return result


def assert_stretched_only_while_active(medians: dict[str, float]) -> None:
    # >= 1.3x while active; afterwards clearly below "during" again. Not held to
    # "before": this 2-core VM went on 1.33x slower right after a throttle that was
    # undone (CI rehearsal: 0.220 s, 1.026 s, then 0.292 s a step); the tests of the
    # injectors check the undo itself (the qdisc below, the cgroup in test_inject_compute).
    assert medians["during"] >= 1.3 * medians["before"]
    assert medians["during"] >= 1.3 * medians["after"]


def test_compute_injection_slows_steps_only_while_active(netns_cluster, tmp_path):
    out = tmp_path / "compute"
    job_id = start_training(out)
    truth = tmp_path / "truth.jsonl"
    medians = inject_and_measure(out, job_id, ["compute", "--job", job_id, "--rank", "3"], truth)
    assert_stretched_only_while_active(medians)
    record = json.loads(truth.read_text().splitlines()[-1])
    assert (record["kind"], record["job"], record["rank"], record["severity"]) == ("compute", job_id, 3, 0.5)
    assert record["end"] - record["start"] == pytest.approx(10, abs=0.5)


def test_link_throttle_slows_a_job_whose_dp_traffic_crosses_the_node(netns_cluster, tmp_path):
    # pp-fast: ranks 0-3 are replica 0's stages on n1, n2; ranks 4-7 replica 1's on
    # n3, n4. Every stage's DP gradient all-reduce crosses n3's link.
    out = tmp_path / "link"
    job_id = start_training(out, "--rank-order", "pp-fast")
    truth = tmp_path / "truth.jsonl"
    medians = inject_and_measure(out, job_id, ["link", "--node", "n3", "--rate", "20mbit"], truth)
    assert_stretched_only_while_active(medians)
    record = json.loads(truth.read_text().splitlines()[-1])
    assert record["kind"] == "link" and record["node"] == "n3"
    tc = subprocess.run(["tc", "qdisc", "show", "dev", "gh-veth3"], capture_output=True, text=True, check=True)
    assert "tbf" not in tc.stdout, "the throttle was not undone"
