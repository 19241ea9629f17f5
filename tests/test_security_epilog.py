"""Attacks on the root epilog by an unprivileged user, on the real local cluster.

A second user (created here) submits `sbatch --greyhound` jobs that shape their own run
directory the way a hostile user would: a symlinked report directory, symlinks inside a
real one, symlinks planted at the temporary names the merge and the report write, a
trace that is a symlink to another user's trace, and `report=` pointing at a root-only
directory. slurmctld's EpilogSlurmctld then runs the post-mortem as root. Each test
asserts that nothing outside the attacker's own reach changed owner, mode or content,
that the attacker got nothing of another user's, and that the job's record still says
what happened.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import REPO, SlurmJob, comment_of, ensure_user

pytestmark = pytest.mark.cluster

RUN_DIR_BASE = Path("/var/tmp/greyhound")
ATTACKER = "gh-attacker"
VICTIM = "gh-victim"
REPORT_FILES = ("postmortem.json", "report.html", "heatmap.png", "step_slowdown.png", "timeline.trace.json")


@pytest.fixture(scope="module")
def users(cluster):
    if shutil.which("useradd") is None:
        pytest.skip("useradd is missing: the attack tests need a second, unprivileged user")
    return ensure_user(ATTACKER), ensure_user(VICTIM)


@pytest.fixture(scope="module")
def trace_file(users, tmp_path_factory):
    """A small trace with a slow worker, readable by the attacker (as if their job wrote it)."""
    from postmortem.generate import SyntheticJob, generate
    from postmortem.schema import write_trace

    d = Path(tempfile.mkdtemp(prefix="gh-attack-trace-", dir="/tmp"))
    d.chmod(0o755)
    trace, _ = generate(SyntheticJob(dp=2, pp=2, num_microbatches=4, num_steps=6,
                                     slow_workers=((1, 0, 1.8),), seed=11))
    write_trace(d / "trace.h5", ops=trace.ops, workers=trace.workers, meta=trace.meta)
    (d / "trace.h5").chmod(0o644)
    yield d / "trace.h5"
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def rank_files(users):
    """Per-rank timeline files of a dp=2 x pp=2 job, from which the epilog merges trace.h5."""
    from greyhound.timeline import TimelineConfig, TimelineRecorder

    d = Path(tempfile.mkdtemp(prefix="gh-attack-ranks-", dir="/tmp"))
    d.chmod(0o755)
    job = {"dp": 2, "pp": 2, "tp": 1, "num_microbatches": 2, "microbatches_per_dp": [2, 2],
           "schedule": "1F1B", "job_id": "0", "trial_name": "attack"}
    for rank in range(4):
        rec = TimelineRecorder(TimelineConfig(trace_dir=str(d), every=1), rank=rank, dp_rank=rank % 2,
                               pp_rank=rank // 2, node="n1", device="cpu", job=job)
        t = 0.0
        for step in range(3):
            rec.start_step(step, num_microbatches=2)
            for mb in range(2):
                rec.record("forward-compute", microbatch=mb, start=t, duration=0.02 if rank == 1 else 0.01)
                rec.record("backward-compute", microbatch=mb, start=t + 0.02, duration=0.02)
                t += 0.05
            rec.end_step()
        rec.close()
    for f in d.iterdir():
        f.chmod(0o644)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def protected():
    """A root-only directory with a secret file, and a root-owned world-readable file."""
    d = Path(tempfile.mkdtemp(prefix="gh-root-only-", dir="/var/tmp"))
    d.chmod(0o700)
    (d / "secret").write_text("root's secret\n")
    (d / "secret").chmod(0o600)
    f = Path(tempfile.mkstemp(prefix="gh-root-file-", dir="/var/tmp")[1])
    f.write_text("root's config\n")
    f.chmod(0o644)
    yield d, f
    shutil.rmtree(d, ignore_errors=True)
    f.unlink(missing_ok=True)


def snapshot(*roots: Path) -> dict[str, tuple]:
    """Owner, mode and content hash of every path under roots (symlinks not followed)."""
    out = {}
    for root in roots:
        paths = [root] + (sorted(root.rglob("*")) if root.is_dir() and not root.is_symlink() else [])
        for p in paths:
            st = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else None
            out[str(p)] = (st.st_uid, st.st_gid, st.st_mode, digest)
    return out


def submit_as(user: str, script: str, *options: str) -> SlurmJob:
    d = Path(tempfile.mkdtemp(prefix="gh-attack-job-", dir="/tmp"))
    d.chmod(0o777)
    (d / "job.sh").write_text(script)
    (d / "job.sh").chmod(0o755)
    proc = subprocess.run(["runuser", "-u", user, "--", "sbatch", "--parsable", f"--output={d}/job.out",
                           f"--chdir={d}", *options, str(d / "job.sh")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return SlurmJob(proc.stdout.strip().split(";")[0], d / "job.out")


def run_attack(script: str, greyhound: str = "--greyhound") -> tuple[SlurmJob, str]:
    """Runs the attacker's job with greyhound on; the comment the epilog left on it."""
    job = submit_as(ATTACKER, "#!/bin/bash\nset -e\nR=$GREYHOUND_RUN_DIR\n" + script, greyhound)
    assert job.wait() == "COMPLETED", job.text()
    comment = comment_of(job.job_id)
    return job, comment


def test_a_symlinked_report_directory_is_not_chowned(users, trace_file, protected):
    root_dir, root_file = protected
    before = snapshot(root_dir, root_file)
    job, comment = run_attack(f"mkdir -p $R/timeline; cp {trace_file} $R/timeline/trace.h5\n"
                              f"ln -s {root_dir} $R/report\n")
    assert snapshot(root_dir, root_file) == before
    assert comment.startswith("greyhound: no post-mortem:") and "report directory" in comment, comment


def test_symlinks_inside_the_report_directory_are_not_followed(users, trace_file, protected):
    root_dir, root_file = protected
    before = snapshot(root_dir, root_file)
    links = "\n".join(f"ln -s {root_dir / 'secret'} $R/report/{name}" for name in REPORT_FILES[:3])
    links += "\n" + "\n".join(f"ln -s {root_file} $R/report/{name}" for name in REPORT_FILES[3:])
    job, comment = run_attack(f"mkdir -p $R/timeline $R/report; cp {trace_file} $R/timeline/trace.h5\n{links}\n")
    assert snapshot(root_dir, root_file) == before
    # The report is written all the same, as the user's own files in place of the links.
    assert comment.startswith("greyhound: S="), comment
    attacker = pwd.getpwnam(ATTACKER)
    report = RUN_DIR_BASE / job.job_id / "report"
    for name in REPORT_FILES:
        st = (report / name).lstat()
        assert not (report / name).is_symlink() and st.st_uid == attacker.pw_uid, name


def test_symlinks_at_the_temporary_names_are_not_followed(users, rank_files, protected):
    """The merge and the report once wrote .NAME.tmp<pid>: plant those for the pids to come."""
    root_dir, root_file = protected
    before = snapshot(root_dir, root_file)
    last_pid = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
    names = ["trace.h5", *REPORT_FILES]
    plant = (f"import os\nfor pid in range({last_pid}, {last_pid + 3000}):\n"
             f"    for name in {names!r}:\n"
             f"        for d in ('timeline', 'report'):\n"
             f"            os.symlink('{root_file}', os.path.join(os.environ['R'], d, f'.{{name}}.tmp{{pid}}'))\n")
    script = (f"mkdir -p $R/timeline $R/report; export R\n"
              f"{REPO / '.venv/bin/python'} -I -c \"$(cat <<'EOF'\n{plant}EOF\n)\"\n"
              f"cp {rank_files}/rank-*.jsonl $R/timeline/\n")
    job, comment = run_attack(script)
    assert snapshot(root_dir, root_file) == before
    assert comment.startswith("greyhound: S="), comment
    merged = RUN_DIR_BASE / job.job_id / "timeline/trace.h5"     # written by the epilog's merge
    assert not merged.is_symlink() and merged.lstat().st_uid == pwd.getpwnam(ATTACKER).pw_uid


def test_a_trace_symlinked_to_another_users_trace_is_not_read(users, trace_file, protected):
    _, victim = users
    victim_dir = Path(tempfile.mkdtemp(prefix="gh-victim-", dir="/var/tmp"))
    try:
        shutil.copy(trace_file, victim_dir / "trace.h5")
        for p in (victim_dir, victim_dir / "trace.h5"):
            os.chown(p, victim.pw_uid, victim.pw_gid)
        victim_dir.chmod(0o700)
        (victim_dir / "trace.h5").chmod(0o600)
        before = snapshot(victim_dir)
        job, comment = run_attack(f"mkdir -p $R/timeline; ln -s {victim_dir}/trace.h5 $R/timeline/trace.h5\n")
        assert snapshot(victim_dir) == before
        assert comment.startswith("greyhound: no post-mortem: cannot read"), comment
        assert "S=" not in comment
        run_dir = RUN_DIR_BASE / job.job_id
        assert not (run_dir / "report").exists()     # nothing of the victim's trace was analysed
    finally:
        shutil.rmtree(victim_dir, ignore_errors=True)


def test_report_option_pointing_at_a_root_directory_writes_nothing_there(users, trace_file, protected):
    root_dir, root_file = protected
    before = snapshot(root_dir, root_file)
    job, comment = run_attack(f"mkdir -p $R/timeline; cp {trace_file} $R/timeline/trace.h5\n",
                              f"--greyhound=report={root_dir}")
    assert snapshot(root_dir, root_file) == before
    assert not (root_dir / f"greyhound-{job.job_id}").exists()
    assert comment.startswith(f"greyhound: no post-mortem: cannot create the report directory {root_dir}"), comment


def test_the_attackers_own_report_is_private_to_them(users, trace_file):
    attacker = pwd.getpwnam(ATTACKER)
    job, comment = run_attack(f"mkdir -p $R/timeline; cp {trace_file} $R/timeline/trace.h5\n")
    assert comment.startswith("greyhound: S=") and "dp1/pp0" in comment, comment
    report = RUN_DIR_BASE / job.job_id / "report"
    st = report.lstat()
    assert (st.st_uid, st.st_mode & 0o777) == (attacker.pw_uid, 0o700)
    for f in report.iterdir():
        fst = f.lstat()
        assert (fst.st_uid, fst.st_mode & 0o077) == (attacker.pw_uid, 0), f


def test_a_planted_requeue_event_moves_nothing_but_the_attackers_own_ended_job(users):
    """The epilog completes S4 from the run's event log, which the user writes: an event
    naming every node, for a job that was never requeued, must change no job, no node
    and no other user's pending job."""
    from conftest import EPILOG_LOG

    victim_job = submit_as(VICTIM, "#!/bin/bash\nsleep 300\n", "--hold")
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True,
                           check=True).stdout.split()
    before = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True).stdout
    event = json.dumps({"time": 1, "kind": "requeued", "nodes": nodes, "step": 1, "why": "planted"})
    try:
        job, comment = run_attack(f"echo '{event}' > $R/events.jsonl\n")
        assert "S4 requeued it without" in comment, comment          # the note says what the log claims
        lines = [ln for ln in EPILOG_LOG.read_text(errors="replace").splitlines()
                 if f"job {job.job_id}: greyhound: S4:" in ln]
        assert lines and "failed" in lines[-1], lines                 # Slurm refused: the job had ended
        shown = subprocess.run(["scontrol", "show", "job", "-o", job.job_id], capture_output=True, text=True).stdout
        assert "ExcNodeList=(null)" in shown or not shown.strip(), shown
        victim = subprocess.run(["scontrol", "show", "job", "-o", victim_job.job_id], capture_output=True,
                                text=True, check=True).stdout
        assert "ExcNodeList=(null)" in victim and "Reason=JobHeldUser" in victim, victim
        after = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True).stdout
        assert after == before
    finally:
        subprocess.run(["scancel", victim_job.job_id], check=False)


# --- the epilog's bounds: a refused, stopped or starved analysis still leaves a line ----


@pytest.fixture(scope="module")
def finished_job(users, trace_file):
    """An ended greyhound job of the attacker's, with a trace, whose epilog has run."""
    job, comment = run_attack(f"mkdir -p $R/timeline; cp {trace_file} $R/timeline/trace.h5\n")
    assert comment.startswith("greyhound: S="), comment
    return job.job_id


def _hold(lock_dir: Path, *names: str) -> list[int]:
    import fcntl

    fds = []
    for name in names:
        fd = os.open(lock_dir / name, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fds.append(fd)
    return fds


def _epilog(job_id: str, **settings) -> str:
    from conftest import sacct_field
    from postmortem.epilog import EpilogConfig, run

    summary = run(job_id, config=EpilogConfig(**settings), env={})
    comment = sacct_field(job_id, "Comment")
    assert comment == summary, (comment, summary)   # the record says what the epilog said
    return summary


@pytest.fixture
def lock_dir(tmp_path):
    d = tmp_path / "locks"
    d.mkdir(mode=0o700)
    return d


def test_a_full_queue_is_refused_at_once_with_a_line_on_the_record(finished_job, lock_dir):
    held = _hold(lock_dir, "slot.0", "queue.0")
    try:
        summary = _epilog(finished_job, slots=1, queue=1, lock_dir=lock_dir)
    finally:
        for fd in held:
            os.close(fd)
    assert summary.startswith("greyhound: no post-mortem: the controller is busy (1 post-mortems running, 1 waiting)")


def test_a_job_that_waits_too_long_for_a_slot_is_refused(finished_job, lock_dir):
    held = _hold(lock_dir, "slot.0")
    try:
        summary = _epilog(finished_job, slots=1, queue=4, queue_wait_s=1, lock_dir=lock_dir)
    finally:
        for fd in held:
            os.close(fd)
    assert summary.startswith("greyhound: no post-mortem: no post-mortem slot came free within 1s (1 running)")


def test_a_slot_comes_free_when_the_analysis_ends(finished_job, lock_dir):
    first = _epilog(finished_job, slots=1, queue=1, queue_wait_s=0, lock_dir=lock_dir)
    second = _epilog(finished_job, slots=1, queue=1, queue_wait_s=0, lock_dir=lock_dir)
    assert first == second and first.startswith("greyhound: S=")


def test_an_analysis_over_its_time_limit_is_stopped_with_a_line(finished_job, lock_dir):
    summary = _epilog(finished_job, timeout_s=0.2, lock_dir=lock_dir)
    assert summary.startswith("greyhound: no post-mortem: the analysis took longer than 0.2s")
    for fd in _hold(lock_dir, "slot.0", "slot.1"):     # its slot is free again (flock raises if not)
        os.close(fd)


def test_an_analysis_over_its_memory_limit_leaves_a_line(finished_job, lock_dir):
    summary = _epilog(finished_job, mem_kb=50_000, lock_dir=lock_dir)
    assert summary == "greyhound: no post-mortem: the analysis ran out of memory (GREYHOUND_EPILOG_MEM_KB)"


def test_the_owner_is_the_jobs_user_even_as_it_ends(users):
    """sacct reports uid 0 for a moment after a job ends; the epilog must never take that."""
    from greyhound.slurm_client import connect

    attacker, _ = users
    job = submit_as(ATTACKER, "#!/bin/bash\ntrue\n")
    client = connect()
    seen = set()
    while job.state() in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") or not seen:
        seen.add(client.owner_ids(job.job_id))
    assert job.wait() == "COMPLETED"
    seen.add(client.owner_ids(job.job_id))
    assert seen == {(attacker.pw_uid, attacker.pw_gid)}


# --- greyhound report: the report path on the record is the user's to set -----------------


def test_report_does_not_read_a_path_the_user_put_on_the_record(users, protected):
    root_dir, _ = protected
    (root_dir / "postmortem.json").write_text('{"slowdown": 1.0, "secret": "root only"}')
    fake = f"greyhound: S=9.99 (0% GPU-time lost); report {root_dir}/report.html"
    job = submit_as(ATTACKER, f"#!/bin/bash\nscontrol update job=$SLURM_JOB_ID comment='{fake}'\n")
    assert job.wait() == "COMPLETED"
    proc = subprocess.run([str(REPO / ".venv/bin/greyhound"), "report", "--json", job.job_id],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    import json

    shown = json.loads(proc.stdout)
    assert shown["summary"] == fake and shown["postmortem"] is None
    assert "is not where greyhound writes" in shown["postmortem_error"]
    assert "root only" not in proc.stdout


def test_report_json_must_be_the_job_users_regular_file(users, tmp_path):
    from greyhound.report_cli import _read_report_json

    attacker, _ = users
    report = tmp_path / "77" / "report"
    report.mkdir(parents=True)
    (report / "postmortem.json").write_text('{"from": "root"}')          # root's, not the user's
    with pytest.raises(ValueError, match="not a report file written for the job's user"):
        _read_report_json(report / "report.html", "77", attacker.pw_uid)
    os.chown(report / "postmortem.json", attacker.pw_uid, attacker.pw_gid)
    assert _read_report_json(report / "report.html", "77", attacker.pw_uid) == '{"from": "root"}'
    (report / "postmortem.json").unlink()
    (report / "postmortem.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(OSError):
        _read_report_json(report / "report.html", "77", attacker.pw_uid)
    os.mkfifo(report / "fifo")
    (report / "postmortem.json").unlink()
    (report / "fifo").rename(report / "postmortem.json")
    with pytest.raises(ValueError):                                      # a FIFO: refused, not waited on
        _read_report_json(report / "report.html", "77", attacker.pw_uid)
