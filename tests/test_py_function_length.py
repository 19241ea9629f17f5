"""Every Python function of the packages, the examples and the scripts is under 80
lines, so that each can be read at once: the Python twin of test_c_function_length.py.

A function counts from its `def` line to its last line, as `ast` places them
(decorators excluded, as ctags counts it); nested functions and methods are counted on
their own and inside their parent. The scripts under scripts/ are Python files (a python
shebang) or bash scripts that carry Python in quoted heredocs; a heredoc is found the
way scripts/lint finds it, and its body keeps the script's line numbers.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("greyhound", "postmortem", "examples")
MAX_LINES = 80


def heredoc_bodies(text: str) -> list[str]:
    """The Python of a bash script: each quoted heredoc (<<'TAG') on a line that runs or
    writes Python, the lines above it blanked so that line numbers are the script's."""
    lines = text.split("\n")
    bodies = []
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        tag = re.search(r"<<-?'(\w+)'", line)
        if not tag or line.lstrip().startswith("#") or not re.search(r"py", line[: tag.start()], re.I):
            continue
        start = i
        while i < len(lines) and lines[i] != tag.group(1):
            i += 1
        bodies.append("\n" * start + "\n".join(lines[start:i]) + "\n")
    return bodies


def python_sources(path: Path) -> list[str]:
    """The Python text(s) in a file: the file itself, or its heredocs if it is bash."""
    text = path.read_text(encoding="utf-8")
    first = text.split("\n", 1)[0]
    if path.suffix == ".py" or re.match(r"#!.*python", first):
        return [text]
    if re.match(r"#!.*bash", first):
        return heredoc_bodies(text)
    return []


def function_lengths(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, number of lines) of each function in Python source, 1-based."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno is not None
            out.append((node.name, node.lineno, node.end_lineno - node.lineno + 1))
    return out


def sources() -> list[Path]:
    found = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    return found + [p for p in sorted((ROOT / "scripts").iterdir())
                    if p.is_file() and python_sources(p)]


SOURCES = sources()


def test_function_lengths_count_nested_functions_and_methods():
    src = ("import os\n\n@decorator\ndef f(a,\n      b):\n    def g():\n        return 1\n"
           "    return a + g()\n\nclass C:\n    async def m(self):\n        pass\n")
    assert sorted(function_lengths(src)) == [("f", 4, 5), ("g", 6, 2), ("m", 11, 2)]


def test_heredocs_keep_the_scripts_line_numbers():
    script = ("#!/usr/bin/env bash\nset -e\n\"$py\" - <<'EOF'\ndef f():\n    pass\nEOF\n"
              "cat <<'TXT'\nnot python\nTXT\n# runs python <<'X'\ncat > job.py <<'PYEOF'\n"
              "def g():\n    pass\nPYEOF\n")
    bodies = heredoc_bodies(script)
    assert [function_lengths(b) for b in bodies] == [[("f", 4, 2)], [("g", 12, 2)]]


def test_sources_are_found():
    names = {str(p.relative_to(ROOT)) for p in SOURCES}
    assert {"greyhound/cli.py", "postmortem/analysis.py", "examples/gpt_hybrid.py",
            "scripts/bench_agent", "scripts/bench_detect", "scripts/bench_postmortem"} <= names
    assert "scripts/cluster" not in names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_functions_are_under_80_lines(path):
    lengths = [f for source in python_sources(path) for f in function_lengths(source)]
    long = [f"{path.name}:{first} {name} ({n} lines)" for name, first, n in lengths if n >= MAX_LINES]
    assert not long, f"functions of {MAX_LINES} lines or more: {', '.join(long)}"
