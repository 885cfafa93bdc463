"""Chunk streams without copies: the same bytes on the wire as protobuf's, read back alike,
and interoperable over real gRPC with peers that use the generated stubs."""

from __future__ import annotations

import os
from concurrent import futures

import grpc
import numpy as np
import pytest

from ddiloco.common import codec, errors, wire
from ddiloco.common.config_rules import MAX_CHUNK_BYTES, MAX_HEADER_BYTES
from ddiloco.common.rpc import CLIENT_OPTIONS, SERVER_OPTIONS
from ddiloco.common.transport import OuterClient
from ddiloco.v1 import common_pb2, outer_pb2, outer_pb2_grpc

SIZES = [1, 127, 128, 16383, 16384, 300_001, 1 << 20]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("cls", [outer_pb2.DeltaChunk, outer_pb2.GlobalChunk])
def test_a_data_frame_is_what_protobuf_serializes(size, cls):
    part = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    frame = wire.data_frame(memoryview(part))
    assert frame == cls(data=part).SerializeToString()
    parsed = wire.chunk_parser(cls)(frame)
    assert isinstance(parsed, wire.DataChunk) and not parsed.HasField("header")
    assert bytes(parsed.data) == part


def test_anything_but_a_bare_data_frame_goes_through_protobuf():
    parse = wire.chunk_parser(outer_pb2.DeltaChunk)
    header = outer_pb2.DeltaHeader(run_id="r", seq=3)
    first = outer_pb2.DeltaChunk(header=header, data=b"abc").SerializeToString()
    got = parse(first)
    assert got.HasField("header") and got.header.seq == 3 and got.data == b"abc"
    # data first, then a header: valid protobuf, not a bare frame
    odd = outer_pb2.DeltaChunk(data=b"xy").SerializeToString() + outer_pb2.DeltaChunk(header=header).SerializeToString()
    got = parse(odd)
    assert isinstance(got, outer_pb2.DeltaChunk) and got.HasField("header") and got.data == b"xy"
    # a length that runs past the end is protobuf's to refuse, as before
    with pytest.raises(Exception):
        parse(b"\x12\x05ab")
    assert parse(b"").data == b""


def test_frames_are_the_messages_byte_for_byte():
    payload = bytes(range(256)) * 41
    header = outer_pb2.DeltaHeader(run_id="r", seq=1, payload=common_pb2.PayloadInfo(payload_bytes=len(payload)))
    frames = [wire.serialize(m) for m in wire.stream_frames(outer_pb2.DeltaChunk, header, payload, 1000)]
    messages = [m.SerializeToString() for m in wire.stream_messages(outer_pb2.DeltaChunk, header, payload, 1000)]
    assert frames == messages
    parse = wire.chunk_parser(outer_pb2.DeltaChunk)
    got_header, got = wire.reassemble((parse(f) for f in frames), 1 << 20, "delta")
    assert got_header.seq == 1 and bytes(got) == payload


def test_the_handlers_cover_every_method_of_the_service():
    methods = set(outer_pb2.DESCRIPTOR.services_by_name["OuterOptimizer"].methods_by_name)
    assert set(wire.outer_handlers(outer_pb2_grpc.OuterOptimizerServicer())) == methods
    assert outer_pb2.DESCRIPTOR.services_by_name["OuterOptimizer"].full_name == wire.OUTER_SERVICE


class _Echo(outer_pb2_grpc.OuterOptimizerServicer):
    """Keeps what was pushed; serves it back, as a real stream of the given chunk size."""

    def __init__(self, frames: bool, chunk_bytes: int = 65536) -> None:
        self.frames = frames
        self.chunk_bytes = chunk_bytes
        self.payload = b""

    def PushDelta(self, request_iterator, context):
        header, self.payload = wire.reassemble(request_iterator, 1 << 26, "delta")
        return outer_pb2.PushDeltaResponse(outcome=outer_pb2.PUSH_OUTCOME_ACCEPTED, global_version=header.seq)

    def PullGlobal(self, request, context):
        info = common_pb2.PayloadInfo(payload_bytes=len(self.payload))
        header = outer_pb2.GlobalHeader(version=request.have_version, payload=info)
        make = wire.stream_frames if self.frames else wire.stream_messages
        yield from make(outer_pb2.GlobalChunk, header, self.payload, self.chunk_bytes)


@pytest.fixture(params=["fast-server", "generated-server"])
def served(request):
    fast = request.param == "fast-server"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS)
    echo = _Echo(frames=fast)
    if fast:
        wire.add_outer_servicer(echo, server)
    else:
        outer_pb2_grpc.add_OuterOptimizerServicer_to_server(echo, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", echo
    server.stop(0).wait()


@pytest.mark.parametrize("size", [1, 65536, 3_000_001])
def test_push_and_pull_round_trip_over_grpc_with_either_kind_of_peer(served, size):
    address, echo = served
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    client = OuterClient(address, "r", 1, chunk_bytes=65536)
    try:
        header = outer_pb2.DeltaHeader(run_id="r", learner_id=1, seq=5, payload=common_pb2.PayloadInfo(payload_bytes=size))
        assert client.push_payload(header, payload, timeout=30).global_version == 5
        assert bytes(echo.payload) == payload
        got_header, got = client.pull_payload(0, 9, timeout=30)
        assert got_header.version == 9 and bytes(got) == payload
    finally:
        client.close()
    # a client on the generated stub reads the fast server's frames as ordinary messages
    with grpc.insecure_channel(address, options=CLIENT_OPTIONS) as ch:
        stub = outer_pb2_grpc.OuterOptimizerStub(ch)
        chunks = list(stub.PullGlobal(outer_pb2.PullGlobalRequest(have_version=2), timeout=30))
        assert chunks[0].header.version == 2 and b"".join(c.data for c in chunks) == payload


def _specs(n: int) -> list:
    return [common_pb2.TensorSpec(name=f"blocks.{i}.attn.c_proj.weight", shape=[4096, 4096]) for i in range(n)]


def test_the_largest_chunk_a_run_may_set_crosses_the_services_channels_with_a_full_header(served):
    """A run may set learner.chunk_bytes up to MAX_CHUNK_BYTES; the first message carries the
    header beside such a chunk, and the channels the services build must carry it both ways
    (they once allowed 8 MiB messages while the run allowed 64 MiB chunks, and every upload
    was refused by the learner's own channel)."""
    address, echo = served
    echo.chunk_bytes = MAX_CHUNK_BYTES
    size = 2 * MAX_CHUNK_BYTES + 3
    payload = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
    info = common_pb2.PayloadInfo(payload_bytes=size, tensors=_specs(5000))
    client = OuterClient(address, "r", 1, chunk_bytes=MAX_CHUNK_BYTES)
    try:
        header = outer_pb2.DeltaHeader(run_id="r", learner_id=1, seq=7, payload=info)
        assert client.push_payload(header, payload, timeout=60).global_version == 7
        assert bytes(echo.payload) == payload
        _, got = client.pull_payload(0, 1, timeout=60)
        assert bytes(got) == payload
    finally:
        client.close()


def test_a_header_of_the_largest_size_crosses_beside_a_chunk_of_the_largest_size(served):
    """The first message is the header, the first chunk and the protobuf framing of both.
    The channels once allowed exactly a chunk plus a header, so a header within a few bytes
    of the largest (which the sender accepts) beside a chunk of the largest size was refused
    by the learner's own channel as RESOURCE_EXHAUSTED, which it retries for ever."""
    address, echo = served
    size = MAX_CHUNK_BYTES + 1
    payload = bytes(size)
    header = outer_pb2.DeltaHeader(learner_id=1, seq=3, payload=common_pb2.PayloadInfo(payload_bytes=size, tensors=_specs(9000)))
    header.run_id = "r" * (MAX_HEADER_BYTES - header.ByteSize() - 4)
    while header.ByteSize() < MAX_HEADER_BYTES:
        header.run_id += "r"
    assert header.ByteSize() == MAX_HEADER_BYTES
    client = OuterClient(address, header.run_id, 1, chunk_bytes=MAX_CHUNK_BYTES)
    try:
        assert client.push_payload(header, payload, timeout=60).global_version == 3
        assert bytes(echo.payload) == payload
    finally:
        client.close()


def test_a_header_too_large_for_a_message_is_refused_before_anything_is_sent():
    header = outer_pb2.DeltaHeader(payload=common_pb2.PayloadInfo(tensors=_specs(30_000)))
    assert header.ByteSize() > MAX_HEADER_BYTES
    with pytest.raises(ValueError, match="stream header of .* bytes is over the"):
        next(wire.stream_frames(outer_pb2.DeltaChunk, header, b"x", 1024))


def test_an_encoded_payload_crosses_and_decodes():
    arr = np.random.default_rng(0).normal(size=(300, 70)).astype(np.float32)
    enc = codec.encode([("w", arr)], "int4", 64)
    frames = [wire.serialize(m) for m in wire.stream_frames(outer_pb2.DeltaChunk, outer_pb2.DeltaHeader(payload=wire.payload_info(enc)), enc.payload, 4096)]
    parse = wire.chunk_parser(outer_pb2.DeltaChunk)
    header, payload = wire.reassemble((parse(f) for f in frames), 1 << 20, "delta")
    (_, got), = wire.decode_payload(header.payload, payload)
    (_, want), = codec.decode_encoded(enc)
    assert got.tobytes() == want.tobytes()


def test_an_unknown_format_or_compression_is_refused_by_name():
    enc = codec.encode([("w", np.ones(10, np.float32))], "int8", 64)
    info = wire.payload_info(enc)
    info.format = 3
    with pytest.raises(errors.InvalidArgument) as err:
        wire.decode_payload(info, enc.payload)
    assert "payload format 3" in err.value.message
    info = wire.payload_info(enc)
    info.compression = 9
    with pytest.raises(errors.InvalidArgument) as err:
        wire.decode_payload(info, enc.payload)
    assert "unknown compression 9" in err.value.message
    info = wire.payload_info(enc)
    info.xxh3_128 = "0" * 32
    with pytest.raises(errors.DataLoss) as err:  # damaged in transit: sending again may succeed
        wire.decode_payload(info, enc.payload)
    assert "checksum" in err.value.message


# ----------------------------------------------------------------------------- reassembly
def _stream(payload: bytes, chunk: int, offset: int = 0, declared: int | None = None) -> list:
    header = outer_pb2.DeltaHeader(
        run_id="r", seq=1, offset=offset,
        payload=common_pb2.PayloadInfo(payload_bytes=len(payload) if declared is None else declared),
    )
    parse = wire.chunk_parser(outer_pb2.DeltaChunk)
    return [parse(wire.serialize(m)) for m in wire.stream_frames(outer_pb2.DeltaChunk, header, payload[offset:], chunk)]


class _Broken(grpc.RpcError):
    pass


def _breaking(messages: list, after: int):
    yield from messages[:after]
    raise _Broken()


@pytest.mark.parametrize("size", [10_000, 3 << 20])  # the second into a pooled buffer, reused the second time
def test_a_resumed_stream_is_the_held_bytes_then_the_rest(size):
    payload = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
    chunk = size // 10
    held = {}
    messages = _stream(payload, chunk)
    with pytest.raises(_Broken):
        wire.reassemble(_breaking(messages, 3), 1 << 24, "delta", on_break=lambda h, b: held.update(data=b))
    assert held["data"] == payload[:3 * chunk]  # exactly what arrived, as bytes of its own
    resumed = _stream(payload, chunk, offset=3 * chunk)
    header, got = wire.reassemble(iter(resumed), 1 << 24, "delta", resume=lambda h: held["data"])
    assert header.offset == 3 * chunk and len(got) == len(payload) and bytes(got) == payload


def test_more_or_less_than_the_header_declares_is_refused():
    payload = bytes(range(200)) * 10
    with pytest.raises(errors.InvalidArgument, match="more than the 1999"):
        wire.reassemble(iter(_stream(payload, 500, declared=1999)), 1 << 20, "delta")
    with pytest.raises(errors.DataLoss, match="declares 2001 bytes, received 2000"):
        wire.reassemble(iter(_stream(payload, 500, declared=2001)), 1 << 20, "delta")
    with pytest.raises(errors.ResourceExhausted, match="exceeds the limit of 1000"):
        wire.reassemble(iter(_stream(payload, 500)), 1000, "delta")


def test_a_stream_that_declares_much_and_sends_little_costs_what_it_sent():
    """The receive buffer is sized by the (bounded) declared size but only touched as data
    arrives: a 1 GiB declaration followed by a break holds one chunk, not a gigabyte."""
    header = outer_pb2.DeltaHeader(run_id="r", seq=1, payload=common_pb2.PayloadInfo(payload_bytes=1 << 30))
    first = wire.chunk_parser(outer_pb2.DeltaChunk)(outer_pb2.DeltaChunk(header=header, data=b"x" * 100).SerializeToString())
    held = {}

    def resident_bytes() -> int:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident_bytes()
    with pytest.raises(_Broken):  # the buffer is alive while on_break runs: measure there
        wire.reassemble(_breaking([first], 1), 1 << 31, "delta",
                        on_break=lambda h, b: held.update(data=b, grown=resident_bytes() - before))
    assert held["data"] == b"x" * 100
    assert held["grown"] < 64 << 20


# ----------------------------------------------------------------------------- receive pool
MIB = 1 << 20


def _address(buf) -> int:
    return np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]


def test_a_pooled_buffer_is_reused_only_once_nothing_refers_to_its_payload():
    import torch

    pool = wire.ReceivePool(max_free=2, min_bytes=MIB)
    first = pool.take(2 * MIB)
    where = _address(first)
    # what a receiver keeps of a payload: a slice, an array over it, a tensor sharing it
    kept = [first[10:20], np.frombuffer(first, dtype=np.float32), torch.from_numpy(np.frombuffer(first, dtype=np.uint8))]
    del first
    while kept:
        other = pool.take(2 * MIB)
        assert _address(other) != where and pool.reused == 0, "memory handed out while a payload view was alive"
        del other  # goes back to the pool; fine, it is not the first buffer
        pool._free.clear()
        kept.pop()
    again = pool.take(2 * MIB)
    assert _address(again) == where and pool.reused == 1


def test_a_payload_still_held_survives_the_next_one_received_and_a_reused_buffer_shows_no_old_bytes():
    pool = wire.ReceivePool(max_free=2, min_bytes=MIB)
    a = np.random.default_rng(2).normal(size=MIB // 2).astype(np.float32)
    b = np.random.default_rng(3).normal(size=MIB // 2).astype(np.float32)

    def receive(arr):
        enc = codec.encode([("w", arr)], "fp32", 64, compression="none")
        frames = [wire.serialize(m) for m in wire.stream_frames(
            outer_pb2.DeltaChunk, outer_pb2.DeltaHeader(payload=wire.payload_info(enc)), enc.payload, 256 * 1024)]
        parse = wire.chunk_parser(outer_pb2.DeltaChunk)
        real = wire.RECEIVE_POOL
        wire.RECEIVE_POOL = pool
        try:
            header, payload = wire.reassemble((parse(f) for f in frames), 16 * MIB, "delta")
        finally:
            wire.RECEIVE_POOL = real
        return header, payload

    h1, held = receive(a)  # e.g. a payload a slow consumer still holds
    h2, later = receive(b)
    assert _address(later) != _address(held)
    assert wire.decode_payload(h1.payload, held)[0][1].tobytes() == a.tobytes()
    assert wire.decode_payload(h2.payload, later)[0][1].tobytes() == b.tobytes()
    where = _address(held)
    del held
    h3, again = receive(b)  # into the first buffer, which held a's bytes
    assert pool.reused == 1 and _address(again) == where
    assert wire.decode_payload(h3.payload, again)[0][1].tobytes() == b.tobytes()


def test_the_pool_keeps_few_buffers_and_none_for_small_or_much_smaller_payloads():
    pool = wire.ReceivePool(max_free=2, min_bytes=MIB)
    small = pool.take(MIB - 1)
    del small
    assert pool.idle_bytes() == 0  # not pooled
    two, three, four = (pool.take(n * MIB) for n in (2, 3, 4))
    del two
    del three
    del four
    assert sorted(b.nbytes for b in pool._free) == [3 * MIB, 4 * MIB]  # the oldest went back to the kernel
    half = pool.take(int(1.4 * MIB))  # under half of every idle buffer: fresh memory
    assert pool.reused == 0
    fits = pool.take(int(3.5 * MIB))  # the 4 MiB one
    assert pool.reused == 1 and [b.nbytes for b in pool._free] == [3 * MIB]
    del half, fits
