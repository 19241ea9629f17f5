"""The run's configuration: frozen keyword-only dataclasses that check themselves."""

from __future__ import annotations

from dataclasses import dataclass

SEQLEN_DISTRIBUTIONS = ("uniform", "fixed", "lognormal", "bimodal")
RANK_ORDERS = ("dp-fast", "pp-fast")


class UsageError(ValueError):
    """A user setting that only turns out wrong at run time (e.g. nccl without CUDA)."""

BACKENDS = ("auto", "gloo", "nccl")


def _positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner}.{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the GPT-style decoder (tiny by default: 8 ranks train on 2 CPU cores)."""

    num_layers: int = 8
    """Transformer blocks, split over the pipeline stages."""
    dim: int = 64
    """Model width (embedding and residual stream)."""
    num_heads: int = 4
    """Attention heads; must divide ``dim``."""
    vocab_size: int = 128
    """Token vocabulary."""
    max_seq_len: int = 64
    """Longest sequence (position embeddings)."""
    mlp_ratio: int = 4
    """MLP hidden width as a multiple of ``dim``."""

    def __post_init__(self) -> None:
        _positive("ModelConfig", num_layers=self.num_layers, dim=self.dim, num_heads=self.num_heads,
                  vocab_size=self.vocab_size, max_seq_len=self.max_seq_len, mlp_ratio=self.mlp_ratio)
        if self.dim % self.num_heads:
            raise ValueError(f"ModelConfig.num_heads={self.num_heads} must divide dim={self.dim}")
        if self.vocab_size < 2:
            raise ValueError(f"ModelConfig.vocab_size must be >= 2, got {self.vocab_size}")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Synthetic token data: a fixed random Markov chain with variable sequence lengths."""

    microbatch_size: int = 4
    """Sequences per micro-batch."""
    seq_len: int = 64
    """Longest sample (tokens fed to the model); at most ModelConfig.max_seq_len."""
    min_seq_len: int = 8
    """Shortest sample."""
    seqlen_dist: str = "uniform"
    """Sample-length distribution: uniform on [min, max], fixed (always max), lognormal
    (median max/4, sigma ``seqlen_sigma``, clipped) or bimodal (90% short, 10% max)."""
    seqlen_sigma: float = 0.8
    """Spread of the lognormal distribution."""

    def __post_init__(self) -> None:
        _positive("DataConfig", microbatch_size=self.microbatch_size, seq_len=self.seq_len,
                  min_seq_len=self.min_seq_len)
        if self.min_seq_len > self.seq_len:
            raise ValueError(f"DataConfig.min_seq_len={self.min_seq_len} exceeds seq_len={self.seq_len}")
        if self.seqlen_dist not in SEQLEN_DISTRIBUTIONS:
            raise ValueError(f"DataConfig.seqlen_dist must be one of {', '.join(SEQLEN_DISTRIBUTIONS)}, "
                             f"got {self.seqlen_dist!r}")
        if not self.seqlen_sigma > 0:
            raise ValueError(f"DataConfig.seqlen_sigma must be > 0, got {self.seqlen_sigma!r}")


def parse_split(text: str) -> tuple[int, ...]:
    """``"4,12"`` -> (4, 12); ValueError naming the bad part."""
    parts = [p.strip() for p in text.split(",")]
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--microbatch-split must be integers separated by commas, got {text!r}") from None
    return values


def resolve_split(*, dp: int, global_microbatches: int | None, microbatch_split: tuple[int, ...] | None,
                  pp: int) -> tuple[int, ...]:
    """Micro-batches per DP replica from either an even total or an explicit split.

    Default (neither given): 2 * pp per replica, enough to fill the 1F1B pipeline.
    """
    if global_microbatches is not None and microbatch_split is not None:
        raise ValueError("give either --global-microbatches or --microbatch-split, not both")
    if microbatch_split is not None:
        if len(microbatch_split) != dp:
            raise ValueError(f"--microbatch-split has {len(microbatch_split)} entries, --dp is {dp}")
        if min(microbatch_split) < 1:
            raise ValueError(f"--microbatch-split entries must be >= 1, got {','.join(map(str, microbatch_split))}")
        return tuple(microbatch_split)
    if global_microbatches is None:
        return (2 * pp,) * dp
    if global_microbatches < dp or global_microbatches % dp:
        raise ValueError(f"--global-microbatches={global_microbatches} must be a positive multiple of --dp={dp}; "
                         "use --microbatch-split for an uneven split")
    return (global_microbatches // dp,) * dp


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run."""

    dp: int
    """Data-parallel degree (replicas)."""
    pp: int
    """Pipeline-parallel degree (stages)."""
    microbatch_split: tuple[int, ...]
    """Micro-batches per step of each DP replica; their sum is the global batch."""
    microbatch_multiple: int = 1
    """Every replica's micro-batches stay a multiple of this under greyhound's plans
    (the paper's 1F1B runs them in blocks of the pipeline depth: pass pp)."""
    steps: int = 20
    """Train until this many steps are done (counting steps restored by --resume)."""
    seed: int = 0
    """Seeds the parameters and the data; equal seeds give equal runs."""
    lr: float = 3e-3
    """AdamW learning rate (constant)."""
    stage_layers: tuple[int, ...] | None = None
    """Blocks per stage; None = as even as possible (earlier stages take the remainder)."""
    rank_order: str = "dp-fast"
    """dp-fast: consecutive ranks are the DP replicas of one stage (Megatron's order, DP
    traffic stays on a node); pp-fast: consecutive ranks are the stages of one replica."""
    grad_accum_float64: bool = True
    """Accumulate and all-reduce gradients in float64, so that any split of the global
    batch sums to the same float32 gradient."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl when CUDA is there, else gloo), gloo, nccl."""
    threads: int = 1
    """Intra-op CPU threads per rank (1 keeps CPU ranks from oversubscribing cores)."""
    metrics: str | None = None
    """JSON-lines file of {step, loss, step_time, tokens, time}, written by one rank."""
    trace_dir: str | None = None
    """Directory for the per-rank timelines; merged into trace.h5 there at the end."""
    trace_every: int = 10
    """Record every n-th step's timeline."""
    checkpoint_dir: str | None = None
    """Directory for checkpoints."""
    checkpoint_every: int = 0
    """Save every n steps (0: only at the end, when checkpoint_dir is set)."""
    resume: bool = False
    """Restart from the latest checkpoint in checkpoint_dir."""
    crash_at_step: int | None = None
    """Fault injection for tests: global rank 0 SIGKILLs itself when this step begins."""
    job_id: str | None = None
    """Job id for the trace (default: SLURM_JOB_ID)."""

    def __post_init__(self) -> None:
        _positive("TrainConfig", dp=self.dp, pp=self.pp, steps=self.steps, trace_every=self.trace_every,
                  threads=self.threads)
        if len(self.microbatch_split) != self.dp or min(self.microbatch_split) < 1:
            raise ValueError(f"TrainConfig.microbatch_split must have dp={self.dp} entries >= 1, "
                             f"got {self.microbatch_split}")
        if not isinstance(self.microbatch_multiple, int) or self.microbatch_multiple < 1 or \
                any(m % self.microbatch_multiple for m in self.microbatch_split):
            raise ValueError(f"--microbatch-multiple={self.microbatch_multiple} must be an integer >= 1 that "
                             f"divides every replica's micro-batches {self.microbatch_split}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"--seed must be an integer >= 0, got {self.seed!r}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr!r}")
        if self.rank_order not in RANK_ORDERS:
            raise ValueError(f"--rank-order must be one of {', '.join(RANK_ORDERS)}, got {self.rank_order!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if (self.resume or self.checkpoint_every) and not self.checkpoint_dir:
            raise ValueError("--resume and --checkpoint-every need --checkpoint DIR")
        if self.crash_at_step is not None and not 0 <= self.crash_at_step < self.steps:
            raise ValueError(f"--crash-at-step must be in 0..{self.steps - 1}, got {self.crash_at_step}")

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step over all replicas (the global batch)."""
        return sum(self.microbatch_split)


def first_microbatch(split: tuple[int, ...], dp_rank: int) -> int:
    """Global index of replica ``dp_rank``'s first micro-batch under ``split``: replicas
    take consecutive runs of the global batch, so any split consumes the same samples
    (the job's own split, or a plan greyhound's mitigation moved micro-batches by)."""
    return sum(split[:dp_rank])
