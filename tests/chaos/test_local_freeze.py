"""A local freeze returns only once the target has really stopped: ``kill(2)`` with SIGSTOP
returns before a thread busy on another core is descheduled, and a test or schedule that looks
at the target right after the freeze must see it still. Real processes and signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from ddiloco.chaos.local import FaultError, group_threads_states, wait_group_stopped

# a process group of two processes, each with a second thread; every thread spins
SPIN = """
import os, subprocess, sys, threading
def spin():
    while True:
        pass
threading.Thread(target=spin, daemon=True).start()
if sys.argv[1:] == ["parent"]:
    subprocess.Popen([sys.executable, __file__, "child"])
os.write(1, b"up\\n")  # one write, atomic on a pipe: print's two writes interleaved with the other process's
spin()
"""


@pytest.fixture
def spinning_group(tmp_path):
    script = tmp_path / "spin.py"
    script.write_text(SPIN)
    proc = subprocess.Popen([sys.executable, str(script), "parent"], stdout=subprocess.PIPE, start_new_session=True)
    try:  # the group is killed however the set-up ends: its processes spin for ever
        assert [proc.stdout.readline() for _ in range(2)] == [b"up\n"] * 2  # the parent's and the child's
        yield proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_every_thread_of_the_group_is_stopped_when_it_returns(spinning_group):
    os.killpg(spinning_group, signal.SIGSTOP)
    wait_group_stopped(spinning_group)
    states = group_threads_states(spinning_group)
    assert len(states) >= 4 and all(s in "Tt" for s in states), states
    os.killpg(spinning_group, signal.SIGCONT)


def test_a_group_that_does_not_stop_is_a_clear_error(spinning_group):
    with pytest.raises(FaultError, match="did not stop"):
        wait_group_stopped(spinning_group, timeout=0.05)
