"""``greyhound inject``: real fail-slows (a CPU quota, a narrowed link) and their truth.

    greyhound inject compute (--pid PID | --job J --rank R [--step S]) [--severity 0.5]
                             --duration S [--start-after S]
    greyhound inject link (--node nX | --dev IF [--netns NS]) --rate 200mbit
                          --duration S [--start-after S]
    greyhound inject run SCHEDULE.yaml
    greyhound inject undo-all [--force]

Each command runs in the foreground and undoes what it did when the duration ends or
when it gets SIGINT, SIGTERM or SIGHUP (it then exits with 128 + the signal number).
Every injection that happened is appended to the truth log as one JSON line.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import click

from greyhound.errors import GreyhoundError, InputError
from greyhound.inject import runner, schedule, state
from greyhound.inject.spec import DEFAULT_SEVERITY, SEVERITY_MAX, ComputeSpec, LinkSpec


def _env(ctx: click.Context) -> state.InjectEnv:
    env = ctx.find_object(state.InjectEnv)
    assert env is not None  # the group's callback made it
    return env


def _truth_path(env: state.InjectEnv, truth: str | None) -> Path:
    return Path(truth) if truth else env.default_truth


def _plan(spec_cls, duration: float, start_after: float, **fields) -> schedule.Planned:
    try:
        return schedule.Planned(spec=spec_cls(**fields), start_s=start_after, duration_s=duration)
    except ValueError as exc:
        raise InputError(str(exc)) from exc


def _execute(ctx: click.Context, plans: list[schedule.Planned], truth: str | None, as_json: bool) -> None:
    env = _env(ctx)
    truth_path = _truth_path(env, truth)
    injections = runner.preflight(plans, env=env)

    def notify(msg: str) -> None:
        click.echo(f"greyhound: inject: {msg}", err=True)

    with runner.StopOnSignals() as guard:
        outcomes = runner.run_plans(plans, env=env, truth_path=truth_path, stop=guard.stop,
                                    injections=injections, notify=notify)
    for outcome in outcomes:
        if outcome.record is not None:
            click.echo(json.dumps(outcome.record, sort_keys=True) if as_json else
                       f"{outcome.id}: {outcome.record['start']:.3f} -> {outcome.record['end']:.3f} "
                       f"({outcome.record['ended_by']})")
    failed = [o for o in outcomes if o.error]
    if guard.signum is not None:
        name = signal.Signals(guard.signum).name
        click.echo(f"greyhound: inject: stopped by {name}; every injection was undone"
                   + (" except as reported above" if any("undo failed" in (o.error or "") for o in failed) else ""),
                   err=True)
        for outcome in failed:
            click.echo(f"greyhound: inject: {outcome.id}: {outcome.error}", err=True)
        ctx.exit(128 + guard.signum)
    if failed:
        if len(failed) == 1 and len(outcomes) == 1:
            raise InputError(failed[0].error)
        details = "; ".join(f"{o.id}: {o.error}" for o in failed)
        raise InputError(f"{len(failed)} of {len(outcomes)} injections failed: {details}")


class _InjectGroup(click.Group):
    """Prefixes every one-line error of the inject commands with 'inject: '."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except GreyhoundError as exc:
            raise type(exc)(f"inject: {exc}") from exc


@click.group("inject", cls=_InjectGroup)
@click.option("--state-dir", type=click.Path(file_okay=False), default=str(state.DEFAULT_STATE_DIR),
              show_default=True, help="Records of active injections (for undo-all) and the default truth log.")
@click.option("--cgroup-parent", default=state.DEFAULT_CGROUP_PARENT, show_default=True,
              help="Directory under the cgroup v1 cpu mount that holds compute injections' cgroups.")
@click.pass_context
def inject(ctx: click.Context, state_dir: str, cgroup_parent: str) -> None:
    """Inject real fail-slows: a CPU quota on a process or rank, a tbf on a link."""
    try:
        ctx.obj = state.InjectEnv(state_dir=Path(state_dir), cgroup_parent=cgroup_parent)
    except ValueError as exc:
        raise InputError(str(exc)) from exc


_duration = click.option("--duration", type=float, required=True, help="Seconds the injection lasts.")
_start_after = click.option("--start-after", type=float, default=0.0, show_default=True,
                            help="Seconds to wait before applying it.")
_truth = click.option("--truth", type=click.Path(dir_okay=False), default=None,
                      help="Ground-truth JSON-lines log [default: STATE_DIR/truth.jsonl].")
_json = click.option("--json", "as_json", is_flag=True, help="Print the truth record(s) as JSON.")


@inject.command("compute")
@click.option("--pid", type=int, default=None, help="The process to slow (all its threads).")
@click.option("--job", default=None, help="With --rank: a Slurm job whose rank to slow.")
@click.option("--rank", type=int, default=None, help="SLURM_PROCID of the task to slow.")
@click.option("--step", default=None, help="Job step, when several steps run the rank here.")
@click.option("--severity", type=float, default=DEFAULT_SEVERITY, show_default=True,
              help=f"Fraction of the CPU taken away, in (0, {SEVERITY_MAX}].")
@click.option("--cpus", type=float, default=None,
              help="CPUs the target uses unslowed; it keeps (1 - severity) x cpus "
                   "[default: what it used in the second before].")
@_duration
@_start_after
@_truth
@_json
@click.pass_context
def compute_command(ctx, pid, job, rank, step, severity, cpus, duration, start_after, truth, as_json):
    """Give one process, or every process of a job's rank, less CPU (cgroup v1 quota)."""
    plan = _plan(ComputeSpec, duration, start_after, pid=pid, job=job, rank=rank, step=step,
                 severity=severity, cpus=cpus)
    _execute(ctx, [plan], truth, as_json)


@inject.command("link")
@click.option("--node", default=None, help="Emulated node nX: throttle gh-vethX and eth0 in gh-nX.")
@click.option("--dev", default=None, help="A raw interface to throttle (its egress).")
@click.option("--netns", default=None, help="Named network namespace of --dev.")
@click.option("--rate", required=True, help="tc rate the link is narrowed to, e.g. 200mbit.")
@click.option("--burst", default=None, help="tbf bucket [default: max(64kb, 5 ms at the rate)].")
@click.option("--latency", default="50ms", show_default=True, help="tbf queueing limit.")
@_duration
@_start_after
@_truth
@_json
@click.pass_context
def link_command(ctx, node, dev, netns, rate, burst, latency, duration, start_after, truth, as_json):
    """Narrow a link with a token bucket (tc tbf) for a while."""
    plan = _plan(LinkSpec, duration, start_after, node=node, dev=dev, netns=netns, rate=rate,
                 burst=burst, latency=latency)
    _execute(ctx, [plan], truth, as_json)


@inject.command("run")
@click.argument("schedule_file", metavar="SCHEDULE.yaml", type=click.Path(dir_okay=False))
@click.option("--check", is_flag=True, help="Only parse the schedule and check it against this machine.")
@_truth
@_json
@click.pass_context
def run_command(ctx, schedule_file, check, truth, as_json):
    """Run a schedule file of injections concurrently (see greyhound.inject.schedule)."""
    plans = schedule.load_schedule(schedule_file)
    if check:
        runner.preflight(plans, env=_env(ctx))
        click.echo(f"{schedule_file}: {len(plans)} injections, last ends at "
                   f"{max(p.end_s for p in plans):g} s")
        return
    _execute(ctx, plans, truth, as_json)


@inject.command("undo-all")
@click.option("--force", is_flag=True, help="Also stop live injectors (SIGTERM) so they undo theirs.")
@_truth
@click.pass_context
def undo_all_command(ctx, force, truth):
    """Remove every leftover greyhound cgroup and tbf qdisc."""
    result = runner.undo_all(env=_env(ctx), truth_path=Path(truth) if truth else None, force=force)
    click.echo(json.dumps(result, sort_keys=True))
    if result["live"]:
        click.echo(f"greyhound: inject: {len(result['live'])} injection(s) belong to running "
                   "injectors and were left alone (use --force)", err=True)
