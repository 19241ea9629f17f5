"""The admin's greyhound settings, read from its plugstack line as the plugin reads them.

``optional /usr/local/lib/greyhound/greyhound_spank.so default=off mode=detect
prefix=/usr/local rundir=/var/tmp/greyhound retain=7 python=/opt/greyhound/bin/python
requeue=on``:
the arguments after the plugin's
path are ``key=value`` with the plugin's keys (spank/plugin/config.c); anything else
makes the plugin turn greyhound off, and then this reader says so too.

The line is split as Slurm splits it (src/common/spank.c, _plugin_stack_parse_line):
everything from the first ``#`` on is a comment, words are separated by blanks, tabs
and newlines only, and nothing is unquoted or unescaped (``rundir="/a b"`` is the two
words ``rundir="/a`` and ``b"``). The arguments are then checked as gh_config_parse
checks them; tests/test_plugstack.py runs one table of lines through both.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from greyhound.errors import InputError

PLUGSTACK_ENTRY = Path("/etc/slurm/plugstack.conf.d/greyhound.conf")
PLUGIN_FILE = "greyhound_spank.so"
KEYS = ("default", "mode", "prefix", "rundir", "retain", "python", "requeue")
ALLOWED = ("default=on|off, mode=detect|mitigate, prefix=DIR, rundir=DIR, retain=DAYS, python=PATH, "
           "requeue=on|off")
"""CONFIG_KEYS_ALLOWED in spank/plugin/config.c."""
_ON = ("1", "on", "true", "yes", "y")
_OFF = ("0", "off", "false", "no", "n")
"""The plugin's booleans (parse_bool in spank/plugin/config.c)."""
MODES = ("detect", "mitigate")
PATH_MAX = 4096
"""Linux's PATH_MAX, with its NUL: the plugin's path buffers, and Slurm's line buffer."""
RETAIN_DAYS_DEFAULT = 7
RETAIN_DAYS_MAX = 3650
"""GH_RETAIN_DAYS_DEFAULT and GH_RETAIN_DAYS_MAX in spank/plugin/greyhound.h."""
_SEPARATORS = re.compile("[ \t\n]+")
"""Slurm's word separators on a plugstack line; \\r, \\v and \\f are not among them."""
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
    retain_days: int = RETAIN_DAYS_DEFAULT
    """Days a job's run directory stays after the job."""
    requeue: bool = True
    """S4 allowed: checkpoint and requeue a job without its slow node. Off here wins
    over a job's ``--greyhound=requeue=on``."""


def _bytes(text: str) -> bytes:
    """The bytes the plugin sees (read_plugstack decodes undecodable bytes as surrogates)."""
    return text.encode("utf-8", "surrogateescape")


def _show(value: str) -> str:
    """value as the plugin's message quotes it; an undecodable byte as \\xNN."""
    return _bytes(value).decode("utf-8", "backslashreplace")


def _bool(key: str, value: str) -> bool:
    if value not in _ON + _OFF:
        raise InputError(f"plugstack: {key}='{_show(value)}' is not allowed; use on or off")
    return value in _ON


def _abs_path(key: str, value: str) -> Path:
    """valid_abs_path and the PATH_MAX buffer of spank/plugin/config.c."""
    parts = value.split("/")
    if (not value.startswith("/") or value == "/" or any(p in ("", ".", "..") for p in parts[1:])
            or len(_bytes(value)) >= PATH_MAX):
        raise InputError(f"plugstack: {key}='{_show(value)}' must be an absolute path other than /, without "
                         f"empty, '.' or '..' components, shorter than {PATH_MAX} characters")
    return Path(value)


def _days(value: str) -> int:
    """parse_days of spank/plugin/config.c: digits only, 0 to RETAIN_DAYS_MAX."""
    significant = value.lstrip("0")
    if (not value or not all("0" <= c <= "9" for c in value) or len(significant) > len(str(RETAIN_DAYS_MAX))
            or int(significant or "0") > RETAIN_DAYS_MAX):
        raise InputError(f"plugstack: retain='{_show(value)}' is not allowed; use a whole number of days "
                         f"from 0 to {RETAIN_DAYS_MAX}")
    return int(significant or "0")


def _check_printable(number: int, word: str) -> None:
    """The plugin refuses a control character (iscntrl in the C locale) in any argument."""
    for position, byte in enumerate(_bytes(word), 1):
        if byte < 0x20 or byte == 0x7F:
            raise InputError(f"plugstack: argument {number}: control character 0x{byte:02x} at position "
                             f"{position}; only printable characters are allowed")


def _apply(config: PlugstackConfig, key: str, value: str) -> PlugstackConfig:
    """config with one argument's setting (a known key)."""
    if key == "default":
        return dataclasses.replace(config, default_on=_bool(key, value))
    if key == "requeue":
        return dataclasses.replace(config, requeue=_bool(key, value))
    if key == "mode":
        if value not in MODES:
            raise InputError(f"plugstack: mode='{_show(value)}' is not allowed; use detect or mitigate")
        return dataclasses.replace(config, mode=value)
    if key == "retain":
        return dataclasses.replace(config, retain_days=_days(value))
    path = _abs_path(key, value)
    if key == "prefix":
        return dataclasses.replace(config, prefix=path)
    if key == "rundir":
        return dataclasses.replace(config, rundir=path)
    return dataclasses.replace(config, python=path)


def parse_plugstack_args(args: list[str]) -> PlugstackConfig:
    """The settings the plugin makes of its plugstack arguments (gh_config_parse): each
    argument checked in turn, the first bad one refused, a repeated key's last value kept.

    Raises:
        InputError: an argument the plugin refuses (it then turns greyhound off).
    """
    config = PlugstackConfig()
    for number, word in enumerate(args, 1):
        _check_printable(number, word)
        key, eq, value = word.partition("=")
        if not eq or key not in KEYS:
            raise InputError(f"plugstack: unknown argument '{_show(word)}'; allowed: {ALLOWED}")
        config = _apply(config, key, value)
    return config


def plugstack_words(line: str) -> list[str]:
    """The words Slurm makes of one plugstack line (without its \\n): cut at a NUL (C
    strings) and at the first ``#``, split on blanks, tabs and newlines, no quoting."""
    return [w for w in _SEPARATORS.split(line.split("\0", 1)[0].split("#", 1)[0]) if w]


def parse_plugstack_line(line: str) -> PlugstackConfig | None:
    """The settings on one plugstack line (without its \\n); None when the line is not
    greyhound's.

    Raises:
        InputError: greyhound's line with an argument the plugin would refuse, or longer
            than Slurm reads at once (PATH_MAX - 1 bytes: it takes the rest for another
            line, and the plugin would see the line cut).
    """
    words = plugstack_words(line)
    if len(words) < 2 or words[0] not in ("optional", "required") or words[1].rpartition("/")[2] != PLUGIN_FILE:
        return None
    if len(_bytes(line)) > PATH_MAX - 1:
        raise InputError(f"plugstack: the line is {len(_bytes(line))} bytes long; Slurm reads at most "
                         f"{PATH_MAX - 1} bytes of a line, so the plugin would see it cut")
    return parse_plugstack_args(words[2:])


def read_plugstack(path: Path = PLUGSTACK_ENTRY) -> PlugstackConfig:
    """greyhound's settings from the plugstack file (the defaults when it has no line).
    Lines end at \\n only, as Slurm's fgets reads them; bytes that are not UTF-8 are
    kept (as surrogates), as the plugin keeps them."""
    try:
        lines = path.read_bytes().decode("utf-8", "surrogateescape").split("\n")
    except OSError:
        return PlugstackConfig()
    for line in lines:
        config = parse_plugstack_line(line)
        if config is not None:
            return config
    return PlugstackConfig()
