"""S2 on the master's side (greyhound.mitigate.planner) and the training side
(greyhound.mitigate.training) on a real job Redis; the training side in a real gloo
world of two processes."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import socket
import subprocess

import pytest

from greyhound.control import store
from greyhound.control.events import read_events
from greyhound.control.redis_server import start_redis, stop_redis
from greyhound.mitigate.planner import (
    Planner,
    PlannerConfig,
    healthy_work_s,
    recovered,
    slow_loss,
)
from greyhound.mitigate.microbatch import replica_seconds
from greyhound.mitigate.training import Mitigation

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed: run scripts/setup")
REPLICAS = [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.fixture
def job(tmp_path):
    proc, address = start_redis(tmp_path, host="127.0.0.1")
    yield tmp_path, address.client()
    stop_redis(proc)


def test_a_replica_runs_at_its_slowest_members_pace():
    assert replica_seconds(REPLICAS, {5: 2.5, 6: 1.2}).tolist() == [1.0, 2.5]
    assert replica_seconds(REPLICAS, {}).tolist() == [1.0, 1.0]


def test_a_straggler_has_recovered_when_its_work_under_the_plan_dropped_by_the_factor():
    assert recovered(0.10, settled_s=0.15, drop=1.3)
    assert not recovered(0.12, settled_s=0.15, drop=1.3)       # 20%: within the noise


def test_the_loss_so_far_is_slow_iterations_times_the_extra_seconds():
    ranks = {r: {"baseline_s": 0.2, "current_s": 0.5, "iterations": 70, "slow_since": 50} for r in range(4)}
    assert slow_loss(ranks) == (pytest.approx(6.0), 0.2)
    assert slow_loss({0: {"baseline_s": ""}}) == (None, None)


def _ranks(compute: dict[int, float], base: float = 0.05) -> dict:
    return {r: {"compute_s": compute.get(r, base), "compute_base_s": base, "baseline_s": 0.25,
                "current_s": 0.5, "iterations": 80, "slow_since": 60} for r in range(8)}


VERDICT = {"kind": "compute", "ranks": [5], "nodes": ["n3"], "validated": True, "slowness": 9.0,
           "strength": 8.0, "where": "rank 5 on n3"}
"""Rank 5's own work rose 0.05 -> 0.15 s (3x); its GEMM 8x; profiling's relative 9x."""


def test_a_validated_compute_straggler_gets_the_exact_split_and_the_job_its_own_back_when_it_recovers(job):
    run_dir, client = job
    planner = Planner(client, run_dir, config=PlannerConfig(settle_s=2.0, end_s=3.0))
    client.set(store.TRAINING_LAYOUT, json.dumps({"microbatch_split": [8, 8], "replicas": REPLICAS}))
    planner.on_verdict(VERDICT, _ranks({5: 0.15}))
    plan = json.loads(client.get(store.PLAN))
    # Replica 1 at 3x: 12 x 1 = 4 x 3 = 12 s, the least makespan (even: 24 s).
    assert (plan["version"], plan["microbatch_split"], plan["level"]) == (1, [12, 4], "S2")
    event = read_events(run_dir)[-1]
    assert (event["kind"], event["expected_speedup"], event["loss_s"], event["cost_s"]) == \
        ("mitigation", 2.0, 5.0, 0.25)
    # Nothing is judged before the training side applied the plan, then settle polls.
    for _ in range(5):
        planner.poll(_ranks({5: 0.15}))
    assert planner.work[5].get("settled") is None
    client.set(store.TRAINING_APPLIED, json.dumps({"version": 1, "step": 70, "microbatch_split": [12, 4]}))
    for _ in range(6):                        # the plan in force, the straggler still slow
        planner.poll(_ranks({5: 0.15}))
    assert planner.work[5]["settled"] == 0.15 and json.loads(client.get(store.PLAN))["version"] == 1
    for _ in range(2):                        # healthy again, two polls: not yet
        planner.poll(_ranks({5: 0.05}))
    planner.poll(_ranks({5: 0.2}))            # a relapse resets the count
    for _ in range(3):
        planner.poll(_ranks({5: 0.05}))
    plan = json.loads(client.get(store.PLAN))
    assert (plan["version"], plan["microbatch_split"], plan["level"]) == (2, [8, 8], "S1")
    assert [e["kind"] for e in read_events(run_dir)] == ["mitigation", "mitigation_ended"]


def test_a_stages_healthy_work_at_a_split_is_read_off_a_healthy_peers_line():
    # GPU-bound: all of it per micro-batch; the peer's 8 -> 12 gives the line.
    assert healthy_work_s(peer_base_s=0.08, peer_now_s=0.12, peer_before=8, peer_now=12,
                          microbatches=4) == pytest.approx(0.04)
    # The CPU reference job on the local cluster: the peer did 0.133 s at 8 and 0.12 s
    # at 13 (noise, per-step work dominating): flat, the straggler at 3 expects 0.12 s.
    assert healthy_work_s(peer_base_s=0.133, peer_now_s=0.12, peer_before=8, peer_now=13,
                          microbatches=3) == pytest.approx(0.12)
    assert healthy_work_s(peer_base_s=0.1, peer_now_s=0.1, peer_before=8, peer_now=8, microbatches=2) == 0.1


def test_a_straggler_that_recovered_before_the_plan_settled_gets_the_job_its_own_split_back(job):
    # Run 650 on the local cluster: S2 split 13,3 about 6 s before rank 5's quota
    # ended; 20 s later its settled work was already healthy (0.065 s), no drop could
    # follow, and 13,3 stayed to the end of the job (1.26x slower than 8,8).
    run_dir, client = job
    planner = Planner(client, run_dir, config=PlannerConfig(settle_s=2.0, end_s=3.0))
    client.set(store.TRAINING_LAYOUT, json.dumps({"microbatch_split": [8, 8], "replicas": REPLICAS}))
    # As the master hands them over, read around the validation pause: the other ranks'
    # recent figures are missing; their baselines are not.
    slow = {r: "" for r in range(8)} | {5: 0.862}
    planner.on_verdict(VERDICT, _ranks(slow, base=0.133))
    split = json.loads(client.get(store.PLAN))["microbatch_split"]
    client.set(store.TRAINING_APPLIED, json.dumps({"version": 1, "step": 65, "microbatch_split": split}))
    under_plan = {r: 0.12 for r in range(8)}
    for _ in range(2):                                       # settling, the fail-slow on
        planner.poll(_ranks(under_plan | {5: 0.862}, base=0.133))
    for _ in range(2):                                       # it ends: settled is healthy
        planner.poll(_ranks(under_plan | {5: 0.065}, base=0.133))
    assert planner.work[5]["settled"] == 0.065 and json.loads(client.get(store.PLAN))["version"] == 1
    planner.poll(_ranks(under_plan | {5: 0.065}, base=0.133))
    plan = json.loads(client.get(store.PLAN))
    assert (plan["version"], plan["microbatch_split"]) == (2, [8, 8])


def test_a_straggler_with_no_recent_figure_at_the_verdict_is_watched_and_its_plan_ends(job):
    # scripts/demo: rank 5 at 5x finished too few iterations in the agent's window to
    # have a recent figure when the verdict came; it was not watched, and 14,2 stayed
    # to the end of the job though it recovered 30 s later.
    run_dir, client = job
    planner = Planner(client, run_dir, config=PlannerConfig(settle_s=2.0, end_s=3.0))
    client.set(store.TRAINING_LAYOUT, json.dumps({"microbatch_split": [8, 8], "replicas": REPLICAS}))
    planner.on_verdict({**VERDICT, "severity": 5.14}, _ranks({5: None}, base=0.145))   # the job 5.14x slow
    assert planner.work[5] == {"base": 0.145}
    split = json.loads(client.get(store.PLAN))["microbatch_split"]
    client.set(store.TRAINING_APPLIED, json.dumps({"version": 1, "step": 60, "microbatch_split": split}))
    for _ in range(3):                                       # settling, still slow
        planner.poll(_ranks({5: 0.8}, base=0.145))
    assert planner.work[5]["settled"] == 0.8
    for _ in range(3):                                       # recovered
        planner.poll(_ranks({5: 0.03}, base=0.145))
    plan = json.loads(client.get(store.PLAN))
    assert (plan["version"], plan["microbatch_split"], plan["level"]) == (2, [8, 8], "S1")


def test_a_straggler_still_slow_under_the_plan_keeps_it_against_its_peers_line(job):
    run_dir, client = job
    planner = Planner(client, run_dir, config=PlannerConfig(settle_s=1.0, end_s=2.0))
    client.set(store.TRAINING_LAYOUT, json.dumps({"microbatch_split": [8, 8], "replicas": REPLICAS}))
    planner.on_verdict(VERDICT, _ranks({r: 0.133 for r in range(8)} | {5: 0.862}, base=0.133))
    split = json.loads(client.get(store.PLAN))["microbatch_split"]
    client.set(store.TRAINING_APPLIED, json.dumps({"version": 1, "step": 65, "microbatch_split": split}))
    for _ in range(8):   # 1.5x what its peer's line gives at its micro-batches: still slow
        planner.poll(_ranks({r: 0.12 for r in range(8)} | {5: 0.18}, base=0.133))
    assert json.loads(client.get(store.PLAN))["version"] == 1


def test_a_straggler_without_a_figure_from_before_is_taken_at_the_jobs_slowdown(job):
    # Profiling named it by its share of compute (no work figure before the onset):
    # the job's slowdown, 3x, is its replica's pace (its GEMM said 8x).
    run_dir, client = job
    planner = Planner(client, run_dir)
    client.set(store.TRAINING_LAYOUT, json.dumps({"microbatch_split": [8, 8], "replicas": REPLICAS}))
    ranks = _ranks({5: 0.15})
    ranks[5]["compute_base_s"] = ""
    planner.on_verdict({**VERDICT, "severity": 3.0}, ranks)
    assert json.loads(client.get(store.PLAN))["microbatch_split"] == [12, 4]


def test_unvalidated_or_link_verdicts_and_jobs_without_the_training_side_get_no_plan(job):
    run_dir, client = job
    planner = Planner(client, run_dir)
    planner.on_verdict({**VERDICT, "validated": False}, _ranks({}))
    planner.on_verdict({"kind": "link", "ranks": [], "nodes": ["n3"], "validated": True}, _ranks({}))
    # A GEMM slowed beside a slow link: S2 cannot help a link.
    planner.on_verdict({"kind": "link", "ranks": [], "nodes": ["n3"], "validated": True,
                        "also": [{**VERDICT, "strength": 2.2}]}, _ranks({5: 0.15}))
    assert client.get(store.PLAN) is None and read_events(run_dir) == []
    planner.on_verdict(VERDICT, _ranks({}))           # its own work did not rise: nothing to move
    assert client.get(store.PLAN) is None and read_events(run_dir) == []
    planner.on_verdict(VERDICT, _ranks({5: 0.15}))    # no layout: the job does not take plans
    assert client.get(store.PLAN) is None
    assert [e["kind"] for e in read_events(run_dir)] == ["mitigation_skipped"]


def test_a_straggler_no_split_helps_gets_no_plan_and_stays_open_to_the_next_rung(job):
    run_dir, client = job
    planner = Planner(client, run_dir)
    client.set(store.TRAINING_LAYOUT, json.dumps({"microbatch_split": [8, 8], "replicas": REPLICAS}))
    # Rank 5's own work 10% up: 8 x 1.1 = 8.8 s, while [9, 7] takes 9 s (the
    # healthy replica's ninth micro-batch): the even split is already the best.
    planner.on_verdict(VERDICT, _ranks({5: 0.055}))
    assert client.get(store.PLAN) is None and not planner.stragglers
    [event] = read_events(run_dir)
    assert (event["kind"], event["level"], event["microbatch_split"]) == ("mitigation_skipped", "S2", [8, 8])
    assert "rank 5 at 1.10x" in event["why"], event
    assert planner.s4 is not None and planner.s4["nodes"] == ["n3"]      # S4's ski-rental decides
    # Slower, it is worth a split after all.
    planner.on_verdict(VERDICT, _ranks({5: 0.15}))
    assert json.loads(client.get(store.PLAN))["microbatch_split"] == [12, 4] and planner.s4 is None


def test_the_training_side_is_inert_outside_mitigate_mode(monkeypatch, tmp_path):
    monkeypatch.setenv("GREYHOUND_MODE", "detect")
    monkeypatch.setenv("GREYHOUND_RUN_DIR", str(tmp_path))
    m = Mitigation.from_env(microbatch_split=(8, 8), replicas=REPLICAS, rank=0)
    # No process group exists: an active step would fail on the broadcast.
    assert not m.active and m.step(0).microbatch_split == (8, 8)
    monkeypatch.delenv("GREYHOUND_MODE")
    assert not Mitigation.from_env(microbatch_split=(8, 8), replicas=REPLICAS, rank=0).active
    with pytest.raises(ValueError, match="one entry >= 1 per replica"):
        Mitigation(microbatch_split=(8,), replicas=REPLICAS, rank=0, active=False)
    with pytest.raises(ValueError, match=r"microbatch_multiple 3 must be an integer >= 1 that divides"):
        Mitigation(microbatch_split=(8, 8), replicas=REPLICAS, rank=0, active=False, microbatch_multiple=3)


def test_a_plan_that_breaks_the_jobs_micro_batch_multiple_is_refused():
    m = Mitigation(microbatch_split=(4, 4), replicas=[[0], [1]], rank=0, active=False, microbatch_multiple=2)
    assert m._check({"version": 1, "microbatch_split": [6, 2]}).microbatch_split == (6, 2)
    with pytest.raises(ValueError, match=r"\[5, 3\] is not 2 integers >= 1 summing to 8, each a multiple of 2"):
        m._check({"version": 1, "microbatch_split": [5, 3]})


def _train(rank: int, port: int, run_dir: str, steps: int, out) -> None:
    import torch.distributed as dist

    os.environ.update(GREYHOUND_MODE="mitigate", GREYHOUND_RUN_DIR=run_dir)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    m = Mitigation.from_env(microbatch_split=(4, 4), replicas=[[0], [1]], rank=rank)
    client = None
    if rank == 0:
        from greyhound.control.redis_server import read_address

        client = read_address(run_dir).client()
    splits = []
    placement = ((0, 0), (1, 0))
    for step in range(steps):
        if rank == 0 and step == 3:
            client.set(store.PLAN, json.dumps({"version": 1, "microbatch_split": [6, 2]}))
        if rank == 0 and step == 6:     # malformed: the plan in force stays
            client.set(store.PLAN, json.dumps({"version": 2, "microbatch_split": [7, 7]}))
        if rank == 0 and step == 8:     # S4: a checkpoint, once
            client.set(store.PLAN, json.dumps({"version": 3, "microbatch_split": [6, 2], "checkpoint": True}))
        if rank == 0 and step == 11:    # S3: the two ranks swap replicas
            client.set(store.PLAN, json.dumps({"version": 4, "microbatch_split": [6, 2],
                                               "placement": [[1, 0], [0, 0]]}))
        if rank == 0 and step == 12:    # malformed placements: the plan in force stays
            client.set(store.PLAN, json.dumps({"version": 5, "microbatch_split": [6, 2],
                                               "placement": [[0, 0], [0, 0]]}))
        if rank == 0 and step == 13:
            client.set(store.PLAN, json.dumps({"version": 6, "microbatch_split": [6, 2], "placement": {"0": 1}}))
        if rank == 0 and step == 14:    # S2 alone (no placement): the placement in force stays
            client.set(store.PLAN, json.dumps({"version": 7, "microbatch_split": [4, 4]}))
        plan = m.step(step)
        splits.append((*plan.microbatch_split, plan.checkpoint, plan.placement))
        if plan.checkpoint:
            m.checkpointed(step)
        if plan.placement != placement:
            placement = plan.placement
            m.relaid_out(step, seconds=0.25, bytes_moved=1024)
        dist.barrier()                  # rank 1 may run ahead of rank 0's writes otherwise
    out.put((rank, splits))
    dist.destroy_process_group()


def test_every_rank_switches_to_a_plan_at_the_same_step_and_a_bad_plan_changes_nothing(job):
    run_dir, client = job
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_train, args=(r, port, str(run_dir), 16, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    # Rank 0 finds the board at step 0 and reads each step; the plan set before step 3's
    # read holds from step 3 on, on both ranks; the bad one (sum 14, not 8) is ignored;
    # S4's checkpoint is due at step 8 alone, on both ranks; S3's placement from step
    # 11, kept through two malformed ones and a plan that re-splits only.
    own, swapped = ((0, 0), (1, 0)), ((1, 0), (0, 0))
    want = ([(4, 4, False, own)] * 3 + [(6, 2, False, own)] * 5 + [(6, 2, True, own)] + [(6, 2, False, own)] * 2
            + [(6, 2, False, swapped)] * 3 + [(4, 4, False, swapped)] * 2)
    assert got[0] == got[1] == want
    assert json.loads(client.get(store.TRAINING_LAYOUT)) == {"microbatch_split": [4, 4], "replicas": [[0], [1]],
                                                             "microbatch_multiple": 1}
    assert json.loads(client.get(store.TRAINING_APPLIED)) == {"version": 7, "step": 14, "microbatch_split": [4, 4],
                                                              "placement": [[1, 0], [0, 0]]}
    assert json.loads(client.get(store.TRAINING_CHECKPOINTED)) == {"version": 3, "step": 8}
    assert json.loads(client.get(store.TRAINING_RELAID)) == {"version": 4, "step": 11, "pause_s": 0.25, "bytes": 1024}
    shown = store.read_job(client)
    assert shown["plan"]["version"] == 7 and shown["applied"]["version"] == 7 and shown["ranks"] == {}


def test_status_says_which_plan_is_in_force_and_since_when():
    from greyhound.status_cli import render_text

    plan = {"version": 1, "microbatch_split": [13, 3], "level": "S2", "why": "compute straggler(s) rank 5 at 3.00x"}
    shown = {"job_id": "7", "control_plane": "tracking", "plan": plan}
    assert "mitigation S2 (plan 1): micro-batches per DP replica 13,3, not applied yet; compute straggler(s)" \
        in render_text(shown)
    shown["applied"] = {"version": 1, "step": 68, "microbatch_split": [13, 3]}
    assert "13,3, in force from step 68;" in render_text(shown)
    assert "mitigation" not in render_text({"job_id": "7", "control_plane": "tracking", "plan": None})


def test_the_jobs_own_placement_comes_from_its_replicas():
    from greyhound.mitigate.training import placement_of

    # Megatron's order for DP=2 x PP=4: rank = stage * 2 + replica.
    assert placement_of([[0, 2, 4, 6], [1, 3, 5, 7]]) == (
        (0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3))
    for bad in ([[0, 1], [1, 2]], [[0, 1], [2]], [[0, 3], [1, 2, 4]]):
        with pytest.raises(ValueError, match="ranks 0..N-1 once each"):
            placement_of(bad)


def _board(client, nodes: list[str], dp_bytes: float = 4e6, pp_bytes: float = 1e5) -> None:
    """Each rank's comm figures as the agents publish them: its stage's gradient
    all-reduce and its pipeline sends and receives."""
    for rank in range(len(nodes)):
        client.hset(store.comms_key(rank), mapping={
            "11": json.dumps({"bytes_per_iter": dp_bytes, "seconds_per_iter": 0.01, "calls_per_iter": 1,
                              "op": "AllReduce"}),
            "12": json.dumps({"bytes_per_iter": pp_bytes, "seconds_per_iter": 0.01, "calls_per_iter": 8,
                              "op": "Send"})})


LINK_VERDICT = {"kind": "link", "where": "n2", "nodes": ["n2"], "ranks": [], "validated": True,
                "measured": {"slow_links": [{"link": "n2<->n4", "bandwidth_Bps": 1e6, "ratio": 0.01, "node": "n2"}]},
                "link_bandwidth_Bps": 1e8}


def test_a_link_under_the_dp_rings_gets_a_placement_that_puts_it_under_pipeline_traffic(job):
    run_dir, client = job
    nodes = ["n1", "n1", "n2", "n2", "n3", "n3", "n4", "n4"]
    # Replica d holds ranks 4d..4d+3 (stages in order): each stage's DP pair spans two
    # nodes, and n2's NIC carries the rings of stages 2 and 3.
    client.set(store.TRAINING_LAYOUT, json.dumps({"microbatch_split": [8, 8], "replicas": REPLICAS}))
    _board(client, nodes)
    ranks = {r: {**state, "node": nodes[r]} for r, state in _ranks({}).items()}
    planner = Planner(client, run_dir)
    planner.on_verdict(LINK_VERDICT, {r: {**s, "iterations": 61} for r, s in ranks.items()})
    planner.poll({r: {**s, "iterations": 61} for r, s in ranks.items()})   # lost 0.25 s: less than the move
    assert client.get(store.PLAN) is None
    planner.poll(ranks)                                                     # lost 5 s
    plan = json.loads(client.get(store.PLAN))
    assert (plan["version"], plan["level"], plan["microbatch_split"]) == (1, "S3", [8, 8])
    stage_nodes = {}
    for rank, (_, stage) in enumerate(plan["placement"]):
        stage_nodes.setdefault(stage, set()).add(nodes[rank])
    # No DP ring crosses n2's NIC: n2's two ranks form a stage's pair.
    assert {"n2"} in stage_nodes.values() and all("n2" not in s or s == {"n2"} for s in stage_nodes.values())
    event = read_events(run_dir)[-1]
    assert (event["kind"], event["level"], event["cost_is"], event["loss_s"]) == ("mitigation", "S3", "estimated", 5.0)
    assert event["modelled_step_s"][1] < event["modelled_step_s"][0] and event["moves"]
    # The training side applied it and measured the pause: S3's cost from now on.
    client.set(store.TRAINING_RELAID, json.dumps({"version": 1, "step": 90, "pause_s": 1.7, "bytes": 123}))
    planner.poll(ranks)
    assert planner.relaid_s == 1.7 and planner.s3 is None
    assert [e["kind"] for e in read_events(run_dir)] == ["mitigation", "relaid"]
    # The S2 split is planned over the replicas of the placement in force.
    client.set(store.TRAINING_APPLIED, json.dumps({"version": 1, "step": 90, "microbatch_split": [8, 8],
                                                   "placement": plan["placement"]}))
    slow = next(r for r, (d, _) in enumerate(plan["placement"]) if d == 1)
    planner.on_verdict({**VERDICT, "ranks": [slow]}, _ranks({slow: 0.15}))
    assert json.loads(client.get(store.PLAN))["microbatch_split"] == [12, 4]


@pytest.mark.parametrize(("step_s", "undone"), [(1.4, True), (0.3, False)])
def test_a_move_that_makes_the_job_slower_is_moved_back_and_s3_rests_until_the_slowdown_ends(job, step_s, undone):
    # Right before the move the ranks took 0.5 s a step (current_s); after it, the job's
    # own steps (training rank 0's progress) take step_s over the judging window.
    run_dir, client = job
    nodes = ["n1", "n1", "n2", "n2", "n3", "n3", "n4", "n4"]
    client.set(store.TRAINING_LAYOUT, json.dumps({"microbatch_split": [8, 8], "replicas": REPLICAS}))
    _board(client, nodes)
    ranks = {r: {**state, "node": nodes[r]} for r, state in _ranks({}).items()}
    planner = Planner(client, run_dir, config=PlannerConfig(judge_s=3.0))
    planner.on_verdict(LINK_VERDICT, ranks)
    planner.poll(ranks)
    moved = json.loads(client.get(store.PLAN))
    client.set(store.TRAINING_APPLIED, json.dumps({"version": 1, "step": 90, "microbatch_split": [8, 8],
                                                   "placement": moved["placement"]}))
    client.set(store.TRAINING_RELAID, json.dumps({"version": 1, "step": 90, "pause_s": 0.4, "bytes": 123}))
    planner.poll(ranks)                                  # relaid: judging from the next poll
    for k in range(5):
        client.set(store.TRAINING_PROGRESS, json.dumps({"step": 91 + 10 * k, "time": 1000.0 + 10 * k * step_s}))
        planner.poll(ranks)
    kinds = [e["kind"] for e in read_events(run_dir)]
    if not undone:
        assert kinds == ["mitigation", "relaid"] and json.loads(client.get(store.PLAN))["version"] == 1
        return
    back = json.loads(client.get(store.PLAN))
    assert (back["version"], back["level"], back["microbatch_split"]) == (2, "S3", [8, 8])
    assert back["placement"] == [[r // 4, r % 4] for r in range(8)]          # the job's own placement
    undo = read_events(run_dir)[-1]
    assert (undo["kind"], undo["undoes"], undo["before_step_s"], undo["after_step_s"]) == \
        ("mitigation_undone", 1, 0.5, 1.4)
    # The way back is applied and logged; S3 rests while the job is slow, then serves again.
    client.set(store.TRAINING_APPLIED, json.dumps({"version": 2, "step": 140, "microbatch_split": [8, 8]}))
    client.set(store.TRAINING_RELAID, json.dumps({"version": 2, "step": 140, "pause_s": 0.5, "bytes": 123}))
    planner.poll(ranks)
    planner.on_verdict(LINK_VERDICT, ranks)
    assert planner.s3 is None and [e["kind"] for e in read_events(run_dir)][-1] == "relaid"
    planner.poll({r: {**s, "slow_since": None} for r, s in ranks.items()})
    planner.on_verdict(LINK_VERDICT, ranks)
    assert planner.s3 is not None


@pytest.mark.cluster
@pytest.mark.parametrize("still_slow", [True, False])
def test_s4_waits_for_the_judge_of_s3s_move_and_goes_only_if_the_job_is_still_slow(cluster, job, still_slow):
    # The loss (5 s) is past both rungs' costs at the verdict (S4: no start-up, a 1 s
    # hold, a 0.25 s step): S3 moves first, and S4 waits for the move's effect to show.
    from greyhound.slurm_client import CommandLineClient

    run_dir, client = job
    partition = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True,
                               check=True).stdout.split()[0].rstrip("*")
    nodes = ["n1", "n1", "n2", "n2", "n3", "n3", "n4", "n4"]
    client.set(store.TRAINING_LAYOUT, json.dumps({"microbatch_split": [8, 8], "replicas": REPLICAS}))
    _board(client, nodes)
    ranks = {r: {**state, "node": nodes[r]} for r, state in _ranks({}).items()}
    planner = Planner(client, run_dir, config=PlannerConfig(judge_s=3.0, requeue_hold_s=1.0),
                      job={"id": "999999", "partition": partition, "num_nodes": 2}, slurm=CommandLineClient())
    planner.on_verdict(LINK_VERDICT, ranks)
    planner.poll(ranks)
    moved = json.loads(client.get(store.PLAN))
    assert (moved["version"], moved["level"]) == (1, "S3") and planner.s4 is not None
    client.set(store.TRAINING_APPLIED, json.dumps({"version": 1, "step": 90, "microbatch_split": [8, 8],
                                                   "placement": moved["placement"]}))
    client.set(store.TRAINING_RELAID, json.dumps({"version": 1, "step": 90, "pause_s": 0.4, "bytes": 123}))
    after = ranks if still_slow else {r: {**s, "slow_since": None, "current_s": 0.26} for r, s in ranks.items()}
    for k in range(4):                                   # relaid, then the judge's polls: the move stays
        client.set(store.TRAINING_PROGRESS, json.dumps({"step": 91 + 10 * k, "time": 1000.0 + 5 * k}))
        planner.poll(after)
        assert json.loads(client.get(store.PLAN))["version"] == 1 and planner.judged is not None
        assert not planner.idle                          # the agents publish every poll meanwhile
    planner.poll(after)                                  # judged: kept
    kinds = [e["kind"] for e in read_events(run_dir)]
    if not still_slow:
        assert kinds == ["mitigation", "relaid"] and planner.s4 is None and planner.idle
        return
    plan = json.loads(client.get(store.PLAN))
    assert (plan["version"], plan["level"], plan["checkpoint"]) == (2, "S4", True)
    assert kinds == ["mitigation", "relaid", "mitigation"] and read_events(run_dir)[-1]["nodes"] == ["n2"]


def test_a_compute_straggler_clearly_slow_beside_a_link_gets_s2_once_the_links_move_is_made(job):
    # The end-to-end benchmark's compound phase: a link named at n2 and, beside it,
    # rank 6's GEMM 10x with its own work 3x. S2 waits for S3's move: made before it,
    # the split would stay with replicas the move reshuffles.
    run_dir, client = job
    nodes = ["n1", "n1", "n2", "n2", "n3", "n3", "n4", "n4"]
    client.set(store.TRAINING_LAYOUT, json.dumps({"microbatch_split": [8, 8], "replicas": REPLICAS}))
    _board(client, nodes)
    ranks = {r: {**state, "node": nodes[r]} for r, state in _ranks({6: 0.15}).items()}
    verdict = {**LINK_VERDICT, "also": [{"kind": "compute", "ranks": [6], "nodes": ["n4"], "where": "rank 6 on n4",
                                         "strength": 10.0}]}
    planner = Planner(client, run_dir)
    planner.on_verdict(verdict, ranks)
    assert client.get(store.PLAN) is None and not planner.stragglers
    planner.poll(ranks)                                                     # lost 5 s: the move
    plan = json.loads(client.get(store.PLAN))
    assert (plan["version"], plan["level"], plan["microbatch_split"]) == (1, "S3", [8, 8])
    client.set(store.TRAINING_APPLIED, json.dumps({"version": 1, "step": 90, "microbatch_split": [8, 8],
                                                   "placement": plan["placement"]}))
    client.set(store.TRAINING_RELAID, json.dumps({"version": 1, "step": 90, "pause_s": 0.4, "bytes": 123}))
    planner.poll(ranks)
    after = json.loads(client.get(store.PLAN))
    # Rank 6's replica under the new placement gives micro-batches away: 4 x 3 = 12 x 1.
    mine = plan["placement"][6][0]
    assert (after["version"], after["level"]) == (2, "S2") and "placement" not in after
    assert after["microbatch_split"][mine] == 4 and sum(after["microbatch_split"]) == 16
    assert planner.stragglers == {6: 3.0}
    assert [e["kind"] for e in read_events(run_dir)] == ["mitigation", "relaid", "mitigation"]
    assert planner.s4 is not None and planner.s4["nodes"] == ["n2"]      # the link stays S4's candidate


def test_beside_a_link_a_gemm_the_link_may_have_slowed_or_a_rank_without_its_own_rise_gets_no_s2(job):
    run_dir, client = job
    nodes = ["n1", "n1", "n2", "n2", "n3", "n3", "n4", "n4"]
    client.set(store.TRAINING_LAYOUT, json.dumps({"microbatch_split": [8, 8], "replicas": REPLICAS}))
    _board(client, nodes)
    for gemm, compute in ((2.2, 0.15), (10.0, None)):
        planner = Planner(client, run_dir)
        ranks = {r: {**state, "node": nodes[r]} for r, state in _ranks({6: compute}).items()}
        planner.on_verdict({**LINK_VERDICT, "also": [{"kind": "compute", "ranks": [6], "strength": gemm}]}, ranks)
        assert planner.s3 is not None and "then_s2" not in planner.s3, (gemm, compute)


def _two_stragglers(job, second: int, **layout):
    """A verdict naming rank 2 (replica 0's stage 2) and ``second``, both 3x slow, and
    the planner's plans after it (None: none) and after one more poll."""
    run_dir, client = job
    nodes = ["n1", "n1", "n2", "n2", "n3", "n3", "n4", "n4"]
    client.set(store.TRAINING_LAYOUT, json.dumps({"microbatch_split": [8, 8], "replicas": REPLICAS, **layout}))
    _board(client, nodes)
    ranks = {r: {**state, "node": nodes[r]} for r, state in _ranks({2: 0.15, second: 0.15}).items()}
    verdict = {**VERDICT, "ranks": [2], "nodes": ["n2"], "where": "rank 2 on n2", "link_bandwidth_Bps": 1e8,
               "also": [{"kind": "compute", "ranks": [second], "nodes": [nodes[second]], "strength": 8.0}]}
    planner = Planner(client, run_dir)
    planner.on_verdict(verdict, ranks)
    first = json.loads(client.get(store.PLAN) or "null")
    planner.poll(ranks)                       # lost 5 s: more than a rebuild's two steps
    return first, json.loads(client.get(store.PLAN) or "null"), read_events(run_dir)


def test_two_stragglers_in_two_replicas_are_gathered_into_one_and_s2_unloads_it(job):
    # Rank 5 runs replica 1's stage 1: both replicas 3x slow, so S2 alone cannot help.
    first, plan, events = _two_stragglers(job, 5)
    assert first is None                 # S2's best is the even split: no plan, an event
    assert [(e["kind"], e["level"]) for e in events][:1] == [("mitigation_skipped", "S2")]
    assert (plan["version"], plan["level"]) == (1, "S3")
    cells = plan["placement"]
    # Rank 5 takes rank 1's cell (replica 0, stage 1) and rank 1 its: each keeps its
    # stage (nothing to send), and replica 1 is clean.
    assert cells[2] == [0, 2] and cells[5] == [0, 1] and cells[1] == [1, 1]
    assert all(cells[r] == [r // 4, r % 4] for r in (0, 3, 4, 6, 7))
    # S2 over the gathered replicas: 4 x 3 = 12 x 1 (even: 8 x 3 = 24). Modelled 1F1B
    # steps: 7 x 3 + 3 + 3 = 27 in each replica before; 3 x 3 + (3 + 3 + 1 + 1) = 17
    # after (the clean replica 11 + 4).
    assert plan["microbatch_split"] == [4, 12]
    event = events[-1]
    assert (event["kind"], event["level"], event["moves"], event["modelled_step_microbatches"]) == \
        ("mitigation", "S3", [], [27.0, 17.0])
    assert "rank 2" in event["why"] and "rank 5" in event["why"]


def test_two_stragglers_already_in_one_replica_stay_there(job):
    # Ranks 1 and 2 both run replica 0: S2 unloads it, and spreading them (the old
    # "one stage" consolidation) would slow replica 1 too.
    first, plan, events = _two_stragglers(job, 1)
    assert (first["level"], first["microbatch_split"]) == ("S2", [4, 12]) and plan == first
    skipped = [e for e in events if e["kind"] == "mitigation_skipped"]
    assert skipped and skipped[0]["level"] == "S3" and "neither gathering" in skipped[0]["why"]


def test_two_stragglers_in_one_replica_of_a_job_that_splits_in_whole_pipelines_are_put_into_one_stage(job):
    # Ranks 1 and 2 run replica 0's stages 1 and 2; the job keeps each replica's
    # micro-batches a multiple of the pipeline depth (4 + 4): no split helps. One
    # stage does: each replica then has one slow stage (modelled 3 x 3 + 3 + 3 = 15
    # against 3 x 3 + 3 + 3 + 1 + 1 = 17 in replica 0 now).
    first, plan, events = _two_stragglers(job, 1, microbatch_split=[4, 4], microbatch_multiple=4)
    assert first is None
    skipped = [e for e in events if e["kind"] == "mitigation_skipped"]
    assert skipped[0]["level"] == "S2" and skipped[0]["microbatch_split"] == [4, 4]
    assert (plan["version"], plan["level"], plan["microbatch_split"]) == (1, "S3", [4, 4])
    cells = [tuple(c) for c in plan["placement"]]
    assert cells[1][1] == cells[2][1] and cells[1][0] != cells[2][0]        # one stage, both replicas
    assert cells[1][1] in (1, 2)                                           # an inner one
    (event,) = [e for e in events if e["kind"] == "mitigation"]
    assert (event["level"], event["modelled_step_microbatches"]) == ("S3", [17.0, 15.0])
    assert len(event["moves"]) == 2 and "consolidate" in event["action"]


@pytest.mark.parametrize(("multiple", "split"), [(1, [14, 2]), (4, [12, 4])])
def test_a_job_that_splits_in_whole_pipelines_gets_s2_splits_in_whole_pipelines(job, multiple, split):
    # Rank 5 (replica 1) 7x slow: 14 x 1 = 2 x 7 in ones; in fours, 12 + 4 (16 + 0 would
    # drain replica 1).
    run_dir, client = job
    client.set(store.TRAINING_LAYOUT, json.dumps({"microbatch_split": [8, 8], "replicas": REPLICAS,
                                                  "microbatch_multiple": multiple}))
    Planner(client, run_dir).on_verdict(VERDICT, _ranks({5: 0.35}))
    assert json.loads(client.get(store.PLAN))["microbatch_split"] == split


def test_a_finding_beside_the_lead_with_no_figure_of_its_own_needs_a_clearly_slow_gemm(job):
    # scripts/demo: rank 0 (healthy) read 1.33x in its GEMM and had no recent work figure
    # (read around the pause); taken at the job's 5.9x it was gathered with rank 5.
    run_dir, client = job
    client.set(store.TRAINING_LAYOUT, json.dumps({"microbatch_split": [8, 8], "replicas": REPLICAS}))
    verdict = {**VERDICT, "severity": 5.9, "also": [{"kind": "compute", "ranks": [0], "strength": 1.33}]}
    planner = Planner(client, run_dir)
    planner.on_verdict(verdict, _ranks({5: 0.15, 0: None}))
    assert planner.stragglers == {5: 3.0}
    # A GEMM clearly slow stands alone: the job's slowdown, at most the GEMM's ratio.
    planner = Planner(client, run_dir)
    planner.on_verdict({**verdict, "also": [{"kind": "compute", "ranks": [0], "strength": 4.0}]},
                       _ranks({5: 0.15, 0: None}))
    assert planner.stragglers == {5: 3.0, 0: 4.0}


def test_a_finding_masked_by_a_slower_straggler_upstream_is_taken_by_its_clearly_slow_gemm(job):
    # The consolidation cluster test: ranks 2 and 4 in stages 1 and 2 of one replica,
    # both under CPU quotas; rank 4 idled in its calls waiting for rank 2 (its own work
    # and CPU wait as before) while its GEMM read 9.7x. A 1.33x GEMM is not enough.
    run_dir, client = job
    client.set(store.TRAINING_LAYOUT, json.dumps({"microbatch_split": [8, 8], "replicas": REPLICAS}))
    for gemm, taken in ((9.7, {1: 3.0, 2: 9.7}), (1.33, {1: 3.0})):
        verdict = {**VERDICT, "ranks": [1], "severity": 19.3, "also": [{"kind": "compute", "ranks": [2],
                                                                         "strength": gemm}]}
        planner = Planner(client, run_dir)
        planner.on_verdict(verdict, _ranks({1: 0.15}))
        assert planner.stragglers == taken, gemm


def test_a_straggler_whose_work_fell_is_taken_at_how_long_it_waits_for_a_cpu(job):
    # The two-straggler cluster test: rank 2, under a CPU quota, read 0.3x its past work
    # per iteration (its stops fell inside its calls) but waited for a CPU 0.53 of its
    # time against 0.38 before; rank 5's work rose 3x and it waited no longer.
    run_dir, client = job
    client.set(store.TRAINING_LAYOUT, json.dumps({"microbatch_split": [8, 8], "replicas": REPLICAS}))
    ranks = _ranks({2: 0.015, 5: 0.15})
    ranks[2] |= {"cpu_wait": 0.53, "cpu_wait_base": 0.38}
    ranks[5] |= {"cpu_wait": 0.30, "cpu_wait_base": 0.30}
    verdict = {**VERDICT, "also": [{"kind": "compute", "ranks": [2], "nodes": ["n2"], "strength": 8.0}]}
    planner = Planner(client, run_dir)
    planner.on_verdict(verdict, ranks)
    assert planner.stragglers == {5: 3.0, 2: round((1 - 0.38) / (1 - 0.53), 3)}
    # Without the CPU figure its work alone says it is not slow: not a straggler.
    del ranks[2]["cpu_wait"]
    planner = Planner(client, run_dir)
    planner.on_verdict(verdict, ranks)
    assert planner.stragglers == {5: 3.0}


def test_a_lone_straggler_is_at_least_as_slow_as_the_job_it_slows(job):
    # CI rehearsal: a CPU quota on rank 5, the job 3.99x slower, the rank's own figures
    # 1.61x (its stops fell inside its calls); S2 split 10,6 for 1.61x and gained 5%.
    run_dir, client = job
    client.set(store.TRAINING_LAYOUT, json.dumps({"microbatch_split": [8, 8], "replicas": REPLICAS}))
    for verdict, taken in (({**VERDICT, "severity": 4.0}, 4.0),          # the job's 4x, not its own 3x
                           ({**VERDICT, "severity": 12.0}, 8.0),         # at most its GEMM's 8x
                           ({**VERDICT, "severity": 2.0}, 3.0)):         # its own 3x over the job's 2x
        planner = Planner(client, run_dir)
        planner.on_verdict(verdict, _ranks({5: 0.15}))
        assert planner.stragglers == {5: taken}, verdict
        client.delete(store.PLAN)
