"""A learner holds at most ``MAX_PUSH_STREAMS`` upload streams open at once on a real outer
optimizer (common/slots.py): an upload stream holds a server thread until its last
chunk, and the rate limit bounds how often a learner calls, not how many streams it keeps
open. One more is RESOURCE_EXHAUSTED (which learners retry after their backoff) and changes
nothing; other learners are not affected; a stream that ends frees its place."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from ddiloco.common import codec
from ddiloco.common.rpc import channel
from ddiloco.common.wire import payload_info, stream_messages
from ddiloco.outer.service import MAX_PUSH_STREAMS
from ddiloco.v1 import outer_pb2, outer_pb2_grpc

RUN = "streams-run"


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    from outer_helpers import serving_run

    yield from serving_run(tmp_path_factory.mktemp("streams"), RUN)


class Pusher:
    """Delta streams of one learner over a real channel."""

    def __init__(self, address: str, learner: int) -> None:
        self.learner = learner
        self.stub = outer_pb2_grpc.OuterOptimizerStub(channel(address))
        self.specs = None
        chunks = list(self.stub.PullGlobal(
            outer_pb2.PullGlobalRequest(run_id=RUN, learner_id=learner, have_version=-1, fragment=0), timeout=30))
        info = chunks[0].header.payload
        self.version = chunks[0].header.version
        self.specs = [(t.name, tuple(t.shape)) for t in info.tensors]

    def messages(self, seq: int, damaged: bool = False):
        rng = np.random.default_rng(seq)
        arrays = [(n, rng.uniform(-1e-3, 1e-3, size=s).astype(np.float32)) for n, s in self.specs]
        enc = codec.encode(arrays, "int8", 64)
        header = outer_pb2.DeltaHeader(run_id=RUN, learner_id=self.learner, base_version=self.version,
                                       tokens=5 * 4 * 64, inner_steps=5, seq=seq, payload=payload_info(enc))
        payload = bytearray(enc.payload)
        if damaged:
            payload[len(payload) // 2] ^= 0xFF  # fails its checksum: refused, whatever else it is
        return list(stream_messages(outer_pb2.DeltaChunk, header, bytes(payload), 4096))

    def probe(self, seq: int) -> grpc.StatusCode:
        """The status of a push that can never be accepted: RESOURCE_EXHAUSTED while the
        learner holds every stream it may, else DATA_LOSS (its checksum fails)."""
        try:
            self.stub.PushDelta(iter(self.messages(seq, damaged=True)), timeout=30)
        except grpc.RpcError as exc:
            return exc.code()
        raise AssertionError("a damaged delta was accepted")

    def held_open(self, seq: int, release: threading.Event):
        """A push whose header and first chunk go at once, the rest once ``release`` is set."""
        msgs = self.messages(seq)

        def stream():
            yield msgs[0]
            release.wait(60)
            yield from msgs[1:]

        return self.stub.PushDelta.future(stream(), timeout=120)

    def push(self, seq: int):
        return self.stub.PushDelta(iter(self.messages(seq)), timeout=30)

    def last_seq(self) -> int:
        status = self.stub.GetStatus(outer_pb2.StatusRequest(), timeout=5)
        return next((r.last_seq for r in status.learners if r.learner_id == self.learner), 0)


def test_one_stream_more_than_a_learner_may_hold_is_refused_and_a_finished_one_frees_its_place(system):
    from support import wait_until

    cluster, (a, b) = system
    pa, pb = Pusher(cluster.outer_address, a), Pusher(cluster.outer_address, b)
    releases = [threading.Event() for _ in range(MAX_PUSH_STREAMS)]
    seqs = range(1, MAX_PUSH_STREAMS + 1)
    held = [pa.held_open(seq, r) for seq, r in zip(seqs, releases)]

    def holding() -> bool:
        # a probe that reaches the server before a held stream's header takes its place,
        # and that stream is refused: open it again (a refused stream changed nothing)
        for i, (seq, release) in enumerate(zip(seqs, releases)):
            if held[i].done() and held[i].exception() is not None:
                assert held[i].exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED, held[i].exception()
                held[i] = pa.held_open(seq, release)
        return pa.probe(MAX_PUSH_STREAMS + 1) == grpc.StatusCode.RESOURCE_EXHAUSTED

    # the server holds both once it has read their headers: wait for that, not a while (a
    # probe can never be accepted, so it changes nothing whichever way it is answered)
    wait_until(holding, 30, "the held streams")
    with pytest.raises(grpc.RpcError) as err:
        pa.push(MAX_PUSH_STREAMS + 1)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"already holds {MAX_PUSH_STREAMS} upload streams open" in err.value.details()
    assert pa.last_seq() == 0  # nothing accepted meanwhile
    assert pb.push(1).outcome == outer_pb2.PUSH_OUTCOME_ACCEPTED  # another learner is not held up
    for release, future in zip(releases, held):  # in sequence order: a learner's sequence only grows
        release.set()
        assert future.result(timeout=60).outcome == outer_pb2.PUSH_OUTCOME_ACCEPTED
    assert pa.last_seq() == MAX_PUSH_STREAMS
    # the places are free again once the finished calls are released
    wait_until(lambda: pa.probe(MAX_PUSH_STREAMS + 1) == grpc.StatusCode.DATA_LOSS, 30, "the streams released")
    assert pa.push(MAX_PUSH_STREAMS + 1).outcome == outer_pb2.PUSH_OUTCOME_ACCEPTED
    assert pa.last_seq() == MAX_PUSH_STREAMS + 1


def _silent_pushes(address: str, n: int, release: threading.Event) -> list:
    """``n`` upload streams that open and send no message until ``release`` is set (then end),
    with no deadline, as any client may open them."""

    def nothing():
        release.wait(120)
        return
        yield  # a generator that yields nothing

    stub = outer_pb2_grpc.OuterOptimizerStub(channel(address))
    return [stub.PushDelta.future(nothing()) for _ in range(n)]


def test_streams_that_never_send_a_message_take_nothing_from_the_other_calls(system):
    """More silent upload streams than the server has threads (16 + 4 per learner): before
    their first message they share the bound of all uploads together (2 per learner; in a
    run with certificates, each its learner's own), every further one is RESOURCE_EXHAUSTED
    at once, and the status, a download and the health check answer meanwhile. Before, each
    held a thread, and the whole service stopped answering until they ended."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from support import wait_until

    cluster, (a, b) = system
    release = threading.Event()
    calls = _silent_pushes(cluster.outer_address, 16 + 4 * 2 + 1, release)
    try:
        refused = lambda: sum(c.done() and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for c in calls)  # noqa: E731
        wait_until(lambda: refused() == len(calls) - MAX_PUSH_STREAMS * 2, 30, "the streams beyond the bound refused")
        stub = outer_pb2_grpc.OuterOptimizerStub(channel(cluster.outer_address))
        assert stub.GetStatus(outer_pb2.StatusRequest(), timeout=10).ready
        assert Pusher(cluster.outer_address, b).version >= 0  # a whole download
        health = health_pb2_grpc.HealthStub(channel(cluster.outer_address))
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        assert "upload streams are open already (2 per learner of the run)" in next(
            c.details() for c in calls if c.done()
        )
    finally:
        release.set()
    for c in calls:  # ended without a message: nothing to accept, nothing changed
        assert c.exception(timeout=60) is not None
    pa = Pusher(cluster.outer_address, a)
    assert pa.push(pa.last_seq() + 1).outcome == outer_pb2.PUSH_OUTCOME_ACCEPTED  # uploads go on


def test_a_stream_silent_for_the_first_message_deadline_is_cancelled(system):
    """A caller that opens an upload and sends nothing has its call cancelled after
    ``FIRST_MESSAGE_S``, which frees its thread and its slot, whatever keepalive says of its
    connection (a live but silent client passes keepalive)."""
    from ddiloco.outer.service import FIRST_MESSAGE_S

    cluster, _ = system
    release = threading.Event()
    (call,) = _silent_pushes(cluster.outer_address, 1, release)
    try:
        err = call.exception(timeout=FIRST_MESSAGE_S + 30)  # waits for the cancel itself
        assert err is not None and err.code() == grpc.StatusCode.CANCELLED, err
    finally:
        release.set()
