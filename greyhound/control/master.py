"""The master: the job's state machine, on the control plane's rank 0.

    tracking --(ranks' trackers report a sustained slowdown)--> profiling
    profiling --(suspects stable for a few polls)--> validating --> verdict, tracking
    profiling/validating --(the slowdown ended meanwhile)--> tracking ("back_to_tracking")
    a verdict's slowdown ends --> "recovered"

Each decision is an event in the job's event log and the state is on the job's Redis,
where `greyhound status` reads it. Validation (a consistent pause at the hook's gate,
a GEMM in the suspect's own process, P2P tests between the nodes) is done by a
``validator`` with ``validate(suspects) -> list[dict]`` (measurements and, per suspect,
``confirmed``); without one, a verdict rests on profiling alone and says so. A planner
(mitigation) can subscribe to verdicts through ``on_verdict``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from pathlib import Path

import numpy as np

from greyhound.control import store
from greyhound.control.events import append_event
from greyhound.control.profile import Suspect, find_suspects

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MasterConfig:
    slow_rank_fraction: float = 0.5
    """The job is slow when at least this fraction of its ranks report a slow interval
    (a synchronous job slows on every rank; one rank alone is that rank's noise)."""
    profile_polls: int = 3
    """Polls of profiling evidence before suspects are settled."""

    def __post_init__(self) -> None:
        if not 0 < self.slow_rank_fraction <= 1:
            raise ValueError(f"slow_rank_fraction={self.slow_rank_fraction} must be in (0, 1]")
        if self.profile_polls < 1:
            raise ValueError(f"profile_polls={self.profile_polls} must be >= 1")


@dataclasses.dataclass
class _Episode:
    onset: int
    slowdown: float
    detected_s: float
    votes: Counter = dataclasses.field(default_factory=Counter)
    suspects: dict = dataclasses.field(default_factory=dict)
    polls: int = 0
    verdict: dict | None = None


class Master:
    def __init__(self, run_dir: str | Path, client, *, nodes: list[str], config: MasterConfig | None = None,
                 validator=None, on_verdict=None) -> None:
        self.run_dir = Path(run_dir)
        self.client = client
        self.nodes = nodes
        self.config = config or MasterConfig()
        self.validator = validator
        self.on_verdict = on_verdict
        self.state = "tracking"
        self.episode: _Episode | None = None
        store.set_plane_state(client, "tracking", master_node=nodes[0], nodes=nodes)

    def _event(self, kind: str, **fields) -> None:
        append_event(self.run_dir, kind, **fields)
        log.info("%s %s", kind, fields)

    def _set(self, state: str) -> None:
        self.state = state
        store.set_plane_state(self.client, state)

    def step(self) -> None:
        """One decision round, after the agents have published this poll."""
        job = store.read_job(self.client)
        ranks = job["ranks"]
        slow = {r: s for r, s in ranks.items() if s.get("slow_since") not in (None, "")}
        job_slow = bool(ranks) and len(slow) >= self.config.slow_rank_fraction * len(ranks)
        ep = self.episode
        if ep is None:
            if job_slow:
                onset = min(int(s["slow_since"]) for s in slow.values())
                slowdown = float(np.median([float(s.get("slowdown") or 1.0) for s in slow.values()]))
                self.episode = _Episode(onset=onset, slowdown=slowdown, detected_s=time.time())
                self._event("detected", onset_iteration=onset, slowdown=round(slowdown, 3),
                            ranks=sorted(slow))
                self._set("profiling")
            else:
                store.set_plane_state(self.client, self.state)
            return
        if not job_slow:
            if ep.verdict is None:
                self._event("back_to_tracking", why=f"the slowdown ended while {self.state}")
            else:
                self._event("recovered", verdict=ep.verdict["kind"], where=ep.verdict["where"],
                            lasted_s=round(time.time() - ep.detected_s, 2))
            self.episode = None
            self.client.set(store.SUSPECTS, "[]")
            self._set("tracking")
            return
        if self.state == "profiling":
            self._profile(ep, ranks)
        else:
            store.set_plane_state(self.client, self.state)

    def _profile(self, ep: _Episode, ranks: dict) -> None:
        stats = store.read_comm_stats(self.client, ranks)
        suspects = find_suspects(stats, rank_nodes={r: s.get("node", "?") for r, s in ranks.items()},
                                 iteration_s={r: float(s.get("current_s") or 0) for r, s in ranks.items()})
        ep.polls += 1
        for s in suspects:
            key = (s.kind, s.ranks if s.kind == "compute" else s.nodes)
            ep.votes[key] += 1
            ep.suspects[key] = s
        self.client.set(store.SUSPECTS, store.dumps([s.as_dict() for s in suspects]))
        if ep.polls < self.config.profile_polls:
            return
        settled = [ep.suspects[k] for k, n in ep.votes.most_common() if n * 2 > ep.polls]
        self._event("suspects", suspects=[s.as_dict() for s in settled], polls=ep.polls)
        self._set("validating")
        results = self.validator.validate(settled) if (self.validator and settled) else None
        if results is not None:
            self._event("validated", results=results)
        ep.verdict = _verdict(settled, results, ep)
        self.client.rpush(store.VERDICTS, store.dumps(ep.verdict))
        self._event("verdict", verdict=ep.verdict)
        if self.on_verdict:
            self.on_verdict(ep.verdict)
        self._set("tracking")


def _verdict(suspects: list[Suspect], results: list[dict] | None, ep: _Episode) -> dict:
    confirmed = suspects
    if results is not None:
        ok = {r["key"] for r in results if r.get("confirmed")}
        confirmed = [s for s in suspects if _key(s) in ok]
    base = {"severity": round(ep.slowdown, 3), "since": ep.onset, "validated": results is not None,
            "detected_at": round(ep.detected_s, 3)}
    if not confirmed:
        return {"kind": "unknown", "where": "-", "ranks": [], "nodes": [], **base,
                "why": "no suspect stood out" if not suspects else "validation confirmed no suspect"}
    top = confirmed[0]
    return {"kind": top.kind, "where": top.as_dict()["where"], "ranks": list(top.ranks),
            "nodes": list(top.nodes), "why": top.why, **base}


def _key(s: Suspect) -> str:
    return f"{s.kind}:{','.join(map(str, s.ranks)) if s.kind == 'compute' else ','.join(s.nodes)}"

