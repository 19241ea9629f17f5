"""Records torch.distributed's collectives and p2p into the hook's ring.

The gloo backend communicates inside libtorch, where the LD_PRELOAD hook cannot see
it, so this module wraps the Python API (all_reduce, reduce_scatter(_tensor),
all_gather(_into_tensor), all_gather_single, reduce_scatter_single (torch >= 2.13),
broadcast, reduce, send, recv, isend, irecv, batch_isend_irecv, barrier) and writes one
record per call through the hook's ``gh_py_*`` entry points: the same layout, the same
ring, the same pause gate. The common case of each call runs in C
(spank/capture/fastpath.c) when that extension is built; the Python wrappers here are
the complete implementation it hands everything else to.

- Times are the hook's clock (CLOCK_MONOTONIC ns), taken in gh_py_begin just before
  the call and in gh_py_end_head just after it, so a record spans the call plus a
  few tenths of a microsecond of capture work.
- Blocking calls: t_end is the return. Async calls (async_op=True, isend, irecv,
  batch_isend_irecv) get a record at issue with the ASYNC flag and a WAIT record
  with the same req_id when ``wait()`` returns. The program gets torch's own Work;
  the Wait is written by the Work class's wait, patched on the first async call
  (see _WaitRecorder), so a wait called from C++ writes none.
- No double counting: a call that goes to NCCL while the C hook interposes NCCL,
  or to the MPI backend (the C hook records MPI), is not recorded here.
- Communicator ids: FNV-1a over the group's global ranks (int32, little-endian, in
  group rank order), then over the n-th group of the same members seen by this
  process: the scheme of spank/hook/mpi.c.
- DistributedDataParallel's gradient all-reduce runs in C++, out of sight of these
  wrappers: _greyhound_ddp.py records its buckets.

sitecustomize.py (beside this file) loads this module when the program imports
torch.distributed and calls :func:`patch`. It must not import greyhound: it runs in
any Python that has torch. Any failure leaves torch untouched.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import inspect
import itertools
import os
import struct
import sys
import time
import weakref
from typing import NamedTuple

# Mirrors enum gh_op / GH_F_* in spank/hook/gh_ring.h (checked by tests/test_hook_layout.py).
OP_ALLREDUCE, OP_REDUCESCATTER, OP_ALLGATHER, OP_BROADCAST, OP_REDUCE = 1, 2, 3, 4, 5
OP_SEND, OP_RECV, OP_BARRIER, OP_WAIT, OP_GROUP = 6, 7, 9, 10, 11
F_ASYNC, F_GROUPED, F_ERROR = 0x1, 0x2, 0x8

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1

HOOK_NAME = "libgreyhound_hook.so"
FASTPATH_NAME = "_greyhound_fastpath"

# A record's head as gh_py_end_head (spank/hook/pyapi.c) takes it: struct gh_py_head
# of spank/hook/pyhead.h (op, flags, peer, 0, comm_id, size_bytes, req_id; checked
# by tests/test_capture_layout.py). The hook takes the times itself (gh_py_begin,
# then gh_py_end_head). ctypes passes one bytes object for almost nothing but spends
# ~0.3 us on each typed argument, so per call the capture makes gh_py_begin() and
# gh_py_end_head(head), with the head packed once per operation shape and reused.
_HEAD = struct.Struct("<IIiIQQQ")
_HEADS_MAX = 4096   # cached heads per group (distinct op, peer, size); then start over
_PENDING_MAX = 4096  # async works followed until their wait before dead ones are swept

HOOK = None
"""The _HookBinding that patch() installed (scripts/bench_hook wraps a stand-in with it)."""

_logged: set = set()


def log_once(what: str, exc: BaseException | None = None, *, then: str) -> None:
    """One line on stderr per kind of problem; the program goes on unrecorded."""
    if what in _logged:
        return
    _logged.add(what)
    why = f": {type(exc).__name__}: {exc}" if exc is not None else ""
    try:
        sys.stderr.write(f"greyhound: capture: {what}{why}; {then}\n")
    except Exception:  # noqa: BLE001
        pass


def fnv1a_i32(h: int, values) -> int:
    """FNV-1a 64 fed with each value as 4 little-endian bytes (gh_fnv1a_i32)."""
    for v in values:
        for b in (int(v) & 0xFFFFFFFF).to_bytes(4, "little"):
            h = ((h ^ b) * FNV_PRIME) & _MASK64
    return h


class GroupInfo(NamedTuple):
    """What the capture knows about one process group, derived on its first call.

    spank/capture/fastpath.c reads it by position: when the capture binds the fast
    path it hands over these field names, and the fast path refuses to bind if they
    are not the ones it reads.
    """

    comm_id: int       # the ring's communicator id (FNV-1a, see the module doc)
    size: int          # members
    rank: int          # this process's rank in the group
    skip_all: bool     # its calls are the C hook's (MPI, or NCCL the hook interposes)
    skip_cuda: bool    # its calls on CUDA tensors are the C hook's (NCCL)
    heads: dict        # packed record heads of its calls, by (peer, op, size): one int


# --- binding to the hook ------------------------------------------------------------

def _load_hook_library():
    """The hook's gh_py_* functions: from this process (preloaded), else from disk."""
    candidates = [None]
    prefix = os.environ.get("GREYHOUND_PREFIX")
    if prefix:
        candidates.append(os.path.join(prefix, "lib", "greyhound", HOOK_NAME))
    # Installed layout: <libdir>/python/this file, <libdir>/libgreyhound_hook.so
    candidates.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                   HOOK_NAME))
    for candidate in candidates:
        if candidate is not None and not os.path.exists(candidate):
            continue
        try:
            lib = ctypes.CDLL(candidate)
            lib.gh_py_begin  # noqa: B018  (raises AttributeError when absent)
        except (OSError, AttributeError):
            continue
        return lib
    return None


def _hook_path() -> str | None:
    """Where the preloaded (or loaded) hook library lives, from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if line.rstrip().endswith("/" + HOOK_NAME):
                    return line.split(None, 5)[5].strip()
    except (OSError, IndexError):
        pass
    return None


def _import_fastpath():
    """The _greyhound_fastpath extension, or None. Installed, it sits beside this file
    (on PYTHONPATH); in a build tree, in python/ next to the hook library."""
    try:
        import _greyhound_fastpath  # type: ignore[import-not-found]  # a C extension, built in spank/
        return _greyhound_fastpath
    except ImportError:
        pass
    hook = _hook_path()
    if hook is None:
        return None
    pydir = os.path.join(os.path.dirname(hook), "python")
    for suffix in (".abi3.so", ".so"):
        path = os.path.join(pydir, FASTPATH_NAME + suffix)
        if os.path.exists(path):
            spec = importlib.util.spec_from_file_location(FASTPATH_NAME, path)
            fastpath = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(fastpath)
            return fastpath
    return None


def _load_fastpath(lib):
    """The C fast path bound to lib's gh_py_begin_call / gh_py_end_head; None without
    it. GREYHOUND_CAPTURE_FASTPATH=0 leaves it out."""
    if os.environ.get("GREYHOUND_CAPTURE_FASTPATH", "1") == "0":
        return None
    try:
        fastpath = _import_fastpath()
        if fastpath is None:
            return None
        # Every call the fast path records is a communication call: it begins with
        # gh_py_begin_call, which numbers it for the pause gate (a hook from before
        # call numbers has only gh_py_begin). bind() checks GroupInfo's fields.
        begin = getattr(lib, "gh_py_begin_call", None) or lib.gh_py_begin
        fastpath.bind(ctypes.cast(begin, ctypes.c_void_p).value,
                      ctypes.cast(lib.gh_py_end_head, ctypes.c_void_p).value,
                      GroupInfo._fields)
        return fastpath
    except Exception as exc:  # noqa: BLE001  (the Python wrapper does it all)
        log_once("cannot load the C fast path", exc, then="the Python wrapper records alone")
        return None


def _declare_signatures(lib) -> None:
    """ctypes signatures of the hook calls made through CDLL (which releases the GIL)."""
    lib.gh_py_active.restype = ctypes.c_int
    lib.gh_py_active.argtypes = []
    lib.gh_py_gate.restype = None
    lib.gh_py_gate.argtypes = []
    lib.gh_py_record.restype = ctypes.c_uint64
    lib.gh_py_record.argtypes = [ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int32,
                                 ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64,
                                 ctypes.c_uint32, ctypes.c_uint64]
    lib.gh_py_comm.restype = None
    lib.gh_py_comm.argtypes = [ctypes.c_uint64, ctypes.c_int32, ctypes.c_int32]


def _pydll_function(pylib, name: str, restype, argtypes=None):
    function = getattr(pylib, name)
    function.restype = restype
    if argtypes is not None:
        function.argtypes = argtypes
    return function


class _HookBinding:
    """Binding to the C hook, and what this process knows about its groups.

    The C fast path reads three attributes of it: ``on``, ``groups`` and ``gate``.
    """

    def __init__(self, lib) -> None:
        self.lib = lib
        _declare_signatures(lib)
        # begin/end never block: called with the GIL held (PyDLL), which is cheaper.
        # The gate may wait for seconds: gh_py_gate goes through CDLL, which releases it.
        pylib = ctypes.PyDLL(lib._name)
        self.begin = _pydll_function(pylib, "gh_py_begin", ctypes.c_size_t, [])
        # A call that writes a communication-call record begins with begin_call (or,
        # a batch of n, begin_calls(n)): the hook numbers it, and its pause gate can
        # hold a rank before a given call number (spank/hook/gh_ring.h). A hook from
        # before call numbers has neither: then begin, and the gate holds any call.
        try:
            self.begin_call = _pydll_function(pylib, "gh_py_begin_call", ctypes.c_size_t, [])
            self.begin_calls = _pydll_function(pylib, "gh_py_begin_calls", ctypes.c_size_t,
                                               [ctypes.c_uint32])
        except AttributeError:
            self.begin_call = self.begin
            self.begin_calls = lambda _n: self.begin()
        self.end = _pydll_function(pylib, "gh_py_end", None, [])
        # No argtypes: a bytes object goes as char *.
        self.end_head = _pydll_function(pylib, "gh_py_end_head", None)
        self.gate = lib.gh_py_gate
        self.record = lib.gh_py_record
        self.groups: dict[int, tuple] = {}   # id(group) -> (group, GroupInfo)
        self.last_group = (None,)            # (group, *its GroupInfo) of the last call
        self.groups_seen: dict[int, int] = {}  # FNV of the members -> groups of them
        self.req_ids = itertools.count(1)
        self.c_hook_records_nccl = self._interposes("ncclAllReduce")
        self.on: bool | None = None  # asked on the first call: the ring opens only then
        self.fastpath = _load_fastpath(lib)
        self.waits = _WaitRecorder(self)
        os.register_at_fork(after_in_child=self._after_fork)

    def _interposes(self, name: str) -> bool:
        """True when the process-wide definition of name is the hook's (preloaded)."""
        try:
            ours = ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value
            seen = ctypes.cast(getattr(ctypes.CDLL(None), name), ctypes.c_void_p).value
        except (OSError, AttributeError):
            return False
        return ours == seen

    def active(self) -> bool:
        """Whether the hook records; the first call opens the ring."""
        if self.on is None:
            self.on = bool(self.lib.gh_py_active())
        return self.on

    def _after_fork(self) -> None:
        # The child gets its own ring (the C hook reopens on first use).
        self.groups = {}
        self.last_group = (None,)
        self.on = None

    def group_info(self, dc10d, group) -> GroupInfo:
        """The GroupInfo of a process group (None: the default group); derived once."""
        if group is None:
            group = dc10d.GroupMember.WORLD
        entry = self.groups.get(id(group))
        if entry is not None and entry[0] is group:
            return entry[1]
        ranks = dc10d.get_process_group_ranks(group)
        members = fnv1a_i32(FNV_OFFSET, ranks)
        nth = self.groups_seen.get(members, 0)
        self.groups_seen[members] = nth + 1
        comm_id = fnv1a_i32(members, [nth])
        try:
            backend = str(dc10d.get_backend(group)).lower()
        except Exception:  # noqa: BLE001  (a group torch cannot describe: record it)
            backend = "gloo"
        rank = dc10d.get_rank(group)
        info = GroupInfo(
            comm_id=comm_id, size=len(ranks), rank=rank,
            skip_all="mpi" in backend or (backend == "nccl" and self.c_hook_records_nccl),
            skip_cuda=self.c_hook_records_nccl and "nccl" in backend, heads={})
        self.groups[id(group)] = (group, info)
        self.lib.gh_py_comm(comm_id, len(ranks), rank)
        return info


class _WaitRecorder:
    """The Wait records of async calls, written by torch's own Work.wait.

    The program gets the Work torch returned, unchanged: isinstance checks, and C++
    that takes a c10d::Work (torch's work registry and wait_tensor, FSDP, futures),
    see what they would without greyhound. A forwarding proxy is rejected by all of
    these; a Python subclass of Work is accepted, but C++ then runs the base class's
    virtuals for all but wait and getFuture (isCompleted stays false, result()
    throws). So the wait is recorded in the class instead: the first async call
    returning a Work of some class patches the wait that class uses (torch's Work
    for gloo) to write the Wait of the works this module issued, found by identity;
    any other work's wait pays one failed dict lookup. A wait called from C++ (the
    registry, DDP's reducer) is torch's own and writes nothing.
    """

    def __init__(self, hook: _HookBinding) -> None:
        self.hook = hook
        # id(work) -> (weak reference to it, req_id). No weakref callback (it costs a
        # closure per call): a dead entry is ignored when its id comes back, and
        # swept out when there are many (a program may never wait, e.g. using only
        # get_future()).
        self.reqs: dict[int, tuple] = {}
        self.sweep_at = _PENDING_MAX
        self.classes: set = set()       # Work classes whose wait records
        self.refused: set = set()       # classes whose wait could not be patched

    def track(self, work, req: int) -> None:
        """From now on, the first wait() on work writes the Wait record of req."""
        try:
            cls = type(work)
            if cls not in self.classes and not self.patch(cls):
                return
            reqs = self.reqs
            reqs[id(work)] = (weakref.ref(work), req)
            if len(reqs) >= self.sweep_at:
                self.sweep()
        except Exception as exc:  # noqa: BLE001  (the call's result goes back as is)
            log_once("cannot follow an async call's wait", exc,
                     then="its Wait goes unrecorded")

    def sweep(self) -> None:
        reqs = self.reqs
        for key, entry in list(reqs.items()):
            if entry[0]() is None and reqs.get(key) is entry:
                reqs.pop(key, None)
        self.sweep_at = max(_PENDING_MAX, 2 * len(reqs))

    def patch(self, cls) -> bool:
        """Makes the wait that cls's instances use record; False if it cannot."""
        if cls in self.refused:
            return False
        try:
            owner = next((c for c in cls.__mro__ if "wait" in c.__dict__), None)
            if owner is None:
                raise TypeError("it has no wait()")
            wait = owner.__dict__["wait"]
            if getattr(wait, "__greyhound_waits__", None) is not self:
                # (patched for an earlier binding: this one takes over; one per process)
                owner.wait = self.recording(getattr(wait, "__greyhound_wrapped__", wait))
        except Exception as exc:  # noqa: BLE001  (e.g. a type that takes no attributes)
            self.refused.add(cls)
            log_once(f"cannot record waits on {cls.__qualname__}", exc,
                     then="their Waits go unrecorded")
            return False
        self.classes.add(cls)
        return True

    def recording(self, wait):
        """wait (a Work class's), writing the Wait record of a work tracked here."""
        reqs, hook = self.reqs, self.hook

        @functools.wraps(wait)
        def greyhound_wait(work, *args, **kwargs):
            entry = reqs.pop(id(work), None)
            if entry is None or entry[0]() is not work:
                return wait(work, *args, **kwargs)
            req = entry[1]
            begun = hook.begin()      # (completion is not held at the gate)
            t0 = 0 if begun else time.monotonic_ns()
            flags = F_ERROR
            try:
                done = wait(work, *args, **kwargs)
                flags = 0
                return done
            finally:
                if begun:
                    hook.end_head(_HEAD.pack(OP_WAIT, flags, -1, 0, 0, 0, req))
                else:  # inside another captured call: the slow way
                    hook.record(OP_WAIT, 0, -1, 0, t0, time.monotonic_ns(), flags, req)

        greyhound_wait.__greyhound_wrapped__ = wait
        greyhound_wait.__greyhound_waits__ = self
        return greyhound_wait


# --- the per-call wrappers ------------------------------------------------------------

def _nbytes(t) -> int:
    try:
        return t.numel() * t.element_size()
    except AttributeError:
        return 0


def _list_bytes(ts) -> int:
    return sum(_nbytes(t) for t in ts) if ts is not None else 0


class CallSpec(NamedTuple):
    """How the capture records one torch.distributed function."""

    op: int                  # the record's op code
    size_arg: str | None     # the argument whose bytes the record counts
    peer_arg: str | None     # the argument naming the p2p peer or the root


CALL_SPECS = {
    "all_reduce": CallSpec(OP_ALLREDUCE, "tensor", None),
    "reduce_scatter": CallSpec(OP_REDUCESCATTER, "input_list", None),
    "reduce_scatter_tensor": CallSpec(OP_REDUCESCATTER, "input", None),
    "all_gather": CallSpec(OP_ALLGATHER, "tensor_list", None),
    "all_gather_into_tensor": CallSpec(OP_ALLGATHER, "output_tensor", None),
    # torch >= 2.13's names for the two above (which now call them: the inner call
    # is not recorded again, gh_py_begin refuses a call inside a captured one).
    "all_gather_single": CallSpec(OP_ALLGATHER, "output_tensor", None),
    "reduce_scatter_single": CallSpec(OP_REDUCESCATTER, "input", None),
    "broadcast": CallSpec(OP_BROADCAST, "tensor", "src"),
    "reduce": CallSpec(OP_REDUCE, "tensor", "dst"),
    "send": CallSpec(OP_SEND, "tensor", "dst"),
    "recv": CallSpec(OP_RECV, "tensor", "src"),
    "isend": CallSpec(OP_SEND, "tensor", "dst"),
    "irecv": CallSpec(OP_RECV, "tensor", "src"),
    "barrier": CallSpec(OP_BARRIER, None, None),
}
_LIST_ARGS = {"input_list", "tensor_list"}   # size_args that are lists of tensors
_ALWAYS_ASYNC = {"isend", "irecv"}
_ABSENT = 1 << 30    # a parameter index no call reaches: the argument comes from kwargs


def _world_getter(dc10d):
    """How to find the default group: None when torch's own attribute can be read
    (two attribute loads), else a function using the public GroupMember.WORLD."""
    world = getattr(dc10d, "_world", None)
    if world is not None and hasattr(world, "_default_pg"):
        return None
    return lambda: dc10d.GroupMember.WORLD


def _peer_getter(fn_params: dict, peer_arg: str, dc10d):
    """peer(args, kwargs, group): the group rank of the call's peer or root, -1 if
    none (group: the group argument, None for the default group)."""
    group_peer_arg = "group_" + peer_arg
    i_group_peer = fn_params.get(group_peer_arg, _ABSENT)
    i_peer = fn_params.get(peer_arg, _ABSENT)

    def peer(args, kwargs, group) -> int:
        n = len(args)
        group_peer = args[i_group_peer] if i_group_peer < n else kwargs.get(group_peer_arg)
        if group_peer is not None:
            return group_peer
        global_peer = args[i_peer] if i_peer < n else kwargs.get(peer_arg)
        if global_peer is None:
            return -1
        return global_peer if group is None else dc10d.get_group_rank(group, global_peer)

    return peer


def _head(op, flags, peer, comm_id, nbytes, req):
    """A record head for gh_py_end_head; None (no record) if a value does not fit."""
    try:
        return _HEAD.pack(op, flags, peer, 0, comm_id, nbytes, req)
    except Exception:  # noqa: BLE001
        return None


def _cached_head(heads: dict, key: int, op: int, peer: int, comm_id: int, nbytes: int):
    """The head of a blocking call of this shape, packed on its first call."""
    if len(heads) >= _HEADS_MAX:
        heads.clear()
    head = heads[key] = _HEAD.pack(op, 0, peer, 0, comm_id, nbytes, 0)
    return head


def _end_async(hook: _HookBinding, result, op: int, peer: int, comm_id: int, nbytes: int):
    """Writes an async call's record once it is issued, and follows its Work's wait."""
    if result is None:           # nothing to wait for
        hook.end_head(_head(op, 0, peer, comm_id, nbytes, 0))
        return result
    req = next(hook.req_ids)
    hook.end_head(_head(op, F_ASYNC, peer, comm_id, nbytes, req))
    waits = hook.waits
    try:                         # waits.track, written out for its common case
        if type(result) in waits.classes and len(waits.reqs) < waits.sweep_at:
            waits.reqs[id(result)] = (weakref.ref(result), req)
        else:
            waits.track(result, req)
    except Exception as exc:  # noqa: BLE001  (the result goes back as is)
        log_once("cannot follow an async call's wait", exc, then="its Wait goes unrecorded")
    return result


def _python_wrapper(fn, name: str, fn_params: dict, hook: _HookBinding, dc10d):
    """fn recorded: the complete Python wrapper, which the C fast path hands to all
    it leaves (fn_params: fn's parameter names -> positions)."""
    op, size_arg, peer_arg = CALL_SPECS[name]
    i_size = fn_params.get(size_arg, _ABSENT)
    i_group = fn_params.get("group", _ABSENT)
    i_async = fn_params.get("async_op", _ABSENT)
    is_list = size_arg in _LIST_ARGS
    always_async = name in _ALWAYS_ASYNC
    peer_of = _peer_getter(fn_params, peer_arg, dc10d) if peer_arg else None
    recv_from_any = name == "recv"       # recv(src=None) returns the sender
    begin, end_head = hook.begin_call, hook.end_head
    op_key = op << 48                    # heads are keyed by (peer, op, size) in one int
    default_group = _world_getter(dc10d)

    # The common path is inline: a Python call costs ~0.1 us on a slow core (more on
    # the cold caches a blocking torch call leaves), and the budget is 2 us. The
    # head is ready before the call, so after it only gh_py_end_head runs.
    @functools.wraps(fn)
    def recorded_call(*args, **kwargs):
        on = hook.on
        if on is None:
            on = hook.active()
        if not on:
            return fn(*args, **kwargs)
        try:
            n = len(args)
            group = args[i_group] if i_group < n else kwargs.get("group")
            pg = group
            if pg is None:
                pg = dc10d._world._default_pg if default_group is None else default_group()
            last = hook.last_group        # a plain tuple: it unpacks faster than GroupInfo
            if last[0] is not pg or pg is None:
                last = hook.last_group = (pg, *hook.group_info(dc10d, pg))
            _pg, comm_id, _size, _rank, skip_all, skip_cuda, heads = last
            tensor = args[i_size] if i_size < n else kwargs.get(size_arg)   # None: no size_arg
            if skip_all or (skip_cuda and tensor is not None and not is_list
                            and getattr(tensor, "is_cuda", False)):
                return fn(*args, **kwargs)
            if tensor is None:
                nbytes = 0
            elif is_list:
                nbytes = _list_bytes(tensor)
            else:
                try:
                    nbytes = tensor.nbytes
                except AttributeError:
                    nbytes = _nbytes(tensor)
            peer = -1 if peer_of is None else peer_of(args, kwargs, group)
            is_async = always_async or (args[i_async] if i_async < n
                                        else kwargs.get("async_op", False))
            head = None                  # packed after the call (async) or not cached
            if not is_async and peer >= -1:
                key = ((peer + 1) << 56) | op_key | nbytes
                head = heads.get(key) or _cached_head(heads, key, op, peer, comm_id, nbytes)
        except Exception:  # noqa: BLE001  (never let bookkeeping break the call)
            return fn(*args, **kwargs)
        begun = begin()           # 0: inside another captured call on this thread
        if not begun:
            return fn(*args, **kwargs)
        if begun & 1:             # the pause gate is set: wait there (GIL released)
            hook.gate()
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            end_head(_head(op, F_ERROR, peer, comm_id, nbytes, 0))
            raise
        if is_async:
            return _end_async(hook, result, op, peer, comm_id, nbytes)
        if recv_from_any and peer == -1 and isinstance(result, int):
            head = _head(op, 0, result, comm_id, nbytes, 0)   # the sender
        end_head(head)            # takes t_end and writes the record
        return result

    recorded_call.__greyhound_wrapped__ = fn  # type: ignore[attr-defined]  # the marker of our wrappers
    return recorded_call


def _fast_call(fastpath, python_wrapper, fn, name: str, hook: _HookBinding, dc10d,
               fn_params: dict):
    """The C callable for python_wrapper's common case (spank/capture/fastpath.c),
    dressed as functools.wraps dresses a function; python_wrapper if that fails."""
    op, size_arg, peer_arg = CALL_SPECS[name]
    group_peer_arg = "group_" + peer_arg if peer_arg else None
    try:
        fast = fastpath.FastCall(
            fn=fn, slow=python_wrapper, hook=hook, dc10d=dc10d, op=op, size_name=size_arg,
            i_size=fn_params.get(size_arg, -1), i_group=fn_params.get("group", -1),
            i_async=fn_params.get("async_op", -1), peer_name=peer_arg,
            i_peer=fn_params.get(peer_arg, -1), group_peer_name=group_peer_arg,
            i_group_peer=fn_params.get(group_peer_arg, -1))
        # Not functools.update_wrapper: the stable ABI gives FastCall instance attributes
        # but no `__dict__` attribute, which update_wrapper reads.
        for attr in functools.WRAPPER_ASSIGNMENTS:
            if hasattr(fn, attr):
                setattr(fast, attr, getattr(fn, attr))
        fast.__wrapped__ = fn
        fast.__greyhound_wrapped__ = fn
        fast.__greyhound_python__ = python_wrapper   # the complete wrapper (scripts/bench_hook)
        return fast
    except Exception as exc:  # noqa: BLE001
        log_once("cannot use the C fast path", exc, then="the Python wrapper records alone")
        return python_wrapper


def _wrap(fn, name: str, hook: _HookBinding, dc10d):
    """fn (the torch.distributed function called name) recorded: the C fast path
    where it applies (blocking calls sized by one tensor), else the Python wrapper."""
    fn_params = {p: i for i, p in enumerate(inspect.signature(fn).parameters)}
    python_wrapper = _python_wrapper(fn, name, fn_params, hook, dc10d)
    if hook.fastpath is None or CALL_SPECS[name].size_arg in _LIST_ARGS or name in _ALWAYS_ASYNC:
        return python_wrapper
    return _fast_call(hook.fastpath, python_wrapper, fn, name, hook, dc10d, fn_params)


def _batch_ops(p2p_op_list, hook: _HookBinding, dc10d):
    """(op, comm_id, peer, bytes) of each P2POp of a batch; None if the C hook
    records them (MPI, NCCL it interposes)."""
    ops = []
    for p2p in p2p_op_list:
        info = hook.group_info(dc10d, p2p.group)
        if info.skip_all or (info.skip_cuda and getattr(p2p.tensor, "is_cuda", False)):
            return None
        peer = p2p.group_peer if getattr(p2p, "group_peer", None) is not None else p2p.peer
        op = OP_SEND if "send" in getattr(p2p.op, "__name__", "") else OP_RECV
        ops.append((op, info.comm_id, peer, _nbytes(p2p.tensor)))
    return ops


def _wrap_batch(fn, hook: _HookBinding, dc10d):
    """batch_isend_irecv recorded: one async record per op, then a Group record."""
    begin_calls, end, record = hook.begin_calls, hook.end, hook.record

    @functools.wraps(fn)
    def recorded_batch(p2p_op_list):
        if not hook.active():
            return fn(p2p_op_list)
        try:
            ops = _batch_ops(p2p_op_list, hook, dc10d)
        except Exception:  # noqa: BLE001
            ops = None
        if ops is None:
            return fn(p2p_op_list)
        # One number per op's record; the batch is held or not as one (by its first).
        begun = begin_calls(len(ops))  # the isend/irecv torch issues inside are part of this
        if not begun:
            return fn(p2p_op_list)
        try:
            if begun & 1:
                hook.gate()
            t0 = time.monotonic_ns()
            works = fn(p2p_op_list)
            t1 = time.monotonic_ns()
        finally:
            end()                 # nothing staged: the records are written below
        reqs = []
        for op, comm_id, peer, nbytes in ops:
            reqs.append(next(hook.req_ids))
            record(op, comm_id, peer, nbytes, t0, t1, F_ASYNC | F_GROUPED, reqs[-1])
        record(OP_GROUP, 0, -1, len(ops), t0, t1, 0, 0)
        if works is None or len(works) != len(ops) or len({id(w) for w in works}) != len(ops):
            return works  # coalesced (fewer works, or one twice): completion is not attributed
        for work, req in zip(works, reqs, strict=True):
            hook.waits.track(work, req)
        return works

    recorded_batch.__greyhound_wrapped__ = fn  # type: ignore[attr-defined]  # the marker of our wrappers
    return recorded_batch


def patch(dist) -> _HookBinding | None:
    """Wraps torch.distributed's calls (module passed in); the binding to the hook,
    or None if nothing was done."""
    hook_lib = _load_hook_library()
    if hook_lib is None:
        return None
    # The ring is not opened here: a program that imports torch but never
    # communicates gets no file. Whether the hook is on is asked on the first call.
    hook = _HookBinding(hook_lib)
    global HOOK  # noqa: PLW0603  (bound once, on install; the wrappers read it)
    HOOK = hook
    dc10d = sys.modules.get("torch.distributed.distributed_c10d")
    if dc10d is None:
        return None
    for name in [*CALL_SPECS, "batch_isend_irecv"]:
        fn = getattr(dc10d, name, None)
        if fn is None or hasattr(fn, "__greyhound_wrapped__"):
            continue
        wrapped = (_wrap_batch(fn, hook, dc10d) if name == "batch_isend_irecv"
                   else _wrap(fn, name, hook, dc10d))
        setattr(dc10d, name, wrapped)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, wrapped)
    return hook
