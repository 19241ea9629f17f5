"""`greyhound postmortem [--json] [--out DIR] [--meta FILE] TRACE`."""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager

import click

from postmortem.idealize import ESTIMATORS


@contextmanager
def _progress(enabled: bool):
    """A rich progress bar on a terminal; a no-op otherwise."""
    if not enabled:
        yield lambda *_: None
        return
    from rich.progress import Progress

    with Progress(transient=True) as prog:
        task = prog.add_task("post-mortem", total=3)

        def advance(what: str) -> None:
            prog.update(task, advance=1, description=what)

        yield advance


@click.command("postmortem")
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Write the HTML report here.")
@click.option("--meta", "meta_file", type=click.Path(dir_okay=False), help="meta-X.yaml of a What-if parquet trace.")
@click.option(
    "--estimator",
    type=click.Choice(ESTIMATORS),
    default="robust",
    show_default=True,
    help="Ideal compute time: robust (greyhound) or mean (the What-if study's).",
)
def postmortem(trace: str, as_json: bool, out_dir: str | None, meta_file: str | None, estimator: str) -> None:
    """What-if post-mortem of TRACE (greyhound HDF5, or What-if parquet + meta)."""
    from postmortem.analysis import analyze, summary_line
    from postmortem.whatif_import import load_any

    with _progress(sys.stderr.isatty()) as step:
        t0 = time.perf_counter()
        tr = load_any(trace, meta_path=meta_file)
        load_s = time.perf_counter() - t0
        step("analysing")
        result = analyze(tr, estimator=estimator, load_seconds=load_s)
        step("writing report")
        report_path = None
        if out_dir:
            from postmortem.report import write_report

            report_path = write_report(result, out_dir)
        step("done")
    data = result.to_json()
    if report_path:
        data["report"] = str(report_path)
    if as_json:
        click.echo(json.dumps(data))
        return
    a = result.attribution
    click.echo(summary_line(result, str(report_path) if report_path else "(none; use --out)"))
    click.echo(
        f"T traced {a.t_real:.4f} s, replay {a.t_replay:.4f} s (error {a.simulation_error * 100:+.2f}%), "
        f"ideal {a.t_ideal:.4f} s; M_W {a.mw:.3f}, M_S {a.ms:.3f}"
    )
    top = sorted(a.by_optype.items(), key=lambda x: -x[1])[:4]
    click.echo("S_t: " + ", ".join(f"{k} {v:.3f}" for k, v in top))
    for c in result.causes:
        click.echo(f"cause: {c.cause} (confidence {c.confidence:.2f}) {json.dumps(c.evidence)}")
    for note in result.model.dropped:
        click.echo(f"dropped: {note}")
