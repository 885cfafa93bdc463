"""The learner's view of the outer optimizer, behind a small interface: push a delta, pull
the global parameters, read the status. Everything gRPC-specific stays in here."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import grpc
import numpy as np

from ddiloco.common import codec, errors
from ddiloco.common.paced import Pace
from ddiloco.common.rpc import TRANSIENT, channel
from ddiloco.common.wire import (
    OUTER_SERVICE,
    chunk_parser,
    decode_payload,
    payload_info,
    reassemble,
    serialize,
    stream_frames,
)
from ddiloco.v1 import outer_pb2, outer_pb2_grpc


# The most a download may declare when its fragment's size is not known here (16 GiB);
# a learner passes its fragment's own bound (``download_bound``)
MAX_DOWNLOAD_BYTES = 1 << 34


def download_bound(shapes) -> int:
    """The most bytes a download of a fragment of tensors of ``shapes`` can take as sent: the
    fragment in fp32 (a change through the run's codec is smaller), compressed or not."""
    return codec.payload_bound(codec.float32_raw_size("fp32", 0, shapes))


class CorruptDownload(Exception):
    """A download that arrived damaged (truncated, checksum mismatch, undecodable): a transport
    fault, worth asking again."""


class ClientClosed(grpc.RpcError):
    """A call on a client that was closed: the learner replaced it (the outer optimizer
    restarted or moved) between taking it and calling. CANCELLED, as for a call the close
    cut short, so every caller's retry rule already covers it: the next attempt takes the
    new client. (gRPC raises a bare ValueError for a call on a closed channel, which the
    uploader took for a bug and failed the learner on: an outer-optimizer restart killed
    learners, seen in a chaos soak.)"""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return "the client was closed: the outer optimizer restarted or moved, and a new client replaced it"


def _open(method):
    """Turn gRPC's ValueError for a call on a closed channel into ``ClientClosed``."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except ValueError:
            if self._closed:
                raise ClientClosed() from None
            raise

    return call


@dataclass
class GlobalParams:
    """One fragment of the global parameters as received: the full fragment when
    ``base_version`` is -1, else the change since the learner's copy at ``base_version``."""

    fragment: int
    version: int
    tokens_merged: int  # tokens merged into this fragment version: the clock of staleness
    base_version: int
    arrays: list[tuple[str, np.ndarray]]
    nbytes: int


class OuterClient:
    def __init__(
        self, address: str, run_id: str, learner_id: int, chunk_bytes: int = 1 << 20, security=None, incarnation: int = 0
    ) -> None:
        self.address = address
        self.run_id = run_id
        self.learner_id = learner_id
        # which process of learner_id this is (RegisterResponse.incarnation), on every delta
        # header, so that the outer optimizer refuses it once another process holds the id
        self.incarnation = incarnation
        self.chunk_bytes = chunk_bytes
        self._closed = False
        # security: the learner's ddiloco.common.security.Security (None: plaintext)
        self._channel = channel(address, security, server_role="outer")
        self._stub = outer_pb2_grpc.OuterOptimizerStub(self._channel)
        # the chunk streams with ready frames out and views in (common/wire.py)
        self._push = self._channel.stream_unary(
            f"/{OUTER_SERVICE}/PushDelta",
            request_serializer=serialize,
            response_deserializer=outer_pb2.PushDeltaResponse.FromString,
        )
        self._pull = self._channel.unary_stream(
            f"/{OUTER_SERVICE}/PullGlobal",
            request_serializer=outer_pb2.PullGlobalRequest.SerializeToString,
            response_deserializer=chunk_parser(outer_pb2.GlobalChunk),
        )

    def close(self) -> None:
        self._closed = True  # before the channel closes: a call that fails on it is told why
        self._channel.close()

    def push(
        self,
        enc: codec.Encoded,
        *,
        seq: int,
        base_version: int,
        tokens: int,
        inner_steps: int,
        loss: float,
        timeout: float,
        fragment: int = 0,
        compute_seconds: float = 0.0,
        more_queued: bool = False,
        resume: bool = False,
        pace: Pace | None = None,
    ) -> outer_pb2.PushDeltaResponse:
        """Upload one delta. ``resume`` (a retry of the same delta): first ask how much of an
        earlier, broken attempt the server holds, and send only the rest. ``more_queued``:
        another upload of this fragment follows at once (``DeltaHeader.more_queued``).
        ``pace``: spread the upload over its span (``ddiloco.common.paced``); a resumed
        upload is never paced (it is late already)."""
        header = outer_pb2.DeltaHeader(
            run_id=self.run_id,
            learner_id=self.learner_id,
            base_version=base_version,
            tokens=tokens,
            inner_steps=inner_steps,
            seq=seq,
            payload=payload_info(enc),
            loss=loss,
            fragment=fragment,
            compute_seconds=compute_seconds,
            more_queued=more_queued,
            incarnation=self.incarnation,
        )
        offset = self.upload_offset(header, len(enc.payload), min(timeout, 10.0)) if resume else 0
        if offset:
            try:
                return self.push_payload(header, enc.payload, timeout, offset)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.OUT_OF_RANGE:
                    raise
                # the server let go of that part meanwhile (restart, eviction): all of it, then
        return self.push_payload(header, enc.payload, timeout, pace=None if resume else pace)

    @_open
    def upload_offset(self, header: outer_pb2.DeltaHeader, payload_bytes: int, timeout: float) -> int:
        """Bytes of this upload the server holds from a broken attempt; 0 when it holds none,
        answers anything outside the payload, or cannot say (an older server, a fault: the
        push itself will tell)."""
        try:
            resp = self._stub.UploadOffset(outer_pb2.UploadOffsetRequest(header=header), timeout=timeout)
        except grpc.RpcError:
            return 0
        return resp.offset if 0 < resp.offset < payload_bytes else 0

    @_open
    def push_payload(
        self, header: outer_pb2.DeltaHeader, payload, timeout: float, offset: int = 0, pace: Pace | None = None
    ) -> outer_pb2.PushDeltaResponse:
        """Stream ``payload`` from byte ``offset`` on under ``header`` (whose PayloadInfo
        describes all of it), paced by ``pace`` (over the bytes sent) if given."""
        header.offset = offset
        rest = memoryview(payload)[offset:]
        return self._push(stream_frames(outer_pb2.DeltaChunk, header, rest, self.chunk_bytes, pace), timeout=timeout)

    @_open
    def pull_payload(
        self, fragment: int, have_version: int, timeout: float, pace_s: float = 0.0, have_digest: bytes = b"",
        max_bytes: int = MAX_DOWNLOAD_BYTES,
    ) -> tuple[outer_pb2.GlobalHeader, memoryview]:
        """One fragment's download as received, not decoded; raises ``errors.Refused`` for a stream
        that is not one. ``pace_s``: ask the server to spread it over that many seconds.
        ``have_digest``: the digest of a copy this side built itself, claimed to be
        ``have_version`` (``codec.held_digest``; ``PullGlobalRequest.have_digest``).
        ``max_bytes``: the most the answer may declare (the fragment's size in fp32, as a
        learner knows it: ``download_bound``), refused before anything is allocated."""
        stream = self._pull(
            outer_pb2.PullGlobalRequest(
                run_id=self.run_id, learner_id=self.learner_id, have_version=have_version, fragment=fragment,
                pace_ms=int(pace_s * 1000), have_digest=have_digest,
            ),
            timeout=timeout,
        )
        return reassemble(stream, max_bytes, "global parameters")

    def pull(
        self, fragment: int, have_version: int, timeout: float, pace_s: float = 0.0, have_digest: bytes = b"",
        max_bytes: int = MAX_DOWNLOAD_BYTES,
    ) -> GlobalParams:
        try:
            header, payload = self.pull_payload(fragment, have_version, timeout, pace_s, have_digest, max_bytes)
            arrays = decode_payload(header.payload, payload)
        except errors.Refused as exc:
            raise CorruptDownload(f"fragment {fragment}: {exc.message}") from exc
        return GlobalParams(
            header.fragment, header.version, header.tokens_merged, header.base_version, arrays, len(payload)
        )

    @_open
    def status(
        self, timeout: float = 3.0, wait_newer_than: int = -1, wait_s: float = 0.0, position: bool = False
    ) -> outer_pb2.OuterStatus:
        """The outer optimizer's status; with ``wait_s`` > 0, as soon as its global version
        exceeds ``wait_newer_than`` (a long poll), or after ``wait_s``. ``position``: this
        process reads where it resumes, so the answer is final for older processes of its
        learner id (``StatusRequest.incarnation``)."""
        return self._stub.GetStatus(self._status_request(wait_newer_than, wait_s, position), timeout=timeout + wait_s)

    @_open
    def status_future(self, timeout: float = 3.0, wait_newer_than: int = -1, wait_s: float = 0.0, position: bool = False):
        """``status`` as a grpc future (one long poll per shard, ``common/shard_client.py``)."""
        return self._stub.GetStatus.future(self._status_request(wait_newer_than, wait_s, position), timeout=timeout + wait_s)

    def _status_request(self, wait_newer_than: int, wait_s: float, position: bool) -> outer_pb2.StatusRequest:
        req = outer_pb2.StatusRequest(wait_newer_than=wait_newer_than, wait_ms=int(wait_s * 1000))
        if position and self.incarnation:
            req.learner_id, req.incarnation = self.learner_id, self.incarnation
        return req

    def last_seq(self, timeout: float = 3.0) -> int:
        """The last sequence number the outer optimizer accepted from this learner id (0: none)."""
        status = self.status(timeout)
        return next((r.last_seq for r in status.learners if r.learner_id == self.learner_id), 0)


def is_retryable(exc: grpc.RpcError) -> bool:
    return exc.code() in TRANSIENT
