"""Files written all or nothing, safe in a directory that someone else can write to.

Every file greyhound writes for later readers (a merged trace, a report, a
checkpoint's index) goes through :func:`atomic_file`: the content is written under an
unpredictable name beside the target, created with ``O_EXCL | O_NOFOLLOW`` relative to
a descriptor of the directory, and renamed over the target only when it is complete.
A reader never sees half a file; a symlink planted at the target or at any temporary
name is never followed (the rename replaces a symlink, it does not write through it);
and the directory cannot be swapped for another between the create and the rename.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO


def open_dir(path: str | os.PathLike) -> int:
    """A descriptor of the directory ``path`` (its last component must not be a symlink)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, *, mode: int = 0o600, text: bool = False) -> Iterator[IO]:
    """Yields a new file open for writing; on a clean exit it replaces ``path``.

    On an exception the temporary file is removed and ``path`` is left as it was.
    ``mode`` is applied to the new file (the umask still narrows it). Libraries that
    insist on a file name (h5py) can write through ``/proc/self/fd/N`` of the yielded
    file's ``fileno()``, which names this open file, not a path that could be swapped.
    """
    path = Path(path)
    dir_fd = open_dir(path.parent)
    tmp_name = f".{path.name}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     mode, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "w" if text else "wb", encoding="utf-8" if text else None) as f:
                yield f
            os.replace(tmp_name, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name, dir_fd=dir_fd)
            raise
    finally:
        os.close(dir_fd)


def write_atomic(path: str | os.PathLike, data: str | bytes, *, mode: int = 0o600) -> None:
    """Writes ``data`` (str as UTF-8) to ``path`` all or nothing (see :func:`atomic_file`)."""
    with atomic_file(path, mode=mode, text=isinstance(data, str)) as f:
        f.write(data)
