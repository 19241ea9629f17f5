"""The Slurm client: pure helpers, and job comments on the real cluster's accounting."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import types

import pytest

from conftest import require
from greyhound import slurm_client
from greyhound.errors import InputError, SlurmError
from greyhound.slurm_client import (COMMENT_MAX_LEN, CommandLineClient, JobRecord, PySlurmClient, check_job_id,
                                    choose_backend, connect, merge_comment, running_slurm_version)


def test_check_job_id_accepts_jobs_and_array_tasks():
    assert check_job_id(" 1234 ") == "1234"
    assert check_job_id(77) == "77"
    assert check_job_id("12_3") == "12_3"


@pytest.mark.parametrize("bad", ["", "abc", "12;rm", "1 2", "-5", "12_"])
def test_check_job_id_rejects_with_a_clear_message(bad):
    with pytest.raises(InputError, match="is not a job id; use a number"):
        check_job_id(bad)


def test_merge_comment_keeps_the_users_comment_and_replaces_an_old_summary():
    assert merge_comment("", "greyhound: S=1.2") == "greyhound: S=1.2"
    assert merge_comment("My Run A", "greyhound: S=1.2") == "My Run A | greyhound: S=1.2"
    once = merge_comment("My Run A", "greyhound: S=1.2")
    assert merge_comment(once, "greyhound: S=1.5") == "My Run A | greyhound: S=1.5"


def test_merge_comment_fits_slurms_limit_and_never_cuts_the_user():
    user = "U" * 1000
    merged = merge_comment(user, "greyhound: " + "x" * 500)
    assert len(merged) == COMMENT_MAX_LEN
    assert merged.startswith(user + " | greyhound: ")
    assert merge_comment("V" * 1023, "greyhound: S=1") == "V" * 1023
    with pytest.raises(InputError, match="one line"):
        merge_comment("", "greyhound: a\nb")


def test_this_machine_uses_the_command_line_backend(monkeypatch):
    """Debian 12's Slurm is 22.05 (scripts/setup) and PyPI has no pyslurm for it, so the
    client must run Slurm's commands, and say exactly why."""
    monkeypatch.delenv("GREYHOUND_SLURM_BACKEND", raising=False)
    require(None if shutil.which("sinfo") else "Slurm is not installed: run scripts/setup")
    assert re.fullmatch(r"22\.05\.\d+", running_slurm_version() or "")
    assert importlib.util.find_spec("pyslurm") is None
    assert choose_backend() == ("command-line", "pyslurm is not installed (PyPI has none for Slurm 22.05)")
    assert type(connect()) is CommandLineClient


def test_backend_override_and_pyslurm_version_match(monkeypatch):
    monkeypatch.setenv("GREYHOUND_SLURM_BACKEND", "command-line")
    assert choose_backend() == ("command-line", "GREYHOUND_SLURM_BACKEND=command-line")
    monkeypatch.delenv("GREYHOUND_SLURM_BACKEND")
    fake = types.ModuleType("pyslurm")
    fake.__version__ = "22.5.1"
    monkeypatch.setitem(sys.modules, "pyslurm", fake)
    monkeypatch.setattr(slurm_client, "running_slurm_version", lambda: "22.05.8")
    assert choose_backend() == ("command-line", "pyslurm 22.5.1 does not match Slurm 22.05.8")
    fake.__version__ = "22.05.0"
    assert choose_backend() == ("pyslurm", "pyslurm 22.05.0 matches Slurm 22.05.8")
    client = connect()
    assert type(client) is PySlurmClient and client.backend == "pyslurm"
    monkeypatch.setattr(slurm_client, "running_slurm_version", lambda: None)
    assert choose_backend() == ("command-line", "pyslurm 22.05.0 does not match Slurm ?")


def test_a_command_that_cannot_run_is_one_slurm_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert running_slurm_version() is None
    with pytest.raises(SlurmError, match=r"^hostnames: scontrol not found; is Slurm installed and on PATH\?$"):
        CommandLineClient().hostnames("n[1-2]")


@pytest.mark.cluster
def test_finished_jobs_comment_keeps_its_case(cluster, sbatch):
    job = sbatch("#!/bin/bash\ntrue\n", "--comment=User Note A")
    assert job.wait() == "COMPLETED"
    client = connect()
    record = client.job(job.job_id)
    assert record.state == "COMPLETED" and not record.running and not record.in_queue
    summary = "greyhound: S=1.34 (25% GPU-time lost) top: compute DP1/PP2 on n3; report /Var/Reports/X"
    client.set_comment(job.job_id, merge_comment(record.comment, summary))
    out = subprocess.run(["sacct", "-j", job.job_id, "-X", "-n", "-o", "Comment%300"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == f"User Note A | {summary}"
    assert client.job(job.job_id).comment == out
    print(f"slurm client backend: {client.backend}")


@pytest.mark.cluster
def test_running_jobs_comment_keeps_its_case(cluster, sbatch):
    job = sbatch("#!/bin/bash\nsleep 30\n")
    client = connect()
    for _ in range(60):
        if job.state() == "RUNNING":
            break
        subprocess.run(["sleep", "0.5"], check=True)
    client.set_comment(job.job_id, "greyhound: Running MixedCase")
    subprocess.run(["scancel", job.job_id], check=True)
    assert job.wait() == "CANCELLED"
    # The controller sends the comment to accounting with the job's end record.
    for _ in range(20):
        if client.job(job.job_id).comment:
            break
        subprocess.run(["sleep", "0.5"], check=True)
    assert client.job(job.job_id).comment == "greyhound: Running MixedCase"


@pytest.mark.parametrize("state, running, in_queue", [
    ("PENDING", True, True), ("RUNNING", True, True), ("COMPLETING", False, True),
    ("COMPLETED", False, False), ("FAILED", False, False), ("CANCELLED", False, False),
])
def test_a_completing_job_is_still_in_the_queue_but_not_running(state, running, in_queue):
    record = JobRecord(job_id="7", name="j", user="u", state=state, exit_code="0:0", cluster="c",
                       node_list="n1", num_nodes=1, submit="", start="", end="", elapsed_s=0,
                       work_dir="/", comment="")
    assert (record.running, record.in_queue) == (running, in_queue)


def test_sigterm_is_held_from_the_commands_started_meanwhile_and_delivered_after():
    # requeue_excluding runs its scontrol commands so: requeuehold signals the caller's
    # own step (greyhound's master runs in one), and the commands after it died of it.
    got: list[str] = []
    previous = signal.signal(signal.SIGTERM, lambda *_: got.append("TERM"))
    try:
        with slurm_client._sigterm_held():
            child = subprocess.Popen(["sleep", "0.3"])
            child.send_signal(signal.SIGTERM)
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
            assert child.wait(timeout=10) == 0       # it ran to its end
            assert got == []
        assert got == ["TERM"]                       # ours, once the block was over
        child = subprocess.Popen(["sleep", "5"])     # and nothing stays blocked after it
        os.kill(child.pid, signal.SIGTERM)
        assert child.wait(timeout=10) == -signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
