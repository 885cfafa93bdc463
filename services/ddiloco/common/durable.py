"""Atomic, durable file writes: write a temporary file, fsync it, rename it over the
target, fsync the folder. A crash at any moment leaves either the old or the new file."""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import threading

_unique = itertools.count()


def fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: pathlib.Path, data: bytes) -> None:
    path = pathlib.Path(path)
    # unique per write: two threads saving the same file must not share a temporary
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}-{next(_unique)}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json(path: pathlib.Path, obj) -> None:
    write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())
