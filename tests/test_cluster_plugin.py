"""The SPANK plugin on the real local cluster: sbatch --greyhound, as users run it."""

from __future__ import annotations

import os
import stat
import subprocess
import uuid
from pathlib import Path

import pytest

from conftest import PREFIX, REPO, SlurmJob

pytestmark = pytest.mark.cluster

HOOK = PREFIX / "lib/greyhound/libgreyhound_hook.so"

# Every task prints what greyhound set up for it, one '|'-separated line.
REPORT_ENV = (
    'echo "$0|${SLURM_PROCID-}|${SLURMD_NODENAME-}|${GREYHOUND_MODE-}|${LD_PRELOAD-}|'
    '${GREYHOUND_RUN_DIR-}|${GREYHOUND_JOB_ID-}|${GREYHOUND_TRACE-}"'
)
JOB_SCRIPT = f"""#!/bin/bash
/bin/bash -c '{REPORT_ENV}' batch
srun /bin/bash -c '{REPORT_ENV}' step0
srun --overlap --ntasks=4 --ntasks-per-node=1 /bin/bash -c '{REPORT_ENV}' step1
"""
# step1 overlaps: it needs the CPUs step0 had, and Slurm 22.05 left a step that asked for
# them before slurmctld had freed them pending until the job was cancelled (a CI
# rehearsal: job 359, greyhound off, step0 done, step1 pending for 2 minutes). The tests
# here are about what each step's tasks get, not about step scheduling.


def task_lines(text: str) -> list[dict[str, str]]:
    keys = ("step", "rank", "node", "mode", "ld_preload", "run_dir", "job_id", "trace")
    return [dict(zip(keys, line.split("|"))) for line in text.splitlines() if line.count("|") == 7]


@pytest.fixture(scope="module")
def user_preload(tmp_path_factory):
    """A user's own LD_PRELOAD library, built here, that greyhound must keep."""
    d = tmp_path_factory.mktemp("userlib")
    os.chmod(d, 0o755)
    src = d / "user.c"
    src.write_text("int greyhound_test_user_preload;\n")
    lib = d / "libuser.so"
    subprocess.run(["gcc", "-shared", "-fpic", "-o", str(lib), str(src)], check=True)
    return str(lib)


def test_sbatch_help_lists_the_option(cluster):
    out = subprocess.run(["sbatch", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--greyhound=options" in out
    assert "[greyhound]" in out


BAD_OPTIONS = [
    ("mode=fast", "mode='fast' is not allowed; use mode=detect or mode=mitigate"),
    ("bogus=1", "unknown key 'bogus'; allowed keys: mode, trace, report, requeue"),
    ("trace=maybe", "trace='maybe' is not allowed; use trace=on or trace=off"),
    ("report=relative/dir", "report='relative/dir' must be an absolute directory path"),
    ("off,mode=detect", "'off' cannot be combined with other settings"),
    ("fastest", "'fastest' is not an option; use off, on, detect, mitigate"),
    ("mode=detect,,trace=on", "empty item in 'mode=detect,,trace=on'"),
    ("mode=detect,mode=mitigate", "mode given twice ('detect' and 'mitigate')"),
    ("mode=detect\x07", "control character 0x07 at position 12"),
    ("report=/" + "x" * 1100, "characters long; at most 1024 are allowed"),
    # A second, different value for the same setting is refused, never silently kept.
    ("on,off", "'on' and 'off' both given; give one of them"),
    ("report=/a,report=/b", "report given twice, with different directories; give it once"),
    ("trace=on,trace=off", "trace given twice ('on' and 'off'); give it once"),
    ("requeue=maybe", "requeue='maybe' is not allowed; use requeue=on or requeue=off"),
    ("requeue=on,requeue=off", "requeue given twice ('on' and 'off'); give it once"),
]


@pytest.mark.parametrize(("value", "message"), BAD_OPTIONS, ids=[v[:20] for v, _ in BAD_OPTIONS])
def test_bad_option_is_refused_without_a_job(cluster, tmp_path, value, message):
    name = f"gh-bad-{uuid.uuid4().hex[:8]}"
    proc = subprocess.run(
        ["sbatch", f"--job-name={name}", f"--greyhound={value}", f"--output={tmp_path}/o", "--wrap=true"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("greyhound: ")]
    assert len(ours) == 1, proc.stderr
    assert message in ours[0]
    assert "Submitted" not in proc.stdout
    squeue = subprocess.run(["squeue", "-h", "-n", name], capture_output=True, text=True, check=True).stdout
    sacct = subprocess.run(["sacct", "-n", "-X", "--name", name, "-S", "now-1hours"],
                           capture_output=True, text=True, check=True).stdout
    assert squeue.strip() == "" and sacct.strip() == ""


def test_conflicting_flags_are_refused_and_repeated_ones_accepted(cluster, sbatch, tmp_path):
    # Two flags: Slurm calls the option callback once per flag.
    proc = subprocess.run(["sbatch", "--greyhound=mode=detect", "--greyhound=mode=mitigate", "--wrap=true",
                           f"--output={tmp_path}/o"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "Submitted" not in proc.stdout
    assert [line for line in proc.stderr.splitlines() if line.startswith("greyhound: ")] == [
        "greyhound: --greyhound: mode given twice ('detect' and 'mitigate'); give it once"]
    # The same value again, in one flag or two, is one setting.
    os.chmod(tmp_path, 0o755)
    job = sbatch(JOB_SCRIPT, "--nodes=2", "--ntasks=4", "--ntasks-per-node=2",
                 f"--greyhound=on,on,mitigate,mode=mitigate,trace=on,trace=yes,report={tmp_path},report={tmp_path}",
                 "--greyhound=mitigate")
    assert job.wait() == "COMPLETED", job.text()
    check_enabled(task_lines(job.text()), mode="mitigate", job_id=job.job_id)


# PYTHONPATH and LD_PRELOAD as every task sees them, one '|'-separated line each.
SEARCH_PATHS = 'printf "paths|%s|%s|%s\\n" "$0" "${PYTHONPATH-<unset>}" "${LD_PRELOAD-<unset>}"'
SEARCH_PATHS_JOB = f"""#!/bin/bash
/bin/bash -c '{SEARCH_PATHS}' batch
srun --ntasks=2 --ntasks-per-node=1 /bin/bash -c '{SEARCH_PATHS}' step
"""
CAPTURE = str(PREFIX / "lib/greyhound/python")


@pytest.mark.parametrize(("pythonpath", "expected"), [
    # Spaces, an empty item ('::', the current directory) and a leading ':' are kept.
    (":/tmp/a dir with spaces::/opt/b", CAPTURE + "::/tmp/a dir with spaces::/opt/b"),
    ("/trailing:", CAPTURE + ":/trailing:"),
    # Unset: ours alone. Set but empty adds nothing for python, so ours alone as well
    # ("ours:" would add the current directory).
    (None, CAPTURE),
    ("", CAPTURE),
    # Only an identical copy of our entry is dropped.
    (CAPTURE + ":/x", CAPTURE + ":/x"),
], ids=["spaces-empty-leading", "trailing", "unset", "empty", "our-copy"])
def test_search_paths_keep_the_users_value_exactly(cluster, sbatch, user_preload, pythonpath, expected):
    assert (PREFIX / "lib/greyhound/python").is_dir(), "make -C spank install puts the capture there"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    # LD_PRELOAD separates with ':' or ' ': the user's blanks stay as they were.
    env["LD_PRELOAD"] = f"{user_preload}  {user_preload}"
    job = sbatch(SEARCH_PATHS_JOB, "--nodes=2", "--ntasks=2", "--greyhound", env=env)
    assert job.wait() == "COMPLETED", job.text()
    lines = [line.split("|") for line in job.text().splitlines() if line.startswith("paths|")]
    assert sorted(f[1] for f in lines) == ["batch", "step", "step"], job.text()
    for _, where, got_pythonpath, got_preload in lines:
        assert got_pythonpath == expected, (where, got_pythonpath)
        assert got_preload == f"{HOOK}:{user_preload}  {user_preload}", (where, got_preload)


def check_enabled(lines, *, mode, job_id, user_preload=None):
    assert lines, "the job printed nothing"
    for t in lines:
        assert t["mode"] == mode, t
        assert t["job_id"] == job_id, t
        assert t["trace"] == "on", t
        assert t["ld_preload"].split(":")[0] == str(HOOK), t
        if user_preload:
            assert t["ld_preload"].split(":")[1:] == [user_preload], t
        assert t["run_dir"].endswith(f"/{job_id}"), t


def test_detect_job_sets_up_every_task_on_every_node(cluster, sbatch, user_preload):
    assert HOOK.exists(), f"{HOOK} is missing: scripts/cluster up installs it (make -C spank install)"
    env = dict(os.environ, LD_PRELOAD=user_preload)
    job = sbatch(JOB_SCRIPT, "--nodes=4", "--ntasks=8", "--ntasks-per-node=2",
                 "--greyhound=mode=detect", env=env)
    assert job.wait() == "COMPLETED", job.text()
    lines = task_lines(job.text())
    check_enabled(lines, mode="detect", job_id=job.job_id, user_preload=user_preload)
    steps = {t["step"] for t in lines}
    assert steps == {"batch", "step0", "step1"}
    assert sorted(int(t["rank"]) for t in lines if t["step"] == "step0") == list(range(8))
    assert {t["node"] for t in lines if t["step"] == "step0"} == {"n1", "n2", "n3", "n4"}
    assert {t["node"] for t in lines if t["step"] == "step1"} == {"n1", "n2", "n3", "n4"}
    run_dir = lines[0]["run_dir"]
    st = os.stat(run_dir)
    assert stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.getuid()


def test_bare_option_and_export_none(cluster, sbatch):
    # A bare --greyhound reaches the nodes as "(null)"; --export=NONE hides the option
    # from the batch step's environment. Both must still mean "on, defaults".
    job = sbatch(JOB_SCRIPT, "--nodes=4", "--ntasks=8", "--ntasks-per-node=2",
                 "--export=NONE", "--greyhound")
    assert job.wait() == "COMPLETED", job.text()
    lines = task_lines(job.text())
    check_enabled(lines, mode="detect", job_id=job.job_id)
    assert {t["step"] for t in lines} == {"batch", "step0", "step1"}


def test_job_without_the_option_is_untouched(cluster, sbatch, user_preload):
    env = dict(os.environ, LD_PRELOAD=user_preload)
    job = sbatch(JOB_SCRIPT, "--nodes=4", "--ntasks=8", "--ntasks-per-node=2", env=env)
    assert job.wait() == "COMPLETED", job.text()
    lines = task_lines(job.text())
    assert len(lines) == 1 + 8 + 4
    for t in lines:
        assert t["mode"] == t["run_dir"] == t["job_id"] == t["trace"] == "", t
        assert t["ld_preload"] == user_preload, t


@pytest.fixture
def default_on(cluster):
    subprocess.run([str(REPO / "scripts/cluster"), "default", "on"], check=True, capture_output=True)
    try:
        yield
    finally:
        subprocess.run([str(REPO / "scripts/cluster"), "default", "off"], check=True, capture_output=True)


def test_plugstack_default_on_enables_every_job_unless_off(default_on, sbatch):
    on = sbatch(JOB_SCRIPT, "--nodes=2", "--ntasks=4", "--ntasks-per-node=2")
    off = sbatch(JOB_SCRIPT, "--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--greyhound=off")
    mitigate = sbatch(JOB_SCRIPT, "--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--greyhound=mitigate")
    env_off = sbatch(JOB_SCRIPT, "--nodes=2", "--ntasks=4", "--ntasks-per-node=2",
                     env=dict(os.environ, GREYHOUND_OPTIONS="off"))
    for job in (on, off, mitigate, env_off):
        assert job.wait() == "COMPLETED", job.text()
    check_enabled(task_lines(on.text()), mode="detect", job_id=on.job_id)
    check_enabled(task_lines(mitigate.text()), mode="mitigate", job_id=mitigate.job_id)
    for job in (off, env_off):
        off_lines = task_lines(job.text())
        assert off_lines and all(t["mode"] == "" and t["ld_preload"] == "" for t in off_lines)


def test_greyhound_options_variable_is_the_flags_fallback(cluster, sbatch, tmp_path):
    # Precedence (STYLE): plugstack defaults < GREYHOUND_OPTIONS < --greyhound=.
    env = dict(os.environ, GREYHOUND_OPTIONS="mode=mitigate,trace=on")
    by_env = sbatch(JOB_SCRIPT, "--nodes=2", "--ntasks=4", "--ntasks-per-node=2", env=env)
    flag_wins = sbatch(JOB_SCRIPT, "--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--greyhound=detect", env=env)
    for job in (by_env, flag_wins):
        assert job.wait() == "COMPLETED", job.text()
    check_enabled(task_lines(by_env.text()), mode="mitigate", job_id=by_env.job_id)
    check_enabled(task_lines(flag_wins.text()), mode="detect", job_id=flag_wins.job_id)
    # A bad value cannot refuse the job (an optional plugin's init_post_opt cannot):
    # one line says so and the job runs as if greyhound were not there.
    os.chmod(tmp_path, 0o755)
    (tmp_path / "bad.sh").write_text(JOB_SCRIPT)
    proc = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/bad.out", "--nodes=2", "--ntasks=4",
                           "--ntasks-per-node=2", str(tmp_path / "bad.sh")],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env=dict(os.environ, GREYHOUND_OPTIONS="mode=fast"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        "greyhound: GREYHOUND_OPTIONS: mode='fast' is not allowed; use mode=detect or mode=mitigate; "
        "greyhound is off for this job"]
    bad = SlurmJob(proc.stdout.strip().split(";")[0], tmp_path / "bad.out")
    assert bad.wait() == "COMPLETED", bad.text()
    lines = task_lines(bad.text())
    assert {t["step"] for t in lines} == {"batch", "step0", "step1"}
    assert all(t["mode"] == "" and t["ld_preload"] == "" for t in lines)


def test_srun_and_salloc_take_the_option_too(cluster):
    srun = subprocess.run(
        ["srun", "--nodes=2", "--ntasks-per-node=1", "--greyhound=mitigate", "/bin/bash", "-c", REPORT_ENV, "srun"],
        capture_output=True, text=True, timeout=120,
    )
    assert srun.returncode == 0, srun.stderr
    lines = task_lines(srun.stdout)
    # Two tasks on two nodes, wherever Slurm put them: a job of an earlier test may
    # still hold n1 and n2 as it completes (a CI rehearsal got n3 and n4).
    assert len(lines) == 2 and len({t["node"] for t in lines}) == 2
    assert all(t["mode"] == "mitigate" and t["ld_preload"].split(":")[0] == str(HOOK) for t in lines)
    salloc = subprocess.run(
        ["salloc", "--nodes=1", "--greyhound=detect", "srun", "/bin/bash", "-c", REPORT_ENV, "salloc"],
        capture_output=True, text=True, timeout=120,
    )
    assert salloc.returncode == 0, salloc.stderr
    assert [t["mode"] for t in task_lines(salloc.stdout)] == ["detect"]
    bad = subprocess.run(["srun", "--greyhound=fast", "true"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0
    assert [line for line in bad.stderr.splitlines() if line.startswith("greyhound: ")] == [
        "greyhound: --greyhound: 'fast' is not an option; use off, on, detect, mitigate or key=value "
        "with keys mode, trace, report, requeue"]


@pytest.fixture
def plugstack_line(cluster):
    """Lets a test rewrite greyhound's plugstack line; restores it afterwards."""
    entry = Path("/etc/slurm/plugstack.conf.d/greyhound.conf")
    saved = entry.read_text()

    def rewrite(transform):
        entry.write_text("\n".join(transform(line) if line.startswith("optional") else line
                                   for line in saved.splitlines()) + "\n")

    try:
        yield rewrite
    finally:
        entry.write_text(saved)


def test_broken_admin_config_leaves_jobs_running_without_greyhound(plugstack_line, sbatch):
    plugstack_line(lambda line: line + " colour=blue")
    job = sbatch(JOB_SCRIPT, "--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--greyhound")
    assert job.wait() == "COMPLETED", job.text()
    lines = task_lines(job.text())
    assert {t["step"] for t in lines} == {"batch", "step0", "step1"}
    assert all(t["mode"] == "" and t["ld_preload"] == "" for t in lines), lines


def test_unusable_run_dir_leaves_jobs_running_without_greyhound(plugstack_line, sbatch, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    plugstack_line(lambda line: " ".join(w if not w.startswith("rundir=") else f"rundir={not_a_dir}"
                                         for w in line.split()))
    job = sbatch(JOB_SCRIPT, "--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--greyhound")
    assert job.wait() == "COMPLETED", job.text()
    lines = task_lines(job.text())
    assert {t["step"] for t in lines} == {"batch", "step0", "step1"}
    assert all(t["mode"] == "" and t["run_dir"] == "" for t in lines), lines


def test_a_plain_users_job_gets_its_own_private_run_dir(cluster):
    # The run dir is made as root (init_post_opt), then handed to the job's user.
    import pwd
    import shutil
    import tempfile

    user = pwd.getpwnam("nobody")
    out_dir = Path(tempfile.mkdtemp(prefix="greyhound-nobody-", dir="/tmp"))
    try:
        out_dir.chmod(0o1777)
        proc = subprocess.run(
            ["runuser", "-u", "nobody", "--", "sbatch", "--parsable", "--wait", "--nodes=2", "--ntasks=4",
             "--ntasks-per-node=2", "--greyhound", f"--output={out_dir}/job.out", f"--chdir={out_dir}"],
            input=JOB_SCRIPT, capture_output=True, text=True, timeout=180,
        )
        assert proc.returncode == 0, proc.stderr
        job_id = proc.stdout.strip().split(";")[0]
        lines = task_lines((out_dir / "job.out").read_text())
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    check_enabled(lines, mode="detect", job_id=job_id)
    st = os.stat(lines[0]["run_dir"])
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (user.pw_uid, user.pw_gid, 0o700)
