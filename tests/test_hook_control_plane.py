"""The control plane's own processes (GREYHOUND_CONTROL_PLANE=1, set by the SPANK
plugin for the plane's step) are never recorded, even with the hook preloaded."""

from __future__ import annotations

from hook_support import PYTHON, ROOT, base_env, hook_lib, run

LOOP = str(ROOT / "tests" / "hook_progs" / "mpi_loop.py")


def test_the_control_planes_calls_pass_through_without_a_ring(tmp_path):
    proc = run([PYTHON, LOOP, "50"], base_env(tmp_path, hook_lib(), GREYHOUND_CONTROL_PLANE="1"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "50\n"
    assert "greyhound:" not in proc.stderr   # not an error: nothing to say
    assert list(tmp_path.iterdir()) == []


def test_only_the_value_1_marks_the_control_plane(tmp_path):
    proc = run([PYTHON, LOOP, "50"], base_env(tmp_path, hook_lib(), GREYHOUND_CONTROL_PLANE="0", PMI_RANK="5"))
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["ring.5"]
