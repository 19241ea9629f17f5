"""The hook never changes a program's results, whatever is wrong around it."""

from __future__ import annotations

import subprocess

import pytest

from hook_support import PYTHON, ROOT, base_env, hook_lib, nccl_prog, run

LOOP = str(ROOT / "tests" / "hook_progs" / "mpi_loop.py")


def loop(env, n=50):
    return run([PYTHON, LOOP, str(n)], env)


def assert_intact_once(proc, message: str, n=50):
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{n}\n"
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("greyhound:")]
    assert len(lines) == 1, proc.stderr       # once, not once per call
    assert lines[0].startswith("greyhound: hook: ")
    assert message in lines[0]


def test_missing_run_dir(tmp_path):
    proc = loop(base_env(tmp_path / "absent", hook_lib()))
    assert_intact_once(proc, "cannot create a ring")


def test_run_dir_is_not_a_directory(tmp_path):
    (tmp_path / "file").write_text("")
    proc = loop(base_env(tmp_path / "file", hook_lib()))
    assert_intact_once(proc, "cannot create a ring")


def test_unwritable_run_dir(tmp_path):
    # root ignores mode bits, so "unwritable" is a directory nobody can create in.
    proc = loop(base_env("/proc/self", hook_lib()))
    assert_intact_once(proc, "cannot create a ring")


def test_no_run_dir_variable():
    proc = loop(base_env(None, hook_lib()))
    assert_intact_once(proc, "GREYHOUND_RUN_DIR is not set")


@pytest.mark.parametrize("var,value", [
    ("GREYHOUND_TRACE", "maybe"),
    ("GREYHOUND_PAUSE_TIMEOUT_S", "-1"),
    ("GREYHOUND_PAUSE_TIMEOUT_S", "soon"),
    ("GREYHOUND_RING_RECORDS", "1000"),
    ("GREYHOUND_CLOCK", "fast"),
])
def test_bad_environment_turns_the_hook_off(tmp_path, var, value):
    proc = loop(base_env(tmp_path, hook_lib(), **{var: value}))
    assert_intact_once(proc, var)
    assert list(tmp_path.iterdir()) == []


def test_bad_rank_variable_falls_back_to_the_next(tmp_path):
    proc = loop(base_env(tmp_path, hook_lib(), RANK="x", PMI_RANK="5"))
    assert_intact_once(proc, 'RANK="x"')
    assert [p.name for p in tmp_path.iterdir()] == ["ring.5"]


def test_file_size_limit(tmp_path):
    # Growing the ring past RLIMIT_FSIZE would raise SIGXFSZ: the hook checks first.
    # (Open MPI itself fails under such a limit, so the NCCL double's program runs.)
    prog = nccl_prog()
    (tmp_path / "run").mkdir()
    proc = subprocess.run(["bash", "-c", f"ulimit -f 64; exec {prog} {tmp_path / 'id'} 3"],
                          env=base_env(tmp_path / "run", hook_lib()), capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ok\n"
    assert proc.stderr.count("greyhound: hook: ") == 1
    assert "cannot reserve" in proc.stderr
    assert list((tmp_path / "run").iterdir()) == []


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "full"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                      capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root) to fill a disk")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_full_disk(tiny_tmpfs):
    proc = loop(base_env(tiny_tmpfs, hook_lib()))
    assert_intact_once(proc, "cannot reserve")
    assert list(tiny_tmpfs.iterdir()) == []   # the half-made ring is removed
