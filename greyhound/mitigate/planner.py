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
then watched; a drop by ``end_drop`` held for ``end_polls`` polls is its end, and the
job's own split returns. That work changes with the split by a share each job decides
(linear in micro-batches on a GPU-bound stage, flat where per-step work dominates, as
in the CPU reference job), so it is compared with itself under the same plan only; and
a drop, not a level: the figures right around a plan and a pause mix regimes (judged
against the work before the plan, a recovery was called while the straggler was
still 1.5x slow). A fail-slow that ends before the plan settles leaves the plan in
force until the job ends: it costs only the imbalance, never a wrong step back.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from greyhound.control.events import append_event
from greyhound.mitigate.microbatch import makespan, split_microbatches
from greyhound.control.store import MITIGATION_WATCH as WATCH_KEY
from greyhound.control.store import PLAN as PLAN_KEY
from greyhound.control.store import TRAINING_APPLIED as APPLIED_KEY
from greyhound.control.store import TRAINING_LAYOUT as LAYOUT_KEY

log = logging.getLogger(__name__)



@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlannerConfig:
    end_drop: float = 1.3
    """A straggler whose work per iteration fell by this factor from its level under
    the plan has recovered (the figure varies by about 15% from poll to poll)."""
    end_polls: int = 6
    """Consecutive polls it must stay so before the job's own split returns."""
    settle_polls: int = 40
    """Polls after a plan is applied before its effect is judged: the new split changes
    the calls of an iteration, the trackers lock on again (16 iterations), and the
    agents' recent figures cover 10 polls after that (24 polls were too few once: the
    straggler's figure still fell as its window filled, and read as a recovery)."""

    def __post_init__(self) -> None:
        if not self.end_drop > 1:
            raise ValueError(f"end_drop={self.end_drop} must be > 1")
        if self.end_polls < 1 or self.settle_polls < 0:
            raise ValueError("end_polls must be >= 1 and settle_polls >= 0")


def replica_seconds(replicas: Sequence[Sequence[int]], slowness: dict[int, float]) -> np.ndarray:
    """(dp,) relative seconds per micro-batch of each DP replica: its slowest member's
    slowness (1.0 for a healthy rank)."""
    return np.array([max((slowness.get(r, 1.0) for r in members), default=1.0) for members in replicas])


def recovered(now_s: float, settled_s: float, drop: float) -> bool:
    """Whether a straggler's work per iteration fell by ``drop`` from its level under
    the plan with the fail-slow on."""
    return now_s * drop < settled_s


class Planner:
    """Runs on the master; see the module docstring."""

    def __init__(self, client, run_dir: str | Path, *, config: PlannerConfig | None = None) -> None:
        self.client = client
        self.run_dir = Path(run_dir)
        self.config = config or PlannerConfig()
        self.version = 0
        self.stragglers: dict[int, float] = {}
        """rank -> measured slowness, while a plan is in force."""
        self.work: dict[int, dict[str, float]] = {}
        """rank -> its work per iteration: ``base`` (healthy), ``before`` (the plan),
        ``settled`` (under the plan, the fail-slow on); for the record and status."""
        self._polls_applied = 0
        self._recovered_polls = 0

    def _layout(self) -> dict | None:
        raw = self.client.get(LAYOUT_KEY)
        return json.loads(raw) if raw else None

    def _applied_version(self) -> int:
        raw = self.client.get(APPLIED_KEY)
        return int(json.loads(raw).get("version", 0)) if raw else 0

    def on_verdict(self, verdict: dict, ranks: dict) -> None:
        """A validated compute straggler (the verdict's lead or one beside it): S2."""
        found = _compute_findings(verdict, ranks)
        if not verdict.get("validated") or not found:
            return
        layout = self._layout()
        if layout is None:
            append_event(self.run_dir, "mitigation_skipped", level="S2",
                         why="the training processes do not call greyhound.mitigate (no layout on the board)")
            return
        self.stragglers.update(found)
        # Every straggler's work is measured again around the new plan (an earlier
        # straggler's healthy base stays what it was before its fail-slow).
        for rank in self.stragglers:
            state = ranks.get(rank, {})
            try:
                base = self.work[rank]["base"] if rank in self.work else float(state["compute_base_s"])
                self.work[rank] = {"base": base, "before": float(state["compute_s"])}
            except (KeyError, TypeError, ValueError):
                self.work.pop(rank, None)      # no figures: the plan stays until the job ends
        self._publish(layout, ranks, why=f"compute straggler(s) {_ranks_text(self.stragglers)}")

    def poll(self, ranks: dict) -> None:
        """Every poll while a plan is in force: has the straggler recovered?"""
        if not self.stragglers or self._applied_version() != self.version:
            return
        self._polls_applied += 1
        if self._polls_applied <= self.config.settle_polls:
            return
        compute = {int(r): float(s["compute_s"]) for r, s in ranks.items() if s.get("compute_s") not in (None, "")}
        watched = {r: w for r, w in self.work.items() if r in compute}
        for rank, work in watched.items():
            work.setdefault("settled", compute[rank])
        ended = bool(watched) and len(watched) == len(self.stragglers) and all(
            recovered(compute[r], w["settled"], self.config.end_drop) for r, w in watched.items())
        self._recovered_polls = self._recovered_polls + 1 if ended else 0
        self.client.set(WATCH_KEY, json.dumps({"version": self.version, "recovered_polls": self._recovered_polls,
                                               "work": {str(r): {**w, "now": compute.get(r)}
                                                        for r, w in self.work.items()}}))
        if self._recovered_polls >= self.config.end_polls:
            layout = self._layout()
            if layout is None:
                return
            self.version += 1
            self._write_plan(layout["microbatch_split"], level="S1", why="the straggler(s) recovered")
            append_event(self.run_dir, "mitigation_ended", level="S2", version=self.version,
                         microbatch_split=layout["microbatch_split"],
                         work={str(r): {k: round(v, 4) for k, v in w.items()} for r, w in watched.items()})
            self.stragglers.clear()
            self.work.clear()

    def _publish(self, layout: dict, ranks: dict, *, why: str) -> None:
        default = list(layout["microbatch_split"])
        times = replica_seconds(layout["replicas"], self.stragglers)
        plan = split_microbatches(times, total=sum(default))
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


def _compute_findings(verdict: dict, ranks: dict) -> dict[int, float]:
    """rank -> slowness of each compute finding of a verdict led by a compute finding.

    Validated means its GEMM was slow; how slow its training work is, is the rank's own
    work per iteration now over before (profiling's rise, against the rank itself: the
    rise over the median rank's read 30x once, when the others' work fell), or the
    job's slowdown where the rank has no figure from before, at most its GEMM's ratio.
    A compute finding beside a link lead is left alone: a link at 1% of its bandwidth
    slows the GEMM of a rank whose transfers it holds (measured 1.9x and 2.2x), and S2
    cannot help a link.
    """
    if verdict.get("kind") != "compute":
        return {}
    out = {}
    for finding in [verdict, *verdict.get("also", [])]:
        if finding.get("kind") != "compute" or len(finding.get("ranks", [])) != 1:
            continue
        rank = int(finding["ranks"][0])
        gemm = float(finding.get("strength") or 1.0)
        state = ranks.get(rank, {})
        try:
            rise = float(state["compute_s"]) / float(state["compute_base_s"])
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            # No figure of its own from before (profiling named it by its share of
            # compute): the job's own slowdown, the pace its replica sets.
            rise = float(verdict.get("severity") or 1.0)
        slowness = min(rise, gemm)
        if slowness > 1:
            out[rank] = round(slowness, 3)
    return out


def _ranks_text(stragglers: dict[int, float]) -> str:
    return ", ".join(f"rank {r} at {s:.2f}x" for r, s in sorted(stragglers.items()))
