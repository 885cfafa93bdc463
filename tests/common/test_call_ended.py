"""``rpc.call_ended``: inside a servicer, whether the caller's call has ended (the caller
cancelled, or its process died) or is still waiting for an answer. Over a real gRPC socket,
with a bare server of one client-streaming method (the outer optimizer's use of it is
tested in tests/outer/test_bad_input.py)."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from ddiloco.common.rpc import call_ended

METHOD = "/test.Streams/Push"


class Handler:
    def __init__(self) -> None:
        self.entered = threading.Event()
        self.answered = threading.Event()
        self.ended: bool | None = None
        self.grace_s = 0.0

    def __call__(self, request_iterator, context):
        self.entered.set()
        self.ended = call_ended(context, self.grace_s)
        self.answered.set()
        return b""


@pytest.fixture()
def served():
    handler = Handler()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    generic = grpc.method_handlers_generic_handler("test.Streams", {"Push": grpc.stream_unary_rpc_method_handler(handler)})
    server.add_generic_rpc_handlers((generic,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    push = ch.stream_unary(METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    yield handler, push
    ch.close()
    server.stop(None)


def test_a_caller_still_waiting_for_its_answer_has_not_ended(served):
    handler, push = served
    handler.grace_s = 0.2
    assert push(iter(()), timeout=10) == b""  # an empty stream, closed by a live caller
    assert handler.ended is False


def test_a_call_the_caller_cancelled_has_ended_well_within_the_grace(served):
    handler, push = served
    handler.grace_s = 30.0  # the answer below must come from the cancellation, not the clock
    never = threading.Event()

    def requests():
        never.wait()
        yield b"x"

    call = push.future(requests(), timeout=60)
    assert handler.entered.wait(10)
    call.cancel()
    assert handler.answered.wait(10), "call_ended waited out its grace: the cancellation was not seen"
    assert handler.ended is True
    never.set()
