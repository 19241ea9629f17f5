"""The job's own Redis: started by the master, for this job only, gone with the job.

Security, because the job's Redis holds what the job is doing and (next) what it
will do: it listens on one address (the master node's, never all interfaces), asks for
a random password that lives only in a 0600 file of the job's 0700 run directory and
in the server's 0600 config file beside it (never on a command line, which any user
can read in /proc), keeps nothing on disk (no RDB, no AOF), and refuses CONFIG and
DEBUG, so not even a client with the password can make it write files elsewhere.
Another user on the node can neither read the secret nor, without it, run a command.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

from greyhound.atomic_file import write_atomic
from greyhound.errors import GreyhoundError

log = logging.getLogger(__name__)

SECRET_FILE = "redis.secret"
CONF_FILE = "redis.conf"
ADDRESS_FILE = "redis.address"
"""``HOST:PORT`` of the job's Redis, for ``greyhound status`` on the master node."""
LOG_FILE = "redis.log"


class RedisError(GreyhoundError):
    """The job's Redis could not be started or reached."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RedisAddress:
    host: str
    port: int
    password: str

    def client(self, *, timeout_s: float = 2.0):
        """A redis-py client with timeouts on every call and one retry, at once (the
        control plane fails open). redis-py 6+ retries a failed call ten times with
        backoff, 3.4 s for a refused connection: at the job's end, when Redis goes
        first, that outlived Slurm's KillWait before the master could mark the plane
        stopped, and a training step reading the plan board of a dead master stalled as
        long. The one retry is for a round trip that timed out on a congested link."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        return redis.Redis(host=self.host, port=self.port, password=self.password,
                           socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                           retry=Retry(NoBackoff(), 1), decode_responses=True)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _config_text(*, host: str, port: int, password: str, run_dir: Path) -> str:
    return "\n".join([
        f"bind {host}",
        f"port {port}",
        "protected-mode yes",
        f"requirepass {password}",
        'save ""',
        "appendonly no",
        f"dir {run_dir}",
        f"logfile {run_dir / LOG_FILE}",
        "daemonize no",
        # Its timer 1/s, not 10/s: it expires no keys and times out no clients, and idle
        # at 10/s it took 0.18% of a core (0.02% at 1/s); a SIGTERM takes up to 1 s.
        "hz 1",
        "databases 1",
        "maxmemory 256mb",
        "maxmemory-policy noeviction",
        'rename-command CONFIG ""',
        'rename-command DEBUG ""',
        'rename-command MODULE ""',
        'rename-command SAVE ""',
        'rename-command BGSAVE ""',
        'rename-command BGREWRITEAOF ""',
        'rename-command REPLICAOF ""',
        'rename-command SLAVEOF ""',
        "",
    ])


def start_redis(run_dir: str | os.PathLike, *, host: str, timeout_s: float = 10.0,
                server: str = "redis-server") -> tuple[subprocess.Popen, RedisAddress]:
    """Starts the job's redis-server listening on ``host``; (process, address).

    Raises:
        RedisError: no redis-server, or it did not answer within timeout_s.
    """
    run_dir = Path(run_dir)
    binary = shutil.which(server)
    if binary is None:
        raise RedisError(f"{server} not found on PATH; install redis-server on the nodes")
    password = secrets.token_urlsafe(32)
    port = _free_port(host)
    old_umask = os.umask(0o077)
    try:
        write_atomic(run_dir / SECRET_FILE, password + "\n", mode=0o600)
        write_atomic(run_dir / CONF_FILE, _config_text(host=host, port=port, password=password, run_dir=run_dir),
                     mode=0o600)
    finally:
        os.umask(old_umask)
    command = [binary, str(run_dir / CONF_FILE)]
    setpriv = shutil.which("setpriv")
    if setpriv:
        # The server goes with its master even when the master is killed (SIGKILL: no
        # clean-up), on clusters whose Slurm does not track a step's processes by cgroup.
        command = [setpriv, "--pdeathsig", "TERM", "--", *command]
    # A session of its own: the plane then lowers its own session's priority
    # (priority.py), and the server keeps the job's, for training ranks that read plans.
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True)
    address = RedisAddress(host=host, port=port, password=password)
    deadline = time.monotonic() + timeout_s
    client = address.client(timeout_s=1.0)
    while True:
        try:
            if client.ping():
                break
        except Exception as exc:  # noqa: BLE001  (redis-py raises ConnectionError, BusyLoadingError, ...)
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_redis(proc)
                raise RedisError(f"redis-server on {host}:{port} did not start: {exc} "
                                 f"(see {run_dir / LOG_FILE})") from None
            time.sleep(0.05)
    write_atomic(run_dir / ADDRESS_FILE, f"{host}:{port}\n", mode=0o600)
    return proc, address


def read_address(run_dir: str | os.PathLike) -> RedisAddress:
    """The job's Redis address and password, from its run directory (the job's user only).

    Raises:
        RedisError: the files are missing or unreadable (no control plane, or not yours).
    """
    run_dir = Path(run_dir)
    try:
        host, port = (run_dir / ADDRESS_FILE).read_text().strip().rsplit(":", 1)
        password = (run_dir / SECRET_FILE).read_text().strip()
        return RedisAddress(host=host, port=int(port), password=password)
    except PermissionError:
        raise RedisError(f"{run_dir}: only the job's user and root may read the job's state") from None
    except (OSError, ValueError):
        raise RedisError(f"{run_dir}: the job has no control plane (no {ADDRESS_FILE})") from None


def stop_redis(proc: subprocess.Popen, *, timeout_s: float = 5.0) -> None:
    """Stops the server (SIGTERM, then SIGKILL); it keeps nothing to flush."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
