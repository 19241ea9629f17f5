"""Every C function of the project is under 80 lines, so that each can be read at once
(issue 11): the SPANK plugin, the hook and the capture's fast path (spank/), the
compiled BOCD+V kernel (greyhound/analytics/_bocdv.c) and the tests' own C programs
(tests/: unit tests, doubles, fuzz targets), which a reader has to follow as much as
the code they test.

The C files are in kernel style (CPython's for _bocdv.c, which puts the return type on a
line of its own): a function's body opens with a `{` alone at column 0 and closes with a
`}` alone at column 0, and its signature starts at the last line above that `{` that
starts at column 0 (continuation lines are indented). A function counts from that line
to its closing brace, as ctags counts it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([
    *(ROOT / "spank").glob("*/*.c"),
    ROOT / "greyhound" / "analytics" / "_bocdv.c",
    *(ROOT / "tests").glob("**/*.c"),
])
MAX_LINES = 80


def function_lengths(text: str) -> list[tuple[int, int]]:
    """(first line, number of lines) of each function in C source text, 1-based."""
    lines = text.splitlines()
    out = []
    start = None
    for i, line in enumerate(lines):
        if line == "{":
            start = next(j for j in range(i - 1, -1, -1) if lines[j][:1] not in ("", " ", "\t"))
        elif line == "}" and start is not None:
            out.append((start + 1, i - start + 1))
            start = None
    return out


def test_function_lengths_are_counted_from_signature_to_closing_brace():
    src = ("/* a comment */\nstatic int f(int a,\n\t     int b)\n{\n\treturn a + b;\n}\n\n"
           "struct s {\n\tint x;\n};\n\nint g(void)\n{\n\tif (1) {\n\t}\n\treturn 0;\n}\n")
    assert function_lengths(src) == [(2, 5), (12, 6)]


def test_sources_are_found():
    names = {p.name for p in SOURCES}
    assert {"mpi.c", "nccl.c", "core.c", "dispatch.c", "fastpath.c", "_bocdv.c",
            "test_plugin_config.c", "nccl_prog.c"} <= names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_c_functions_are_under_80_lines(path):
    text = path.read_text()
    lengths = function_lengths(text)
    # Every body found, opened and closed: the style the counting relies on holds.
    assert len(lengths) == sum(1 for line in text.splitlines() if line == "{")
    long = [f"{path.name}:{first} ({n} lines)" for first, n in lengths if n >= MAX_LINES]
    assert not long, f"functions of {MAX_LINES} lines or more: {', '.join(long)}"
