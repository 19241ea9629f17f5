"""The Slurm client: the only module that runs Slurm commands (scontrol, squeue, sacct, sacctmgr, sinfo).

Two backends behind one interface:

- ``CommandLineClient`` runs Slurm's own commands with argument lists (never a shell)
  and parses their ``--parsable`` output with an unusual delimiter, so that a ``|`` in
  a job name or comment cannot break a row.
- ``PySlurmClient`` is used when an importable pyslurm matches the running Slurm's
  major.minor version. PyPI has no pyslurm for Debian 12's Slurm 22.05, so there the
  command-line backend is the one in use; :func:`connect` says which and why.

Job comments. While a job runs, ``scontrol update job=X comment=...`` sets the
comment with its case kept. After the job has ended only the accounting record can be
changed, and Slurm 22.05's ``sacctmgr modify job set Comment=`` lowercases the value.
To keep the case, :meth:`CommandLineClient.set_comment` writes the ended job's comment
through slurmdbd's own storage (the ``derived_es`` column that sacct shows as
``Comment``), with the credentials of slurmdbd.conf, when this host can read them (the
epilog runs as root on the controller); only otherwise does it fall back to sacctmgr,
and says that the case is lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Protocol

from greyhound.errors import InputError, SlurmError

log = logging.getLogger(__name__)

COMMENT_MAX_LEN = 1024
"""Slurm's limit on a job comment."""

_DELIMITER = "\x1f|\x1f"
_JOB_ID = re.compile(r"^[0-9]+(_[0-9]+)?$")
_NAME = re.compile(r"[A-Za-z0-9._-]+")
"""A node or partition name as greyhound passes it to Slurm's commands."""
_S4_HELD = re.compile(r"\bReason=job_requeued_in_held_state\b")
"""A job in the hold of ``scontrol requeuehold`` (S4's first command), not yet released."""
_SLURMDBD_CONF = Path("/etc/slurm/slurmdbd.conf")
_SACCT_FIELDS = (
    "JobID", "JobName", "User", "State", "ExitCode", "Cluster", "NodeList", "NNodes",
    "NTasks", "Submit", "Start", "End", "ElapsedRaw", "WorkDir", "Comment",
)
_TIMEOUT_S = 30
DEFAULT_CRED_EXPIRE_S = 120.0
"""Slurm's credential lifetime when slurm.conf's AuthInfo does not set cred_expire."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JobRecord:
    """One job as Slurm accounting knows it (the allocation line of sacct)."""

    job_id: str
    name: str
    user: str
    state: str
    """Base state, e.g. RUNNING, COMPLETED, FAILED (without "by 0" suffixes)."""
    exit_code: str
    cluster: str
    node_list: str
    num_nodes: int
    submit: str
    start: str
    end: str
    elapsed_s: int
    work_dir: str
    comment: str

    @property
    def running(self) -> bool:
        return self.state in ("RUNNING", "PENDING", "REQUEUED", "SUSPENDED", "CONFIGURING")

    @property
    def in_queue(self) -> bool:
        """Still in Slurm's queue: running, or completing (its steps ending, its epilog
        not yet run)."""
        return self.running or self.state == "COMPLETING"


class SlurmClient(Protocol):
    backend: str

    def job(self, job_id: str) -> JobRecord: ...

    def set_comment(self, job_id: str, comment: str) -> None: ...

    def owner_ids(self, job_id: str) -> tuple[int, int]: ...

    def node_address(self, node: str) -> str: ...

    def hostnames(self, node_list: str) -> list[str]: ...

    def listpids(self, job_step: str) -> str: ...

    def requeue_excluding(self, job_id: str, nodes: list[str]) -> None: ...

    def finish_requeue(self, job_id: str, nodes: list[str], *, wait_s: float = 10.0) -> list[str]: ...

    def requeue_hold_s(self) -> float: ...

    def schedulable_nodes(self, partition: str) -> list[str]: ...


def check_job_id(job_id: str | int) -> str:
    """Returns job_id as a string, or raises InputError if it is not a Slurm job id."""
    text = str(job_id).strip()
    if not _JOB_ID.match(text):
        raise InputError(f"{job_id!r} is not a job id; use a number such as 1234 (or 1234_5 for an array task)")
    return text


def _check_node_names(nodes: list[str]) -> None:
    """Raises InputError unless ``nodes`` is a non-empty list of node names."""
    bad = [n for n in nodes if not isinstance(n, str) or not _NAME.fullmatch(n)]
    if bad or not nodes:
        raise InputError(f"cannot exclude {bad or 'no node'}: node names are letters, digits, '.', '_', '-'")


def merge_comment(existing: str, summary: str, *, prefix: str = "greyhound:") -> str:
    """The job comment with greyhound's summary, keeping the user's own comment.

    An earlier greyhound summary is replaced, not repeated. The user's text is kept
    whole; the summary is shortened to fit Slurm's 1024-character limit.
    """
    if "\n" in summary or "\r" in summary:
        raise InputError("a job comment must be one line")
    user_part = existing.split(prefix, 1)[0].rstrip(" |") if existing else ""
    if not user_part:
        return summary[:COMMENT_MAX_LEN]
    room = COMMENT_MAX_LEN - len(user_part) - 3
    if room <= len(prefix):
        return user_part[:COMMENT_MAX_LEN]
    return f"{user_part} | {summary[:room]}"


def _run(argv: list[str], *, what: str, timeout_s: float = _TIMEOUT_S) -> str:
    """stdout of a Slurm command (an argument list, never a shell); SlurmError with the
    command's last error line when it cannot run, fails or does not answer in time."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError as exc:
        raise SlurmError(f"{what}: {argv[0]} not found; is Slurm installed and on PATH?") from exc
    except OSError as exc:
        raise SlurmError(f"{what}: cannot run {argv[0]}: {exc.strerror or exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise SlurmError(f"{what}: {argv[0]} did not answer within {timeout_s:g}s") from exc
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise SlurmError(f"{what}: {' '.join(argv[:2])} failed: {detail[-1] if detail else f'exit {proc.returncode}'}")
    return proc.stdout


@contextlib.contextmanager
def _sigterm_held():
    """SIGTERM held back from this thread and the commands it starts meanwhile (a
    blocked signal stays blocked across fork and exec), delivered once it is over.
    ``requeuehold`` signals every step of the job, the caller's too when it runs in one
    (greyhound's master does): a ``scontrol update`` started after it died of that
    SIGTERM (exit -15), and the job was requeued onto the node it was to leave. It does
    not help against the SIGKILL that may follow within KillWait (srun's forced end of
    the caller's step): that is left to ``finish_requeue``, which the epilog runs."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _slurmdbd_storage() -> dict[str, str] | None:
    """slurmdbd.conf's MySQL storage settings, or None where this host cannot read them."""
    try:
        text = _SLURMDBD_CONF.read_text()
    except OSError:
        return None
    conf: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "=" in line:
            key, value = line.split("=", 1)
            conf[key.strip().lower()] = value.strip()
    if conf.get("storagetype") != "accounting_storage/mysql":
        return None
    return conf


class CommandLineClient:
    """Slurm through scontrol, sacct and sacctmgr."""

    backend = "command-line"

    def job(self, job_id: str) -> JobRecord:
        job_id = check_job_id(job_id)
        out = _run(
            ["sacct", "-X", "-n", "-P", f"--delimiter={_DELIMITER}", "-j", job_id,
             "-o", ",".join(_SACCT_FIELDS)],
            what=f"job {job_id}",
        )
        rows = [line for line in out.splitlines() if line.strip()]
        if not rows:
            raise SlurmError(f"job {job_id}: no accounting record; is it a job of this cluster?")
        values = rows[-1].split(_DELIMITER)
        if len(values) != len(_SACCT_FIELDS):
            raise SlurmError(f"job {job_id}: sacct returned {len(values)} fields, expected {len(_SACCT_FIELDS)}")
        row = dict(zip(_SACCT_FIELDS, values, strict=True))
        return JobRecord(
            job_id=row["JobID"], name=row["JobName"], user=row["User"],
            state=row["State"].split()[0] if row["State"] else "",
            exit_code=row["ExitCode"], cluster=row["Cluster"], node_list=row["NodeList"],
            num_nodes=int(row["NNodes"] or 0), submit=row["Submit"], start=row["Start"],
            end=row["End"], elapsed_s=int(row["ElapsedRaw"] or 0), work_dir=row["WorkDir"],
            comment=row["Comment"],
        )

    @staticmethod
    def _live_state(job_id: str) -> str:
        """The controller's view of a job's state ("" once it has left the queue)."""
        try:
            out = _run(["squeue", "-h", "-j", job_id, "-o", "%T"], what=f"job {job_id}")
        except SlurmError:
            return ""  # squeue fails for a job id the controller has already purged
        return out.strip().split("\n")[0] if out.strip() else ""

    def owner_ids(self, job_id: str) -> tuple[int, int]:
        """(uid, gid) the job ran as: the controller's view while it still holds the job
        (sacct's reads uid 0 for a moment after a job ends), else accounting's."""
        job_id = check_job_id(job_id)
        try:
            out = _run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%U %G"], what=f"job {job_id}")
        except SlurmError:
            out = ""      # squeue fails for a job id the controller has already purged
        if not out.strip():
            out = _run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "UID,GID"], what=f"job {job_id}")
            out = out.strip().splitlines()[-1].replace("|", " ") if out.strip() else ""
        try:
            uid, gid = (int(x) for x in out.split()[:2])
        except ValueError:
            raise SlurmError(f"job {job_id}: cannot tell which user it ran as (got {out.strip()!r})") from None
        return uid, gid

    def node_address(self, node: str) -> str:
        """The IPv4 address other nodes reach ``node`` at (its NodeAddr, resolved)."""
        import socket

        if not _NAME.fullmatch(node):
            raise InputError(f"{node!r} is not a node name")
        out = _run(["scontrol", "show", "node", "-o", node], what=f"node {node}")
        match = re.search(r"\bNodeAddr=(\S+)", out)
        if not match:
            raise SlurmError(f"node {node}: scontrol shows no NodeAddr")
        try:
            return str(socket.getaddrinfo(match.group(1), None, socket.AF_INET)[0][4][0])
        except OSError as exc:
            raise SlurmError(f"node {node}: cannot resolve NodeAddr {match.group(1)}: {exc}") from None

    def listpids(self, job_step: str) -> str:
        """Raw `scontrol listpids JOB[.STEP]` output: this host's processes of the job."""
        return _run(["scontrol", "listpids", job_step], what=f"job {job_step}")

    def requeue_excluding(self, job_id: str, nodes: list[str]) -> None:
        """Puts a running batch job back in the queue, barred from ``nodes`` (greyhound's
        S4), with what the job's own user may do: ``requeuehold`` (the job goes pending
        and held; Slurm signals its steps, the caller's included, and kills them after
        KillWait), then ExcNodeList (Slurm changes it on a pending job only: the hold
        makes it one at once), then ``release``. The release is tried whatever failed
        before it: a job left held never runs again. Slurm then holds the job back for
        ``requeue_hold_s()`` (its begin time, set when its steps have ended: a caller
        inside the job cannot lift it). A caller inside the job can be killed before it
        is done: :meth:`finish_requeue`, run by the epilog, completes what it left.

        Raises:
            InputError: a node name that is not one.
            SlurmError: a step failed (the message says which; the job is released).
        """
        job_id = check_job_id(job_id)
        _check_node_names(nodes)
        shown = _run(["scontrol", "show", "job", "-o", job_id], what=f"job {job_id}")
        with _sigterm_held():
            _run(["scontrol", "requeuehold", job_id], what=f"job {job_id}")
            try:
                self._exclude(job_id, nodes, self._excluded(shown))
            finally:
                _run(["scontrol", "release", job_id], what=f"job {job_id}")

    def finish_requeue(self, job_id: str, nodes: list[str], *, wait_s: float = 10.0) -> list[str]:
        """Completes S4's requeue of job_id without ``nodes`` where its caller could not.
        EpilogSlurmctld runs this as the job's user when the job's allocation ends: the
        master requeues from inside the job, and Slurm ends the master's own step with
        the others (SIGKILL after KillWait), so the exclusion was lost in 2 of 6 tries
        on the local cluster, and a master killed between hold and release would leave
        the job held for good. Waits up to ``wait_s`` for the master to release the job,
        then adds what is missing from ExcNodeList and releases a job still in S4's
        hold. It can do only what the job's user may; Slurm refuses the update for a
        job that has ended for good, and the error says so.

        Returns what it did ("excluded n3", "released"); empty when the master did it all.

        Raises:
            InputError: a node name that is not one.
            SlurmError: a Slurm command failed.
        """
        job_id = check_job_id(job_id)
        _check_node_names(nodes)
        deadline = time.monotonic() + wait_s
        while _S4_HELD.search(shown := _run(["scontrol", "show", "job", "-o", job_id], what=f"job {job_id}")) \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        done, excluded = [], self._excluded(shown)
        if missing := [n for n in nodes if n not in excluded]:
            self._exclude(job_id, nodes, excluded)
            done.append(f"excluded {','.join(missing)}")
        if _S4_HELD.search(shown):
            _run(["scontrol", "release", job_id], what=f"job {job_id}")
            done.append("released")
        return done

    def _excluded(self, shown: str) -> list[str]:
        """The nodes in the ExcNodeList of a ``scontrol show job -o`` line."""
        match = re.search(r"\bExcNodeList=(\S+)", shown)
        return self.hostnames(match.group(1)) if match and match.group(1) != "(null)" else []

    def _exclude(self, job_id: str, nodes: list[str], excluded: list[str]) -> None:
        """Sets the job's ExcNodeList to ``excluded`` (what it has: the user's own kept)
        and ``nodes``."""
        merged = excluded + [n for n in nodes if n not in excluded]
        _run(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(merged)}"], what=f"job {job_id}")

    def requeue_hold_s(self) -> float:
        """Seconds Slurm holds a requeued job before it may start again: the credential
        lifetime, so that the old allocation's credentials lapse first (slurm.conf
        ``AuthInfo=cred_expire=N``; 120 s when unset)."""
        out = _run(["scontrol", "show", "config"], what="Slurm configuration")
        match = re.search(r"^AuthInfo\s*=.*\bcred_expire=(\d+)", out, re.MULTILINE)
        return float(match.group(1)) if match else DEFAULT_CRED_EXPIRE_S

    def schedulable_nodes(self, partition: str) -> list[str]:
        """The partition's nodes a job can be given now or later: up and responding,
        not drained, down, failed or in maintenance."""
        if not _NAME.fullmatch(partition):
            raise InputError(f"{partition!r} is not a partition name")
        out = _run(["sinfo", "-h", "-N", "-p", partition, "-o", "%N %t"], what=f"partition {partition}")
        usable = ("idle", "alloc", "mix", "comp", "plnd")
        nodes = []
        for line in out.splitlines():
            node, _, state = line.partition(" ")
            if state.strip() in usable and node not in nodes:    # "idle*": not responding
                nodes.append(node)
        return nodes

    def hostnames(self, node_list: str) -> list[str]:
        if not node_list or node_list in ("None assigned", "(null)"):
            return []
        return _run(["scontrol", "show", "hostnames", node_list], what="hostnames").split()

    def set_comment(self, job_id: str, comment: str) -> None:
        """Sets the job's comment, case kept (see the module docstring)."""
        job_id = check_job_id(job_id)
        if len(comment) > COMMENT_MAX_LEN:
            raise InputError(f"a job comment has at most {COMMENT_MAX_LEN} characters, got {len(comment)}")
        if self._live_state(job_id) in ("PENDING", "RUNNING", "SUSPENDED", "CONFIGURING", "REQUEUED"):
            _run(["scontrol", "update", f"job={job_id}", f"comment={comment}"], what=f"job {job_id}")
            return
        record = self.job(job_id)
        storage = _slurmdbd_storage()
        if storage is not None:
            try:
                self._set_comment_in_storage(storage, record, comment)
                return
            except SlurmError as exc:
                log.warning("%s; falling back to sacctmgr", exc)
        log.warning("job %s: sacctmgr of Slurm 22.05 stores the comment in lower case", job_id)
        _run(["sacctmgr", "-i", "modify", "job", "where", f"jobid={job_id}", "set", f"Comment={comment}"],
             what=f"job {job_id}")

    @staticmethod
    def _set_comment_in_storage(storage: dict[str, str], record: JobRecord, comment: str) -> None:
        import pymysql

        table = f"{record.cluster}_job_table"
        if not re.fullmatch(r"[A-Za-z0-9_]+", table):
            raise SlurmError(f"job {record.job_id}: unexpected cluster name {record.cluster!r}")
        try:
            conn = pymysql.connect(
                host=storage.get("storagehost", "localhost"),
                port=int(storage.get("storageport", "3306")),
                user=storage.get("storageuser", "slurm"),
                password=storage.get("storagepass", ""),
                database=storage.get("storageloc", "slurm_acct_db"),
                connect_timeout=10, read_timeout=10, write_timeout=10,
            )
        except pymysql.MySQLError as exc:
            raise SlurmError(f"job {record.job_id}: cannot reach the accounting storage: {exc}") from exc
        try:
            with conn.cursor() as cur:
                # A job id can be reused after a database reset: take the newest record.
                updated = cur.execute(
                    f"UPDATE `{table}` SET derived_es=%s WHERE id_job=%s "
                    f"ORDER BY time_submit DESC LIMIT 1",
                    (comment, int(record.job_id.split("_")[0])),
                )
            conn.commit()
        except pymysql.MySQLError as exc:
            raise SlurmError(f"job {record.job_id}: writing the comment failed: {exc}") from exc
        finally:
            conn.close()
        if updated != 1 and record.comment != comment:
            raise SlurmError(f"job {record.job_id}: no accounting row to update")


class PySlurmClient(CommandLineClient):
    """Reads jobs through pyslurm's database API; writes go through the commands."""

    backend = "pyslurm"

    def __init__(self, pyslurm_module) -> None:
        self._pyslurm = pyslurm_module

    def job(self, job_id: str) -> JobRecord:
        job_id = check_job_id(job_id)
        try:
            job = self._pyslurm.db.Job.load(int(job_id.split("_")[0]))
        except Exception as exc:  # pyslurm raises its own RPCError and others
            raise SlurmError(f"job {job_id}: pyslurm: {exc}") from exc
        return JobRecord(
            job_id=job_id, name=job.name or "", user=job.user_name or "",
            state=(job.state or "").split()[0], exit_code=str(job.exit_code or ""),
            cluster=job.cluster or "", node_list=job.nodelist or "",
            num_nodes=int(job.num_nodes or 0), submit=str(job.submit_time or ""),
            start=str(job.start_time or ""), end=str(job.end_time or ""),
            elapsed_s=int(job.elapsed_time or 0), work_dir=job.working_directory or "",
            comment=job.comment or "",
        )


def start_overlap_step(argv: list[str], *, num_nodes: int, log_fd: int, env: dict[str, str],
                       name: str = "greyhound") -> subprocess.Popen:
    """Starts ``argv`` as a job step of one task per node that shares every CPU, memory
    and GRES with the job's other steps (``srun --overlap``, Slurm >= 21.08: the user's
    own ``srun`` never waits for it), from inside the job's allocation. srun's messages
    and the task's output go to ``log_fd``. A task that dies (a signal, a non-zero
    status) ends the step (``--kill-on-bad-exit``): the others, one MPI world with it,
    cannot go on, and a plane task that crashed in MPI_Init left the other three
    polling Open MPI at a full core each until the launcher's 60 s deadline, on the
    cores of the job it was there to watch.

    Raises:
        OSError: srun cannot be started.
    """
    command = ["srun", "--overlap", f"--nodes={num_nodes}", f"--ntasks={num_nodes}", "--ntasks-per-node=1",
               "--mpi=pmix", "--gres=none", f"--job-name={name}", "--kill-on-bad-exit=1", "--quiet",
               "--export=ALL", *argv]
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd, env=env)


def running_slurm_version() -> str | None:
    """The installed Slurm's version ("22.05.8"), or None when Slurm is not installed."""
    try:
        out = _run(["sinfo", "--version"], what="Slurm version", timeout_s=10)
    except SlurmError:
        return None
    match = re.search(r"(\d+\.\d+\.\d+)", out)
    return match.group(1) if match else None


def choose_backend() -> tuple[str, str]:
    """(backend, reason): pyslurm when it imports and matches Slurm's major.minor."""
    if os.environ.get("GREYHOUND_SLURM_BACKEND") == "command-line":
        return "command-line", "GREYHOUND_SLURM_BACKEND=command-line"
    try:
        import pyslurm  # type: ignore[import-not-found]
    except ImportError:
        return "command-line", "pyslurm is not installed (PyPI has none for Slurm 22.05)"
    slurm = running_slurm_version()
    wanted = getattr(pyslurm, "__version__", "")
    if slurm is None or wanted.split(".")[:2] != slurm.split(".")[:2]:
        return "command-line", f"pyslurm {wanted or '?'} does not match Slurm {slurm or '?'}"
    return "pyslurm", f"pyslurm {wanted} matches Slurm {slurm}"


def connect() -> SlurmClient:
    """The Slurm client for this machine (see :func:`choose_backend`)."""
    backend, reason = choose_backend()
    log.debug("slurm backend: %s (%s)", backend, reason)
    if backend == "pyslurm":
        import pyslurm

        return PySlurmClient(pyslurm)
    return CommandLineClient()
