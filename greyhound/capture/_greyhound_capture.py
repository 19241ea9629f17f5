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
  (see _Waits), so a wait called from C++ writes none.
- No double counting: a call that goes to NCCL while the C hook interposes NCCL,
  or to the MPI backend (the C hook records MPI), is not recorded here.
- Communicator ids: FNV-1a over the group's global ranks (int32, little-endian, in
  group rank order), then over the n-th group of the same members seen by this
  process: the scheme of spank/hook/mpi.c.
- DistributedDataParallel's gradient all-reduce runs in C++ (the reducer), out of
  sight of the wrappers. So on its first forward a DDP model that has no comm hook
  gets one that does what the reducer would (scale by 1/world size, all_reduce,
  hand back the future) and writes one AllReduce record per gradient bucket: bytes
  = the bucket's, start at issue, end when its future completes (on the thread
  that completes it; the ring takes several producers). A comm hook the program
  registers, before or after that, is wrapped instead to record its buckets the
  same way. Any failure there leaves the model as torch built it (see _DDP).
  Join's per-forward all_reduce (its Work goes to the reducer, which waits on it
  in C++, so it would get no Wait record) is issued unrecorded.

This file is installed next to sitecustomize.py and must not import greyhound:
it runs in any Python that has torch. Any failure leaves torch untouched.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import itertools
import os
import struct
import sys
import threading
import time
import weakref

# Mirrors enum gh_op / GH_F_* in spank/hook/gh_ring.h (checked by tests/test_hook_layout.py).
OP_ALLREDUCE, OP_REDUCESCATTER, OP_ALLGATHER, OP_BROADCAST, OP_REDUCE = 1, 2, 3, 4, 5
OP_SEND, OP_RECV, OP_BARRIER, OP_WAIT, OP_GROUP = 6, 7, 9, 10, 11
F_ASYNC, F_GROUPED, F_ERROR = 0x1, 0x2, 0x8

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1

HOOK_NAME = "libgreyhound_hook.so"

# A record's head as gh_py_end_head (spank/hook/pyapi.c) takes it: op, flags, peer, 0,
# comm_id, size_bytes, req_id. The hook takes the times itself (gh_py_begin, then
# gh_py_end_head). ctypes passes one bytes object for almost nothing but spends
# ~0.3 us on each typed argument, so per call the capture makes gh_py_begin() and
# gh_py_end_head(head), with the head packed once per operation shape and reused.
_HEAD = struct.Struct("<IIiIQQQ")
_HEADS_MAX = 4096   # cached heads per group (distinct op, peer, size); then start over
_PENDING_MAX = 4096  # async works followed until their wait before dead ones are swept

HOOK = None
"""The _Hook that patch() installed (scripts/bench_hook wraps a stand-in with it)."""


def fnv1a_i32(h: int, values) -> int:
    """FNV-1a 64 fed with each value as 4 little-endian bytes (gh_fnv1a_i32)."""
    for v in values:
        for b in (int(v) & 0xFFFFFFFF).to_bytes(4, "little"):
            h = ((h ^ b) * FNV_PRIME) & _MASK64
    return h


def _load_hook():
    """The hook's gh_py_* functions: from this process (preloaded), else from disk."""
    candidates = [None]
    prefix = os.environ.get("GREYHOUND_PREFIX")
    if prefix:
        candidates.append(os.path.join(prefix, "lib", "greyhound", HOOK_NAME))
    # Installed layout: <libdir>/python/this file, <libdir>/libgreyhound_hook.so
    candidates.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                   HOOK_NAME))
    for cand in candidates:
        if cand is not None and not os.path.exists(cand):
            continue
        try:
            lib = ctypes.CDLL(cand)
            lib.gh_py_begin  # noqa: B018  (raises AttributeError when absent)
        except (OSError, AttributeError):
            continue
        return lib
    return None


FASTPATH_NAME = "_greyhound_fastpath"


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


def _load_fastpath(lib):
    """The C fast path bound to lib's gh_py_begin / gh_py_end_head; None without it.

    Installed, it sits beside this file (on PYTHONPATH); in a build tree, in
    python/ next to the hook library. GREYHOUND_CAPTURE_FASTPATH=0 leaves it out.
    """
    if os.environ.get("GREYHOUND_CAPTURE_FASTPATH", "1") == "0":
        return None
    import importlib.util
    try:
        try:
            import _greyhound_fastpath as fastpath
        except ImportError:
            hook = _hook_path()
            if hook is None:
                return None
            spec = None
            pydir = os.path.join(os.path.dirname(hook), "python")
            for suffix in (".abi3.so", ".so"):
                path = os.path.join(pydir, FASTPATH_NAME + suffix)
                if os.path.exists(path):
                    spec = importlib.util.spec_from_file_location(FASTPATH_NAME, path)
                    break
            if spec is None:
                return None
            fastpath = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(fastpath)
        # Every call the fast path records is a communication call: it begins with
        # gh_py_begin_call, which numbers it for the pause gate (a hook from before
        # call numbers has only gh_py_begin).
        begin = getattr(lib, "gh_py_begin_call", None) or lib.gh_py_begin
        fastpath.bind(ctypes.cast(begin, ctypes.c_void_p).value,
                      ctypes.cast(lib.gh_py_end_head, ctypes.c_void_p).value)
        return fastpath
    except Exception as exc:  # noqa: BLE001  (the Python wrapper does it all)
        _log_once("cannot load the C fast path", exc, then="the Python wrapper records alone")
        return None


class _Hook:
    """Binding to the C hook, and what this process knows about its groups."""

    def __init__(self, lib) -> None:
        self.lib = lib
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
        # begin/end never block: called with the GIL held (PyDLL), which is cheaper.
        # The gate may wait for seconds: gh_py_gate goes through CDLL, which releases it.
        pylib = ctypes.PyDLL(lib._name)
        self.begin = pylib.gh_py_begin
        self.begin.restype = ctypes.c_size_t
        self.begin.argtypes = []
        # A call that writes a communication-call record begins with begin_call (or,
        # a batch of n, begin_calls(n)): the hook numbers it, and its pause gate can
        # hold a rank before a given call number (spank/hook/gh_ring.h). A hook from
        # before call numbers has neither: then begin, and the gate holds any call.
        try:
            self.begin_call = pylib.gh_py_begin_call
            self.begin_call.restype = ctypes.c_size_t
            self.begin_call.argtypes = []
            self.begin_calls = pylib.gh_py_begin_calls
            self.begin_calls.restype = ctypes.c_size_t
            self.begin_calls.argtypes = [ctypes.c_uint32]
        except AttributeError:
            self.begin_call = self.begin
            self.begin_calls = lambda _n: self.begin()
        self.end = pylib.gh_py_end
        self.end.restype = None
        self.end.argtypes = []
        self.end_head = pylib.gh_py_end_head   # no argtypes: a bytes object goes as char *
        self.end_head.restype = None
        self.gate = lib.gh_py_gate
        self.record = lib.gh_py_record
        self.groups: dict[int, tuple] = {}
        self.last = (None, None)  # (group, info) of the last call: most calls use one group
        self.ordinals: dict[int, int] = {}
        self.req_ids = itertools.count(1)
        self.c_nccl = self._interposes("ncclAllReduce")
        self.on = None            # asked on the first call: the ring opens only then
        self.fastpath = _load_fastpath(lib)
        self.waits = _Waits(self)
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
        self.last = (None, None)
        self.on = None

    def group_info(self, dc10d, group):
        """(comm_id, size, rank, skip_all, skip_cuda, heads) of a process group; derived
        once. heads caches packed record heads for the group's calls."""
        if group is None:
            group = dc10d.GroupMember.WORLD
        key = id(group)
        info = self.groups.get(key)
        if info is not None and info[0] is group:
            return info[1]
        ranks = dc10d.get_process_group_ranks(group)
        members = fnv1a_i32(FNV_OFFSET, ranks)
        nth = self.ordinals.get(members, 0)
        self.ordinals[members] = nth + 1
        comm_id = fnv1a_i32(members, [nth])
        try:
            backend = str(dc10d.get_backend(group)).lower()
        except Exception:  # noqa: BLE001  (a group torch cannot describe: record it)
            backend = "gloo"
        # Which devices' calls this module must leave to the C hook.
        skip_all = "mpi" in backend or (backend == "nccl" and self.c_nccl)
        skip_cuda = self.c_nccl and "nccl" in backend
        rank = dc10d.get_rank(group)
        value = (comm_id, len(ranks), rank, skip_all, skip_cuda, {})
        self.groups[key] = (group, value)
        self.lib.gh_py_comm(comm_id, len(ranks), rank)
        return value


class _Waits:
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

    def __init__(self, hook: _Hook) -> None:
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
            _log_once("cannot follow an async call's wait", exc,
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
                # (patched for an earlier _Hook: this one takes over; one per process)
                owner.wait = self.recording(getattr(wait, "__greyhound_wrapped__", wait))
        except Exception as exc:  # noqa: BLE001  (e.g. a type that takes no attributes)
            self.refused.add(cls)
            _log_once(f"cannot record waits on {cls.__qualname__}", exc,
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


def _nbytes(t) -> int:
    try:
        return t.numel() * t.element_size()
    except AttributeError:
        return 0


def _list_bytes(ts) -> int:
    return sum(_nbytes(t) for t in ts) if ts is not None else 0


# (function name, op code, how to size it, the argument naming the p2p peer or root)
_SPECS = {
    "all_reduce": (OP_ALLREDUCE, ("tensor",), None),
    "reduce_scatter": (OP_REDUCESCATTER, ("input_list",), None),
    "reduce_scatter_tensor": (OP_REDUCESCATTER, ("input",), None),
    "all_gather": (OP_ALLGATHER, ("tensor_list",), None),
    "all_gather_into_tensor": (OP_ALLGATHER, ("output_tensor",), None),
    # torch >= 2.13's names for the two above (which now call them: the inner call
    # is not recorded again, gh_py_begin refuses a call inside a captured one).
    "all_gather_single": (OP_ALLGATHER, ("output_tensor",), None),
    "reduce_scatter_single": (OP_REDUCESCATTER, ("input",), None),
    "broadcast": (OP_BROADCAST, ("tensor",), "src"),
    "reduce": (OP_REDUCE, ("tensor",), "dst"),
    "send": (OP_SEND, ("tensor",), "dst"),
    "recv": (OP_RECV, ("tensor",), "src"),
    "isend": (OP_SEND, ("tensor",), "dst"),
    "irecv": (OP_RECV, ("tensor",), "src"),
    "barrier": (OP_BARRIER, (), None),
}
_ALWAYS_ASYNC = {"isend", "irecv"}


def _world_getter(dc10d):
    """How to find the default group: None when torch's own attribute can be read
    (two attribute loads), else a function using the public GroupMember.WORLD."""
    world = getattr(dc10d, "_world", None)
    if world is not None and hasattr(world, "_default_pg"):
        return None
    return lambda: dc10d.GroupMember.WORLD


def _wrap(fn, name: str, hook: _Hook, dc10d):
    op, (size_arg,) = _SPECS[name][0], (_SPECS[name][1] or (None,))
    peer_arg = _SPECS[name][2]
    params = list(inspect.signature(fn).parameters)
    absent = 1 << 30              # an index no call reaches: the argument comes from kwargs
    pos = {p: i for i, p in enumerate(params)}
    i_size = pos.get(size_arg, absent) if size_arg else absent
    i_group = pos.get("group", absent)
    i_async = pos.get("async_op", absent)
    is_list = size_arg in ("input_list", "tensor_list")
    always_async = name in _ALWAYS_ASYNC
    begin, end_head, pack = hook.begin_call, hook.end_head, _HEAD.pack
    waits = hook.waits
    reqs, weak_ref = waits.reqs, weakref.ref
    op_key = op << 48             # heads are keyed by (peer, op, size) in one int
    slow_world = _world_getter(dc10d)

    def arg(args, kwargs, pname, default=None):
        i = pos.get(pname, -1)
        if 0 <= i < len(args):
            return args[i]
        return kwargs.get(pname, default)

    # The common path is written out inline, without helper calls: each Python
    # call costs ~0.1 us on a slow core (several times more on the cold caches
    # a blocking torch call leaves), and the budget for all of this is 2 us.
    # The record's head is ready before the call, so after it only
    # gh_py_end_head runs.
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        on = hook.on
        if on is None:
            on = hook.active()
        if not on:
            return fn(*args, **kwargs)
        try:
            n = len(args)
            group = args[i_group] if i_group < n else kwargs.get("group")
            if group is not None:
                pg = group
            elif slow_world is None:
                pg = dc10d._world._default_pg
            else:
                pg = slow_world()
            last = hook.last
            if last[0] is pg and pg is not None:
                info = last[1]
            else:
                info = hook.group_info(dc10d, pg)
                hook.last = (pg, info)
            comm_id, _size, _rank, skip_all, skip_cuda, heads = info
            if size_arg is None:
                tensor = None
            else:
                tensor = args[i_size] if i_size < n else kwargs.get(size_arg)
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
            peer = -1
            if peer_arg:
                g_peer = arg(args, kwargs, "group_" + peer_arg)
                if g_peer is not None:
                    peer = g_peer
                else:
                    p = arg(args, kwargs, peer_arg)
                    if p is not None:
                        peer = p if group is None else dc10d.get_group_rank(group, p)
            is_async = always_async or (args[i_async] if i_async < n
                                        else kwargs.get("async_op", False))
            if is_async or peer < -1:
                head = None               # packed after the call (async) or not cached
            else:
                key = ((peer + 1) << 56) | op_key | nbytes
                head = heads.get(key)
                if head is None:
                    if len(heads) >= _HEADS_MAX:
                        heads.clear()
                    head = heads[key] = pack(op, 0, peer, 0, comm_id, nbytes, 0)
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
            if result is not None:
                req = next(hook.req_ids)
                end_head(_head(op, F_ASYNC, peer, comm_id, nbytes, req))
                try:              # waits.track, written out for its common case
                    if type(result) in waits.classes and len(reqs) < waits.sweep_at:
                        reqs[id(result)] = (weak_ref(result), req)
                    else:
                        waits.track(result, req)
                except Exception as exc:  # noqa: BLE001  (the result goes back as is)
                    _log_once("cannot follow an async call's wait", exc,
                              then="its Wait goes unrecorded")
                return result
            head = _head(op, 0, peer, comm_id, nbytes, 0)   # nothing to wait for
        elif name == "recv" and peer == -1 and isinstance(result, int):
            head = _head(op, 0, result, comm_id, nbytes, 0)  # any source: the sender
        end_head(head)            # takes t_end and writes the record
        return result

    wrapper.__greyhound_wrapped__ = fn
    if hook.fastpath is None or is_list or always_async:
        return wrapper
    return _fast(hook.fastpath, wrapper, fn, hook, dc10d, op=op, size_name=size_arg,
                 i_size=pos.get(size_arg, -1), i_group=pos.get("group", -1),
                 i_async=pos.get("async_op", -1), peer_name=peer_arg,
                 i_peer=pos.get(peer_arg, -1),
                 group_peer_name=("group_" + peer_arg) if peer_arg else None,
                 i_group_peer=pos.get("group_" + peer_arg, -1) if peer_arg else -1)


def _fast(fastpath, wrapper, fn, hook, dc10d, **spec):
    """The C callable for wrapper's common case (spank/capture/fastpath.c), dressed
    as functools.wraps dresses a function; the Python wrapper if that fails."""
    try:
        fast = fastpath.FastCall(fn=fn, slow=wrapper, hook=hook, dc10d=dc10d, **spec)
        # Not functools.update_wrapper: the stable ABI gives FastCall instance attributes
        # but no `__dict__` attribute, which update_wrapper reads.
        for name in functools.WRAPPER_ASSIGNMENTS:
            if hasattr(fn, name):
                setattr(fast, name, getattr(fn, name))
        fast.__wrapped__ = fn
        fast.__greyhound_wrapped__ = fn
        fast.__greyhound_python__ = wrapper   # the complete wrapper (scripts/bench_hook)
        return fast
    except Exception as exc:  # noqa: BLE001
        _log_once("cannot use the C fast path", exc, then="the Python wrapper records alone")
        return wrapper


def _head(op, flags, peer, comm_id, nbytes, req):
    """A record head for gh_py_end_head; None (no record) if a value does not fit."""
    try:
        return _HEAD.pack(op, flags, peer, 0, comm_id, nbytes, req)
    except Exception:  # noqa: BLE001
        return None


def _wrap_batch(fn, hook: _Hook, dc10d):
    begin_calls, end = hook.begin_calls, hook.end
    record = hook.record

    @functools.wraps(fn)
    def wrapper(p2p_op_list):
        if not hook.active():
            return fn(p2p_op_list)
        try:
            ops = []
            for p in p2p_op_list:
                fname = getattr(p.op, "__name__", "")
                comm_id, _s, _r, skip_all, skip_cuda, _heads = hook.group_info(dc10d, p.group)
                if skip_all or (skip_cuda and getattr(p.tensor, "is_cuda", False)):
                    return fn(p2p_op_list)
                peer = p.group_peer if getattr(p, "group_peer", None) is not None else p.peer
                ops.append((OP_SEND if "send" in fname else OP_RECV, comm_id, peer,
                            _nbytes(p.tensor)))
        except Exception:  # noqa: BLE001
            return fn(p2p_op_list)
        # One number per op's record; the batch is held or not as one (by its first).
        addr = begin_calls(len(ops))  # the isend/irecv torch issues inside are part of this
        if not addr:
            return fn(p2p_op_list)
        try:
            if addr & 1:
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

    wrapper.__greyhound_wrapped__ = fn
    return wrapper


# --- DistributedDataParallel -------------------------------------------------------

_DDP_MODULE = "torch.nn.parallel.distributed"
_logged: set = set()


def _log_once(what: str, exc: BaseException | None = None,
              then: str = "DDP runs as torch built it") -> None:
    """One line on stderr per kind of problem; the program goes on unrecorded."""
    if what in _logged:
        return
    _logged.add(what)
    why = f": {type(exc).__name__}: {exc}" if exc is not None else ""
    try:
        sys.stderr.write(f"greyhound: capture: {what}{why}; {then}\n")
    except Exception:  # noqa: BLE001
        pass


class _DDPState:
    """What the capture did to one DDP model; also the state its comm hook gets.

    mode: "ours" (our hook holds the reducer's one hook slot), "user" (the program
    registered a hook before the first forward), "off" (left alone).
    """

    __slots__ = ("mode", "model", "pg", "comm_id", "scale", "user", "join_work",
                 "join_scale", "__weakref__")

    def __init__(self, mode: str, model=None) -> None:
        self.mode = mode
        self.model = weakref.ref(model) if model is not None else None
        self.pg = None
        self.comm_id = 0
        self.scale = 1.0
        self.user = None        # (state, hook) registered after ours: ours hands over
        self.join_work = None   # this forward's count of ranks not joined (Join)
        self.join_scale = None

    def bucket_scale(self) -> float:
        """What the reducer would multiply this backward's gradients by: 1/world
        size, or under Join(divide_by_initial_world_size=False) 1/the ranks that
        have not joined, which the all_reduce Join issued in this forward counts."""
        work = self.join_work
        if work is None:
            return self.scale
        model = self.model() if self.model is not None else None
        if (model is None or not model._join_config.enable
                or model._divide_by_initial_world_size):
            return self.scale
        if self.join_scale is None:   # (the future's value: Work.result() warns)
            self.join_scale = 1.0 / int(work.get_future().wait()[0].item())
        return self.join_scale


def _first(fut):
    return fut.value()[0]


class _DDP:
    """Patches DistributedDataParallel (the class, once) so that its buckets are recorded.

    Exactness: without a comm hook the reducer copies each gradient into its
    bucket multiplied by 1/world size (at::mul_out with a wrapped double scalar);
    our hook multiplies the bucket in place by the same scalar, which gives the
    same bits. (With gradient_as_bucket_view, a gradient that already is the
    bucket's view is divided instead, which differs from the multiplication
    unless the world size is a power of two: such models are left alone.)
    Models the hook cannot stand in for exactly are left alone too: the
    compiled-autograd python reducer, models whose parameters all skip the
    reducer, sparse gradients, NCCL seen by the C hook.
    """

    def __init__(self, hook: _Hook, dc10d, dist) -> None:
        self.hook = hook
        self.dc10d = dc10d
        self.register_raw = dist._register_comm_hook
        fn = dc10d.all_reduce
        self.all_reduce = getattr(fn, "__greyhound_wrapped__", fn)  # ours is not nested
        self.states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.lock = threading.Lock()

    # The patched methods. Each keeps torch's own behaviour when anything fails.

    def patch_class(self, cls) -> None:
        if getattr(cls, "__greyhound_ddp__", False):
            return
        ddp = self
        forward = cls.forward
        register = cls.register_comm_hook
        builtin = getattr(cls, "_register_builtin_comm_hook", None)

        @functools.wraps(forward)
        def greyhound_forward(model, *args, **kwargs):
            if model not in ddp.states:
                ddp.start(model)
            return forward(model, *args, **kwargs)

        @functools.wraps(register)
        def greyhound_register_comm_hook(model, state, hook):
            st = ddp.states.get(model)
            wrapped = ddp.recording(model, hook)
            if st is not None and st.mode == "ours" and st.user is None:
                # Our hook holds the reducer's slot (torch allows one, at any time):
                # what register_comm_hook does, except the reducer call, then ours
                # hands every bucket to the program's hook.
                model._check_comm_hook(hook)     # the program's errors stay its own
                try:
                    model.logger._set_comm_hook_name(hook.__qualname__)
                    model._comm_hooks.append((hook, state))
                except Exception as exc:  # noqa: BLE001  (bookkeeping only)
                    _log_once("cannot note a DDP comm hook", exc)
                st.user = (state, wrapped)
                return None
            result = register(model, state, wrapped)
            if st is None:
                ddp.states[model] = _DDPState("user")
            return result

        cls.forward = greyhound_forward
        cls.register_comm_hook = greyhound_register_comm_hook
        if builtin is not None:
            @functools.wraps(builtin)
            def greyhound_register_builtin_comm_hook(model, comm_hook_type):
                st = ddp.states.get(model)
                if st is not None and st.mode == "ours" and st.user is None:
                    ddp.builtin_after_ours(model, st, comm_hook_type)
                    return None
                result = builtin(model, comm_hook_type)
                if st is None:
                    ddp.states[model] = _DDPState("user")
                return result

            cls._register_builtin_comm_hook = greyhound_register_builtin_comm_hook
        join = sys.modules.get("torch.distributed.algorithms.join")
        if join is not None:
            self.patch_join(join.Join)
        cls.__greyhound_ddp__ = True

    def patch_join(self, join_cls) -> None:
        """Join.notify_join_context hands its all_reduce's Work to the reducer, which
        waits on it in C++, where no Wait record would be written: the call inside
        runs unrecorded (begin() marks the thread busy)."""
        notify = join_cls.__dict__.get("notify_join_context")
        if not isinstance(notify, staticmethod) or hasattr(notify.__func__,
                                                           "__greyhound_wrapped__"):
            return
        fn, hook, ddp = notify.__func__, self.hook, self

        @functools.wraps(fn)
        def notify_join_context(joinable):
            begun = hook.begin() if hook.active() else 0
            try:
                if begun & 1:
                    hook.gate()
                work = fn(joinable)
            finally:
                if begun:
                    hook.end()
            try:
                st = ddp.states.get(joinable)
                if st is not None:
                    st.join_work, st.join_scale = work, None
            except Exception as exc:  # noqa: BLE001
                _log_once("cannot follow a DDP join", exc,
                          then="its buckets may be scaled by the world size")
            return work

        notify_join_context.__greyhound_wrapped__ = fn
        join_cls.notify_join_context = staticmethod(notify_join_context)

    def builtin_after_ours(self, model, st: _DDPState, comm_hook_type) -> None:
        """A built-in (C++) hook asked for after ours took the slot: its Python twin."""
        name = str(comm_hook_type)
        model.logger._set_comm_hook_name(name)
        if name.endswith("FP16_COMPRESS"):
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            st.user = (st.pg, self.recording(model, default_hooks.fp16_compress_hook))
        elif not name.endswith("ALLREDUCE"):   # ALLREDUCE: ours already is it
            _log_once(f"no stand-in for built-in comm hook {name}",
                      then="the model keeps the capture's all-reduce")

    # Deciding, on the first forward.

    def start(self, model) -> None:
        try:
            import torch
            if torch.compiler.is_compiling():
                return              # decided on an eager forward, if there is one
        except Exception:  # noqa: BLE001
            pass
        with self.lock:
            if model in self.states:
                return
            st = self.states[model] = _DDPState("off", model)
        try:
            why = self.unsuitable(model)
            if why is not None:
                return
            pg = model.process_group
            comm_id, size, _rank, _skip_all, _skip_cuda, _heads = self.hook.group_info(
                self.dc10d, pg)
            st.pg, st.comm_id, st.scale = pg, comm_id, 1.0 / size
            self.register_raw(model.reducer, st, self.bucket_hook)
            st.mode = "ours"
        except Exception as exc:  # noqa: BLE001
            _log_once("cannot record DistributedDataParallel", exc)

    def unsuitable(self, model) -> str | None:
        """Why our hook could not stand in for the reducer's all-reduce, or None."""
        if not self.hook.active():
            return "hook off"
        if getattr(model, "_use_python_reducer", False):
            return "python reducer"
        if getattr(model, "_delay_all_reduce_all_params", False):
            return "no reducer buckets"
        import torch
        for m in model.module.modules():
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse:
                return "sparse gradients"
        pg = model.process_group
        size = pg.size()
        if getattr(model, "gradient_as_bucket_view", False) and size & (size - 1):
            return "gradient_as_bucket_view with a world size not a power of two"
        _c, _s, _r, skip_all, skip_cuda, _h = self.hook.group_info(self.dc10d, pg)
        if skip_all or (skip_cuda and any(p.is_cuda for p in model.module.parameters())):
            return "recorded by the C hook"
        return None

    # The hooks.

    def bucket_hook(self, st: _DDPState, bucket):
        """The reducer's all-reduce, recorded (registered on the model's reducer)."""
        user = st.user
        if user is not None:
            return user[1](user[0], bucket)
        buf = bucket.buffer()
        buf.mul_(st.bucket_scale())
        token = self.issue()
        try:
            fut = self.all_reduce(buf, group=st.pg, async_op=True).get_future()
        finally:
            self.issued(token)
        return self.completed(fut, token, st.comm_id, buf, first=True)

    def recording(self, model, hook):
        """The program's comm hook, wrapped to record each bucket; hook itself if not."""
        try:
            if (not callable(hook) or getattr(model, "_use_python_reducer", False)
                    or not self.hook.active()):
                return hook
            capture = self
            pg = model.process_group    # (not the model: the reducer keeps this hook)

            @functools.wraps(hook)
            def greyhound_recording_hook(state, bucket):
                try:
                    comm_id = capture.hook.group_info(capture.dc10d, pg)[0]
                    buf = bucket.buffer()
                    token = capture.issue()
                except Exception as exc:  # noqa: BLE001
                    _log_once("cannot record a DDP comm hook", exc,
                              then="its buckets go unrecorded")
                    return hook(state, bucket)
                try:
                    fut = hook(state, bucket)
                finally:
                    capture.issued(token)
                return capture.completed(fut, token, comm_id, buf, first=False)

            # (functools.wraps: DDP inspects the signature and names the hook)
            greyhound_recording_hook.__greyhound_wrapped__ = hook
            return greyhound_recording_hook
        except Exception as exc:  # noqa: BLE001
            _log_once("cannot record a DDP comm hook", exc, then="its buckets go unrecorded")
            return hook

    def issue(self):
        """Before a bucket's communication: the pause gate, and this thread marked busy
        so the captured calls inside are not recorded twice. (begun, t_start)"""
        begun = 0
        try:
            if self.hook.active():
                begun = self.hook.begin_call()   # the bucket's AllReduce record, at completion
                if begun & 1:
                    self.hook.gate()
        except Exception as exc:  # noqa: BLE001
            _log_once("cannot record a DDP bucket", exc, then="its buckets go unrecorded")
        return begun, time.monotonic_ns()

    def issued(self, token) -> None:
        if token[0]:
            self.hook.end()       # nothing staged: the record comes at completion

    def completed(self, fut, token, comm_id: int, buf, *, first: bool):
        """The future to give the reducer: fut's value (its first element if first)
        once the bucket's record is written. The record is written on whichever
        thread completes fut, before anything waiting on the reducer's future runs,
        so it precedes whatever the program does after backward()."""
        try:
            if not self.hook.on:
                raise LookupError("recording is off")
            nbytes = buf.numel() * buf.element_size()
            t0 = token[1]
            record = self.hook.record
        except Exception as exc:  # noqa: BLE001
            if not isinstance(exc, LookupError):
                _log_once("cannot record a DDP bucket", exc, then="its buckets go unrecorded")
            return fut.then(_first) if first else fut

        def done(f):
            t1 = time.monotonic_ns()
            try:
                value = f.value()
            except BaseException:
                _record_quietly(record, comm_id, nbytes, t0, t1, F_ERROR)
                raise             # the reducer sees the error, as without us
            _record_quietly(record, comm_id, nbytes, t0, t1, 0)
            return value[0] if first else value

        return fut.then(done)


def _record_quietly(record, comm_id: int, nbytes: int, t0: int, t1: int, flags: int) -> None:
    try:
        record(OP_ALLREDUCE, comm_id, -1, nbytes, t0, t1, flags, 0)
    except Exception as exc:  # noqa: BLE001
        _log_once("cannot record a DDP bucket", exc, then="its buckets go unrecorded")


def _patch_ddp_when_loaded(ddp: _DDP) -> None:
    """Patches DistributedDataParallel now if its module is loaded, else on its import."""
    module = sys.modules.get(_DDP_MODULE)
    cls = getattr(module, "DistributedDataParallel", None) if module is not None else None
    if cls is not None:
        ddp.patch_class(cls)
        return
    if module is not None:
        return                    # half imported (a cycle): not safe to patch
    import importlib.abc
    import importlib.util

    class Loader(importlib.abc.Loader):
        def __init__(self, loader) -> None:
            self._loader = loader

        def create_module(self, spec):
            return self._loader.create_module(spec)

        def exec_module(self, module) -> None:
            self._loader.exec_module(module)
            try:
                ddp.patch_class(module.DistributedDataParallel)
            except Exception as exc:  # noqa: BLE001
                _log_once("cannot patch DistributedDataParallel", exc)

        def __getattr__(self, name):
            return getattr(self._loader, name)

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != _DDP_MODULE:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is not None and spec.loader is not None:
                spec.loader = Loader(spec.loader)
            return spec

    sys.meta_path.insert(0, Finder())


def patch(dist) -> bool:
    """Wraps torch.distributed's calls (module passed in); False if nothing was done."""
    hook_lib = _load_hook()
    if hook_lib is None:
        return False
    # The ring is not opened here: a program that imports torch but never
    # communicates gets no file. Whether the hook is on is asked on the first call.
    hook = _Hook(hook_lib)
    global HOOK
    HOOK = hook
    dc10d = sys.modules.get("torch.distributed.distributed_c10d")
    if dc10d is None:
        return False
    for name in list(_SPECS) + ["batch_isend_irecv"]:
        fn = getattr(dc10d, name, None)
        if fn is None or hasattr(fn, "__greyhound_wrapped__"):
            continue
        wrapped = (_wrap_batch(fn, hook, dc10d) if name == "batch_isend_irecv"
                   else _wrap(fn, name, hook, dc10d))
        setattr(dc10d, name, wrapped)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, wrapped)
    try:
        _patch_ddp_when_loaded(_DDP(hook, dc10d, dist))
    except Exception as exc:  # noqa: BLE001
        _log_once("cannot patch DistributedDataParallel", exc)
    return True
