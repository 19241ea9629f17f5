"""Main gradients: one flat buffer per stage that the micro-batches add into and the DP
replicas all-reduce in one call.

Why float64: the same global batch split (8, 8) or (4, 12) over two replicas sums the
same per-micro-batch gradients in a different order.  In float32 the sums differ in the
last bits and the runs drift apart; in float64 the rounding error is ~1e-16 relative,
so the float32 gradient handed to the optimizer is the same and so are the losses.
(Megatron keeps float32 main grads under bf16 parameters for the same reason.)

The last stage's buffer has one extra element at the end: the step's summed token loss,
which thereby rides in the gradient all-reduce instead of needing a collective of its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class MainGrads:
    """Flat gradient accumulator of one stage's parameters.

    Args:
        module: the stage.
        dtype: accumulation and all-reduce dtype (float64, or the parameters' dtype).
        with_loss_slot: reserve the trailing element for the loss sum (last stage).
    """

    def __init__(self, module: nn.Module, *, dtype: torch.dtype, with_loss_slot: bool) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        device = self.params[0].device if self.params else torch.device("cpu")
        total = sum(p.numel() for p in self.params) + (1 if with_loss_slot else 0)
        self.flat = torch.zeros(total, dtype=dtype, device=device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in self.params:
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.with_loss_slot = with_loss_slot

    def zero(self) -> None:
        self.flat.zero_()

    def accumulate(self) -> None:
        """Add the parameters' .grad (one micro-batch's) into the buffer, clear .grad."""
        for p, view in zip(self.params, self.views):
            if p.grad is not None:
                view.add_(p.grad)
                p.grad = None

    def add_loss(self, loss_sum: torch.Tensor) -> None:
        self.flat[-1] += loss_sum.detach().to(self.flat.dtype)

    @property
    def loss_sum(self) -> float:
        """The loss slot (after all_reduce: summed over the replicas)."""
        return float(self.flat[-1]) if self.with_loss_slot else float("nan")

    def all_reduce(self, group) -> None:
        """Sum the buffer over the stage's DP replicas (one collective)."""
        dist.all_reduce(self.flat, op=dist.ReduceOp.SUM, group=group)

    def apply(self) -> None:
        """Hand the summed gradients to the optimizer (.grad in the parameters' dtype)."""
        for p, view in zip(self.params, self.views):
            p.grad = view.to(p.dtype)
