"""``greyhound plan``: the mitigation planner's solvers, offline.

``greyhound plan microbatches --times T1,T2,... --total M [--multiple P] [--min K]
[--json]`` solves S2 (:mod:`greyhound.mitigate.microbatch`). The options are parsed
here rather than by click's types so that a malformed value is one ``greyhound: ...``
line and exit status 1, like every other error of the command.
"""

from __future__ import annotations

import json

import click

from greyhound.errors import InputError
from greyhound.mitigate.microbatch import Allocation, even_split, makespan, split_microbatches

_COMMAND = "plan microbatches"


@click.group()
def plan() -> None:
    """Mitigation plans, computed offline from measured times."""


@plan.command("microbatches")
@click.option("--times", metavar="T1,T2,...", help="Seconds per micro-batch of each DP group (required).")
@click.option("--total", metavar="M", help="Micro-batches per step, M (required).")
@click.option("--multiple", metavar="P", help="Each group's count is a multiple of P (1F1B: the PP degree). [1]")
@click.option("--min", "minimum", metavar="K", help="Fewest micro-batches per group. [P]")
@click.option("--json", "as_json", is_flag=True, help="Print {allocation, makespan, solve_seconds} as JSON.")
def microbatches(times: str | None, total: str | None, multiple: str | None, minimum: str | None,
                 as_json: bool) -> None:
    """S2: split a step's M micro-batches across DP groups so the slowest group finishes first.

    Minimises max_i m_i * t_i over whole counts m_i with sum m_i = M, each a multiple of
    P and at least K (default P: a group keeps one micro-batch, or one P-block, so its
    pipeline stays busy); among the optimal splits, the one closest to the even split.
    Without --json: a table per group, and the makespan against the even split's
    ("Z% faster" is the even split's makespan over the re-split's, minus 1).
    """
    t = _parse_times(times)
    m_total = _parse_whole("--total", total, required=True)
    p = _parse_whole("--multiple", multiple, default=1)
    least = None if minimum is None else _parse_whole("--min", minimum)
    try:
        result = split_microbatches(t, total=m_total, multiple=p, minimum=least)
    except ValueError as exc:
        raise InputError(f"{_COMMAND}: {exc}") from None
    if as_json:
        click.echo(json.dumps(result.as_dict()))
        return
    _print_table(t, result, makespan(even_split(len(t), total=m_total, multiple=p), t))


def _parse_times(text: str | None) -> list[float]:
    if text is None or not text.strip():
        raise InputError(f"{_COMMAND}: --times is required: seconds per micro-batch of each DP group, T1,T2,...")
    values = []
    for i, item in enumerate(text.split(","), start=1):
        try:
            values.append(float(item))
        except ValueError:
            raise InputError(
                f"{_COMMAND}: --times: item {i} {item.strip()!r} is not a number; give seconds per micro-batch "
                "as T1,T2,..."
            ) from None
    return values


def _parse_whole(flag: str, text: str | None, *, required: bool = False, default: int = 0) -> int:
    """A whole number from an option (its range is the solver's to check)."""
    if text is None:
        if required:
            raise InputError(f"{_COMMAND}: {flag} is required (a whole number)")
        return default
    try:
        return int(text.strip(), 10)
    except ValueError:
        raise InputError(f"{_COMMAND}: {flag}: {text!r} is not a whole number") from None


def _print_table(t: list[float], result: Allocation, even: float) -> None:
    click.echo(f"{'group':>5}  {'s/micro-batch':>13}  {'micro-batches':>13}  {'seconds':>10}")
    for i, (s, m) in enumerate(zip(t, result.allocation)):
        click.echo(f"{i:>5}  {s:>13.6g}  {m:>13}  {m * s:>10.6g}")
    faster = even / result.makespan - 1  # > 0: some group has m >= 1 and t > 0
    click.echo(f"even split: {even:.6g} s; re-split: {result.makespan:.6g} s ({faster * 100:.1f}% faster)")
    click.echo(f"solved in {result.solve_seconds * 1e3:.2f} ms")
