"""Atomic, durable file writes: write a temporary file, fsync it, rename it over the
target, fsync the folder. A crash at any moment leaves either the old or the new file.

A write that fails (disk full, read-only file system, I/O error) raises ``StorageError``,
which names the path and the errno, and removes its temporary file: a failed write leaves
the folder exactly as it was. A crash can still leave a temporary behind (the process dies
before it can clean up); ``remove_temporaries`` clears those at the next start.

A JSON record that a restart trusts (a checkpoint's state, a merge record) is sealed: it
carries the SHA-256 of its other fields (``seal``), so that damage which still parses (a
lost digit, a dropped list entry) is found on reading (``seal_holds``) instead of restored
as truth. Atomic writes rule out torn files, not a disk that changes bytes.
"""

from __future__ import annotations

import errno as errno_mod
import hashlib
import itertools
import json
import os
import pathlib
import stat
import threading
from typing import Callable

_unique = itertools.count()
TMP_MARK = ".tmp"  # every temporary this module (and the checkpoint writer) makes has it in its name


class StorageError(OSError):
    """A durable write failed; nothing was replaced. Still an ``OSError`` for old callers."""

    def __init__(self, path: pathlib.Path, cause: OSError) -> None:
        code = cause.errno if cause.errno is not None else errno_mod.EIO
        super().__init__(code, cause.strerror or str(cause))
        self.path = pathlib.Path(path)

    def __str__(self) -> str:
        name = errno_mod.errorcode.get(self.errno, "?")
        return f"cannot write {self.path}: [Errno {self.errno} {name}] {self.strerror}"


# What a file of our own holds at most, by kind: a reader takes no more (a sparse file or a
# device in its place is refused from its size or type, not read until memory runs out)
MAX_RECORD_BYTES = 64 << 20  # a JSON record: a checkpoint's state, a merge record, state.json
MAX_NAME_BYTES = 4096  # a file naming another (LATEST)


class FileRefused(OSError):
    """A file is not one to read: not a regular file, or larger than it can be."""


def read_file(path: pathlib.Path, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path``: ``FileRefused`` if it is something else (a
    FIFO would block the reader until a writer came; /dev/zero never ends) or holds more than
    ``max_bytes`` (checked from its size before anything is read: a sparse file of 16 GB
    reads as 16 GB of zeros). Other ``OSError`` as ``open`` raises them."""
    path = pathlib.Path(path)
    # O_NONBLOCK: opening a FIFO for reading blocks until it has a writer; a regular file's
    # reads ignore the flag
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(errno_mod.EINVAL, "not a regular file", str(path))
        if st.st_size > max_bytes:
            raise FileRefused(errno_mod.EFBIG, f"{st.st_size:,} bytes, more than the {max_bytes:,} it can hold", str(path))
        chunks, left = [], max_bytes + 1  # one byte more: a file that grew since is refused too
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise FileRefused(errno_mod.EFBIG, f"more than the {max_bytes:,} bytes it can hold", str(path))
    return data


def fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: pathlib.Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def temporary_name(path: pathlib.Path) -> pathlib.Path:
    """A fresh hidden name next to ``path``: unique per write, so two threads saving the same
    file never share a temporary."""
    path = pathlib.Path(path)
    return path.with_name(f".{path.name}{TMP_MARK}-{os.getpid()}-{threading.get_ident()}-{next(_unique)}")


def write_bytes(path: pathlib.Path, data: bytes) -> None:
    path = pathlib.Path(path)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # the folder itself is gone or unwritable; the next start cleans up
        if isinstance(exc, StorageError):
            raise
        raise StorageError(path, exc) from exc


SEAL = "sealed_sha256"  # the field a sealed record keeps the digest of the others in


def _json_digest(obj: dict) -> str:
    rest = {k: v for k, v in obj.items() if k != SEAL}
    # canonical: sorted keys; JSON floats round-trip, so the digest of what is read back
    # is the digest of what was written
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def seal(obj: dict) -> dict:
    """``obj`` with the SHA-256 of its fields added (``SEAL``)."""
    return {**obj, SEAL: _json_digest(obj)}


def seal_holds(obj: dict) -> bool | None:
    """Whether a record read back is the one sealed: True or False; None for a record
    without a seal (written before records were sealed), which the caller accepts as before."""
    if SEAL not in obj:
        return None
    return obj[SEAL] == _json_digest(obj)


def write_json(path: pathlib.Path, obj) -> None:
    write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def remove_temporaries_of(path: pathlib.Path) -> list[pathlib.Path]:
    """Delete the temporaries torn writes of ``path`` left (``temporary_name``'s), and no
    other file's: for a folder other processes write to. Call it only when no write of
    ``path`` can be in flight. Returns what it removed."""
    path = pathlib.Path(path)
    prefix = f".{path.name}{TMP_MARK}-"
    return _remove_where(path.parent, lambda p: p.name.startswith(prefix) and p.is_file())


def remove_temporaries(folder: pathlib.Path) -> list[pathlib.Path]:
    """Delete what torn writes left in ``folder`` (hidden names containing ``.tmp``): call it
    only at start, when no write of this process can be in flight. Returns what it removed."""
    return _remove_where(pathlib.Path(folder), lambda p: p.name.startswith(".") and TMP_MARK in p.name)


def _remove_where(folder: pathlib.Path, chosen: Callable[[pathlib.Path], bool]) -> list[pathlib.Path]:
    import shutil

    removed: list[pathlib.Path] = []
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        if chosen(p):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


class FolderInUse(Exception):
    """Another live process holds a service's state folder (``FolderLock``)."""

    def __init__(self, folder: pathlib.Path, holder: str) -> None:
        super().__init__(
            f"{folder} is in use by another process ({holder}): two processes serving from one folder would "
            "overwrite each other's journal and merge records; stop the other one first"
        )
        self.folder = pathlib.Path(folder)


class FolderLock:
    """An exclusive lock on ``folder`` for this process's life (``flock`` on ``folder/LOCK``):
    a second process that would serve from the same folder is refused at start with
    ``FolderInUse``. The kernel drops the lock when its holder dies, however it dies, so a
    crashed process never leaves a stale one; the file itself stays, naming the last holder."""

    NAME = "LOCK"

    def __init__(self, folder: pathlib.Path) -> None:
        import fcntl

        self.folder = pathlib.Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.folder / self.NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            try:
                holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(self._fd)
                self._fd = None
            if exc.errno in (errno_mod.EWOULDBLOCK, errno_mod.EAGAIN):
                raise FolderInUse(self.folder, f"pid {holder}") from None
            raise StorageError(self.folder / self.NAME, exc) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Idempotent; closing the descriptor drops the lock."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
