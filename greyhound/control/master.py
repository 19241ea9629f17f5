"""The master: the job's state machine, on the control plane's rank 0.

    tracking --(ranks' trackers report a sustained slowdown)--> profiling
    profiling --(suspects stable for a few polls)--> validating --> verdict, tracking
    profiling --(the job's pace fell a fifth further: a fail-slow on top)--> profiling anew ("deepened")
    validating --(no suspect confirmed, a round left)--> profiling
    validating --(the pause could not be placed, a retry left)--> profiling
    profiling/validating --(the slowdown ended meanwhile)--> tracking ("back_to_tracking")
    a verdict's slowdown ends --> "recovered"
    an "unknown" verdict's slowdown lasts --(after a hold-off: doubled each time, and at least
        until the slowdown has cost the job what the verdict's rounds did)--> profiling ("reexamining")
    an "unknown" verdict's slowdown deepens a fifth --> profiling at once ("reexamining")
    (a verdict whose validation could not run counts as "unknown" for both)

Each decision is an event in the job's event log and the state is on the job's Redis,
where `greyhound status` reads it. Validation (a consistent pause at the hook's gate,
a GEMM in the suspects' own processes, P2P tests between the nodes) needs every agent:
the master only asks for it (:meth:`Master.take_request`), the plane runs the round on
all nodes (pause.py) and hands the outcome back (:meth:`Master.complete_validation`).
With ``validate=False`` a verdict rests on profiling alone and says so. A planner
(mitigation, greyhound.mitigate.planner) plugs in: it hears every verdict
(``on_verdict(verdict, ranks)``) and every poll (``poll(ranks)``), with the ranks'
published state.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from greyhound.control import store
from greyhound.control.agent import polls_in
from greyhound.control.events import append_event
from greyhound.control.links import job_links, link_passes
from greyhound.control.p2p import link_ends
from greyhound.control.profile import Suspect, find_suspects, job_pace_s
from greyhound.control.validate import reference_ranks

log = logging.getLogger(__name__)

UNSUSPECTED_LINK_FRACTION = 0.1
"""A slow link that profiling did not suspect is a finding below this fraction of the
median link bandwidth (p2p.SLOW_FRACTION for one that it did)."""


RUNNERS_UP = 2
"""Compute suspects of a minority of the polls GEMM-tested beside the settled ones."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MasterConfig:
    slow_rank_fraction: float = 0.5
    """The job is slow when at least this fraction of its ranks report a slow interval
    (a synchronous job slows on every rank; one rank alone is that rank's noise)."""
    profile_s: float = 1.5
    """Seconds of profiling evidence (whole polls, at least one) before suspects are settled."""
    validation_rounds: int = 2
    """Validation rounds an episode may take: when one confirms none of the suspects
    (profiling caught a rank that waits on the straggler, not the straggler), profiling
    starts over once more before the verdict says "unknown"."""
    placement_retries: int = 6
    """Validation rounds of an episode that may find the pause unplaceable (a rank's
    tracker re-locking on a new micro-batch split: its step is unknown for a few
    seconds) and profile again instead of giving a verdict without validation."""
    deepened_ratio: float = 1.2
    """While profiling, a job whose iteration time rises this far above where profiling
    began has a new fail-slow on top of the one detected: the evidence so far describes
    the job before it, so profiling starts over. The agents' figures cover their last
    seconds (agent.RECENT_S): a straggler that began a second after the detection (a
    burst of other work on the node just before it, CI) was still below the suspects'
    threshold when profiling settled on the other straggler alone."""
    quiet_reread_s: float = 10.0
    """Seconds between reads of every rank's state in a quiet plane with no news
    (:meth:`Master._nothing_new`)."""
    deepened_restarts: int = 3
    """How often profiling may start over for a deepening slowdown (a slow ramp would
    otherwise keep it profiling)."""
    recheck_s: float = 10.0
    """A slowdown validation pinned on nobody is examined again when it lasts this long
    after the verdict, then twice as long after each further "unknown": a fail-slow that
    began while the job was already slow (a false alarm's episode) is still named, and
    a lasting slowdown nobody causes costs ever fewer pauses. Never sooner than
    :func:`recheck_after_s` allows: until the slowdown has cost the job what the
    verdict's rounds cost it."""

    def __post_init__(self) -> None:
        if not 0 < self.slow_rank_fraction <= 1:
            raise ValueError(f"slow_rank_fraction={self.slow_rank_fraction} must be in (0, 1]")
        if not self.profile_s > 0:
            raise ValueError(f"profile_s={self.profile_s} must be > 0")
        if self.placement_retries < 0:
            raise ValueError(f"placement_retries={self.placement_retries} must be >= 0")
        if self.validation_rounds < 1:
            raise ValueError(f"validation_rounds={self.validation_rounds} must be >= 1")
        if not self.deepened_ratio > 1:
            raise ValueError(f"deepened_ratio={self.deepened_ratio} must be > 1")
        if not self.quiet_reread_s > 0:
            raise ValueError(f"quiet_reread_s={self.quiet_reread_s} must be > 0")
        if self.deepened_restarts < 0:
            raise ValueError(f"deepened_restarts={self.deepened_restarts} must be >= 0")
        if not self.recheck_s > 0:
            raise ValueError(f"recheck_s={self.recheck_s} must be > 0")


@dataclasses.dataclass
class _Episode:
    onset: int
    slowdown: float
    detected_s: float
    votes: Counter = dataclasses.field(default_factory=Counter)
    settled: list = dataclasses.field(default_factory=list)
    runners_up: list = dataclasses.field(default_factory=list)
    """Compute suspects of a minority of the polls: GEMM-tested beside the settled ones."""
    suspects: dict = dataclasses.field(default_factory=dict)
    polls: int = 0
    pace_s: float | None = None
    """The job's iteration time when profiling (re)started."""
    deepened: int = 0
    """Times profiling started over for a deepening slowdown."""
    rounds: int = 0
    """Validation rounds taken."""
    unplaced: int = 0
    """Rounds that held nobody: the pause could not be placed."""
    unknowns: int = 0
    """Verdicts that settled nothing: named nobody, or their validation could not run."""
    spent_s: float = 0.0
    """Job seconds the validation rounds since the last re-examination took (parked and
    paused): what looking again would cost the job."""
    verdict_at: float = 0.0
    """time.monotonic() of the latest verdict."""
    verdict: dict | None = None
    ranks: dict = dataclasses.field(default_factory=dict)
    """The ranks' published state when validation was asked for."""


class Master:
    def __init__(self, run_dir: str | Path, client, *, nodes: list[str], config: MasterConfig | None = None,
                 validate: bool = True, poll_s: float = 1.0, planner=None) -> None:
        self.run_dir = Path(run_dir)
        self.client = client
        self.nodes = nodes
        self.config = config or MasterConfig()
        self.validate = validate
        self.poll_s = poll_s
        self._profile_polls = polls_in(self.config.profile_s, poll_s)
        self.request: dict | None = None
        self.planner = planner
        self.state = "tracking"
        self.episode: _Episode | None = None
        self._beat = 0.0
        self._quiet = False
        """The plane was left quiet (store.QUIET) at the last poll that read the ranks."""
        self._news_seen: str | None = None
        self._quiet_polls = 0
        self._reread_polls = polls_in(self.config.quiet_reread_s, poll_s)
        store.set_plane_state(client, "tracking", master_node=nodes[0], nodes=nodes)

    def _event(self, kind: str, **fields) -> None:
        append_event(self.run_dir, kind, **fields)
        log.info("%s %s", kind, fields)

    def _set(self, state: str) -> None:
        self.state = state
        self._quiet = False
        store.set_plane_state(self.client, state)

    def step(self) -> None:
        """One decision round, after the agents have published this poll."""
        if self._nothing_new():
            return
        job = store.read_job(self.client)
        ranks = job["ranks"]
        self._plan("poll", ranks)
        ep = self.episode
        if ep is None:
            if not self._detect(ranks):
                # Nothing open and no plan watched: the agents may publish only what is
                # new (a candidate change, a change point, a slow interval).
                self._quiet = self.planner is None or self.planner.idle
                store.set_plane_state(self.client, self.state, quiet=self._quiet)
            return
        slow = self._slow(ranks)
        if not slow:
            if ep.verdict is None:
                self._event("back_to_tracking", why=f"the slowdown ended while {self.state}")
            else:
                # Under a plan in force the job is back to its pace, not the straggler:
                # the event says which (the planner steps back when the straggler is).
                plan = job.get("plan")
                level = plan.get("level") if isinstance(plan, dict) else None
                self._event("recovered", verdict=ep.verdict["kind"], where=ep.verdict["where"],
                            lasted_s=round(time.time() - ep.detected_s, 2),
                            **({"under_mitigation": level} if level in ("S2", "S3") else {}))
            self.episode = None
            self.client.set(store.SUSPECTS, "[]")
            self._set("tracking")
            return
        if self.state == "profiling":
            self._profile(ep, ranks)
        elif ep.verdict is not None and self._inconclusive(ep.verdict) and \
                (why := self._recheck_why(ep, slow, job_pace_s(ranks))):
            self._event("reexamining", why=why, after_s=round(time.monotonic() - ep.verdict_at, 2),
                        slowdown=round(_slowdown(slow), 3), rounds_cost_s=round(ep.spent_s, 2))
            # The slowdown examined now is the episode's: a further "unknown" is examined
            # at once again only if the job slows a fifth past this one (no loop of rounds).
            ep.rounds, ep.spent_s, ep.slowdown = 0, 0.0, _slowdown(slow)
            self._profile_again(ep)
        else:
            # A verdict given and no plan watched: nothing waits for every rank's figures
            # every poll. The agents post news (a change point: the recovery, a deeper
            # slowdown) at once, and the ranks are read every quiet_reread_s anyway (a
            # fade, a recheck's hold-off). A VM drift's episode that named nobody kept
            # every agent publishing and the master reading all ranks every poll, five
            # times the plane's quiet cost, for as long as the drift lasted.
            self._quiet = ep.verdict is not None and (self.planner is None or self.planner.idle)
            store.set_plane_state(self.client, self.state, quiet=self._quiet)

    def _nothing_new(self) -> bool:
        """In a quiet plane (the last poll found nothing open, or an episode with its
        verdict, and the planner idle),
        whether no agent has published news since the ranks were last read: then the
        poll is only the master's heartbeat. Every ``quiet_reread_s`` they are read
        anyway. Reading and decoding every rank's state each poll was the master's
        whole cost beside its node's agent."""
        if not self._quiet:
            return False
        news = store.quiet_beat(self.client)
        if news == self._news_seen and self._quiet_polls < self._reread_polls and not self._hold_off_over():
            self._quiet_polls += 1
            return True
        self._news_seen, self._quiet_polls = news, 0
        return False

    def _hold_off_over(self) -> bool:
        """Whether an inconclusive verdict's hold-off has passed (at the slowdown it was
        examined at): a quiet master then reads the ranks and decides every poll."""
        ep = self.episode
        return ep is not None and ep.verdict is not None and self._inconclusive(ep.verdict) and \
            self._held_off(ep, ep.slowdown)

    def _held_off(self, ep: _Episode, slowdown: float) -> bool:
        """Whether the episode's verdict is older than the hold-off at ``slowdown``."""
        return time.monotonic() - ep.verdict_at >= recheck_after_s(
            self.config.recheck_s, unknowns=ep.unknowns, spent_s=ep.spent_s, slowdown=slowdown)

    def _inconclusive(self, verdict: dict) -> bool:
        """A verdict that settles nothing: it named nobody, or its validation was asked for
        and could not run (the pause failed). In a CI run a drift's episode got such a
        verdict (rank 1, "not every rank reached the pause iteration in time") just as two
        ranks were throttled, and the 4x slowdown that followed was never examined."""
        return verdict["kind"] == "unknown" or (self.validate and not verdict["validated"])

    def _recheck_why(self, ep: _Episode, slow: dict, pace_s: float | None) -> str | None:
        """Why an inconclusive verdict's slowdown is examined again now (None: not yet):
        the job slowed a fifth further (a fail-slow on top of what was examined: in a CI
        run a drift's verdict came as two ranks were throttled, and the ski-rental
        hold-off held their examination back 18 s, most of the throttle), by the ranks'
        slowdowns or by the job's pace against its pace when profiling began (a rank's
        slowdown is its open slow interval's median: a drift's 1.35x still, 10 s after a
        CPU quota took the job from 0.35 s a step to 1.4 s, and the hold-off kept the
        throttle's examination back until 2 s before it ended, in a cluster test), or the
        hold-off passed."""
        slowdown = _slowdown(slow)
        what = "named nobody" if ep.verdict and ep.verdict["kind"] == "unknown" else "could not be validated"
        if slowdown > self.config.deepened_ratio * ep.slowdown or \
                (pace_s is not None and ep.pace_s is not None and pace_s > self.config.deepened_ratio * ep.pace_s):
            return f"the job slowed further after a verdict that {what}"
        if self._held_off(ep, slowdown):
            return f"the job is still slow after a verdict that {what}"
        return None

    def watch(self) -> None:
        """Between polls, while this node's detectors weigh a candidate change
        (agent.NodeAgent.watching): whether the job has become slow, and nothing else."""
        if self.episode is None:
            self._detect(store.read_job(self.client)["ranks"])

    def _slow(self, ranks: dict) -> dict:
        """The ranks that report a slow interval, when they are enough to make the job
        slow (``slow_rank_fraction``); else {}."""
        slow = {r: s for r, s in ranks.items() if s.get("slow_since") not in (None, "")}
        return slow if ranks and len(slow) >= self.config.slow_rank_fraction * len(ranks) else {}

    def _detect(self, ranks: dict) -> bool:
        """Opens an episode (``detected``, then profiling) when the job is slow."""
        slow = self._slow(ranks)
        if not slow:
            return False
        # The ranks' own onsets differ by their trackers' numbering and noise: the
        # median is the job's.
        onset = int(np.median([int(s["slow_since"]) for s in slow.values()]))
        slowdown = _slowdown(slow)
        # Iterations each rank had finished past its own onset when it reported: the
        # detector's delay (the plane's polls add up to a poll or two on top).
        delay = int(np.median([int(s.get("iterations") or 0) - 1 - int(s["slow_since"]) for s in slow.values()]))
        self.episode = _Episode(onset=onset, slowdown=slowdown, detected_s=time.time())
        self._event("detected", onset_iteration=onset, delay_iterations=delay, slowdown=round(slowdown, 3),
                    ranks=sorted(slow))
        self._set("profiling")
        return True

    def _profile_again(self, ep: _Episode) -> None:
        ep.votes.clear()
        ep.suspects.clear()
        ep.settled, ep.runners_up, ep.polls, ep.pace_s = [], [], 0, None
        self._set("profiling")

    def _profile(self, ep: _Episode, ranks: dict) -> None:
        pace_s = job_pace_s(ranks)
        if ep.pace_s is None:
            ep.pace_s = pace_s
        elif pace_s is not None and ep.pace_s is not None and pace_s > self.config.deepened_ratio * ep.pace_s \
                and ep.deepened < self.config.deepened_restarts:
            ep.deepened += 1
            slowdowns = [float(s["slowdown"]) for s in ranks.values() if s.get("slowdown") not in (None, "")]
            if slowdowns:
                ep.slowdown = float(np.median(slowdowns))
            self._event("deepened", iteration_s=round(pace_s, 4), was_s=round(ep.pace_s, 4),
                        slowdown=round(ep.slowdown, 3), after_polls=ep.polls,
                        why="the job slowed further while profiling: profiling starts over")
            self._profile_again(ep)
            ep.pace_s = pace_s
        stats = store.read_comm_stats(self.client, ranks)
        compute_rise = _compute_rise(ranks)
        suspects = find_suspects(stats, rank_nodes={r: s.get("node", "?") for r, s in ranks.items()},
                                 compute_share={r: float(s["compute_share"]) for r, s in ranks.items()
                                                if s.get("compute_share") not in (None, "")},
                                 compute_rise=compute_rise, cpu_wait=_cpu_wait(ranks))
        ep.polls += 1
        for s in suspects:
            key = (s.kind, s.ranks if s.kind == "compute" else s.nodes)
            ep.votes[key] += 1
            ep.suspects[key] = s
        self.client.set(store.SUSPECTS, store.dumps([s.as_dict() for s in suspects]))
        if ep.polls < self._profile_polls:
            return
        settled = [ep.suspects[k] for k, n in ep.votes.most_common() if n * 2 > ep.polls]
        # A compute suspect of fewer polls is tested too (one GEMM more), not named
        # unless its GEMM is slow: of two stragglers throttled at once, profiling
        # settled on one, and the other went unnamed (CI rehearsal, twice).
        # At most RUNNERS_UP, most voted first, then by rise: on this VM's noise a single
        # straggler's run had four, and its pause took 5.1 s instead of 3-3.7 s.
        minority = sorted(((n, ep.suspects[k]) for k, n in ep.votes.items() if n * 2 <= ep.polls and k[0] == "compute"),
                          key=lambda vote: (-vote[0], -vote[1].score))
        runners_up = [s for _, s in minority[:RUNNERS_UP]]
        ep.settled, ep.runners_up = settled, runners_up
        ep.ranks = ranks
        # Every rank's rise in the last poll: what the suspects were picked from.
        rises = {r: round(v, 2) for r, v in sorted(compute_rise.items())}
        self._event("suspects", suspects=[s.as_dict() for s in settled], polls=ep.polls, rises=rises,
                    **({"runners_up": [s.as_dict() for s in runners_up]} if runners_up else {}))
        self._set("validating")
        if not self.validate:
            self.complete_validation(None)
            return
        compute = [s.ranks[0] for s in settled + runners_up if s.kind == "compute"]
        groups: dict[str, list[int]] = {}
        for rank, comms in store.read_comm_stats(self.client, ranks).items():
            for comm in comms:
                groups.setdefault(comm, []).append(rank)
        node_of = {r: s.get("node", "?") for r, s in ranks.items()}
        links = job_links([[node_of[r] for r in sorted(members)] for members in groups.values()])
        self.request = {
            "suspects": [s.as_dict() for s in settled], "gemm_suspects": compute,
            "gemm_references": reference_ranks(compute, sorted(ranks)) if compute else [],
            "link_suspects": [list(s.nodes) for s in settled if s.kind == "link"],
            "passes": link_passes(links), "poll_s": self.poll_s,
        }

    def _plan(self, what: str, *args) -> None:
        """Hands the planner a verdict or a poll. A planner that fails (a layout the
        training side wrote wrong, say) costs the job its mitigation, never its
        detection: the failure is an event and the master goes on."""
        if self.planner is None:
            return
        try:
            getattr(self.planner, what)(*args)
        except Exception as exc:  # fail open
            log.debug("planner failed", exc_info=True)
            self.planner = None
            self._event("mitigation_skipped", why=f"the planner failed ({type(exc).__name__}: {exc}); "
                                                  "no more mitigation in this job")

    def heartbeat(self) -> None:
        """The master is alive (during a validation round, which lasts seconds); at
        most one write a second."""
        now = time.monotonic()
        if now - self._beat >= 1.0:
            self._beat = now
            store.set_plane_state(self.client, self.state)

    def take_request(self) -> dict | None:
        """The validation round the master wants now (every agent takes part), once."""
        request, self.request = self.request, None
        return request

    def complete_validation(self, outcome: dict | None) -> None:
        """The round's outcome (None: no validation) -> the verdict, back to tracking."""
        ep = self.episode
        if ep is None:
            return
        results = None
        if outcome is not None and outcome.get("held_nobody") and ep.unplaced < self.config.placement_retries:
            # Nothing was tested and the job lost nothing: try again once the ranks'
            # trackers can place the pause.
            ep.unplaced += 1
            self._event("validated", **outcome, next="the pause could not be placed: profiling again")
            self._profile_again(ep)
            return
        ep.rounds += 1
        if outcome is not None and outcome.get("paused"):
            self.client.hincrby(store.PAUSES, "count", 1)
            self.client.hincrbyfloat(store.PAUSES, "total_s", outcome["pause_s"])
            self.client.hset(store.PAUSES, "last_s", outcome["pause_s"])
            self._event("paused", seconds=outcome["pause_s"], park_s=outcome["park_s"])
            ep.spent_s += float(outcome["pause_s"]) + float(outcome["park_s"])
            results = outcome["results"]
        verdict = _verdict(ep.settled, results, ep, outcome, runners_up=ep.runners_up)
        again = results is not None and verdict["kind"] == "unknown" and ep.rounds < self.config.validation_rounds
        if outcome is not None:
            self._event("validated", **{k: v for k, v in outcome.items() if k != "results"}, results=results,
                        **({"next": "nothing confirmed: profiling again"} if again else {}))
        if again:
            self._profile_again(ep)
            return
        ep.verdict = verdict
        ep.verdict_at = time.monotonic()
        ep.unknowns += self._inconclusive(verdict)
        self.client.rpush(store.VERDICTS, store.dumps(ep.verdict))
        self._event("verdict", verdict=ep.verdict)
        # The ranks as they stood before the round: the other nodes' agents publish
        # again as soon as it ends, and their first figures after a pause count the
        # time parked (a rank's work per iteration read 0.48 s instead of 0.12 s).
        self._plan("on_verdict", ep.verdict, ep.ranks or store.read_job(self.client)["ranks"])
        self._set("tracking")


def _slowdown(slow: dict) -> float:
    """The job's slowdown: the median slow rank's (its iteration time over its baseline)."""
    return float(np.median([float(s.get("slowdown") or 1.0) for s in slow.values()]))


def recheck_after_s(recheck_s: float, *, unknowns: int, spent_s: float, slowdown: float) -> float:
    """Seconds after an "unknown" verdict before the slowdown is examined again.

    Ski rental, as the mitigation ladder escalates: a slowdown ``slowdown`` times the
    healthy iteration costs the job ``1 - 1/slowdown`` of each second (steps it does not
    make), and looking again costs about what the rounds behind the verdict did
    (``spent_s``: their parking and pauses; the first ranks at the gate wait for the last).
    Waiting until the slowdown has cost that much bounds what re-examining costs to
    what the slowdown itself cost, whatever it turns out to be: on a machine whose pace
    drifts by 10-20% with nobody to blame (this project's 2-core VM), rounds of 4-5 s
    every 10 s had cost a healthy job more than its drift. A fail-slow that deepens the
    slowdown shortens the wait. Never before ``recheck_s``, doubled after each further
    "unknown" (``unknowns``, at least 1)."""
    loss_per_s = 1.0 - 1.0 / slowdown if slowdown > 1.0 else 0.0
    # A slow job whose ranks give no slowdown over 1 has no measure of its loss: the
    # doubling hold-off alone, as before the rounds had a cost.
    paid_back_s = spent_s / loss_per_s if loss_per_s > 0 else 0.0
    return max(recheck_s * 2 ** (max(unknowns, 1) - 1), paid_back_s)


def _verdict(suspects: list[Suspect], results: list[dict] | None, ep: _Episode, outcome: dict | None, *,
             runners_up: Sequence[Suspect] = ()) -> dict:
    """The fail-slow named. Every finding the validation confirmed (a suspect whose
    test came out slow, or slow links the P2P tests found on their own) has a strength,
    how far its measurement is off: a GEMM's time over the references', a link's median
    bandwidth over its own. The strongest leads and the others follow under ``also``
    (a compound fail-slow): a link narrowed to 1% also slows the GEMM of a rank whose
    transfers over it are held at the pause (measured 1.9x once), and must not be
    named a compute straggler for it. With nothing confirmed, the best suspect, marked
    as unconfirmed (never a runner-up: ``runners_up`` count only where their test
    confirmed them)."""
    base = {"severity": round(ep.slowdown, 3), "since": ep.onset, "validated": results is not None,
            "detected_at": round(ep.detected_s, 3)}
    bandwidth = [float(b) for b in ((outcome or {}).get("bandwidth_Bps") or {}).values()]
    if bandwidth:      # the healthy scale of the job's links, for S3's cost model
        base["link_bandwidth_Bps"] = float(np.median(bandwidth))
    findings = (_findings([*suspects, *runners_up], results, (outcome or {}).get("slow_links") or [])
                if results is not None else [])
    if findings:
        findings.sort(key=lambda f: -f["strength"])
        also = [{k: f[k] for k in ("kind", "where", "ranks", "nodes", "strength", "slowness") if k in f}
                for f in findings[1:]]
        return {**findings[0], **base, **({"also": also} if also else {})}
    if not suspects:
        return {"kind": "unknown", "where": "-", "ranks": [], "nodes": [], "why": "no suspect stood out", **base}
    top = suspects[0]
    why = top.why + ("; validation did not confirm it" if results is not None else "; not validated")
    return {"kind": top.kind if results is None else "unknown", "where": top.as_dict()["where"],
            "ranks": list(top.ranks), "nodes": list(top.nodes), "why": why, **base}


def _findings(suspects: list[Suspect], results: list[dict], slow_links: list[dict]) -> list[dict]:
    """The confirmed findings of a validation round, each with its ``strength``."""
    ok = {r["key"]: r for r in results if r.get("confirmed")}
    out: list[dict] = []
    explained: set[str] = set()
    for s in suspects:
        measured = ok.get(_key(s))
        if measured is None:
            continue
        where, nodes = s.as_dict()["where"], list(s.nodes)
        if s.kind == "link":
            hits = measured.get("slow_links", [])
            explained.update(h["link"] for h in hits)
            strength = max((1 / max(h["ratio"], 1e-6) for h in hits), default=1.0)
            # A slow group spans nodes; the P2P tests say which one the slow links share.
            shared = {h["node"] for h in hits if h.get("node")} & set(nodes)
            if len(shared) == 1:
                where, nodes = next(iter(shared)), sorted(shared)
        else:
            strength = float(measured.get("ratio") or 1.0)
        finding = {"kind": s.kind, "where": where, "ranks": list(s.ranks), "nodes": nodes, "why": s.why,
                   "measured": measured, "strength": round(strength, 3)}
        if s.kind == "compute":
            # How much slower the rank does its own training work now (profiling's
            # rise over the median rank's); the GEMM says only that it is slow (a CPU
            # quota slowed one GEMM 8.3x and the rank's training work 3.4x).
            finding["slowness"] = round(s.score, 3)
        out.append(finding)
    # A slow link nothing in the job's own timing pointed at needs stronger evidence:
    # healthy loopback links of emulated nodes measured 22% of the others' median, alone
    # on the wire, with nothing wrong; a link narrowed to 20 Mbit/s measures about 1%.
    alone = [link for link in slow_links if link["link"] not in explained and link["ratio"] < UNSUSPECTED_LINK_FRACTION]
    if alone:
        top, node = alone[0], alone[0]["node"]
        out.append({"kind": "link", "where": node or top["link"], "ranks": [],
                    "nodes": [node] if node else list(link_ends(top["link"])),
                    "why": f"P2P: {top['link']} at {top['ratio']:.0%} of the median bandwidth",
                    "measured": alone, "strength": round(1 / max(top["ratio"], 1e-6), 3)})
    return out


def _compute_rise(ranks: dict) -> dict[int, float]:
    """rank -> its recent work per iteration / its earlier one, where the agent had both."""
    out = {}
    for rank, state in ranks.items():
        recent, base = state.get("compute_s"), state.get("compute_base_s")
        if recent not in (None, "") and base not in (None, "") and float(base) > 0:
            out[rank] = float(recent) / float(base)
    return out


def _cpu_wait(ranks: dict) -> dict[int, tuple[float, float]]:
    """rank -> (recent, earlier) share of its time it waited for a CPU, where the agent had both."""
    out = {}
    for rank, state in ranks.items():
        now, before = state.get("cpu_wait"), state.get("cpu_wait_base")
        if now not in (None, "") and before not in (None, ""):
            out[rank] = (float(now), float(before))
    return out


def _key(s: Suspect) -> str:
    return f"{s.kind}:{','.join(map(str, s.ranks)) if s.kind == 'compute' else ','.join(s.nodes)}"

