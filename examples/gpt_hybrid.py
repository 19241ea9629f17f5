#!/usr/bin/env python3
"""Reference hybrid-parallel training job: a GPT-style decoder, DP x PP, 1F1B.

Runs with gloo on CPUs and NCCL on GPUs, under torchrun or under srun:

    torchrun --standalone --nproc-per-node 8 examples/gpt_hybrid.py --dp 2 --pp 4 --steps 20
    srun --ntasks 8 python examples/gpt_hybrid.py --dp 2 --pp 4 --microbatch-split 4,12

Every DP replica runs its own pipeline over its share of the global batch (the micro-
batch split may be uneven); each stage's replicas then all-reduce their gradients in one
call and step AdamW.  Gradients are weighted by each micro-batch's share of the global
batch's tokens and summed in float64, so any split of the same global batch learns the
same model.  --trace DIR records a timeline of sampled steps (greyhound.timeline) and
merges it into DIR/trace.h5 at the end.

Exit status: 0 on success, 2 on bad input (one line on stderr), 1 on a runtime failure.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hybrid.config import (
    BACKENDS,
    RANK_ORDERS,
    SEQLEN_DISTRIBUTIONS,
    DataConfig,
    ModelConfig,
    TrainConfig,
    parse_split,
    resolve_split,
)

PROG = "gpt_hybrid"


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise _ArgError(message)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="GPT-style decoder trained with DP x PP (1F1B) on torch.distributed.")
    par = p.add_argument_group("parallelism")
    par.add_argument("--dp", type=int, required=True, help="data-parallel degree")
    par.add_argument("--pp", type=int, required=True, help="pipeline-parallel degree (stages)")
    par.add_argument("--rank-order", choices=RANK_ORDERS, default="dp-fast",
                     help="dp-fast: consecutive ranks are a stage's DP replicas (Megatron); "
                          "pp-fast: consecutive ranks are a replica's stages")
    par.add_argument("--backend", choices=BACKENDS, default="auto", help="auto: nccl with CUDA, else gloo")
    par.add_argument("--threads", type=int, default=1, help="CPU intra-op threads per rank")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--global-microbatches", type=int, default=None, metavar="M",
                       help="micro-batches per step, split evenly over the DP replicas (default 2*pp each)")
    batch.add_argument("--microbatch-split", type=str, default=None, metavar="m0,m1,...",
                       help="micro-batches per step of each DP replica (uneven allowed)")
    par.add_argument("--microbatch-multiple", type=int, default=1, metavar="P",
                     help="under greyhound's plans every replica's micro-batches stay a multiple of P "
                          "(the paper's 1F1B constraint: P = pp)")
    tr = p.add_argument_group("training")
    tr.add_argument("--steps", type=int, default=20, help="train until this many steps are done")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--lr", type=float, default=3e-3)
    tr.add_argument("--grad-accum-dtype", choices=("float64", "float32"), default="float64",
                    help="dtype of gradient accumulation and all-reduce")
    mod = p.add_argument_group("model")
    mod.add_argument("--layers", type=int, default=8)
    mod.add_argument("--dim", type=int, default=64)
    mod.add_argument("--heads", type=int, default=4)
    mod.add_argument("--vocab", type=int, default=128)
    mod.add_argument("--max-seq-len", type=int, default=None, help="position embeddings (default --seq-len)")
    mod.add_argument("--stage-layers", type=_int_list, default=None, metavar="l0,l1,...",
                     help="blocks per stage (default: as even as possible)")
    dat = p.add_argument_group("data")
    dat.add_argument("--microbatch-size", type=int, default=4, help="sequences per micro-batch")
    dat.add_argument("--seq-len", type=int, default=64, help="longest sample")
    dat.add_argument("--min-seq-len", type=int, default=8, help="shortest sample")
    dat.add_argument("--seqlen-dist", choices=SEQLEN_DISTRIBUTIONS, default="uniform")
    dat.add_argument("--seqlen-sigma", type=float, default=0.8, help="lognormal spread")
    out = p.add_argument_group("output")
    out.add_argument("--metrics", metavar="FILE", default=None, help="JSON lines {step, loss, step_time, tokens, time}")
    out.add_argument("--trace", metavar="DIR", default=None, help="timeline trace dir (merged to DIR/trace.h5)")
    out.add_argument("--trace-every", type=int, default=10, help="record every n-th step")
    out.add_argument("--job-id", default=None, help="job id for the trace (default SLURM_JOB_ID)")
    ck = p.add_argument_group("checkpoints")
    ck.add_argument("--checkpoint", metavar="DIR", default=None, help="checkpoint dir")
    ck.add_argument("--checkpoint-every", type=int, default=0, help="save every n steps (0: at the end)")
    ck.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in DIR")
    ck.add_argument("--crash-at-step", type=int, default=None, help=argparse.SUPPRESS)
    return p


def configs_from_args(argv: list[str] | None = None) -> tuple[TrainConfig, ModelConfig, DataConfig]:
    """Parse the command line into the run's configs (ValueError / _ArgError on bad input)."""
    a = build_parser().parse_args(argv)
    split = parse_split(a.microbatch_split) if a.microbatch_split is not None else None
    if a.global_microbatches is not None and a.global_microbatches < 1:
        raise ValueError(f"--global-microbatches must be >= 1, got {a.global_microbatches}")
    if a.dp < 1 or a.pp < 1:
        raise ValueError(f"--dp and --pp must be >= 1, got --dp={a.dp} --pp={a.pp}")
    model = ModelConfig(num_layers=a.layers, dim=a.dim, num_heads=a.heads, vocab_size=a.vocab,
                        max_seq_len=a.max_seq_len or a.seq_len)
    data = DataConfig(microbatch_size=a.microbatch_size, seq_len=a.seq_len, min_seq_len=a.min_seq_len,
                      seqlen_dist=a.seqlen_dist, seqlen_sigma=a.seqlen_sigma)
    train = TrainConfig(
        dp=a.dp, pp=a.pp,
        microbatch_split=resolve_split(dp=a.dp, pp=a.pp, global_microbatches=a.global_microbatches,
                                       microbatch_split=split),
        microbatch_multiple=a.microbatch_multiple,
        steps=a.steps, seed=a.seed, lr=a.lr, stage_layers=a.stage_layers, rank_order=a.rank_order,
        grad_accum_float64=a.grad_accum_dtype == "float64", backend=a.backend, threads=a.threads,
        metrics=a.metrics, trace_dir=a.trace, trace_every=a.trace_every, checkpoint_dir=a.checkpoint,
        checkpoint_every=a.checkpoint_every, resume=a.resume, crash_at_step=a.crash_at_step, job_id=a.job_id,
    )
    if data.seq_len > model.max_seq_len:
        raise ValueError(f"--seq-len={data.seq_len} exceeds --max-seq-len={model.max_seq_len}")
    from hybrid.layout import split_layers

    split_layers(model.num_layers, train.pp, train.stage_layers)
    return train, model, data


def _is_rank0() -> bool:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def main(argv: list[str] | None = None) -> int:
    try:
        train_cfg, model_cfg, data_cfg = configs_from_args(argv)
    except (_ArgError, ValueError) as exc:
        if _is_rank0():
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format=f"{PROG}: %(message)s")
    from hybrid.launch import LaunchError, detect
    from hybrid.layout import ParallelLayout

    try:
        penv = detect()
        ParallelLayout(dp=train_cfg.dp, pp=train_cfg.pp, world_size=penv.world_size,
                       rank_order=train_cfg.rank_order)
    except ValueError as exc:
        if _is_rank0():
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    # torch is imported only now: a bad command line is reported in milliseconds.
    from greyhound.errors import GreyhoundError
    from hybrid.checkpoint import CheckpointError
    from hybrid.config import UsageError
    from hybrid.train import train

    try:
        train(train_cfg, model_cfg, data_cfg, penv)
    except UsageError as exc:  # e.g. --backend nccl without CUDA
        if _is_rank0():
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except (CheckpointError, GreyhoundError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
