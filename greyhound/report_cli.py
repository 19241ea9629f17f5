"""`greyhound report [--json] JOBID`: a job's post-mortem, read back like seff.

The summary comes from the job's accounting record (sacct Comment), where the
EpilogSlurmctld put it; the causes come from the report's postmortem.json beside the
HTML page named in the summary, when the caller may read it.
"""

from __future__ import annotations

import json
import re
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
            out["postmortem"] = json.loads((page.parent / "postmortem.json").read_text())
        except PermissionError:
            out["postmortem_error"] = f"{page.parent} is readable only by the job's user and admins"
        except (OSError, ValueError) as exc:
            out["postmortem_error"] = f"cannot read {page.parent / 'postmortem.json'}: {exc}"
    return out


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
