"""`greyhound report [--json] JOBID`: a job's post-mortem, read back like seff.

The summary comes from the job's accounting record (sacct Comment), where the
EpilogSlurmctld put it; the causes come from the report's postmortem.json beside the
HTML page named in the summary, when the caller may read it.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import click

from greyhound.errors import GreyhoundError
from greyhound.slurm_client import connect

_SUMMARY = re.compile(r"(greyhound: .*)$")
_REPORT_PATH = re.compile(r"; report (\S+)")


def _elapsed(seconds: int) -> str:
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text


def job_report(job_id: str) -> dict:
    """What `greyhound report` shows for job_id, as a dict (the --json output)."""
    client = connect()
    record = client.job(job_id)
    match = _SUMMARY.search(record.comment)
    if not match:
        raise GreyhoundError(
            f"job {record.job_id} has no greyhound summary on its record "
            "(not run with --greyhound, or its post-mortem has not finished yet)"
        )
    summary = match.group(1)
    out: dict = {
        "job_id": record.job_id, "user": record.user, "state": record.state,
        "exit_code": record.exit_code, "nodes": record.node_list, "num_nodes": record.num_nodes,
        "elapsed_s": record.elapsed_s, "summary": summary, "report": None, "postmortem": None,
        "backend": client.backend,
    }
    path = _REPORT_PATH.search(summary)
    if path:
        page = Path(path.group(1))
        out["report"] = str(page)
        try:
            out["postmortem"] = json.loads(_read_report_json(page, record.job_id, client.owner_ids(record.job_id)[0]))
        except PermissionError:
            out["postmortem_error"] = f"{page.parent} is readable only by the job's user and admins"
        except (OSError, ValueError) as exc:
            out["postmortem_error"] = f"cannot read {page.parent / 'postmortem.json'}: {exc}"
    return out


_REPORT_JSON_MAX_BYTES = 64 << 20


def _read_report_json(page: Path, job_id: str, owner_uid: int) -> str:
    """The postmortem.json beside the report page named on the record.

    The record's comment is the job user's to change, so the path is taken only where
    the epilog writes reports (``.../<job>/report/`` or ``.../greyhound-<job>/``), the
    file only if it is a regular file of the job's user, opened without following a
    symlink or blocking on a FIFO, and no bigger than a report gets.

    Raises:
        ValueError: the path or the file is not one the post-mortem wrote.
        OSError: it cannot be read.
    """
    base_job_id = job_id.split("_")[0]
    where = page.parent
    expected = (where.name == "report" and where.parent.name == base_job_id) or where.name == f"greyhound-{job_id}"
    if not page.is_absolute() or page.name != "report.html" or not expected or ".." in page.parts:
        raise ValueError(f"{page} is not where greyhound writes job {job_id}'s report")
    fd = os.open(where / "postmortem.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != owner_uid or st.st_size > _REPORT_JSON_MAX_BYTES:
            raise ValueError("it is not a report file written for the job's user")
        return f.read(_REPORT_JSON_MAX_BYTES).decode("utf-8")


_EVIDENCE_ITEMS = 3   # entries of a list shown on the line (the JSON has them all)


def _evidence_text(evidence: dict) -> str:
    """A cause's evidence on one line: scalars as k=v, dicts as k=(k=v ...), lists of
    workers as k=[...] with the first few entries (the JSON has the rest)."""
    def flat(d: dict) -> str:
        return " ".join(f"{k}={v}" for k, v in d.items() if isinstance(v, (int, float, str)))

    parts = []
    for k, v in evidence.items():
        if isinstance(v, (int, float, str)):
            parts.append(f"{k}={v}")
        elif isinstance(v, dict) and flat(v):
            parts.append(f"{k}=({flat(v)})")
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            more = f"; +{len(v) - _EVIDENCE_ITEMS} more" if len(v) > _EVIDENCE_ITEMS else ""
            parts.append(f"{k}=[" + "; ".join(flat(x) for x in v[:_EVIDENCE_ITEMS]) + more + "]")
    return ", ".join(parts) or json.dumps(evidence)


def render_text(report: dict) -> str:
    lines = [
        f"Job ID: {report['job_id']}",
        f"User: {report['user']}",
        f"State: {report['state']} (exit code {report['exit_code']})",
        f"Nodes: {report['num_nodes']} ({report['nodes']})",
        f"Elapsed: {_elapsed(report['elapsed_s'])}",
        report["summary"],
    ]
    pm = report.get("postmortem")
    if pm:
        lines.append(
            f"Slowdown S={pm['slowdown']:.3f}, ideal step {pm['t_ideal']:.4g}s vs real {pm['t_real']:.4g}s; "
            f"M_W={pm['mw']:.2f}, M_S={pm['ms']:.2f}"
        )
        lines.append("Causes:" if pm["causes"] else "Causes: none found")
        for cause in pm["causes"]:
            lines.append(f"  - {cause['cause']} (confidence {cause['confidence']:.2f})")
            lines.append(f"      evidence: {_evidence_text(cause['evidence'])}")
            lines.append(f"      remedy: {cause['remedy']}")
    elif report.get("postmortem_error"):
        lines.append(f"Causes: unavailable: {report['postmortem_error']}")
    if report.get("report"):
        lines.append(f"Report: {report['report']}")
    return "\n".join(lines)


@click.command("report")
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def report(job_id: str, as_json: bool) -> None:
    """Show a job's straggler post-mortem (summary, causes, report path)."""
    data = job_report(job_id)
    click.echo(json.dumps(data, indent=2) if as_json else render_text(data))
