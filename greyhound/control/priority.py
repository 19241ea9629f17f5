"""The control plane yields the CPU to the job it watches.

The plane's agents and master need about a hundredth of a core each, a few
milliseconds a poll, but at the job's own priority each of those milliseconds is taken
from a training rank on a node whose cores the job fills (on this project's 2-core
machine, 8 ranks: the plane's share of the cores came back one for one as step time).
At the lowest priority they run in the moments the job leaves free and give way at
once when a rank wakes; while the job is paused for validation (its ranks parked)
nothing competes with them.

Two levers, because the kernel schedules in groups where it has them:

- every thread of the process goes to nice 19 (threads have their own nice value:
  Open MPI's and OpenBLAS's threads already exist when this runs);
- where the kernel groups tasks by session (autogroup, on by default in Debian's
  kernels for processes outside a CPU cgroup), the session's group goes to nice 19
  too: without it the group competes with the job's groups as an equal, whatever its
  threads' nice. The session is the plane step's own (its slurmstepd and the plane).

Neither can be undone without privilege (an unprivileged process may only lower its
priority), so the job's Redis is started before, in a session of its own, and keeps
the job's priority: a training rank that reads a mitigation plan waits on it.

Where Slurm puts steps into CPU cgroups (cgroup v2 with the cpu controller), the
plane's step competes with the training step as an equal group and neither lever
reaches across; the README says what an admin can set there.
"""

from __future__ import annotations

import os

LOWEST_NICE = 19


def yield_cpu(*, proc: str = "/proc/self") -> list[str]:
    """Lowers this process's threads and its autogroup to nice 19; what it lowered
    (``threads``, ``autogroup``), for the plane's start event. Never raises: a plane
    at the job's priority still works."""
    lowered = []
    try:
        tids = [int(t) for t in os.listdir(f"{proc}/task")]
    except OSError:
        tids = [0]
    done = 0
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, LOWEST_NICE)
            done += 1
        except OSError:     # a thread that ended meanwhile
            pass
    if done:
        lowered.append("threads")
    try:
        with open(f"{proc}/autogroup", "w") as f:
            f.write(str(LOWEST_NICE))
        if _autogroups_on():
            lowered.append("autogroup")
    except OSError:         # no autogroup in this kernel
        pass
    return lowered


def _autogroups_on() -> bool:
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return False
