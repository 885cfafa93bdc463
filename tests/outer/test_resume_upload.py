"""Resumable uploads against a real outer optimizer: a PushDelta stream broken half way is
held, UploadOffset says how much, and the retry sends only the rest; the joined payload is
checked like any other. Offsets that do not match what is held are refused precisely."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from ddiloco.common import codec
from ddiloco.common.transport import OuterClient
from ddiloco.common.wire import payload_info, stream_frames
from ddiloco.v1 import outer_pb2

CHUNK = 4096


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    from outer_helpers import register
    from support import TINY_RUN, wait_serving, wait_until

    from ddiloco.launcher.processes import Cluster

    cluster = Cluster(tmp_path_factory.mktemp("resume"))
    cluster.start_coordinator([*TINY_RUN, "--learners", "2", "--max-seconds", "600", "--run-id", "resume-run"])
    cluster.start_outer()
    wait_until(cluster.registered_outer, 120, "outer registration")
    wait_serving(cluster.outer_address)
    ids = register(cluster.coordinator_address, 2)
    client = OuterClient(cluster.outer_address, "resume-run", ids[0], chunk_bytes=CHUNK)
    g = client.pull(0, -1, timeout=30)
    # The outer optimizer keeps a broken stream only of a learner it has confirmed with the
    # coordinator (its membership cache; a learner it has not confirmed yet simply resends
    # everything). UploadOffset confirms the caller, so the first break below does not
    # depend on when the cache last refreshed.
    _stub_offset(client, ids[0])
    yield client, g, ids
    client.close()
    cluster.stop_all()


def _stub_offset(client, learner_id) -> None:
    client._stub.UploadOffset(outer_pb2.UploadOffsetRequest(header=outer_pb2.DeltaHeader(run_id="resume-run", learner_id=learner_id)), timeout=10)


def _delta(g, seed):
    rng = np.random.default_rng(seed)
    return codec.encode([(n, (rng.normal(size=a.shape) * 1e-4).astype(np.float32)) for n, a in g.arrays], "int8", 64)


def _header(client, g, enc, seq):
    return outer_pb2.DeltaHeader(
        run_id="resume-run", learner_id=client.learner_id, base_version=g.version, tokens=2 * 5 * 4 * 64 // 2,
        inner_steps=5, seq=seq, payload=payload_info(enc),
    )


def _break_after(client, header, payload, chunks: int, settle_s: float = 0.5) -> None:
    """Stream the first ``chunks`` chunks, then fail on the client side: the call is cancelled."""

    def frames():
        for i, frame in enumerate(stream_frames(outer_pb2.DeltaChunk, header, payload, CHUNK)):
            if i == chunks:
                time.sleep(settle_s)  # what was sent arrives before the cancellation
                raise ConnectionError("the link went down")
            yield frame

    with pytest.raises(grpc.RpcError):
        client._push(frames(), timeout=30)


def _break_until_held(client, header, payload, chunks: int) -> int:
    """Break an upload after ``chunks`` chunks until the server holds part of it. Keeping a
    broken stream is best effort: a cancellation that reaches the server before it read the
    chunks leaves nothing to keep (the retry then sends everything), so one break alone is a
    race with the server's scheduling; a few attempts are not. Each attempt gives the server
    twice as long to read what was sent (0.5 s to 8 s): on a loaded host its handler may not
    run for a while."""
    for attempt in range(5):
        _break_after(client, header, payload, chunks, settle_s=0.5 * 2**attempt)
        held = _held(client, header, len(payload), wait_s=3)
        if held:
            return held
    return 0


def _held(client, header, size, want_positive=True, wait_s=10.0):
    deadline = time.monotonic() + wait_s
    while True:
        held = client.upload_offset(header, size, 5)
        if held or not want_positive or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


def test_a_broken_upload_resumes_where_it_stopped(system):
    client, g, _ = system
    enc = _delta(g, 1)
    assert len(enc.payload) > 8 * CHUNK
    header = _header(client, g, enc, 1)
    held = _break_until_held(client, header, enc.payload, 5)
    assert 0 < held <= 5 * CHUNK
    # another upload (another sequence number) has nothing held
    assert client.upload_offset(_header(client, g, enc, 2), len(enc.payload), 5) == 0
    resp = client.push_payload(header, enc.payload, timeout=30, offset=held)
    assert resp.outcome == outer_pb2.PUSH_OUTCOME_ACCEPTED  # the digest of the joined payload held
    assert client.upload_offset(header, len(enc.payload), 5) == 0  # taken


def test_push_with_resume_asks_first_and_falls_back_to_the_whole_payload(system):
    client, g, _ = system
    enc = _delta(g, 2)
    header = _header(client, g, enc, 2)
    assert _break_until_held(client, header, enc.payload, 3) > 0
    kwargs = dict(seq=2, base_version=g.version, tokens=header.tokens, inner_steps=5, loss=0.0, timeout=30)
    assert client.push(enc, resume=True, **kwargs).outcome == outer_pb2.PUSH_OUTCOME_ACCEPTED
    # nothing held now: a resumed push of the next one simply sends everything
    enc3 = _delta(g, 3)
    kwargs["seq"] = 3
    assert client.push(enc3, resume=True, **kwargs).outcome == outer_pb2.PUSH_OUTCOME_ACCEPTED


def test_offsets_that_do_not_match_what_is_held_are_refused(system):
    client, g, ids = system
    enc = _delta(g, 4)
    size = len(enc.payload)
    header = _header(client, g, enc, 4)
    with pytest.raises(grpc.RpcError) as err:
        client.push_payload(header, enc.payload, timeout=30, offset=CHUNK)
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE and "send it from offset 0" in err.value.details()
    for bad in (size, size + 1, -1):
        header.offset = bad
        with pytest.raises(grpc.RpcError) as err:
            client._push(iter([outer_pb2.DeltaChunk(header=header, data=b"x")]), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "offset" in err.value.details()
    # held, but not that much: refused, and what is held stays for a correct retry
    held = _break_until_held(client, header, enc.payload, 2)
    with pytest.raises(grpc.RpcError) as err:
        client.push_payload(header, enc.payload, timeout=30, offset=held + 1)
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert client.upload_offset(header, size, 5) == held
    # UploadOffset itself: another run, an unregistered learner
    other = outer_pb2.DeltaHeader()
    other.CopyFrom(header)
    other.run_id = "another-run"
    with pytest.raises(grpc.RpcError) as err:
        client._stub.UploadOffset(outer_pb2.UploadOffsetRequest(header=other), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    other.run_id, other.learner_id = "resume-run", max(ids) + 1000
    with pytest.raises(grpc.RpcError) as err:
        client._stub.UploadOffset(outer_pb2.UploadOffsetRequest(header=other), timeout=10)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert client.push_payload(header, enc.payload, timeout=30, offset=held).outcome == outer_pb2.PUSH_OUTCOME_ACCEPTED
