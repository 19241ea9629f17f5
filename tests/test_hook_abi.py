"""The hook in a process whose MPI or NCCL is not the ABI it was built for.

The plugin preloads the hook into every enabled job, whatever MPI or NCCL it uses. The
hook is compiled against Open MPI's mpi.h and a known NCCL ABI; anywhere else every
call must go straight through to the library, the program must not notice, and one
line on stderr says why.
"""

from __future__ import annotations

import pytest

from hook_support import (asan_preload, base_env, hook_lib, hook_lib_asan, mpich_prog, nccl_prog,
                          run)
from test_hook_asan import SAN

# tests/mpich_standin/prog under the stand-in libmpi (MPICH's ABI, one process).
MPICH_OUTPUT = """\
init 0
size 0 1 rank 0 0
recv proc_null ignore 0 got -1
recv proc_null status 0 source -1 tag -1
send proc_null 0
send self 0
recv any_source 0 got 42 source 0 tag 9
allreduce 0 1 2 3
allreduce in_place 0 0.5 1.5
irecv 0 isend 0 waitall 0 got 0
bcast 0
dup 0 allreduce 0 free 0
barrier 0
finalize 0
"""


def hook_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("greyhound:")]


@pytest.fixture(scope="module")
def without_hook():
    proc = run([str(mpich_prog())], base_env(None))
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    assert proc.stdout == MPICH_OUTPUT
    return proc


def assert_passed_through(proc, without_hook, run_dir):
    # Before the ABI check: SIGSEGV (-11) at the first MPI_Recv(MPI_PROC_NULL, ...,
    # MPI_STATUS_IGNORE), read as Open MPI's MPI_ANY_SOURCE and a status to fill in.
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == without_hook.stdout
    lines = hook_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("greyhound: hook: ")
    assert "libmpi.so.12 is not Open MPI" in lines[0] and "ABI" in lines[0]
    assert "pass through" in lines[0]
    assert list(run_dir.iterdir()) == []          # nothing recorded, no ring


def test_mpich_abi_program_runs_unchanged_under_the_hook(tmp_path, without_hook):
    proc = run([str(mpich_prog())], base_env(tmp_path, hook_lib()))
    assert_passed_through(proc, without_hook, tmp_path)
    assert proc.stderr.count("\n") == 1


def test_mpich_abi_program_under_sanitizers(tmp_path, without_hook):
    if not asan_preload().startswith("/"):
        pytest.skip("gcc has no ASan runtime here")
    env = base_env(tmp_path, None, **SAN)
    env["LD_PRELOAD"] = f"{asan_preload()}:{hook_lib_asan()}"
    proc = run([str(mpich_prog())], env)
    assert_passed_through(proc, without_hook, tmp_path)
    for marker in ("AddressSanitizer", "runtime error"):
        assert marker not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("version,says", [
    ("30000", "NCCL 3.0.0"),                 # a major version the hook has not seen
    ("21705", "NCCL 2.17.5"),                # older than the vendored ABI (no ncclCommSplit)
    ("2708", "NCCL 2.7.8"),                  # the version code of NCCL before 2.9
    ("error", "does not say which NCCL"),    # ncclGetVersion fails
])
def test_unknown_nccl_version_passes_through_with_one_line(tmp_path, version, says):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = run([str(nccl_prog()), str(tmp_path / "id"), "3"],
               base_env(run_dir, hook_lib(), GREYHOUND_TRACE="on", NCCL_DOUBLE_VERSION=version))
    assert (proc.returncode, proc.stdout) == (0, "ok\n"), proc.stderr
    lines = hook_lines(proc.stderr)
    assert len(lines) == 1 and lines[0] == proc.stderr.rstrip("\n"), proc.stderr
    assert lines[0].startswith("greyhound: hook: ")
    assert says in lines[0] and "pass through" in lines[0] and "libnccl.so.2" in lines[0]
    assert list(run_dir.iterdir()) == []          # no ring, no device timing


@pytest.mark.parametrize("version", ["21800", "22105", "29999"])
def test_known_nccl_versions_are_recorded(tmp_path, version):
    from greyhound.ring import OP, RingReader, ring_paths

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = run([str(nccl_prog()), str(tmp_path / "id"), "1"],
               base_env(run_dir, hook_lib(), NCCL_DOUBLE_VERSION=version))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "ok\n", "")
    (path,) = ring_paths(run_dir)
    with RingReader(path) as ring:
        recs = ring.read().records
    assert (recs["op"] == OP["AllReduce"]).sum() == 2
