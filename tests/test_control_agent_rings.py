"""The node agent on real rings: which rings it opens, and when it looks again."""

from __future__ import annotations

import os
import shutil

import pytest
from hook_support import PYTHON, ROOT, base_env, hook_lib, run

from greyhound.control.agent import NodeAgent
from greyhound.ring import OP_NAMES

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


# A pipeline stage's step on a real ring: a small plan broadcast on the world, its
# point-to-point calls there (2 a step, then 4: a new micro-batch split), and the
# gradient all-reduce on its data-parallel communicator.
STAGE_STEPS = """
import sys, time
import numpy as np
from mpi4py import MPI
world = MPI.COMM_WORLD
dp = world.Dup()
plan, grads, out, msg, got = np.zeros(2), np.ones(16384), np.empty(16384), np.ones(64), np.empty(64)
for step in range(int(sys.argv[1])):
    world.Bcast(plan, root=0)
    for _ in range(2 if step < 30 else 4):
        recv = world.Irecv(got, source=0)
        world.Send(msg, dest=0)
        recv.Wait()
    time.sleep(0.004)
    dp.Allreduce(grads, out)
"""


def _stage(run_dir, steps: int):
    """STAGE_STEPS run for ``steps`` steps on a real ring, polled once by an agent:
    the agent and the rank's process."""
    proc = run([PYTHON, "-c", STAGE_STEPS, str(steps)], base_env(run_dir, hook_lib(), PMI_RANK="0",
                                                                  SLURMD_NODENAME="n7"))
    assert proc.returncode == 0, proc.stderr
    agent = NodeAgent(run_dir, "n7")
    agent.discover()
    agent.poll()
    (rank,) = agent.processes.values()
    return agent, rank


def test_a_rank_is_cut_at_its_gradient_sync_and_counts_steps_by_it(tmp_path):
    agent, rank = _stage(tmp_path, 60)
    clock = agent.clock(rank)
    assert clock is not None, "the tracker did not lock on the steps"
    rows = rank.tracker.arrivals(clock.iteration, clock.iteration)
    cut = rows[rows["position"] == clock.cut_position]
    # Cut right after the gradient all-reduce (the biggest collective), wherever the
    # tracker's iteration begins within the step; its count is the steps done.
    assert OP_NAMES[int(cut["op"][0])] == "AllReduce"
    assert clock.cut_step == int(cut["comm_ordinal"][0])
    assert clock.cut_call == int(cut["call_number"][0])
    assert clock.started_s == pytest.approx(rank.reader.info.unix_seconds(int(cut["t_end_ns"][0])))
    assert 55 <= clock.cut_step <= 59
    # A step now: the broadcast, 4 sends with their receives, the all-reduce.
    assert clock.step_calls == 1 + 4 * 2 + 1
    agent.close()


def test_a_rank_whose_tracker_has_no_lock_is_cut_by_its_last_calls(tmp_path):
    # 46 steps: 30 of 6 calls (too few to lock), then 16 of 10. A tracker re-locking
    # after a split change is in the same state; the pause is placed by step count.
    agent, rank = _stage(tmp_path, 46)
    assert not rank.tracker.locked
    clock = agent.clock(rank)
    assert clock is not None
    assert (clock.iteration, clock.cut_step, clock.step_calls) == (-1, 45, 10)
    assert clock.cut_call == 30 * 6 + 16 * 10          # the last all-reduce
    (cut,) = rank.tracker.arrivals(last_calls=1)
    assert OP_NAMES[int(cut["op"])] == "AllReduce" and int(cut["call_number"]) == clock.cut_call
    assert 0.004 <= clock.iteration_s < 0.1
    agent.close()


def test_polls_in_between_join_the_next_regular_polls_window_entry(tmp_path):
    # A rank stepping every 5 ms for a few seconds; the agent polls once every 0.4 s and
    # three times in between. Each entry of the rank's window spans a regular poll's
    # whole interval and its iterations, whatever the agent read in between.
    import subprocess
    import time

    from hook_support import ready_ring

    proc = subprocess.Popen([PYTHON, "-c", STAGE_STEPS, "1200"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=base_env(tmp_path, hook_lib(), PMI_RANK="0", SLURMD_NODENAME="n7"))
    try:
        ready_ring(tmp_path)
        agent = NodeAgent(tmp_path, "n7")
        deadline = time.monotonic() + 30
        while not (agent.processes and next(iter(agent.processes.values())).tracker.locked):
            assert time.monotonic() < deadline, "the tracker did not lock on the steps"
            agent.poll()
            time.sleep(0.1)
        (rank,) = agent.processes.values()
        agent.poll()
        entries, regular = [], [time.monotonic()]
        for _ in range(3):
            last = rank.polls._recent[-1]
            for _ in range(3):
                time.sleep(0.1)
                agent.poll(between=True)
                assert rank.polls._recent[-1] is last       # nothing appended in between
            time.sleep(0.1)
            agent.poll()
            regular.append(time.monotonic())
            entries.append(rank.polls._recent[-1])
        assert proc.poll() is None, "the rank ended before the last poll"
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == 0, proc.stderr.read()
    for (wall_ns, blocked_ns, iterations, _), start, end in zip(entries, regular, regular[1:]):
        assert wall_ns / 1e9 == pytest.approx(end - start, abs=0.02)
        assert 0 < blocked_ns < wall_ns
        # Steps of at least 4 ms (the sleep) and, loaded, up to 20: the whole interval's
        # tens of iterations, not the few of the last 0.1 s.
        assert wall_ns / 20e6 <= iterations <= wall_ns / 4e6, (iterations, wall_ns)
    agent.close()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed: run scripts/setup")
def test_a_quiet_plane_gets_news_at_once_and_the_rest_every_few_seconds(tmp_path):
    import time

    from greyhound.control import store
    from greyhound.control.agent import AgentConfig
    from greyhound.control.redis_server import start_redis, stop_redis

    proc, address = start_redis(tmp_path, host="127.0.0.1")
    try:
        client = address.client()
        # A run whose rank has no news of its own. STAGE_STEPS's 4 ms steps, which
        # change shape at step 30, ended with the detector weighing a candidate change
        # (news at every publish) here in 1 run in 6 beside 4 busy loops, and in all
        # three runs of a CI rehearsal: steady steps of 30 ms, where a millisecond of
        # jitter is no change, and up to three runs, each in a run dir of its own.
        steady = STAGE_STEPS.replace("2 if step < 30 else 4", "2").replace("time.sleep(0.004)", "time.sleep(0.03)")
        for attempt in range(3):
            run_dir = tmp_path / f"run{attempt}"
            run_dir.mkdir()
            run([PYTHON, "-c", steady, "60"], base_env(run_dir, hook_lib(), PMI_RANK="0", SLURMD_NODENAME="n7"))
            agent = NodeAgent(run_dir, "n7", config=AgentConfig(quiet_publish_s=2.0))
            agent.poll()
            agent.publish(client)
            if not agent._news():
                break
            (kept,) = agent.processes.values()      # not `proc`: that is the Redis server stopped below
            had = {"pending_change": kept.tracker.pending_change, "changepoints": len(kept.tracker.changepoints),
                   "slow_since": (kept.summary_cache or (0, {}))[1].get("slow_since")}
            agent.close()
        else:
            raise AssertionError(f"each of 3 runs left its rank with news; the last: {had}")
        (rank,) = agent.processes.values()

        def sent() -> bool:
            """Whether the last publish sent the figures (the agent's heartbeat moved)."""
            before = client.hget(store.agent_key("n7"), "heartbeat")
            agent.publish(client)
            return client.hget(store.agent_key("n7"), "heartbeat") != before

        assert sent() and not agent.quiet                   # the master has not said quiet
        client.hset(store.PLANE, store.QUIET, 1)
        assert sent() and agent.quiet                       # read with the figures
        assert not sent() and not sent()                    # nothing new: only the flag is read
        news = int(client.get(store.NEWS) or 0)
        rank.republish = True                               # news (a re-numbering)
        assert sent() and not rank.republish
        assert int(client.get(store.NEWS)) == news + 1      # posted for the master
        assert not sent()
        time.sleep(2.0)
        assert sent()                                       # everything every quiet_publish_s,
        assert int(client.get(store.NEWS)) == news + 1      # which is no news
        client.hset(store.PLANE, store.QUIET, 0)            # the master opened an episode
        assert sent() and not agent.quiet                   # the same poll
        assert sent()
    finally:
        stop_redis(proc)
