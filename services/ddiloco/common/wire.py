"""Between codec payloads and gRPC messages: headers, chunked streams, reassembly.

Reassembly enforces the size the header declares before anything is decoded, so an
oversized or truncated stream is refused early with a precise status.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import grpc

from ddiloco.common import codec as codec_mod
from ddiloco.common.rpc import chunks
from ddiloco.v1 import common_pb2

CODEC_TO_PB = {
    "fp32": common_pb2.CODEC_FP32,
    "int8": common_pb2.CODEC_INT8,
    "int4": common_pb2.CODEC_INT4,
}
PB_TO_CODEC = {v: k for k, v in CODEC_TO_PB.items()}


class Refused(Exception):
    """Input refused with a gRPC status code and a message saying what was wrong."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def payload_info(enc: codec_mod.Encoded) -> common_pb2.PayloadInfo:
    return common_pb2.PayloadInfo(
        codec=CODEC_TO_PB[enc.codec],
        block_size=enc.block_size,
        tensors=[common_pb2.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype) for s in enc.specs],
        payload_bytes=len(enc.payload),
        sha256=enc.sha256,
    )


def specs_of(info: common_pb2.PayloadInfo) -> tuple[codec_mod.TensorSpec, ...]:
    return tuple(codec_mod.TensorSpec(t.name, tuple(int(d) for d in t.shape), t.dtype) for t in info.tensors)


def decode_payload(info: common_pb2.PayloadInfo, payload: bytes):
    """Decode a payload described by ``info``; codec errors become DATA_LOSS/INVALID_ARGUMENT."""
    if info.codec not in PB_TO_CODEC:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"unknown codec {info.codec}")
    try:
        return codec_mod.decode(
            payload, PB_TO_CODEC[info.codec], info.block_size, specs_of(info), info.sha256, info.payload_bytes
        )
    except codec_mod.CodecError as exc:
        msg = str(exc)
        # corruption in transit is DATA_LOSS; a payload that contradicts its header is INVALID_ARGUMENT
        lossy = msg.startswith(("checksum", "payload truncated", "payload is not valid"))
        raise Refused(grpc.StatusCode.DATA_LOSS if lossy else grpc.StatusCode.INVALID_ARGUMENT, msg) from exc


def stream_messages(message_cls, header, payload: bytes, chunk_bytes: int) -> Iterator:
    """Header first (with the first chunk of data), then the rest of the data in chunks."""
    parts = list(chunks(payload, chunk_bytes)) or [b""]
    yield message_cls(header=header, data=parts[0])
    for part in parts[1:]:
        yield message_cls(data=part)


def reassemble(messages: Iterable, max_payload_bytes: int, what: str):
    """Collect a header-then-data stream; returns (header, payload bytes)."""
    header = None
    buf = bytearray()
    declared = None
    for i, msg in enumerate(messages):
        if i == 0:
            if not msg.HasField("header"):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: the first message carries no header")
            header = msg.header
            declared = header.payload.payload_bytes
            if declared <= 0:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: header declares {declared} payload bytes")
            if declared > max_payload_bytes:
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{what}: payload of {declared} bytes exceeds the limit of {max_payload_bytes}",
                )
        elif msg.HasField("header"):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: header repeated in message {i}")
        buf += msg.data
        if len(buf) > declared:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{what}: received more than the {declared} payload bytes the header declares",
            )
    if header is None:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: empty stream")
    if len(buf) != declared:
        raise Refused(
            grpc.StatusCode.DATA_LOSS, f"{what}: truncated: header declares {declared} bytes, received {len(buf)}"
        )
    return header, bytes(buf)
