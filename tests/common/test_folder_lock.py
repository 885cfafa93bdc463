"""One process per state folder (``durable.FolderLock``): a second holder is refused, naming
the first; the lock goes with its holder, released or dead."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ddiloco.common.durable import FolderInUse, FolderLock


def test_a_second_holder_is_refused_naming_the_first_and_a_release_frees_the_folder(tmp_path):
    import os

    first = FolderLock(tmp_path / "outer")
    with pytest.raises(FolderInUse, match=rf"outer is in use by another process \(pid {os.getpid()}\)"):
        FolderLock(tmp_path / "outer")
    first.release()
    first.release()  # idempotent
    FolderLock(tmp_path / "outer").release()


def test_a_killed_holder_leaves_no_lock_behind(tmp_path):
    """The kernel drops a flock with its process, however it ends: a SIGKILLed outer
    optimizer restarts on its folder at once."""
    code = (
        "import sys, os, signal; sys.path.insert(0, sys.argv[2]); from ddiloco.common.durable import FolderLock; "
        "FolderLock(sys.argv[1]); print('held', flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    )
    import ddiloco

    services = str(__import__("pathlib").Path(ddiloco.__file__).parent.parent)
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "outer"), services], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == -9 and done.stdout == "held\n", done.stderr
    FolderLock(tmp_path / "outer").release()
