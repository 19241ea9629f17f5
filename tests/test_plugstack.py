"""greyhound.plugstack: the admin's line read by the plugin's rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from greyhound.errors import InputError
from greyhound.plugstack import PlugstackConfig, parse_plugstack_line, read_plugstack


def test_the_line_gives_its_settings():
    config = parse_plugstack_line("optional /usr/local/lib/greyhound/greyhound_spank.so default=on "
                                  "mode=mitigate prefix=/opt/gh rundir=/dev/shm/greyhound retain=3 "
                                  "python=/opt/gh/venv/bin/python")
    assert config == PlugstackConfig(rundir=Path("/dev/shm/greyhound"), prefix=Path("/opt/gh"),
                                     default_on=True, mode="mitigate", python=Path("/opt/gh/venv/bin/python"))


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
