"""The hardening of spank/Makefile's shared objects holds against a user's CFLAGS and
LDFLAGS: _FORTIFY_SOURCE stays at 2 or more, the stack protector stays on, and the
link keeps full RELRO, BIND_NOW and a non-executable stack."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess

import pytest

from conftest import REPO

SPANK = REPO / "spank"
pytestmark = pytest.mark.skipif(any(shutil.which(t) is None for t in ("gcc", "make", "readelf", "nm")),
                                reason="needs gcc, make and binutils (scripts/setup installs build-essential)")

HOSTILE_LDFLAGS = "-Wl,-z,norelro -Wl,-z,lazy -Wl,-z,execstack"


def compile_command(cflags: str) -> list[str]:
    """The command `make` would compile plugin/config.c with, given CFLAGS."""
    out = subprocess.run(["make", "-n", "-C", str(SPANK), "BUILD=/nonexistent", f"CFLAGS={cflags}",
                          "/nonexistent/plugin/config.o"], capture_output=True, text=True, check=True).stdout
    return next(shlex.split(line) for line in out.splitlines() if line.endswith(" plugin/config.c"))


def fortify_level(cflags: str) -> int:
    """_FORTIFY_SOURCE as the compiler sees it with the Makefile's command (0: undefined)."""
    args = compile_command(cflags)
    out_at = args.index("-o")
    args = [a for i, a in enumerate(args) if a != "-c" and i not in (out_at, out_at + 1)]
    macros = subprocess.run([*args, "-dM", "-E"], cwd=SPANK, capture_output=True, text=True, check=True).stdout
    found = re.search(r"^#define _FORTIFY_SOURCE (\d+)$", macros, re.M)
    return int(found.group(1)) if found else 0


@pytest.mark.parametrize("cflags, level", [
    ("-O2 -g", 2),
    ("-O2 -U_FORTIFY_SOURCE", 2),
    ("-O2 -D_FORTIFY_SOURCE=0", 2),
    ("-O2 -D_FORTIFY_SOURCE=1", 2),
    ("-O2 -D_FORTIFY_SOURCE", 2),
    ("-O2 -D_FORTIFY_SOURCE=3 -U_FORTIFY_SOURCE", 2),  # the last mention counts
    ("-O2 -D_FORTIFY_SOURCE=3", 3),  # a user's higher level is kept
    ("-O2 -Wp,-D_FORTIFY_SOURCE=3", 3),
    ("-O2 -U_FORTIFY_SOURCE -D_FORTIFY_SOURCE=3", 3),
    ("-O2 -fsanitize=undefined", 2),
    ("-O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer", 0),  # `make asan`: ASan checks those calls
])
def test_a_users_cflags_cannot_lower_fortify(cflags, level):
    assert fortify_level(cflags) == level


@pytest.mark.parametrize("cflags, last", [
    ("-O2 -fno-stack-protector", "-fstack-protector-strong"),
    ("-O2 -fstack-protector", "-fstack-protector-strong"),
    ("-O2 -fstack-protector-all", "-fstack-protector-all"),  # stronger: kept
    ("-O2 -fstack-protector-all -fno-stack-protector", "-fstack-protector-strong"),
])
def test_a_users_cflags_cannot_lower_the_stack_protector(cflags, last):
    assert [a for a in compile_command(cflags) if "stack-protector" in a][-1] == last


def build(tmp_path, cflags: str, ldflags: str, target: str):
    subprocess.run(["make", "-s", "-C", str(SPANK), f"BUILD={tmp_path}", f"CFLAGS={cflags}", f"LDFLAGS={ldflags}",
                    str(tmp_path / target)], check=True, capture_output=True)
    return tmp_path / target


def assert_hardened(so) -> None:
    dynamic = subprocess.run(["readelf", "-dW", str(so)], capture_output=True, text=True, check=True).stdout
    segments = subprocess.run(["readelf", "-lW", str(so)], capture_output=True, text=True, check=True).stdout
    symbols = subprocess.run(["nm", "-D", str(so)], capture_output=True, text=True, check=True).stdout.split()
    assert re.search(r"\(FLAGS\)\s.*\bBIND_NOW\b", dynamic), f"{so.name}: no BIND_NOW\n{dynamic}"
    assert re.search(r"^\s*GNU_RELRO\s", segments, re.M), f"{so.name}: no GNU_RELRO\n{segments}"
    stack = re.search(r"^\s*GNU_STACK\s.*\s(R?W?E?)\s+0x\w+$", segments, re.M)
    assert stack and "E" not in stack.group(1), f"{so.name}: executable stack\n{segments}"
    assert any(s.startswith("__stack_chk_fail") for s in symbols), f"{so.name}: no stack protector"
    fortified = [s for s in symbols if re.match(r"__\w+_chk@", s) and not s.startswith("__stack_chk")]
    assert fortified, f"{so.name}: no _FORTIFY_SOURCE checks (__*_chk) among {symbols}"


@pytest.mark.parametrize("cflags", ["-O2 -g -U_FORTIFY_SOURCE -fno-stack-protector", "-O2 -g -D_FORTIFY_SOURCE=0"])
def test_the_plugin_stays_hardened_under_hostile_flags(tmp_path, cflags):
    assert_hardened(build(tmp_path, cflags, HOSTILE_LDFLAGS, "greyhound_spank.so"))


def test_the_hook_stays_hardened_under_hostile_flags(tmp_path):
    assert_hardened(build(tmp_path, "-O2 -g -D_FORTIFY_SOURCE=1 -fno-stack-protector", HOSTILE_LDFLAGS,
                          "libgreyhound_hook.so"))
