"""Async torch.distributed handles under the capture are torch's own Work.

tests/hook_progs/torch_work.py hands an async all_reduce's handle to C++ (torch's
work registry, which takes only a c10d::Work), chains its future, waits with a
timeout, uses isend/irecv and batch_isend_irecv, and lets one wait fail; it runs
once plainly and once with the capture. The program must see the same things both
times, and each wait called from Python must still write a Wait record naming its
call.
"""

from __future__ import annotations

import pytest

from greyhound.capture import _greyhound_capture as cap
from greyhound.ring import F_ASYNC, F_ERROR, F_GROUPED, OP, RingReader, op_names
from hook_support import PYTHON, ROOT, base_env, free_port, hook_lib, run, run_torch_pair

torch = pytest.importorskip("torch")
PROG = str(ROOT / "tests" / "hook_progs" / "torch_work.py")
CAPTURE = ROOT / "greyhound" / "capture"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    env = base_env(run_dir, hook_lib(), PYTHONPATH=str(CAPTURE))
    with_capture, outs = run_torch_pair(PROG, tmp_path_factory.mktemp("out"), env)
    plain, _ = run_torch_pair(PROG, tmp_path_factory.mktemp("out"), base_env(None))
    return run_dir, with_capture, plain, outs


def test_handles_are_torch_work(pair):
    _, with_capture, _, outs = pair
    for rank in (0, 1):
        seen = with_capture[rank]
        assert seen["all_reduce"] == seen["p2p"] == [True, "Work"]
        assert seen["batch"] == [[True, "Work"]] * 2
    assert all("greyhound" not in out + err for out, err in outs)


def test_cpp_consumers_futures_and_errors_as_without_capture(pair):
    _, with_capture, plain, _ = pair
    assert with_capture == plain
    seen = with_capture[0]
    assert seen["register_work"] == [1.0, 3.0, 5.0, 7.0]   # waited on in C++
    assert seen["wait"] is True and seen["wait_timeout"] is True
    assert seen["future"] == [True, "Future"]
    assert seen["future_value"] == [[3.0, 3.0, 3.0]] and seen["future_then"] == [6.0] * 3
    assert with_capture[1]["p2p_value"] == [0, 1, 2]
    assert seen["failed_wait"] == ["RuntimeError",
                                   "Timed out waiting 300ms for recv operation to complete"]


EXPECTED = [  # (op, bytes, flags) of rank 0; rank 1 receives the 12, has no last two
    ("AllReduce", 16, F_ASYNC),
    ("Wait", 0, 0),
    ("AllReduce", 24, F_ASYNC),
    ("Wait", 0, 0),
    ("Send", 12, F_ASYNC),
    ("Wait", 0, 0),
    ("Send", 20, F_ASYNC | F_GROUPED),
    ("Recv", 20, F_ASYNC | F_GROUPED),
    ("Group", 2, 0),
    ("Wait", 0, 0),
    ("Wait", 0, 0),
    ("Recv", 8, F_ASYNC),
    ("Wait", 0, F_ERROR),     # the wait raised: the program got torch's exception
]


@pytest.mark.parametrize("rank", [0, 1])
def test_each_wait_names_its_call(pair, rank):
    run_dir = pair[0]
    with RingReader(run_dir / f"ring.{rank}") as ring:
        recs = ring.read().records
    recs = recs[recs["op"] != OP["CommInit"]]
    want = EXPECTED if rank == 0 else [*EXPECTED[:4], ("Recv", 12, F_ASYNC), *EXPECTED[5:-2]]
    assert list(zip(op_names(recs), recs["size_bytes"].tolist(), recs["flags"].tolist(),
                    strict=True)) == want
    req = recs["req_id"].tolist()
    assert req[0] == req[1] != 0 and req[2] == req[3] != 0 and req[4] == req[5] != 0
    assert req[9:11] == req[6:8] and len(set(req[:8])) == 5
    if rank == 0:
        assert req[11] == req[12] and req[11] not in req[:11]


UNWAITED = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0,
                        world_size=1)
t = torch.ones(2)
for _ in range(3 * 4096):       # only their futures are waited on, as DDP comm hooks do
    dist.all_reduce(t, async_op=True).get_future().wait()
cap = sys.modules["_greyhound_capture"]
print(len(cap.HOOK.waits.reqs) <= 4096, dist.Work.wait.__name__, t.tolist(), flush=True)
import os; os._exit(0)
"""


def test_works_only_their_futures_wait_on_are_not_kept(tmp_path):
    # (Here a new work mostly takes a dead one's id, which replaces its entry;
    # test_dead_works_are_swept checks the sweep for the works that do not.)
    proc = run([PYTHON, "-c", UNWAITED, str(free_port())],
               base_env(tmp_path, hook_lib(), PYTHONPATH=str(CAPTURE)))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "True wait [1.0, 1.0]\n", "")


# _WaitRecorder on its own, with a stand-in for the hook: what its patched wait writes.

class StubHook:
    """gh_py_begin / gh_py_end_head / gh_py_record, keeping what they were given."""

    def __init__(self) -> None:
        self.heads: list[tuple] = []
        self.busy = False

    def begin(self) -> int:
        if self.busy:
            return 0              # inside another captured call, as the hook says
        self.busy = True
        return 2

    def end_head(self, head) -> None:
        self.busy = False
        self.heads.append(cap._HEAD.unpack(head))

    def record(self, op, comm_id, peer, nbytes, t0, t1, flags, req) -> None:
        self.heads.append((op, flags, peer, 0, comm_id, nbytes, req))


class FakeWork:
    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail
        self.calls: list[tuple] = []

    def wait(self, timeout=None):
        self.calls.append((timeout,))
        if self.fail is not None:
            raise self.fail
        return True


def wait_head(req, flags=0):
    return (cap.OP_WAIT, flags, -1, 0, 0, 0, req)


@pytest.fixture
def waits(monkeypatch):
    monkeypatch.setattr(cap, "_logged", set())
    return cap._WaitRecorder(StubHook())


def test_wait_writes_its_calls_record_once_and_passes_through(waits):
    tracked, other = FakeWork(), FakeWork()
    waits.track(tracked, 7)
    assert isinstance(tracked, FakeWork) and FakeWork.wait.__name__ == "wait"
    assert other.wait() is True and waits.hook.heads == []      # not ours: torch's wait
    assert tracked.wait(timeout=5) is True
    assert tracked.wait() is True                                # waited before: no record
    assert waits.hook.heads == [wait_head(7)]
    assert tracked.calls == [(5,), (None,)]


def test_a_failing_wait_raises_what_it_raised_and_is_marked(waits):
    error = RuntimeError("Timed out")
    work = FakeWork(fail=error)
    waits.track(work, 3)
    with pytest.raises(RuntimeError) as raised:
        work.wait()
    assert raised.value is error
    assert waits.hook.heads == [wait_head(3, cap.F_ERROR)]


def test_a_wait_inside_another_captured_call_is_recorded_the_slow_way(waits):
    work = FakeWork()
    waits.track(work, 4)
    waits.hook.busy = True
    assert work.wait() is True
    assert waits.hook.heads == [wait_head(4)]


def test_dead_works_are_swept(waits, monkeypatch):
    monkeypatch.setattr(cap, "_PENDING_MAX", 8)
    waits.sweep_at = 8
    dropped = [FakeWork() for _ in range(7)]
    kept = [FakeWork() for _ in range(3)]    # made before the others die: other ids
    for i, work in enumerate(dropped):
        waits.track(work, i + 1)
    del dropped, work
    for i, work in enumerate(kept):
        waits.track(work, 100 + i)
    assert sorted(req for _ref, req in waits.reqs.values()) == [100, 101, 102]
    assert [w.wait() for w in kept] == [True] * 3
    assert [h[-1] for h in waits.hook.heads] == [100, 101, 102]


def test_a_class_that_cannot_be_patched_is_left_alone_with_one_line(waits, capsys):
    class Frozen(type):
        def __setattr__(cls, name, value):
            raise TypeError("read-only")

    class SealedWork(metaclass=Frozen):
        def wait(self):
            return "torch's"

    for req in (1, 2):
        work = SealedWork()
        waits.track(work, req)
        assert work.wait() == "torch's"
    waits.track(object(), 3)
    assert waits.hook.heads == [] and waits.reqs == {}
    assert capsys.readouterr().err.splitlines() == [
        "greyhound: capture: cannot record waits on test_a_class_that_cannot_be_patched_is_"
        "left_alone_with_one_line.<locals>.SealedWork: TypeError: read-only; their Waits go "
        "unrecorded",
        "greyhound: capture: cannot record waits on object: TypeError: it has no wait(); "
        "their Waits go unrecorded"]
