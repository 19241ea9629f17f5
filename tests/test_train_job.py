"""Acceptance tests of the reference DP x PP training job (examples/gpt_hybrid.py).

Real multi-rank runs on 127.0.0.1 with gloo, no Slurm: the ranks are forked from a
multiprocessing fork server (examples/hybrid/forklaunch.py) to save the torch import per
rank, and one test goes through torchrun itself.  The live-cluster test under sbatch /
srun is the integrator's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

from hybrid.config import DataConfig  # noqa: E402
from hybrid.data import SyntheticData  # noqa: E402
from hybrid.forklaunch import run_local  # noqa: E402
from hybrid.layout import ParallelLayout  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 6
# Tiny model: 4 blocks (one per stage), short samples; the job's defaults otherwise.
BASE = ["--pp", "4", "--steps", str(STEPS), "--seed", "3", "--layers", "4", "--dim", "32", "--heads", "2",
        "--vocab", "64", "--seq-len", "32", "--min-seq-len", "4", "--microbatch-size", "2", "--lr", "1e-2"]


def _losses(path: Path) -> dict[int, float]:
    """step -> loss; every step once and in order (a resumed job drops the rows of the
    steps after its checkpoint that the killed run logged)."""
    out = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        assert set(row) >= {"step", "loss", "step_time"}
        assert row["step"] not in out and all(row["step"] > s for s in out), (path, row)
        out[row["step"]] = row["loss"]
    return out


def _run(tmp: Path, name: str, args: list[str], nproc: int = 8) -> list[int]:
    logs = tmp / f"logs-{name}"
    logs.mkdir(exist_ok=True)
    codes = run_local(BASE + args, nproc=nproc, timeout_s=180, log_dir=str(logs))
    if name != "crash":
        assert codes == [0] * nproc, (codes, (logs / "rank-0.log").read_text()[-3000:])
    return codes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every multi-rank run of this file, once: name -> (exit codes, work dir)."""
    tmp = tmp_path_factory.mktemp("train")
    out = {}
    out["even"] = _run(tmp, "even", ["--dp", "2", "--microbatch-split", "8,8", "--metrics", str(tmp / "even.jsonl"),
                                     "--trace", str(tmp / "trace"), "--trace-every", "2"])
    out["uneven"] = _run(tmp, "uneven", ["--dp", "2", "--microbatch-split", "4,12",
                                         "--metrics", str(tmp / "uneven.jsonl")])
    out["odd"] = _run(tmp, "odd", ["--dp", "2", "--microbatch-split", "5,11", "--metrics", str(tmp / "odd.jsonl")])
    ckpt = ["--dp", "2", "--microbatch-split", "8,8", "--checkpoint", str(tmp / "ckpt"),
            "--checkpoint-every", "3", "--metrics", str(tmp / "resumed.jsonl"),
            "--trace", str(tmp / "trace-resumed"), "--trace-every", "2"]
    out["crash"] = _run(tmp, "crash", ckpt + ["--crash-at-step", "4"])
    # A copy of the step-3 checkpoint, resumed on half the ranks (greyhound's S4 requeue
    # without a node): DP=1, the same global batch of 16 micro-batches.
    (tmp / "ckpt-dp1").mkdir()
    shutil.copytree(tmp / "ckpt" / "step-000003", tmp / "ckpt-dp1" / "step-000003")
    (tmp / "ckpt-dp1" / "latest").write_text("step-000003\n")
    out["resume_dp1"] = _run(tmp, "resume_dp1", ["--dp", "1", "--global-microbatches", "16", "--resume",
                                                 "--checkpoint", str(tmp / "ckpt-dp1"),
                                                 "--metrics", str(tmp / "resumed-dp1.jsonl")], nproc=4)
    out["resume"] = _run(tmp, "resume", ckpt + ["--resume"])
    return out, tmp


def test_dp2_pp4_trains_and_loss_goes_down(runs):
    _, tmp = runs
    loss = _losses(tmp / "even.jsonl")
    assert sorted(loss) == list(range(STEPS))
    values = [loss[s] for s in range(STEPS)]
    assert all(np.isfinite(values))
    assert values[0] == pytest.approx(np.log(64), abs=0.15)  # starts near uniform guessing
    assert np.mean(values[-2:]) < np.mean(values[:2]) - 0.1, values


def test_golden_loss_curve(runs):
    """The even run reproduces the recorded loss curve (tests/assets/losses/): a guard
    against unintended changes of the model, data, schedule or optimizer.  The tolerance
    allows other CPUs' float32 kernels, not a change of what is computed."""
    _, tmp = runs
    golden = json.loads((ROOT / "tests" / "assets" / "losses" / "gpt_hybrid_dp2_pp4.json").read_text())
    assert golden["args"] == BASE + ["--dp", "2", "--microbatch-split", "8,8"]
    loss = _losses(tmp / "even.jsonl")
    np.testing.assert_allclose([loss[s] for s in range(STEPS)], golden["losses"], rtol=0, atol=1e-4)


def test_uneven_splits_learn_the_same_as_even(runs):
    _, tmp = runs
    even = _losses(tmp / "even.jsonl")
    for name in ("uneven", "odd"):  # (4, 12), and (5, 11): not a multiple of PP
        other = _losses(tmp / f"{name}.jsonl")
        assert sorted(other) == sorted(even)
        for step in even:
            assert abs(other[step] - even[step]) <= 1e-6, (name, step, other[step], even[step])


def test_checkpoint_kill_resume_matches_uninterrupted(runs):
    codes, tmp = runs
    assert codes["crash"][0] == -9  # rank 0 SIGKILLed itself at step 4; the rest were stopped
    assert all(c != 0 for c in codes["crash"])
    assert (tmp / "ckpt" / "latest").read_text().strip() == f"step-{STEPS:06d}"
    assert (tmp / "ckpt" / "step-000003").is_dir()
    even = _losses(tmp / "even.jsonl")
    resumed = _losses(tmp / "resumed.jsonl")
    assert sorted(resumed) == list(range(STEPS))
    for step in range(STEPS):
        assert abs(resumed[step] - even[step]) <= 1e-6, (step, resumed[step], even[step])


def test_resume_on_fewer_dp_replicas_matches(runs):
    _, tmp = runs
    even = _losses(tmp / "even.jsonl")
    resumed = _losses(tmp / "resumed-dp1.jsonl")
    assert sorted(resumed) == [3, 4, 5]
    for step in resumed:
        assert abs(resumed[step] - even[step]) <= 1e-6, (step, resumed[step], even[step])


def _by_key(ops, mask, names):
    return [tuple(int(ops[n][i]) for n in names) for i in np.flatnonzero(mask)]


def test_merged_trace_is_consistent(runs):
    from postmortem.schema import OPTYPE_CODE, read_trace

    _, tmp = runs
    trace = read_trace(tmp / "trace" / "trace.h5")
    meta = trace.meta
    assert (meta.dp, meta.pp, meta.tp, meta.num_microbatches, meta.schedule) == (2, 4, 1, 16, "1F1B")
    assert meta.microbatches_per_dp is None  # 8, 8 is even
    layout = ParallelLayout(dp=2, pp=4, world_size=8)
    w = trace.workers
    assert sorted(w["rank"].tolist()) == list(range(8))
    for r, d, p in zip(w["rank"], w["dp_rank"], w["pp_rank"]):
        assert layout.coords_of(int(r)) == (int(d), int(p))
    assert set(w["device"]) == {"cpu"}

    ops = trace.ops
    code = OPTYPE_CODE
    assert sorted(set(ops["step"].tolist())) == [1, 3, 5]  # every 2nd step: (s + 1) % 2 == 0
    assert np.all(np.isfinite(ops["start"])) and np.all(ops["duration"] >= 0)
    key = ("step", "dp_rank", "pp_rank")
    cells = Counter(_by_key(ops, np.ones(trace.num_ops, bool), key))
    assert len(cells) == 3 * 8
    for name in ("grads-all-reduce", "optimizer"):
        per_cell = Counter(_by_key(ops, ops["optype"] == code[name], key))
        assert set(per_cell) == set(cells) and set(per_cell.values()) == {1}, name
    for name in ("forward-compute", "backward-compute"):
        got = sorted(_by_key(ops, ops["optype"] == code[name], key + ("microbatch",)))
        assert got == sorted((s, d, p, mb) for s, d, p in cells for mb in range(8)), name

    # Every p2p send has exactly one receive on the neighbouring stage, and vice versa.
    full = key + ("microbatch",)
    fsend = Counter(_by_key(ops, ops["optype"] == code["forward-send"], full))
    frecv = Counter((s, d, p - 1, mb) for s, d, p, mb in _by_key(ops, ops["optype"] == code["forward-recv"], full))
    bsend = Counter(_by_key(ops, ops["optype"] == code["backward-send"], full))
    brecv = Counter((s, d, p + 1, mb) for s, d, p, mb in _by_key(ops, ops["optype"] == code["backward-recv"], full))
    assert fsend == frecv and bsend == brecv
    assert set(fsend.values()) == {1} and set(bsend.values()) == {1}
    assert len(fsend) == 3 * 2 * 3 * 8 and len(bsend) == 3 * 2 * 3 * 8  # steps x dp x links x mbs
    # One clock: a receive cannot end before its send started.
    index = {}
    for i in np.flatnonzero(np.isin(ops["optype"], [code[n] for n in ("forward-send", "backward-send")])):
        index[(int(ops["optype"][i]), *(int(ops[n][i]) for n in full))] = i
    for i in np.flatnonzero(ops["optype"] == code["forward-recv"]):
        s, d, p, mb = (int(ops[n][i]) for n in full)
        j = index[(code["forward-send"], s, d, p - 1, mb)]
        assert ops["start"][i] + ops["duration"][i] >= ops["start"][j]

    # Sequence lengths: one row per (step, dp, micro-batch), equal to what the data made.
    sl = trace.seqlens
    data = SyntheticData(DataConfig(microbatch_size=2, seq_len=32, min_seq_len=4), vocab_size=64, seed=3)
    assert len(sl["step"]) == 3 * 16
    for i in range(len(sl["step"])):
        s, d, mb = int(sl["step"][i]), int(sl["dp_rank"][i]), int(sl["microbatch"][i])
        lengths = sl["lengths"][sl["offsets"][i]:sl["offsets"][i + 1]]
        np.testing.assert_array_equal(lengths, data.lengths(s, 8 * d + mb))


def test_resumed_trace_keeps_every_sampled_step(runs):
    from postmortem.schema import read_trace

    _, tmp = runs
    trace = read_trace(tmp / "trace-resumed" / "trace.h5")
    assert sorted(set(trace.ops["step"].tolist())) == [1, 3, 5]
    assert np.all(trace.ops["duration"] >= 0)


def test_torchrun_launch_matches_forked_run(tmp_path):
    """The real launcher (env:// variables from torchrun) on 4 ranks, DP=2 x PP=2 with a
    (1, 3) split, learns exactly what DP=1 x PP=2 learns from the same 4 micro-batches."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed beside this python")
    args = ["--pp", "2", "--steps", "3", "--seed", "5", "--layers", "2", "--dim", "32", "--heads", "2",
            "--vocab", "64", "--seq-len", "16", "--microbatch-size", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "4", str(EXAMPLES / "gpt_hybrid.py"),
                           *args, "--dp", "2", "--microbatch-split", "1,3", "--metrics", str(tmp_path / "a.jsonl")],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = run_local(args + ["--dp", "1", "--global-microbatches", "4", "--metrics", str(tmp_path / "b.jsonl")],
                      nproc=2, timeout_s=120)
    assert codes == [0, 0]
    a, b = _losses(tmp_path / "a.jsonl"), _losses(tmp_path / "b.jsonl")
    assert sorted(a) == sorted(b) == [0, 1, 2]
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-6


def test_resume_without_a_checkpoint_starts_afresh(tmp_path):
    """A requeued job passes --resume every time; the first time there is nothing yet."""
    args = ["--dp", "1", "--pp", "1", "--steps", "2", "--layers", "1", "--dim", "16", "--heads", "2",
            "--vocab", "32", "--seq-len", "8", "--global-microbatches", "2"]
    codes = run_local(args + ["--checkpoint", str(tmp_path / "ck"), "--resume",
                              "--metrics", str(tmp_path / "m.jsonl")], nproc=1, timeout_s=120)
    assert codes == [0]
    assert sorted(_losses(tmp_path / "m.jsonl")) == [0, 1]
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-000002"
