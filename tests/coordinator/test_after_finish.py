"""Calls that come after the end change nothing: after its Leave, a learner's statistics are
final; after FINISHED, the membership is the one report.json was written from.

* A second Leave is a retry only if it repeats the statistics the first left with; one with
  other statistics is refused NOT_FOUND. Before, it was accepted and overwrote them, so a
  learner that had left could keep raising its counters.
* After FINISHED, a Heartbeat is answered with FINISHED (so the learner drains and leaves)
  and keeps no statistics, renews no lease; a Leave is answered OK and changes nothing; a
  RegisterService is answered OK with FINISHED and moves no address (an outer process
  started then exits once it reads FINISHED). Before, each of them changed what state.json
  saved after the report: the two disagreed, and --reopen continued from figures the report
  never gave.

The coordinators are real processes called over gRPC; the outer optimizer at the end of the
run is a stand-in that answers Finalize, all the coordinator asks it then."""

from __future__ import annotations

import json

import grpc
import pytest
from coord_helpers import LONG_LEASE, OuterAtTheEnd, announce_outer, events, membership, register, running_coordinator
from support import TINY_RUN, wait_until

from ddiloco.common.config import RunConfig
from ddiloco.common.rpc import Server, channel
from ddiloco.coordinator.membership import MemberRecord, Membership
from ddiloco.launcher.processes import Cluster
from ddiloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, outer_pb2_grpc

FINISHED = coordinator_pb2.RUN_STATE_FINISHED
TOKENS_PER_STEP = 4 * 64  # TINY_RUN: batch 4 x context 64


def token(learner_id: int) -> str:
    return f"process-{learner_id}"


def steps(n: int, **more) -> common_pb2.LearnerStats:
    """A learner's report after ``n`` inner steps."""
    return common_pb2.LearnerStats(tokens=n * TOKENS_PER_STEP, inner_steps=n, **more)


def heartbeat(stub, learner_id, stats):
    return stub.Heartbeat(coordinator_pb2.HeartbeatRequest(run_id="run", learner_id=learner_id, stats=stats,
                                                           instance_token=token(learner_id)), timeout=10)


def leave(stub, learner_id, stats):
    return stub.Leave(coordinator_pb2.LeaveRequest(run_id="run", learner_id=learner_id, stats=stats,
                                                   instance_token=token(learner_id)), timeout=10)


def register_outer(stub, address):
    return stub.RegisterService(coordinator_pb2.RegisterServiceRequest(run_id="run", kind="outer", address=address),
                                timeout=10)


def view(stub) -> list:
    """All a call could change, as GetMembership shows it: the run's state and outer
    addresses, and per member its lease, whether it left, its incarnation and statistics."""
    m = membership(stub)
    return [m.state, list(m.outer_shards)] + [
        (x.learner_id, x.alive, x.left, x.incarnation, x.stats.SerializeToString(deterministic=True)) for x in m.members
    ]


# ------------------------------------------------------------------ a second Leave
@pytest.fixture(scope="module")
def left_learner(tmp_path_factory):
    """A coordinator whose learner 0 left after 6 steps; the run goes on (learner 1 stays)."""
    with running_coordinator(tmp_path_factory.mktemp("left"), LONG_LEASE) as (_, stub):
        announce_outer(stub)
        register(stub, requested=0, token=token(0))
        register(stub, requested=1, token=token(1))
        heartbeat(stub, 0, steps(5))
        leave(stub, 0, steps(6))
        yield stub


def test_a_second_leave_with_other_statistics_is_refused_and_changes_nothing(left_learner):
    stub = left_learner
    before = view(stub)
    with pytest.raises(grpc.RpcError) as refused:
        leave(stub, 0, steps(9, bytes_uploaded=10**9))
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND, refused.value.details()
    assert "left the run" in refused.value.details()
    assert view(stub) == before
    assert [x.stats.inner_steps for x in membership(stub).members if x.learner_id == 0] == [6]


def test_a_second_leave_repeating_the_statistics_is_answered_as_a_retry(left_learner):
    stub = left_learner
    before = view(stub)
    leave(stub, 0, steps(6))  # the learner's Leave sent again (its first answer lost): OK
    assert view(stub) == before


# ------------------------------------------------------------------ after FINISHED
def _coordinator_that_stays(cluster: Cluster):
    """The coordinator process as coord_helpers starts it, but without --exit-when-finished:
    it serves after FINISHED until stopped (SIGTERM: it saves its state and exits)."""
    port_file = cluster.out / "coordinator.port"
    proc = cluster.spawn("coordinator", [
        "coordinator", "--bind", "127.0.0.1:0", "--run-dir", str(cluster.out), "--port-file", str(port_file),
        "--insecure", *TINY_RUN, "--learners", "3", "--max-seconds", "1", "--lease-timeout", "1.5"])
    wait_until(lambda: port_file.exists() or proc.returncode() is not None, 60, "the coordinator to start")
    assert proc.returncode() is None, proc.log_path.read_text()[-2000:]
    return proc, coordinator_pb2_grpc.CoordinatorStub(channel(f"127.0.0.1:{int(port_file.read_text())}"))


def _finished_run(tmp_path):
    """A run of 1 s brought to FINISHED: learner 0 left after 12 steps, learner 1 went silent
    after 10 and its lease ran out; the report is written. Returns (cluster, stub, outer, report)."""
    outer = OuterAtTheEnd()
    server = Server("127.0.0.1:0", ["ddiloco.v1.OuterOptimizer"])
    outer_pb2_grpc.add_OuterOptimizerServicer_to_server(outer, server.grpc_server)
    server.start()
    server.set_ready()
    cluster = Cluster(tmp_path)
    try:
        _, stub = _coordinator_that_stays(cluster)
        register_outer(stub, f"127.0.0.1:{server.port}")
        register(stub, requested=0, token=token(0))
        register(stub, requested=1, token=token(1))
        heartbeat(stub, 0, steps(10))
        heartbeat(stub, 1, steps(10))
        leave(stub, 0, steps(12))
        wait_until(lambda: (tmp_path / "report.json").exists(), 60, "the run to finish")
    except BaseException:
        cluster.stop_all()
        server.stop(grace=0)
        raise
    assert membership(stub).state == FINISHED
    return cluster, stub, server, json.loads((tmp_path / "report.json").read_text())


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    path = tmp_path_factory.mktemp("finished")
    cluster, stub, server, report = _finished_run(path)
    yield stub, report, path
    cluster.stop_all()
    server.stop(grace=0)


def test_after_finished_a_heartbeat_is_answered_finished_and_keeps_no_statistics(finished):
    stub, report, _ = finished
    before = view(stub)
    answer = heartbeat(stub, 1, steps(50))  # learner 1's lease ran out before the end; it is still the holder
    assert answer.state == FINISHED  # the learner drains on this
    assert view(stub) == before, "no statistics kept, no lease renewed"
    assert {x.learner_id: x.stats.inner_steps for x in membership(stub).members} == \
        {x["learner_id"]: x["inner_steps"] for x in report["learners"]} == {0: 12, 1: 10}


def test_after_finished_a_leave_is_answered_and_changes_nothing(finished):
    stub, _, _ = finished
    before = view(stub)
    leave(stub, 1, steps(60))  # the holder that never left
    leave(stub, 0, steps(99, bytes_uploaded=10**9))  # one that left already
    assert view(stub) == before


def test_after_finished_register_service_is_answered_finished_and_moves_no_address(finished):
    stub, _, run_dir = finished
    before = view(stub)
    beat = heartbeat(stub, 1, steps(10))
    answer = register_outer(stub, "10.9.9.9:1")
    assert answer.state == FINISHED
    assert view(stub) == before
    assert heartbeat(stub, 1, steps(10)).outer_registrations == beat.outer_registrations
    assert not [e for e in events(run_dir, "outer_registered") if e["address"] == "10.9.9.9:1"], "nothing registered"


def test_after_finished_state_json_keeps_the_figures_report_json_gives(tmp_path):
    cluster, stub, server, report = _finished_run(tmp_path)
    try:
        outer_address = list(membership(stub).outer_shards)
        heartbeat(stub, 1, steps(50))
        leave(stub, 1, steps(60))
        leave(stub, 0, steps(99, bytes_uploaded=10**9))
        register_outer(stub, "10.9.9.9:1")
    finally:
        cluster.stop_all()  # SIGTERM: the coordinator saves its state as it exits
        server.stop(grace=0)
    saved = json.loads((tmp_path / "coordinator" / "state.json").read_text())
    assert saved["state"] == FINISHED and saved["outer_shards"] == outer_address
    restored = Membership(RunConfig.from_json((tmp_path / "config.json").read_text()), tmp_path / "coordinator" / "state.json")
    for row in report["learners"]:
        total = restored.members[row["learner_id"]].total_stats()
        assert {k: total[k] for k in ("tokens", "inner_steps", "bytes_uploaded", "deltas_sent")} == \
            {k: row[k] for k in ("tokens", "inner_steps", "bytes_uploaded", "deltas_sent")}, row["learner_id"]


def test_after_finished_a_lease_that_runs_out_is_not_announced_as_a_death():
    # a learner still beating when the run finished (the drain timed out): its heartbeats renew
    # nothing then and its Leave marks nothing, so its lease runs out; that is not a death
    now = [100.0]
    members = Membership(RunConfig(lease_timeout_s=2.0), None, clock=lambda: now[0])
    members.members[0] = MemberRecord(learner_id=0, shard_index=0, incarnation=1, instance_token="t", last_heartbeat=now[0])
    members.state = FINISHED
    now[0] += 10.0
    assert members.tick() == []
    members.state = coordinator_pb2.RUN_STATE_DRAINING  # the same silence before the end is one
    assert [kind for kind, _ in members.tick()] == ["learner_dead"]

