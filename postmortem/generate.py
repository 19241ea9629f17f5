"""Synthetic 1F1B traces with injected stragglers, and the truth about them.

An executor of its own (not the post-mortem's model): each stage runs Megatron's
non-interleaved 1F1B program (warm-up forwards, steady one-forward-one-backward with
fused send_forward_recv_backward / send_backward_recv_forward, cool-down backwards),
then DP gradient sync, the embedding all-reduce of the first and last stage, the global
clip all-reduce and the optimizer.  Every (step, DP replica) runs in lock-step through
the same program, so one Python iteration per instruction moves numpy arrays shaped
(steps, DP).  A CPU launch gap precedes every instruction, so the trace, like a real one,
is a little slower than a replay without launch delays.

``measured_slowdown`` is the mean step time of the run with the injected stragglers over
the same run (same noise, same gaps) without them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from postmortem.schema import OPTYPE_CODE, Trace, TraceMeta


@dataclass(frozen=True, kw_only=True)
class SyntheticJob:
    """A synthetic DP x PP job and the stragglers injected into it."""

    dp: int = 4
    """Data-parallel degree."""
    pp: int = 4
    """Pipeline stages."""
    num_microbatches: int = 8
    """Micro-batches per step per DP replica."""
    num_steps: int = 6
    """Traced steps."""
    forward_s: float = 0.010
    """Forward compute time of one micro-batch on one stage."""
    backward_s: float = 0.020
    """Backward compute time of one micro-batch on one stage."""
    p2p_s: float = 0.0004
    """Transfer time of one activation / gradient between stages."""
    dp_sync_s: float = 0.004
    """Transfer time of the DP gradient reduce-scatter (params all-gather: half)."""
    optimizer_s: float = 0.003
    """Optimizer step time."""
    launch_gap_s: float = 20e-6
    """Mean CPU launch gap before every op (exponentially distributed)."""
    noise: float = 0.0
    """Sigma of the multiplicative log-normal noise on every compute op."""
    slow_workers: tuple[tuple[int, int, float], ...] = ()
    """(dp_rank, pp_rank, factor): that worker's compute ops take factor x longer."""
    slow_dp: tuple[tuple[int, float], ...] = ()
    """(dp_rank, factor): every stage of that DP replica computes factor x slower."""
    stage_weights: tuple[float, ...] | None = None
    """Per-stage compute multipliers (stage-partition imbalance), None = balanced."""
    stage_start_s: tuple[float, ...] | None = None
    """Per-stage delay before the stage starts each step (a schedule's own skew, as when
    steps overlap without a job-wide sync), None = every stage at 0."""
    late_workers: tuple[tuple[int, int, float], ...] = ()
    """(dp_rank, pp_rank, seconds): that worker starts each step this much later (what a
    straggler's late previous step leaves); a straggler, absent from the healthy run."""
    gc_prob: float = 0.0
    """Probability that a worker pauses for GC in a step (before forward micro-batch 1)."""
    gc_pause_s: float = 0.1
    """Length of a GC pause."""
    seqlen_max: int = 0
    """> 0: sample sequence lengths (up to this) and scale compute by sum of s^2."""
    samples_per_microbatch: int = 4
    """Samples per micro-batch when sequence lengths are drawn."""
    gpus_per_node: int = 8
    """Workers per node, for the worker -> node map."""
    seed: int = 0
    """Seed of every random draw, when :func:`generate` is given no generator."""

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "num_microbatches", "num_steps", "samples_per_microbatch", "gpus_per_node"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"SyntheticJob.{name} must be >= 1, got {getattr(self, name)}")
        for d, p, f in self.slow_workers:
            if not (0 <= d < self.dp and 0 <= p < self.pp and f > 0):
                raise ValueError(f"SyntheticJob.slow_workers entry {(d, p, f)} out of range")
        for d, f in self.slow_dp:
            if not (0 <= d < self.dp and f > 0):
                raise ValueError(f"SyntheticJob.slow_dp entry {(d, f)} out of range")
        if self.stage_weights is not None and len(self.stage_weights) != self.pp:
            raise ValueError(f"SyntheticJob.stage_weights needs {self.pp} entries")
        if self.stage_start_s is not None and (len(self.stage_start_s) != self.pp
                                               or min(self.stage_start_s) < 0):
            raise ValueError(f"SyntheticJob.stage_start_s needs {self.pp} entries >= 0")
        for d, p, late in self.late_workers:
            if not (0 <= d < self.dp and 0 <= p < self.pp and late >= 0):
                raise ValueError(f"SyntheticJob.late_workers entry {(d, p, late)} out of range")
        if not 0 <= self.gc_prob <= 1:
            raise ValueError("SyntheticJob.gc_prob must be in [0, 1]")


@dataclass(frozen=True, kw_only=True)
class Truth:
    measured_slowdown: float
    """Mean step time with the stragglers / without them."""
    step_time: np.ndarray
    """(N,) step times with the stragglers."""
    step_time_healthy: np.ndarray
    """(N,) step times of the same run without them."""
    slow_cells: np.ndarray
    """(D, P) compute slow-down factor injected per worker."""
    extra: dict = field(default_factory=dict)


def stage_program(p: int, P: int, M: int) -> list[list[tuple[str, int]]]:
    """Megatron's 1F1B program of stage p: a list of instructions, each a list of
    (op type, micro-batch) issued together."""
    first, last = p == 0, p == P - 1
    warm = min(P - p - 1, M)
    rem = M - warm
    prog: list[list[tuple[str, int]]] = [[("params-all-gather", -1)]]
    for i in range(warm):
        if not first:
            prog.append([("forward-recv", i)])
        prog.append([("gc", i)] if i == 1 else [])
        prog.append([("forward-compute", i)])
        if not last:
            prog.append([("forward-send", i)])
    if rem > 0 and not first:
        prog.append([("forward-recv", warm)])
    for i in range(rem):
        f = warm + i
        if f == 1:
            prog.append([("gc", 1)])
        prog.append([("forward-compute", f)])
        if not last:
            prog.append([("forward-send", f), ("backward-recv", i)])
        prog.append([("backward-compute", i)])
        if not first:
            if i == rem - 1:
                prog.append([("backward-send", i)])
            else:
                prog.append([("backward-send", i), ("forward-recv", f + 1)])
    for j in range(warm):
        b = rem + j
        if not last:
            prog.append([("backward-recv", b)])
        prog.append([("backward-compute", b)])
        if not first:
            prog.append([("backward-send", b)])
    if M < 2:
        prog.append([("gc", 1)])
    prog.append([("layernorm-grads-all-reduce", -1)])
    if P > 1 and (first or last):
        prog.append([("embedding-grads-all-reduce", -1)])
    prog.append([("grads-reduce-scatter", -1)])
    prog.append([("optimizer-clip-main-grad", -1)])
    prog.append([("optimizer", -1)])
    return [ins for ins in prog if ins]


def generate(job: SyntheticJob, *, rng: np.random.Generator | None = None) -> tuple[Trace, Truth]:
    """Generate a trace of ``job`` and the truth about its stragglers, every random draw
    from ``rng`` (None: a generator seeded with ``job.seed``, the same trace for a job)."""
    rng = np.random.default_rng(job.seed) if rng is None else rng
    D, P, M, N = job.dp, job.pp, job.num_microbatches, job.num_steps
    slow = np.ones((D, P))
    for d, p, f in job.slow_workers:
        slow[d, p] *= f
    for d, f in job.slow_dp:
        slow[d, :] *= f
    weights = np.asarray(job.stage_weights if job.stage_weights is not None else np.ones(P), float)
    seq_factor = np.ones((N, D, M))
    seqlens: dict[str, np.ndarray] | None = None
    if job.seqlen_max > 0:
        k = job.samples_per_microbatch
        lengths = rng.integers(16, job.seqlen_max + 1, size=(N, D, M, k)).astype(np.int32)
        q = (lengths.astype(np.float64) ** 2).sum(axis=-1)
        seq_factor = 0.3 + 0.7 * q / q.mean()
        n_rows = N * D * M
        step_i, dp_i, mb_i = np.meshgrid(np.arange(N), np.arange(D), np.arange(M), indexing="ij")
        seqlens = {
            "step": step_i.ravel().astype(np.int32),
            "dp_rank": dp_i.ravel().astype(np.int16),
            "microbatch": mb_i.ravel().astype(np.int32),
            "offsets": np.arange(n_rows + 1, dtype=np.int64) * k,
            "lengths": lengths.reshape(-1),
        }
    gc = (rng.random((N, D, P)) < job.gc_prob) * job.gc_pause_s
    # noise drawn once per op instance so that both runs see the same noise
    progs = [stage_program(p, P, M) for p in range(P)]
    noise_cache: dict[tuple, np.ndarray] = {}

    def noise(key) -> np.ndarray:
        if key not in noise_cache:
            noise_cache[key] = (
                np.exp(rng.normal(0.0, job.noise, size=(N, D))) if job.noise > 0 else np.ones((N, D))
            )
        return noise_cache[key]

    gaps = {
        (p, k): rng.exponential(job.launch_gap_s, size=(N, D)) if job.launch_gap_s > 0 else np.zeros((N, D))
        for p in range(P)
        for k in range(len(progs[p]))
    }
    start = np.zeros((D, P)) + (np.asarray(job.stage_start_s) if job.stage_start_s else 0.0)
    late = np.zeros((D, P))
    for d, p, seconds in job.late_workers:
        late[d, p] += seconds
    rows_slow, t_slow = _execute(job, progs, slow, weights, seq_factor, gc, noise, gaps, start + late,
                                 record=True)
    _, t_healthy = _execute(job, progs, np.ones((D, P)), weights, seq_factor, gc * 0, noise, gaps, start,
                            record=False)
    offsets = np.concatenate([[0.0], np.cumsum(t_slow + 0.001)[:-1]]) + 100.0
    ops = _rows_to_ops(rows_slow, offsets, N=N, D=D)
    dd, pp_ = np.meshgrid(np.arange(D), np.arange(P), indexing="ij")
    rank = (dd * P + pp_).ravel()
    workers: dict[str, np.ndarray] = {
        "rank": rank.astype(np.int32),
        "dp_rank": dd.ravel().astype(np.int16),
        "pp_rank": pp_.ravel().astype(np.int16),
        "node": np.asarray([f"n{r // job.gpus_per_node + 1}" for r in rank]),
        "device": np.asarray([f"cuda:{r % job.gpus_per_node}" for r in rank]),
    }
    meta = TraceMeta(dp=D, pp=P, num_microbatches=M * D, job_id=None, trial_name="synthetic")
    trace = Trace(meta=meta, ops=ops, workers=workers, seqlens=seqlens, path="<synthetic>")
    cells = slow * weights[None, :] / weights.mean()
    truth = Truth(
        measured_slowdown=float(t_slow.mean() / t_healthy.mean()),
        step_time=t_slow,
        step_time_healthy=t_healthy,
        slow_cells=cells,
        extra={"gc_pauses": int((gc > 0).sum())},
    )
    return trace, truth


def _execute(job, progs, slow, weights, seq_factor, gc, noise, gaps, start, *, record: bool):
    D, P, N = job.dp, job.pp, job.num_steps
    clock = [np.broadcast_to(start[:, p], (N, D)).copy() for p in range(P)]   # start: (D, P)
    ptr = [0] * P
    posted: dict[tuple, np.ndarray] = {}
    rows: list[tuple] = []
    step_end = np.zeros(N)
    done = 0
    total = sum(len(pr) for pr in progs)
    while done < total:
        progressed = False
        for p in range(P):
            while ptr[p] < len(progs[p]):
                ins = progs[p][ptr[p]]
                key0 = ("launch", p, ptr[p])
                if key0 not in posted:
                    posted[key0] = clock[p] + gaps[(p, ptr[p])]
                    for op, mb in ins:
                        posted[(op, p, mb)] = posted[key0]
                launch = posted[key0]
                ends = []
                ready = True
                for op, mb in ins:
                    peers = _peers(op, p, mb, P)
                    if any(k not in posted for k in peers):
                        ready = False
                        break
                if not ready:
                    break
                for op, mb in ins:
                    end = _op_end(job, op, p, mb, launch, posted, slow, weights, seq_factor, gc, noise)
                    ends.append(end)
                    if record:
                        rows.append((op, p, mb, launch, end))
                clock[p] = np.maximum.reduce(ends)
                ptr[p] += 1
                done += 1
                progressed = True
        if not progressed:
            raise RuntimeError("synthetic 1F1B program deadlocked (generator bug)")
    for p in range(P):
        step_end = np.maximum(step_end, clock[p].max(axis=1))
    return rows, step_end


def _peers(op: str, p: int, mb: int, P: int) -> list[tuple]:
    if op == "forward-send":
        return [("forward-recv", p + 1, mb)]
    if op == "forward-recv":
        return [("forward-send", p - 1, mb)]
    if op == "backward-send":
        return [("backward-recv", p - 1, mb)]
    if op == "backward-recv":
        return [("backward-send", p + 1, mb)]
    if op == "embedding-grads-all-reduce":
        return [(op, P - 1 - p if p in (0, P - 1) else p, mb)]
    if op == "optimizer-clip-main-grad":
        return [(op, q, mb) for q in range(P)]
    return []


def _op_end(job, op, p, mb, launch, posted, slow, weights, seq_factor, gc, noise) -> np.ndarray:
    if op in ("forward-compute", "backward-compute"):
        base = job.forward_s if op == "forward-compute" else job.backward_s
        dur = base * weights[p] * slow[None, :, p] * seq_factor[:, :, mb] * noise((op, p, mb))
        return launch + dur
    if op == "gc":
        return launch + gc[:, :, p]
    if op == "optimizer":
        return launch + job.optimizer_s * slow[None, :, p]
    if op == "layernorm-grads-all-reduce":
        return launch + 1e-5
    if op in ("forward-send", "forward-recv", "backward-send", "backward-recv", "embedding-grads-all-reduce"):
        peer = _peers(op, p, mb, job.pp)[0]
        xfer = job.p2p_s if "embedding" not in op else 2 * job.p2p_s
        return np.maximum(launch, posted[peer]) + xfer
    if op in ("params-all-gather", "grads-reduce-scatter"):
        xfer = job.dp_sync_s / 2 if op == "params-all-gather" else job.dp_sync_s
        return launch.max(axis=1, keepdims=True) + xfer + 0 * launch
    if op == "optimizer-clip-main-grad":
        allp = np.maximum.reduce([posted[k] for k in _peers(op, p, mb, job.pp)])
        return allp.max(axis=1, keepdims=True) + 1e-4 + 0 * launch
    raise ValueError(f"generator has no rule for {op}")


def _rows_to_ops(rows, offsets, *, N: int, D: int) -> dict[str, np.ndarray]:
    n = len(rows)
    size = N * D
    step = np.tile(np.repeat(np.arange(N, dtype=np.int32), D), n)
    dp = np.tile(np.tile(np.arange(D, dtype=np.int16), N), n)
    code = np.repeat(np.array([OPTYPE_CODE[r[0]] for r in rows], np.int8), size)
    pp = np.repeat(np.array([r[1] for r in rows], np.int16), size)
    mb = np.repeat(np.array([r[2] for r in rows], np.int32), size)
    launch = np.concatenate([r[3].ravel() for r in rows]) if rows else np.zeros(0)
    end = np.concatenate([r[4].ravel() for r in rows]) if rows else np.zeros(0)
    return {
        "step": step,
        "microbatch": mb,
        "pp_rank": pp,
        "dp_rank": dp,
        "chunk": np.zeros(n * size, np.int16),
        "optype": code,
        "start": launch + offsets[step],
        "duration": end - launch,
    }
