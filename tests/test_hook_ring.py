"""Ring overflow, incremental tailing and the reader's defences."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from greyhound.ring import (HEADER_BYTES, HEADER_DTYPE, MAGIC, OP, RECORD_DTYPE, COMM_DTYPE,
                            VERSION, RingError, RingReader, ring_paths)
from hook_support import PYTHON, ROOT, base_env, hook_lib, run

LOOP = str(ROOT / "tests" / "hook_progs" / "mpi_loop.py")


def test_overflow_overwrites_oldest_and_counts_drops(tmp_path):
    proc = run([PYTHON, LOOP, "100"], base_env(tmp_path, hook_lib(), GREYHOUND_RING_RECORDS="16"))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "100\n", "")
    (path,) = ring_paths(tmp_path)
    with RingReader(path) as ring:
        head = ring.head
        assert head == 101                       # CommInit + 100 AllReduce
        assert ring.counters()["drops"] == head - 16
        batch = ring.read()
    assert batch.lost == head - 16
    assert batch.records["seq"].tolist() == list(range(head - 15, head + 1))
    assert set(batch.records["op"].tolist()) == {OP["AllReduce"]}


def test_reader_tails_incrementally_and_read_records_are_not_drops(tmp_path):
    # 10 calls, the reader reads them, then 10 more into a 16-slot ring: the
    # overwritten slots had been read, so nothing counts as dropped.
    proc = subprocess.Popen([PYTHON, LOOP, "20", "0", "10"],
                            env=base_env(tmp_path, hook_lib(), GREYHOUND_RING_RECORDS="16"),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline() == "waiting\n"
        (path,) = ring_paths(tmp_path)
        with RingReader(path) as ring:
            first = ring.read()
            assert first.records["seq"].tolist() == list(range(1, 12))
            assert ring.read().records.size == 0          # nothing new yet
            out, err = proc.communicate("go\n", timeout=60)
            second = ring.read()
            counters = ring.counters()
    finally:
        proc.kill()
    assert (proc.returncode, out, err) == (0, "20\n", "")
    assert second.lost == 0 and counters["drops"] == 0
    assert second.records["seq"].tolist() == list(range(12, 22))


def write_fake_ring(path, capacity=8, head=0):
    """A ring file as the hook lays it out, for the reader's edge cases."""
    records_offset = HEADER_BYTES + 256 * COMM_DTYPE.itemsize
    data = np.zeros(records_offset + capacity * RECORD_DTYPE.itemsize, dtype=np.uint8)
    hdr = np.ndarray((), dtype=HEADER_DTYPE, buffer=data)
    hdr["magic"] = MAGIC
    hdr["version"], hdr["header_bytes"], hdr["record_bytes"] = VERSION, HEADER_BYTES, 64
    hdr["comm_bytes"], hdr["comm_capacity"] = COMM_DTYPE.itemsize, 256
    hdr["capacity"], hdr["records_offset"], hdr["comms_offset"] = capacity, records_offset, HEADER_BYTES
    hdr["head"] = head
    recs = np.ndarray((capacity,), dtype=RECORD_DTYPE, buffer=data, offset=records_offset)
    for i in range(head):
        recs[i % capacity]["seq"] = i + 1
        recs[i % capacity]["op"] = OP["Send"]
    path.write_bytes(data.tobytes())
    return records_offset


def test_unfinished_record_is_waited_for_then_skipped(tmp_path):
    path = tmp_path / "ring.0"
    off = write_fake_ring(path, head=5)
    with open(path, "r+b") as f:                # record 2 is being written (seq = 0)
        f.seek(off + 2 * 64)
        f.write(b"\0" * 8)
    with RingReader(path) as ring:
        first = ring.read()
        assert first.records["seq"].tolist() == [1, 2] and first.lost == 0
        second = ring.read()                    # still unfinished, later ones done: skip
        assert second.records["seq"].tolist() == [4, 5] and second.lost == 1


def test_reader_rejects_what_is_not_a_ring(tmp_path):
    bad = tmp_path / "ring.0"
    bad.write_bytes(b"x" * 4096)
    with pytest.raises(RingError, match="not a greyhound ring"):
        RingReader(bad)
    with pytest.raises(RingError, match="smaller than a ring header"):
        (tmp_path / "ring.1").write_bytes(b"GHRING1\0")
        RingReader(tmp_path / "ring.1")
    with pytest.raises(RingError, match="cannot open"):
        RingReader(tmp_path / "ring.9")
    path = tmp_path / "ring.2"
    write_fake_ring(path)
    with open(path, "r+b") as f:
        f.seek(8)
        f.write((7).to_bytes(4, "little"))
    with pytest.raises(RingError, match="layout version 7"):
        RingReader(path)
    path = tmp_path / "ring.3"
    write_fake_ring(path)
    with open(path, "r+b") as f:
        f.truncate(HEADER_BYTES + 100)
    with pytest.raises(RingError, match="do not fit"):
        RingReader(path)


@pytest.mark.parametrize(("field", "value", "what"), [
    ("comm_capacity", 1 << 31, "communicators"),
    ("comm_capacity", 0xFFFFFFFF, "communicators"),
    ("comms_offset", 1 << 40, "communicators"),
    ("comms_offset", (1 << 64) - 8, "communicators"),
    ("comms_offset", 0, "communicators"),           # on top of the header
    ("comms_offset", HEADER_BYTES + 4, "communicators"),   # misaligned
    ("records_offset", (1 << 64) - 64, "records"),
    ("records_offset", 64, "records"),
])
def test_reader_rejects_a_scribbled_layout_with_a_ring_error(tmp_path, field, value, what):
    # Any process of the user can write into the header; a reader opening the ring
    # then gets a RingError naming the layout, not numpy's TypeError/ValueError.
    path = tmp_path / "ring.0"
    write_fake_ring(path)
    with open(path, "r+b") as f:
        f.seek(HEADER_DTYPE.fields[field][1])
        f.write(value.to_bytes(HEADER_DTYPE.fields[field][0].itemsize, "little"))
    with pytest.raises(RingError, match=f"{what} at offset .* do not fit its"):
        RingReader(path, publish=False)


def test_ring_paths_orders_by_rank(tmp_path):
    for name in ["ring.10", "ring.2", "ring.pid77", "ring.2.4242", "other"]:
        (tmp_path / name).write_text("")
    assert [p.name for p in ring_paths(tmp_path)] == ["ring.2", "ring.2.4242", "ring.10",
                                                     "ring.pid77"]
