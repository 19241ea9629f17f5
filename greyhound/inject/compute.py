"""Compute fail-slow: a cgroup v1 CFS quota takes a fraction of a CPU from a process.

The target's processes (their whole thread groups: a write to ``cgroup.procs`` moves
every thread) go into ``<cgroup_root>/<parent>/<id>`` with
``cpu.cfs_quota_us = (1 - severity) x cpus x cpu.cfs_period_us``, where cpus is given
or measured: the CPU the target used in the second before (see ComputeSpec.cpus).
Children forked
while injected inherit the cgroup and are slowed too. Undo moves every task still in
the cgroup back where its process was before (read from /proc/PID/cgroup) and removes
the cgroup.

The cgroup sits at the top of the cpu hierarchy, not under the target's own cgroup:
on these machines ranks' cpu cgroup is the root (Slurm's task/cgroup uses cpuset,
memory and freezer, not cpu), and a fixed place lets ``undo-all`` find leftovers.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path

from greyhound.errors import InputError
from greyhound.inject import targets
from greyhound.inject.spec import ComputeSpec
from greyhound.inject.state import InjectEnv

log = logging.getLogger(__name__)

PERIOD_US = 20_000
"""The quota's period. A rank that spends its quota early in a period stops until the
next one, and every message its pipeline peers wait for from it waits with it: at
100 ms (the kernel's default) a 0.11-CPU quota made the reference job's steps 4-8 s
(healthy 0.35 s; a validated slowdown of 10-20x, on this VM, 2026-12-06), 1.3-4 s at
20 ms. A shorter period is closer to a device that is uniformly slower."""
_RMDIR_WAIT_S = 2.0


MEASURE_WINDOW_S = 1.0
MIN_CPUS = 0.01
"""Floor of a measured CPU rate: an idle target still gets a quota that means something."""


def quota_us(severity: float, cpus: float, period_us: int = PERIOD_US) -> int:
    """CFS quota: what the target keeps, in microseconds per period."""
    # The kernel refuses quotas below 1 ms.
    return max(1000, round((1.0 - severity) * cpus * period_us))


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of the processes (all threads), 0 for a gone one."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / ticks


def measure_cpus(pids: list[int], window_s: float = MEASURE_WINDOW_S) -> float:
    """CPUs the processes used over the next window_s seconds (at least MIN_CPUS)."""
    t0, c0 = time.monotonic(), cpu_seconds(pids)
    time.sleep(window_s)
    rate = (cpu_seconds(pids) - c0) / (time.monotonic() - t0)
    return max(MIN_CPUS, rate)


def cpu_cgroup_of(pid: int) -> str:
    """The cpu-controller cgroup path of a process (e.g. '/' or '/slurm/uid_0/job_3')."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError as exc:
        raise InputError(f"pid {pid}: no such running process on this host") from exc
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    raise InputError(f"pid {pid} is in no cgroup v1 cpu hierarchy; compute injection needs "
                     "the cgroup v1 cpu controller (mount -t cgroup -o cpu cgroup /sys/fs/cgroup/cpu)")


def check_environment(env: InjectEnv) -> None:
    """InputError unless this process may create cpu cgroups under env.cgroup_root."""
    if os.geteuid() != 0:
        raise InputError("compute injection needs root (it creates cpu cgroups and moves processes)")
    if not (env.cgroup_root / "cpu.cfs_quota_us").is_file():
        raise InputError(
            f"no cgroup v1 cpu controller at {env.cgroup_root}; compute injection needs one "
            f"(mount -t cgroup -o cpu cgroup {env.cgroup_root})"
        )


def _write(path: Path, value: str) -> None:
    with open(path, "w") as fh:  # one write(): cgroup files reject partial values
        fh.write(value)


def _move(env: InjectEnv, cgroup_rel: str, pid: int) -> bool:
    """Move a thread group into a cgroup (relative to the root); False if it is gone."""
    target = env.cgroup_root / cgroup_rel.lstrip("/")
    try:
        _write(target / "cgroup.procs", str(pid))
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            return False
        if exc.errno == errno.ENOENT and cgroup_rel not in ("", "/"):
            log.warning("cgroup %s is gone; moving pid %d to the root instead", cgroup_rel, pid)
            return _move(env, "/", pid)
        raise
    return True


def _members(cgroup: Path) -> list[int]:
    try:
        return [int(x) for x in (cgroup / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def _tgid(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Tgid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def release_cgroup(env: InjectEnv, cgroup: Path, originals: dict[int, str]) -> list[int]:
    """Move every process of ``cgroup`` back (to its original, else the first target's,
    else the root) and remove the cgroup; returns the pids moved back."""
    fallback = next(iter(originals.values()), "/")
    moved = []
    deadline = time.monotonic() + _RMDIR_WAIT_S
    while True:
        for pid in _members(cgroup):
            tgid = _tgid(pid) or pid
            home = originals.get(tgid, fallback)
            try:
                if _move(env, home, pid):
                    moved.append(pid)
            except OSError as exc:
                raise InputError(f"cannot move pid {pid} back to cgroup {home}: {exc.strerror}") from exc
        try:
            cgroup.rmdir()
            return moved
        except FileNotFoundError:
            return moved
        except OSError as exc:
            # EBUSY: a task forked or was exiting while we moved the others.
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise InputError(f"cannot remove cgroup {cgroup}: {exc.strerror}") from exc
            time.sleep(0.05)


class ComputeInjection:
    """One compute injection; apply() then undo() (undo is safe after a partial apply)."""

    kind = "compute"

    def __init__(self, spec: ComputeSpec, *, env: InjectEnv, injection_id: str) -> None:
        self.spec = spec
        self.env = env
        self.id = injection_id
        self.cgroup = env.cgroup_base / injection_id
        self.pids: list[int] = []
        self.step: str | None = spec.step
        self.originals: dict[int, str] = {}
        self.cpus: float | None = spec.cpus
        """CPUs the quota is a fraction of: given, or measured at apply()."""

    def preflight(self) -> None:
        """Checks that need no target yet (and the pid, when the target is a pid)."""
        check_environment(self.env)
        if self.spec.pid is not None:
            targets.check_pid(self.spec.pid)

    def state(self) -> dict:
        return {"kind": self.kind, "cgroup": str(self.cgroup),
                "originals": {str(k): v for k, v in self.originals.items()}}

    def resolve(self) -> None:
        if self.spec.pid is not None:
            targets.check_pid(self.spec.pid)
            self.pids = [self.spec.pid]
        else:
            assert self.spec.rank is not None  # a pid, or a job and a rank (ComputeSpec)
            self.step, self.pids = targets.resolve_rank(job=str(self.spec.job), rank=self.spec.rank,
                                                        step=self.spec.step)
        prefix = f"/{self.env.cgroup_parent}/"
        for pid in self.pids:
            path = cpu_cgroup_of(pid)
            if path.startswith(prefix):
                raise InputError(f"pid {pid} is already slowed by another injection ({path}); "
                                 "one compute injection per process at a time")
            self.originals[pid] = path
        if self.cpus is None:
            self.cpus = measure_cpus(self.pids)

    @property
    def lead_s(self) -> float:
        """How long resolve() looks at the target before the injection can start."""
        return MEASURE_WINDOW_S if self.spec.cpus is None else 0.0

    def apply(self, record_state=lambda: None) -> None:
        """Create the cgroup with its quota and move the resolved pids into it."""
        record_state()  # before the change, so undo-all knows it even if we die now
        assert self.cpus is not None  # resolve() measured it
        try:
            self.env.cgroup_base.mkdir(exist_ok=True)
            self.cgroup.mkdir()
            _write(self.cgroup / "cpu.cfs_period_us", str(PERIOD_US))
            _write(self.cgroup / "cpu.cfs_quota_us", str(quota_us(self.spec.severity, self.cpus)))
        except OSError as exc:
            raise InputError(f"cannot set up cgroup {self.cgroup}: {exc.strerror}") from exc
        moved = []
        for pid in self.pids:
            try:
                if _move(self.env, str(self.cgroup.relative_to(self.env.cgroup_root)), pid):
                    moved.append(pid)
            except OSError as exc:
                raise InputError(f"cannot move pid {pid} into {self.cgroup}: {exc.strerror}") from exc
        if not moved:
            raise InputError(f"pids {self.pids} exited before they could be slowed")
        self.pids = moved
        log.info("%s: pids %s limited to %.3f CPU in %s", self.id, moved,
                 quota_us(self.spec.severity, self.cpus) / PERIOD_US, self.cgroup)

    def target_alive(self) -> bool:
        return bool(_members(self.cgroup))

    def undo(self) -> None:
        if self.cgroup.exists():
            moved = release_cgroup(self.env, self.cgroup, self.originals)
            log.info("%s: pids %s moved back, cgroup removed", self.id, moved)
        # The parent directory stays: removing it here would race with a concurrent
        # injection creating its cgroup there; undo-all removes it.

    def truth_fields(self) -> dict:
        return {"severity": self.spec.severity,
                "quota_cpus": quota_us(self.spec.severity, self.cpus) / PERIOD_US if self.cpus else None,
                "pids": self.pids, "job": self.spec.job, "step": self.step,
                "rank": self.spec.rank}
