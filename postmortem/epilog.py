"""The post-mortem of one ended job, as EpilogSlurmctld runs it (slurm/epilog_slurmctld).

For a greyhound-enabled job (one whose run directory exists):
  1. find its timeline: the merged ``trace.h5``, or per-rank files merged here;
  2. run the what-if analysis and write the report into the job's report directory,
     readable only by the job's user (and root);
  3. put a one-line summary on the job's accounting record, keeping the user's comment.
A job without a usable trace gets a record that says why, never silence. Nothing here
can fail the job: it has ended, and the epilog script runs this detached and bounded.

Usage: python -m postmortem.epilog JOBID   (as root on the controller)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import sys
import time
from pathlib import Path

from greyhound.errors import GreyhoundError
from greyhound.slurm_client import check_job_id, connect, merge_comment

log = logging.getLogger(__name__)

PLUGSTACK_ENTRY = Path("/etc/slurm/plugstack.conf.d/greyhound.conf")
OPTIONS_FILE = "options"
"""Written by the SPANK plugin into the run directory: the job's effective options."""
TIMELINE_DIRS = ("timeline", "trace", ".")
"""Where inside the run directory the training job's timeline may be."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EpilogConfig:
    rundir: Path = Path("/var/tmp/greyhound")
    """Parent of the per-job run directories (plugstack ``rundir=``)."""


def read_plugstack_config(path: Path = PLUGSTACK_ENTRY) -> EpilogConfig:
    """The admin's settings from greyhound's plugstack line (defaults if absent)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return EpilogConfig()
    for line in lines:
        words = shlex.split(line, comments=True)
        if len(words) >= 2 and words[0] in ("optional", "required") and words[1].endswith("greyhound_spank.so"):
            args = dict(w.split("=", 1) for w in words[2:] if "=" in w)
            return EpilogConfig(rundir=Path(args.get("rundir", "/var/tmp/greyhound")))
    return EpilogConfig()


def read_options(run_dir: Path) -> dict[str, str]:
    try:
        text = (run_dir / OPTIONS_FILE).read_text()
    except OSError:
        return {}
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def find_trace(run_dir: Path, job_id: str) -> Path:
    """The job's HDF5 trace, merging per-rank timeline files if needed.

    Raises:
        GreyhoundError: with the reason there is no usable trace.
    """
    from postmortem.merge import TRACE_FILE_NAME, merge_trace_dir

    for sub in TIMELINE_DIRS:
        d = run_dir / sub
        merged = d / TRACE_FILE_NAME
        if merged.is_file():
            return merged
        if any(d.glob("rank-*.jsonl")):
            return merge_trace_dir(d, job_id=job_id)
    raise GreyhoundError(f"no timeline trace in {run_dir} (the job recorded none)")


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    for root, dirs, files in os.walk(path):
        for name in (root, *(os.path.join(root, f) for f in dirs + files)):
            os.chown(name, uid, gid)


def report_dir_for(run_dir: Path, options: dict[str, str], job_id: str) -> Path:
    if options.get("report"):
        return Path(options["report"]) / f"greyhound-{job_id}"
    return run_dir / "report"


def run(job_id: str, *, config: EpilogConfig | None = None) -> str | None:
    """The post-mortem of job_id; returns the summary put on its record (None: not greyhound's)."""
    job_id = check_job_id(job_id)
    config = config or read_plugstack_config()
    run_dir = config.rundir / job_id
    if not run_dir.is_dir():
        return None
    st = run_dir.stat()
    options = read_options(run_dir)
    t0 = time.monotonic()
    try:
        if options.get("trace") == "off":
            raise GreyhoundError("tracing was off for this job (--greyhound=trace=off)")
        from postmortem.analysis import analyze, summary_line
        from postmortem.report import write_report
        from postmortem.whatif_import import load_any

        trace_path = find_trace(run_dir, job_id)
        result = analyze(load_any(trace_path))
        out = report_dir_for(run_dir, options, job_id)
        old_umask = os.umask(0o077)
        try:
            page = write_report(result, out)
        finally:
            os.umask(old_umask)
        os.chmod(out, 0o700)
        _chown_tree(out, st.st_uid, st.st_gid)
        summary = summary_line(result, str(page))
    except GreyhoundError as exc:
        summary = f"greyhound: no post-mortem: {exc}"
    except Exception as exc:  # never leave the record silent, whatever broke
        log.exception("post-mortem of job %s failed", job_id)
        summary = f"greyhound: no post-mortem: internal error ({type(exc).__name__}: {exc})"
    summary = " ".join(summary.split())
    client = connect()
    record = client.job(job_id)
    client.set_comment(job_id, merge_comment(record.comment, summary))
    log.info("job %s: %s (%.1fs)", job_id, summary, time.monotonic() - t0)
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s greyhound: epilog: %(message)s")
    if len(argv) != 1:
        print("greyhound: epilog: usage: python -m postmortem.epilog JOBID", file=sys.stderr)
        return 2
    try:
        run(argv[0])
    except GreyhoundError as exc:
        print(f"greyhound: epilog: job {argv[0]}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
