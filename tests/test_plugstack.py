"""greyhound.plugstack: the admin's line read by the plugin's rules."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from greyhound.errors import InputError
from greyhound.plugstack import (
    ALLOWED,
    PATH_MAX,
    RETAIN_DAYS_DEFAULT,
    RETAIN_DAYS_MAX,
    PlugstackConfig,
    parse_plugstack_args,
    parse_plugstack_line,
    read_plugstack,
)


def test_the_line_gives_its_settings():
    config = parse_plugstack_line("optional /usr/local/lib/greyhound/greyhound_spank.so default=on "
                                  "mode=mitigate prefix=/opt/gh rundir=/dev/shm/greyhound retain=3 "
                                  "python=/opt/gh/venv/bin/python")
    assert config == PlugstackConfig(rundir=Path("/dev/shm/greyhound"), prefix=Path("/opt/gh"), default_on=True,
                                     mode="mitigate", python=Path("/opt/gh/venv/bin/python"), retain_days=3)


def test_without_python_there_is_no_control_plane():
    assert parse_plugstack_line("optional /x/greyhound_spank.so rundir=/r").python is None


def test_other_plugins_and_comments_are_not_greyhounds():
    assert parse_plugstack_line("required /usr/lib/pyxis/spank_pyxis.so") is None
    assert parse_plugstack_line("# optional greyhound_spank.so rundir=/x") is None


@pytest.mark.parametrize("value, expected", [(None, True), ("on", True), ("yes", True), ("off", False), ("0", False)])
def test_requeue_is_on_unless_the_admin_turns_it_off(value, expected):
    line = "optional /x/greyhound_spank.so rundir=/r" + (f" requeue={value}" if value else "")
    assert parse_plugstack_line(line).requeue is expected


@pytest.mark.parametrize("word", ["requeue=x", "requeue="])
def test_a_bad_requeue_is_refused_in_one_line(word):
    with pytest.raises(InputError, match=r"^plugstack: requeue='x?' is not allowed; use on or off$"):
        parse_plugstack_line(f"optional /x/greyhound_spank.so {word}")


@pytest.mark.parametrize("word", ["rundir", "colour=red", "rundir=relative/path", "python=python3"])
def test_an_argument_the_plugin_refuses_is_refused(word):
    with pytest.raises(InputError, match="plugstack: "):
        parse_plugstack_line(f"optional /x/greyhound_spank.so {word}")


def test_a_missing_file_gives_the_defaults(tmp_path):
    assert read_plugstack(tmp_path / "none.conf") == PlugstackConfig()
    (tmp_path / "g.conf").write_text("# c\noptional /x/greyhound_spank.so rundir=/r\n")
    assert read_plugstack(tmp_path / "g.conf").rundir == Path("/r")


# --- the plugin's rules: one table, run through this reader and through the plugin's
# own parser (spank/plugin/config.c, behind Slurm's line reading in tests/c/plugstack_lines.c)

P = "optional /usr/lib/greyhound/greyhound_spank.so"
ABS_PATH = "must be an absolute path other than /, without empty, '.' or '..' components, shorter than 4096 characters"
LINES: list[tuple[str, dict | str | None]] = [
    # accepted: the settings that differ from the defaults
    (P, {}),
    (f"{P} default=on mode=mitigate prefix=/opt/gh rundir=/dev/shm/greyhound retain=3 "
     "python=/opt/gh/venv/bin/python requeue=off",
     {"default_on": True, "mode": "mitigate", "prefix": Path("/opt/gh"), "rundir": Path("/dev/shm/greyhound"),
      "retain_days": 3, "python": Path("/opt/gh/venv/bin/python"), "requeue": False}),
    ("required greyhound_spank.so default=yes", {"default_on": True}),  # found in PluginDir
    (f"  {P}\t default=1 \t  rundir=/r  ", {"default_on": True, "rundir": Path("/r")}),
    (f"{P} rundir=/a rundir=/b", {"rundir": Path("/b")}),  # the last one counts
    (f"{P} rundir=/r#mode=bogus", {"rundir": Path("/r")}),  # '#' starts a comment anywhere
    (f"{P} rundir=/r # retain=-1", {"rundir": Path("/r")}),
    (f"{P} rundir=/r\0 mode=bogus", {"rundir": Path("/r")}),  # Slurm's C strings end at a NUL
    (f"{P} retain=0", {"retain_days": 0}),
    (f"{P} retain=3650", {"retain_days": 3650}),
    (f"{P} retain=007", {"retain_days": 7}),
    (f"{P} retain={'0' * 4000}7", {"retain_days": 7}),  # as many leading zeros as a line holds
    (f"{P} retain={'0' * 4000}", {"retain_days": 0}),
    (f"{P} rundir=/a\\b prefix=/x/.hidden/..y/y.. python=/ü/python",
     {"rundir": Path("/a\\b"), "prefix": Path("/x/.hidden/..y/y.."), "python": Path("/ü/python")}),
    (f"{P} requeue=no default=false", {"requeue": False}),
    # not greyhound's line
    ("", None),
    ("   # optional /x/greyhound_spank.so rundir=relative", None),
    ("required /usr/lib/pyxis/spank_pyxis.so rundir=relative", None),
    ("include /etc/slurm/plugstack.conf.d/*.conf", None),
    ("Optional /x/greyhound_spank.so rundir=relative", None),
    ("optional /x/not_greyhound_spank.so rundir=relative", None),
    ("optional /x/greyhound_spank.so.bak rundir=relative", None),
    ("optional", None),
    # refused paths
    (f"{P} rundir=/", f"rundir='/' {ABS_PATH}"),
    (f"{P} rundir=", f"rundir='' {ABS_PATH}"),
    (f"{P} prefix=", f"prefix='' {ABS_PATH}"),
    (f"{P} python=", f"python='' {ABS_PATH}"),
    (f"{P} rundir=//", f"rundir='//' {ABS_PATH}"),
    (f"{P} rundir=/a/./b", f"rundir='/a/./b' {ABS_PATH}"),
    (f"{P} rundir=/a/../b", f"rundir='/a/../b' {ABS_PATH}"),
    (f"{P} rundir=/a/.", f"rundir='/a/.' {ABS_PATH}"),
    (f"{P} prefix=/a/..", f"prefix='/a/..' {ABS_PATH}"),
    (f"{P} rundir=/..", f"rundir='/..' {ABS_PATH}"),
    (f"{P} rundir=/a//b", f"rundir='/a//b' {ABS_PATH}"),
    (f"{P} rundir=//a", f"rundir='//a' {ABS_PATH}"),
    (f"{P} rundir=/a/", f"rundir='/a/' {ABS_PATH}"),
    (f"{P} rundir=relative", f"rundir='relative' {ABS_PATH}"),
    (f"{P} python=python3", f"python='python3' {ABS_PATH}"),
    (f"{P} rundir=~/gh", f"rundir='~/gh' {ABS_PATH}"),
    (f"{P} rundir=relative rundir=/ok", f"rundir='relative' {ABS_PATH}"),  # the first bad one is refused
    # refused values
    (f"{P} default=maybe", "default='maybe' is not allowed; use on or off"),
    (f"{P} default=", "default='' is not allowed; use on or off"),
    (f"{P} default=ON", "default='ON' is not allowed; use on or off"),
    (f"{P} mode=maybe", "mode='maybe' is not allowed; use detect or mitigate"),
    (f"{P} mode=", "mode='' is not allowed; use detect or mitigate"),
    (f"{P} mode=Detect", "mode='Detect' is not allowed; use detect or mitigate"),
    (f"{P} requeue=x", "requeue='x' is not allowed; use on or off"),
    *((f"{P} retain={v}", f"retain='{v}' is not allowed; use a whole number of days from 0 to 3650")
      for v in ("-1", "+7", "7d", "", "3651", "1e3", "0x10", "99999999999", "٣", "1" * 4000)),
    # refused control characters (Slurm splits on blanks, tabs and newlines only)
    (f"{P} rundir=/r\r", "argument 1: control character 0x0d at position 10; only printable characters are allowed"),
    (f"{P} mode=detect rundir=/a\vb", "argument 2: control character 0x0b at position 10;"),
    (f"{P} rundir=/a\fb", "argument 1: control character 0x0c at position 10;"),
    (f"{P} rundir=/ü\x01", "argument 1: control character 0x01 at position 11;"),  # bytes, as the plugin counts
    (f"{P} rundir=/a\x7f", "argument 1: control character 0x7f at position 10;"),
    (f"{P} default=off\x1bmode", "argument 1: control character 0x1b at position 12;"),
    # quoting and escapes that Slurm does not undo
    (f'{P} rundir="/a b"', f"rundir='\"/a' {ABS_PATH}"),
    (f"{P} rundir='/x'", f"rundir=''/x'' {ABS_PATH}"),
    (f'{P} "rundir=/x"', "unknown argument '\"rundir=/x\"'; allowed: default=on|off, mode=detect|mitigate, "
                         "prefix=DIR, rundir=DIR, retain=DAYS, python=PATH, requeue=on|off"),
    (f"{P} rundir=/a\\ b", "unknown argument 'b'; allowed: "),
    # unknown keys and words
    (f"{P} colour=red", "unknown argument 'colour=red'; allowed: "),
    (f"{P} rundir", "unknown argument 'rundir'; allowed: "),
    (f"{P} =x", "unknown argument '=x'; allowed: "),
    (f"{P} Rundir=/x", "unknown argument 'Rundir=/x'; allowed: "),
    (f"{P} report=/x", "unknown argument 'report=/x'; allowed: "),  # a --greyhound item, not the admin's
    (f"{P} trace=on", "unknown argument 'trace=on'; allowed: "),
]
LONG_PATH = "/" + "a" * 4094  # 4095 characters: the longest the plugin keeps
ARGS: list[tuple[list[str], dict | str]] = [
    ([f"rundir={LONG_PATH}"], {"rundir": Path(LONG_PATH)}),
    ([f"rundir={LONG_PATH}a"], f"rundir='{LONG_PATH}a' {ABS_PATH}"),
    ([f"python=/{'é' * 2048}"], f"python='/{'é' * 2048}' {ABS_PATH}"),  # 4097 bytes
    ([f"prefix=/{'b' * 9000}"], f"prefix='/{'b' * 9000}' {ABS_PATH}"),
]


@pytest.mark.parametrize("line, expected", LINES, ids=[repr(line[len(P):] if line.startswith(P) else line)[:60]
                                                       for line, _ in LINES])
def test_a_line_is_read_by_the_plugins_rules(line, expected):
    if isinstance(expected, str):
        with pytest.raises(InputError, match="^" + re.escape(f"plugstack: {expected}")):
            parse_plugstack_line(line)
    else:
        config = parse_plugstack_line(line)
        assert config == (None if expected is None else PlugstackConfig(**expected))


@pytest.mark.parametrize("args, expected", ARGS, ids=["4095", "4096", "4097-bytes", "9001"])
def test_paths_are_kept_below_path_max(args, expected):
    if isinstance(expected, str):
        with pytest.raises(InputError, match="^" + re.escape(f"plugstack: {expected}") + "$"):
            parse_plugstack_args(args)
    else:
        assert parse_plugstack_args(args) == PlugstackConfig(**expected)


def test_a_line_longer_than_slurm_reads_is_refused():
    line = f"{P} rundir=/{'a' * 4100}"
    with pytest.raises(InputError, match=r"^plugstack: the line is 4155 bytes long; Slurm reads at most 4095 bytes"):
        parse_plugstack_line(line)
    fits = f"{P} rundir=/{'a' * (4095 - len(P) - 9)}"
    assert len(fits) == 4095 and parse_plugstack_line(fits).rundir == Path(fits.split("=")[1])


def test_a_file_is_split_at_newlines_only(tmp_path):
    # \r is not a line end for Slurm: a CRLF file gives the plugin a control character.
    (tmp_path / "crlf.conf").write_bytes(f"{P} rundir=/r\r\n".encode())
    with pytest.raises(InputError, match="control character 0x0d"):
        read_plugstack(tmp_path / "crlf.conf")
    (tmp_path / "latin1.conf").write_bytes(f"{P} rundir=/r\xe9".encode("latin-1"))
    assert read_plugstack(tmp_path / "latin1.conf").rundir == Path(os.fsdecode(b"/r\xe9"))
    (tmp_path / "vt.conf").write_bytes(f"# note\v{P} rundir=/r\n".encode())
    assert read_plugstack(tmp_path / "vt.conf") == PlugstackConfig()  # one comment line, not two lines


def test_the_limits_are_the_plugins():
    header = (REPO / "spank/plugin/greyhound.h").read_text()
    for name, value in (("GH_RETAIN_DAYS_DEFAULT", RETAIN_DAYS_DEFAULT), ("GH_RETAIN_DAYS_MAX", RETAIN_DAYS_MAX)):
        assert re.search(rf"^#define {name} {value}\b", header, re.M), name
    assert PATH_MAX == os.pathconf("/", "PC_PATH_MAX")
    macro = (REPO / "spank/plugin/config.c").read_text().split("#define CONFIG_KEYS_ALLOWED", 1)[1].split("\n\n")[0]
    assert "".join(re.findall(r'"([^"]*)"', macro)) == ALLOWED


def _as_plugin_says(config: PlugstackConfig | None) -> str:
    """A config as tests/c/plugstack_lines.c prints it."""
    if config is None:
        return "none"
    return (f"ok default={int(config.default_on)} mode={config.mode} prefix={config.prefix} rundir={config.rundir} "
            f"retain={config.retain_days} python={config.python or ''} requeue={int(config.requeue)}")


def _reader_says(parse, arg) -> str:
    try:
        return _as_plugin_says(parse(arg))
    except InputError as exc:
        # The plugin's message buffer is GH_ERR_LEN (512) bytes with its NUL.
        cause = str(exc).removeprefix("plugstack: ").encode("utf-8", "surrogateescape")[:511]
        return "error: " + cause.decode("utf-8", "surrogateescape")


@pytest.fixture(scope="module")
def plugin_parser(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc (scripts/setup installs build-essential)")
    binary = tmp_path_factory.mktemp("plugstack") / "plugstack_lines"
    subprocess.run(["gcc", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-std=gnu11", "-fsanitize=address,undefined",
                    "-fno-sanitize-recover=all", f"-I{REPO}/spank/plugin", "-o", str(binary),
                    str(REPO / "tests/c/plugstack_lines.c"), str(REPO / "spank/plugin/config.c")],
                   check=True, capture_output=True, text=True)
    return binary


def _run(binary, *args: str) -> list[str]:
    proc = subprocess.run([str(binary), *args], capture_output=True, check=True, timeout=60)
    return proc.stdout.decode("utf-8", "surrogateescape").splitlines()


def test_the_plugin_reads_every_line_alike(plugin_parser, tmp_path):
    conf = tmp_path / "plugstack.conf"
    conf.write_bytes("\n".join(line for line, _ in LINES).encode() + b"\n")
    plugin = _run(plugin_parser, str(conf))
    assert len(plugin) == len(LINES)
    for (line, _), said in zip(LINES, plugin, strict=True):
        assert _reader_says(parse_plugstack_line, line) == said, repr(line)


def test_the_plugin_reads_every_argument_alike(plugin_parser):
    for args, _ in ARGS:
        assert [_reader_says(parse_plugstack_args, args)] == _run(plugin_parser, "--args", *args), args[0][:20]


def test_the_plugin_would_see_a_long_line_cut(plugin_parser, tmp_path):
    # Why a line over 4095 bytes is refused: Slurm reads it in pieces, the plugin gets
    # the first piece's arguments (here a shorter rundir than written) and the rest
    # is a line of its own.
    conf = tmp_path / "plugstack.conf"
    conf.write_text(f"{P} rundir=/{'a' * 4100} default=on\n")
    first, *rest = _run(plugin_parser, str(conf))
    assert first == f"ok default=0 mode=detect prefix=/usr/local rundir=/{'a' * (4095 - len(P) - 9)} retain=7 " \
                    "python= requeue=1"
    assert rest == ["none"]
