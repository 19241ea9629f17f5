"""The one object that owns the DP x PP layout of the job's ranks."""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.config import RANK_ORDERS


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Where each global rank sits in the DP x PP grid (TP = 1).

    ``rank_order`` "dp-fast" numbers the DP replicas of a stage consecutively
    (rank = pp_rank * dp + dp_rank, Megatron's order); "pp-fast" numbers the stages of a
    replica consecutively (rank = dp_rank * pp + pp_rank).
    """

    dp: int
    """Data-parallel degree."""
    pp: int
    """Pipeline-parallel degree."""
    world_size: int
    """Number of ranks; must equal dp * pp."""
    rank_order: str = "dp-fast"
    """"dp-fast" or "pp-fast" (see the class doc)."""

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelLayout.{name} must be an integer >= 1, got {value!r}")
        if self.dp * self.pp != self.world_size:
            raise ValueError(f"world size {self.world_size} != dp {self.dp} x pp {self.pp}; "
                             "launch dp * pp ranks or change --dp/--pp")
        if self.rank_order not in RANK_ORDERS:
            raise ValueError(f"rank order must be one of {', '.join(RANK_ORDERS)}, got {self.rank_order!r}")

    def rank_of(self, *, dp_rank: int, pp_rank: int) -> int:
        """Global rank of the worker (dp_rank, pp_rank)."""
        if not (0 <= dp_rank < self.dp and 0 <= pp_rank < self.pp):
            raise ValueError(f"(dp_rank, pp_rank)=({dp_rank}, {pp_rank}) outside {self.dp} x {self.pp}")
        if self.rank_order == "dp-fast":
            return pp_rank * self.dp + dp_rank
        return dp_rank * self.pp + pp_rank

    def coords_of(self, rank: int) -> tuple[int, int]:
        """(dp_rank, pp_rank) of global rank ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        if self.rank_order == "dp-fast":
            return rank % self.dp, rank // self.dp
        return rank // self.pp, rank % self.pp

    def dp_group(self, pp_rank: int) -> list[int]:
        """Global ranks of stage ``pp_rank``'s DP replicas (they all-reduce gradients)."""
        return [self.rank_of(dp_rank=d, pp_rank=pp_rank) for d in range(self.dp)]

    def pipeline(self, dp_rank: int) -> list[int]:
        """Global ranks of replica ``dp_rank``'s stages, first to last."""
        return [self.rank_of(dp_rank=dp_rank, pp_rank=p) for p in range(self.pp)]


def split_layers(num_layers: int, pp: int, stage_layers: tuple[int, ...] | None = None) -> list[range]:
    """Block indices of each stage: ``stage_layers`` when given, else as even as possible
    with the remainder on the earlier stages (the last stage also carries the LM head).
    """
    if stage_layers is None:
        if num_layers < pp:
            raise ValueError(f"--layers={num_layers} is fewer than --pp={pp} stages")
        base, extra = divmod(num_layers, pp)
        stage_layers = tuple(base + (1 if s < extra else 0) for s in range(pp))
    if len(stage_layers) != pp:
        raise ValueError(f"--stage-layers has {len(stage_layers)} entries, --pp is {pp}")
    if min(stage_layers) < 0 or sum(stage_layers) != num_layers:
        raise ValueError(f"--stage-layers must be >= 0 each and sum to --layers={num_layers}, "
                         f"got {','.join(map(str, stage_layers))}")
    out, start = [], 0
    for count in stage_layers:
        out.append(range(start, start + count))
        start += count
    return out
