"""The SPANK plugin's pure C parts, built and run under ASan/UBSan: the option and
plugstack parsers (config.c), PYTHONPATH/LD_PRELOAD handling (pathlist.c), the run
directories (rundir.c) and the control plane's start (controlplane.c)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

from conftest import REPO

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (scripts/setup installs build-essential)")


def build_and_run(tmp_path, test: str, source: str | tuple[str, ...], *args: str) -> None:
    sources = (source,) if isinstance(source, str) else source
    binary = tmp_path / test
    subprocess.run(
        ["gcc", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-std=gnu11",
         "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
         f"-I{REPO}/spank/plugin", "-o", str(binary),
         str(REPO / f"tests/c/{test}.c"), *(str(REPO / f"spank/plugin/{s}") for s in sources)],
        check=True, capture_output=True, text=True,
    )
    proc = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert proc.stdout.strip().endswith(" 0 failed")


@needs_gcc
def test_plugin_config_parsers_under_sanitizers(tmp_path):
    build_and_run(tmp_path, "test_plugin_config", "config.c")


@needs_gcc
def test_plugin_path_lists_under_sanitizers(tmp_path):
    build_and_run(tmp_path, "test_plugin_pathlist", "pathlist.c")


@needs_gcc
def test_plugin_control_plane_start_under_sanitizers(tmp_path):
    # The launcher's command, environment, stdin, fds and signals; the task left as it was.
    build_and_run(tmp_path, "test_plugin_controlplane", ("controlplane.c", "pathlist.c"))


@needs_gcc
@pytest.mark.skipif(os.geteuid() != 0, reason="the run directories are made as root (chown, root-owned parents)")
def test_plugin_run_directories_under_sanitizers(tmp_path):
    # A root-owned 0700 directory in /tmp: pytest's tmp_path may sit below a parent
    # that rundir.c rightly refuses (not root-owned); the test wants safe parents.
    work = tempfile.mkdtemp(prefix="greyhound-rundir-", dir="/tmp")
    try:
        build_and_run(tmp_path, "test_plugin_rundir", "rundir.c", work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_plugin_exports_only_the_spank_symbols(tmp_path):
    subprocess.run(["make", "-s", "-C", str(REPO / "spank"), f"BUILD={tmp_path}", str(tmp_path / "greyhound_spank.so")],
                   check=True, capture_output=True)
    out = subprocess.run(["nm", "-D", "--defined-only", str(tmp_path / "greyhound_spank.so")],
                         capture_output=True, text=True, check=True).stdout
    exported = sorted(line.split()[-1] for line in out.splitlines())
    assert exported == sorted(["plugin_name", "plugin_type", "plugin_version", "spank_plugin_version",
                               "slurm_spank_init", "slurm_spank_init_post_opt", "slurm_spank_task_init",
                               "slurm_spank_job_epilog"])
