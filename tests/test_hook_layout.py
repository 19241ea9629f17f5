"""The Python mirrors of spank/hook/gh_ring.h agree with the compiled C header."""

from __future__ import annotations

import re

import pytest

from greyhound import ring
from greyhound.capture import _greyhound_capture as capture
from hook_support import HOOK_DIR, _cc, build_dir, run

STRUCTS = {"gh_record": ring.RECORD_DTYPE, "gh_comm_entry": ring.COMM_DTYPE,
           "gh_ring_header": ring.HEADER_DTYPE}


@pytest.fixture(scope="module")
def c_layout() -> dict[str, str]:
    lines = ['#include <stddef.h>', '#include <stdio.h>', '#include "hook.h"', "int main(void) {"]
    for struct, dtype in STRUCTS.items():
        lines.append(f'printf("{struct} sizeof %zu\\n", sizeof(struct {struct}));')
        for name in dtype.names:
            lines.append(f'printf("{struct} {name} %zu %zu\\n", offsetof(struct {struct}, {name}), '
                         f'sizeof(((struct {struct} *)0)->{name}));')
    header = (HOOK_DIR / "gh_ring.h").read_text()
    consts = re.findall(r"\b(GH_OP_[A-Z_]+|GH_F_[A-Z_]+|GH_HOOK_[A-Z_]+|GH_SRC_[A-Z]+|"
                        r"GH_BENCH_[A-Z_]+|GH_RING_VERSION)\b", header)
    for c in sorted(set(consts)):
        lines.append(f'printf("const {c} %llu\\n", (unsigned long long){c});')
    lines.append('printf("fnv %llu\\n", (unsigned long long)gh_fnv1a_i32(gh_fnv1a_i32('
                 'gh_fnv1a_i32(GH_FNV_OFFSET, 0), 1), 0));')
    lines.append('printf("fnv_neg %llu\\n", (unsigned long long)gh_fnv1a_i32(GH_FNV_OFFSET, -3));')
    lines.append("return 0; }")
    src = build_dir() / "layout.c"
    src.write_text("\n".join(lines))
    exe = build_dir() / "layout"
    _cc(["-std=gnu11", f"-I{HOOK_DIR}", "-o", str(exe), str(src)])
    out = run([str(exe)], env={}).stdout
    parsed: dict = {}
    for line in out.splitlines():
        parts = line.split()
        if parts[0] == "const":
            parsed[f"const {parts[1]}"] = parts[2]
        elif parts[0].startswith("fnv"):
            parsed[parts[0]] = parts[1]
        elif parts[1] == "sizeof":
            parsed[f"{parts[0]} sizeof"] = parts[2]
        else:                                   # struct field offset size
            parsed[f"{parts[0]} {parts[1]}"] = parts[2:4]
    return parsed


@pytest.mark.parametrize("struct", list(STRUCTS))
def test_struct_layout(c_layout, struct):
    dtype = STRUCTS[struct]
    assert int(c_layout[f"{struct} sizeof"]) == dtype.itemsize
    for name in dtype.names:
        offset, size = (int(x) for x in c_layout[f"{struct} {name}"])
        field, py_offset = dtype.fields[name][:2]
        assert (py_offset, field.itemsize) == (offset, size), name


def test_op_codes_and_flags(c_layout):
    consts = {k.split()[1]: int(v) for k, v in c_layout.items() if k.startswith("const ")}
    ops = {k[len("GH_OP_"):]: v for k, v in consts.items()
           if k.startswith("GH_OP_") and k != "GH_OP_COUNT"}
    assert consts["GH_OP_COUNT"] == len(ring.OP_NAMES)
    for cname, code in ops.items():
        assert ring.OP_NAMES[code].upper().replace("_", "") == cname.replace("_", ""), cname
    for cname, value in consts.items():
        if cname.startswith("GH_F_"):
            assert getattr(ring, cname[3:]) == value, cname
    assert consts["GH_HOOK_TRACE"] == ring.HOOK_TRACE
    assert {v: k[len("GH_SRC_"):].lower() for k, v in consts.items()
            if k.startswith("GH_SRC_")} == ring.SOURCE_NAMES
    for name in ("ALLREDUCE", "REDUCESCATTER", "ALLGATHER", "BROADCAST", "REDUCE", "SEND",
                 "RECV", "BARRIER", "WAIT", "GROUP"):
        assert getattr(capture, f"OP_{name}") == ops[name]
    assert (capture.F_ASYNC, capture.F_GROUPED, capture.F_ERROR) == (
        ring.F_ASYNC, ring.F_GROUPED, ring.F_ERROR)


def test_version_and_benchmark_constants(c_layout):
    consts = {k.split()[1]: int(v) for k, v in c_layout.items() if k.startswith("const ")}
    assert consts["GH_RING_VERSION"] == ring.VERSION
    bench = {k[len("GH_BENCH_"):]: v for k, v in consts.items() if k.startswith("GH_BENCH_")}
    assert (bench.pop("MIN_N"), bench.pop("MAX_N")) == (ring.BENCH_MIN_N, ring.BENCH_MAX_N)
    assert bench == {name: getattr(ring, f"BENCH_{name}") for name in bench}
    assert set(bench.values()) == set(ring.BENCH_STATUS_NAMES)


def test_fnv_matches_the_c_hook(c_layout):
    assert int(c_layout["fnv"]) == capture.fnv1a_i32(capture.FNV_OFFSET, [0, 1, 0])
    assert int(c_layout["fnv_neg"]) == capture.fnv1a_i32(capture.FNV_OFFSET, [-3])
