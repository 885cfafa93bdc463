"""Between codec payloads and gRPC messages: headers, chunked streams, reassembly.

Reassembly enforces the size the header declares before anything is decoded, so an
oversized or truncated stream is refused early with a precise status.

Chunks without copies: every chunk of a stream after the first carries only ``data``. Its
serialized form is one tag byte, a length and the bytes, so ``data_frame`` writes it with
one copy of the payload slice (protobuf would copy it into a message, then again to
serialize it), and ``chunk_parser`` reads it as a view of the bytes gRPC received (protobuf
would copy it into the message, then again into a Python ``bytes`` on access). Any other
message (the first, with its header; anything unusual a peer sends) goes through protobuf
as before: the bytes on the wire are the same either way.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable, Iterable, Iterator

import grpc
import numpy as np

from ddiloco.common import codec as codec_mod
from ddiloco.common import errors
from ddiloco.common.config_rules import MAX_HEADER_BYTES
from ddiloco.common.paced import Pace
from ddiloco.common.rpc import chunks
from ddiloco.v1 import common_pb2, outer_pb2

CODEC_TO_PB = {
    "fp32": common_pb2.CODEC_FP32,
    "int8": common_pb2.CODEC_INT8,
    "int4": common_pb2.CODEC_INT4,
}
PB_TO_CODEC = {v: k for k, v in CODEC_TO_PB.items()}
COMPRESSION_TO_PB = {"none": common_pb2.COMPRESSION_NONE, "zstd": common_pb2.COMPRESSION_ZSTD}
PB_TO_COMPRESSION = {v: k for k, v in COMPRESSION_TO_PB.items()}



def payload_info(enc: codec_mod.Encoded) -> common_pb2.PayloadInfo:
    info = common_pb2.PayloadInfo(
        codec=CODEC_TO_PB[enc.codec],
        block_size=enc.block_size,
        tensors=[common_pb2.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype) for s in enc.specs],
        payload_bytes=len(enc.payload),
        format=enc.format,
    )
    if enc.format == 1:
        info.sha256 = enc.digest
    else:
        info.compression = COMPRESSION_TO_PB[enc.compression]
        info.xxh3_128 = enc.digest
    return info


def payload_format(info: common_pb2.PayloadInfo) -> int:
    return info.format or 1  # unset: written before formats were numbered


def digest_matches(info: common_pb2.PayloadInfo, payload) -> bool:
    """Whether ``payload`` has the digest ``info`` declares (format 1 without a digest: yes,
    as that format always allowed)."""
    fmt = payload_format(info)
    if fmt == 1:
        return not info.sha256 or codec_mod.digest_of(payload, 1) == info.sha256
    if fmt == 2:
        return codec_mod.digest_of(payload, 2) == info.xxh3_128
    return False


def specs_of(info: common_pb2.PayloadInfo) -> tuple[codec_mod.TensorSpec, ...]:
    return tuple(codec_mod.TensorSpec(t.name, tuple(int(d) for d in t.shape), t.dtype) for t in info.tensors)


def decode_payload(info: common_pb2.PayloadInfo, payload: bytes):
    """Decode a payload described by ``info``; codec errors become DATA_LOSS/INVALID_ARGUMENT."""
    if info.codec not in PB_TO_CODEC:
        raise errors.InvalidArgument(f"unknown codec {info.codec}")
    fmt = payload_format(info)
    if fmt == 2 and info.compression not in PB_TO_COMPRESSION:
        raise errors.InvalidArgument(f"unknown compression {info.compression}")
    try:
        return codec_mod.decode(
            payload, PB_TO_CODEC[info.codec], info.block_size, specs_of(info),
            info.sha256 if fmt == 1 else info.xxh3_128, info.payload_bytes,
            fmt=fmt, compression=PB_TO_COMPRESSION.get(info.compression),
        )
    except codec_mod.CodecError as exc:
        msg = str(exc)
        # corruption in transit is DATA_LOSS; a payload that contradicts its header is INVALID_ARGUMENT
        lossy = msg.startswith(("checksum", "payload truncated", "payload is not valid"))
        raise (errors.DataLoss if lossy else errors.InvalidArgument)(msg) from exc


def stream_messages(message_cls, header, payload: bytes, chunk_bytes: int) -> Iterator:
    """Header first (with the first chunk of data), then the rest of the data in chunks."""
    parts = list(chunks(payload, chunk_bytes)) or [b""]
    yield message_cls(header=header, data=parts[0])
    for part in parts[1:]:
        yield message_cls(data=part)


DATA_TAG = 0x12  # field 2 (data), length-delimited, in DeltaChunk and GlobalChunk alike


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def data_frame(part) -> bytes:
    """The serialized chunk message holding only ``part`` (non-empty) as its data."""
    return b"".join((bytes((DATA_TAG,)), _varint(len(part)), part))


def serialize(message) -> bytes:
    """Serializer for streams that mix messages and ready frames."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def stream_frames(message_cls, header, payload, chunk_bytes: int, pace: Pace | None = None) -> Iterator:
    """As ``stream_messages``, with the data-only chunks as ready frames (see the module
    docstring); for a stub or handler whose serializer is ``serialize``. With ``pace``
    (``ddiloco.common.paced``), in the pace's chunks (at most ``chunk_bytes``), each held
    back until it is due."""
    if chunk_bytes <= 0:
        raise ValueError("chunk size must be positive")
    if pace is not None:
        chunk_bytes = pace.chunk_bytes(chunk_bytes)
    if header.ByteSize() > MAX_HEADER_BYTES:  # else the peer's channel refuses the first message
        raise ValueError(f"a stream header of {header.ByteSize()} bytes is over the {MAX_HEADER_BYTES} a message leaves it")
    view = memoryview(payload)
    if pace is not None:
        pace(0)
    yield message_cls(header=header, data=bytes(view[:chunk_bytes]))
    for i in range(chunk_bytes, len(view), chunk_bytes):
        if pace is not None:
            pace(i)
        yield data_frame(view[i : i + chunk_bytes])


class DataChunk:
    """A received chunk that carries only data: a view of the message bytes."""

    __slots__ = ("data",)

    def __init__(self, data: memoryview) -> None:
        self.data = data

    def HasField(self, name: str) -> bool:  # noqa: N802 - the protobuf method it stands in for
        return False


def chunk_parser(message_cls) -> Callable[[bytes], object]:
    """Deserializer for a chunk stream: a data-only message as a ``DataChunk`` (no copy),
    anything else through ``message_cls.FromString``."""

    def parse(raw: bytes):
        if len(raw) > 1 and raw[0] == DATA_TAG:
            n, shift, pos = 0, 0, 1
            while pos < len(raw) and pos <= 10:  # a varint has at most 10 bytes
                b = raw[pos]
                pos += 1
                n |= (b & 0x7F) << shift
                shift += 7
                if not b & 0x80:
                    if pos + n == len(raw):
                        return DataChunk(memoryview(raw)[pos:])
                    break
        return message_cls.FromString(raw)

    return parse


class ReceivePool:
    """Memory for received payloads, reused once nothing refers to it any more.

    Why: on this kind of host the first touch of fresh memory, not the copy into it, is what
    a large upload's receiving side spends most on when it is slow (a 256 MB payload: 0.24 to
    0.28 s of page faults where a warm buffer fills in 0.035 s), and a run receives payloads
    of the same few sizes over and over.

    Why it is safe: a buffer is handed out only as a ``memoryview`` of a numpy view made for
    that one payload, and everything derived from it (slices, ``np.frombuffer`` arrays,
    tensors over those; decoding copies, but nothing relies on it) holds a reference to that
    view. The memory goes back to the pool only when the view is
    collected (``weakref.finalize``), so no payload's bytes are ever overwritten while any
    of them can still be read. A reused buffer's old bytes are never read: reassembly
    writes every byte it returns.

    Bounds: payloads under ``min_bytes`` are not pooled (their faults are few); at most
    ``max_free`` buffers wait idle, each used only for a payload of at least half its size,
    so idle memory stays within ``max_free`` of the largest payloads recently received."""

    def __init__(self, max_free: int = 2, min_bytes: int = 1 << 20) -> None:
        self.max_free = max_free
        self.min_bytes = min_bytes
        self._free: list[np.ndarray] = []
        # re-entrant: a collection inside ``take`` may run a finaliser that gives one back
        self._lock = threading.RLock()
        self.reused = 0  # buffers handed out again (tests, diagnostics)

    def take(self, nbytes: int) -> memoryview:
        """A writable buffer of ``nbytes`` (its old content is not defined)."""
        if nbytes < self.min_bytes:
            return memoryview(np.empty(nbytes, dtype=np.uint8)).cast("B")
        backing = None
        with self._lock:
            fits = [b for b in self._free if nbytes <= b.nbytes <= 2 * nbytes]
            if fits:
                backing = min(fits, key=lambda b: b.nbytes)
                self._free = [b for b in self._free if b is not backing]
                self.reused += 1
        if backing is None:
            backing = np.empty(nbytes, dtype=np.uint8)
        view = backing[:nbytes]
        weakref.finalize(view, self._give_back, backing)
        return memoryview(view).cast("B")

    def _give_back(self, backing: np.ndarray) -> None:
        with self._lock:
            self._free.append(backing)
            if len(self._free) > self.max_free:
                self._free.pop(0)  # the oldest goes; the kernel gets its memory back

    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._free)


RECEIVE_POOL = ReceivePool()


def receive_buffer(nbytes: int) -> memoryview:
    """A writable buffer of ``nbytes`` for a payload being received.

    numpy's allocation, not a ``bytearray``: numpy asks the kernel for transparent huge pages
    on large buffers, so filling one costs one page fault per 2 MiB instead of per 4 KiB.
    Measured on 256 MB of 1 MiB chunks: 40 ms against 160 ms for a growing ``bytearray``
    (the faults, not the copy, were most of a loopback upload's receiving side). Pages are
    only touched as data arrives: a stream that declares its size and then sends little
    costs what it sent. Buffers of 1 MiB and more come from ``RECEIVE_POOL``, which reuses
    the memory of payloads nothing refers to any more (the module's one pool: a test or a
    bench replaces it to receive into fresh memory)."""
    return RECEIVE_POOL.take(nbytes)


def reassemble(
    messages: Iterable,
    max_payload_bytes: int,
    what: str,
    resume: Callable[[object], bytes] | None = None,
    on_break: Callable[[object, bytes], None] | None = None,
    admit: Callable[[object], None] | None = None,
):
    """Collect a header-then-data stream; returns (header, payload as a ``memoryview`` of
    the buffer it was received into: handing it on as it is saves a copy of the whole
    payload).

    The header's declared size is checked against ``max_payload_bytes`` (the caller's
    bound, from the run) before the buffer is made; no more than it declares is accepted.
    ``admit(header)``, if given, checks the rest of the header then (raising
    ``errors.Refused``), so a refused stream is not read past its first message.

    Resumable uploads: a header whose ``offset`` is not 0 continues a broken upload; after
    checking that the offset lies inside the declared size, ``resume(header)`` returns the
    ``offset`` bytes held for it (or raises ``errors.Refused``), and the stream's data follows them.
    If the stream breaks (the peer cancels, the connection drops), ``on_break(header,
    bytes so far)`` may keep them for such a retry. Streams without either refuse offsets."""
    header = None
    buf = None
    got = 0
    declared = None
    try:
        for i, msg in enumerate(messages):
            if i == 0:
                if not msg.HasField("header"):
                    raise errors.InvalidArgument(f"{what}: the first message carries no header")
                header = msg.header
                declared = header.payload.payload_bytes
                if declared <= 0:
                    raise errors.InvalidArgument(f"{what}: header declares {declared} payload bytes")
                if declared > max_payload_bytes:
                    raise errors.ResourceExhausted(
                        f"{what}: payload of {declared} bytes exceeds the limit of {max_payload_bytes}"
                    )
                if admit is not None:
                    admit(header)
                offset = getattr(header, "offset", 0)  # uploads only
                if offset:
                    if resume is None:
                        raise errors.InvalidArgument(f"{what}: offset {offset}, but this stream does not resume")
                    if not 0 < offset < declared:
                        raise errors.InvalidArgument(
                            f"{what}: offset {offset} lies outside the {declared} payload bytes the header declares"
                        )
                    held = resume(header)
                    buf = receive_buffer(declared)
                    buf[:offset] = held
                    got = offset
                else:
                    buf = receive_buffer(declared)
            elif msg.HasField("header"):
                raise errors.InvalidArgument(f"{what}: header repeated in message {i}")
            n = len(msg.data)
            if got + n > declared:
                raise errors.InvalidArgument(
                    f"{what}: received more than the {declared} payload bytes the header declares"
                )
            buf[got : got + n] = msg.data
            got += n
    except grpc.RpcError:  # the stream broke: what arrived may spare the retry a resend
        if on_break is not None and header is not None and got:
            on_break(header, bytes(buf[:got]))
        raise
    if header is None:
        raise errors.InvalidArgument(f"{what}: empty stream")
    if got != declared:
        raise errors.DataLoss(f"{what}: truncated: header declares {declared} bytes, received {got}")
    return header, buf


OUTER_SERVICE = "ddiloco.v1.OuterOptimizer"


def outer_handlers(servicer) -> dict[str, grpc.RpcMethodHandler]:
    """The OuterOptimizer's method handlers, as the generated
    ``add_OuterOptimizerServicer_to_server`` builds them, except that the two chunk streams
    use ``chunk_parser`` (uploads) and ``serialize`` (downloads and fragment reads, from
    ``stream_frames``)."""
    return {
        "PushDelta": grpc.stream_unary_rpc_method_handler(
            servicer.PushDelta,
            request_deserializer=chunk_parser(outer_pb2.DeltaChunk),
            response_serializer=outer_pb2.PushDeltaResponse.SerializeToString,
        ),
        "PullGlobal": grpc.unary_stream_rpc_method_handler(
            servicer.PullGlobal,
            request_deserializer=outer_pb2.PullGlobalRequest.FromString,
            response_serializer=serialize,
        ),
        "GetStatus": grpc.unary_unary_rpc_method_handler(
            servicer.GetStatus,
            request_deserializer=outer_pb2.StatusRequest.FromString,
            response_serializer=outer_pb2.OuterStatus.SerializeToString,
        ),
        "Finalize": grpc.unary_unary_rpc_method_handler(
            servicer.Finalize,
            request_deserializer=outer_pb2.FinalizeRequest.FromString,
            response_serializer=outer_pb2.FinalizeResponse.SerializeToString,
        ),
        "UploadOffset": grpc.unary_unary_rpc_method_handler(
            servicer.UploadOffset,
            request_deserializer=outer_pb2.UploadOffsetRequest.FromString,
            response_serializer=outer_pb2.UploadOffsetResponse.SerializeToString,
        ),
        "ReadFragment": grpc.unary_stream_rpc_method_handler(
            servicer.ReadFragment,
            request_deserializer=outer_pb2.ReadFragmentRequest.FromString,
            response_serializer=serialize,
        ),
    }


def add_outer_servicer(servicer, server: grpc.Server) -> None:
    handlers = outer_handlers(servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(OUTER_SERVICE, handlers),))
    server.add_registered_method_handlers(OUTER_SERVICE, handlers)
