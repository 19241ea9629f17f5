"""Validation: pause the job consistently, test the suspects, resume. Pure decisions here;
the plane (plane.py) carries them out on every node at once.

The pause. A rank blocked inside a call (a receive waiting for a parked peer) never
reaches the gate, so "park every rank at its next call" can deadlock the pause. Every
rank is instead parked at the same step boundary: right after its step's gradient
sync (every point-to-point message of a step is matched within that step, so a rank
cut there owes nobody anything). Each rank's tracker numbers its iterations from its
own phase (where its lock fell in the cycle), so the boundary is placed by step count
(:func:`pause_steps`: how many syncs each rank has made, the same steps everywhere),
a whole number of the rank's own steps after its last sync. Where the counts cannot
be trusted it is placed by time (:func:`pause_iterations`): ranks of a synchronous job
run in lockstep, and each rank's boundary nearest a common future time T belongs to
the same step everywhere. The agent turns either into that rank's call number and
sets the gate to hold the rank right before the call after the boundary.

The tests, while every rank is parked:
- a GEMM in each suspect rank's own process (its CPU set, cgroup, device), sized to
  take about 0.2 s on the reference ranks (greyhound.ring.bench_n_for), and the same
  GEMM on those reference ranks; a
  suspect is confirmed when it takes more than ``GEMM_SLOW_RATIO`` times the
  slowest reference (the references show how far a healthy rank's GEMM strays: on
  cores the ranks share, two healthy references took 0.125 and 0.184 s, and against
  their median a healthy suspect read 1.39x and was named a straggler beside the real
  one, 20x; under S3 a false straggler moves ranks);
- P2P bandwidth along the links the job uses, in node-disjoint passes (links.py,
  p2p.py); a link suspect is confirmed when a slow link touches its nodes.
"""

from __future__ import annotations

import dataclasses
import math
import numpy as np

from greyhound.control.p2p import link_ends

GEMM_SLOW_RATIO = 1.3


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RankClock:
    """Where one rank stands, as its tracker knows it."""

    rank: int
    iteration: int
    """Index of the last iteration that started."""
    started_s: float
    """When it started (Unix seconds)."""
    iteration_s: float
    """The rank's current iteration time (seconds)."""
    cut_position: int = -1
    """Where in its iteration the rank is cut: right after the call at this position
    (its last collective, the step's gradient sync), or -1: before the first call.
    ``started_s`` is then that call's time."""
    cut_step: int | None = None
    """Steps the rank has completed at that cut: how many times it has made its cut
    collective, the step's gradient sync (its ordinal among the collectives on that
    communicator, over the collectives it makes there a step). Every rank makes
    its step's gradient sync once a step, so this counts the same steps everywhere,
    whatever each tracker's own numbering."""
    cut_call: int = 0
    """The hook's call number of the cut collective."""
    step_calls: int = 0
    """Calls the rank made in its last step (from the sync before the cut to the cut;
    0: unknown). A new micro-batch split changes it, and the tracker's period follows
    only once it locks again: a cut placed by the period then misses the step."""


def pause_steps(clocks: list[RankClock], *, lead_s: float) -> dict[int, int] | None:
    """For each rank, how many steps after its cut to cut again, by step count: at the
    first step every rank can still reach after ``lead_s`` (the rank's gate is then
    set ``steps * step_calls`` calls after its cut). None (then
    :func:`pause_iterations` places the cut by time) when some rank has no step count
    or step length, or when the counts disagree by more steps than the ranks can be
    apart: lockstep ranks, read at most ``lead_s`` apart, differ by at most that many
    of the fastest rank's iterations. Counts that disagree more are not counting the same steps (a
    tracker locked on two steps as one iteration): a cut placed by them would park
    some ranks many steps ahead of the others, and the others could never get there."""
    cut_steps = [c.cut_step for c in clocks if c.cut_step is not None and c.step_calls > 0]
    if not clocks or len(cut_steps) < len(clocks):
        return None
    fastest = min(c.iteration_s for c in clocks)
    if not fastest > 0 or max(cut_steps) - min(cut_steps) > 1 + math.ceil(lead_s / fastest):
        return None
    slowest = max(c.iteration_s for c in clocks)
    step = max(cut_steps) + 1 + math.ceil(lead_s / slowest)
    return {c.rank: step - cut for c, cut in zip(clocks, cut_steps, strict=True)}


def pause_iterations(clocks: list[RankClock], *, at_s: float) -> dict[int, int]:
    """For each rank, the index of its iteration whose cut point (``started_s`` plus a
    whole number of iterations) is nearest ``at_s``, and not before the next one: the
    same step on every rank of a lockstep job.

    Raises:
        ValueError: a rank has no iteration time yet (its tracker has no period).
    """
    out = {}
    for c in clocks:
        if not c.iteration_s > 0:
            raise ValueError(f"rank {c.rank} has no iteration time yet")
        ahead = max(1, round((at_s - c.started_s) / c.iteration_s))
        out[c.rank] = c.iteration + ahead
    return out


def pause_lead_s(clocks: list[RankClock], *, poll_s: float) -> float:
    """How far ahead to place the pause: the agents must set the gates before any rank
    reaches that iteration, so a couple of polls and two iterations of the slowest rank."""
    slowest = max((c.iteration_s for c in clocks), default=0.0)
    return 2 * poll_s + 2 * slowest


def reference_ranks(suspects: list[int], ranks: list[int], *, count: int = 2) -> list[int]:
    """Ranks to judge the suspects against: healthy ones, spread over the rank list."""
    healthy = [r for r in ranks if r not in set(suspects)]
    if len(healthy) <= count:
        return healthy
    idx = np.linspace(0, len(healthy) - 1, count).round().astype(int)
    return [healthy[i] for i in idx]


def judge_gemm(times_s: dict[int, float], *, suspects: list[int], references: list[int],
               capped=()) -> list[dict]:
    """Per suspect rank: its GEMM time, the slowest reference's, confirmed or not; for a
    ``capped`` rank (its GEMM was not waited for to the end) the time and ratio are
    lower bounds (``at_least``)."""
    ref = [times_s[r] for r in references if times_s.get(r)]
    slowest = max(ref) if ref else float("nan")
    out = []
    for r in suspects:
        t = times_s.get(r)
        ratio = t / slowest if t and ref else float("nan")
        out.append({"key": f"compute:{r}", "rank": r, "gemm_s": t, "reference_s": slowest,
                    "ratio": ratio, "at_least": r in capped, "confirmed": bool(ratio > GEMM_SLOW_RATIO)})
    return out


def doubtful_suspects(times_s: dict[int, float], *, suspects: list[int], references: list[int],
                      clearly_slow: float, capped=()) -> list[int]:
    """The suspects whose GEMM is over the bar but not clearly slow: run again (with the
    references) before they are named. A rank under a CPU quota is slow at every run; on
    cores the ranks share (the local cluster: 8 ranks on 2 cores, whose sibling threads
    slow each other's GEMM) a healthy rank read 1.33x in both of its runs before any
    injection and was named a straggler."""
    return [o["rank"] for o in judge_gemm(times_s, suspects=suspects, references=references, capped=capped)
            if o["confirmed"] and not o["at_least"] and o["ratio"] < clearly_slow]


def judge_links(slow: list[dict], *, suspect_nodes: list[tuple[str, ...]]) -> list[dict]:
    """Per link suspect (its nodes): confirmed when a slow link touches them."""
    out = []
    for nodes in suspect_nodes:
        hits = [s for s in slow if set(link_ends(s["link"])) & set(nodes)]
        out.append({"key": f"link:{','.join(nodes)}", "nodes": list(nodes), "slow_links": hits,
                    "confirmed": bool(hits)})
    return out
