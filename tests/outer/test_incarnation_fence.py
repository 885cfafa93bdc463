"""The outer optimizer fences replaced learner processes (ddiloco.outer.known_learners).

A learner process cut off from the coordinator past its lease (a partitioned node) may still
reach the outer optimizer while another process holds its id. Its deltas name the
incarnation it registered as (``DeltaHeader.incarnation``); once its successor has read where
it resumes (``StatusRequest.incarnation``), every delta of the old process is ABORTED and
changes nothing, so the two can neither train the shard twice nor collide on sequence
numbers. Real coordinator and outer optimizer processes over gRPC; the coordinator's lease is
1.5 s and expires in real time (there is no other way to reach a real process's lease).
"""

from __future__ import annotations

import hashlib
import threading

import grpc
import pytest

from ddiloco.common.rpc import channel
from ddiloco.common.wire import stream_messages
from ddiloco.v1 import coordinator_pb2, coordinator_pb2_grpc, outer_pb2, outer_pb2_grpc
from outer_helpers import make_delta

RUN = "fence-run"


@pytest.fixture
def run(tmp_path):
    """(cluster, coordinator stub, outer stub): a real coordinator (lease 1.5 s) and outer."""
    from support import TINY_RUN, wait_serving, wait_until

    from ddiloco.launcher.processes import Cluster

    cluster = Cluster(tmp_path)
    cluster.start_coordinator(
        [*TINY_RUN, "--learners", "2", "--max-seconds", "600", "--run-id", RUN, "--lease-timeout", "1.5"]
    )
    try:
        cluster.start_outer()
        wait_until(cluster.registered_outer, 120, "outer registration")
        wait_serving(cluster.outer_address)
        coord = coordinator_pb2_grpc.CoordinatorStub(channel(cluster.coordinator_address))
        outer = outer_pb2_grpc.OuterOptimizerStub(channel(cluster.outer_address))
        yield cluster, coord, outer
    finally:
        cluster.stop_all()


def register(coord, token: str, requested: int = -1) -> coordinator_pb2.RegisterResponse:
    """Register as learner process ``token`` would."""
    from ddiloco.common.config import RunConfig
    from ddiloco.coordinator.signature import model_signature

    config = RunConfig.from_json(coord.GetRunConfig(coordinator_pb2.GetRunConfigRequest(), timeout=5).config_json)
    return coord.Register(
        coordinator_pb2.RegisterRequest(
            address="x:1", requested_learner_id=requested, instance_token=token, model=model_signature(config)
        ),
        timeout=10,
    )


def wait_expired(coord, learner_id: int) -> None:
    from support import wait_until

    def expired():
        m = coord.GetMembership(coordinator_pb2.GetMembershipRequest(), timeout=5)
        return not {x.learner_id: x.alive for x in m.members}[learner_id]

    wait_until(expired, 20, f"learner {learner_id}'s lease to expire", interval=0.1)


def specs(outer) -> tuple[int, list]:
    """(fragment 0's version, its tensors' names and shapes), from a full download."""
    from ddiloco.common.wire import decode_payload, reassemble

    stream = outer.PullGlobal(outer_pb2.PullGlobalRequest(run_id=RUN, learner_id=0, have_version=-1), timeout=30)
    header, payload = reassemble(stream, 1 << 30, "global parameters")
    arrays = decode_payload(header.payload, payload)
    return header.version, [(n, a.shape) for n, a in arrays]


def delta(outer, learner: int, seq: int, incarnation: int):
    version, shapes = specs(outer)
    header, payload = make_delta(shapes, RUN, learner, seq, version, seed=seq)
    header.incarnation = incarnation
    return header, payload


def push(outer, header, payload, chunk: int = 1 << 12):
    return outer.PushDelta(stream_messages(outer_pb2.DeltaChunk, header, payload, chunk), timeout=30)


def position(outer, learner: int, incarnation: int) -> outer_pb2.OuterStatus:
    return outer.GetStatus(outer_pb2.StatusRequest(learner_id=learner, incarnation=incarnation), timeout=10)


def refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value
    return info.value.details()


def observed(outer, learner: int = 0) -> tuple:
    """What a refused delta must leave unchanged: versions, per-learner positions and the
    served parameters."""
    st = outer.GetStatus(outer_pb2.StatusRequest(), timeout=10)
    learners = sorted((r.learner_id, r.last_seq, r.deltas_accepted, r.tokens_accepted) for r in st.learners)
    stream = outer.PullGlobal(outer_pb2.PullGlobalRequest(run_id=RUN, learner_id=learner, have_version=-1), timeout=30)
    params = hashlib.sha256(b"".join(bytes(c.data) for c in stream)).hexdigest()
    return st.version, st.pending_deltas, learners, params


def journaled(cluster, learner: int, seq: int) -> list:
    return list(cluster.out.rglob(f"{learner:05d}-{seq:010d}.delta"))


def replaced(coord, outer) -> int:
    """Process "old" (incarnation 1) holds id 0 and has one delta accepted; it falls silent
    past its lease, and process "new" takes the id (incarnation 2)."""
    old = register(coord, "old")
    assert old.incarnation == 1
    push(outer, *delta(outer, old.learner_id, 1, incarnation=1))
    wait_expired(coord, old.learner_id)
    new = register(coord, "new", requested=old.learner_id)
    assert (new.learner_id, new.incarnation) == (old.learner_id, 2)
    return new.learner_id


def test_once_the_successor_read_its_position_the_old_process_delta_is_aborted_and_changes_nothing(run):
    cluster, coord, outer = run
    learner = replaced(coord, outer)
    mine = next(r for r in position(outer, learner, 2).learners if r.learner_id == learner)
    assert mine.last_seq == 1  # the old process's accepted delta is part of where it resumes
    before = observed(outer)

    details = refused(lambda: push(outer, *delta(outer, learner, 2, incarnation=1)), grpc.StatusCode.ABORTED)
    assert f"learner {learner} incarnation 1 was replaced by incarnation 2" in details
    header, _ = delta(outer, learner, 2, incarnation=1)
    refused(lambda: outer.UploadOffset(outer_pb2.UploadOffsetRequest(header=header), timeout=10), grpc.StatusCode.ABORTED)
    assert observed(outer) == before
    assert journaled(cluster, learner, 2) == []

    # the successor's own sequence goes on from its position, without a collision
    assert push(outer, *delta(outer, learner, 2, incarnation=2)).outcome == outer_pb2.PUSH_OUTCOME_ACCEPTED


def test_a_delta_streaming_while_its_process_is_replaced_is_not_committed(run):
    """Admitted while process 1 still held the id, its payload still on the way when
    process 2 registers and reads its position: the fence checked as the delta commits
    refuses it, and its journal entry is removed (it was never acknowledged)."""
    cluster, coord, outer = run
    old = register(coord, "old")
    push(outer, *delta(outer, old.learner_id, 1, incarnation=1))
    header, payload = delta(outer, old.learner_id, 2, incarnation=1)
    messages = list(stream_messages(outer_pb2.DeltaChunk, header, payload, 1 << 12))
    assert len(messages) >= 3
    held = threading.Event()
    result: dict = {}

    def stream():
        yield messages[0]  # the header
        yield messages[1]
        held.wait(60)  # the rest once the replacement has read its position
        yield from messages[2:]

    def upload():
        try:
            result["response"] = outer.PushDelta(stream(), timeout=60)
        except grpc.RpcError as exc:
            result["error"] = exc

    uploading = threading.Thread(target=upload)
    uploading.start()
    try:
        wait_expired(coord, old.learner_id)
        new = register(coord, "new", requested=old.learner_id)
        position(outer, new.learner_id, new.incarnation)
        before = observed(outer)
    finally:
        held.set()
        uploading.join(60)
    assert "response" not in result, result
    assert result["error"].code() == grpc.StatusCode.ABORTED, result["error"]
    assert observed(outer) == before
    assert journaled(cluster, old.learner_id, 2) == []


def test_an_incarnation_the_coordinator_never_registered_is_refused(run):
    _, coord, outer = run
    learner = register(coord, "only").learner_id
    before = observed(outer)
    details = refused(lambda: push(outer, *delta(outer, learner, 1, incarnation=7)), grpc.StatusCode.PERMISSION_DENIED)
    assert f"learner {learner} incarnation 7 is not registered with the coordinator (it holds incarnation 1)" in details
    refused(lambda: position(outer, learner, 7), grpc.StatusCode.PERMISSION_DENIED)
    details = refused(lambda: push(outer, *delta(outer, learner, 1, incarnation=-1)), grpc.StatusCode.INVALID_ARGUMENT)
    assert "incarnation must be 0 (not stated) or the Register answer's" in details
    refused(lambda: position(outer, learner, -3), grpc.StatusCode.INVALID_ARGUMENT)
    assert observed(outer) == before
    assert push(outer, *delta(outer, learner, 1, incarnation=1)).outcome == outer_pb2.PUSH_OUTCOME_ACCEPTED
