"""Unit tests of the reference training job's parts (one process, no process group)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

from hybrid.config import (DataConfig, ModelConfig, TrainConfig, first_microbatch, parse_split,  # noqa: E402
                           resolve_split)
from hybrid.data import IGNORE_INDEX, SyntheticData  # noqa: E402
from hybrid.grads import MainGrads  # noqa: E402
from hybrid.launch import LaunchError, detect  # noqa: E402
from hybrid.layout import ParallelLayout, split_layers  # noqa: E402
from hybrid.model import GPTStage, token_loss_sum  # noqa: E402
from hybrid.schedule import StageContext, run_1f1b  # noqa: E402


# -- configuration -------------------------------------------------------------------
def test_resolve_split():
    assert resolve_split(dp=2, pp=4, global_microbatches=None, microbatch_split=None) == (8, 8)
    assert resolve_split(dp=2, pp=4, global_microbatches=6, microbatch_split=None) == (3, 3)
    assert resolve_split(dp=2, pp=4, global_microbatches=None, microbatch_split=(4, 12)) == (4, 12)
    with pytest.raises(ValueError, match="multiple of --dp=2"):
        resolve_split(dp=2, pp=4, global_microbatches=7, microbatch_split=None)
    with pytest.raises(ValueError, match="has 3 entries, --dp is 2"):
        resolve_split(dp=2, pp=4, global_microbatches=None, microbatch_split=(1, 2, 3))
    with pytest.raises(ValueError, match=">= 1"):
        resolve_split(dp=2, pp=4, global_microbatches=None, microbatch_split=(0, 16))
    assert parse_split("4, 12") == (4, 12)
    with pytest.raises(ValueError, match="integers separated by commas"):
        parse_split("4;12")


def test_train_config_checks():
    cfg = TrainConfig(dp=2, pp=4, microbatch_split=(4, 12))
    assert cfg.num_microbatches == 16
    assert [first_microbatch(cfg.microbatch_split, d) for d in range(2)] == [0, 4]
    with pytest.raises(ValueError, match="need --checkpoint"):
        TrainConfig(dp=1, pp=1, microbatch_split=(2,), resume=True)
    with pytest.raises(ValueError, match="--crash-at-step must be in 0..4"):
        TrainConfig(dp=1, pp=1, microbatch_split=(2,), steps=5, crash_at_step=5)
    with pytest.raises(ValueError, match="must divide dim"):
        ModelConfig(dim=10, num_heads=4)


# -- layout --------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["dp-fast", "pp-fast"])
@pytest.mark.parametrize("dp,pp", [(1, 1), (2, 4), (3, 2), (4, 1)])
def test_layout_is_a_bijection(order, dp, pp):
    lay = ParallelLayout(dp=dp, pp=pp, world_size=dp * pp, rank_order=order)
    seen = {lay.rank_of(dp_rank=d, pp_rank=p) for d in range(dp) for p in range(pp)}
    assert seen == set(range(dp * pp))
    for r in range(dp * pp):
        d, p = lay.coords_of(r)
        assert lay.rank_of(dp_rank=d, pp_rank=p) == r
        assert r in lay.dp_group(p) and r in lay.pipeline(d)


def test_layout_orders_and_world_size():
    assert ParallelLayout(dp=2, pp=4, world_size=8).dp_group(1) == [2, 3]  # Megatron: DP adjacent
    assert ParallelLayout(dp=2, pp=4, world_size=8, rank_order="pp-fast").pipeline(1) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="world size 6 != dp 2 x pp 4"):
        ParallelLayout(dp=2, pp=4, world_size=6)


def test_split_layers():
    assert split_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert split_layers(6, 2, (1, 5)) == [range(0, 1), range(1, 6)]
    with pytest.raises(ValueError, match="sum to --layers=6"):
        split_layers(6, 2, (1, 4))
    with pytest.raises(ValueError, match="fewer than --pp"):
        split_layers(2, 4)


# -- data ----------------------------------------------------------------------------
@pytest.mark.parametrize("dist", ["uniform", "fixed", "lognormal", "bimodal"])
def test_data_is_deterministic_and_well_formed(dist):
    cfg = DataConfig(microbatch_size=5, seq_len=24, min_seq_len=3, seqlen_dist=dist)
    a = SyntheticData(cfg, vocab_size=50, seed=7)
    b = SyntheticData(cfg, vocab_size=50, seed=7)
    for step, idx in [(0, 0), (3, 11)]:
        x, y = a.microbatch(step, idx), b.microbatch(step, idx)
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.targets, y.targets)
        assert np.all((x.lengths >= 3) & (x.lengths <= 24))
        if dist == "fixed":
            assert set(x.lengths.tolist()) == {24}
        assert x.tokens.shape == x.targets.shape == (5, x.lengths.max())
        for row, n in enumerate(x.lengths):
            assert np.all(x.targets[row, n:] == IGNORE_INDEX) and np.all(x.tokens[row, n:] == 0)
            # the next-token target is the following input token
            np.testing.assert_array_equal(x.targets[row, : n - 1], x.tokens[row, 1:n])
            assert np.all((x.targets[row, :n] >= 0) & (x.targets[row, :n] < 50))
        assert x.num_tokens == int((x.targets != IGNORE_INDEX).sum())
        shape_only = a.microbatch(step, idx, with_tokens=False)
        np.testing.assert_array_equal(shape_only.lengths, x.lengths)
    other_seed = SyntheticData(cfg, vocab_size=50, seed=8).microbatch(0, 0)
    assert not np.array_equal(other_seed.tokens, a.microbatch(0, 0).tokens)
    assert a.tokens_in_step(2, 4) == sum(a.microbatch(2, i).num_tokens for i in range(4))


def test_variable_lengths_vary():
    data = SyntheticData(DataConfig(microbatch_size=4, seq_len=64, min_seq_len=8), vocab_size=32, seed=0)
    widths = {data.microbatch(0, i, with_tokens=False).seq_len for i in range(20)}
    assert len(widths) > 3


# -- model and schedule -------------------------------------------------------------
def _tiny():
    return ModelConfig(num_layers=4, dim=16, num_heads=2, vocab_size=20, max_seq_len=12)


def test_stages_compose_to_the_whole_model():
    """Per-part seeding: the same blocks give the same function however they are split."""
    torch.manual_seed(0)
    cfg = _tiny()
    tokens = torch.randint(0, cfg.vocab_size, (3, 9))
    whole = GPTStage(cfg, range(4), first=True, last=True, seed=11)
    parts = [GPTStage(cfg, r, first=i == 0, last=i == 2, seed=11)
             for i, r in enumerate(split_layers(4, 3))]
    x = tokens
    for part in parts:
        x = part(x)
    torch.testing.assert_close(x, whole(tokens), rtol=0, atol=1e-6)
    assert sum(p.numel() for m in parts for p in m.parameters()) == sum(p.numel() for p in whole.parameters())


def test_one_stage_1f1b_gives_the_plain_gradient():
    """With PP=1 the schedule is forward+backward per micro-batch; its float64 main grads
    equal the gradient of the token-mean loss over the whole batch."""
    cfg = _tiny()
    data = SyntheticData(DataConfig(microbatch_size=2, seq_len=12, min_seq_len=2), vocab_size=20, seed=1)
    mbs = [data.microbatch(0, i) for i in range(3)]
    total = sum(mb.num_tokens for mb in mbs)
    module = GPTStage(cfg, range(4), first=True, last=True, seed=2)
    grads = MainGrads(module, dtype=torch.float64, with_loss_slot=True)
    ctx = StageContext(module=module, pp_rank=0, pp=1, prev_rank=None, next_rank=None, dim=cfg.dim,
                       device=torch.device("cpu"))
    run_1f1b(ctx, mbs, grads=grads, loss_scale=1.0 / total)

    ref = GPTStage(cfg, range(4), first=True, last=True, seed=2)
    loss = sum(token_loss_sum(ref(torch.from_numpy(mb.tokens)), torch.from_numpy(mb.targets)) for mb in mbs)
    (loss / total).backward()
    for p, view in zip(ref.parameters(), grads.views):
        torch.testing.assert_close(view.float(), p.grad, rtol=1e-5, atol=1e-7)
    assert grads.loss_sum == pytest.approx(float(loss.detach()), rel=1e-6)


def test_main_grads_sum_is_split_independent():
    """float64 accumulation: grouping 16 float32 gradients as 8+8 or 4+12 gives the same
    float32 result (the property the even-vs-uneven acceptance test relies on)."""
    rng = np.random.default_rng(0)
    g = torch.from_numpy(rng.standard_normal((16, 1000)).astype(np.float32)) * 1e-3

    def split_sum(split, dtype):
        parts = []
        start = 0
        for m in split:
            acc = torch.zeros(1000, dtype=dtype)
            for i in range(start, start + m):
                acc += g[i]
            parts.append(acc)
            start += m
        return sum(parts).float()

    assert torch.equal(split_sum((8, 8), torch.float64), split_sum((4, 12), torch.float64))
    assert torch.equal(split_sum((8, 8), torch.float64), split_sum((5, 11), torch.float64))


# -- launch environment --------------------------------------------------------------
def test_detect_torchrun_and_srun_env():
    tr = detect({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h1", "MASTER_PORT": "1234"})
    assert (tr.rank, tr.world_size, tr.local_rank, tr.master_addr, tr.master_port, tr.launcher) == \
        (3, 8, 1, "h1", 1234, "torchrun")
    sr = detect({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "4242",
                 "MASTER_ADDR": "n1", "SLURMD_NODENAME": "n3"})
    assert (sr.rank, sr.world_size, sr.local_rank, sr.master_addr, sr.node, sr.job_id, sr.launcher) == \
        (5, 8, 1, "n1", "n3", "4242", "srun")
    assert sr.master_port == 20000 + 4242  # derived from the job id: two jobs on a node differ
    with pytest.raises(LaunchError, match="SLURM_PROCID='x' is not an integer"):
        detect({"SLURM_PROCID": "x", "SLURM_NTASKS": "8", "MASTER_ADDR": "n1"})
    with pytest.raises(LaunchError, match="export MASTER_ADDR"):
        detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"})
    assert detect({}).launcher == "single"


# -- command line --------------------------------------------------------------------
@pytest.mark.parametrize("args,message", [
    (["--dp", "2", "--pp", "4", "--microbatch-split", "4"], "--microbatch-split has 1 entries, --dp is 2"),
    (["--dp", "two", "--pp", "4"], "argument --dp: invalid int value: 'two'"),
    (["--dp", "2", "--pp", "4", "--global-microbatches", "7"], "must be a positive multiple of --dp=2"),
    (["--dp", "2", "--pp", "4", "--global-microbatches", "8", "--microbatch-split", "4,4"], "not allowed with"),
    (["--dp", "2", "--pp", "4", "--dim", "30", "--heads", "4"], "num_heads=4 must divide dim=30"),
    (["--dp", "2", "--pp", "4", "--resume"], "need --checkpoint"),
    (["--dp", "2", "--pp", "4", "--global-microbatches", "8", "--microbatch-multiple", "3"],
     "--microbatch-multiple=3 must be an integer >= 1 that divides every replica's micro-batches (4, 4)"),
    (["--dp", "1", "--pp", "4"], "world size 1 != dp 1 x pp 4"),
    (["--dp", "1", "--pp", "1", "--seq-len", "80", "--max-seq-len", "64"], "exceeds --max-seq-len=64"),
])
def test_bad_command_line_is_one_line(args, message):
    proc = subprocess.run([sys.executable, str(EXAMPLES / "gpt_hybrid.py"), *args], capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpt_hybrid: error: ") and message in lines[0], proc.stderr
