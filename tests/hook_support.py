"""Builds and runs things for the hook tests (tests/test_hook_*.py); not a test file.

Everything here runs the real hook: built with the project's Makefile, preloaded
into real MPI (Open MPI + mpi4py), torch (gloo) or the NCCL test double.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import require

ROOT = Path(__file__).resolve().parent.parent
SPANK = ROOT / "spank"
HOOK_DIR = SPANK / "hook"
NCCL_DOUBLE = ROOT / "tests" / "nccl_double"
MPICH_STANDIN = ROOT / "tests" / "mpich_standin"
PYTHON = sys.executable
ASAN_CFLAGS = "-O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer"


def _make(build: str, extra: list[str]) -> Path:
    target = f"{build}/libgreyhound_hook.so"
    proc = subprocess.run(["make", "-s", "-C", str(SPANK), f"BUILD={build}", *extra, target],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.fail(f"building the hook failed:\n{proc.stdout}\n{proc.stderr}")
    return SPANK / target


@functools.cache
def hook_lib() -> Path:
    """The hook as `make -C spank` builds it."""
    return _make("build", [])


@functools.cache
def hook_lib_asan() -> Path:
    """The hook as `make -C spank asan` builds it (ASan + UBSan)."""
    return _make("build/asan", [f"CFLAGS={ASAN_CFLAGS}",
                                "LDFLAGS=-fsanitize=address,undefined"])


@functools.cache
def build_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="greyhound-hook-tests-"))


def _cc(args: list[str]) -> None:
    proc = subprocess.run(["gcc", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.fail(f"gcc {' '.join(args)} failed:\n{proc.stderr}")


@functools.cache
def nccl_prog() -> Path:
    """tests/nccl_double/nccl_prog linked to the NCCL and CUDA-event doubles."""
    out = build_dir() / "nccl"
    out.mkdir(exist_ok=True)
    inc = f"-I{HOOK_DIR / 'nccl_abi'}"
    flags = ["-O1", "-g", "-Wall", "-Wextra", "-Werror"]
    _cc([*flags, "-shared", "-fpic", inc, "-Wl,-soname,libnccl.so.2", "-o",
         str(out / "libnccl.so.2"), str(NCCL_DOUBLE / "nccl_double.c")])
    _cc([*flags, "-shared", "-fpic", "-Wl,-soname,libcudart.so.12", "-o",
         str(out / "libcudart.so.12"), str(NCCL_DOUBLE / "cudart_double.c")])
    _cc([*flags, inc, "-o", str(out / "nccl_prog"), str(NCCL_DOUBLE / "nccl_prog.c"),
         "-Wl,--no-as-needed", str(out / "libnccl.so.2"), str(out / "libcudart.so.12"),
         f"-Wl,-rpath,{out}"])
    return out / "nccl_prog"


@functools.cache
def mpich_prog() -> Path:
    """tests/mpich_standin/prog linked to the stand-in libmpi with MPICH's ABI."""
    out = build_dir() / "mpich"
    out.mkdir(exist_ok=True)
    flags = ["-O1", "-g", "-Wall", "-Wextra", "-Werror"]
    _cc([*flags, "-shared", "-fpic", "-Wl,-soname,libmpi.so.12", "-o",
         str(out / "libmpi.so.12"), str(MPICH_STANDIN / "libmpi.c")])
    _cc([*flags, f"-I{MPICH_STANDIN}", "-o", str(out / "prog"), str(MPICH_STANDIN / "prog.c"),
         str(out / "libmpi.so.12"), f"-Wl,-rpath,{out}"])
    return out / "prog"


def asan_preload() -> str:
    """The ASan runtime, which must come first in LD_PRELOAD."""
    path = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True,
                          text=True, check=True).stdout.strip()
    return os.path.realpath(path)


def base_env(run_dir: Path | None, hook: Path | None = None, **extra: str) -> dict[str, str]:
    """A clean environment: no launcher rank variables, greyhound ones as given."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GREYHOUND_", "OMPI_", "PMI", "SLURM_"))
           and k not in ("RANK", "LD_PRELOAD", "PYTHONPATH")}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_btl="self,tcp", OMPI_MCA_rmaps_base_oversubscribe="1")
    if run_dir is not None:
        env["GREYHOUND_RUN_DIR"] = str(run_dir)
    if hook is not None:
        env["LD_PRELOAD"] = str(hook)
    env.update(extra)
    return env


def mpirun_cmd(np_: int, args: list[str], env: dict[str, str]) -> list[str]:
    """The mpirun command line for args on np_ ranks, forwarding the greyhound and
    preload variables."""
    require(None if shutil.which("mpirun") else "mpirun (Open MPI) is not installed: run scripts/setup")
    fwd = []
    for k in env:
        if k.startswith("GREYHOUND_") or k in ("LD_PRELOAD", "PYTHONPATH", "ASAN_OPTIONS",
                                                "UBSAN_OPTIONS"):
            fwd += ["-x", k]
    # `-x LD_PRELOAD` takes the value from mpirun's own environment, so mpirun runs
    # with the hook too; it never calls MPI_* itself (the tests see no extra ring).
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np_),
            "--mca", "btl", "self,tcp", *fwd, *args]


def mpirun(np_: int, args: list[str], env: dict[str, str], timeout: float = 60):
    """Runs args on np_ ranks, forwarding the greyhound and preload variables."""
    return subprocess.run(mpirun_cmd(np_, args, env), env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def run(args: list[str], env: dict[str, str], timeout: float = 60, **kw):
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False, **kw)


def ready_rings(run_dir: Path, count: int, timeout: float = 60.0) -> list[Path]:
    """The first count rings in run_dir once a reader can open each of them."""
    import time

    from greyhound.ring import RingError, RingReader, ring_paths

    end = time.monotonic() + timeout
    while True:
        paths = ring_paths(run_dir)[:count]
        if len(paths) == count:
            try:
                for path in paths:
                    RingReader(path, publish=False).close()
                return paths
            except RingError:
                pass
        if time.monotonic() > end:
            raise AssertionError(f"not {count} ready rings in {run_dir} after {timeout} s")
        time.sleep(0.005)


def ready_ring(run_dir: Path, timeout: float = 60.0) -> Path:
    """The first ring in run_dir once a reader can open it.

    The hook creates the file, then reserves and maps it, then writes the header;
    a reader polling the directory can see the file before it is a ring.
    """
    import time

    from greyhound.ring import RingError, RingReader, ring_paths

    end = time.monotonic() + timeout
    while True:
        paths = ring_paths(run_dir)
        if paths:
            try:
                RingReader(paths[0], publish=False).close()
                return paths[0]
            except RingError:
                pass
        if time.monotonic() > end:
            raise AssertionError(f"no ready ring in {run_dir} after {timeout} s")
        time.sleep(0.005)



def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a torch.distributed rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torch_pair(prog: str, out_dir: Path, env: dict) -> tuple[dict, list]:
    """Runs a 2-rank torch program (argv: rank, world size, port, out dir) to the end.

    Returns each rank's out.<rank>.json and the (stdout, stderr) of both processes.
    """
    import json

    port = str(free_port())
    procs = [subprocess.Popen([PYTHON, prog, str(r), "2", port, str(out_dir)],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    return {r: json.loads((out_dir / f"out.{r}.json").read_text()) for r in (0, 1)}, outs
