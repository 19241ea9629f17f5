"""The 1F1B pipeline schedule (PipeDream-flush, Megatron's non-interleaved schedule).

Why not torch.distributed.pipelining's Schedule1F1B: (1) its PipelineStage infers the
activation shape once and receives into fixed-size buffers, while this job's
micro-batches have variable sequence lengths (each is padded only to its own longest
sample, so compute follows the real lengths, which the post-mortem's sequence-length
analysis needs); (2) its sends are posted non-blocking and waited for later, with no
hook around each op, while greyhound needs the start and duration of every forward,
backward, send and receive of every micro-batch.  Uneven micro-batch counts per DP
replica it would allow (one schedule object per replica).

Communication follows Megatron's p2p pattern so that it cannot deadlock under NCCL's
rendezvous semantics: in the steady state a stage posts its send and the receive it
needs next as one batched op (recorded as two rows with the same start and duration,
as in the What-if study's traces).  Any micro-batch count >= 1 works, including counts
below the number of stages and counts that are not a multiple of it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hybrid.data import MicroBatch
from hybrid.grads import MainGrads
from hybrid.model import token_loss_sum


@dataclass
class StageContext:
    """This rank's stage and its neighbours."""

    module: nn.Module
    pp_rank: int
    pp: int
    prev_rank: int | None
    """Global rank of the previous stage of this replica (None on the first stage)."""
    next_rank: int | None
    """Global rank of the next stage (None on the last stage)."""
    dim: int
    device: torch.device
    dtype: torch.dtype = torch.float32

    @property
    def first(self) -> bool:
        return self.pp_rank == 0

    @property
    def last(self) -> bool:
        return self.pp_rank == self.pp - 1


class _NoRecorder:
    """Stands in for a TimelineRecorder when the job records no timeline."""

    class _Null:
        def __enter__(self):
            return None

        def __exit__(self, *exc):
            return None

    _null = _Null()

    def span(self, *optypes, microbatch=-1, chunk=None):
        return self._null


NO_RECORDER = _NoRecorder()


def _exchange(ops: list[tuple[str, torch.Tensor, int]]) -> None:
    if not ops:
        return
    p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer) for kind, tensor, peer in ops]
    for work in dist.batch_isend_irecv(p2p):
        work.wait()


class _Step:
    """One step of one stage: its micro-batches, the p2p ops around them and the
    activations waiting for their backward pass (first in, first out)."""

    def __init__(self, ctx: StageContext, microbatches: list[MicroBatch], *, grads: MainGrads,
                 loss_scale: float, recorder) -> None:
        self.ctx = ctx
        self.microbatches = microbatches
        self.grads = grads
        self.loss_scale = loss_scale
        self.recorder = recorder
        self.in_flight: deque[tuple[torch.Tensor, torch.Tensor]] = deque()

    def _empty(self, i: int) -> torch.Tensor:
        """A buffer for micro-batch i's activations (or their gradient)."""
        mb = self.microbatches[i]
        return torch.empty((mb.lengths.size, mb.seq_len, self.ctx.dim), dtype=self.ctx.dtype,
                           device=self.ctx.device)

    def recv_forward(self, i: int) -> torch.Tensor:
        if self.ctx.first:
            return torch.from_numpy(self.microbatches[i].tokens).to(self.ctx.device)
        x = self._empty(i)
        with self.recorder.span("forward-recv", microbatch=i):
            _exchange([("recv", x, self.ctx.prev_rank)])
        return x

    def send_forward(self, i: int, y: torch.Tensor | None) -> None:
        if not self.ctx.last:
            with self.recorder.span("forward-send", microbatch=i):
                _exchange([("send", y, self.ctx.next_rank)])

    def recv_backward(self, i: int) -> torch.Tensor | None:
        if self.ctx.last:
            return None
        g = self._empty(i)
        with self.recorder.span("backward-recv", microbatch=i):
            _exchange([("recv", g, self.ctx.next_rank)])
        return g

    def send_backward(self, i: int, gx: torch.Tensor | None) -> None:
        if not self.ctx.first:
            with self.recorder.span("backward-send", microbatch=i):
                _exchange([("send", gx, self.ctx.prev_rank)])

    def send_forward_recv_backward(self, i_fwd: int, y: torch.Tensor | None, i_bwd: int) -> torch.Tensor | None:
        if self.ctx.last:
            return None
        g = self._empty(i_bwd)
        with self.recorder.span("forward-send", "backward-recv", microbatch=(i_fwd, i_bwd)):
            _exchange([("send", y, self.ctx.next_rank), ("recv", g, self.ctx.next_rank)])
        return g

    def send_backward_recv_forward(self, i_bwd: int, gx: torch.Tensor | None, i_fwd: int) -> torch.Tensor:
        if self.ctx.first:
            return self.recv_forward(i_fwd)
        x = self._empty(i_fwd)
        with self.recorder.span("backward-send", "forward-recv", microbatch=(i_bwd, i_fwd)):
            _exchange([("send", gx, self.ctx.prev_rank), ("recv", x, self.ctx.prev_rank)])
        return x

    def forward(self, i: int, x: torch.Tensor) -> torch.Tensor | None:
        ctx = self.ctx
        with self.recorder.span("forward-compute", microbatch=i):
            if not ctx.first:
                x.requires_grad_()
            y = ctx.module(x)
            if ctx.last:
                loss_sum = token_loss_sum(y, torch.from_numpy(self.microbatches[i].targets).to(ctx.device))
                self.grads.add_loss(loss_sum)
                self.in_flight.append((x, loss_sum * self.loss_scale))
                return None
            self.in_flight.append((x, y))
            return y.detach()

    def backward(self, i: int, g: torch.Tensor | None) -> torch.Tensor | None:
        x, y = self.in_flight.popleft()
        with self.recorder.span("backward-compute", microbatch=i):
            if self.ctx.last:
                y.backward()
            else:
                torch.autograd.backward(y, g)
            self.grads.accumulate()
            return None if self.ctx.first else x.grad


def run_1f1b(
    ctx: StageContext,
    microbatches: list[MicroBatch],
    *,
    grads: MainGrads,
    loss_scale: float,
    recorder=NO_RECORDER,
) -> None:
    """Run one step's forward and backward passes of this stage over ``microbatches``.

    Gradients are added into ``grads`` (scaled by ``loss_scale``, the inverse of the
    global batch's token count, so every replica's share is weighted by its tokens);
    on the last stage the unscaled token-loss sum goes into ``grads``' loss slot.

    Micro-batch numbers in the timeline are local (0..m-1 on this replica).
    """
    m = len(microbatches)
    if m < 1:
        raise ValueError("run_1f1b needs at least one micro-batch")
    step = _Step(ctx, microbatches, grads=grads, loss_scale=loss_scale, recorder=recorder)
    num_warmup = min(ctx.pp - ctx.pp_rank - 1, m)
    num_steady = m - num_warmup
    i_fwd = i_bwd = 0
    for _ in range(num_warmup):
        y = step.forward(i_fwd, step.recv_forward(i_fwd))
        step.send_forward(i_fwd, y)
        i_fwd += 1
    x = step.recv_forward(i_fwd) if num_steady else None
    for k in range(num_steady):
        y = step.forward(i_fwd, x)
        g = step.send_forward_recv_backward(i_fwd, y, i_bwd)
        i_fwd += 1
        gx = step.backward(i_bwd, g)
        if k == num_steady - 1:
            step.send_backward(i_bwd, gx)
        else:
            x = step.send_backward_recv_forward(i_bwd, gx, i_fwd)
        i_bwd += 1
    for _ in range(num_warmup):
        gx = step.backward(i_bwd, step.recv_backward(i_bwd))
        step.send_backward(i_bwd, gx)
        i_bwd += 1
