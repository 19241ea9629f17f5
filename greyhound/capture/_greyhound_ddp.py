"""Records DistributedDataParallel's gradient all-reduce into the hook's ring.

DDP's reducer all-reduces gradient buckets in C++, out of sight of the capture's
wrappers (_greyhound_capture.py). So on its first forward a DDP model that has no
comm hook gets one that does what the reducer would (scale by 1/world size,
all_reduce, hand back the future) and writes one AllReduce record per gradient
bucket: bytes = the bucket's, start at issue, end when its future completes (on the
thread that completes it; the ring takes several producers). A comm hook the
program registers, before or after that, is wrapped instead to record its buckets
the same way. Any failure here leaves the model as torch built it (see DDPCapture).
Join's per-forward all_reduce (its Work goes to the reducer, which waits on it in
C++, so it would get no Wait record) is issued unrecorded.

sitecustomize.py (beside this file) loads this module when the program imports
torch.nn.parallel.distributed and calls :func:`patch`. Like the capture, it must not
import greyhound.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
import weakref

if __package__:     # greyhound.capture, in a checkout (tests)
    from . import _greyhound_capture as capture
else:               # installed: sitecustomize loaded the capture as a top-level module
    import _greyhound_capture as capture  # type: ignore[import-not-found, no-redef]  # the same module

AS_TORCH_BUILT_IT = "DDP runs as torch built it"
UNRECORDED_BUCKETS = "its buckets go unrecorded"


class DDPModelState:
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
        self.user: tuple | None = None  # (state, hook) registered after ours: ours hands over
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

    def holds_the_slot_alone(self) -> bool:
        """Our hook holds the reducer's hook slot, and no program hook came after it."""
        return self.mode == "ours" and self.user is None


def _first_of_value(fut):
    return fut.value()[0]


def _record_quietly(record, comm_id: int, nbytes: int, t0: int, t1: int, flags: int) -> None:
    try:
        record(capture.OP_ALLREDUCE, comm_id, -1, nbytes, t0, t1, flags, 0)
    except Exception as exc:  # noqa: BLE001
        capture.log_once("cannot record a DDP bucket", exc, then=UNRECORDED_BUCKETS)


class DDPCapture:
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

    def __init__(self, hook, dc10d, dist) -> None:
        self.hook = hook          # the capture's binding to the C hook
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
        cls.forward = self.patched_forward(cls.forward)
        cls.register_comm_hook = self.patched_register_comm_hook(cls.register_comm_hook)
        builtin = getattr(cls, "_register_builtin_comm_hook", None)
        if builtin is not None:
            cls._register_builtin_comm_hook = self.patched_register_builtin_comm_hook(builtin)
        join = sys.modules.get("torch.distributed.algorithms.join")
        if join is not None:
            self.patch_join(join.Join)
        cls.__greyhound_ddp__ = True

    def patched_forward(self, forward):
        """forward, deciding on a model's first forward how its buckets are recorded."""
        ddp = self

        @functools.wraps(forward)
        def greyhound_forward(model, *args, **kwargs):
            if model not in ddp.states:
                ddp.start(model)
            return forward(model, *args, **kwargs)

        return greyhound_forward

    def patched_register_comm_hook(self, register):
        """register_comm_hook, registering the program's hook wrapped to record."""
        ddp = self

        @functools.wraps(register)
        def greyhound_register_comm_hook(model, state, hook):
            model_state = ddp.states.get(model)
            wrapped = ddp.recording(model, hook)
            if model_state is not None and model_state.holds_the_slot_alone():
                # Our hook holds the reducer's slot (torch allows one, at any time):
                # what register_comm_hook does, except the reducer call, then ours
                # hands every bucket to the program's hook.
                model._check_comm_hook(hook)     # the program's errors stay its own
                try:
                    model.logger._set_comm_hook_name(hook.__qualname__)
                    model._comm_hooks.append((hook, state))
                except Exception as exc:  # noqa: BLE001  (bookkeeping only)
                    capture.log_once("cannot note a DDP comm hook", exc, then=AS_TORCH_BUILT_IT)
                model_state.user = (state, wrapped)
                return None
            result = register(model, state, wrapped)
            if model_state is None:
                ddp.states[model] = DDPModelState("user")
            return result

        return greyhound_register_comm_hook

    def patched_register_builtin_comm_hook(self, builtin):
        """_register_builtin_comm_hook, turned into its Python twin once ours holds the slot."""
        ddp = self

        @functools.wraps(builtin)
        def greyhound_register_builtin_comm_hook(model, comm_hook_type):
            model_state = ddp.states.get(model)
            if model_state is not None and model_state.holds_the_slot_alone():
                ddp.builtin_after_ours(model, model_state, comm_hook_type)
                return None
            result = builtin(model, comm_hook_type)
            if model_state is None:
                ddp.states[model] = DDPModelState("user")
            return result

        return greyhound_register_builtin_comm_hook

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
                model_state = ddp.states.get(joinable)
                if model_state is not None:
                    model_state.join_work, model_state.join_scale = work, None
            except Exception as exc:  # noqa: BLE001
                capture.log_once("cannot follow a DDP join", exc,
                                 then="its buckets may be scaled by the world size")
            return work

        notify_join_context.__greyhound_wrapped__ = fn  # type: ignore[attr-defined]  # our wrappers' marker
        join_cls.notify_join_context = staticmethod(notify_join_context)

    def builtin_after_ours(self, model, model_state: DDPModelState, comm_hook_type) -> None:
        """A built-in (C++) hook asked for after ours took the slot: its Python twin."""
        name = str(comm_hook_type)
        model.logger._set_comm_hook_name(name)
        if name.endswith("FP16_COMPRESS"):
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            model_state.user = (model_state.pg,
                                self.recording(model, default_hooks.fp16_compress_hook))
        elif not name.endswith("ALLREDUCE"):   # ALLREDUCE: ours already is it
            capture.log_once(f"no stand-in for built-in comm hook {name}",
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
            model_state = self.states[model] = DDPModelState("off", model)
        try:
            why = self.unsuitable(model)
            if why is not None:
                return
            model_state.pg = model.process_group
            info = self.hook.group_info(self.dc10d, model_state.pg)
            model_state.comm_id, model_state.scale = info.comm_id, 1.0 / info.size
            self.register_raw(model.reducer, model_state, self.bucket_hook)
            model_state.mode = "ours"
        except Exception as exc:  # noqa: BLE001
            capture.log_once("cannot record DistributedDataParallel", exc, then=AS_TORCH_BUILT_IT)

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
        info = self.hook.group_info(self.dc10d, pg)
        if info.skip_all or (info.skip_cuda
                             and any(p.is_cuda for p in model.module.parameters())):
            return "recorded by the C hook"
        return None

    # The hooks.

    def bucket_hook(self, model_state: DDPModelState, bucket):
        """The reducer's all-reduce, recorded (registered on the model's reducer)."""
        user = model_state.user
        if user is not None:
            return user[1](user[0], bucket)
        buf = bucket.buffer()
        buf.mul_(model_state.bucket_scale())
        token = self.issue()
        try:
            fut = self.all_reduce(buf, group=model_state.pg, async_op=True).get_future()
        finally:
            self.issued(token)
        return self.completed(fut, token, model_state.comm_id, buf, first=True)

    def recording(self, model, hook):
        """The program's comm hook, wrapped to record each bucket; hook itself if not."""
        try:
            if (not callable(hook) or getattr(model, "_use_python_reducer", False)
                    or not self.hook.active()):
                return hook
            ddp = self
            pg = model.process_group    # (not the model: the reducer keeps this hook)

            @functools.wraps(hook)
            def greyhound_recording_hook(state, bucket):
                try:
                    comm_id = ddp.hook.group_info(ddp.dc10d, pg).comm_id
                    buf = bucket.buffer()
                    token = ddp.issue()
                except Exception as exc:  # noqa: BLE001
                    capture.log_once("cannot record a DDP comm hook", exc,
                                     then=UNRECORDED_BUCKETS)
                    return hook(state, bucket)
                try:
                    fut = hook(state, bucket)
                finally:
                    ddp.issued(token)
                return ddp.completed(fut, token, comm_id, buf, first=False)

            # (functools.wraps: DDP inspects the signature and names the hook)
            greyhound_recording_hook.__greyhound_wrapped__ = hook
            return greyhound_recording_hook
        except Exception as exc:  # noqa: BLE001
            capture.log_once("cannot record a DDP comm hook", exc, then=UNRECORDED_BUCKETS)
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
            capture.log_once("cannot record a DDP bucket", exc, then=UNRECORDED_BUCKETS)
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
                capture.log_once("cannot record a DDP bucket", exc, then=UNRECORDED_BUCKETS)
            return fut.then(_first_of_value) if first else fut

        def done(f):
            t1 = time.monotonic_ns()
            try:
                value = f.value()
            except BaseException:
                _record_quietly(record, comm_id, nbytes, t0, t1, capture.F_ERROR)
                raise             # the reducer sees the error, as without us
            _record_quietly(record, comm_id, nbytes, t0, t1, 0)
            return value[0] if first else value

        return fut.then(done)


def patch(ddp_module, hook, dist) -> None:
    """Patches ddp_module's DistributedDataParallel to record through hook (the
    capture's binding); a module still being imported (a cycle) is left alone."""
    cls = getattr(ddp_module, "DistributedDataParallel", None)
    if cls is None:
        return                    # half imported: not safe to patch
    try:
        dc10d = sys.modules["torch.distributed.distributed_c10d"]
        DDPCapture(hook, dc10d, dist).patch_class(cls)
    except Exception as exc:  # noqa: BLE001
        capture.log_once("cannot patch DistributedDataParallel", exc, then=AS_TORCH_BUILT_IT)
