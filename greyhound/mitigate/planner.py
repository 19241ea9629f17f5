"""The master's side of mitigation: validated verdicts in, plans on the job's Redis out.

S2 (micro-batch re-split), the first rung of the ladder that costs anything: a
validated compute straggler slows its whole DP replica (a pipeline runs at its slowest
stage's pace), so the replicas' seconds per micro-batch are their slowest members'
measured slowness (the GEMM in the straggler's own process, against the other ranks')
and the solver (microbatch.split_microbatches) moves micro-batches from the slow
replica to the others, exactly. The training processes apply the plan at their next
step boundary (training.py).

Its cost is about one step (nothing pauses; the next step runs the new split), so the
ladder's rule (escalate when the loss so far reaches the next level's cost) takes it
at the first validated verdict; the event says so with its numbers.

Stepping back: while the plan is in force the job's iteration time no longer shows the
straggler (that is the point: the replicas are balanced, and when the straggler
recovers the other replica, now with more micro-batches, still sets the pace), so its
end is read from the straggler's own work per iteration outside communication (the
agents' ``compute_s``): measured once the plan has settled (the fail-slow still on),
then watched; a drop by ``end_drop`` held for ``end_s`` seconds of polls is its end, and the
job's own split returns. That work changes with the split by a share each job decides
(linear in micro-batches on a GPU-bound stage, flat where per-step work dominates, as
in the CPU reference job), so it is compared with itself under the same plan only; and
a drop, not a level: the figures right around a plan and a pause mix regimes (judged
against the work before the plan, a recovery was called while the straggler was
still 1.5x slow). A fail-slow that ends before the plan settles gives no drop: the
straggler's settled level is already healthy. So the straggler is also compared with
what a healthy rank of its stage does at its micro-batches under the plan, read off a
line through a healthy peer's work (the same stage in another replica) before and
under the plan (:func:`healthy_work_s`); within ``end_drop`` of it is recovered too.
Without that, a plan that came late stayed to the end of the job (13,3 on the local
cluster: the job 1.26x slower than on its own split).

S3 (a new placement, moved in memory): for a validated link fail-slow, the placement
that moves the job's heavy traffic off the slow link (placement.py); for several compute
stragglers, the exchanges that gather them into the fewest replicas (gather.py) or the
stage moves that consolidate them into the fewest stages (placement.py), whichever runs
faster with S2's split for it on a 1F1B model (gather.choose_straggler_plan): gathering
where S2 can move micro-batches, one stage where the job's replicas must keep multiples
of the pipeline depth (the layout's ``microbatch_multiple``, which S2 keeps too). All
wait until the loss reaches the move's cost. A link verdict with a
compute straggler clearly slow beside it (a compound fail-slow) gets the move first
and S2 for the straggler once the move is made, over the replicas it made.

S4 (checkpoint and requeue without the bad node), for what S2 cannot help: a validated
link fail-slow named at one node, or a compute straggler in a job that cannot re-split
(it does not call greyhound.mitigate, or has one replica) or that no split helps (a
mild one: 10% slower under 8 + 8 micro-batches, the even split is already the best;
a plan that changed nothing would cost a switch and report a mitigation).
Ski-rental: the job keeps running slow while the time lost so far is below what a restart costs (the job's own
start-up, measured from the control plane's start to every rank's first iteration,
plus Slurm's hold on a requeued job and one step for the checkpoint); once the loss
reaches the cost (break-even: never more than twice the better of the two choices in
hindsight), a plan asks the training processes for a checkpoint, and when rank 0 says
it is saved the master requeues the job without the node (slurm_client's
requeue_excluding). It does not when the partition would have too few usable nodes
left for the job (a job excluded from the nodes it needs would wait for ever), when
the admin or the user turned S4 off, or when the slowdown ends first. After an S3 move
it waits for the move's judge, so the loss is reckoned at the pace the move left.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import numpy as np

from greyhound.control import store
from greyhound.control.agent import polls_in
from greyhound.control.events import append_event
from greyhound.control.profile import cpu_wait_slowness, job_pace_s
from greyhound.mitigate import topology
from greyhound.mitigate.gather import choose_straggler_plan, gather_stragglers
from greyhound.mitigate.microbatch import makespan, replica_seconds, split_microbatches
from greyhound.mitigate.placement import plan_placement
from greyhound.control.store import MITIGATION_WATCH as WATCH_KEY
from greyhound.control.store import PLAN as PLAN_KEY
from greyhound.control.store import TRAINING_APPLIED as APPLIED_KEY
from greyhound.control.store import TRAINING_CHECKPOINTED as CHECKPOINTED_KEY
from greyhound.control.store import TRAINING_LAYOUT as LAYOUT_KEY
from greyhound.control.store import TRAINING_PROGRESS as PROGRESS_KEY
from greyhound.control.store import TRAINING_RELAID as RELAID_KEY
from greyhound.slurm_client import COMMENT_MAX_LEN, DEFAULT_CRED_EXPIRE_S

log = logging.getLogger(__name__)



@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlannerConfig:
    end_drop: float = 1.3
    """A straggler whose work per iteration fell by this factor from its level under
    the plan has recovered (the figure varies by about 15% from poll to poll)."""
    end_s: float = 3.0
    """Seconds (of consecutive polls) it must stay so before the job's own split returns."""
    settle_s: float = 20.0
    """Seconds (of polls) after a plan is applied before its effect is judged: the new
    split changes the calls of an iteration, the trackers lock on again (16
    iterations), and the agents' recent figures cover 5 s after that (12 s were too
    few once: the straggler's figure still fell as its window filled, and read as a
    recovery)."""

    requeue: bool = True
    """S4 allowed (the admin's plugstack ``requeue=off`` or the user's
    ``--greyhound=mitigate,requeue=off`` turn it off)."""
    requeue_hold_s: float = DEFAULT_CRED_EXPIRE_S
    """Slurm's hold on a requeued job before it may start again (its begin time): the
    control plane asks the cluster (``SlurmClient.requeue_hold_s``); this default is
    Slurm's own."""
    checkpoint_s: float = 120.0
    """Seconds (of polls) to wait for the checkpoint S4 asked for; then S4 is given up."""
    relayout_s: float = 120.0
    """Seconds (of polls) to wait for the training side to apply an S3 placement; then
    S3 is given up."""
    judge_s: float = 10.0
    """Seconds (of polls) after an S3 move over which the job's own steps
    (``training:progress``) say what the move did."""
    undo_ratio: float = 1.1
    """A move after which the job's steps take this much longer than right before it
    is moved back (the model behind it was wrong for this job), and S3 rests until the
    slowdown ends: on the local cluster, consolidating two CPU-throttled stragglers into
    one stage took the job from 0.59 s a step to 1.38 s, where the model said 16.4 ->
    15.9."""

    def __post_init__(self) -> None:
        if not self.end_drop > 1:
            raise ValueError(f"end_drop={self.end_drop} must be > 1")
        if not (self.end_s > 0 and self.settle_s >= 0 and self.checkpoint_s > 0 and self.relayout_s > 0
                and self.judge_s > 0):
            raise ValueError("end_s, checkpoint_s, relayout_s and judge_s must be > 0 and settle_s >= 0")
        if not self.undo_ratio > 1:
            raise ValueError(f"undo_ratio={self.undo_ratio} must be > 1")


S3_MAX_BRANCHES = 20_000
"""Branches the exact placement search may take on the master (well under a second:
the master's loop waits for it); a bigger instance is refused, with an event."""


ASSUMED_BANDWIDTH_BPS = 1e9
"""Link bandwidth (B/s) a stage move's cost is estimated with before any validation
measured the job's links (each verdict's P2P tests do; a move then measures itself)."""


def _multiple(layout: dict) -> int:
    """What every replica's micro-batch count must stay a multiple of (the job says)."""
    return int(layout.get("microbatch_multiple") or 1)


def restart_cost_s(*, startup_s: float, hold_s: float, step_s: float) -> float:
    """What S4 costs the job: its start-up again, Slurm's hold, one step to checkpoint."""
    return startup_s + hold_s + step_s


def s4_nodes(verdict: dict) -> list[str]:
    """The node S4 would leave out for a validated verdict: a link fail-slow named at
    one node, or a compute straggler's node; [] when there is no single node to blame."""
    if not verdict.get("validated") or verdict.get("kind") not in ("link", "compute"):
        return []
    nodes = list(verdict.get("nodes") or [])
    return nodes if len(nodes) == 1 else []


def recovered(now_s: float, settled_s: float, drop: float) -> bool:
    """Whether a straggler's work per iteration fell by ``drop`` from its level under
    the plan with the fail-slow on."""
    return now_s * drop < settled_s


def healthy_work_s(*, peer_base_s: float, peer_now_s: float, peer_before: int, peer_now: int,
                   microbatches: int) -> float:
    """A stage's healthy work per iteration at ``microbatches``, from a healthy peer
    (the same stage in another replica): its work at ``peer_before`` micro-batches
    (before the plan) and at ``peer_now`` (under it), as fixed + per-micro-batch work
    (a line through the two; the slope no less than 0, the fixed part no less than 0:
    noise on a machine where per-step work dominates gives a flat or falling line)."""
    per = max(0.0, (peer_now_s - peer_base_s) / (peer_now - peer_before)) if peer_now != peer_before else 0.0
    fixed = max(0.0, peer_now_s - peer_now * per)
    return fixed + microbatches * per


class Planner:
    """Runs on the master; see the module docstring."""

    def __init__(self, client, run_dir: str | Path, *, config: PlannerConfig | None = None,
                 job: dict | None = None, slurm=None, poll_s: float = 1.0) -> None:
        """``job``: this job's id, partition and node count (from the plane's Slurm
        environment; None: no S4); ``slurm``: the Slurm client S4 requeues with;
        ``poll_s``: the plane's poll interval (the planner is called once a poll)."""
        self.client = client
        self.run_dir = Path(run_dir)
        self.config = config or PlannerConfig()
        self._end_polls, self._settle_polls, self._checkpoint_polls, self._relayout_polls, self._judge_polls = (
            polls_in(seconds, poll_s) for seconds in (self.config.end_s, self.config.settle_s,
                                                      self.config.checkpoint_s, self.config.relayout_s,
                                                      self.config.judge_s))
        self.job = job
        self.slurm = slurm
        self.started_s = time.time()
        self.startup_s: float | None = None
        """Seconds from the planner's start (the control plane's) to every rank's first iteration."""
        self.s4: dict | None = None
        """The S4 candidate: ``nodes``, ``why``; ``version`` once its checkpoint is asked for."""
        self.version = 0
        self.stragglers: dict[int, float] = {}
        """rank -> measured slowness, while a plan is in force."""
        self.work: dict[int, dict[str, float]] = {}
        """rank -> its work per iteration: ``base`` (healthy), ``before`` (the plan),
        ``settled`` (under the plan, the fail-slow on); for the record and status."""
        self.s3: dict | None = None
        """The S3 candidate: ``plan`` (placement.PlacementPlan), ``cost_s``, ``why``;
        ``version`` once it is published."""
        self.relaid_s: float | None = None
        """The pause the job's last S3 move took (measured on the job)."""
        self.judged: dict | None = None
        """The S3 move being judged: its ``version``, the job's ``before_s`` a step right
        before it, the placement and split to go back to, the first ``progress`` after it."""
        self.s3_rests = False
        """A move was undone: no S3 until the slowdown ends."""
        self.link_bandwidth_Bps = ASSUMED_BANDWIDTH_BPS
        """The healthy bandwidth of the job's links, as the last validation measured it."""
        self._polls_applied = 0
        self._recovered_polls = 0
        self.peers: dict[int, dict] = {}
        """straggler -> its ``replica`` and its healthy ``peers`` (the same stage in other
        replicas) -> their ``replica``, ``base`` work per iteration and micro-batches
        ``before`` the plan; as the plan was made."""

    @property
    def idle(self) -> bool:
        """Nothing in force or pending: no plan watched, no rung waiting for its loss,
        no move being judged (the agents then need not publish every poll)."""
        return not (self.stragglers or self.s3 or self.s4 or self.judged) and self.startup_s is not None

    def _replicas(self, layout: dict, applied: dict) -> list[list[int]]:
        """The ranks of each replica's stages under the placement in force."""
        return topology.pipelines(topology.placement_now(layout, applied))

    def _peers_before(self, layout: dict, ranks: dict) -> None:
        """Each straggler's healthy peers as the plan is made: their healthy work and
        their replica's micro-batches, where the line of :func:`healthy_work_s` starts."""
        applied = self._applied()
        replicas = self._replicas(layout, applied)
        split = applied.get("microbatch_split") or layout["microbatch_split"]
        self.peers = {}
        for rank in self.stragglers:
            mine = next((d for d, members in enumerate(replicas) if rank in members), None)
            if mine is None:
                continue
            stage = replicas[mine].index(rank)
            peers = {}
            for d, members in enumerate(replicas):
                peer = members[stage]
                if peer in self.stragglers:
                    continue
                # Its baseline (the 30 s before its last 5): the recent figure of a rank
                # read around a validation pause was often 0 or missing.
                try:
                    base = float(ranks[peer]["compute_base_s"])
                except (KeyError, TypeError, ValueError):
                    continue
                if base > 0:
                    peers[peer] = {"base": base, "before": int(split[d]), "replica": d}
            self.peers[rank] = {"replica": mine, "peers": peers}

    def _back_to_healthy(self, rank: int, compute: dict[int, float], split: list | None) -> bool:
        """The straggler does what a healthy peer's line says a healthy rank does at its
        micro-batches under the plan's ``split`` (within ``end_drop``). Unlike a drop from
        its settled level, this holds when the fail-slow ended before the plan settled
        (the settled level was then already healthy, and the plan stayed to the end of
        the job)."""
        mine = self.peers.get(rank)
        if not split or mine is None:
            return False
        expected = [healthy_work_s(peer_base_s=p["base"], peer_now_s=compute[peer], peer_before=p["before"],
                                   peer_now=int(split[p["replica"]]), microbatches=int(split[mine["replica"]]))
                    for peer, p in mine["peers"].items() if peer in compute]
        return bool(expected) and compute[rank] <= self.config.end_drop * float(np.median(expected))

    def _layout(self) -> dict | None:
        raw = self.client.get(LAYOUT_KEY)
        return json.loads(raw) if raw else None

    def _applied(self) -> dict:
        raw = self.client.get(APPLIED_KEY)
        return json.loads(raw) if raw else {}

    def on_verdict(self, verdict: dict, ranks: dict) -> None:
        """A validated compute straggler (the verdict's lead or one beside it): S2. A
        validated link fail-slow: an S3 candidate, and S2 for a compute straggler
        clearly slow beside it once the move is made. What neither can help: an S4
        candidate."""
        found = _compute_findings(verdict, ranks)
        if verdict.get("link_bandwidth_Bps"):
            self.link_bandwidth_Bps = float(verdict["link_bandwidth_Bps"])
        layout = self._layout()
        validated = bool(verdict.get("validated"))
        if validated and verdict.get("kind") == "link" and layout is not None:
            slow, bandwidth = topology.slow_links_of(verdict)
            if slow and bandwidth and self.s3 is None:
                self._s3_candidate(layout, ranks, bandwidth=bandwidth, slow_links=slow,
                                   why=f"link fail-slow at {verdict.get('where')}")
                if found and self.s3 is not None:
                    # S2's split follows the move: made now, over the replicas before it,
                    # it would stay with replicas the move reshuffles.
                    self.s3["then_s2"] = {"found": found, **_findings_place(verdict, found)}
                    found = {}
        takes_s2 = validated and bool(found) and layout is not None and len(layout["replicas"]) >= 2
        if not takes_s2 or verdict.get("kind") == "link":      # a link stays S4's candidate beside S2
            nodes = s4_nodes(verdict)
            if nodes and self.s4 is None:
                self.s4 = {"nodes": nodes, "why": f"{verdict['kind']} fail-slow at {verdict.get('where')}"}
        if not takes_s2:
            if found and validated:
                append_event(self.run_dir, "mitigation_skipped", level="S2",
                             why="the training processes do not call greyhound.mitigate (no layout on the board)"
                             if layout is None else "the job has one DP replica: nothing to re-split")
            return
        assert layout is not None   # takes_s2 says so
        self._s2(layout, ranks, found, **_findings_place(verdict, found))

    def _s2(self, layout: dict, ranks: dict, found: dict[int, float], *, nodes: list[str], where: str) -> None:
        """S2 for the compute stragglers ``found`` (rank -> slowness) at ``where`` (on
        ``nodes``), over the placement in force; S3 gathers them where they are several."""
        if not self.stragglers and len(found) == 1:
            default = self._current_split(layout)
            plan, _ = self._best_split(layout, found)
            if list(plan.allocation) == default:
                # A mild straggler (a 10% slower GPU under 8 + 8 micro-batches): moving
                # one micro-batch costs more than it saves. A plan that changes nothing
                # would cost a switch and report a mitigation; the ladder's next rungs
                # stay open to it.
                append_event(self.run_dir, "mitigation_skipped", level="S2", microbatch_split=default,
                             why=f"straggler {_ranks_text(found)}: no split of the {sum(default)} micro-batches "
                                 f"is faster than {default}")
                if len(nodes) == 1 and self.s4 is None:
                    self.s4 = {"nodes": nodes, "stragglers": sorted(found),
                               "why": f"compute fail-slow at {where}, which no micro-batch split helps"}
                return
        if self.s4 is not None and "version" not in self.s4 and set(self.s4.get("stragglers", ())) & set(found):
            self.s4 = None      # slower now, S2 helps it: the lower rung first
        self.stragglers.update(found)
        # Every straggler's work is measured again around the new plan (an earlier
        # straggler's healthy base stays what it was before its fail-slow). A figure
        # may be missing (a rank 5x slow finishes too few iterations in the agent's
        # recent window to have one): it is watched all the same, from the figures it
        # has under the plan (unwatched, its plan stayed to the end of the job).
        for rank in self.stragglers:
            state = ranks.get(rank, {})
            work = {"base": self.work[rank]["base"]} if "base" in self.work.get(rank, {}) else {}
            for key, field in (("base", "compute_base_s"), ("before", "compute_s")):
                try:
                    work.setdefault(key, float(state[field]))
                except (KeyError, TypeError, ValueError):
                    pass
            self.work[rank] = work
        self._peers_before(layout, ranks)
        current = self._current_split(layout)
        if len(self.stragglers) > 1 and list(self._best_split(layout, self.stragglers)[0].allocation) == current:
            # Stragglers in every replica, or a job whose replicas keep multiples of the
            # pipeline's depth: no split helps, a placement may.
            append_event(self.run_dir, "mitigation_skipped", level="S2", microbatch_split=current,
                         why=f"stragglers {_ranks_text(self.stragglers)}: no split of the {sum(current)} "
                             f"micro-batches is faster than {current}")
        else:
            self._publish(layout, ranks, why=f"compute straggler(s) {_ranks_text(self.stragglers)}")
        if len(self.stragglers) > 1:     # S3: gathered into fewer replicas or stages, the next rung
            self._s3_stragglers(layout, ranks, why=f"compute stragglers {_ranks_text(self.stragglers)}")

    def poll(self, ranks: dict) -> None:
        """Every poll: the job's start-up time; S4's ski-rental; while an S2 plan is in
        force, has the straggler recovered?"""
        if self.startup_s is None and ranks and all(int(s.get("iterations") or 0) > 0 for s in ranks.values()):
            self.startup_s = time.time() - self.started_s
        if self.s3_rests and slow_loss(ranks)[0] is None:
            self.s3_rests = False           # the slowdown ended: S3 may serve the next one
        if self.judged is not None:
            self._judge(ranks)
        if self.s3 is not None:
            self._s3_poll(ranks)
        if self.s4 is not None and self.s3 is None and self.judged is None:
            # The ladder: S3 first where it can help, and S4 once the move's effect shows
            # (its judge): the loss so far is then reckoned at the pace after the move. On
            # the local cluster S4 came 2 s after a move, before it could show, when the
            # loss before it already exceeded the restart's cost.
            self._s4_poll(ranks)
        applied = self._applied()
        if not self.stragglers or int(applied.get("version", 0)) != self.version:
            return
        self._polls_applied += 1
        if self._polls_applied <= self._settle_polls:
            return
        compute = {int(r): float(s["compute_s"]) for r, s in ranks.items() if s.get("compute_s") not in (None, "")}
        watched = {r: w for r, w in self.work.items() if r in compute}
        for rank, work in watched.items():
            work.setdefault("settled", compute[rank])
        ended = bool(watched) and len(watched) == len(self.stragglers) and all(
            recovered(compute[r], w["settled"], self.config.end_drop)
            or self._back_to_healthy(r, compute, applied.get("microbatch_split"))
            for r, w in watched.items())
        self._recovered_polls = self._recovered_polls + 1 if ended else 0
        self.client.set(WATCH_KEY, json.dumps({"version": self.version, "recovered_polls": self._recovered_polls,
                                               "work": {str(r): {**w, "now": compute.get(r)}
                                                        for r, w in self.work.items()}}))
        if self._recovered_polls >= self._end_polls:
            layout = self._layout()
            if layout is None:
                return
            raw = self.client.get(PLAN_KEY)
            ending = (json.loads(raw) if raw else {}).get("level") or "S2"    # S3 when a move carried the split
            self.version += 1
            self._write_plan(layout["microbatch_split"], level="S1", why="the straggler(s) recovered")
            append_event(self.run_dir, "mitigation_ended", level=ending, version=self.version,
                         microbatch_split=layout["microbatch_split"],
                         work={str(r): {k: round(v, 4) for k, v in w.items()} for r, w in watched.items()})
            self.stragglers.clear()
            self.work.clear()

    def _judge(self, ranks: dict) -> None:
        """The S3 move just made, by the job's own steps over ``judge_s`` (training
        rank 0's ``training:progress``): moved back when they take ``undo_ratio`` times
        as long as right before it. A model is only a model: the job says."""
        judged = self.judged
        assert judged is not None
        raw = self.client.get(PROGRESS_KEY)
        progress = json.loads(raw) if raw else None
        if progress is None:                # a job that does not report its steps: not judged
            self.judged = None
            return
        judged["polls"] += 1
        if "progress" not in judged:
            judged["progress"] = progress
            return
        if judged["polls"] <= self._judge_polls:
            return
        self.judged = None
        first = judged["progress"]
        steps, seconds = int(progress["step"]) - int(first["step"]), float(progress["time"]) - float(first["time"])
        after_s = seconds / steps if steps > 0 else math.inf
        if after_s <= judged["before_s"] * self.config.undo_ratio:
            return
        layout = self._layout()
        if layout is None:
            return
        self.version += 1
        why = (f"the move made the job slower: {after_s:.3g} s a step over {seconds:.1f} s after it, "
               f"{judged['before_s']:.3g} s right before; moved back")
        self.client.set(PLAN_KEY, json.dumps({"version": self.version, "microbatch_split": judged["split"],
                                              "level": "S3", "why": why, "placement": judged["placement"]}))
        append_event(self.run_dir, "mitigation_undone", level="S3", version=self.version, undoes=judged["version"],
                     why=why, before_step_s=round(judged["before_s"], 4),
                     after_step_s=round(after_s, 4) if math.isfinite(after_s) else None,
                     placement=judged["placement"], microbatch_split=judged["split"])
        # The way back is a move too: its pause is logged when the training side applies it.
        self.s3 = {"version": self.version, "plan": None, "why": why, "cost_s": 0.0, "polls": 0}
        self.s3_rests = True
        self._polls_applied = self._recovered_polls = 0
        for work in self.work.values():
            work.pop("settled", None)

    def _s4_poll(self, ranks: dict) -> None:
        s4 = self.s4
        assert s4 is not None
        if "version" in s4:
            self._s4_requeue(s4)
            return
        loss_s, step_s = slow_loss(ranks)
        if loss_s is None:                 # the slowdown ended: nothing to pay for
            self.s4 = None
            return
        cost_s = restart_cost_s(startup_s=self.startup_s or 0.0, hold_s=self.config.requeue_hold_s,
                                step_s=step_s or 0.0)
        if loss_s < cost_s:
            return
        layout = self._layout()
        why = self._s4_refused(s4["nodes"], layout)
        if why:
            append_event(self.run_dir, "mitigation_skipped", level="S4", why=why, loss_s=loss_s,
                         cost_s=round(cost_s, 3))
            self.s4 = None
            return
        assert layout is not None    # _s4_refused said so
        self.version += 1
        s4.update(version=self.version, polls=0, loss_s=loss_s, cost_s=round(cost_s, 3))
        split = self._current_split(layout)
        self.client.set(PLAN_KEY, json.dumps({"version": self.version, "microbatch_split": split,
                                              "checkpoint": True, "level": "S4", "why": s4["why"]}))
        append_event(self.run_dir, "mitigation", level="S4", version=self.version, why=s4["why"],
                     action=f"checkpoint, then requeue without {','.join(s4['nodes'])}", nodes=s4["nodes"],
                     loss_s=loss_s, cost_s=round(cost_s, 3))

    def _s3_candidate(self, layout: dict, ranks: dict, *, bandwidth: float, why: str, slow_links: dict) -> None:
        """The placement that moves the job's traffic off slow links (placement.py, on
        the step's traffic and compute as the agents measured them); the candidate waits
        for its cost in loss."""
        if self.s3 is not None or self.s3_rests:
            return
        placement = topology.placement_now(layout, self._applied())
        replicas = topology.pipelines(placement)
        try:
            nodes = [str(ranks[r]["node"]) for r in range(len(placement))]
            model = topology.step_model(store.read_comm_stats(self.client, range(len(placement))), ranks,
                                        placement, bandwidth=bandwidth)
            plan = plan_placement(dp=len(replicas), pp=len(replicas[0]), node_of_rank=nodes, model=model,
                                  placement=placement, slow_links=slow_links, max_branches=S3_MAX_BRANCHES)
        except (KeyError, ValueError) as exc:
            append_event(self.run_dir, "mitigation_skipped", level="S3", why=f"no placement to plan: {exc}")
            return
        self._s3_propose(plan, model, ranks, why=why)

    def _s3_stragglers(self, layout: dict, ranks: dict, *, why: str) -> None:
        """S3 for compute stragglers: the DP-rank exchanges that gather them into the
        fewest replicas (gather.py), or the stage moves that consolidate them into the
        fewest stages (placement.py), each with S2's split for it, whichever is faster
        than the placement in force under its split (gather.choose_straggler_plan); the
        candidate waits for its cost in loss."""
        if self.s3 is not None or self.s3_rests:
            return
        placement = topology.placement_now(layout, self._applied())
        total, multiple = sum(layout["microbatch_split"]), _multiple(layout)
        replicas = topology.pipelines(placement)
        try:
            gathered, _ = gather_stragglers(placement, stragglers=self.stragglers, microbatches=total,
                                            multiple=multiple)
            model = topology.step_model(store.read_comm_stats(self.client, range(len(placement))), ranks,
                                        placement, bandwidth=self.link_bandwidth_Bps)
            consolidated = plan_placement(dp=len(replicas), pp=len(replicas[0]), placement=placement,
                                          node_of_rank=[str(ranks[r]["node"]) for r in range(len(placement))],
                                          model=model, stragglers=self.stragglers, max_branches=S3_MAX_BRANCHES)
            plan, split = choose_straggler_plan(placement, [gathered, consolidated], stragglers=self.stragglers,
                                                microbatches=total, multiple=multiple)
        except (KeyError, ValueError) as exc:
            append_event(self.run_dir, "mitigation_skipped", level="S3", why=f"no placement to plan: {exc}")
            return
        self._s3_propose(plan, model if plan.moves else None, ranks, why=why, split=list(split))

    def _s3_propose(self, plan, model, ranks: dict, *, why: str, **extra) -> None:
        """A plan that beats the current placement becomes the S3 candidate, with the
        move's cost (topology.move_cost_s; ``model`` None for a plan that moves no
        stage) and ``extra`` (a gathering's ``split``); one that does not, an event."""
        if not plan.improves:
            append_event(self.run_dir, "mitigation_skipped", level="S3", why=plan.reason)
            return
        _, step_s = slow_loss(ranks)
        cost_s = topology.move_cost_s(plan, model, step_s=step_s or 0.0, measured_s=self.relaid_s)
        self.s3 = {"plan": plan, "why": why, "cost_s": round(cost_s, 3), "polls": 0, **extra,
                   "cost_is": "measured" if self.relaid_s is not None else "estimated"}

    def _s3_poll(self, ranks: dict) -> None:
        """S3's ski-rental: the placement once the loss reaches the move's cost; then
        the pause the move took, as the training side measured it."""
        s3 = self.s3
        assert s3 is not None
        if "version" in s3:
            raw = self.client.get(RELAID_KEY)
            relaid = json.loads(raw) if raw else {}
            if relaid.get("version") == s3["version"]:
                self.relaid_s = float(relaid["pause_s"])
                append_event(self.run_dir, "relaid", level="S3", version=s3["version"], step=relaid.get("step"),
                             pause_s=self.relaid_s, bytes=relaid.get("bytes"), cost_s=s3["cost_s"])
                self.s3 = None
                if "back" in s3:
                    self.judged = {"version": s3["version"], "polls": 0, **s3["back"]}
                if "then_s2" in s3 and (layout := self._layout()) is not None:   # over the replicas the move made
                    then = s3["then_s2"]
                    self._s2(layout, ranks, then["found"], nodes=then["nodes"], where=then["where"])
            else:
                s3["polls"] += 1
                if s3["polls"] > self._relayout_polls:
                    append_event(self.run_dir, "mitigation_skipped", level="S3", why=(
                        f"the training side applied no placement within {self.config.relayout_s:.0f} s"))
                    self.s3 = None
            return
        loss_s, _ = slow_loss(ranks)
        if loss_s is None:                 # the slowdown ended: nothing to pay for
            self.s3 = None
            return
        if loss_s < s3["cost_s"]:
            return
        layout = self._layout()
        if layout is None:
            self.s3 = None
            return
        plan = s3["plan"]
        self.version += 1
        s3["version"] = self.version
        previous = self._current_split(layout)
        split = s3.get("split") or previous
        before_s = job_pace_s(ranks)
        if before_s is not None:      # what to judge the move by, and go back to
            s3["back"] = {"before_s": before_s, "split": previous,
                          "placement": [list(c) for c in topology.placement_now(layout, self._applied())]}
        self.client.set(PLAN_KEY, json.dumps({
            "version": self.version, "microbatch_split": split, "level": "S3",
            "why": s3["why"], "placement": [list(cell) for cell in plan.placement]}))
        modelled = [round(plan.cost_before, 4), round(plan.cost_after, 4)]
        append_event(self.run_dir, "mitigation", level="S3", version=self.version, why=s3["why"],
                     action=plan.reason, placement=[list(cell) for cell in plan.placement],
                     moves=[[m.rank, m.from_stage, m.to_stage] for m in plan.moves],
                     **({"microbatch_split": split, "previous": previous, "modelled_step_microbatches": modelled}
                        if "split" in s3 else {"modelled_step_s": modelled}),
                     loss_s=loss_s, cost_s=s3["cost_s"], cost_is=s3["cost_is"],
                     solve_seconds=round(plan.solve_seconds, 6))
        if "split" in s3:
            # The stragglers changed replica and their replicas' micro-batches: their work
            # under the plan is measured again once it settles, and the healthy peers'
            # line (drawn in the old replicas) no longer applies.
            self._polls_applied = self._recovered_polls = 0
            for work in self.work.values():
                work.pop("settled", None)
            self.peers = {}

    def _s4_refused(self, nodes: list[str], layout: dict | None) -> str | None:
        """Why S4 may not run now (None: it may)."""
        if not self.config.requeue:
            return "S4 (requeue) is turned off for this job"
        if self.job is None or self.slurm is None:
            return "the control plane does not know its Slurm job"
        if layout is None:
            return "the training processes do not call greyhound.mitigate: nobody would save a checkpoint"
        try:
            usable = self.slurm.schedulable_nodes(self.job["partition"])
        except Exception as exc:  # noqa: BLE001  (S4 is given up, never the job)
            return f"cannot list the partition's nodes ({exc})"
        left = [n for n in usable if n not in nodes]
        if len(left) < int(self.job["num_nodes"]):
            return (f"partition {self.job['partition']} would keep {len(left)} usable node(s) without "
                    f"{','.join(nodes)}; the job needs {self.job['num_nodes']}")
        return None

    def _s4_requeue(self, s4: dict) -> None:
        raw = self.client.get(CHECKPOINTED_KEY)
        saved = json.loads(raw) if raw else {}
        if saved.get("version") != s4["version"]:
            s4["polls"] += 1
            if s4["polls"] > self._checkpoint_polls:
                append_event(self.run_dir, "mitigation_skipped", level="S4",
                             why=f"no checkpoint within {self.config.checkpoint_s:.0f} s")
                self.s4 = None
            return
        if saved.get("step") is None:
            append_event(self.run_dir, "mitigation_skipped", level="S4",
                         why=f"the job saved no checkpoint ({saved.get('why') or 'no reason given'})")
            self.s4 = None
            return
        nodes = s4["nodes"]
        note = (f"greyhound S4: requeued without {','.join(nodes)} after step {saved['step']} "
                f"({s4['why']}; lost {s4['loss_s']:.0f} s >= restart cost {s4['cost_s']:.0f} s)")
        append_event(self.run_dir, "requeued", nodes=nodes, step=saved["step"], why=s4["why"],
                     loss_s=s4["loss_s"], cost_s=s4["cost_s"])
        self.s4 = None
        job, slurm = self.job, self.slurm
        assert job is not None and slurm is not None    # _s4_refused said so
        try:
            # The job's record says it too, after the user's own comment (a note of
            # its own: the post-mortem's "greyhound:" summary replaces only its own).
            existing = slurm.job(job["id"]).comment
            slurm.set_comment(job["id"], (f"{existing} | {note}" if existing else note)[:COMMENT_MAX_LEN])
        except Exception:  # the note is best effort
            log.debug("cannot set the job's comment", exc_info=True)
        try:
            slurm.requeue_excluding(job["id"], nodes)   # Slurm ends this job's steps, this one too
        except Exception as exc:  # noqa: BLE001  (the job runs on where it is)
            append_event(self.run_dir, "mitigation_skipped", level="S4", why=f"requeue failed: {exc}")

    def _current_split(self, layout: dict) -> list[int]:
        """The split in force: the last plan's, else the job's own."""
        raw = self.client.get(PLAN_KEY)
        return list(json.loads(raw)["microbatch_split"] if raw else layout["microbatch_split"])

    def _best_split(self, layout: dict, stragglers: dict[int, float]):
        """S2's exact split for these stragglers under the placement in force, and the
        replicas' seconds per micro-batch it was solved for."""
        times = replica_seconds(self._replicas(layout, self._applied()), stragglers)
        return split_microbatches(times, total=sum(layout["microbatch_split"]), multiple=_multiple(layout)), times

    def _publish(self, layout: dict, ranks: dict, *, why: str) -> None:
        default = list(layout["microbatch_split"])
        plan, times = self._best_split(layout, self.stragglers)
        self.version += 1
        self._polls_applied = self._recovered_polls = 0
        self._write_plan(list(plan.allocation), level="S2", why=why)
        loss_s, step_s = slow_loss(ranks)
        append_event(self.run_dir, "mitigation", level="S2", version=self.version, why=why,
                     microbatch_split=list(plan.allocation), previous=default,
                     expected_speedup=round(makespan(default, times) / plan.makespan, 3),
                     loss_s=loss_s, cost_s=step_s, solve_seconds=round(plan.solve_seconds, 6))

    def _write_plan(self, split: list[int], *, level: str, why: str) -> None:
        self.client.set(PLAN_KEY, json.dumps({"version": self.version, "microbatch_split": split,
                                              "level": level, "why": why}))


def slow_loss(ranks: dict) -> tuple[float | None, float | None]:
    """(seconds lost so far to the slowdown: slow iterations x (slow - healthy) time,
    one healthy step's seconds: S2's cost), medians over the ranks that report them."""
    losses, steps = [], []
    for s in ranks.values():
        try:
            base = float(s["baseline_s"])
            steps.append(base)
            if s.get("slow_since") not in (None, ""):
                losses.append((int(s["iterations"]) - int(s["slow_since"])) * (float(s["current_s"]) - base))
        except (KeyError, TypeError, ValueError):
            continue
    return (round(float(np.median(losses)), 3) if losses else None,
            round(float(np.median(steps)), 3) if steps else None)


BESIDE_LINK_GEMM_MIN = 4.0
"""The GEMM ratio a compute finding beside a link lead needs to be taken for S2: twice
the 2.2x a link at 1% of its bandwidth caused in the GEMM of a rank whose transfers it
held (the end-to-end benchmark's compound phase: 10x, a CPU quota)."""
UNMEASURED_GEMM_MIN = 2.0
"""The GEMM ratio a compute finding beside the lead needs when its rank has no work
figure of its own (the GEMM then stands alone)."""


def _compute_findings(verdict: dict, ranks: dict) -> dict[int, float]:
    """rank -> slowness of each compute finding of a verdict.

    Validated means its GEMM was slow; how slow its training work is, is the rank's own
    work per iteration now over before (profiling's rise, against the rank itself: the
    rise over the median rank's read 30x once, when the others' work fell) or its share
    of time with a CPU then over now, whichever says more (:func:`_own_slowness`), or the
    job's slowdown where the rank has no figure from before, at most its GEMM's ratio;
    the lead of a verdict that names no other finding at least the job's slowdown.
    Beside a link lead, a compute finding counts only with a GEMM of at least
    ``BESIDE_LINK_GEMM_MIN`` and a rise of its own: a link at 1% of its bandwidth slows
    the GEMM of a rank whose transfers it holds (measured 1.9x and 2.2x), and the job's
    slowdown is then the link's.
    """
    if verdict.get("kind") == "compute":
        findings = [verdict, *verdict.get("also", [])]
    elif verdict.get("kind") == "link":
        findings = [f for f in verdict.get("also", []) if float(f.get("strength") or 1.0) >= BESIDE_LINK_GEMM_MIN]
    else:
        return {}
    job_slowdown = float(verdict.get("severity") or 1.0)
    out = {}
    for finding in findings:
        if finding.get("kind") != "compute" or len(finding.get("ranks", [])) != 1:
            continue
        rank = int(finding["ranks"][0])
        gemm = float(finding.get("strength") or 1.0)
        rise = _own_slowness(ranks.get(rank, {}))
        if rise is not None and rise <= 1 and gemm >= UNMEASURED_GEMM_MIN and verdict.get("kind") == "compute":
            # Masked: its stage waits on a slower straggler's upstream of it in the same
            # pipeline, so it idles in calls, neither computing more nor waiting for a
            # CPU; its GEMM, in its own process, still reads its throttle (stages 1 and
            # 2 of one replica under CPU quotas: 9.7x both, its own figures 1.0x).
            rise = None
        if rise is None:
            if verdict.get("kind") == "link":
                continue        # beside a link, only a rank whose own work rose
            # No figure of its own from before (profiling named it by its share of
            # compute): the job's own slowdown, the pace its replica sets; beside the
            # lead, only for a GEMM clearly slow. A healthy rank's GEMM read 1.33x of
            # the slower reference on shared cores (scripts/demo): taken at the job's
            # 5.9x, S3 gathered the real straggler with it, and the plan outlived the
            # fail-slow (the healthy rank never "recovered").
            if finding is not verdict and gemm < UNMEASURED_GEMM_MIN:
                continue
            rise = job_slowdown
        if finding is verdict and not verdict.get("also"):
            # The one straggler of a job slows it at most as much as it is slowed
            # itself: the job's slowdown is a floor for its own (CI rehearsal: a CPU
            # quota, the job 3.99x slower, the rank's own figures 1.61x as its stops
            # fell inside calls; S2 split 10,6 for 1.61x and the job ran 0.436 s a
            # step against 0.460 s with nothing done).
            rise = max(rise, job_slowdown)
        slowness = min(rise, gemm)
        if slowness > 1:
            out[rank] = round(slowness, 3)
    return out


def _own_slowness(state: dict) -> float | None:
    """How much slower a rank runs now than before by its own figures: its work per
    iteration, or its share of time with a CPU, whichever says more (a throttled rank
    stopped inside its calls shows in the second only: one such rank's work read 0.3x
    and 0.98x its past; throttled ranks waited for a CPU 60-90% of their time, the
    others 1-3%); None without either."""
    figures = []
    try:
        figures.append(float(state["compute_s"]) / float(state["compute_base_s"]))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        pass
    try:
        figures.append(cpu_wait_slowness(float(state["cpu_wait"]), float(state["cpu_wait_base"])))
    except (KeyError, TypeError, ValueError):
        pass
    return max(figures) if figures else None


def _findings_place(verdict: dict, found: dict[int, float]) -> dict:
    """``nodes`` (the one node S4 would leave out, else none) and ``where`` of the
    compute findings of ``verdict`` whose rank is in ``found``."""
    mine = [f for f in [verdict, *verdict.get("also", [])]
            if f.get("kind") == "compute" and len(f.get("ranks", [])) == 1 and int(f["ranks"][0]) in found]
    nodes = sorted({str(n) for f in mine for n in f.get("nodes") or []})
    return {"nodes": nodes if len(nodes) == 1 else [],
            "where": ", ".join(str(f.get("where") or f"rank {f['ranks'][0]}") for f in mine)}


def _ranks_text(stragglers: dict[int, float]) -> str:
    return ", ".join(f"rank {r} at {s:.2f}x" for r, s in sorted(stragglers.items()))
