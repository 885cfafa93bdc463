"""While deltas wait for their quorum, the outer optimizer's merge loop waits too: it does
not spin. The grace window is 0 before any learner has reported a step time (and whenever
uploads, merges and downloads take longer than a window), and a loop that polled with a
timeout of 0 then took a whole core, starving the handlers that accept the deltas it waits
for. Measured on the real process: its CPU time over two seconds of waiting."""

from __future__ import annotations

import pathlib
import sys
import time

import pytest

from outer_helpers import Remote, register

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
from common_bench import process_cpu_seconds as _cpu_seconds  # noqa: E402


@pytest.fixture
def outer(tmp_path):
    from support import TINY_RUN, wait_serving, wait_until

    from ddiloco.launcher.processes import Cluster

    cluster = Cluster(tmp_path)
    # M = 2 and quorum 2: one delta alone is never due; no evaluation while it waits
    cluster.start_coordinator([*TINY_RUN, "--learners", "2", "--quorum", "2", "--eval-interval", "600",
                               "--max-seconds", "600", "--run-id", "idle"])
    proc = cluster.start_outer()
    wait_until(cluster.registered_outer, 120, "outer registration")
    wait_serving(cluster.outer_address)
    ids = register(cluster.coordinator_address, 2)
    yield proc, Remote(cluster.outer_address, "idle", ids[0])
    cluster.stop_all()


def test_a_delta_waiting_for_its_quorum_costs_no_cpu(outer):
    proc, learner = outer
    learner.push(seq=1)  # no step time reported (compute_seconds 0): the grace window is 0
    assert learner.status().pending_deltas == 1
    time.sleep(0.5)  # let the push's own work finish (not synchronisation: only the measure's start)
    cpu0, t0 = _cpu_seconds(proc.popen.pid), time.monotonic()
    time.sleep(2.0)  # the interval measured
    used, wall = _cpu_seconds(proc.popen.pid) - cpu0, time.monotonic() - t0
    assert learner.status().pending_deltas == 1  # still waiting: nothing merged it meanwhile
    # a spinning loop takes most of a core (about 2 s here); waiting takes a few hundredths
    assert used < 0.25 * wall, f"the outer process used {used:.2f} s of CPU in {wall:.2f} s while only waiting"
