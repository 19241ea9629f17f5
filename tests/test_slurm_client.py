"""The Slurm client: pure helpers, and job comments on the real cluster's accounting."""

from __future__ import annotations

import subprocess

import pytest

from greyhound.errors import InputError
from greyhound.slurm_client import COMMENT_MAX_LEN, check_job_id, choose_backend, connect, merge_comment


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


def test_backend_choice_says_why():
    backend, reason = choose_backend()
    assert backend in ("command-line", "pyslurm")
    assert reason
    print(f"slurm client backend: {backend} ({reason})")


@pytest.mark.cluster
def test_finished_jobs_comment_keeps_its_case(cluster, sbatch):
    job = sbatch("#!/bin/bash\ntrue\n", "--comment=User Note A")
    assert job.wait() == "COMPLETED"
    client = connect()
    record = client.job(job.job_id)
    assert record.state == "COMPLETED" and not record.running
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
