"""The coordinator's state lock and saves: never a deadlock, never a lock held across the
model's build, never a change answered UNKNOWN, and the end of a run written even when the
disk refuses it at first.

* A save that waits for the state lock (the timer's) must not hold another lock that a
  request path, which saves while it holds the state lock (Register, Leave,
  RegisterService), waits for. Before, ``save`` took a save lock and then the state lock,
  and the request paths the state lock and then the save lock: each waited for the other,
  and every call that needs the state hung with nothing logged.
* A heartbeat that is the first call to need the run's bounds (a coordinator restarted with
  learners heartbeating, before its warm-up built the model) builds them before it takes the
  state lock. Before, it built them under the lock: every call waited for the torch import
  and the model's build.
* A Register the disk refuses to save is answered UNAVAILABLE, which a learner retries, and
  the retry of the same process is the same registration. Before, the ``StorageError``
  reached the learner as UNKNOWN, which its start-up does not retry, after the coordinator
  had admitted it.
* When the disk refuses the FINISHED state (or ``report.json``) at the end of the run, the
  writes are retried with the outer optimizer's final answers kept, and the run finishes
  once there is space. Before, the state was FINISHED in memory, the end was never tried
  again (it is tried only while draining), no report was written and ``--exit-when-finished``
  never exited.

The full disks are real (a tiny tmpfs: needs root; skipped without). The outer optimizer of
the last test is a stand-in: a real gRPC server answering Finalize, all the coordinator asks
it at the end of a run.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import threading

import grpc
import pytest
from coord_helpers import OuterAtTheEnd, announce_outer, events, fill_disk, membership, register, start_coordinator
from support import wait_until

from ddiloco.common.config import RunConfig
from ddiloco.common.rpc import Server
from ddiloco.coordinator.membership import Membership
from ddiloco.coordinator.service import CoordinatorOptions, CoordinatorService
from ddiloco.v1 import common_pb2, coordinator_pb2, outer_pb2_grpc

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs (a real full disk) needs root")


def _tmpfs(path: pathlib.Path, size: str = "256k"):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "outer"))
    from outer_helpers import Tmpfs  # the outer optimizer's full-disk tests use the same

    return Tmpfs(path, size)


class _WatchedRLock:
    """The membership's lock, telling which threads are waiting to take it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.waiting: set[int] = set()

    def acquire(self, *args, **kwargs) -> bool:
        self.waiting.add(threading.get_ident())
        try:
            return self._lock.acquire(*args, **kwargs)
        finally:
            self.waiting.discard(threading.get_ident())

    def release(self) -> None:
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


def test_a_save_waiting_for_the_state_does_not_deadlock_a_request_that_saves_while_holding_it(tmp_path):
    members = Membership(RunConfig(), tmp_path / "state.json")
    members.lock = lock = _WatchedRLock()
    holding, go = threading.Event(), threading.Event()

    def request() -> None:  # as Register, Leave and RegisterService do: a save under the state lock
        with members.lock:
            holding.set()
            go.wait(60)
            members.save()

    req = threading.Thread(target=request, daemon=True)
    req.start()
    assert holding.wait(30)
    timer = threading.Thread(target=members.save, daemon=True)  # the timer's periodic save
    timer.start()
    wait_until(lambda: timer.ident in lock.waiting, 30, "the timer's save to wait for the state lock")
    go.set()
    req.join(30)
    timer.join(30)
    assert not req.is_alive() and not timer.is_alive(), "the request's save and the timer's wait for each other"
    assert json.loads((tmp_path / "state.json").read_text())["run_id"] == RunConfig().run_id


@needs_root
def test_a_registration_the_disk_refuses_is_answered_unavailable_and_its_retry_is_the_same_registration(tmp_path):
    disk = _tmpfs(tmp_path / "coordinator")
    cluster = None
    try:
        cluster, stub = start_coordinator(tmp_path)
        announce_outer(stub)
        filler = fill_disk(tmp_path / "coordinator")
        with pytest.raises(grpc.RpcError) as refused:
            register(stub, token="the-same-process")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        assert "not saved" in refused.value.details() and "ENOSPC" in refused.value.details()

        filler.unlink()  # space again: the learner's retry
        rec = register(stub, token="the-same-process")
        assert rec.incarnation == 1  # the same process, not a second incarnation
        members = [m for m in membership(stub).members if not m.left]
        assert [(m.learner_id, m.incarnation) for m in members] == [(rec.learner_id, 1)]
        saved = json.loads((tmp_path / "coordinator" / "state.json").read_text())
        assert [m["learner_id"] for m in saved["members"]] == [rec.learner_id]
    finally:
        if cluster is not None:
            cluster.stop_all()
        disk.unmount()


@needs_root
def test_the_end_of_the_run_is_written_once_the_disk_has_space_without_finalizing_twice(tmp_path):
    outer = OuterAtTheEnd()
    server = Server("127.0.0.1:0", ["ddiloco.v1.OuterOptimizer"])
    outer_pb2_grpc.add_OuterOptimizerServicer_to_server(outer, server.grpc_server)
    server.start()
    server.set_ready()
    disk = _tmpfs(tmp_path / "coordinator")
    svc = None
    try:
        svc = CoordinatorService(RunConfig(), CoordinatorOptions(bind="127.0.0.1:0", run_dir=tmp_path))
        svc.members.outer_shards = [f"127.0.0.1:{server.port}"]
        with svc.members.lock:  # every learner has left a draining run: the timer ends it
            svc.members.state = coordinator_pb2.RUN_STATE_DRAINING
            svc.members.drain_started = svc.members.clock()
        filler = fill_disk(tmp_path / "coordinator")
        svc.start()
        wait_until(lambda: outer.finalized and events(tmp_path, "state_save_failed"), 60, "the end refused by the disk")
        assert not svc.finished.is_set()
        assert not (tmp_path / "report.json").exists()

        filler.unlink()
        wait_until(svc.finished.is_set, 60, "the end of the run written once there is space")
        assert outer.finalized == 1, "the outer optimizer's answers are kept, not asked again"
        assert json.loads((tmp_path / "report.json").read_text())["final_eval_loss"] == 1.5
        saved = json.loads((tmp_path / "coordinator" / "state.json").read_text())
        assert saved["state"] == coordinator_pb2.RUN_STATE_FINISHED
    finally:
        if svc is not None:
            svc.stop()
            svc.wait()
        server.stop(grace=0)
        disk.unmount()


def test_a_heartbeat_builds_the_runs_bounds_before_it_takes_the_state_lock(tmp_path):
    from ddiloco.coordinator.membership import MemberRecord

    members = Membership(RunConfig(), None)
    members.members[0] = MemberRecord(learner_id=0, shard_index=0, incarnation=1, instance_token="t",
                                      last_heartbeat=members.clock())
    building, built = threading.Event(), threading.Event()
    build = members.expected_signature

    def slow_build():  # the model's build, held until the test lets it finish
        building.set()
        built.wait(60)
        return build()

    members.expected_signature = slow_build
    beat = threading.Thread(target=lambda: members.heartbeat(RunConfig().run_id, 0, common_pb2.LearnerStats(), "t"),
                            daemon=True)
    beat.start()
    assert building.wait(30)
    answered = threading.Thread(target=members.membership_pb, daemon=True)  # any call that needs the state
    answered.start()
    answered.join(30)
    alive = answered.is_alive()
    built.set()
    beat.join(60)
    assert not alive, "a call that needs the state waited for the model's build"
    assert not beat.is_alive()
