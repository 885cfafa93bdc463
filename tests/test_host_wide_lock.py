"""The lock that keeps host-wide test files apart across the suite's workers
(tests/conftest.py) excludes another process while held, and is free once released. On a
lock file of this test's own, so that a worker holding the suite's lock meanwhile cannot
change the outcome."""

from __future__ import annotations

import fcntl
import pathlib
import subprocess
import sys
import textwrap

TESTS = pathlib.Path(__file__).resolve().parent


def _try_lock(path: pathlib.Path) -> bool:
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def test_a_held_lock_excludes_another_process_until_released(tmp_path):
    path = tmp_path / "host-wide.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import pathlib, sys
            sys.path[:0] = [{str(TESTS)!r}, {str(TESTS.parent / "services")!r}]
            from support import host_wide_lock
            with host_wide_lock(pathlib.Path({str(path)!r})):
                print("held", flush=True)
                sys.stdin.readline()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not _try_lock(path), "another process took the lock while it was held"
        holder.stdin.write("release\n")
        holder.stdin.flush()
        assert holder.wait(30) == 0
        assert _try_lock(path), "the lock stayed taken after its holder released it"
    finally:
        if holder.poll() is None:
            holder.kill()


def test_the_holder_may_take_it_again_and_it_is_released_only_by_the_last_exit(tmp_path):
    """A worker whose last test is a host-wide file's tears down its session fixtures (the
    Docker engine's stop takes the lock) while it still holds the lock for that file: a
    lock that is not re-entrant waited for itself there until the test timed out."""
    path = tmp_path / "host-wide.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import pathlib, sys
            sys.path[:0] = [{str(TESTS)!r}, {str(TESTS.parent / "services")!r}]
            from support import host_wide_lock
            outer = host_wide_lock(pathlib.Path({str(path)!r}))
            outer.__enter__()
            with host_wide_lock(pathlib.Path({str(path)!r})):
                print("twice", flush=True)
            print("inner released", flush=True)
            sys.stdin.readline()
            outer.__exit__(None, None, None)
            print("released", flush=True)
            sys.stdin.readline()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "twice"
        assert holder.stdout.readline().strip() == "inner released"
        assert not _try_lock(path), "the inner exit released the lock its holder still holds"
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "released"
        assert _try_lock(path), "the lock stayed taken after the last exit"
        holder.stdin.write("end\n")
        holder.stdin.flush()
        assert holder.wait(30) == 0
    finally:
        if holder.poll() is None:
            holder.kill()


def test_the_long_files_named_for_the_workers_order_exist_and_come_first_whole():
    """tests/conftest.py queues the longest files first (the workers' schedule): a file named
    there that no longer exists would silently fall back to the end of the queue."""
    from support import LONG_FILES, order_files

    for name in LONG_FILES:
        assert (TESTS / name).is_file(), f"tests/conftest.py names {name}, which does not exist"

    class Item:
        def __init__(self, path: str, name: str) -> None:
            self.fspath, self.name = TESTS / path, name

    items = [Item("common/test_a.py", "1"), Item(LONG_FILES[1], "1"), Item("common/test_b.py", "1"),
             Item("common/test_b.py", "2"), Item(LONG_FILES[0], "1"), Item(LONG_FILES[1], "2")]
    order = [(str(i.fspath.relative_to(TESTS)), i.name) for i in order_files(items)]
    assert order == [(LONG_FILES[0], "1"), (LONG_FILES[1], "1"), (LONG_FILES[1], "2"),
                     ("common/test_b.py", "1"), ("common/test_b.py", "2"), ("common/test_a.py", "1")]
