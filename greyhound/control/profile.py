"""Profiling: from what the agents publish, who is suspect. Pure functions, no I/O.

Two signals, both read from calls the job makes anyway (nothing is paused):

- **Slow link.** Communicators that move the same bytes per iteration with the same
  operation form a comparable cluster (the DP groups of one stage size, the PP pairs).
  A communicator's transfer time is the smallest per-iteration call time among its
  members: the member that arrives last waits for nobody, so its time inside the call
  is the transfer itself; the others' include waiting. A communicator more than
  ``LINK_TOLERANCE`` above its cluster's median transfer time is suspect, and so are
  the nodes its members run on; a group within one node crosses no network link and
  is never a link suspect.
- **Compute straggler.** A rank's own work is the time it spends outside communication
  calls (the agent measures it from the rings: calls and waits are timed, the rest is
  the rank's work). Per iteration, it stays what it was on every rank but a slow one:
  the others only wait longer inside calls. So the rank whose work per iteration rose
  against its own past (``compute_rise``) by more than ``COMPUTE_TOLERANCE`` beyond the
  median rank's rise is the compute suspect; a rise every rank shares (a busier
  machine) names nobody. Without that history (a rank tracked for a few seconds only),
  ranks that share a collective (a DP group: one pipeline stage in each replica) are
  compared by their share of time outside calls, which confounds a rank's work with
  its pipeline waits. (Arrival order alone would name the whole slow pipeline
  replica: in 1F1B every stage of the replica behind a slow stage arrives late at its
  DP all-reduce.)
- **Starved of CPU.** A rank whose share of time spent ready to run but waiting for a
  CPU (``cpu_wait``: a CPU quota throttling it, other work on its cores) is more than
  ``CPU_WAIT_RISE`` of its time above the median rank's, and rose against its own past
  by that much beyond the median rank's change, is a compute suspect too. A throttled
  rank is stopped wherever its quota runs out, often inside a call (waking from a
  receive needs the CPU as well), so its work per iteration can miss it: with two
  ranks throttled, one read 6x its own past and the other 0.3x (the two-straggler
  cluster test). Waiting for a CPU is read every poll, not per iteration.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np

from greyhound.ring import COLLECTIVE_OPS, OP_NAMES

LINK_TOLERANCE = 0.10
"""A group more than 10% above its cluster's median transfer time is suspect (the paper's rule)."""
WAIT_FRACTION = 0.05
"""How much more of its time a rank must compute than its peers to be suspect."""
COMPUTE_TOLERANCE = 0.10
"""A rank computing more than 10% longer than its peers is suspect."""
CPU_WAIT_RISE = 0.20
"""How much more of its time a rank must wait for a CPU than the median rank does now,
and beyond the median rank's change against its own past, to be suspect. Measured
with two ranks under a CPU quota on 2 shared cores: they waited 0.48-0.74 of their
time, the others 0.01-0.03; against their own past the throttled rose by 0.06-0.41
(their past held the quota's first seconds), the others fell by 0.2-0.3."""
SAME_BYTES_RTOL = 0.01
COLLECTIVE_NAMES = frozenset(OP_NAMES[op] for op in COLLECTIVE_OPS)
"""The op names of collectives, as the agents publish a communicator's op."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Suspect:
    kind: str
    """"compute" or "link"."""
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    comm: str | None
    score: float
    """compute: peers' mean wait / iteration time; link: transfer time / cluster median."""
    why: str

    def as_dict(self) -> dict:
        return {"kind": self.kind, "ranks": list(self.ranks), "nodes": list(self.nodes), "comm": self.comm,
                "score": round(self.score, 4), "why": self.why,
                "where": ",".join(self.nodes) if self.kind == "link" else
                f"rank {self.ranks[0]} on {self.nodes[0]}"}


def _members(comm_stats: dict[int, dict[str, dict]]) -> dict[str, dict[int, dict]]:
    """comm id -> rank -> that rank's stats of it."""
    out: dict[str, dict[int, dict]] = defaultdict(dict)
    for rank, comms in comm_stats.items():
        for comm, stats in comms.items():
            out[comm][rank] = stats
    return out


def find_suspects(comm_stats: dict[int, dict[str, dict]], *, rank_nodes: dict[int, str],
                  compute_share: dict[int, float], compute_rise: dict[int, float] | None = None,
                  cpu_wait: dict[int, tuple[float, float]] | None = None) -> list[Suspect]:
    """Suspects, most suspicious first.

    Args:
        comm_stats: rank -> comm id -> ``{"bytes_per_iter", "seconds_per_iter", "op"}``
            (as the agents publish them).
        rank_nodes: rank -> node name.
        compute_share: rank -> fraction of its recent wall time spent outside calls.
        compute_rise: rank -> its recent work per iteration / its earlier one (ranks
            without enough history left out).
        cpu_wait: rank -> (recent, earlier) fraction of its time it waited for a CPU
            (ranks without both left out).
    """
    members = _members(comm_stats)
    if compute_rise and 2 * len(compute_rise) >= max(len(compute_share), 2):
        suspects = _risen(compute_rise, rank_nodes)
    else:
        suspects = _busier_than_peers(members, compute_share, rank_nodes)
    named = {s.ranks for s in suspects}
    suspects += [s for s in _starved(cpu_wait or {}, rank_nodes) if s.ranks not in named]
    suspects += _slow_groups(members, rank_nodes)
    # A group whose member is a compute suspect is slow because of it (collectives on
    # CPU-driven transports run at the slow rank's pace too): not a link suspect.
    slow_ranks = {r for s in suspects if s.kind == "compute" for r in s.ranks}
    suspects = [s for s in suspects if s.kind == "compute" or not slow_ranks & set(s.ranks)]
    # Scores of the two kinds are not comparable: compute suspects first, each kind by score.
    return sorted(suspects, key=lambda s: (s.kind != "compute", -s.score))


def _risen(compute_rise: dict[int, float], rank_nodes: dict[int, str]) -> list[Suspect]:
    """Ranks whose own work per iteration rose more than the median rank's."""
    median = float(np.median(list(compute_rise.values())))
    out = []
    for rank, rise in compute_rise.items():
        if median > 0 and rise > (1 + COMPUTE_TOLERANCE) * median and rise > 1 + COMPUTE_TOLERANCE:
            out.append(Suspect(kind="compute", ranks=(rank,), nodes=(rank_nodes.get(rank, "?"),), comm=None,
                               score=rise / median,
                               why=f"its own work per iteration rose {rise:.2f}x (the median rank's: "
                                   f"{median:.2f}x); the others wait in calls"))
    return out


def job_pace_s(ranks: dict) -> float | None:
    """The job's iteration time now: the median rank's recent iteration time (the
    agents' ``current_s``); None while no rank has one."""
    current = [float(s["current_s"]) for s in ranks.values() if s.get("current_s") not in (None, "")]
    return float(np.median(current)) if current else None


def cpu_wait_slowness(now: float, before: float) -> float:
    """How much slower a rank runs that waits for a CPU ``now`` of its time, against
    ``before``: the share of its time it had one then over now."""
    return (1 - before) / max(1 - now, 0.01)


def _starved(cpu_wait: dict[int, tuple[float, float]], rank_nodes: dict[int, str]) -> list[Suspect]:
    """Ranks waiting for a CPU a larger share of their time than the median rank does,
    and more than they did beyond the median rank's change (a busier machine moves
    every rank; a rank that always waited more is not new). The score is how much
    slower the rank runs for it: the share of its time it had a CPU before over now."""
    if len(cpu_wait) < 2:
        return []
    median_now = float(np.median([now for now, _ in cpu_wait.values()]))
    median_rise = float(np.median([now - before for now, before in cpu_wait.values()]))
    out = []
    for rank, (now, before) in cpu_wait.items():
        if now - median_now > CPU_WAIT_RISE and now - before - median_rise > CPU_WAIT_RISE and now > before:
            out.append(Suspect(kind="compute", ranks=(rank,), nodes=(rank_nodes.get(rank, "?"),), comm=None,
                               score=cpu_wait_slowness(now, before),
                               why=f"it waits for a CPU {now:.0%} of its time ({before:.0%} before), the "
                                   f"median rank {median_now:.0%}"))
    return out


def _busier_than_peers(members: dict[str, dict[int, dict]], compute_share: dict[int, float],
                       rank_nodes: dict[int, str]) -> list[Suspect]:
    """Ranks computing a larger share of their time than the members of their collectives."""
    suspects: list[Suspect] = []
    peer_groups = [sorted(ranks) for ranks in members.values()
                   if len(ranks) >= 2 and next(iter(ranks.values())).get("op") in COLLECTIVE_NAMES]
    if not peer_groups:             # no collective to compare within: every rank with every other
        peer_groups = [sorted(compute_share)]
    excess: dict[int, float] = {}
    for group in peer_groups:
        for r in group:
            others = [compute_share[p] for p in group if p != r and p in compute_share]
            if r not in compute_share or not others:
                continue
            base = float(np.median(others))
            extra = compute_share[r] - base
            if compute_share[r] > (1 + COMPUTE_TOLERANCE) * base and extra > WAIT_FRACTION:
                excess[r] = max(excess.get(r, 0.0), extra)
    for rank, extra in excess.items():
        suspects.append(Suspect(kind="compute", ranks=(rank,), nodes=(rank_nodes.get(rank, "?"),), comm=None,
                                score=extra,
                                why=f"computes {compute_share[rank]:.0%} of the time, {extra:.0%} more than "
                                    "the ranks it shares a collective with (they wait in calls)"))
    return suspects


def _slow_groups(members: dict[str, dict[int, dict]], rank_nodes: dict[int, str]) -> list[Suspect]:
    """Communicators slower than others moving the same bytes with the same op."""
    suspects: list[Suspect] = []
    groups = []
    for comm, ranks in members.items():
        stats = list(ranks.values())
        groups.append((comm, stats[0].get("op"), float(np.median([s["bytes_per_iter"] for s in stats])),
                       min(float(s["seconds_per_iter"]) for s in stats), tuple(sorted(ranks))))
    used = set()
    for i, (_, op, nbytes, _, _) in enumerate(groups):
        if i in used or nbytes <= 0:
            continue
        cluster = [j for j, g in enumerate(groups)
                   if g[1] == op and abs(g[2] - nbytes) <= SAME_BYTES_RTOL * nbytes]
        used.update(cluster)
        if len(cluster) < 2:
            continue
        median = float(np.median([groups[j][3] for j in cluster]))
        for j in cluster:
            c, _, _, t, group_ranks = groups[j]
            nodes = tuple(sorted({rank_nodes.get(r, "?") for r in group_ranks}))
            # A group within one node crosses no network link (its slowness is its
            # members' or the node's): still a yardstick for the others, never a suspect.
            if median > 0 and t > (1 + LINK_TOLERANCE) * median and len(nodes) > 1:
                suspects.append(Suspect(kind="link", ranks=group_ranks, nodes=nodes, comm=c, score=t / median,
                                        why=f"{op} on comm {c} takes {t / median:.2f}x the median of "
                                            f"{len(cluster)} groups moving {nbytes:.0f} bytes per iteration"))
    return suspects
