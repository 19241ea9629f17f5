"""What the torch capture and the ring's Python reader mirror of C, checked against C.

tests/test_hook_layout.py checks greyhound/ring.py's dtypes, op codes and flags, and
the capture's op codes and flags, against the compiled spank/hook/gh_ring.h. Here the
rest: the ring's magic, header size and communicator states as ring.py reads them;
the record head the capture packs for gh_py_end_head (struct gh_py_head of
spank/hook/pyhead.h); and the capture's GroupInfo, which spank/capture/fastpath.c
reads by position and refuses to bind to when its fields are not the ones it reads.
"""

from __future__ import annotations

import importlib.util
import re
import struct

import pytest

from greyhound import ring
from greyhound.capture import _greyhound_capture as capture
from greyhound.ring import OP, RingReader, ring_paths
from hook_support import HOOK_DIR, PYTHON, ROOT, _cc, base_env, build_dir, free_port, hook_lib, run

CAPTURE = ROOT / "greyhound" / "capture"
FASTPATH = ROOT / "spank" / "build" / "python" / "_greyhound_fastpath.abi3.so"

# struct gh_py_head's fields, in the order the capture packs them.
HEAD_FIELDS = ("op", "flags", "peer", "reserved", "comm_id", "size_bytes", "req_id")

LAYOUT_C = r"""
#include <stddef.h>
#include <stdio.h>
#include "gh_ring.h"
#include "pyhead.h"
#define HEAD_FIELD(f) printf("head %s %zu %zu %d\n", #f, offsetof(struct gh_py_head, f), \
    sizeof(((struct gh_py_head *)0)->f), (__typeof__(((struct gh_py_head *)0)->f))-1 < 0)
int main(void) {
    HEAD_FIELDS
    printf("head_size %zu\n", sizeof(struct gh_py_head));
    printf("magic %s\n", GH_RING_MAGIC);
    printf("header_bytes %u\n", GH_RING_HEADER_BYTES);
    printf("comm_states %u %u %u\n", GH_COMM_EMPTY, GH_COMM_LIVE, GH_COMM_DESTROYED);
    printf("hook_tsc %u\n", GH_HOOK_TSC);
    return 0;
}
"""


@pytest.fixture(scope="module")
def c_values() -> dict[str, list[str]]:
    src = build_dir() / "capture_layout.c"
    src.write_text(LAYOUT_C.replace("HEAD_FIELDS", " ".join(f"HEAD_FIELD({f});"
                                                         for f in HEAD_FIELDS)))
    exe = build_dir() / "capture_layout"
    _cc(["-std=gnu11", "-Wall", "-Werror", f"-I{HOOK_DIR}", "-o", str(exe), str(src)])
    values: dict[str, list[str]] = {}
    for line in run([str(exe)], env={}).stdout.splitlines():
        key, *rest = line.split()
        values[f"head {rest.pop(0)}" if key == "head" else key] = rest
    return values


def test_the_capture_packs_the_head_the_hook_reads(c_values):
    # (offset, size, signed) of each field, in the order _HEAD packs them.
    packed, offset = [], 0
    for code in capture._HEAD.format.lstrip("<"):
        size = struct.calcsize("<" + code)
        packed.append((offset, size, code.islower()))
        offset += size
    in_c = [tuple(int(v) for v in c_values[f"head {f}"]) for f in HEAD_FIELDS]
    assert [(o, s, bool(signed)) for o, s, signed in in_c] == packed
    assert int(c_values["head_size"][0]) == capture._HEAD.size == 40


def test_ring_constants_the_reader_mirrors(c_values):
    assert ring.MAGIC == c_values["magic"][0].encode() + b"\0"
    assert ring.HEADER_BYTES == int(c_values["header_bytes"][0]) == ring.HEADER_DTYPE.itemsize
    assert [ring.COMM_EMPTY, ring.COMM_LIVE, ring.COMM_DESTROYED] == [
        int(v) for v in c_values["comm_states"]]
    assert ring.HOOK_TSC == int(c_values["hook_tsc"][0])


@pytest.fixture(scope="module")
def fastpath():
    # scripts/setup builds the fast path (make -C spank): a missing one is a failure.
    assert FASTPATH.is_file(), f"{FASTPATH} is not built (make -C spank)"
    spec = importlib.util.spec_from_file_location("_greyhound_fastpath", FASTPATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("fields", [
    ("size", "comm_id", "rank", "skip_all", "skip_cuda", "heads"),        # reordered
    ("comm_id", "size", "rank", "skip_all", "skip_cuda"),                 # one fewer
    (*capture.GroupInfo._fields, "backend"),                              # one more
    ("comm_id", "size", "rank", "skip_all", "skip_cuda", "record_heads"),  # renamed
    ["comm_id", "size", "rank", "skip_all", "skip_cuda", "heads"],        # not a tuple
])
def test_the_fast_path_refuses_a_group_info_it_does_not_read(fastpath, fields):
    want = (f"the capture's GroupInfo fields are {fields!r}, but this fast path reads "
            f"{capture.GroupInfo._fields!r}: rebuild it with the capture it is installed with")
    with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
        fastpath.bind(1, 1, fields)   # refused before the addresses are taken


RENAMED_FIELDS = """
import sys, _greyhound_capture as cap    # before torch, which imports torch.distributed

class Renamed(cap.GroupInfo):     # the same tuple, with a field named otherwise
    _fields = ("comm_id", "size", "rank", "skip_all", "skip_cuda", "record_heads")

cap.GroupInfo = Renamed
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0,
                        world_size=1)
t = torch.ones(3)
for _ in range(3):
    dist.all_reduce(t)
print(type(dist.all_reduce).__name__, t.tolist(), flush=True)
import os; os._exit(0)
"""


def test_a_refused_fast_path_leaves_the_python_wrapper_recording(tmp_path):
    assert FASTPATH.is_file(), f"{FASTPATH} is not built (make -C spank)"
    proc = run([PYTHON, "-c", RENAMED_FIELDS, str(free_port())],
               base_env(tmp_path, hook_lib(), PYTHONPATH=str(CAPTURE)))
    fields = ("comm_id", "size", "rank", "skip_all", "skip_cuda")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "function [1.0, 1.0, 1.0]\n", (
        "greyhound: capture: cannot load the C fast path: ValueError: the capture's GroupInfo "
        f"fields are {(*fields, 'record_heads')!r}, but this fast path reads "
        f"{(*fields, 'heads')!r}: rebuild it with the capture it is installed with; "
        "the Python wrapper records alone\n"))
    (path,) = ring_paths(tmp_path)
    with RingReader(path) as reader:
        recs = reader.read().records
    recs = recs[recs["op"] != OP["CommInit"]]
    assert recs["op"].tolist() == [OP["AllReduce"]] * 3
    assert recs["size_bytes"].tolist() == [12] * 3
