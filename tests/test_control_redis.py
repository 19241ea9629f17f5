"""The job's Redis: one address, a password nobody else can read, nothing on disk."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess

import pytest

from greyhound.control.redis_server import (
    ADDRESS_FILE, SECRET_FILE, RedisError, read_address, start_redis, stop_redis,
)

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed: run scripts/setup")


@pytest.fixture
def job_redis(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    proc, address = start_redis(run_dir, host="127.0.0.1")
    yield run_dir, proc, address
    stop_redis(proc)


def test_answers_with_the_password_only(job_redis):
    import redis

    run_dir, proc, address = job_redis
    client = address.client()
    assert client.set("state", "tracking") and client.get("state") == "tracking"
    anonymous = redis.Redis(host=address.host, port=address.port, socket_timeout=2)
    with pytest.raises(redis.AuthenticationError):
        anonymous.get("state")
    wrong = redis.Redis(host=address.host, port=address.port, password="guess", socket_timeout=2)
    with pytest.raises(redis.AuthenticationError):
        wrong.get("state")


def test_the_password_is_in_a_private_file_and_on_no_command_line(job_redis):
    run_dir, proc, address = job_redis
    for name in (SECRET_FILE, "redis.conf", ADDRESS_FILE):
        assert os.stat(run_dir / name).st_mode & 0o077 == 0, name
    with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
        cmdline = f.read()
    assert address.password.encode() not in cmdline
    assert read_address(run_dir) == address


def test_config_and_persistence_commands_are_refused(job_redis):
    import redis

    run_dir, _, address = job_redis
    client = address.client()
    for command in (("CONFIG", "GET", "requirepass"), ("CONFIG", "SET", "dir", "/etc"), ("SAVE",),
                    ("BGSAVE",), ("DEBUG", "SLEEP", "0"), ("MODULE", "LIST")):
        with pytest.raises(redis.ResponseError, match="unknown command"):
            client.execute_command(*command)
    client.set("k", "v")
    stop_redis(job_redis[1])
    assert not [p for p in os.listdir(run_dir) if p.endswith((".rdb", ".aof")) or p.startswith("appendonly")]


def test_listens_on_the_given_address_only(job_redis):
    _, proc, address = job_redis
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    mine = [line.split()[3] for line in out.splitlines() if f"pid={proc.pid}," in line]
    assert mine == [f"127.0.0.1:{address.port}"]


def test_another_user_cannot_read_the_secret(job_redis):
    run_dir, _, _ = job_redis
    nobody = pwd.getpwnam("nobody")
    proc = subprocess.run(["runuser", "-u", "nobody", "--", "cat", str(run_dir / SECRET_FILE)],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and proc.stdout == ""
    assert nobody.pw_uid != os.getuid()


def test_a_run_dir_without_a_control_plane_is_a_clear_error(tmp_path):
    with pytest.raises(RedisError, match="has no control plane"):
        read_address(tmp_path)


def test_the_server_goes_with_a_master_killed_without_clean_up(tmp_path):
    # The master (here a child Python) starts the job's Redis and is then SIGKILLed:
    # nothing stops Redis but the parent-death signal it was started with.
    import sys
    import time

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    master = ("import os, signal, sys\n"
              "from greyhound.control.redis_server import start_redis\n"
              "proc, _ = start_redis(sys.argv[1], host='127.0.0.1')\n"
              "print(proc.pid, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    out = subprocess.run([sys.executable, "-c", master, str(run_dir)], capture_output=True, text=True, timeout=60)
    assert out.returncode == -9, out.stderr
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}"), "redis-server outlived its killed master"


def test_a_client_tries_a_gone_server_twice_at_most_and_fails():
    """The control plane and the training side poll: a call to a Redis that is gone
    must fail after one retry (redis-py's default retries ten times with backoff,
    3.4 s, which outlived Slurm's KillWait at the job's end)."""
    import socket
    import threading

    import redis

    from greyhound.control.redis_server import RedisAddress

    accepted = []
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        server.settimeout(0.5)

        def hang_up() -> None:          # a server going away: it accepts, then closes
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                accepted.append(conn)
                conn.close()

        thread = threading.Thread(target=hang_up, daemon=True)
        thread.start()
        client = RedisAddress(host="127.0.0.1", port=server.getsockname()[1], password="p").client()
        with pytest.raises(redis.ConnectionError):
            client.get("plane")
        thread.join()
    assert len(accepted) == 2


def test_a_rank_publishes_only_what_changed_and_the_store_holds_it_all(job_redis):
    from greyhound.control import store

    _, _, address = job_redis
    client = address.client()
    sent: dict = {}
    commands = []
    for fields in ({"node": "n1", "iterations": 10, "slowdown": None, "counters": {"calls": 5}},
                   {"node": "n1", "iterations": 11, "slowdown": None, "counters": {"calls": 5}},
                   {"node": "n1", "iterations": 11, "slowdown": None, "counters": {"calls": 5}}):
        pipe = client.pipeline(transaction=False)
        store.publish_rank(pipe, 3, new_times=[], fields=fields, sent=sent)
        commands.append([args for args, _ in pipe.command_stack])
        pipe.execute()
    assert commands[0] == [("HSET", "rank:3", "node", "n1", "iterations", 10, "slowdown", "",
                            "counters", '{"calls": 5}')]
    assert commands[1] == [("HSET", "rank:3", "iterations", 11)]     # only the field that changed
    assert commands[2] == []                                          # nothing changed: no command
    assert client.hgetall("rank:3") == {"node": "n1", "iterations": "11", "slowdown": "",
                                        "counters": '{"calls": 5}'}


def test_the_job_is_read_whole_in_two_round_trips_and_past_one_scan_too(job_redis, monkeypatch):
    from greyhound.control import store

    _, _, address = job_redis
    client = address.client()
    for rank in range(7):
        pipe = client.pipeline(transaction=False)
        store.publish_rank(pipe, rank, new_times=[0.1 * rank], fields={"node": f"n{rank // 2}", "iterations": rank},
                           sent={})
        pipe.hset(store.agent_key(f"n{rank // 2}"), mapping={"heartbeat": 1.5})
        pipe.execute()
    client.set(store.PLAN, store.dumps({"level": "S2"}))
    client.rpush(store.VERDICTS, store.dumps({"kind": "compute"}))

    sent_commands = []
    execute = client.execute_command
    monkeypatch.setattr(client, "execute_command", lambda *a, **k: sent_commands.append(a[0]) or execute(*a, **k))
    job = store.read_job(client)
    assert sorted(job["ranks"]) == list(range(7))
    assert job["ranks"][6] == {"node": "n3", "iterations": 6}
    assert sorted(job["agents"]) == ["n0", "n1", "n2", "n3"] and job["agents"]["n0"] == {"heartbeat": 1.5}
    assert job["plan"] == {"level": "S2"} and job["verdicts"] == [{"kind": "compute"}]
    assert job["suspects"] == [] and job["applied"] is None and job["pauses"] == {}
    assert sent_commands == []      # pipelines only: no command sent on its own

    # Keys that take several SCAN calls (a job past a thousand ranks) are all found.
    monkeypatch.setattr(store, "SCAN_COUNT", 2)
    assert store.read_job(client) == job
