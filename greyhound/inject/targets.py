"""The processes an injection acts on: one pid, or every process of a job step's rank.

A rank is found on this host in two ways, and the first that finds something wins:

1. ``scontrol listpids JOBID[.STEP]``: slurmd's own list of the step's processes;
   GLOBALID is the task's rank ("-" for a task's children, which are attributed through
   their SLURM_PROCID).
2. /proc/*/environ: processes with SLURM_JOB_ID = JOBID, a numeric SLURM_STEP_ID and
   SLURM_PROCID = rank. This is what works when several slurmd emulate nodes on one
   host (listpids then asks for a node name and knows only that node's steps), and
   where scontrol is missing.

Batch and extern steps are never targets: their processes are not ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TypeGuard

from greyhound.errors import InputError, SlurmError
from greyhound.slurm_client import connect

log = logging.getLogger(__name__)

_PROC = Path("/proc")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ListpidsRow:
    pid: int
    job: str
    step: str
    local_id: int | None
    global_id: int | None


def pid_exists(pid: int) -> bool:
    return (_PROC / str(pid)).is_dir() and _proc_state(pid) not in ("Z", "X", None)


def check_pid(pid: int) -> None:
    if not pid_exists(pid):
        raise InputError(f"pid {pid}: no such running process on this host")


def _proc_state(pid: int) -> str | None:
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[0]


def read_environ(pid: int) -> dict[str, str] | None:
    """A process's environment, None when it is gone or unreadable."""
    try:
        raw = (_PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def parse_listpids(text: str) -> list[ListpidsRow]:
    """Rows of `scontrol listpids` output (header and unparsable lines skipped)."""

    def as_int(value: str) -> int | None:
        return int(value) if value.isdigit() else None

    rows = []
    for line in text.splitlines():
        cols = line.split()
        if len(cols) != 5 or not cols[0].isdigit():
            continue
        rows.append(ListpidsRow(pid=int(cols[0]), job=cols[1], step=cols[2],
                                local_id=as_int(cols[3]), global_id=as_int(cols[4])))
    return rows


def _step_ok(step: str | None, wanted: str | None) -> TypeGuard[str]:
    if step is None or not step.isdigit():
        return False  # batch, extern, interactive: not a rank
    return wanted is None or step == wanted


def rank_pids_from_listpids(rows: list[ListpidsRow], *, job: str, rank: int,
                            step: str | None) -> dict[str, list[int]]:
    """{step: pids} of the rank among listpids rows."""
    out: dict[str, list[int]] = {}
    for row in rows:
        if row.job != job or not _step_ok(row.step, step):
            continue
        if row.global_id is None:
            env = read_environ(row.pid) or {}
            procid = env.get("SLURM_PROCID", "")
            if not procid.isdigit() or int(procid) != rank:
                continue
        elif row.global_id != rank:
            continue
        out.setdefault(row.step, []).append(row.pid)
    return out


def rank_pids_from_environ(*, job: str, rank: int, step: str | None) -> dict[str, list[int]]:
    """{step: pids} of the rank found through /proc/*/environ."""
    out: dict[str, list[int]] = {}
    me = os.getpid()
    for entry in _PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        env = read_environ(int(entry.name))
        if not env or env.get("SLURM_JOB_ID") != job:
            continue
        proc_step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
        procid = env.get("SLURM_PROCID", "")
        if not _step_ok(proc_step, step) or not procid.isdigit() or int(procid) != rank:
            continue
        if pid_exists(int(entry.name)):
            out.setdefault(proc_step, []).append(int(entry.name))
    return out


def _listpids(job: str, step: str | None) -> list[ListpidsRow]:
    what = f"{job}.{step}" if step is not None else job
    try:
        return parse_listpids(connect().listpids(what))
    except SlurmError as exc:
        log.info("%s; reading /proc instead", exc)
        return []


def resolve_rank(*, job: str, rank: int, step: str | None = None) -> tuple[str, list[int]]:
    """(step, pids) of rank ``rank`` of job ``job`` (step ``step``) on this host.

    Raises InputError when none is found, or when several steps have that rank and no
    step was given.
    """
    by_step = rank_pids_from_listpids(_listpids(job, step), job=job, rank=rank, step=step)
    source = "scontrol listpids"
    if not by_step:
        by_step = rank_pids_from_environ(job=job, rank=rank, step=step)
        source = "/proc environ"
    # greyhound's own control plane runs as a step of the job, one rank per node: its
    # ranks are not the job's (its tasks carry GREYHOUND_CONTROL_PLANE=1).
    by_step = {s: pids for s, pids in by_step.items()
               if not any((read_environ(pid) or {}).get("GREYHOUND_CONTROL_PLANE") == "1" for pid in pids)}
    where = f"job {job}" + (f" step {step}" if step is not None else "")
    if not by_step:
        raise InputError(f"{where}: no process of rank {rank} runs on this host "
                         "(is the job running here, and the rank below its task count?)")
    if len(by_step) > 1:
        raise InputError(f"{where}: rank {rank} runs in steps {', '.join(sorted(by_step))}; "
                         "choose one with --step")
    (found_step, pids), = by_step.items()
    log.info("%s rank %s: pids %s (step %s, from %s)", where, rank, pids, found_step, source)
    return found_step, sorted(pids)
