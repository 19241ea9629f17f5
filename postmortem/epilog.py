"""The post-mortem of one ended job, as EpilogSlurmctld runs it (slurm/epilog_slurmctld).

Two processes, because the run directory, the trace and the report directory are the
user's to shape (symlinks, planted files, ``report=`` pointing anywhere) while the
epilog runs as root:

- the **root step** (:func:`run`) takes one of a bounded number of analysis slots,
  starts the unprivileged step as the job's user, waits for it with a time limit, and
  puts the one-line summary on the job's accounting record. It opens nothing in the run
  directory, the trace or the report directory; the only thing it takes from there is
  the unprivileged step's stdout, checked to be one printable line.
- the **unprivileged step** (:func:`analyze_job`, ``--as-user``) runs as the job's uid,
  gid and groups, with a memory limit, from ``/``, under ``python -I``: it finds the
  timeline, merges it, runs the what-if analysis and writes the report into a directory
  only the user can read. It can read and write exactly what the user can, so no link
  or path the user plants reaches beyond the user's own files.

A job without a usable trace gets a record that says why, and so does one whose
analysis was refused (the controller busy), ran out of time or of memory. Nothing here
can fail the job: it has ended, and the epilog script runs this detached.

Slurm runs the epilog when a job is requeued too. Before it waits for a slot, the root
step starts a short unprivileged step (:func:`finish_requeue`, ``--as-user
--finish-requeue``) that completes an S4 requeue the job's master began from inside
the job and may not have finished (Slurm kills the master's step with the others): the
bad node excluded, the job released. It too runs as the job's user, so it can do only
what that user may do to their own job.

Usage: python -I -m postmortem.epilog JOBID   (as root on the controller)
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import pwd
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from greyhound.errors import GreyhoundError, InputError
from greyhound.plugstack import DEFAULT_RUNDIR, PLUGSTACK_ENTRY, read_plugstack
from greyhound.slurm_client import COMMENT_MAX_LEN, check_job_id, connect, merge_comment

log = logging.getLogger(__name__)

OPTIONS_FILE = "options"
"""Written by the SPANK plugin into the run directory: the job's effective options."""
TIMELINE_DIRS = ("timeline", "trace", ".")
"""Where inside the run directory the training job's timeline may be."""
NOT_GREYHOUND_EXIT = 3
"""The unprivileged step's exit status for a job without a run directory."""
SUMMARY_PREFIX = "greyhound: "
OUT_OF_MEMORY = "greyhound: no post-mortem: the analysis ran out of memory (GREYHOUND_EPILOG_MEM_KB)"
_CAUSE_MAX_CHARS = 200
"""How much of an exception's text goes onto the record."""
FINISH_REQUEUE_TIMEOUT_S = 60.0
"""Wall-clock limit of the step that completes an S4 requeue (it waits up to 10 s for
the master, then runs at most four Slurm commands)."""
_NODE_LIST = re.compile(r"[A-Za-z0-9._,\[\]-]{1,4096}")
"""A Slurm node list as slurmctld gives it to the epilog (n[1-4],gpu7)."""
_OUTPUT_MAX_BYTES = 64 * 1024
"""How much of the unprivileged step's stdout/stderr the root step keeps."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EpilogConfig:
    rundir: Path = DEFAULT_RUNDIR
    """Parent of the per-job run directories (plugstack ``rundir=``)."""
    timeout_s: float = 300.0
    """Wall-clock limit of one analysis (``GREYHOUND_EPILOG_TIMEOUT_S``)."""
    mem_kb: int = 8 * 1024 * 1024
    """Address-space limit of one analysis (``GREYHOUND_EPILOG_MEM_KB``)."""
    slots: int = 2
    """Analyses that may run at once on the controller (``GREYHOUND_EPILOG_SLOTS``):
    the controller's memory for post-mortems is at most ``slots * mem_kb``."""
    queue: int = 64
    """Ended jobs that may wait for a slot (``GREYHOUND_EPILOG_QUEUE``); the next one
    is refused at once, with a line on its record."""
    queue_wait_s: float = 900.0
    """How long a job waits for a slot before it is refused (``GREYHOUND_EPILOG_QUEUE_WAIT_S``)."""
    lock_dir: Path = Path("/run/greyhound/epilog")
    """Root-only directory of the slot and queue lock files."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "mem_kb", "slots", "queue"):
            if getattr(self, name) <= 0:
                raise InputError(f"epilog setting {name}={getattr(self, name)} must be positive")
        if self.queue_wait_s < 0:
            raise InputError(f"epilog setting queue_wait_s={self.queue_wait_s} must be >= 0")


_ENV_SETTINGS = {
    "GREYHOUND_EPILOG_TIMEOUT_S": ("timeout_s", float),
    "GREYHOUND_EPILOG_MEM_KB": ("mem_kb", int),
    "GREYHOUND_EPILOG_SLOTS": ("slots", int),
    "GREYHOUND_EPILOG_QUEUE": ("queue", int),
    "GREYHOUND_EPILOG_QUEUE_WAIT_S": ("queue_wait_s", float),
}


def read_config(env: Mapping[str, str] | None = None, *, plugstack: Path = PLUGSTACK_ENTRY) -> EpilogConfig:
    """The epilog's settings: plugstack ``rundir=`` and the ``GREYHOUND_EPILOG_*`` variables
    of slurmctld's environment. A bad variable is logged and its default kept."""
    env = os.environ if env is None else env
    try:
        rundir = read_plugstack(plugstack).rundir
    except InputError as exc:
        log.error("%s; using %s", exc, DEFAULT_RUNDIR)
        rundir = DEFAULT_RUNDIR
    values: dict = {"rundir": rundir}
    for var, (field, kind) in _ENV_SETTINGS.items():
        if var in env:
            try:
                values[field] = kind(env[var])
                EpilogConfig(**{field: values[field]})
            except (ValueError, InputError):
                log.error("%s=%r is not allowed (a positive number); using the default", var, env[var])
                values.pop(field)
    return EpilogConfig(**values)


# --- the root step ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class JobOwner:
    uid: int
    gid: int
    groups: tuple[int, ...]
    name: str
    home: str


def job_owner(uid: int, gid: int) -> JobOwner:
    """The job's user as this host knows them, with their groups."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        raise GreyhoundError(f"the job's uid {uid} is unknown on this host") from None
    return JobOwner(uid=uid, gid=gid, groups=tuple(os.getgrouplist(entry.pw_name, gid)),
                    name=entry.pw_name, home=entry.pw_dir)


def job_owner_ids(job_id: str, client, env: Mapping[str, str]) -> tuple[int, int]:
    """(uid, gid) of the job: SLURM_JOB_UID/GID as slurmctld gives them to EpilogSlurmctld,
    else what Slurm says (a run by hand)."""
    try:
        return int(env["SLURM_JOB_UID"]), int(env["SLURM_JOB_GID"])
    except (KeyError, ValueError):
        return client.owner_ids(job_id)


class Busy(GreyhoundError):
    """No analysis slot could be had."""


def _root_lock_dir(path: Path) -> int:
    """A descriptor of the lock directory, made root-only if missing; refused if anyone
    but root could plant files in it."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise GreyhoundError(f"{path} must be owned by uid {os.geteuid()} and writable by it alone")
    return fd


def _try_lock(dir_fd: int, kind: str, count: int) -> int | None:
    """Takes the first free one of ``count`` lock files ``kind.N``; its fd, or None."""
    for i in range(count):
        fd = os.open(f"{kind}.{i}", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            os.close(fd)
    return None


@contextlib.contextmanager
def analysis_slot(config: EpilogConfig) -> Iterator[None]:
    """Holds one of ``config.slots`` analysis slots for the block (flock: a killed epilog
    frees its slot). Waits at most ``queue_wait_s`` in a queue of ``config.queue``.

    Raises:
        Busy: the queue is full, or no slot came free in time.
    """
    dir_fd = _root_lock_dir(config.lock_dir)
    held: list[int] = []
    try:
        slot = _try_lock(dir_fd, "slot", config.slots)
        if slot is None:
            place = _try_lock(dir_fd, "queue", config.queue)
            if place is None:
                raise Busy(f"the controller is busy ({config.slots} post-mortems running, "
                           f"{config.queue} waiting)")
            held.append(place)
            deadline = time.monotonic() + config.queue_wait_s
            while (slot := _try_lock(dir_fd, "slot", config.slots)) is None:
                if time.monotonic() >= deadline:
                    raise Busy(f"no post-mortem slot came free within {config.queue_wait_s:g}s "
                               f"({config.slots} running)")
                time.sleep(0.5)
        held.append(slot)
        yield
    finally:
        for fd in held:
            os.close(fd)
        os.close(dir_fd)


def _drain(stream, out: bytearray) -> None:
    """Reads stream to its end, keeping at most _OUTPUT_MAX_BYTES."""
    while chunk := stream.read1(65536):
        if len(out) < _OUTPUT_MAX_BYTES:
            out += chunk[: _OUTPUT_MAX_BYTES - len(out)]


def _set_child_limits(mem_kb: int) -> None:
    import resource

    mem = mem_kb * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def checked_summary(stdout: bytes) -> str:
    """The unprivileged step's summary, if it is one printable greyhound line.

    Raises:
        GreyhoundError: anything else (the step runs as the user, who can shape it).
    """
    text = stdout.decode("utf-8", "replace").rstrip("\n")
    if "\n" in text or not text.startswith(SUMMARY_PREFIX) or len(text) > COMMENT_MAX_LEN \
            or not text.isprintable():
        raise GreyhoundError("the analysis returned no readable summary")
    return text


def _run_as_user(args: list[str], owner: JobOwner, config: EpilogConfig, *,
                 timeout_s: float) -> tuple[int | None, bytes, bytes]:
    """Runs ``python -I -m postmortem.epilog --as-user ARGS`` as the job's owner, from /,
    in its own process group, with the memory limit; (exit status or None when it ran
    out of time and was killed, stdout, stderr), each output kept to _OUTPUT_MAX_BYTES."""
    argv = [sys.executable, "-I", "-m", "postmortem.epilog", "--as-user", *args]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": owner.home,
           "USER": owner.name, "LOGNAME": owner.name, "TMPDIR": "/tmp"}
    proc = subprocess.Popen(
        argv, cwd="/", env=env, user=owner.uid, group=owner.gid, extra_groups=list(owner.groups),
        process_group=0, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=lambda: _set_child_limits(config.mem_kb),  # noqa: PLW1509 (the root step has one thread)
    )
    stdout, stderr = bytearray(), bytearray()
    readers = [threading.Thread(target=_drain, args=(s, b), daemon=True)
               for s, b in ((proc.stdout, stdout), (proc.stderr, stderr))]
    for r in readers:
        r.start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = None
    for r in readers:
        r.join(timeout=5)
    return rc, bytes(stdout), bytes(stderr)


def analyze_as_user(job_id: str, owner: JobOwner, config: EpilogConfig) -> str | None:
    """Runs the unprivileged step for job_id as its owner; its summary (None: no run dir).

    Never raises for what the step did: a crash, a timeout or garbage becomes a summary
    that says so.
    """
    rc, stdout, stderr = _run_as_user(["--rundir", str(config.rundir), job_id], owner, config,
                                      timeout_s=config.timeout_s)
    for line in stderr.decode("utf-8", "replace").splitlines()[-20:]:
        log.info("job %s: analysis: %s", job_id, line[:500].encode("unicode_escape").decode())
    if rc is None:
        return (f"greyhound: no post-mortem: the analysis took longer than {config.timeout_s:g}s "
                "(GREYHOUND_EPILOG_TIMEOUT_S); run greyhound postmortem on the trace yourself")
    if rc == NOT_GREYHOUND_EXIT:
        return None
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        why = f" (memory limit {config.mem_kb // 1024} MiB, GREYHOUND_EPILOG_MEM_KB)" if rc == -signal.SIGKILL else ""
        return f"greyhound: no post-mortem: the analysis was stopped by {name}{why}"
    try:
        return checked_summary(stdout)
    except GreyhoundError as exc:
        last = next((ln for ln in reversed(stderr.decode("utf-8", "replace").splitlines()) if ln.strip()), "")
        last = "".join(c for c in last if c.isprintable())[:_CAUSE_MAX_CHARS]
        return f"greyhound: no post-mortem: {exc} (exit status {rc}{': ' + last if last else ''})"


def finish_requeue_as_user(job_id: str, owner: JobOwner, config: EpilogConfig, node_list: str) -> None:
    """Completes an S4 requeue of job_id that its master began (see
    ``CommandLineClient.finish_requeue``), as the job's owner: root lends this step no
    power, so a run dir or event log shaped by the user can make it do only what the
    user may do to their own job. Logs what was done; never raises."""
    if not _NODE_LIST.fullmatch(node_list):
        log.info("job %s: S4: SLURM_JOB_NODELIST %r is not a node list; nothing to finish", job_id, node_list[:80])
        return
    rc, stdout, stderr = _run_as_user(["--finish-requeue", "--nodes", node_list, "--rundir", str(config.rundir),
                                       job_id], owner, config, timeout_s=FINISH_REQUEUE_TIMEOUT_S)
    lines = (stdout + stderr).decode("utf-8", "replace").splitlines()
    for line in lines[-5:]:
        log.info("job %s: %s", job_id, line[:500].encode("unicode_escape").decode())
    if rc != 0:
        log.info("job %s: S4: the step ended with %s", job_id, "a timeout" if rc is None else f"status {rc}")


def run(job_id: str, *, config: EpilogConfig | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The post-mortem of job_id; returns the summary put on its record (None: not greyhound's)."""
    job_id = check_job_id(job_id)
    config = config or read_config(env)
    t0 = time.monotonic()
    client = connect()
    env = os.environ if env is None else env
    owner = job_owner(*job_owner_ids(job_id, client, env))
    # First, and without waiting for a slot: Slurm starts a requeued job again once its
    # hold (cred_expire, 30-120 s) is over, and S4's exclusion must be in place by then.
    finish_requeue_as_user(job_id, owner, config, env.get("SLURM_JOB_NODELIST", ""))
    try:
        with analysis_slot(config):
            summary = analyze_as_user(job_id, owner, config)
    except Busy as exc:
        summary = f"greyhound: no post-mortem: {exc}; run greyhound postmortem on the trace yourself"
    if summary is None:
        return None
    record = client.job(job_id)
    client.set_comment(job_id, merge_comment(record.comment, summary))
    log.info("job %s (%s): %s (%.1fs)", job_id, owner.name, summary, time.monotonic() - t0)
    return summary


# --- the unprivileged step ------------------------------------------------------------


def read_options(run_dir: Path) -> dict[str, str]:
    try:
        text = (run_dir / OPTIONS_FILE).read_text()
    except OSError:
        return {}
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def find_trace(run_dir: Path, job_id: str) -> Path:
    """The job's HDF5 trace, merging per-rank timeline files if needed.

    Raises:
        GreyhoundError: with the reason there is no usable trace.
    """
    from postmortem.merge import TRACE_FILE_NAME, merge_trace_dir

    for sub in TIMELINE_DIRS:
        d = run_dir / sub
        merged = d / TRACE_FILE_NAME
        try:
            rank_files = list(d.glob("rank-*.jsonl"))
            # A merged trace older than a rank file is a requeued job's first run's (the
            # epilog merged it at the requeue, and the next run appended to the files).
            if merged.is_file() and os.access(merged, os.R_OK) and \
                    merged.stat().st_mtime >= max((f.stat().st_mtime for f in rank_files), default=0.0):
                return merged
            if merged.exists() and not os.access(merged, os.R_OK):
                raise GreyhoundError(f"cannot read {merged}: permission denied")
            if rank_files:
                return merge_trace_dir(d, job_id=job_id)
        except PermissionError as exc:
            raise GreyhoundError(f"cannot read {exc.filename or d}: permission denied") from None
    raise GreyhoundError(f"no timeline trace in {run_dir} (the job recorded none)")


def report_dir_for(run_dir: Path, options: dict[str, str], job_id: str) -> Path:
    if options.get("report"):
        return Path(options["report"]) / f"greyhound-{job_id}"
    return run_dir / "report"


def _make_private_dir(path: Path) -> None:
    """Creates path (mode 0700) or checks that the existing one is the caller's own,
    private directory, not a symlink."""
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError as exc:
        raise GreyhoundError(f"cannot create the report directory {path}: {exc.strerror}") from None
    st = path.lstat()
    if not path.is_dir() or path.is_symlink() or st.st_uid != os.getuid():
        raise GreyhoundError(f"the report directory {path} exists and is not a directory of the job's user")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


def analyze_job(job_id: str, rundir: Path) -> str | None:
    """As the job's user: the analysis and the report; the summary line (None: no run dir)."""
    job_id = check_job_id(job_id)
    run_dir = rundir / job_id
    try:
        _check_own_run_dir(run_dir)
    except FileNotFoundError:
        return None
    except GreyhoundError as exc:
        return f"greyhound: no post-mortem: {exc}"
    options = read_options(run_dir)
    try:
        if options.get("trace") == "off":
            raise GreyhoundError("tracing was off for this job (--greyhound=trace=off)")
        from postmortem.analysis import analyze, summary_line
        from postmortem.report import write_report
        from postmortem.whatif_import import load_any

        trace_path = find_trace(run_dir, job_id)
        result = analyze(load_any(trace_path))
        out = report_dir_for(run_dir, options, job_id)
        _make_private_dir(out)
        page = write_report(result, out, run_dir=run_dir)  # its events.jsonl: the online control plane's events
        summary = summary_line(result, str(page))
    except GreyhoundError as exc:
        summary = f"greyhound: no post-mortem: {exc}"
    except MemoryError:
        summary = OUT_OF_MEMORY
    except Exception as exc:  # never leave the record silent, whatever broke
        log.exception("post-mortem of job %s failed", job_id)
        if isinstance(exc, ImportError) and "failed to map segment" in str(exc):
            summary = OUT_OF_MEMORY    # a library too big for the address-space limit
        else:
            summary = f"greyhound: no post-mortem: internal error ({type(exc).__name__}: {str(exc)[:_CAUSE_MAX_CHARS]})"
    note = requeue_note(run_dir)
    summary = " ".join(summary.split())
    return f"{summary}; {note}"[:COMMENT_MAX_LEN] if note else summary


def _check_own_run_dir(run_dir: Path) -> None:
    """Raises FileNotFoundError when run_dir is missing, GreyhoundError when it is not a
    directory (a symlink included) of this process's user."""
    st = run_dir.lstat()
    if not run_dir.is_dir() or run_dir.is_symlink():
        raise GreyhoundError(f"{run_dir} is not a directory")
    if st.st_uid != os.getuid():
        raise GreyhoundError(f"{run_dir} is owned by uid {st.st_uid}, not the job's uid {os.getuid()}")


def _requeued_events(run_dir: Path) -> list[dict]:
    """The run's ``requeued`` events (S4 began a requeue), oldest first; [] when the
    event log cannot be read. A ``requeued`` event followed by S4's "requeue failed"
    stays in the list: the note says what was tried."""
    from greyhound.control.events import read_events

    try:
        return [e for e in read_events(run_dir) if e["kind"] == "requeued"]
    except Exception:  # noqa: BLE001  (the note is extra: the post-mortem stands without it)
        return []


def requeue_note(run_dir: Path) -> str | None:
    """What S4 did to this job, from its event log, for its record ("S4 requeued it
    without n3 after step 309: link fail-slow at n3"); None when it did nothing. The
    run's own note on the comment does not outlive the requeue, so the post-mortem's
    summary carries it."""
    parts = []
    for e in _requeued_events(run_dir)[-3:]:
        nodes = ",".join(str(n) for n in e.get("nodes", []) if isinstance(n, str))[:80] or "?"
        parts.append(f"S4 requeued it without {nodes} after step {e.get('step')}: {str(e.get('why'))[:120]}")
    # The events are the user's to write: only printable text reaches the record (the
    # root side refuses a summary with anything else, and the post-mortem's with it).
    return "; ".join(" ".join("".join(c if c.isprintable() else " " for c in p).split()) for p in parts) or None


def finish_requeue(job_id: str, rundir: Path, node_list: str) -> str | None:
    """As the job's user, at the end of an allocation: if this run's master began an
    S4 requeue (the last ``requeued`` event names a node of this allocation), makes sure
    the job waits for its next start barred from those nodes, and released; what was
    done, or None when there was nothing to do."""
    from greyhound.slurm_client import CommandLineClient

    job_id = check_job_id(job_id)
    run_dir = rundir / job_id
    try:
        _check_own_run_dir(run_dir)
    except (OSError, GreyhoundError):
        return None
    events = _requeued_events(run_dir)
    if not events:
        return None
    slurm = CommandLineClient()
    allocated = slurm.hostnames(node_list)
    # None of them: an earlier run's requeue (a requeued run goes on in the same run
    # dir, without the node), or an event naming nodes the job never had.
    nodes = [n for n in events[-1].get("nodes", []) if isinstance(n, str) and n in allocated]
    if not nodes:
        return None
    done = slurm.finish_requeue(job_id, nodes)
    return f"greyhound: S4: {'; '.join(done) if done else 'the master had excluded ' + ','.join(nodes)}"


def _as_user_main(argv: list[str]) -> int:
    import tempfile

    rundir = Path(argv[argv.index("--rundir") + 1])
    job_id = argv[-1]
    os.umask(0o077)
    if "--finish-requeue" in argv:
        try:
            done = finish_requeue(job_id, rundir, argv[argv.index("--nodes") + 1])
        except GreyhoundError as exc:
            print(f"greyhound: S4: {exc}")
            return 1
        if done:
            print(done)
        return 0
    with tempfile.TemporaryDirectory(prefix="greyhound-epilog-") as mpl_dir:
        os.environ["MPLCONFIGDIR"] = mpl_dir
        summary = analyze_job(job_id, rundir)
    if summary is None:
        return NOT_GREYHOUND_EXIT
    print(summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s greyhound: epilog: %(message)s")
    if argv[:1] == ["--as-user"] and "--rundir" in argv:
        return _as_user_main(argv)
    if len(argv) != 1:
        print("greyhound: epilog: usage: python -I -m postmortem.epilog JOBID", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("greyhound: epilog: must run as root (it runs the analysis as the job's user)", file=sys.stderr)
        return 2
    try:
        run(argv[0])
    except (GreyhoundError, OSError) as exc:
        print(f"greyhound: epilog: job {argv[0]}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
