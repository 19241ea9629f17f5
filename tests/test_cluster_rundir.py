"""The run directories on the real local cluster: made safely as root, fresh for a
reused job id, rings gone at job end, removed after retain= days, refused under an
unsafe rundir=."""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import stat
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from conftest import CLUSTER_STATE

pytestmark = pytest.mark.cluster

PLUGSTACK_ENTRY = Path("/etc/slurm/plugstack.conf.d/greyhound.conf")
CLUSTER_LOGS = CLUSTER_STATE / "log"
NOBODY = pwd.getpwnam("nobody")
# What a job's control plane writes into its run directory (greyhound/control/).
CONTROL_PLANE_FILES = ("control-plane.log", "events.jsonl", "redis.")
# Far above any id Slurm hands out (MaxJobId is below 0x04000000): never a real job's.
FAKE_JOB_ID_BASE = 4_100_000_000

# The batch step says where its run directory is, who owns it and what is in it.
SHOW_RUN_DIR = """#!/bin/bash
echo "run_dir=$GREYHOUND_RUN_DIR"
echo "owner=$(stat -c %u:%g:%a "$GREYHOUND_RUN_DIR")"
echo "entries=$(ls -A "$GREYHOUND_RUN_DIR" | tr '\\n' ' ')"
"""


def plugstack_args() -> dict[str, str]:
    for line in PLUGSTACK_ENTRY.read_text().splitlines():
        words = shlex.split(line, comments=True)
        if len(words) >= 2 and words[0] in ("optional", "required") and words[1].endswith("greyhound_spank.so"):
            return dict(w.split("=", 1) for w in words[2:] if "=" in w)
    raise AssertionError(f"no greyhound line in {PLUGSTACK_ENTRY}")


@pytest.fixture(scope="module")
def rundir(cluster) -> Path:
    return Path(plugstack_args().get("rundir", "/var/tmp/greyhound"))


def fields(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


JOB_EPILOG_HINT = ("greyhound's SPANK job epilog did not clean up: slurmd runs it only when it was started "
                   "with this plugin installed (restart slurmd after `make -C spank install`)")


def wait_until(predicate, timeout_s: float = 60, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; {JOB_EPILOG_HINT}")
        time.sleep(0.5)


def next_job_id() -> int:
    """A lower bound of the next job ids: submit a held job and cancel it."""
    proc = subprocess.run(["sbatch", "--parsable", "--hold", "--output=/dev/null", "--wrap=true"],
                          capture_output=True, text=True, timeout=60, check=True)
    job_id = int(proc.stdout.strip().split(";")[0])
    subprocess.run(["scancel", str(job_id)], check=True, timeout=60)
    return job_id + 1


def slurmd_log_lines(needle: str) -> list[str]:
    lines = []
    for log in sorted(CLUSTER_LOGS.glob("slurmd-n*.log")):
        lines += [line for line in log.read_text(errors="replace").splitlines() if needle in line]
    return lines


@pytest.fixture
def root_secret(tmp_path) -> Path:
    """A root-owned file and directory that a user's planted symlinks point at."""
    secret_dir = tmp_path / "secret"
    secret_dir.mkdir(mode=0o700)
    (secret_dir / "file").write_text("root's\n")
    (secret_dir / "file").chmod(0o600)
    return secret_dir


def plant_symlinks(run_dir: Path, secret: Path) -> None:
    """What a user can leave in their own run directory for root to trip over."""
    (run_dir / "ring.0").symlink_to(secret / "file")
    (run_dir / "link-to-dir").symlink_to(secret)
    deep = run_dir / "deep"
    deep.mkdir()
    for _ in range(60):
        deep = deep / "d"
        deep.mkdir()
    for path in [run_dir, *run_dir.rglob("*")]:
        os.lchown(path, NOBODY.pw_uid, NOBODY.pw_gid)


def secret_intact(secret: Path) -> bool:
    return (secret / "file").read_text() == "root's\n" and sorted(p.name for p in secret.iterdir()) == ["file"]


def test_reused_job_id_gets_a_fresh_run_dir(rundir, sbatch):
    # Job ids wrap, and a fresh controller starts them again: another user's old run
    # directory (with their trace) must not be handed to the next job with that id.
    # The next ids cannot be known exactly (other jobs run): plant one for each.
    tag = uuid.uuid4().hex
    first = next_job_id()
    planted = []
    for job_id in range(first, first + 100):
        d = rundir / str(job_id)
        if d.exists() or (rundir / f"{job_id}.end").exists():
            continue
        d.mkdir(mode=0o700)
        (d / "trace.h5").write_text("the old owner's trace\n")
        (d / "ring.0").write_text("the old owner's ring\n")
        (d / "planted").write_text(tag)
        for path in (d, *d.iterdir()):
            os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
        planted.append(d)
    try:
        job = sbatch(SHOW_RUN_DIR, "--greyhound")
        assert job.wait() == "COMPLETED", job.text()
        assert int(job.job_id) < first + 100, "more than 100 jobs were submitted meanwhile"
        got = fields(job.text())
        assert got["run_dir"] == str(rundir / job.job_id)
        assert got["owner"] == f"{os.getuid()}:{os.getgid()}:700"
        assert got["entries"].split() == ["options"], got
    finally:
        for d in planted:  # those no greyhound job took over
            try:
                ours = (d / "planted").read_text() == tag and d.stat().st_uid == NOBODY.pw_uid
            except OSError:
                ours = False
            if ours:
                subprocess.run(["rm", "-rf", "--one-file-system", str(d)], check=True)
                (rundir / f"{d.name}.end").unlink(missing_ok=True)


def test_rings_go_at_job_end_the_timeline_stays(rundir, sbatch, root_secret):
    script = SHOW_RUN_DIR + f"""
cd "$GREYHOUND_RUN_DIR"
head -c 4096 /dev/zero > ring.0.1234
head -c 4096 /dev/zero > ring.1.1235
ln -s {root_secret}/file ring.planted
mkdir -p timeline && echo '{{}}' > timeline/rank-0.jsonl
srun --ntasks=2 --nodes=2 true
"""
    # trace=off: the post-mortem leaves this fake timeline alone.
    job = sbatch(script, "--nodes=2", "--ntasks=2", "--greyhound=trace=off")
    assert job.wait() == "COMPLETED", job.text()
    run_dir = rundir / job.job_id
    wait_until(lambda: not any(run_dir.glob("ring.*")), 60, f"the rings in {run_dir} to go (job epilog)")
    # What stays: the options, the timeline and the control plane's files (its log,
    # events, Redis files; none where the plugstack has no python=).
    left = sorted(p.name for p in run_dir.iterdir() if not p.name.startswith(CONTROL_PLANE_FILES))
    assert left == ["options", "timeline"]
    assert (run_dir / "timeline/rank-0.jsonl").read_text() == "{}\n"
    assert (rundir / f"{job.job_id}.end").is_file()
    assert secret_intact(root_secret)


def test_expired_run_dir_is_removed_without_following_symlinks(rundir, sbatch, root_secret):
    retain_days = int(plugstack_args().get("retain", "7"))
    expired_id = FAKE_JOB_ID_BASE + int(uuid.uuid4().hex[:6], 16)
    recent_id = expired_id + 1
    now = time.time()
    for job_id, ended_days_ago in ((expired_id, retain_days + 1), (recent_id, max(retain_days - 1, 0) + 0.5)):
        d = rundir / str(job_id)
        d.mkdir(mode=0o700)
        (d / "timeline").mkdir()
        (d / "timeline/rank-0.jsonl").write_text("{}\n")
        plant_symlinks(d, root_secret)
        mark = rundir / f"{job_id}.end"
        mark.touch()
        os.utime(mark, (now - ended_days_ago * 86400,) * 2)
    try:
        # Any job's end on a node sweeps that node's rundir (greyhound's or not).
        job = sbatch("#!/bin/bash\ntrue\n")
        assert job.wait() == "COMPLETED", job.text()
        wait_until(lambda: not (rundir / str(expired_id)).exists(), 60, "the expired run directory to go")
        assert not (rundir / f"{expired_id}.end").exists()
        assert secret_intact(root_secret)
        if retain_days >= 1:
            assert (rundir / str(recent_id) / "timeline/rank-0.jsonl").is_file()
    finally:
        for job_id in (expired_id, recent_id):
            subprocess.run(["rm", "-rf", "--one-file-system", str(rundir / str(job_id))], check=True)
            (rundir / f"{job_id}.end").unlink(missing_ok=True)


@pytest.fixture
def rundir_arg(cluster):
    """Points greyhound's plugstack line at another rundir=; restores it afterwards."""
    saved = PLUGSTACK_ENTRY.read_text()

    def set_rundir(path: Path) -> None:
        lines = []
        for line in saved.splitlines():
            if line.startswith("optional") or line.startswith("required"):
                line = " ".join(w for w in line.split() if not w.startswith("rundir=")) + f" rundir={path}"
            lines.append(line)
        PLUGSTACK_ENTRY.write_text("\n".join(lines) + "\n")

    try:
        yield set_rundir
    finally:
        PLUGSTACK_ENTRY.write_text(saved)


def make_symlinked(base: Path) -> tuple[Path, str]:
    (base / "real").mkdir(mode=0o755)
    (base / "link").symlink_to(base / "real")
    return base / "link" / "greyhound", f"{base}/link is a symlink"


def make_user_owned(base: Path) -> tuple[Path, str]:
    (base / "users").mkdir(mode=0o755)
    os.chown(base / "users", NOBODY.pw_uid, NOBODY.pw_gid)
    return base / "users" / "greyhound", f"{base}/users is not owned by root"


def make_world_writable(base: Path) -> tuple[Path, str]:
    (base / "open").mkdir()
    (base / "open").chmod(0o777)
    return base / "open" / "greyhound", f"{base}/open is writable by group or others without the sticky bit"


def make_sticky_rundir(base: Path) -> tuple[Path, str]:
    (base / "shm").mkdir()
    (base / "shm").chmod(0o1777)
    return base / "shm", f"{base}/shm is writable by group or others (mode 1777"


@pytest.mark.parametrize("make_unsafe", [make_symlinked, make_user_owned, make_world_writable, make_sticky_rundir],
                         ids=["symlink", "user-owned-parent", "world-writable-parent", "sticky-rundir"])
def test_unsafe_rundir_is_refused_and_the_job_runs_without_greyhound(rundir_arg, sbatch, tmp_path, make_unsafe):
    base = tmp_path / "admin"
    base.mkdir(mode=0o755)
    unsafe, why = make_unsafe(base)
    rundir_arg(unsafe)
    job = sbatch(SHOW_RUN_DIR, "--greyhound")
    assert job.wait() == "COMPLETED", job.text()
    assert fields(job.text())["run_dir"] == ""  # greyhound is off: no run directory at all
    assert not (unsafe.resolve() / job.job_id).exists()
    lines = slurmd_log_lines(f"greyhound is off for job {job.job_id}")
    assert lines, f"no greyhound line for job {job.job_id} in {CLUSTER_LOGS}/slurmd-n*.log"
    assert all(f"greyhound: remote: unsafe or unusable rundir={unsafe}: {why}" in line for line in lines), lines
    assert all("allowed: a real directory owned by root, not writable by group or others" in line for line in lines)


def test_missing_rundir_is_made_root_owned_with_its_parents(rundir_arg, sbatch, tmp_path):
    base = tmp_path / "admin"
    base.mkdir(mode=0o755)
    rundir_arg(base / "a" / "b" / "greyhound")
    job = sbatch(SHOW_RUN_DIR, "--greyhound")
    assert job.wait() == "COMPLETED", job.text()
    assert fields(job.text())["run_dir"] == str(base / "a/b/greyhound" / job.job_id)
    for d in (base / "a", base / "a/b", base / "a/b/greyhound"):
        st = d.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o755), d


def test_plain_users_job_cannot_redirect_roots_cleanup(rundir, root_secret, tmp_path):
    # The job's user owns the run directory: what they plant there is removed as links
    # at job end (rings) and never followed.
    out_dir = Path(tempfile.mkdtemp(prefix="greyhound-nobody-", dir="/tmp"))
    out_dir.chmod(0o1777)
    script = SHOW_RUN_DIR + f"""
cd "$GREYHOUND_RUN_DIR"
ln -s {root_secret}/file ring.0.1
ln -s {root_secret} ring.dir
ln -s /etc ring.etc
"""
    try:
        proc = subprocess.run(
            ["runuser", "-u", "nobody", "--", "sbatch", "--parsable", "--wait", "--greyhound=trace=off",
             f"--output={out_dir}/job.out", f"--chdir={out_dir}"],
            input=script, capture_output=True, text=True, timeout=180,
        )
        assert proc.returncode == 0, proc.stderr
        job_id = proc.stdout.strip().split(";")[0]
        got = fields((out_dir / "job.out").read_text())
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    assert got["owner"] == f"{NOBODY.pw_uid}:{NOBODY.pw_gid}:700"
    run_dir = rundir / job_id
    wait_until(lambda: not any(run_dir.glob("ring.*")), 60, "the rings to go")
    assert secret_intact(root_secret)
    assert Path("/etc/passwd").is_file()
