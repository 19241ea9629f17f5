"""Change the job's DP x PP placement at a step boundary, without a restart (S3).

greyhound's S3 moves ranks to other (dp_rank, pp_rank) cells: a straggler is put on a
light inner stage, a congested link made to carry pipeline rather than DP traffic.
Every rank whose stage changes needs that stage's state, and the stage's DP replicas
hold identical state, so it is sent point to point, in memory, by one of the stage's
old holders.  No file is written and no process restarts.

What moves: a stage's whole training state, as a checkpoint's stage file holds it
(hybrid/checkpoint.py's stage_state, loaded by its load_stage_state): the stage's
``module.state_dict()`` (parameters and buffers), its ``optimizer.state_dict()``
(AdamW's exp_avg, exp_avg_sq and step per parameter, and the param groups'
hyperparameters), its pp_rank and block range.  It travels as
the bytes ``torch.save`` writes (what a stage file would hold), so it arrives
bit-identical.  The job's MainGrads (hybrid/grads.py) keep no main parameters, only a
gradient buffer zeroed at every step: nothing of it moves, the receiver builds a new
one for its new stage.  Ranks that keep their stage (their dp_rank may change) send
nothing to themselves and receive nothing.

Sources: for each stage, the ranks that receive it are spread over its old holders,
each receiver to the holder with the fewest receivers so far (ties: a holder that is
not itself receiving a stage, then the lowest rank), so no holder sends more than
ceil(receivers / dp) copies.

Order: every rank computes the same plan from the two layouts (a pure function).  The
move is a barrier (everyone has finished the step) and two rounds of
``batch_isend_irecv`` on the default group: first each payload's size, then the
payloads.  A rank posts all its sends and its one receive in one batch and every send
has its matching receive in the peer's batch, so swaps and cycles cannot deadlock
(gloo posts them non-blocking; NCCL runs a batch as one group).  The default group
takes global ranks, so no group is needed for the move itself.

What is rebuilt (the caller's part, see :func:`rebuild_groups`): the DP groups, one
per stage with the new holders, created by every rank in stage order (``new_group``
is collective over the world); the stage module and its optimizer, built for the new
stage and loaded with checkpoint.load_stage_state; the MainGrads; the pipeline
neighbours (``new.pipeline(dp_rank)``); the replica's data, which follows the dp_rank
cell (a rank that takes cell (d, s) trains replica d's micro-batches).

A Megatron or torchtitan loop would do the same at a step boundary: Megatron's
parallel_state keeps its groups in module globals, so it would destroy and re-run
``initialize_model_parallel`` with a rank-to-cell map instead of its fixed rank
order, rebuild the model chunk and DistributedOptimizer (whose sharded main
parameters and moments would move per shard, not per stage) and reset its p2p
neighbours; torchtitan would build a new DeviceMesh from the placement, re-run
``pipeline_llm`` for the new stage, and load the received state through its
state-dict adapters (DCP's state dict, sent instead of written).
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybrid.checkpoint import CheckpointError
from hybrid.layout import ParallelLayout


@dataclass(frozen=True)
class Transfer:
    """One copy of a stage's state: ``src`` held ``pp_rank`` before, ``dst`` takes it."""

    pp_rank: int
    src: int
    dst: int


@dataclass(frozen=True, kw_only=True)
class MovedStage:
    """This rank's side of a move."""

    state: dict
    """The state of the rank's new stage (its own ``state`` when the stage is kept)."""
    bytes_sent: int
    bytes_received: int
    seconds: float
    """Wall time of the move on this rank after the opening barrier (serialising,
    transfer, deserialising; not the wait for the slowest rank to end its step)."""


def plan_transfers(old: ParallelLayout, new: ParallelLayout) -> list[Transfer]:
    """Which old holder sends each changed rank its new stage (the same on every rank).

    One Transfer per rank whose pp_rank differs between the layouts, in rank order.
    """
    if (old.dp, old.pp, old.world_size) != (new.dp, new.pp, new.world_size):
        raise ValueError(f"relayout keeps the grid: old is dp {old.dp} x pp {old.pp}, "
                         f"new is dp {new.dp} x pp {new.pp}")
    stage_before = [old.coords_of(r)[1] for r in range(old.world_size)]
    stage_after = [new.coords_of(r)[1] for r in range(new.world_size)]
    receiving = {r for r in range(old.world_size) if stage_before[r] != stage_after[r]}
    sends = dict.fromkeys(range(old.world_size), 0)
    out = []
    for dst in sorted(receiving):
        holders = old.dp_group(stage_after[dst])
        src = min(holders, key=lambda r: (sends[r], r in receiving, r))
        sends[src] += 1
        out.append(Transfer(pp_rank=stage_after[dst], src=src, dst=dst))
    return out


def _to_bytes(state: dict) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)


def _from_bytes(payload: torch.Tensor) -> dict:
    # weights_only: the payload is data (tensors, numbers, lists), as checkpoint.load reads it
    return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), map_location="cpu", weights_only=True)


def _exchange(sends: list[tuple[torch.Tensor, int]], recv: tuple[torch.Tensor, int] | None) -> None:
    """Post this rank's sends and its receive as one batch; wait for all of them."""
    ops = [dist.P2POp(dist.isend, tensor, peer) for tensor, peer in sends]
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv[0], recv[1]))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def move_stages(old: ParallelLayout, new: ParallelLayout, state: dict, *, rank: int,
                device: torch.device | str = "cpu") -> MovedStage:
    """Collective over the default group: give every rank its stage under ``new``.

    Args:
        old, new: the layouts before and after (same dp x pp grid).
        state: this rank's stage state under ``old`` (:func:`stage_state`); read, not changed.
        rank: this rank's global rank.
        device: where the wire tensors live: "cpu" for gloo, this rank's GPU for NCCL.
    Returns:
        the new stage's state (``state`` itself when this rank keeps its stage) and
        what the move cost here.
    """
    plan = plan_transfers(old, new)
    dests = [t.dst for t in plan if t.src == rank]
    source = next((t for t in plan if t.dst == rank), None)
    dist.barrier()  # the step is over everywhere: no p2p of the step is still in flight
    t0 = time.perf_counter()
    payload = _to_bytes(state).to(device) if dests else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=device)
    recv_size = torch.zeros(1, dtype=torch.int64, device=device)
    _exchange([(size, d) for d in dests], (recv_size, source.src) if source else None)
    received = torch.empty(int(recv_size.item()), dtype=torch.uint8, device=device) if source else None
    _exchange([(payload, d) for d in dests] if payload is not None else [],
              (received, source.src) if source and received is not None else None)
    new_state = state
    if source is not None and received is not None:
        new_state = _from_bytes(received)
        if new_state["pp_rank"] != source.pp_rank:
            raise CheckpointError(f"rank {rank} expected stage {source.pp_rank} from rank {source.src}, "
                                  f"got stage {new_state['pp_rank']}")
    sent = len(dests) * (payload.numel() if payload is not None else 0)
    got = received.numel() if received is not None else 0
    return MovedStage(state=new_state, bytes_sent=sent, bytes_received=got, seconds=time.perf_counter() - t0)


def rebuild_groups(new: ParallelLayout, *, old_groups: list | None = None) -> list:
    """Collective over the world: the DP group of every stage under ``new``, indexed by
    pp_rank (a rank uses ``groups[its pp_rank]``).

    ``new_group`` must be called by every rank, for every group, in the same order, so
    all stages' groups are made here in stage order, member or not.  ``old_groups``
    (the layout's previous groups) are destroyed afterwards, in the same order.
    """
    groups = [dist.new_group(new.dp_group(s)) for s in range(new.pp)]
    for group in old_groups or []:
        if group != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)
    return groups
