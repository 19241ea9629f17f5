"""Shared fixtures: the repository's paths and the live local Slurm cluster."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STUDY_TRACES = REPO / "tests" / "assets" / "straggleranalysis"
"""The What-if study's three sample traces and its analyzer's results (README.md there)."""
PREFIX = Path(os.environ.get("GREYHOUND_PREFIX", "/usr/local"))


def _cluster_reason() -> str | None:
    """Why the local cluster cannot be used, or None when it answers."""
    if shutil.which("sbatch") is None:
        return "Slurm is not installed: run scripts/setup"
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "slurmctld does not answer: run scripts/cluster up"
    if proc.returncode != 0:
        return "the local Slurm cluster is not running: run scripts/cluster up"
    if "idle" not in proc.stdout and "mixed" not in proc.stdout:
        return f"no usable node in the local cluster (states: {proc.stdout.split()})"
    return None


def require(missing: str | None) -> None:
    """Skips the calling test when ``missing`` says what it lacks (under CI, where
    .ci/run has set everything up, :func:`pytest_runtest_makereport` makes the skip a
    failure)."""
    if missing is not None:
        pytest.skip(missing)


HARDWARE_SKIP = re.compile(r"hardware: (GPU|CUDA|NCCL|AVX-512)\b")
"""The one skip reason CI accepts, at the start of the reason: hardware no machine of
ours may have (the GPU path's CPU twin is tested for real, see the test's docstring).
A reason that merely mentions a GPU ("mpirun is missing for the GPU test") does not
match; :func:`skip_for_hardware` writes it."""


def skip_for_hardware(hardware: str, why: str) -> None:
    """Skips the calling test for lack of ``hardware`` (GPU, CUDA, NCCL or AVX-512), the
    only skip CI accepts."""
    pytest.skip(f"hardware: {hardware}: {why}")


def _skip_message(reason: str) -> str:
    """The message of a skip report's reason ("Skipped: ..." from pytest.skip)."""
    return reason.removeprefix("Skipped: ")


def _refuse_skip(report: pytest.CollectReport | pytest.TestReport, what: str) -> None:
    """Under CI (CI=true: .ci/run has installed and started everything), turns a skip
    ``report`` into a failure unless it names missing hardware (:data:`HARDWARE_SKIP`)."""
    if os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not HARDWARE_SKIP.match(_skip_message(reason)):
        report.outcome = "failed"
        report.longrepr = f"CI: {what}, which CI does not accept: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI a test that skips for any reason but missing hardware is a failure: a
    green run cannot hide a missing install step behind skips (skipif marks and
    pytest.skip calls alike)."""
    outcome = yield
    _refuse_skip(outcome.get_result(), "skipped")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """Under CI a module that skips while it is collected (a module-level
    ``pytest.importorskip`` or ``pytest.skip(allow_module_level=True)``), for any reason
    but missing hardware, is a collection error, which stops the run: the skip never
    reaches :func:`pytest_runtest_makereport`, as the module's tests are never made."""
    outcome = yield
    _refuse_skip(outcome.get_result(), "skipped at collection")


@pytest.fixture(scope="session")
def unmitigated(cluster, tmp_path_factory):
    """The reference job with a compute fail-slow on rank 5 under --greyhound=detect
    (reference_job.run_injected), run once: the online tests read its detection, the
    mitigation tests its step times and losses (what every mitigated run must learn)."""
    from reference_job import run_injected

    return run_injected(tmp_path_factory.mktemp("unmitigated"), "detect")


@pytest.fixture(scope="session")
def cluster() -> None:
    """Skips a test unless the local Slurm cluster (scripts/cluster up) answers; under CI
    a missing cluster is a failure (see :func:`pytest_runtest_makereport`). Nodes still completing or
    planned for another job are waited for, not skipped."""
    deadline = time.monotonic() + 90
    while (reason := _cluster_reason()) and "no usable node" in reason and time.monotonic() < deadline:
        time.sleep(2)
    require(reason)
    if left := _cancel_jobs_from_before():
        warnings.warn(f"cancelled job(s) {', '.join(left)}, left in the queue from before this test run",
                      stacklevel=1)


def _cancel_jobs_from_before(timeout_s: float = 60) -> list[str]:
    """Cancels the jobs in the local cluster's queue as the test run starts, and waits
    for them to leave it; their ids. The tests need the whole cluster: a job an aborted
    earlier run left behind survives scripts/cluster down and up (slurmctld keeps its
    state), held all four nodes for 30 minutes and failed the lifecycle tests in CI."""
    def queued() -> list[str]:
        return subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True,
                              timeout=30).stdout.split()

    left = queued()
    if left:
        subprocess.run(["scancel", *left], capture_output=True, timeout=30, check=False)
    deadline = time.monotonic() + timeout_s
    while queued() and time.monotonic() < deadline:
        time.sleep(1)
    return left


def ensure_user(name: str):
    """The unprivileged local user ``name`` (created if missing): the attacker, the
    victim or the plain user of a test; its pwd entry."""
    import pwd

    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/bash", name],
                       check=True, capture_output=True)
        return pwd.getpwnam(name)


class SlurmJob:
    """A job submitted with real sbatch, waited for with real squeue/sacct."""

    def __init__(self, job_id: str, output: Path) -> None:
        self.job_id = job_id
        self.output = output

    def wait(self, timeout_s: float = 120) -> str:
        """Waits until the job has ended; returns its sacct State."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = sacct_field(self.job_id, "State")
            if state and state.split()[0] not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED"):
                return state.split()[0]
            time.sleep(0.5)
        subprocess.run(["scancel", self.job_id], check=False)
        raise AssertionError(f"job {self.job_id} did not end within {timeout_s}s")

    def state(self) -> str:
        """The controller's state of the job ("" once it left the queue)."""
        return subprocess.run(["squeue", "-h", "-j", self.job_id, "-o", "%T"],
                              capture_output=True, text=True, timeout=30).stdout.strip()

    def text(self) -> str:
        return self.output.read_text() if self.output.exists() else ""


def sacct_field(job_id: str, field: str) -> str:
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-j", job_id, "-o", field],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout.strip().splitlines()
    return out[-1] if out else ""


@pytest.fixture
def sbatch(tmp_path):
    """Submits a job script: sbatch(script_text, *options, env=None) -> SlurmJob."""
    submitted: list[SlurmJob] = []
    os.chmod(tmp_path, 0o755)

    def submit(script: str, *options: str, env: dict | None = None) -> SlurmJob:
        script_path = tmp_path / f"job{len(submitted)}.sh"
        script_path.write_text(script)
        output = tmp_path / f"job{len(submitted)}.out"
        proc = subprocess.run(
            ["sbatch", "--parsable", f"--output={output}", *options, str(script_path)],
            capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
        )
        assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
        job = SlurmJob(proc.stdout.strip().split(";")[0], output)
        submitted.append(job)
        return job

    yield submit
    for job in submitted:
        subprocess.run(["scancel", job.job_id], capture_output=True, check=False)


EPILOG_LOG = Path("/var/log/greyhound/epilog.log")


def comment_of(job_id: str, timeout_s: float = 300) -> str:
    """The job's sacct Comment once greyhound's summary is on it. The default bound is the
    epilog's own analysis limit: on a loaded CI machine the summary once took over 60 s.
    A summary that never comes fails with the epilog log's last lines, which say why."""
    deadline = time.monotonic() + timeout_s
    while True:
        comment = sacct_field(job_id, "Comment")
        if "greyhound: " in comment:
            return comment
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    log = EPILOG_LOG.read_text(errors="replace").splitlines()[-20:] if EPILOG_LOG.exists() else []
    pytest.fail(f"no greyhound summary on job {job_id}'s record after {timeout_s:.0f} s "
                f"(Comment {comment!r}); {EPILOG_LOG}'s last lines:\n" + "\n".join(log))


CLUSTER_SCRIPT = str(REPO / "scripts/cluster")
CLUSTER_STATE = Path(os.environ.get("GREYHOUND_CLUSTER_STATE", "/var/lib/greyhound-cluster"))


def cluster_shape() -> str:
    return (CLUSTER_STATE / "shape").read_text().strip()


def shape_args(shape: str) -> list[str]:
    """`scripts/cluster up`'s arguments for a shape as its state file writes it ("4 netns=1")."""
    nodes, netns = shape.split()
    return ["--nodes", nodes, *(["--netns"] if netns == "netns=1" else [])]


def _dead_slurmds() -> list[str]:
    """The emulated nodes whose slurmd (started by scripts/cluster) no longer runs."""
    dead = []
    for pidfile in sorted((CLUSTER_STATE / "run").glob("slurmd-n*.pid")):
        try:
            stat = Path(f"/proc/{int(pidfile.read_text().split()[0])}/stat").read_text()
        except (OSError, ValueError, IndexError):
            stat = ""
        if stat.rpartition(")")[2].split()[:1] in ([], ["Z"]):     # gone, or a zombie not yet reaped
            dead.append(pidfile.stem.removeprefix("slurmd-"))
    return dead


@pytest.fixture(autouse=True)
def live_nodes(request):
    """Before each cluster test, a node whose slurmd has died is started again, with a
    warning in the run's summary. Slurm 22.05.8's slurmd aborted once in CI ("malloc():
    unaligned tcache chunk detected" while launching a step, two jobs starting on the
    node at once; no greyhound code runs inside slurmd), and every later test that
    wanted that node failed for it."""
    if request.node.get_closest_marker("cluster") is None or not (dead := _dead_slurmds()):
        return
    subprocess.run([CLUSTER_SCRIPT, "up", *shape_args(cluster_shape())], check=True, capture_output=True,
                   timeout=300)
    warnings.warn(f"slurmd of {', '.join(dead)} had died (its log and any core: {CLUSTER_STATE / 'log'}); "
                  f"started again before {request.node.name}", stacklevel=1)


@pytest.fixture(scope="module")
def netns_cluster(cluster):
    """The cluster with a network namespace per node; the plain one again afterwards.
    Not left in place for the tests after (it would save about 40 s of CI a module):
    on the netns cluster a job's own later step sometimes waits for ever behind the
    control plane's step (the default-on plugin test, 4 of 12 rounds; 0 of 12 on the
    plain cluster), a bug of the plane's that those tests are not about."""
    switched = cluster_shape() != "4 netns=1"
    if switched:
        subprocess.run([CLUSTER_SCRIPT, "down"], check=True, capture_output=True, timeout=300)
        subprocess.run([CLUSTER_SCRIPT, "up", "--netns"], check=True, capture_output=True, timeout=300)
    yield
    if switched:
        subprocess.run([CLUSTER_SCRIPT, "down"], check=True, capture_output=True, timeout=300)
        subprocess.run([CLUSTER_SCRIPT, "up", "--nodes", "4"], check=True, capture_output=True, timeout=300)
