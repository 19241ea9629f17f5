"""Apply, wait, undo: the lifecycle of injections, one thread each, undo always.

:func:`run_plans` starts every plan at its offset, keeps it applied for its duration
and undoes it when the duration ends, when its target exits, or as soon as ``stop`` is
set (the CLI sets it on SIGINT, SIGTERM and SIGHUP). Undo runs in a ``finally``, also
after a partial or failed apply. A state record is written before the first change to
the system and removed after a successful undo, so :func:`undo_all` can clean up after
an injector that was killed with SIGKILL.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from greyhound.errors import GreyhoundError, InputError
from greyhound.inject import compute, link, state, truth
from greyhound.inject.schedule import Planned
from greyhound.inject.spec import ComputeSpec, Spec

log = logging.getLogger(__name__)

_POLL_S = 0.25
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

Injection = compute.ComputeInjection | link.LinkInjection


@dataclasses.dataclass(kw_only=True, slots=True)
class Outcome:
    """What became of one plan."""

    plan: Planned
    id: str
    record: dict | None = None
    """The truth record, when the injection was applied."""
    error: str | None = None
    skipped: bool = False
    """Stopped before its start time came."""


def new_id(spec: Spec) -> str:
    return f"{spec.kind}-{spec.label}-{uuid.uuid4().hex[:8]}"


def make_injection(spec: Spec, *, env: state.InjectEnv, injection_id: str) -> Injection:
    if isinstance(spec, ComputeSpec):
        return compute.ComputeInjection(spec, env=env, injection_id=injection_id)
    return link.LinkInjection(spec, injection_id=injection_id)


def _start_time(pid: int) -> str | None:
    """The kernel's start time of a process: with the pid it names one process for good."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[19]


def injector_alive(record: dict) -> bool:
    pid = record.get("injector_pid")
    return isinstance(pid, int) and _start_time(pid) == record.get("injector_start")


def preflight(plans: list[Planned], *, env: state.InjectEnv) -> list[Injection]:
    """One injection per plan, each checked against this machine (InputError otherwise)."""
    injections = []
    for plan in plans:
        injection = make_injection(plan.spec, env=env, injection_id=new_id(plan.spec))
        injection.preflight()
        injections.append(injection)
    return injections


def _hold(injection: Injection, duration_s: float, stop: threading.Event) -> str:
    """Wait out the duration; how the injection ended."""
    deadline = time.monotonic() + duration_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return "duration"
        if stop.wait(min(left, _POLL_S)):
            return "signal"
        if not injection.target_alive():
            return "target-exited"


def _run_one(plan: Planned, injection: Injection, outcome: Outcome, *, env: state.InjectEnv,
             truth_path: Path, stop: threading.Event, t0: float,
             notify: Callable[[str], None]) -> None:
    # Some injections look at their target before they start (a compute injection
    # measures the CPU it uses): that look happens before the planned start.
    lead_s = getattr(injection, "lead_s", 0.0)
    if stop.wait(max(0.0, t0 + plan.start_s - lead_s - time.monotonic())):
        outcome.skipped = True
        return
    base = {"id": injection.id, "injector_pid": os.getpid(),
            "injector_start": _start_time(os.getpid()), "truth": str(truth_path),
            "planned_start_s": plan.start_s, "planned_duration_s": plan.duration_s}
    started = None
    ended_by = "error"

    def record_state(**extra) -> None:
        state.write_active(env, {**base, **injection.state(), "start": started,
                                 "fields": injection.truth_fields(), **extra})

    try:
        injection.resolve()
        if stop.wait(max(0.0, t0 + plan.start_s - time.monotonic())):
            outcome.skipped = True
            return
        injection.apply(record_state)
        started = time.time()
        record_state()
        notify(f"{injection.id}: applied for {plan.duration_s:g} s")
        ended_by = _hold(injection, plan.duration_s, stop)
    except GreyhoundError as exc:
        outcome.error = str(exc)
    except Exception as exc:  # a bug must not leave the system throttled
        log.exception("%s failed", injection.id)
        outcome.error = f"internal error: {exc!r}"
    finally:
        try:
            injection.undo()
        except Exception as exc:  # noqa: BLE001  (keep the state record: undo-all can retry)
            outcome.error = outcome.error or f"undo failed: {exc}"
            notify(f"{injection.id}: UNDO FAILED ({exc}); run `greyhound inject undo-all`")
        else:
            state.remove_active(env, injection.id)
        end = time.time()
        if started is not None:
            outcome.record = truth.new_record(
                id=injection.id, kind=injection.kind, host=socket.gethostname(),
                injector_pid=os.getpid(), start=started, end=end,
                planned_start_s=plan.start_s, planned_duration_s=plan.duration_s,
                ended_by=ended_by, **injection.truth_fields())
            try:
                truth.append(truth_path, outcome.record)
            except GreyhoundError as exc:
                outcome.error = outcome.error or str(exc)
            notify(f"{injection.id}: undone after {end - started:.2f} s ({ended_by})")


def run_plans(plans: list[Planned], *, env: state.InjectEnv, truth_path: Path,
              stop: threading.Event, injections: list[Injection] | None = None,
              notify: Callable[[str], None] = lambda _msg: None) -> list[Outcome]:
    """Run every plan concurrently; returns when all have been undone (or skipped)."""
    if injections is None:
        injections = preflight(plans, env=env)
    # Time zero of the schedule leaves room for the longest look-ahead, so that every
    # injection starts at its planned offset.
    t0 = time.monotonic() + max((getattr(i, "lead_s", 0.0) for i in injections), default=0.0)
    outcomes = [Outcome(plan=p, id=i.id) for p, i in zip(plans, injections)]
    threads = [
        threading.Thread(target=_run_one, args=(p, i, o),
                         kwargs=dict(env=env, truth_path=truth_path, stop=stop, t0=t0, notify=notify),
                         name=i.id, daemon=False)
        for p, i, o in zip(plans, injections, outcomes)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():  # a timed join keeps the main thread free for signal handlers
            thread.join(_POLL_S)
    return outcomes


class StopOnSignals:
    """Context manager: SIGINT/SIGTERM/SIGHUP set ``stop`` (and are remembered) instead
    of killing the process, so the injections are undone before it exits."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.signum: int | None = None
        self._previous: dict[int, Callable[..., Any] | int | signal.Handlers | None] = {}

    def _handler(self, signum, _frame) -> None:
        self.signum = self.signum or signum
        self.stop.set()

    def __enter__(self) -> StopOnSignals:
        for sig in _SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *_exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def undo_all(*, env: state.InjectEnv, truth_path: Path | None = None,
             force: bool = False, wait_s: float = 10.0) -> dict:
    """Undo every leftover injection: those whose injector is gone, and every cgroup
    under the greyhound parent that no live injector owns. With ``force``, live
    injectors are sent SIGTERM and given ``wait_s`` to undo their own.

    Returns {"undone": [ids], "live": [ids left to live injectors], "orphan_cgroups": [paths]}.
    """
    records = state.read_active(env)
    live = [r for r in records if injector_alive(r)]
    if force and live:
        for record in live:
            try:
                os.kill(record["injector_pid"], signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(injector_alive(r) for r in live):
            time.sleep(0.1)
        records = state.read_active(env)
        live = [r for r in records if injector_alive(r)]
    live_ids = {r["id"] for r in live}
    owned_cgroups = {r.get("cgroup") for r in live}
    undone, errors = [], []
    for record in records:
        if record["id"] in live_ids:
            continue
        try:
            if record.get("kind") == "compute":
                cgroup = Path(record["cgroup"])
                if cgroup.exists():
                    originals = {int(k): v for k, v in record.get("originals", {}).items()}
                    compute.release_cgroup(env, cgroup, originals)
            elif record.get("kind") == "link":
                for item in record.get("links", []):
                    link.remove_tbf(item.get("netns"), item["dev"])
        except GreyhoundError as exc:
            errors.append(f"{record['id']}: {exc}")
            continue
        state.remove_active(env, record["id"])
        undone.append(record["id"])
        if record.get("start") is not None:
            fields = {k: v for k, v in record.get("fields", {}).items() if k in truth.FIELDS}
            truth.append(Path(truth_path or record.get("truth") or env.default_truth), truth.new_record(
                **fields, id=record["id"], kind=record.get("kind"), host=socket.gethostname(),
                injector_pid=record.get("injector_pid"), start=record["start"], end=time.time(),
                planned_start_s=record.get("planned_start_s"),
                planned_duration_s=record.get("planned_duration_s"), ended_by="undo-all"))
    orphans = []
    if env.cgroup_base.is_dir():
        for cgroup in sorted(p for p in env.cgroup_base.iterdir() if p.is_dir()):
            if str(cgroup) in owned_cgroups:
                continue
            try:
                compute.release_cgroup(env, cgroup, {})
                orphans.append(str(cgroup))
            except GreyhoundError as exc:
                errors.append(str(exc))
        if not live:
            try:
                env.cgroup_base.rmdir()
            except OSError:
                pass
    if errors:
        raise InputError(f"undo-all left {len(errors)} injection(s) in place: {'; '.join(errors)}")
    return {"undone": undone, "live": sorted(live_ids), "orphan_cgroups": orphans}
