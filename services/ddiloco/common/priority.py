"""Compute yields to communication: the training thread runs at a lower CPU priority.

A learner's overlap (the steps it trains on the old base between sending a window and
folding the merged version) is what asynchrony costs in quality (docs/algorithm.md, "The
M = 4 gap"). On a host whose cores the training saturates (CPU training; several services
on one machine, as ``ddiloco run`` starts them) every part of that path waits for a core:
the learner's own upload and pull threads, the outer optimizer's merge, the coordinator's
leases. Those are short and latency-bound; the training step is throughput work. Raising
the training thread's nice value lets the short work run the moment it is ready and costs
the training only the CPU that work takes anyway. On a GPU host the training thread mostly
waits for the device, and nothing changes.

Linux only: there ``setpriority(PRIO_PROCESS, tid)`` sets one thread's nice value (other
systems apply it to the whole process, which would slow the communication too). Raising a
nice value needs no privilege; lowering one does, so a process cannot undo it.
"""

from __future__ import annotations

import os
import sys
import threading

MAX_NICE = 19  # the lowest priority Linux has


def check(nice: int) -> None:
    """Raise ``ValueError`` for a value that is not a nice increment."""
    if not 0 <= nice <= MAX_NICE:
        raise ValueError(f"compute nice must be 0 (off) to {MAX_NICE}, got {nice}")


def lower_this_thread(nice: int) -> int | None:
    """Raise the calling thread's nice value by ``nice``; the thread's nice value after it, or
    None where threads have no priority of their own (not Linux) or ``nice`` is 0."""
    check(nice)
    if nice == 0 or not sys.platform.startswith("linux"):
        return None
    tid = threading.get_native_id()
    now = os.getpriority(os.PRIO_PROCESS, tid)
    os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, now + nice))
    return os.getpriority(os.PRIO_PROCESS, tid)
