"""The hook in a process whose MPI or NCCL is not the ABI it was built for.

The plugin preloads the hook into every enabled job, whatever MPI or NCCL it uses. The
hook is compiled against Open MPI's mpi.h and a known NCCL ABI; anywhere else every
call must go straight through to the library, the program must not notice, and one
line on stderr says why.
"""

from __future__ import annotations

import pytest

from hook_support import asan_preload, base_env, hook_lib, hook_lib_asan, mpich_prog, run
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
