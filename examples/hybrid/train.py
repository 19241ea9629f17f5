"""The training loop of one rank: data, 1F1B, DP gradient sync, optimizer, checkpoints,
metrics and the timeline."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from greyhound.mitigate.training import Mitigation

from hybrid import checkpoint, relayout
from hybrid.config import DataConfig, ModelConfig, TrainConfig, UsageError, first_microbatch
from hybrid.data import SyntheticData
from hybrid.grads import MainGrads
from hybrid.launch import ProcessEnv
from hybrid.layout import ParallelLayout, split_layers
from hybrid.model import GPTStage
from hybrid.schedule import NO_RECORDER, StageContext, run_1f1b

log = logging.getLogger("gpt_hybrid")

_PG_TIMEOUT = timedelta(minutes=10)


def _backend(name: str) -> str:
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name == "nccl" and not torch.cuda.is_available():
        raise UsageError("--backend nccl needs CUDA, and this torch/machine has none; use gloo")
    return name


def _job_meta(cfg: TrainConfig, model_cfg: ModelConfig, data_cfg: DataConfig, job_id: str | None) -> dict:
    from dataclasses import asdict

    return {
        "dp": cfg.dp,
        "pp": cfg.pp,
        "tp": 1,
        "num_microbatches": cfg.num_microbatches,
        "microbatches_per_dp": list(cfg.microbatch_split),
        "schedule": "1F1B",
        "job_id": job_id,
        "trial_name": "gpt_hybrid",
        "extra": {"model": asdict(model_cfg), "data": asdict(data_cfg), "rank_order": cfg.rank_order,
                  "stage_layers": list(cfg.stage_layers) if cfg.stage_layers else None, "seed": cfg.seed},
    }


def _open_metrics(path: str, *, keep_before: int):
    """Open the metrics file; on a resume keep the rows of the steps before the
    checkpoint and drop those the killed run did after it (they are run again)."""
    kept = []
    if keep_before > 0 and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    if json.loads(line)["step"] < keep_before:
                        kept.append(line if line.endswith("\n") else line + "\n")
                except (ValueError, KeyError, TypeError):
                    continue  # a line torn by the kill
    f = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by the caller
    f.writelines(kept)
    f.flush()
    return f


def train(cfg: TrainConfig, model_cfg: ModelConfig, data_cfg: DataConfig, penv: ProcessEnv) -> list[dict]:
    """Run the job on this rank; returns the metrics rows on the metrics rank, else []."""
    torch.set_num_threads(cfg.threads)
    backend = _backend(cfg.backend)
    layout = ParallelLayout(dp=cfg.dp, pp=cfg.pp, world_size=penv.world_size, rank_order=cfg.rank_order)
    layers_of = split_layers(model_cfg.num_layers, cfg.pp, cfg.stage_layers)
    if data_cfg.seq_len > model_cfg.max_seq_len:
        raise UsageError(f"--seq-len={data_cfg.seq_len} exceeds the model's --max-seq-len={model_cfg.max_seq_len}")
    if backend == "nccl":
        device = torch.device("cuda", penv.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    dist.init_process_group(backend, init_method=f"tcp://{penv.master_addr}:{penv.master_port}",
                            rank=penv.rank, world_size=penv.world_size, timeout=_PG_TIMEOUT)
    try:
        return _run(cfg, model_cfg, data_cfg, penv, layout, layers_of, device)
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True, kw_only=True)
class _Stage:
    """This rank's part of the job: its stage of the model and what trains it."""

    rank: int
    dp_rank: int
    pp_rank: int
    layers: range
    """This stage's block indices in the whole model."""
    ctx: StageContext
    optimizer: torch.optim.Optimizer
    grads: MainGrads
    dp_group: dist.ProcessGroup

    @property
    def first(self) -> bool:
        return self.ctx.first

    @property
    def last(self) -> bool:
        return self.ctx.last


def _build_stage(cfg: TrainConfig, model_cfg: ModelConfig, rank: int, layout: ParallelLayout, layers_of,
                 device: torch.device, dp_groups: list) -> _Stage:
    """This rank's stage under ``layout``, freshly initialised; ``dp_groups``: every
    stage's DP group (relayout.rebuild_groups)."""
    dp_rank, pp_rank = layout.coords_of(rank)
    # NCCL wants the first call on the world group to be collective, not a p2p.
    dist.barrier()
    first, last = pp_rank == 0, pp_rank == cfg.pp - 1
    module = GPTStage(model_cfg, layers_of[pp_rank], first=first, last=last, seed=cfg.seed).to(device)
    pipeline = layout.pipeline(dp_rank)
    ctx = StageContext(module=module, pp_rank=pp_rank, pp=cfg.pp,
                       prev_rank=None if first else pipeline[pp_rank - 1],
                       next_rank=None if last else pipeline[pp_rank + 1],
                       dim=model_cfg.dim, device=device)
    optimizer = torch.optim.AdamW(module.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    grads = MainGrads(module, dtype=torch.float64 if cfg.grad_accum_float64 else torch.float32,
                      with_loss_slot=last)
    return _Stage(rank=rank, dp_rank=dp_rank, pp_rank=pp_rank, layers=layers_of[pp_rank], ctx=ctx,
                  optimizer=optimizer, grads=grads, dp_group=dp_groups[pp_rank])


def _resume(cfg: TrainConfig, stage: _Stage, device: torch.device) -> int:
    """The step to start at: after the latest checkpoint under --resume, else 0."""
    if not cfg.resume:
        return 0
    saved = checkpoint.latest_step(cfg.checkpoint_dir)
    if saved is None:
        if stage.rank == 0:
            log.warning("--resume: no checkpoint in %s yet; starting at step 0", cfg.checkpoint_dir)
        return 0
    checkpoint.load(cfg.checkpoint_dir, step=saved, pp_rank=stage.pp_rank, module=stage.ctx.module,
                    optimizer=stage.optimizer, layers=stage.layers, device=device)
    if stage.rank == 0:
        log.info("resumed from %s after step %d", cfg.checkpoint_dir, saved)
    return saved


def _recorder(cfg: TrainConfig, model_cfg: ModelConfig, data_cfg: DataConfig, penv: ProcessEnv,
              stage: _Stage, device: torch.device):
    """The timeline recorder under --trace, else NO_RECORDER."""
    if not cfg.trace_dir:
        return NO_RECORDER
    from greyhound.timeline import TimelineConfig, TimelineRecorder

    return TimelineRecorder(
        TimelineConfig(trace_dir=cfg.trace_dir, every=cfg.trace_every, append=cfg.resume),
        rank=stage.rank, dp_rank=stage.dp_rank, pp_rank=stage.pp_rank, node=penv.node,
        device=str(device) if device.type == "cuda" else "cpu",
        job=_job_meta(cfg, model_cfg, data_cfg, cfg.job_id or penv.job_id),
        sync=torch.cuda.synchronize if device.type == "cuda" else None,
    )


def _train_step(stage: _Stage, data: SyntheticData, step: int, split: tuple[int, ...], recorder, *,
                dp: int) -> int:
    """One step of this stage: 1F1B over its replica's micro-batches (``split``: each
    replica's count this step), the DP gradient all-reduce and the optimizer step.
    Returns the global batch's token count."""
    m = split[stage.dp_rank]
    first_mb = first_microbatch(split, stage.dp_rank)
    tracing = recorder is not NO_RECORDER
    if tracing:
        recorder.start_step(step, num_microbatches=m)
    total_tokens = data.tokens_in_step(step, sum(split))
    mbs = [data.microbatch(step, first_mb + i, with_tokens=stage.first or stage.last) for i in range(m)]
    if tracing and stage.first:
        for i, mb in enumerate(mbs):
            recorder.seqlens(i, mb.lengths)
    grads = stage.grads
    grads.zero()
    run_1f1b(stage.ctx, mbs, grads=grads, loss_scale=1.0 / total_tokens, recorder=recorder)
    if dp > 1:
        with recorder.span("grads-all-reduce"):
            grads.all_reduce(stage.dp_group)
    with recorder.span("optimizer"):
        grads.apply()
        stage.optimizer.step()
        stage.optimizer.zero_grad(set_to_none=True)
    if tracing:
        recorder.end_step()
    return total_tokens


def _merge_trace(cfg: TrainConfig, penv: ProcessEnv) -> None:
    """Rank 0 merges every rank's timeline file into one trace, once all are complete."""
    dist.barrier()  # every rank's file is complete
    if penv.rank != 0:
        return
    from greyhound.errors import GreyhoundError
    from postmortem.merge import merge_trace_dir

    # The trace is a by-product: a failed merge (e.g. no sampled step) is
    # reported, never turned into a failed training run.
    try:
        path = merge_trace_dir(cfg.trace_dir, job_id=cfg.job_id or penv.job_id)
        log.info("timeline trace: %s", path)
    except GreyhoundError as exc:
        log.warning("timeline trace not merged: %s", exc)


def _stop_recording(recorder, rank: int, step: int):
    """The timeline file of a rank names one (dp_rank, pp_rank) in its header: the
    trace ends at the first move (the post-mortem analyses the steps before it)."""
    if recorder is NO_RECORDER:
        return recorder
    recorder.close()
    if rank == 0:
        log.warning("greyhound S3 moved ranks before step %d: the timeline trace ends there", step)
    return NO_RECORDER


def _hand_over_metrics(cfg: TrainConfig, metrics_file, rank: int, layout: ParallelLayout):
    """The metrics rows are written by the rank that computes the loss, replica 0's last
    stage: after a move, maybe another rank, which appends to the same file."""
    writer = rank == layout.rank_of(dp_rank=0, pp_rank=cfg.pp - 1)
    dist.barrier()            # a new writer opens the file after the old one stopped writing
    if metrics_file is not None and not writer:
        metrics_file.close()
        return None
    if metrics_file is None and writer and cfg.metrics:
        return open(cfg.metrics, "a", encoding="utf-8")   # closed by the caller
    return metrics_file


def _save(cfg: TrainConfig, stage: _Stage, rank: int, *, done: int) -> None:
    """Collective: the checkpoint of the state after ``done`` completed steps."""
    t0 = time.perf_counter()
    checkpoint.save(cfg.checkpoint_dir, step=done, pp_rank=stage.pp_rank, dp_rank=stage.dp_rank,
                    rank=rank, module=stage.ctx.module, optimizer=stage.optimizer, layers=stage.layers)
    if rank == 0:
        log.info("checkpoint after step %d saved in %.3fs", done, time.perf_counter() - t0)


def _relayout(cfg: TrainConfig, model_cfg: ModelConfig, stage: _Stage, layout: ParallelLayout,
              placement, layers_of, device: torch.device, dp_groups: list):
    """S3 at a step boundary (collective): every rank takes its cell of ``placement``;
    the ranks that change stage receive its state from an old holder, in memory, and
    every rank's stage is built anew and loaded, bit for bit (hybrid/relayout.py).
    Returns the new layout, stage and DP groups, and the bytes this rank received."""
    new_layout = layout.with_placement(placement)
    state = checkpoint.stage_state(pp_rank=stage.pp_rank, layers=stage.layers, module=stage.ctx.module,
                                   optimizer=stage.optimizer)
    moved = relayout.move_stages(layout, new_layout, state, rank=stage.rank, device=device)
    dp_groups = relayout.rebuild_groups(new_layout, old_groups=dp_groups)
    new_stage = _build_stage(cfg, model_cfg, stage.rank, new_layout, layers_of, device, dp_groups)
    checkpoint.load_stage_state(moved.state, pp_rank=new_stage.pp_rank, layers=new_stage.layers,
                                module=new_stage.ctx.module, optimizer=new_stage.optimizer,
                                source=f"the state rank {stage.rank} received")
    return new_layout, new_stage, dp_groups, moved.bytes_received


def _run(cfg, model_cfg, data_cfg, penv, layout: ParallelLayout, layers_of, device) -> list[dict]:
    rank = penv.rank
    dp_groups = relayout.rebuild_groups(layout)
    stage = _build_stage(cfg, model_cfg, rank, layout, layers_of, device, dp_groups)
    data = SyntheticData(data_cfg, vocab_size=model_cfg.vocab_size, seed=cfg.seed)
    start_step = _resume(cfg, stage, device)
    recorder = _recorder(cfg, model_cfg, data_cfg, penv, stage, device)
    # Under --greyhound=mitigate the master may move micro-batches between replicas
    # (S2); inert otherwise.
    mitigation = Mitigation.from_env(microbatch_split=cfg.microbatch_split, rank=rank,
                                     replicas=[layout.pipeline(d) for d in range(cfg.dp)],
                                     microbatch_multiple=cfg.microbatch_multiple)

    metrics_rank = layout.rank_of(dp_rank=0, pp_rank=cfg.pp - 1)
    metrics_file = None
    if cfg.metrics and rank == metrics_rank:
        metrics_file = _open_metrics(cfg.metrics, keep_before=start_step)
    rows: list[dict] = []
    try:
        for step in range(start_step, cfg.steps):
            if cfg.crash_at_step == step and rank == 0:
                log.warning("--crash-at-step %d: killing rank 0", step)
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.perf_counter()
            plan = mitigation.step(step)
            if plan.checkpoint:          # S4: greyhound requeues the job once this is saved
                if cfg.checkpoint_dir:
                    _save(cfg, stage, rank, done=step)
                    mitigation.checkpointed(step)
                else:
                    mitigation.checkpointed(None, why="the job has no --checkpoint directory")
            if plan.placement != layout.cells:     # S3: ranks take other cells of the grid
                moved_t0 = time.perf_counter()
                layout, stage, dp_groups, received = _relayout(cfg, model_cfg, stage, layout, plan.placement,
                                                               layers_of, device, dp_groups)
                recorder = _stop_recording(recorder, rank, step)
                metrics_file = _hand_over_metrics(cfg, metrics_file, rank, layout)
                metrics_rank = layout.rank_of(dp_rank=0, pp_rank=cfg.pp - 1)
                moved_bytes = torch.tensor([received], dtype=torch.int64)
                dist.all_reduce(moved_bytes)
                moved_s = time.perf_counter() - moved_t0
                mitigation.relaid_out(step, seconds=moved_s, bytes_moved=int(moved_bytes))
                if rank == 0:
                    log.info("greyhound S3: ranks moved before step %d in %.3fs (%d bytes)", step, moved_s,
                             int(moved_bytes))
            split = plan.microbatch_split
            total_tokens = _train_step(stage, data, step, split, recorder, dp=cfg.dp)
            step_time = time.perf_counter() - t0
            if rank == metrics_rank:
                row = {"step": step, "loss": stage.grads.loss_sum / total_tokens, "step_time": step_time,
                       "tokens": total_tokens, "time": time.time(), "microbatch_split": list(split)}
                rows.append(row)
                log.info("step %d loss %.6f step_time %.3fs", step, row["loss"], step_time)
                if metrics_file is not None:
                    metrics_file.write(json.dumps(row) + "\n")
                    metrics_file.flush()
            done = step + 1
            if cfg.checkpoint_dir and ((cfg.checkpoint_every and done % cfg.checkpoint_every == 0)
                                       or done == cfg.steps):
                _save(cfg, stage, rank, done=done)
    finally:
        if metrics_file is not None:
            metrics_file.close()
        if recorder is not NO_RECORDER:
            recorder.close()

    if cfg.trace_dir:
        _merge_trace(cfg, penv)
    return rows
