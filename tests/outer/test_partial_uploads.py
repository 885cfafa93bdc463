"""The store of broken uploads and reassembly's resumption, without a server: what is held
is exactly what arrived, for exactly that header, within its bounds."""

from __future__ import annotations

import grpc
import pytest

from ddiloco.common.errors import InvalidArgument
from ddiloco.common.wire import chunk_parser, reassemble, serialize, stream_frames
from ddiloco.outer.partial import PartialUploads
from ddiloco.v1 import common_pb2, outer_pb2

PAYLOAD = bytes(range(256)) * 40  # 10240 bytes


def _header(learner=1, seq=1, offset=0):
    return outer_pb2.DeltaHeader(
        run_id="r", learner_id=learner, seq=seq, offset=offset, payload=common_pb2.PayloadInfo(payload_bytes=len(PAYLOAD))
    )


def _messages(header, payload, chunk=1000, break_after=None):
    parse = chunk_parser(outer_pb2.DeltaChunk)
    for i, frame in enumerate(stream_frames(outer_pb2.DeltaChunk, header, payload, chunk)):
        if i == break_after:
            raise grpc.RpcError()  # what a server's request iterator raises when the peer cancels
        yield parse(serialize(frame))


def test_a_broken_stream_is_kept_and_a_resumed_one_joins_it():
    store = PartialUploads(4)
    with pytest.raises(grpc.RpcError):
        reassemble(_messages(_header(), PAYLOAD, break_after=3), 1 << 20, "delta", on_break=store.keep)
    assert store.held(_header()) == 3000
    assert store.held(_header(offset=3000)) == 3000  # the offset is not part of the key
    assert store.held(_header(seq=2)) == 0 and store.held(_header(learner=2)) == 0
    resumed = _header(offset=3000)
    header, payload = reassemble(_messages(resumed, PAYLOAD[3000:]), 1 << 20, "delta", resume=lambda h: store.take(h))
    assert bytes(payload) == PAYLOAD and header.offset == 3000
    assert store.held(_header()) == 0


def test_a_resumed_stream_that_breaks_again_keeps_all_it_has():
    store = PartialUploads(4)
    with pytest.raises(grpc.RpcError):
        reassemble(_messages(_header(), PAYLOAD, break_after=2), 1 << 20, "delta", on_break=store.keep)
    with pytest.raises(grpc.RpcError):
        reassemble(_messages(_header(offset=2000), PAYLOAD[2000:], break_after=4), 1 << 20, "delta",
                   resume=store.take, on_break=store.keep)
    assert store.held(_header()) == 6000


def test_offsets_outside_the_payload_or_without_resumption_are_refused():
    for offset in (-5, len(PAYLOAD), len(PAYLOAD) + 1):
        with pytest.raises(InvalidArgument) as err:
            reassemble(_messages(_header(offset=offset), b"x"), 1 << 20, "delta", resume=lambda h: bytearray())
        assert "outside" in err.value.message
    with pytest.raises(InvalidArgument) as err:
        reassemble(_messages(_header(offset=10), PAYLOAD[10:]), 1 << 20, "delta")
    assert "does not resume" in err.value.message


def test_take_gives_only_exactly_what_the_offset_says():
    store = PartialUploads(4)
    store.keep(_header(), bytearray(b"a" * 100))
    assert store.take(_header(offset=99)) is None and store.take(_header(offset=101)) is None
    assert store.held(_header()) == 100  # a wrong offset leaves it
    assert store.take(_header(offset=100)) == bytearray(b"a" * 100)
    assert store.take(_header(offset=100)) is None


def test_one_upload_per_learner_and_at_most_max_learners():
    now = [0.0]
    store = PartialUploads(2, ttl_s=60, clock=lambda: now[0])
    store.keep(_header(learner=1, seq=1), bytearray(10))
    store.keep(_header(learner=1, seq=2), bytearray(20))  # a newer upload replaces it
    assert store.held(_header(learner=1, seq=1)) == 0 and store.held(_header(learner=1, seq=2)) == 20
    store.keep(_header(learner=2), bytearray(5))
    store.keep(_header(learner=3), bytearray(5))  # the least recent learner goes
    assert len(store) == 2 and store.held(_header(learner=1, seq=2)) == 0
    store.keep(_header(learner=4), bytearray())  # nothing arrived: nothing kept
    assert len(store) == 2
    now[0] = 61.0
    assert store.held(_header(learner=2)) == 0  # expired


@pytest.mark.parametrize("call", ["keep", "held", "take"])
def test_any_call_drops_every_expired_upload_not_only_its_own(call):
    """Learners 1 and 2 broke an upload each and never came back; learner 3's upload broke
    later. Once the first two are past the TTL, any call, whoever it is about, drops both of
    them and keeps learner 3's (they used to stay until enough other uploads broke to push
    them out of the store)."""
    now = [0.0]
    store = PartialUploads(8, ttl_s=60, clock=lambda: now[0])
    store.keep(_header(learner=1), bytearray(1000))
    store.keep(_header(learner=2), bytearray(1000))
    now[0] = 30.0
    store.keep(_header(learner=3), bytearray(1000))
    now[0] = 61.0  # 1 and 2 expired, 3 not
    assert len(store) == 3  # nothing drops them until a call
    if call == "keep":
        store.keep(_header(learner=4), bytearray(10))
    elif call == "held":
        assert store.held(_header(learner=4)) == 0
    else:
        assert store.take(_header(learner=4, offset=10)) is None
    assert len(store) == (2 if call == "keep" else 1)
    assert store.held(_header(learner=3)) == 1000
    now[0] = 90.5  # 3 expired too
    assert store.held(_header(learner=5)) == 0 and len(store) == (1 if call == "keep" else 0)
