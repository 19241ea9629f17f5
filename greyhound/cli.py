"""The `greyhound` command line.

Each subcommand lives beside the code it drives and is registered here; this module
alone turns a GreyhoundError into one stderr line and exit status 1.
"""

import logging
import sys

import click

from greyhound import __version__
from greyhound.errors import GreyhoundError


class _Group(click.Group):
    """A click group that reports GreyhoundError as one line, never a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except GreyhoundError as exc:
            click.echo(f"greyhound: {exc}", err=True)
            sys.exit(1)
        except BrokenPipeError:
            sys.exit(0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="greyhound")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def main(verbose: int) -> None:
    """Find, mitigate and explain fail-slow stragglers in training jobs on Slurm."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="greyhound: %(name)s: %(message)s")


# (module, attribute) of each subcommand; one line per command.
_SUBCOMMANDS: list[tuple[str, str]] = [
    ("postmortem.cli", "postmortem"),
    ("greyhound.detect_cli", "detect"),
    ("postmortem.merge", "merge_command"),
    ("greyhound.report_cli", "report"),
    ("greyhound.status_cli", "status"),
    ("greyhound.inject.cli", "inject"),
    ("greyhound.mitigate.cli", "plan"),
]


def _register() -> None:
    import importlib

    for module_name, attr in _SUBCOMMANDS:
        main.add_command(getattr(importlib.import_module(module_name), attr))


_register()

if __name__ == "__main__":
    main()
