"""The training thread's lower priority: one thread's nice value rises, the process's other
threads keep theirs (they carry the communication it yields to)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from ddiloco.common import priority

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def _in_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", fn()))
    t.start()
    t.join()
    return out["v"]


@linux_only
def test_only_the_calling_thread_is_lowered():
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    after = _in_thread(lambda: priority.lower_this_thread(5))
    assert after == min(priority.MAX_NICE, before + 5)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # this thread unchanged


@linux_only
def test_zero_is_off():
    assert _in_thread(lambda: priority.lower_this_thread(0)) is None


@pytest.mark.parametrize("bad", [-1, 20, 100])
def test_a_value_that_is_not_a_nice_increment_is_refused(bad):
    with pytest.raises(ValueError, match="compute nice must be 0"):
        priority.check(bad)
