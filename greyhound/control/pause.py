"""One validation round, carried out by every agent of the control plane together.

Collective over the plane's MPI world (every rank calls :func:`validation_round` with
the master's request, broadcast from rank 0):

1. every agent reports where each of its ranks stands (tracker clocks); rank 0 picks
   the common future step boundary (validate.pause_steps, else
   validate.pause_iterations) and every agent sets each rank's gate right after that
   step's gradient sync;
2. the agents wait until every rank is parked there (or give up after a deadline:
   then everything resumes and the round says the pause failed);
3. GEMMs run one rank at a time in the parked ranks' own processes: a probe on the
   reference ranks sizes the test to about 0.2 s, then suspects and references run it
   (twice each, the faster counts, unless the first run was already 4x the fastest);
4. P2P tests run along the job's links, pass by pass (the links that look slow once
   more, one at a time);
5. every rank resumes; rank 0 returns the measurements and judgements.

Whatever fails, every gate this agent set is cleared before it returns.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

from greyhound.control import mpi_wait, p2p, validate
from greyhound.control.agent import release
from greyhound.ring import BENCH_OK, BENCH_PROBE_N, bench_n_for

if TYPE_CHECKING:
    from greyhound.control.agent import _Process

log = logging.getLogger(__name__)

PARK_TIMEOUT_MIN_S = 10.0
PARK_STALL_S = 5.0
PARK_CAP_S = 30.0
"""The wait for the ranks to park outlasts the planned deadline while the ranks not
yet parked keep making calls (none for PARK_STALL_S: given up), up to PARK_CAP_S after
the planned moment and half the gate's own timeout: the first ranks to park must still
be held when the tests start. A deadline from the ranks' recent iteration times fell
short of a fail-slow that deepened as the pause was placed (CI rehearsal: a CPU quota
took rank 5 from 2.3x to 9x its work, and it was 29 calls short of its gate after
12.7 s; the job waits for that rank anyway, parked or not)."""
BENCH_TIMEOUT_S = 10.0
PROBES = 3
GEMM_ROUNDS = 2
GEMM_DOUBT_ROUNDS = 2
P2P_ROUNDS = 2
CLEARLY_SLOW = 4.0
GEMM_CAP = 10.0
"""A suspect's GEMM is waited for at most this many times the fastest reference's
(BENCH_TIMEOUT_S at most): slow beyond doubt by then (confirmed at 1.3x the slowest
reference), and a rank throttled to a tenth of a CPU held the job 3-6 s a run (11 s
with two such ranks). Its time is then a lower bound (the round's ``capped`` ranks);
the GEMM itself stops when the rank resumes."""


def _local(agent) -> dict[int, _Process]:
    """rank -> its process (the newest ring of the rank on this node)."""
    return {proc.reader.info.rank: proc for proc in agent.processes.values() if proc.reader.info.rank >= 0}


def validation_round(comm, agent, request: dict, *, nodes: list[str], beat=lambda: None,
                     stopped=lambda: False) -> dict | None:
    """Runs the round; the result on rank 0 (None elsewhere). ``beat`` is called
    between its phases and while it waits (the master's heartbeat: a round lasts
    seconds, and `greyhound status` takes a master silent that long as gone).
    ``stopped()`` says the job is ending: the wait for the ranks to park ends then
    (they have ended or are about to; Slurm kills what is left after its KillWait)."""
    local = _local(agent)
    try:
        return _round(comm, agent, local, request, nodes=nodes, beat=beat, stopped=stopped)
    finally:
        for proc in local.values():
            release(proc)


def _round(comm, agent, local: dict, request: dict, *, nodes: list[str], beat, stopped) -> dict | None:
    root = comm.rank == 0
    here = {rank: agent.clock(proc) for rank, proc in local.items()}
    clocks = [c for cs in comm.allgather([c for c in here.values() if c is not None]) for c in cs]
    plan = None
    if root:
        try:
            lead_s = validate.pause_lead_s(clocks, poll_s=request["poll_s"])
            at_s = time.time() + lead_s
            steps = validate.pause_steps(clocks, lead_s=lead_s)
            placed = {"steps": steps} if steps else {"iterations": validate.pause_iterations(clocks, at_s=at_s)}
            plan = {**placed, "at_s": at_s,
                    "deadline_s": at_s + max(PARK_TIMEOUT_MIN_S, 5 * max(c.iteration_s for c in clocks))}
        except ValueError as exc:
            plan = {"error": str(exc)}
    plan = comm.bcast(plan, root=0)
    if "error" in plan:
        return {"paused": False, "held_nobody": True, "why": plan["error"]} if root else None
    targets = {rank: _target(proc, here[rank], plan) for rank, proc in local.items()}
    unplaced = sorted(r for cs in comm.allgather([r for r, t in targets.items() if t is None]) for r in cs)
    if unplaced:
        return {"paused": False, "held_nobody": True,
                "why": f"the trackers of ranks {unplaced} cannot place the pause iteration "
                       "(no period locked yet)"} if root else None
    # The shortest gate timeout of the job's ranks (none: no rank to hold, no bound).
    gate_s = min((t for ts in comm.allgather([p.reader.info.pause_timeout_s for p in local.values()]) for t in ts),
                 default=math.inf)
    for rank, proc in local.items():
        proc.reader.pause(at_call=targets[rank])
    t_pause = time.time()
    everyone = _wait_parked(comm, local, targets, beat=beat, stopped=stopped,
                            deadline_s=plan["deadline_s"],
                            cap_s=max(plan["deadline_s"], plan["at_s"] + min(PARK_CAP_S, gate_s / 2)))
    t_parked = time.time()
    if not everyone:
        where = {r: {"target": t, "parked_at": local[r].reader.parked_at_call, "calls": local[r].reader.calls}
                 for r, t in targets.items()}
        where = {r: w for part in comm.allgather(where) for r, w in part.items()}
        return {"paused": False, "why": "not every rank reached the pause iteration in time",
                "placed_by": "step count" if "steps" in plan else "time",
                "waited_s": round(t_parked - t_pause, 3), "ranks": where} if root else None
    gemm = _gemm(comm, local, request, beat)
    bandwidth = link_bandwidth(comm, agent.node, request["passes"], nodes=nodes, beat=beat)
    for proc in local.values():
        release(proc)
    t_resumed = time.time()
    if not root:
        return None
    slow = p2p.slow_links(bandwidth)
    results = validate.judge_gemm(gemm["times_s"], suspects=request["gemm_suspects"],
                                  references=request["gemm_references"], capped=gemm.get("capped", ()))
    results += validate.judge_links(slow, suspect_nodes=[tuple(n) for n in request["link_suspects"]])
    return {"paused": True, "pause_s": round(t_resumed - t_parked, 3), "park_s": round(t_parked - t_pause, 3),
            "gemm": gemm, "bandwidth_Bps": bandwidth, "slow_links": slow, "results": results}


def _wait_parked(comm, local: dict, targets: dict, *, beat, stopped, deadline_s: float,
                 cap_s: float) -> bool:
    """Waits until every rank is parked at its target call; False when given up: past
    ``deadline_s`` with no call made by the ranks still on their way for PARK_STALL_S
    (past ``cap_s`` in any case), or the job is ending."""
    calls, progress_s = None, time.time()
    while True:
        # Parked where asked: a rank that had already passed its call parks at a later
        # one, out of step with the others, and the round must not count it.
        mine = all(proc.reader.parked_at_call == targets[rank] for rank, proc in local.items())
        moving = sum(proc.reader.calls for proc in local.values() if proc.reader.parked_at_call is None)
        # Waited for without spinning: two blocking allreduces here had the plane's
        # ranks poll Open MPI in a busy loop all through the lead (seconds), and on
        # cores the job shares its steps ran 0.5 s instead of 0.3 s while it was being
        # parked. One exchange a cycle; every agent decides on the same list.
        states = mpi_wait.allgather(comm, (mine, moving, time.time(), stopped()), beat=beat)
        if all(parked for parked, *_ in states):
            return True
        now = max(t for _, _, t, _ in states)
        moved = [n for _, n, _, _ in states]
        if moved != calls:
            calls, progress_s = moved, now
        if any(ending for *_, ending in states) or now > cap_s or (
                now > deadline_s and now - progress_s > PARK_STALL_S):
            return False
        beat()
        time.sleep(0.02)


def _target(proc: _Process, clock: validate.RankClock | None, plan: dict) -> int | None:
    """The call number to hold the rank before: the call after its cut point (the
    step's gradient sync) at the planned step. By step count, a whole number of its
    steps after its last cut; by time, its tracker's iteration's cut. None: this rank
    cannot be placed."""
    if clock is None:
        return None
    if "steps" in plan:
        steps = plan["steps"].get(clock.rank)
        return None if steps is None else clock.cut_call + steps * clock.step_calls + 1
    iteration = plan["iterations"].get(clock.rank) if clock.iteration >= 0 else None
    start = None if iteration is None else proc.tracker.call_number_of_iteration(iteration)
    return None if start is None else start + clock.cut_position + 1


def link_bandwidth(comm, node: str, passes: list, *, nodes: list[str],
                   measure=p2p.measure_passes, beat=lambda: None) -> dict[str, float]:
    """Every link's bandwidth, everywhere. The links that look slow are measured once
    more, one at a time, and each keeps its better figure: a fail-slow link is slow
    both times, while a burst of other work on a shared node (or the other pair of a
    pass competing for the same cores) slows one round."""
    bandwidth: dict[str, float] = {}
    for round_ in range(P2P_ROUNDS):
        for part in mpi_wait.allgather(comm, measure(comm, node, passes, nodes=nodes), beat=beat):
            for link, bw in part.items():
                bandwidth[link] = max(bw, bandwidth.get(link, 0.0))
        beat()
        # The same figures on every rank: the same answer, the same passes.
        slow = [p2p.link_ends(s["link"]) for s in p2p.slow_links(bandwidth)]
        if not slow or round_ + 1 == P2P_ROUNDS:
            break
        passes = [[link] for link in slow]
    return bandwidth


def _bench_on(comm, local: dict, rank: int, n: int, beat, *,
              wait_s: float = BENCH_TIMEOUT_S) -> tuple[float | None, bool]:
    """The GEMM of size n in rank's process (the agent that has it runs it), everywhere:
    (its seconds, False), or (the seconds waited, True) when it ran past ``wait_s`` (a
    lower bound: it goes on until the rank resumes), or (None, False)."""
    t, capped = None, False
    if rank in local:
        reader = local[rank].reader
        started = time.monotonic()
        epoch = reader.request_bench(n)
        while (detail := reader.bench_detail(epoch)) is None and time.monotonic() < started + wait_s:
            time.sleep(0.002)
        if detail is None:
            t, capped = time.monotonic() - started, True
        elif detail.status == BENCH_OK:
            t = detail.wall_s
    found = [x for x in mpi_wait.allgather(comm, (t, capped), beat=beat) if x[0] is not None]
    return found[0] if found else (None, False)


def _gemm_round(comm, local: dict, ranks: list[int], refs: list[int], n: int, times: dict[int, float],
                capped: dict[int, float], beat) -> None:
    """One GEMM on each of ``ranks`` in turn; each rank keeps its fastest time in
    ``times``, and a rank whose GEMM was cut the wait it was cut at in ``capped``."""
    for r in ranks:
        healthy = [times[x] for x in refs if x in times]
        wait_s = min(BENCH_TIMEOUT_S, GEMM_CAP * min(healthy)) if healthy and r not in refs else BENCH_TIMEOUT_S
        t, cut = _bench_on(comm, local, r, n, beat, wait_s=wait_s)
        if t is not None:
            times[r] = min(t, times.get(r, t))
        if cut:
            capped[r] = wait_s


def _gemm(comm, local: dict, request: dict, beat) -> dict:
    refs, suspects = request["gemm_references"], request["gemm_suspects"]
    if not suspects:
        return {"n": None, "times_s": {}}
    # The fastest of a few probes per reference: one 256 probe takes milliseconds and
    # varies by a third on a shared machine.
    probes = [p for p, _ in (_bench_on(comm, local, r, BENCH_PROBE_N, beat) for r in refs for _ in range(PROBES))
              if p]
    n = bench_n_for(min(probes)) if probes else BENCH_PROBE_N
    # Each rank's fastest of GEMM_ROUNDS runs, the rounds interleaved: a throttled rank
    # is slow every time, a burst of other work on a shared node slows one run. A run
    # CLEARLY_SLOW times the fastest is not repeated: no burst explains it, and a
    # throttled rank's second run would only lengthen the pause by seconds. The
    # references run first: a suspect is waited for GEMM_CAP times their fastest.
    times: dict[int, float] = {}
    capped: dict[int, float] = {}
    ranks = [*refs, *suspects]
    for _ in range(GEMM_ROUNDS):
        _gemm_round(comm, local, ranks, refs, n, times, capped, beat)
        fastest = min(times.values(), default=0.0)
        ranks = [r for r in ranks if r not in times or times[r] < CLEARLY_SLOW * fastest]
    # A suspect just over the bar is run again, with the references, until it is under
    # it or slow in every run: the same answer on every node (the times are allgathered).
    for _ in range(GEMM_DOUBT_ROUNDS):
        doubtful = validate.doubtful_suspects(times, suspects=suspects, references=refs,
                                              clearly_slow=CLEARLY_SLOW, capped=capped)
        if not doubtful:
            break
        _gemm_round(comm, local, [*refs, *doubtful], refs, n, times, capped, beat)
    # The cap is the references' fastest time when the suspect ran, which a later, faster
    # reference run can undercut: the wait itself says where the lower bound stands.
    return {"n": n, "times_s": times, "capped": sorted(capped), "cap_s": dict(sorted(capped.items()))}

