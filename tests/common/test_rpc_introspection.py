"""The server's own services, grpc.health.v1 and reflection, over a real mutual-TLS server:
authorized like every other method (a revoked certificate is UNAUTHENTICATED), and their
long-lived streams bounded per caller and in total, so that no caller can hold the worker
threads the services' own calls need."""

from __future__ import annotations

import queue

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ddiloco.common import errors
from ddiloco.common.certs import revoke, setup_run
from ddiloco.common.rpc import STREAMS_PER_CALLER, Server, channel, hold_stream
from ddiloco.common.slots import Slots
from ddiloco.common.security import Security

WORKERS = 16  # a coordinator's


@pytest.fixture(scope="module")
def run_ca(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    setup_run(folder, 1)  # coordinator, outer, operator, learner-0, learner-1
    revoke(folder, name="learner-0")
    return folder


@pytest.fixture(scope="module")
def server(run_ca):
    security = Security.from_dir(run_ca / "coordinator", "coordinator", run_ca / "revoked.txt")
    srv = Server("127.0.0.1:0", ["ddiloco.v1.Test"], max_workers=WORKERS, security=security)
    srv.start()
    srv.set_ready()
    yield srv
    srv.stop(grace=0.5)


def dial(srv: Server, folder) -> grpc.Channel:
    return channel(f"127.0.0.1:{srv.port}", Security.from_dir(folder), "coordinator")


def code_of(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


class Reflection:
    """One reflection stream, opened and asked one question; left open, idle, as a client
    that never sends its next request leaves it."""

    def __init__(self, ch: grpc.Channel) -> None:
        self.requests: queue.Queue = queue.Queue()
        self.call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter(self.requests.get, None), timeout=30)
        self.requests.put(reflection_pb2.ServerReflectionRequest(list_services=""))
        try:
            next(self.call)  # the server's thread answered, and now waits for the next request
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.code = exc.code()

    def close(self) -> None:
        self.requests.put(None)
        self.call.cancel()


def test_a_revoked_certificate_gets_no_health_or_reflection(run_ca, server):
    with dial(server, run_ca / "learner-0") as revoked, dial(server, run_ca / "operator") as operator:
        health = health_pb2_grpc.HealthStub(revoked)
        assert code_of(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: next(health.Watch(health_pb2.HealthCheckRequest(), timeout=10))) == (
            grpc.StatusCode.UNAUTHENTICATED)
        stream = Reflection(revoked)
        stream.close()
        assert stream.code == grpc.StatusCode.UNAUTHENTICATED
        # the others of the run are answered as before
        answer = health_pb2_grpc.HealthStub(operator).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_idle_reflection_streams_cannot_take_the_threads_the_services_need(run_ca, server):
    """One caller opens as many idle reflection streams as the server has threads: it holds
    only STREAMS_PER_CALLER of them, the rest are refused at once; other callers share what
    is left of a quarter of the threads; an operator's call still answers within 5 s."""
    held: list[Reflection] = []
    channels = [dial(server, run_ca / name) for name in ("learner-1", "outer", "operator")]
    greedy, other, operator = channels
    try:
        for _ in range(WORKERS):
            held.append(Reflection(greedy))
        codes = [s.code for s in held]
        assert codes.count(grpc.StatusCode.OK) == STREAMS_PER_CALLER
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == WORKERS - STREAMS_PER_CALLER
        # another caller takes the rest of the quarter (16 // 4 = 4 streams in all), then a
        # third is refused: the total bound
        held += [Reflection(other) for _ in range(STREAMS_PER_CALLER)]
        assert [s.code for s in held[-STREAMS_PER_CALLER:]] == [grpc.StatusCode.OK] * STREAMS_PER_CALLER
        held.append(Reflection(operator))
        assert held[-1].code == grpc.StatusCode.RESOURCE_EXHAUSTED
        answer = health_pb2_grpc.HealthStub(operator).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for s in held:
            s.close()
    # a stream's slot is given back when it ends
    assert server.streams.wait_held(0, timeout=30)
    again = Reflection(operator)
    again.close()
    assert again.code == grpc.StatusCode.OK
    for ch in channels:
        ch.close()


def test_a_stream_over_its_callers_bound_or_everyones_is_refused_with_which():
    slots = Slots(STREAMS_PER_CALLER, 3)
    held = [hold_stream(slots, "a") for _ in range(STREAMS_PER_CALLER)]
    with pytest.raises(errors.ResourceExhausted, match=f"a already holds {STREAMS_PER_CALLER}"):
        hold_stream(slots, "a")
    held.append(hold_stream(slots, "b"))
    with pytest.raises(errors.ResourceExhausted, match="3 health/reflection streams are open"):
        hold_stream(slots, "c")
    held[0]()
    hold_stream(slots, "c")
