"""The SPANK plugin's parsers in C, built and run under ASan/UBSan."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from conftest import REPO


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (scripts/setup installs build-essential)")
def test_plugin_config_parsers_under_sanitizers(tmp_path):
    binary = tmp_path / "test_plugin_config"
    subprocess.run(
        ["gcc", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-std=gnu11",
         "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
         f"-I{REPO}/spank/plugin", "-o", str(binary),
         str(REPO / "tests/c/test_plugin_config.c"), str(REPO / "spank/plugin/config.c"), "-lslurm"],
        check=True, capture_output=True, text=True,
    )
    proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert proc.stdout.strip().endswith("0 failed")


def test_plugin_exports_only_the_spank_symbols(tmp_path):
    subprocess.run(["make", "-s", "-C", str(REPO / "spank"), f"BUILD={tmp_path}", str(tmp_path / "greyhound_spank.so")],
                   check=True, capture_output=True)
    out = subprocess.run(["nm", "-D", "--defined-only", str(tmp_path / "greyhound_spank.so")],
                         capture_output=True, text=True, check=True).stdout
    exported = sorted(line.split()[-1] for line in out.splitlines())
    assert exported == sorted(["plugin_name", "plugin_type", "plugin_version", "spank_plugin_version",
                               "slurm_spank_init", "slurm_spank_init_post_opt"])
