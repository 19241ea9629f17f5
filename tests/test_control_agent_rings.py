"""The node agent on real rings: which rings it opens, and when it looks again."""

from __future__ import annotations

import os

from hook_support import PYTHON, ROOT, base_env, hook_lib, run

from greyhound.control.agent import NodeAgent

LOOP = str(ROOT / "tests" / "hook_progs" / "mpi_loop.py")


def _rank(run_dir, rank: int, node: str = "n7"):
    proc = run([PYTHON, LOOP, "20"], base_env(run_dir, hook_lib(), PMI_RANK=str(rank), SLURMD_NODENAME=node))
    assert proc.returncode == 0, proc.stderr


def _ranks(agent: NodeAgent) -> list[int]:
    return sorted(p.reader.info.rank for p in agent.processes.values())


def test_rings_that_appear_at_once_or_later_are_all_opened_and_other_nodes_left(tmp_path):
    agent = NodeAgent(tmp_path, "n7")
    agent.discover()
    assert agent.processes == {}
    _rank(tmp_path, 3)
    agent.discover()
    assert _ranks(agent) == [3]
    # Created right after the listing, maybe in the same tick of the kernel's coarse
    # clock (the run dir's mtime unchanged): opened at the next poll all the same.
    _rank(tmp_path, 5)
    _rank(tmp_path, 6, node="n8")
    agent.discover()
    assert _ranks(agent) == [3, 5]
    # Once the run dir has been still for a second, a new ring still changes its mtime.
    st = os.stat(tmp_path)
    os.utime(tmp_path, ns=(st.st_atime_ns, st.st_mtime_ns - 5_000_000_000))
    agent.discover()
    agent.discover()                                   # listed, and trusted
    _rank(tmp_path, 4)
    agent.discover()
    assert _ranks(agent) == [3, 4, 5]
    agent.close()
