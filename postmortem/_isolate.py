"""Run a file parser in a forked child, so that a crash or an endless loop inside a C
library (libhdf5 on a corrupt file) becomes an InputError instead of a dead or hung
greyhound.

The child sends its result back through a pipe, pickled (protocol 5): numpy arrays go
out of band, straight into buffers the parent allocates, so a large trace is copied once.
A GreyhoundError raised in the child is raised again in the parent as it was; any other
exception is too, with the child's traceback as a note (it is a bug, not bad input).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import time
import traceback

from greyhound.errors import GreyhoundError, InputError

_LEN = struct.Struct("<Q")


class ReaderFailed(InputError):
    """The parser in the child crashed, exited without an answer, or ran out of time."""


def run_isolated(fn, *args, timeout: float, what: str):
    """``fn(*args)`` in a forked child; its return value or exception here.

    Args:
        timeout: seconds the child may run.
        what: the subject of the error message, e.g. ``"trace.h5: the HDF5 library"``.
    Raises:
        ReaderFailed: the child died from a signal, exited without an answer, or ran
            past ``timeout`` (then it is killed).
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(r)
        code = 0
        try:
            _quiet()
            try:
                result: tuple = ("ok", fn(*args))
            except GreyhoundError as exc:
                result = ("error", exc, None)
            except BaseException as exc:  # noqa: BLE001 - handed to the parent as is
                result = ("error", exc, traceback.format_exc())
            _send(w, result)
        except BaseException:  # noqa: BLE001 - nothing may escape a forked child
            code = 70
        finally:
            os._exit(code)
    os.close(w)
    try:
        deadline = time.monotonic() + timeout
        try:
            payload = _receive(r, deadline)
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            raise ReaderFailed(
                f"{what} did not finish reading the file in {timeout:.0f} s "
                "(a corrupt file can make it loop forever)"
            ) from None
        except EOFError:
            payload = None
    except BaseException:
        _reap(pid, kill=True)
        raise
    finally:
        os.close(r)
    status = _reap(pid, kill=payload is None)
    if payload is None:
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = f"signal {sig}"
            raise ReaderFailed(f"{what} crashed reading the file ({name}; truncated or corrupt?)")
        raise ReaderFailed(f"{what} exited reading the file (status {os.waitstatus_to_exitcode(status)})")
    if payload[0] == "ok":
        return payload[1]
    error, tb = payload[1], payload[2]
    if tb and not isinstance(error, GreyhoundError):
        error.add_note("in the reader's child process:\n" + tb)
    raise error


def _quiet() -> None:
    """The child prints nothing: its answer goes through the pipe, and a crash dump
    (faulthandler, a library's message) would break the CLI's one stderr line."""
    import faulthandler

    faulthandler.disable()
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)


def _send(fd: int, result) -> None:
    buffers: list[pickle.PickleBuffer] = []
    try:
        head = pickle.dumps(result, protocol=5, buffer_callback=buffers.append)
    except Exception as exc:  # noqa: BLE001 - an exception that does not pickle
        head = pickle.dumps(("error", RuntimeError(f"{type(exc).__name__}: {exc}"), traceback.format_exc()))
        buffers = []
    raws = [b.raw() for b in buffers]
    index = pickle.dumps((len(head), [m.nbytes for m in raws]))
    with os.fdopen(fd, "wb", buffering=0) as out:
        chunks: tuple[bytes | memoryview, ...] = (_LEN.pack(len(index)), index, head, *raws)
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            while view:
                view = view[out.write(view):]


def _receive(fd: int, deadline: float):
    """The child's (tag, ...) tuple; EOFError when it closed the pipe early."""
    (n,) = _LEN.unpack(_read_exact(fd, _LEN.size, deadline))
    head_len, sizes = pickle.loads(_read_exact(fd, n, deadline))
    head = _read_exact(fd, head_len, deadline)
    buffers = [_read_exact(fd, size, deadline) for size in sizes]
    return pickle.loads(head, buffers=buffers)


def _read_exact(fd: int, n: int, deadline: float) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError
        k = os.readv(fd, [view[got:]])
        if k == 0:
            raise EOFError
        got += k
    return buf


def _reap(pid: int, *, kill: bool) -> int:
    if kill:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    while True:
        try:
            return os.waitpid(pid, 0)[1]
        except InterruptedError:
            continue
