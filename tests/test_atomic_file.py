"""greyhound.atomic_file: all or nothing, and no symlink is ever written through."""

from __future__ import annotations

import os

import pytest

from greyhound.atomic_file import atomic_file, write_atomic


def test_writes_the_whole_file_and_leaves_no_temporary(tmp_path):
    write_atomic(tmp_path / "a.json", '{"x": 1}')
    assert (tmp_path / "a.json").read_text() == '{"x": 1}'
    assert os.listdir(tmp_path) == ["a.json"]


def test_an_error_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "a.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_file(target) as f:
        f.write(b"half")
        raise RuntimeError("stop")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["a.bin"]


def test_a_symlink_at_the_target_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    work = tmp_path / "work"
    work.mkdir()
    (work / "out.txt").symlink_to(victim)
    write_atomic(work / "out.txt", "report")
    assert victim.read_text() == "precious"
    assert not (work / "out.txt").is_symlink()
    assert (work / "out.txt").read_text() == "report"


def test_temporary_names_are_not_predictable_and_never_reused(tmp_path, monkeypatch):
    names = []
    real_open = os.open

    def spy(path, flags, mode=0o777, *, dir_fd=None):
        if dir_fd is not None:
            names.append(path)
            assert flags & os.O_EXCL and flags & os.O_NOFOLLOW
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", spy)
    for _ in range(3):
        write_atomic(tmp_path / "t", b"x")
    assert len(set(names)) == 3
    assert not any(str(os.getpid()) in n for n in names)


def test_a_symlinked_parent_directory_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(OSError):
        write_atomic(tmp_path / "link" / "f", "x")
    assert os.listdir(real) == []


def test_mode_is_applied_to_the_new_file(tmp_path):
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "f", "x", mode=0o640)
    finally:
        os.umask(old)
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o640
