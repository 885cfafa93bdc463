"""Every kind of bad delta is refused over a real gRPC connection with a precise status,
and leaves the global parameters and version exactly as they were."""

from __future__ import annotations

import hashlib

import grpc
import numpy as np
import pytest
import zstandard

from ddiloco.common import codec
from ddiloco.common.rpc import channel
from ddiloco.common.transport import OuterClient
from ddiloco.common.wire import payload_info, stream_messages
from ddiloco.v1 import outer_pb2, outer_pb2_grpc

# the fixture's run: M=2, H=5, batch 4, context 64 -> one round is 2560 tokens
ROUND = 2 * 5 * 4 * 64


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    from support import TINY_RUN, wait_serving, wait_until

    from ddiloco.launcher.processes import Cluster

    cluster = Cluster(tmp_path_factory.mktemp("bad-input"))
    cluster.start_coordinator([*TINY_RUN, "--learners", "2", "--max-seconds", "600", "--run-id", "good-run"])
    cluster.start_outer()
    wait_until(cluster.registered_outer, 120, "outer registration")
    wait_serving(cluster.outer_address)
    from outer_helpers import register

    ids = register(cluster.coordinator_address, 2)  # a valid registration: token and model signature
    yield cluster, ids
    cluster.stop_all()


class Probe:
    def __init__(self, cluster, learner_id):
        self.client = OuterClient(cluster.outer_address, "good-run", learner_id)
        self.stub = outer_pb2_grpc.OuterOptimizerStub(channel(cluster.outer_address))
        g = self.client.pull(0, -1, timeout=30)
        self.specs = [(n, a.shape) for n, a in g.arrays]

    def global_state(self):
        """(version, sha256 of the served global parameters)."""
        g = self.client.pull(0, -1, timeout=30)
        blob = b"".join(a.tobytes() for _, a in g.arrays)
        return g.version, hashlib.sha256(blob).hexdigest()

    def delta(self, scale=1e-3, seed=0):
        rng = np.random.default_rng(seed)
        return [(n, (rng.normal(size=s) * scale).astype(np.float32)) for n, s in self.specs]

    def header(self, enc, seq, learner_id, base_version=0, tokens=ROUND // 2, run_id="good-run"):
        return outer_pb2.DeltaHeader(
            run_id=run_id, learner_id=learner_id, base_version=base_version, tokens=tokens, inner_steps=5, seq=seq,
            payload=payload_info(enc),
        )

    def push_raw(self, header, payload, chunk=1 << 16):
        return self.stub.PushDelta(stream_messages(outer_pb2.DeltaChunk, header, payload, chunk), timeout=30)


def refused(probe, fn, code, match):
    before = probe.global_state()
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details()
    assert probe.global_state() == before, "a refused delta changed the global parameters"


@pytest.fixture(scope="module")
def probe(system):
    cluster, ids = system
    p = Probe(cluster, ids[0])
    # a valid delta is accepted and merged: the baseline every refusal is compared against
    v0, _ = p.global_state()
    enc = codec.encode(p.delta(), "int8", 64)
    resp = p.push_raw(p.header(enc, 1, ids[0], base_version=v0), enc.payload)
    assert resp.outcome == outer_pb2.PUSH_OUTCOME_ACCEPTED
    from support import wait_until

    wait_until(lambda: p.global_state()[0] > v0, 30, "the valid delta to merge")
    p.ids = ids
    p.seq = 2
    return p


def test_truncated_upload(probe):
    enc = codec.encode(probe.delta(), "int8", 64)
    header = probe.header(enc, probe.seq, probe.ids[0])
    refused(probe, lambda: probe.push_raw(header, enc.payload[:-100]), grpc.StatusCode.DATA_LOSS, "truncated")


def test_checksum_mismatch(probe):
    enc = codec.encode(probe.delta(), "int8", 64)
    bad = bytearray(enc.payload)
    bad[100] ^= 0x55
    refused(probe, lambda: probe.push_raw(probe.header(enc, probe.seq, probe.ids[0]), bytes(bad)), grpc.StatusCode.DATA_LOSS, "checksum")


def test_wrong_shape(probe):
    arrays = probe.delta()
    arrays[0] = (arrays[0][0], arrays[0][1][:-1])
    enc = codec.encode(arrays, "int8", 64)
    refused(probe, lambda: probe.push_raw(probe.header(enc, probe.seq, probe.ids[0]), enc.payload), grpc.StatusCode.INVALID_ARGUMENT, "shape")


def test_wrong_dtype(probe):
    enc = codec.encode(probe.delta(), "int8", 64)
    header = probe.header(enc, probe.seq, probe.ids[0])
    header.payload.tensors[1].dtype = "float16"
    refused(probe, lambda: probe.push_raw(header, enc.payload), grpc.StatusCode.INVALID_ARGUMENT, "dtype")


def test_wrong_length(probe):
    """A payload that decodes to fewer values than its (correct) tensor specs imply."""
    arrays = probe.delta()
    enc = codec.encode(arrays, "fp32")
    short = zstandard.ZstdCompressor().compress(zstandard.ZstdDecompressor().decompress(enc.payload)[:-8])
    header = probe.header(enc, probe.seq, probe.ids[0])
    header.payload.payload_bytes = len(short)
    header.payload.xxh3_128 = codec.digest_of(short)
    refused(probe, lambda: probe.push_raw(header, short), grpc.StatusCode.INVALID_ARGUMENT, "does not match")


def test_nan_filled_delta(probe):
    enc = codec.encode(probe.delta(), "fp32")
    raw = bytearray(zstandard.ZstdDecompressor().decompress(enc.payload))
    raw[0:4] = np.array([np.nan], dtype="<f4").tobytes()
    payload = zstandard.ZstdCompressor().compress(bytes(raw))
    header = probe.header(enc, probe.seq, probe.ids[0])
    header.payload.payload_bytes = len(payload)
    header.payload.xxh3_128 = codec.digest_of(payload)
    refused(probe, lambda: probe.push_raw(header, payload), grpc.StatusCode.INVALID_ARGUMENT, "NaN or Inf")


def test_unregistered_learner(probe):
    enc = codec.encode(probe.delta(), "int8", 64)
    refused(probe, lambda: probe.push_raw(probe.header(enc, 1, 99), enc.payload), grpc.StatusCode.PERMISSION_DENIED, "not registered")


def test_other_run_id(probe):
    enc = codec.encode(probe.delta(), "int8", 64)
    header = probe.header(enc, probe.seq, probe.ids[0], run_id="someone-else")
    refused(probe, lambda: probe.push_raw(header, enc.payload), grpc.StatusCode.FAILED_PRECONDITION, "run")


def test_repeated_sequence_number(probe):
    enc = codec.encode(probe.delta(), "int8", 64)
    refused(probe, lambda: probe.push_raw(probe.header(enc, 1, probe.ids[0]), enc.payload), grpc.StatusCode.ALREADY_EXISTS, "already accepted")


def test_oversize_delta(probe):
    enc = codec.encode(probe.delta(), "int8", 64)
    header = probe.header(enc, probe.seq, probe.ids[0])
    header.payload.payload_bytes = 1 << 40
    refused(probe, lambda: probe.push_raw(header, enc.payload), grpc.StatusCode.RESOURCE_EXHAUSTED, "exceeds the limit")


def test_more_bytes_than_declared(probe):
    enc = codec.encode(probe.delta(), "int8", 64)
    header = probe.header(enc, probe.seq, probe.ids[0])
    refused(probe, lambda: probe.push_raw(header, enc.payload + b"x" * 10), grpc.StatusCode.INVALID_ARGUMENT, "more than")


def test_stream_without_header(probe):
    refused(
        probe, lambda: probe.stub.PushDelta(iter([outer_pb2.DeltaChunk(data=b"abc")]), timeout=10),
        grpc.StatusCode.INVALID_ARGUMENT, "no header",
    )


def test_empty_stream_from_a_live_sender(probe):
    """No message at all from a caller still waiting for its answer: a client's bug, refused
    (a sender that died as it opened the stream is not: tests/common/test_call_ended.py)."""
    refused(probe, lambda: probe.stub.PushDelta(iter(()), timeout=10), grpc.StatusCode.INVALID_ARGUMENT, "empty stream")


def test_base_version_from_the_future(probe):
    enc = codec.encode(probe.delta(), "int8", 64)
    header = probe.header(enc, probe.seq, probe.ids[0], base_version=10_000)
    refused(probe, lambda: probe.push_raw(header, enc.payload), grpc.StatusCode.FAILED_PRECONDITION, "newer than")


def test_stale_delta_beyond_the_bound(probe):
    """Learner A merges five rounds of work; learner B's delta from version 0 is then 5
    rounds behind (bound 4) and refused. A's own work never makes A's deltas stale."""
    from support import wait_until

    a, b = probe.ids
    base = probe.global_state()[0]
    for i in range(5):
        enc = codec.encode(probe.delta(1e-4, seed=i), "int8", 64)
        probe.push_raw(probe.header(enc, probe.seq, a, base_version=base, tokens=ROUND), enc.payload)
        probe.seq += 1
    wait_until(lambda: probe.global_state()[0] >= base + 5, 30, "five merges")
    enc = codec.encode(probe.delta(), "int8", 64)
    refused(probe, lambda: probe.push_raw(probe.header(enc, 1, b, base_version=base), enc.payload), grpc.StatusCode.FAILED_PRECONDITION, "stale")


# ---------------------------------------------------------------- what a header may claim
def _claim(probe, **fields):
    enc = codec.encode(probe.delta(), "int8", 64)
    header = probe.header(enc, probe.seq, probe.ids[0], base_version=probe.global_state()[0])
    for k, v in fields.items():
        setattr(header, k, v)
    return header, enc.payload


def test_an_inflated_token_count_is_refused_and_the_service_stays_responsive(probe):
    """2^62 tokens used to hold the state lock for 2^62 / round merge substeps, forever."""
    header, payload = _claim(probe, tokens=2**62)
    refused(probe, lambda: probe.push_raw(header, payload), grpc.StatusCode.INVALID_ARGUMENT, "tokens=")
    assert probe.client.status().version >= 1


def test_tokens_outside_what_the_steps_can_weigh_are_refused(probe):
    """At least 1 per step, at most 16 x the run's step weight (batch x context) per step:
    batches of a workload may weigh differently, so the sum is not checked against one batch."""
    header, payload = _claim(probe, tokens=4)  # 5 steps
    refused(probe, lambda: probe.push_raw(header, payload), grpc.StatusCode.INVALID_ARGUMENT, "a batch weight in [1, 4096]")
    header, payload = _claim(probe, tokens=5 * 16 * 64 * 4 + 1)
    refused(probe, lambda: probe.push_raw(header, payload), grpc.StatusCode.INVALID_ARGUMENT, "a batch weight in [1, 4096]")


def test_more_inner_steps_than_a_delta_may_coalesce_are_refused(probe):
    header, payload = _claim(probe, inner_steps=10**9, tokens=10**9 * 64 * 4)
    refused(probe, lambda: probe.push_raw(header, payload), grpc.StatusCode.INVALID_ARGUMENT, "coalesced windows")


@pytest.mark.parametrize("seconds", [float("nan"), -1.0, 1e12])
def test_an_impossible_compute_time_is_refused(probe, seconds):
    header, payload = _claim(probe, compute_seconds=seconds)
    refused(probe, lambda: probe.push_raw(header, payload), grpc.StatusCode.INVALID_ARGUMENT, "compute_seconds")


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_training_loss_is_refused(probe, loss):
    """A learner stops before a non-finite loss reaches its parameters, so no window it
    sends carries one; the value goes into the outer optimizer's record of the delta."""
    header, payload = _claim(probe, loss=loss)
    refused(probe, lambda: probe.push_raw(header, payload), grpc.StatusCode.INVALID_ARGUMENT, "is not finite: a learner stops")


def test_a_finite_delta_larger_than_adamw_can_move_is_refused(probe):
    """Values around 1e6 used to be accepted and sent the eval loss to 5e12."""
    enc = codec.encode(probe.delta(scale=1e6), "int8", 64)
    header = probe.header(enc, probe.seq, probe.ids[0], base_version=probe.global_state()[0])
    refused(probe, lambda: probe.push_raw(header, enc.payload), grpc.StatusCode.INVALID_ARGUMENT, "AdamW steps")


def test_a_sequence_number_far_ahead_is_refused(probe):
    """Accepting it would make the learner's own next deltas look like repeats."""
    header, payload = _claim(probe, seq=probe.seq + 10**6)
    refused(probe, lambda: probe.push_raw(header, payload), grpc.StatusCode.INVALID_ARGUMENT, "jumps more than")


def test_pull_for_an_unregistered_learner_is_refused(probe):
    """A download view holds a full copy of a fragment: none for ids the run does not have."""
    request = outer_pb2.PullGlobalRequest(run_id="good-run", learner_id=12345, fragment=0, have_version=-1)
    refused(probe, lambda: list(probe.stub.PullGlobal(request, timeout=10)), grpc.StatusCode.PERMISSION_DENIED, "not registered")


@pytest.mark.parametrize("run_id,code,match", [
    ("", grpc.StatusCode.INVALID_ARGUMENT, "run_id is missing"),
    ("someone-else", grpc.StatusCode.FAILED_PRECONDITION, "is not run"),
])
def test_a_pull_must_name_this_run(probe, run_id, code, match):
    request = outer_pb2.PullGlobalRequest(run_id=run_id, learner_id=probe.ids[0], fragment=0, have_version=-1)
    refused(probe, lambda: list(probe.stub.PullGlobal(request, timeout=10)), code, match)


@pytest.mark.parametrize("have_version", [-2, -(2**63)])
def test_a_pull_from_a_version_no_copy_can_hold_is_refused(probe, have_version):
    request = outer_pb2.PullGlobalRequest(run_id="good-run", learner_id=probe.ids[0], fragment=0, have_version=have_version)
    refused(
        probe, lambda: list(probe.stub.PullGlobal(request, timeout=10)), grpc.StatusCode.INVALID_ARGUMENT,
        f"have_version={have_version}: a version held",
    )


def test_finalize_while_the_run_is_running_is_refused(probe):
    refused(
        probe, lambda: probe.stub.Finalize(outer_pb2.FinalizeRequest(), timeout=30), grpc.StatusCode.FAILED_PRECONDITION,
        "RUN_STATE_RUNNING",
    )


def _lazy_stream(header, sent: list, messages: int = 200, chunk: int = 1 << 20):
    """A push of ``messages`` chunks of ``chunk`` bytes, made only as gRPC takes them;
    ``sent`` counts those taken after the header's."""
    yield outer_pb2.DeltaChunk(header=header, data=bytes(chunk))
    for _ in range(messages - 1):
        sent.append(1)
        yield outer_pb2.DeltaChunk(data=bytes(chunk))


@pytest.mark.parametrize("case", ["unregistered", "repeated-seq", "larger-than-the-fragment", "unknown-codec"])
def test_a_delta_refused_on_its_header_is_not_received_past_it(probe, case):
    """The header is checked when it arrives: a push that its header already condemns costs
    the server its first message, not the 200 MiB it declares (the run's delta limit is 256
    MiB). Before, every check waited for the whole payload."""
    enc = codec.encode(probe.delta(), "int8", 64)
    header = probe.header(enc, probe.seq, probe.ids[0], base_version=probe.global_state()[0])
    header.payload.payload_bytes = 200 << 20
    code, match = grpc.StatusCode.INVALID_ARGUMENT, "takes at most"
    if case == "unregistered":
        header.learner_id, code, match = 99, grpc.StatusCode.PERMISSION_DENIED, "not registered"
    elif case == "repeated-seq":
        # a retry's header is the accepted one's, a size the fragment can take: the layout is
        # checked first, so a header both repeated and oversized is refused as invalid
        header.seq, code, match = 1, grpc.StatusCode.ALREADY_EXISTS, "already accepted"
        header.payload.payload_bytes = len(enc.payload)
    elif case == "unknown-codec":
        header.payload.codec, match = 77, "unknown codec 77"
    sent: list = []
    refused(probe, lambda: probe.stub.PushDelta(_lazy_stream(header, sent), timeout=60), code, match)
    # what flow control let the client queue before the refusal came back, far from 199
    assert len(sent) < 50, len(sent)
