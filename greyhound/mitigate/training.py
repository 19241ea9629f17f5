"""The training side of mitigation: what a training loop calls once per step.

    from greyhound.mitigate.training import Mitigation

    mitigation = Mitigation.from_env(microbatch_split=(8, 8), replicas=[[0, 1, 2, 3], [4, 5, 6, 7]],
                                     rank=dist.get_rank())
    for step in range(start, steps):
        plan = mitigation.step(step)          # at the step boundary, on every rank
        split = plan.microbatch_split         # this step's micro-batches per DP replica
        if plan.checkpoint:                   # S4: greyhound requeues the job once saved
            save_checkpoint(step)             # the state after `step` completed steps
            mitigation.checkpointed(step)
        if plan.placement != placement:       # S3: ranks take other (replica, stage) cells
            t0 = time.monotonic()
            moved = move_stage_state(placement, plan.placement)   # point to point, in memory
            placement = plan.placement        # and the process groups rebuilt for it
            mitigation.relaid_out(step, seconds=time.monotonic() - t0, bytes_moved=moved)
        ...                                   # replica i takes its consecutive run of the
                                              # global batch: first = sum(split[:i])

It is inert (no collective, no I/O, the job's own split every step) unless the job
runs under ``--greyhound=mitigate`` (the plugin sets GREYHOUND_MODE and
GREYHOUND_RUN_DIR). Active, each call is one small broadcast from rank 0 on the
default process group: rank 0 reads the plan the master published in the job's Redis
and every rank applies the same plan from the same step on. So no rank can start a
step with a split the others do not use, however late each one reads the board.

What is learned does not change: a plan only moves micro-batches between replicas
(the global batch, its samples and their order stay the same), and the loop weights
gradients by tokens of the whole global batch, as it does for any split. A placement
(S3) only changes which process computes which cell of the DP x PP grid: replica d's
micro-batches stay replica d's, and a stage's parameters and optimizer state move
bit for bit to the process that holds the stage now.

Fail open: whatever goes wrong on rank 0 (no Redis yet, a malformed plan, a lost
connection) keeps the plan in force and is logged once; the broadcast still happens,
so no rank waits for another.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Sequence

from greyhound.control.store import PLAN as PLAN_KEY
from greyhound.control.store import TRAINING_APPLIED as APPLIED_KEY
from greyhound.control.store import TRAINING_CHECKPOINTED as CHECKPOINTED_KEY
from greyhound.control.store import TRAINING_LAYOUT as LAYOUT_KEY
from greyhound.control.store import TRAINING_PROGRESS as PROGRESS_KEY
from greyhound.control.store import TRAINING_RELAID as RELAID_KEY

log = logging.getLogger(__name__)

ADDRESS_RETRY_STEPS = 10
"""Steps between tries to find the job's Redis (the control plane comes up alongside
the first steps)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """The plan in force for a step."""

    version: int
    """0: the job's own split; the master counts its plans from 1."""
    microbatch_split: tuple[int, ...]
    """Micro-batches of each DP replica this step; sums to the global batch."""
    checkpoint: bool = False
    """Save a checkpoint before this step, then call :meth:`Mitigation.checkpointed`:
    greyhound requeues the job without a bad node once it is saved (S4), and the job
    resumes from it. True at one step only."""
    placement: tuple[tuple[int, int], ...] = ()
    """(DP replica, pipeline stage) of each global rank from this step on: the job's own
    placement (from ``replicas``) until an S3 plan moves ranks. When it differs from the
    placement the loop runs, the loop moves stage state to the new holders and rebuilds
    its process groups before the step, then calls :meth:`Mitigation.relaid_out`."""


def placement_of(replicas: Sequence[Sequence[int]]) -> tuple[tuple[int, int], ...]:
    """(replica, stage) of each global rank, from the ranks of each replica's stages in
    order (``replicas[d][s]`` is the rank of replica d's stage s)."""
    cells = {int(rank): (d, s) for d, members in enumerate(replicas) for s, rank in enumerate(members)}
    if sorted(cells) != list(range(sum(len(r) for r in replicas))) or len({len(r) for r in replicas}) > 1:
        raise ValueError(f"replicas {[list(r) for r in replicas]} must hold ranks 0..N-1 once each, "
                         "the same number of stages in every replica")
    return tuple(cells[r] for r in range(len(cells)))


class Mitigation:
    """One per training process; see the module docstring."""

    def __init__(self, *, microbatch_split: Sequence[int], replicas: Sequence[Sequence[int]], rank: int,
                 active: bool, run_dir: str | os.PathLike | None = None, microbatch_multiple: int = 1) -> None:
        split = tuple(int(m) for m in microbatch_split)
        if len(split) != len(replicas) or min(split, default=0) < 1:
            raise ValueError(f"microbatch_split {split} needs one entry >= 1 per replica ({len(replicas)})")
        if not (isinstance(microbatch_multiple, int) and microbatch_multiple >= 1) or \
                any(m % microbatch_multiple for m in split):
            raise ValueError(f"microbatch_multiple {microbatch_multiple!r} must be an integer >= 1 that divides "
                             f"every entry of microbatch_split {split}")
        self.multiple = microbatch_multiple
        self.replicas = [list(map(int, r)) for r in replicas]
        self.default = Plan(version=0, microbatch_split=split, placement=placement_of(self.replicas))
        self.rank = rank
        self.active = active
        self.run_dir = run_dir
        self.plan = self.default
        self._client = None
        self._next_try = 0
        self._warned: set[str] = set()

    @classmethod
    def from_env(cls, *, microbatch_split: Sequence[int], replicas: Sequence[Sequence[int]],
                 rank: int, microbatch_multiple: int = 1) -> Mitigation:
        """Active under ``--greyhound=mitigate``, inert otherwise (the same on every rank:
        the job's environment decides). ``microbatch_multiple``: every replica's
        micro-batch count stays a multiple of it (a schedule that runs micro-batches in
        blocks of the pipeline's depth, as the paper's 1F1B does, passes ``pp``)."""
        run_dir = os.environ.get("GREYHOUND_RUN_DIR")
        active = os.environ.get("GREYHOUND_MODE") == "mitigate" and bool(run_dir) and len(replicas) > 1
        return cls(microbatch_split=microbatch_split, replicas=replicas, rank=rank, active=active,
                   run_dir=run_dir, microbatch_multiple=microbatch_multiple)

    def step(self, step: int) -> Plan:
        """The plan for ``step``: collective on the default process group when active."""
        if not self.active:
            return self.default
        import torch
        import torch.distributed as dist

        wanted = self._read_board(step) if self.rank == 0 else self.plan
        # One fixed-length message, the same on every rank: version, checkpoint, the
        # split (a number per replica), the placement (two per rank).
        buf = torch.tensor([wanted.version, int(wanted.checkpoint), *wanted.microbatch_split,
                            *(x for cell in wanted.placement for x in cell)], dtype=torch.int64)
        dist.broadcast(buf, src=0)
        version, checkpoint, *rest = buf.tolist()
        if version == self.plan.version:
            return dataclasses.replace(self.plan, checkpoint=False)
        split, flat = rest[:len(self.replicas)], rest[len(self.replicas):]
        placement = tuple(zip(flat[0::2], flat[1::2]))
        moved = placement != self.plan.placement
        self.plan = Plan(version=version, microbatch_split=tuple(split), checkpoint=bool(checkpoint),
                         placement=placement)
        if self.rank == 0:
            log.warning("greyhound: plan %d from step %d: micro-batches per DP replica %s%s%s",
                        version, step, ",".join(map(str, split)),
                        "; ranks move to other pipeline stages (S3)" if moved else "",
                        "; checkpoint now: greyhound requeues this job without a slow node" if checkpoint else "")
            self._tell(APPLIED_KEY, {"version": version, "step": step, "microbatch_split": split,
                                     **({"placement": [list(c) for c in placement]}
                                        if placement != self.default.placement else {})})
        return self.plan

    def checkpointed(self, step: int | None, *, why: str = "") -> None:
        """The checkpoint a plan asked for is saved, after ``step`` completed steps (rank 0
        tells the master; the others do nothing). ``None`` with ``why``: none could be
        saved (no checkpoint directory, say), and greyhound does not requeue the job."""
        if self.active and self.rank == 0:
            self._tell(CHECKPOINTED_KEY, {"version": self.plan.version, "step": step,
                                          **({"why": why} if why else {})})

    def relaid_out(self, step: int, *, seconds: float, bytes_moved: int = 0) -> None:
        """The placement of the plan in force is applied before ``step``: the job paused
        ``seconds`` for it (moving state, rebuilding groups), which is what S3 costs
        this job (rank 0 tells the master, whose ladder weighs the next move by it)."""
        if self.active and self.rank == 0:
            self._tell(RELAID_KEY, {"version": self.plan.version, "step": step,
                                    "pause_s": round(float(seconds), 6), "bytes": int(bytes_moved)})

    # ---- rank 0: the job's Redis --------------------------------------------------

    def _read_board(self, step: int) -> Plan:
        """The master's plan if it is valid for this job; the plan in force otherwise."""
        try:
            client = self._connect(step)
            if client is None:
                return self.plan
            # The step it is at goes with the read (one round trip): the planner judges
            # a move by the job's own pace.
            pipe = client.pipeline(transaction=False)
            pipe.get(PLAN_KEY)
            pipe.set(PROGRESS_KEY, json.dumps({"step": step, "time": time.time()}))
            raw, _ = pipe.execute()
            if raw is None:
                return self.plan
            return self._check(json.loads(raw))
        except ValueError as exc:     # a malformed plan: ignored, the board is read on
            self._warn_once(f"plan:{exc}", f"greyhound: mitigation: ignoring a plan ({exc}); "
                                           "keeping the plan in force")
            return self.plan
        except Exception as exc:  # noqa: BLE001  (fail open: the job keeps its plan)
            self._warn_once(type(exc).__name__, f"greyhound: mitigation: cannot read the plan ({exc}); "
                                                "keeping the plan in force")
            self._client = None
            self._next_try = step + ADDRESS_RETRY_STEPS
            return self.plan

    def _connect(self, step: int):
        if self._client is not None or step < self._next_try:
            return self._client
        from greyhound.control.redis_server import RedisError, read_address

        try:
            self._client = read_address(self.run_dir or "").client()
        except RedisError:
            self._next_try = step + ADDRESS_RETRY_STEPS
            return None
        self._tell(LAYOUT_KEY, {"microbatch_split": list(self.default.microbatch_split),
                                "replicas": self.replicas, "microbatch_multiple": self.multiple})
        return self._client

    def _check(self, plan: dict) -> Plan:
        version = plan.get("version")
        split = plan.get("microbatch_split")
        total = sum(self.default.microbatch_split)
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"plan version {version!r} is not an integer >= 0")
        if not isinstance(plan.get("checkpoint", False), bool):
            raise ValueError(f"plan {version}: checkpoint {plan.get('checkpoint')!r} is not true or false")
        if (not isinstance(split, list) or len(split) != len(self.replicas)
                or not all(isinstance(m, int) and m >= 1 and m % self.multiple == 0 for m in split)
                or sum(split) != total):
            raise ValueError(f"plan {version}: microbatch_split {split!r} is not {len(self.replicas)} "
                             f"integers >= 1 summing to {total}" +
                             (f", each a multiple of {self.multiple}" if self.multiple > 1 else ""))
        placement = self.plan.placement if plan.get("placement") is None else \
            self._check_placement(version, plan["placement"])
        return Plan(version=version, microbatch_split=tuple(split), checkpoint=plan.get("checkpoint", False),
                    placement=placement)

    def _check_placement(self, version: int, placement) -> tuple[tuple[int, int], ...]:
        """A plan's placement: a [replica, stage] pair per rank, each cell of the grid once."""
        dp, pp = len(self.replicas), len(self.replicas[0])
        grid = [(d, s) for d in range(dp) for s in range(pp)]
        cells = []
        for cell in placement if isinstance(placement, list) else ():
            if isinstance(cell, list) and len(cell) == 2 and all(type(x) is int for x in cell):
                cells.append((cell[0], cell[1]))
        if not isinstance(placement, list) or len(cells) != len(placement) or sorted(cells) != grid:
            raise ValueError(f"plan {version}: placement is not {dp * pp} [replica, stage] pairs covering "
                             f"the {dp} x {pp} grid once each")
        return tuple(cells)

    def _tell(self, key: str, value: dict) -> None:
        try:
            if self._client is not None:
                self._client.set(key, json.dumps(value))
        except Exception as exc:  # noqa: BLE001  (the board is best effort)
            self._warn_once("tell", f"greyhound: mitigation: cannot write {key} ({exc})")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)
