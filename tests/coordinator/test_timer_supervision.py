"""The coordinator's timer (leases, the budget, the end of the run) never dies silently.

* A full disk fails the state save: logged once (``state_save_failed``), the timer goes on
  expiring leases, and the state is saved again once there is space (``state_saved_again``).
  Before, the first failed save ended the timer thread: the process served on, but no lease
  ever expired and the run never drained. Process-level, on a real full disk (a tiny tmpfs
  over the state folder: needs root; skipped without).
* An unexpected error in the timer stops the coordinator with exit status 1, naming the
  cause, where before the thread died and the process served on. In process: the error is
  injected into the lease bookkeeping (``Membership.tick``), which no input can make raise.
"""

from __future__ import annotations

import os
import pathlib
import sys
import threading

import pytest
from coord_helpers import announce_outer, events, fill_disk, register, start_coordinator
from support import wait_until

from ddiloco.common.config import RunConfig
from ddiloco.coordinator.service import CoordinatorOptions, CoordinatorService


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs (a real full disk) needs root")
def test_a_full_disk_does_not_stop_the_lease_timer_and_the_state_is_saved_once_there_is_space(tmp_path):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "outer"))
    from outer_helpers import Tmpfs  # the outer optimizer's full-disk tests use the same

    disk = Tmpfs(tmp_path / "coordinator", "256k")
    cluster = None
    try:
        cluster, stub = start_coordinator(tmp_path, ["--lease-timeout", "1.5"])
        announce_outer(stub)
        learner = register(stub).learner_id  # saved; from here on it never heartbeats
        filler = fill_disk(tmp_path / "coordinator")  # the disk fills up
        wait_until(lambda: events(tmp_path, "state_save_failed"), 30, "a failed state save")
        wait_until(lambda: events(tmp_path, "learner_dead"), 30, "the lease to expire while saves fail")
        assert [e["learner"] for e in events(tmp_path, "learner_dead")] == [learner]
        assert "ENOSPC" in events(tmp_path, "state_save_failed")[0]["reason"]

        filler.unlink()  # space again
        wait_until(lambda: events(tmp_path, "state_saved_again"), 30, "the state saved again")
        assert len(events(tmp_path, "state_save_failed")) == 1, "logged once per streak, not per tick"
        assert cluster.procs[0].returncode() is None, "a full disk must not stop the coordinator"
    finally:
        if cluster is not None:
            cluster.stop_all()
        disk.unmount()


def test_an_unexpected_error_in_the_timer_stops_the_coordinator_with_exit_status_1(tmp_path, monkeypatch):
    svc = CoordinatorService(RunConfig(), CoordinatorOptions(bind="127.0.0.1:0", run_dir=tmp_path))

    def broken_tick(*_):
        raise ZeroDivisionError("lease arithmetic")

    monkeypatch.setattr(svc.members, "tick", broken_tick)
    svc.start()
    result = []
    waiter = threading.Thread(target=lambda: result.append(svc.wait()), daemon=True)
    waiter.start()
    waiter.join(timeout=60)  # wait() returns only because the failure stopped the service
    if waiter.is_alive():
        svc.stop()
        pytest.fail("the coordinator kept serving after its timer failed")
    assert result == [1]
    assert svc.supervisor.failure == "timer: unexpected ZeroDivisionError: lease arithmetic"
