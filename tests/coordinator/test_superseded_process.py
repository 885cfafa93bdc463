"""A learner process cut off past its lease, whose id another process took meanwhile, is
told to stop at its first heartbeat after the cut heals, and can change nothing of its
successor's record (ddiloco.coordinator.membership, "A process cut off past its lease").

Without this, the old process's heartbeats renewed the successor's lease and filled its
record with the old process's counters, its Leave marked the successor as gone, and both
went on training the same shard and uploading under one id. The coordinator runs as a real
process with a lease of 1.5 s; the lease expires in real time (there is no other way to
reach a real process's lease)."""

from __future__ import annotations

import grpc
import pytest

from ddiloco.v1 import common_pb2, coordinator_pb2

from coord_helpers import announce_outer, coordinator, register, snapshot  # noqa: F401 - fixture


def beat(stub, learner_id, token, tokens=0):
    stats = common_pb2.LearnerStats(tokens=tokens, inner_steps=tokens // 256)
    return stub.Heartbeat(
        coordinator_pb2.HeartbeatRequest(run_id="run", learner_id=learner_id, stats=stats, instance_token=token), timeout=5
    )


def leave(stub, learner_id, token, tokens=0):
    stats = common_pb2.LearnerStats(tokens=tokens, inner_steps=tokens // 256)
    return stub.Leave(
        coordinator_pb2.LeaveRequest(run_id="run", learner_id=learner_id, stats=stats, instance_token=token), timeout=5
    )


def aborted(call) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.ABORTED, info.value
    return info.value.details()


def wait_expired(stub, learner_id: int) -> None:
    from support import wait_until

    def expired():
        m = stub.GetMembership(coordinator_pb2.GetMembershipRequest(), timeout=5)
        return not {x.learner_id: x.alive for x in m.members}[learner_id]

    wait_until(expired, 20, f"learner {learner_id}'s lease to expire", interval=0.1)


def taken_over(stub) -> int:
    """Process "old" holds an id, falls silent past its lease, and process "new" takes the id."""
    announce_outer(stub)
    old = register(stub, token="old")
    wait_expired(stub, old.learner_id)
    new = register(stub, requested=old.learner_id, token="new")
    assert new.learner_id == old.learner_id
    beat(stub, new.learner_id, "new", tokens=512)
    return new.learner_id


def test_the_old_process_heartbeat_is_aborted_and_changes_nothing(coordinator):
    _, stub = coordinator
    learner_id = taken_over(stub)
    before = snapshot(stub)
    details = aborted(lambda: beat(stub, learner_id, "old", tokens=99_840))
    assert f"learner {learner_id} is held by another process (incarnation 2)" in details
    assert snapshot(stub) == before  # neither its counters nor anything else taken in
    beat(stub, learner_id, "new", tokens=768)  # the successor carries on


def test_the_old_process_cannot_leave_for_its_successor(coordinator):
    _, stub = coordinator
    learner_id = taken_over(stub)
    aborted(lambda: leave(stub, learner_id, "old"))
    member = {x.learner_id: x for x in stub.GetMembership(coordinator_pb2.GetMembershipRequest(), timeout=5).members}[learner_id]
    assert not member.left and member.alive and member.incarnation == 2
    leave(stub, learner_id, "new", tokens=512)  # its own process may


def test_a_process_whose_lease_expired_but_kept_its_id_beats_on(coordinator):
    """Cut off past its lease with nobody in its place: still its id, so its heartbeat is
    welcome (alive again), as before."""
    _, stub = coordinator
    announce_outer(stub)
    me = register(stub, token="only")
    wait_expired(stub, me.learner_id)
    beat(stub, me.learner_id, "only", tokens=256)
    m = stub.GetMembership(coordinator_pb2.GetMembershipRequest(), timeout=5)
    assert {x.learner_id: (x.alive, x.incarnation) for x in m.members}[me.learner_id] == (True, 1)


def test_an_oversized_token_is_refused_before_anything_is_read(coordinator):
    _, stub = coordinator
    announce_outer(stub)
    me = register(stub, token="t")
    with pytest.raises(grpc.RpcError) as info:
        beat(stub, me.learner_id, "x" * 129)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "instance_token" in info.value.details()
