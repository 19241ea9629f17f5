"""S3's training-side building block (examples/hybrid/relayout.py): ranks change their
(dp_rank, pp_rank) cells at a step boundary, every rank whose stage changes receives it
point to point from an old holder, and training goes on as if nothing had moved.

The world test runs 8 forked gloo ranks (dp 2 x pp 4) of the reference job's model,
schedule and train step (hybrid.train._train_step), started from a fork server that
has imported torch once, as examples/hybrid/forklaunch.py does for the whole job.
"""

from __future__ import annotations

import copy
import json
import math
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from hybrid import checkpoint, relayout, train  # noqa: E402
from hybrid.config import DataConfig, ModelConfig, TrainConfig  # noqa: E402
from hybrid.data import SyntheticData  # noqa: E402
from hybrid.forklaunch import free_port  # noqa: E402
from hybrid.layout import ParallelLayout, placement_of, split_layers  # noqa: E402
from hybrid.schedule import NO_RECORDER  # noqa: E402

DP, PP = 2, 4
MODEL = ModelConfig(num_layers=4, dim=32, num_heads=2, vocab_size=64, max_seq_len=16)
DATA = DataConfig(microbatch_size=2, seq_len=16, min_seq_len=4)
CFG = TrainConfig(dp=DP, pp=PP, microbatch_split=(4, 4), seed=5, backend="gloo")
STEPS_BEFORE, STEPS_AFTER = 2, 2

OLD = ParallelLayout(dp=DP, pp=PP, world_size=DP * PP)  # dp-fast: rank r in cell (r % 2, r // 2)
NEW = OLD.with_placement((
    (0, 3),  # rank 0: stage 0 -> 3, swapping with rank 6
    (1, 1),  # rank 1: stage 0 -> 1 \
    (0, 1),  # rank 2: keeps (0, 1)   |
    (1, 2),  # rank 3: stage 1 -> 2   | a cycle 1 -> 3 -> 5 -> 1
    (1, 3),  # rank 4: (0, 2) -> (1, 3): stage and replica change, swapping with rank 7
    (1, 0),  # rank 5: stage 2 -> 0 /
    (0, 0),  # rank 6: stage 3 -> 0
    (0, 2),  # rank 7: (1, 3) -> (0, 2)
))


# -- placements --------------------------------------------------------------------
@pytest.mark.parametrize("order", ["dp-fast", "pp-fast"])
def test_rank_orders_are_placements(order):
    by_order = ParallelLayout(dp=DP, pp=PP, world_size=8, rank_order=order)
    explicit = OLD.with_placement(placement_of(order, dp=DP, pp=PP))
    for r in range(8):
        assert explicit.coords_of(r) == by_order.coords_of(r)
    assert [explicit.dp_group(s) for s in range(PP)] == [by_order.dp_group(s) for s in range(PP)]
    assert [explicit.pipeline(d) for d in range(DP)] == [by_order.pipeline(d) for d in range(DP)]


def test_explicit_placement_maps_both_ways():
    for r in range(8):
        d, p = NEW.coords_of(r)
        assert NEW.rank_of(dp_rank=d, pp_rank=p) == r
    assert NEW.pipeline(0) == [6, 2, 7, 0] and NEW.dp_group(3) == [0, 4]


@pytest.mark.parametrize("placement,match", [
    (((0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (0, 3)),
     r"placement puts ranks 6 and 7 both in cell \(dp_rank, pp_rank\)=\(0, 3\)"),
    (((0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, 3)), "placement has 7 cells, the world has 8"),
    (((0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (2, 3)), r"rank 7 is \(2, 3\), not a"),
    (((0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, 3), 7), "rank 7 is 7, not a"),
])
def test_bad_placement_is_refused_in_one_line(placement, match):
    with pytest.raises(ValueError, match=match) as info:
        OLD.with_placement(placement)
    assert "\n" not in str(info.value)


# -- the plan (pure) ---------------------------------------------------------------
def test_plan_spreads_sources_and_skips_kept_stages():
    plan = relayout.plan_transfers(OLD, NEW)
    assert sorted(t.dst for t in plan) == [0, 1, 3, 4, 5, 6, 7]  # rank 2 keeps its stage
    for t in plan:
        assert OLD.coords_of(t.src)[1] == t.pp_rank == NEW.coords_of(t.dst)[1]
    sources = [t.src for t in plan]
    assert len(set(sources)) == len(sources)  # two receivers per stage at most, two holders each
    assert next(t.src for t in plan if t.dst == 1) == 2  # the holder that is not receiving
    assert relayout.plan_transfers(OLD, OLD) == []
    dp_swap = OLD.with_placement(((1, 0), (0, 0)) + OLD.cells[2:])
    assert relayout.plan_transfers(OLD, dp_swap) == []  # a replica swap moves no state
    with pytest.raises(ValueError, match="relayout keeps the grid"):
        relayout.plan_transfers(OLD, ParallelLayout(dp=4, pp=2, world_size=8))


def test_plan_load_is_balanced_when_a_stage_has_more_receivers_than_holders():
    old = ParallelLayout(dp=3, pp=2, world_size=6)  # stage 0: 0, 1, 2; stage 1: 3, 4, 5
    new = old.with_placement(((0, 1), (1, 1), (2, 1), (0, 0), (1, 0), (2, 0)))
    plan = relayout.plan_transfers(old, new)
    assert len(plan) == 6
    assert max(sum(t.src == r for t in plan) for r in range(6)) == 1


# -- the world test ------------------------------------------------------------------
def _build(layout: ParallelLayout, rank: int, groups: list) -> train._Stage:
    """This rank's stage under ``layout``, as the job builds it."""
    return train._build_stage(CFG, MODEL, rank, layout, split_layers(MODEL.num_layers, PP), torch.device("cpu"),
                              groups)


def _state(stage: train._Stage) -> dict:
    return checkpoint.stage_state(pp_rank=stage.pp_rank, layers=stage.layers, module=stage.ctx.module,
                                optimizer=stage.optimizer)


def _steps(stage: train._Stage, data: SyntheticData, steps: range) -> dict[int, float]:
    """Train ``steps``; the loss of each, on the rank that holds cell (0, last stage)."""
    losses = {}
    for step in steps:
        tokens = train._train_step(stage, data, step, CFG.microbatch_split, NO_RECORDER, dp=DP)
        if stage.last and stage.dp_rank == 0:
            losses[step] = stage.grads.loss_sum / tokens
    return losses


def _worker(rank: int, out: Path) -> None:
    """Train, keep a snapshot, train on (the unmoved reference), then move the snapshot
    to the new placement and train the same steps again."""
    data = SyntheticData(DATA, vocab_size=MODEL.vocab_size, seed=CFG.seed)
    groups = relayout.rebuild_groups(OLD)
    stage = _build(OLD, rank, groups)
    before = _steps(stage, data, range(STEPS_BEFORE))
    snapshot = copy.deepcopy(_state(stage))
    torch.save(snapshot, out / f"old-{rank}.pt")
    after = range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)
    unmoved = _steps(stage, data, after)

    moved = relayout.move_stages(OLD, NEW, snapshot, rank=rank)
    t0 = time.perf_counter()
    groups = relayout.rebuild_groups(NEW, old_groups=groups)
    groups_seconds = time.perf_counter() - t0
    stage = _build(NEW, rank, groups)
    checkpoint.load_stage_state(moved.state, pp_rank=stage.pp_rank, layers=stage.layers, module=stage.ctx.module,
                                optimizer=stage.optimizer, source=f"rank {rank}'s move")
    torch.save(_state(stage), out / f"new-{rank}.pt")
    moved_losses = _steps(stage, data, after)
    (out / f"rank-{rank}.json").write_text(json.dumps({
        "before": before, "unmoved": unmoved, "moved": moved_losses, "seconds": moved.seconds,
        "groups_seconds": groups_seconds,
        "bytes_sent": moved.bytes_sent, "bytes_received": moved.bytes_received}))


def _child(rank: int, world: int, port: int, out: str) -> None:
    fd = os.open(os.path.join(out, f"rank-{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 0
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=90))
        try:
            _worker(rank, Path(out))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - any failure is reported in the rank's log and exit code
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_world(out: Path, nproc: int, timeout_s: float = 150.0) -> list[int | None]:
    """Run :func:`_worker` on ``nproc`` forked ranks; on a failure or the timeout the
    others are killed (as forklaunch.run_local does for the whole job)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "hybrid.train"])
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, nproc, port, str(out))) for r in range(nproc)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    for p in procs:
        p.join()
    return [p.exitcode for p in procs]


def _assert_bit_equal(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            _assert_bit_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bit_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def moved_world(tmp_path_factory):
    out = tmp_path_factory.mktemp("relayout")
    codes = _run_world(out, DP * PP)
    if codes != [0] * (DP * PP):
        logs = "\n".join(f"--- rank {r}\n" + (out / f"rank-{r}.log").read_text()[-2000:] for r in range(DP * PP))
        pytest.fail(f"ranks exited {codes}\n{logs}")
    return out, [json.loads((out / f"rank-{r}.json").read_text()) for r in range(DP * PP)]


def test_moved_stages_are_bit_identical(moved_world):
    out, results = moved_world
    old = [torch.load(out / f"old-{r}.pt", weights_only=True) for r in range(8)]
    for r in range(8):
        stage = NEW.coords_of(r)[1]
        new = torch.load(out / f"new-{r}.pt", weights_only=True)
        assert new["pp_rank"] == stage and new["optimizer"]["state"], f"rank {r}: no optimizer state"
        for holder in OLD.dp_group(stage):  # the replicas were identical; each equals the move
            _assert_bit_equal(new, old[holder], f"rank {r} (stage {stage}) vs old holder {holder}")
    assert results[2]["bytes_received"] == 0  # rank 2 kept its stage
    assert all(res["bytes_received"] > 0 for r, res in enumerate(results) if r != 2)
    assert sum(res["bytes_sent"] for res in results) == sum(res["bytes_received"] for res in results)


def test_losses_after_the_move_equal_the_unmoved_run(moved_world):
    _, results = moved_world
    unmoved = {int(k): v for res in results for k, v in res["unmoved"].items()}
    moved = {int(k): v for res in results for k, v in res["moved"].items()}
    assert sorted(moved) == sorted(unmoved) == list(range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    assert results[6]["before"] and results[0]["moved"]  # cell (0, 3) moved from rank 6 to rank 0
    for step, loss in unmoved.items():
        assert math.isfinite(loss) and abs(moved[step] - loss) <= 1e-6, (step, moved[step], loss)
    seconds = max(res["seconds"] for res in results)
    groups_seconds = max(res["groups_seconds"] for res in results)
    moved_bytes = sum(res["bytes_received"] for res in results)
    worst = max(abs(moved[s] - unmoved[s]) for s in unmoved)
    print(f"relayout: {moved_bytes} bytes moved in {seconds:.3f} s, groups rebuilt in {groups_seconds:.3f} s "
          f"(slowest rank); largest loss difference {worst:.3g}")


# -- the job itself, moved by a plan on its Redis --------------------------------------
JOB_ARGS = ["--dp", "2", "--pp", "4", "--steps", "12", "--seed", "3", "--layers", "4", "--dim", "32",
            "--heads", "2", "--vocab", "64", "--seq-len", "32", "--min-seq-len", "4", "--microbatch-size", "2",
            "--lr", "1e-2", "--microbatch-split", "8,8"]


def _job_losses(path: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), steps          # every step once, in order
    return {r["step"]: r["loss"] for r in rows}


def _plan_when_trained(client, metrics: Path, placement, *, after_step: int, stop) -> None:
    """The master's part: publish the placement once the job has done ``after_step`` steps."""
    from greyhound.control import store

    while not stop.is_set():
        if metrics.exists() and any(json.loads(line)["step"] >= after_step
                                    for line in metrics.read_text().splitlines() if line.strip()):
            client.set(store.PLAN, json.dumps({"version": 1, "microbatch_split": [8, 8], "level": "S3",
                                               "placement": [list(c) for c in placement]}))
            return
        time.sleep(0.05)


def test_the_job_moved_by_a_placement_plan_learns_what_the_unmoved_job_learns(tmp_path):
    import shutil
    import threading

    from greyhound.control import store
    from greyhound.control.redis_server import start_redis, stop_redis
    from hybrid.forklaunch import run_local

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed: run scripts/setup")
    for name in ("logs-unmoved", "logs-moved", "run"):
        (tmp_path / name).mkdir()
    codes = run_local(JOB_ARGS + ["--metrics", str(tmp_path / "unmoved.jsonl")], nproc=8, timeout_s=180,
                      log_dir=str(tmp_path / "logs-unmoved"))
    assert codes == [0] * 8
    run_dir = tmp_path / "run"
    proc, address = start_redis(run_dir, host="127.0.0.1")
    client = address.client()
    stop = threading.Event()
    # The metrics writer (cell (0, 3), rank 6 before) moves to rank 0.
    planner = threading.Thread(target=_plan_when_trained, daemon=True,
                               args=(client, tmp_path / "moved.jsonl", NEW.cells),
                               kwargs={"after_step": 3, "stop": stop})
    planner.start()
    try:
        codes = run_local(JOB_ARGS + ["--metrics", str(tmp_path / "moved.jsonl")], nproc=8, timeout_s=180,
                          log_dir=str(tmp_path / "logs-moved"),
                          env={"GREYHOUND_MODE": "mitigate", "GREYHOUND_RUN_DIR": str(run_dir)})
        relaid = json.loads(client.get(store.TRAINING_RELAID) or "null")
        applied = json.loads(client.get(store.TRAINING_APPLIED) or "null")
    finally:
        stop.set()
        stop_redis(proc)
    assert codes == [0] * 8, (tmp_path / "logs-moved" / "rank-0.log").read_text()[-3000:]
    assert relaid is not None and applied is not None
    assert 4 <= relaid["step"] == applied["step"] < 12 and relaid["version"] == 1
    assert applied["placement"] == [list(c) for c in NEW.cells]
    assert relaid["bytes"] > 0 and relaid["pause_s"] > 0
    unmoved, moved = _job_losses(tmp_path / "unmoved.jsonl"), _job_losses(tmp_path / "moved.jsonl")
    assert list(moved) == list(unmoved) == list(range(12))
    assert max(abs(moved[s] - unmoved[s]) for s in unmoved) <= 1e-6, (moved, unmoved)
