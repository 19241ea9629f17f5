"""The admin's greyhound settings, read from its plugstack line as the plugin reads them.

``optional /usr/local/lib/greyhound/greyhound_spank.so default=off mode=detect
prefix=/usr/local rundir=/var/tmp/greyhound retain=7 python=/opt/greyhound/bin/python
requeue=on``:
the arguments after the plugin's
path are ``key=value`` with the plugin's keys (spank/plugin/config.c); anything else
makes the plugin turn greyhound off, and then this reader says so too.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

from greyhound.errors import InputError

PLUGSTACK_ENTRY = Path("/etc/slurm/plugstack.conf.d/greyhound.conf")
KEYS = ("default", "mode", "prefix", "rundir", "retain", "python", "requeue")
_ON = ("1", "on", "true", "yes", "y")
_OFF = ("0", "off", "false", "no", "n")
"""The plugin's booleans (parse_bool in spank/plugin/config.c)."""
DEFAULT_RUNDIR = Path("/var/tmp/greyhound")
DEFAULT_PREFIX = Path("/usr/local")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlugstackConfig:
    rundir: Path = DEFAULT_RUNDIR
    """Parent of the per-job run directories."""
    prefix: Path = DEFAULT_PREFIX
    """Where greyhound is installed."""
    default_on: bool = False
    mode: str = "detect"
    python: Path | None = None
    """The interpreter that runs each job's control plane; None: no control plane."""
    requeue: bool = True
    """S4 allowed: checkpoint and requeue a job without its slow node. Off here wins
    over a job's ``--greyhound=requeue=on``."""


def parse_plugstack_line(line: str) -> PlugstackConfig | None:
    """The settings on one plugstack line; None when the line is not greyhound's.

    Raises:
        InputError: greyhound's line with an argument the plugin would refuse.
    """
    words = shlex.split(line, comments=True)
    if len(words) < 2 or words[0] not in ("optional", "required") or not words[1].endswith("greyhound_spank.so"):
        return None
    args: dict[str, str] = {}
    for word in words[2:]:
        key, eq, value = word.partition("=")
        if not eq or key not in KEYS:
            raise InputError(f"plugstack: unknown argument {word!r}; allowed keys: {', '.join(KEYS)}")
        args[key] = value
    for key in ("rundir", "prefix", "python"):
        if key in args and not args[key].startswith("/"):
            raise InputError(f"plugstack: {key}={args[key]!r} must be an absolute path")
    if "requeue" in args and args["requeue"] not in _ON + _OFF:
        raise InputError(f"plugstack: requeue={args['requeue']!r} is not allowed; use on or off")
    return PlugstackConfig(
        rundir=Path(args.get("rundir", DEFAULT_RUNDIR)),
        prefix=Path(args.get("prefix", DEFAULT_PREFIX)),
        default_on=args.get("default", "off") in _ON,
        mode=args.get("mode", "detect"),
        python=Path(args["python"]) if "python" in args else None,
        requeue=args.get("requeue", "on") in _ON,
    )


def read_plugstack(path: Path = PLUGSTACK_ENTRY) -> PlugstackConfig:
    """greyhound's settings from the plugstack file (the defaults when it has no line)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return PlugstackConfig()
    for line in lines:
        config = parse_plugstack_line(line)
        if config is not None:
            return config
    return PlugstackConfig()
