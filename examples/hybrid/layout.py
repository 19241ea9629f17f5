"""The one object that owns the DP x PP layout of the job's ranks."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybrid.config import RANK_ORDERS

Placement = tuple[tuple[int, int], ...]
"""Each global rank's (dp_rank, pp_rank) cell, indexed by global rank."""


def placement_of(rank_order: str, *, dp: int, pp: int) -> Placement:
    """The placement a fixed rank order gives: "dp-fast" numbers the DP replicas of a
    stage consecutively (rank = pp_rank * dp + dp_rank, Megatron's order); "pp-fast"
    numbers the stages of a replica consecutively (rank = dp_rank * pp + pp_rank)."""
    if rank_order not in RANK_ORDERS:
        raise ValueError(f"rank order must be one of {', '.join(RANK_ORDERS)}, got {rank_order!r}")
    if rank_order == "dp-fast":
        return tuple((r % dp, r // dp) for r in range(dp * pp))
    return tuple((r // pp, r % pp) for r in range(dp * pp))


def _check_placement(placement: Placement, *, dp: int, pp: int, world_size: int) -> None:
    """One-line ValueError unless ``placement`` maps the ranks one-to-one onto the grid."""
    if len(placement) != world_size:
        raise ValueError(f"placement has {len(placement)} cells, the world has {world_size} ranks")
    for rank, cell in enumerate(placement):
        ok = (isinstance(cell, tuple) and len(cell) == 2
              and all(isinstance(c, int) and not isinstance(c, bool) for c in cell))
        if not ok or not (0 <= cell[0] < dp and 0 <= cell[1] < pp):
            raise ValueError(f"placement of rank {rank} is {cell!r}, not a (dp_rank, pp_rank) cell "
                             f"of the {dp} x {pp} grid")
    seen: dict[tuple[int, int], int] = {}
    for rank, cell in enumerate(placement):
        if cell in seen:
            raise ValueError(f"placement puts ranks {seen[cell]} and {rank} both in cell "
                             f"(dp_rank, pp_rank)={cell}; each cell needs exactly one rank")
        seen[cell] = rank


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Where each global rank sits in the DP x PP grid (TP = 1).

    The layout is a placement: each global rank's (dp_rank, pp_rank) cell.  Without an
    explicit ``placement`` it is made from ``rank_order`` (see :func:`placement_of`);
    with one, ``rank_order`` is not consulted.  Explicit placements are what
    greyhound's S3 moves a running job between (hybrid/relayout.py).
    """

    dp: int
    """Data-parallel degree."""
    pp: int
    """Pipeline-parallel degree."""
    world_size: int
    """Number of ranks; must equal dp * pp."""
    rank_order: str = "dp-fast"
    """"dp-fast" or "pp-fast" (see :func:`placement_of`); used when placement is None."""
    placement: Placement | None = None
    """Each global rank's (dp_rank, pp_rank) cell, a bijection onto the dp x pp grid;
    None = the one ``rank_order`` gives.  Set (never None) once the layout is built."""
    _rank_at: dict[tuple[int, int], int] = field(init=False, repr=False, compare=False)

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
        if self.placement is None:
            # frozen: the derived placement is stored once, as the one source of truth
            object.__setattr__(self, "placement", placement_of(self.rank_order, dp=self.dp, pp=self.pp))
        else:
            placement = tuple(tuple(c) if isinstance(c, list) else c for c in self.placement)
            _check_placement(placement, dp=self.dp, pp=self.pp, world_size=self.world_size)
            object.__setattr__(self, "placement", placement)
        object.__setattr__(self, "_rank_at", {cell: r for r, cell in enumerate(self.cells)})

    @property
    def cells(self) -> Placement:
        """The placement (each global rank's (dp_rank, pp_rank)), never None."""
        assert self.placement is not None  # set by __post_init__
        return self.placement

    def rank_of(self, *, dp_rank: int, pp_rank: int) -> int:
        """Global rank of the worker (dp_rank, pp_rank)."""
        if not (0 <= dp_rank < self.dp and 0 <= pp_rank < self.pp):
            raise ValueError(f"(dp_rank, pp_rank)=({dp_rank}, {pp_rank}) outside {self.dp} x {self.pp}")
        return self._rank_at[(dp_rank, pp_rank)]

    def coords_of(self, rank: int) -> tuple[int, int]:
        """(dp_rank, pp_rank) of global rank ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        return self.cells[rank]

    def dp_group(self, pp_rank: int) -> list[int]:
        """Global ranks of stage ``pp_rank``'s DP replicas (they all-reduce gradients)."""
        return [self.rank_of(dp_rank=d, pp_rank=pp_rank) for d in range(self.dp)]

    def pipeline(self, dp_rank: int) -> list[int]:
        """Global ranks of replica ``dp_rank``'s stages, first to last."""
        return [self.rank_of(dp_rank=dp_rank, pp_rank=p) for p in range(self.pp)]

    def with_placement(self, placement: Placement) -> ParallelLayout:
        """The same grid with ranks in other cells (checked like the constructor's)."""
        return ParallelLayout(dp=self.dp, pp=self.pp, world_size=self.world_size, placement=tuple(placement))


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
