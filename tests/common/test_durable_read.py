"""Reading a file of our own (``durable.read_file``): a regular file of at most the size it
can hold, refused otherwise before it is read (a FIFO blocked the reader until a writer
came, /dev/zero and a sparse file read until memory ran out)."""

from __future__ import annotations

import os

import pytest

from ddiloco.common import durable


def test_a_regular_file_within_its_bound_is_read_whole(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    assert durable.read_file(path, 100) == b"x" * 100


def test_a_file_over_its_bound_is_refused_from_its_size_unread(tmp_path):
    path = tmp_path / "sparse"
    with open(path, "wb") as f:
        f.truncate(16 << 30)  # 16 GiB of nothing on disk: reading it would take 16 GiB
    with pytest.raises(durable.FileRefused, match="17,179,869,184 bytes, more than the 1,024 it can hold"):
        durable.read_file(path, 1024)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)
    with pytest.raises(durable.FileRefused, match="not a regular file"):
        durable.read_file(path, 1024)


def test_a_device_is_refused_even_behind_a_symlink(tmp_path):
    link = tmp_path / "state.json"
    link.symlink_to("/dev/zero")
    with pytest.raises(durable.FileRefused, match="not a regular file"):
        durable.read_file(link, 1024)


def test_a_missing_file_raises_what_open_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        durable.read_file(tmp_path / "missing", 1024)
