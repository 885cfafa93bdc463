"""Fuzzing the outer optimizer over real sockets: every RPC with hostile field values.

A real coordinator and outer optimizer run as processes on 127.0.0.1 (TINY_RUN); two
learner ids are registered like learners register, and one valid delta of learner A is
accepted and merged first, so repeats, jumps and staleness all have something to hit.

Each example is one request, drawn by hypothesis (deterministic: derandomized):

* ``PushDelta``: a delta a real learner could send, then one to three *poisons*, each of
  which alone makes it inadmissible: another run id, an unregistered learner id (any
  int32), a sequence number <= 0, repeated or jumping past the bound, inner_steps outside
  [1, 64 H], tokens that are no whole batch per step (or inflated up to 2^63 - 1), a
  compute time that is NaN, infinite, negative or longer than a lease per step, a base
  version from the future, a fragment that does not exist; and on the stream: truncated,
  padded, garbled bytes, a wrong declared size or digest, an unknown payload format or
  compression, an unknown codec, an invalid
  block size (odd, below 2, or above the largest a run may use), tensor specs with another count, name, shape or dtype, a payload that is not
  zstd, NaN/Inf values, values far beyond what H AdamW steps can move, a stream without
  header, with a repeated header, or empty, or resuming at an offset nothing is held for. The valid base itself is encoded with an
  arbitrary even block size up to the largest a run may use (2^20), in payload format 1 (zstd, SHA-256) or 2
  (uncompressed or zstd, XXH3-128). A "wild" form draws every field at random.
* ``PullGlobal``: any run id, learner id, have_version, fragment, pace.
* ``UploadOffset``: any run id, learner id, sequence, offset, declared size.
* ``ReadFragment``: any run id, fragment.
* ``GetStatus``: any wait_newer_than, wait_ms either short (<= 30 ms) or above the bound.
* ``Finalize`` while the run is running; ``grpc.health.v1`` Check with any service name.

Asserted for every request: the status is OK or precise (never UNKNOWN, INTERNAL, a
deadline: see fuzz_helpers.PRECISE), no poisoned delta is accepted, and after every
request the outer optimizer's status (version, outer steps, tokens merged, pending deltas,
bytes received, per-fragment versions and per-learner accepted/merged counts and last
sequence) is unchanged. Every 500 requests and at the end, the served global parameters
(sha256 of a full pull) are unchanged too, and at the end the service answers SERVING.
"""

from __future__ import annotations

import hashlib
import pathlib
import sys

import grpc
import numpy as np
import pytest
import zstandard
from fuzz_helpers import SIZES, UINT32_MAX, Calls, doubles, fuzz_settings, int32s, int64s, texts
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "outer"))

from outer_helpers import Remote, register  # noqa: E402

from ddiloco.common.config import MAX_BLOCK_SIZE, RunConfig  # noqa: E402
from ddiloco.common.rpc import channel  # noqa: E402
from ddiloco.common import codec  # noqa: E402
from ddiloco.common.wire import COMPRESSION_TO_PB, PB_TO_CODEC, PB_TO_COMPRESSION  # noqa: E402
from ddiloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, outer_pb2, outer_pb2_grpc  # noqa: E402

RUN_ID = "fuzz-run"
DIGEST_EVERY = 500


# ---------------------------------------------------------------- payloads of any block size
def encode_int8(
    specs, scale: float, block_size: int, q_value: int = 1, fmt: int = 1, compression: str = "zstd"
) -> tuple[common_pb2.PayloadInfo, bytes]:
    """An int8 payload for ``specs`` with every value ``q_value x scale``, built in O(numel)
    for any block size (the codec's own encoder pads to whole blocks); payload format
    ``fmt`` (format 1 is always zstd)."""
    parts = []
    for _, shape in specs:
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        nb = -(-n // block_size)
        parts.append(np.full(nb, scale, dtype="<f4").tobytes())
        parts.append(np.full(n, q_value, dtype=np.int8).tobytes())
    raw = b"".join(parts)
    payload = zstandard.ZstdCompressor(level=1).compress(raw) if fmt == 1 or compression == "zstd" else raw
    info = common_pb2.PayloadInfo(
        codec=common_pb2.CODEC_INT8,
        block_size=block_size,
        tensors=[common_pb2.TensorSpec(name=n, shape=list(s), dtype="float32") for n, s in specs],
    )
    if fmt == 2:
        info.format, info.compression = 2, COMPRESSION_TO_PB[compression]
    rehash(info, payload)
    return info, payload


def encode_fp32(specs, values: np.ndarray | None = None, bad_at: int = 0, bad: float = float("nan")):
    """An fp32 payload of small values with one non-finite value at flat index ``bad_at``."""
    flat = []
    for _, shape in specs:
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        flat.append(np.full(n, 1e-5, dtype="<f4"))
    allv = np.concatenate(flat)
    allv[bad_at % allv.size] = bad
    payload = zstandard.ZstdCompressor(level=1).compress(allv.astype("<f4").tobytes())
    info = common_pb2.PayloadInfo(
        codec=common_pb2.CODEC_FP32,
        block_size=0,
        tensors=[common_pb2.TensorSpec(name=n, shape=list(s), dtype="float32") for n, s in specs],
        payload_bytes=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
    )
    return info, payload


def rehash(info: common_pb2.PayloadInfo, payload: bytes) -> None:
    """The declared size and the digest of ``info``'s format, made true for ``payload``."""
    info.payload_bytes = len(payload)
    if info.format == 2:
        info.xxh3_128 = codec.digest_of(payload, 2)
    else:
        info.sha256 = hashlib.sha256(payload).hexdigest()


# ---------------------------------------------------------------- the system under test
class System:
    def __init__(self, cluster, ids: list[int]) -> None:
        self.cluster = cluster
        self.ids = ids
        self.a, self.b = ids
        self.config = RunConfig.from_json(
            coordinator_pb2_grpc.CoordinatorStub(channel(cluster.coordinator_address))
            .GetRunConfig(coordinator_pb2.GetRunConfigRequest(), timeout=5)
            .config_json
        )
        self.remote = Remote(cluster.outer_address, RUN_ID, self.a)
        self.stub = self.remote.stub
        self.health = health_pb2_grpc.HealthStub(channel(cluster.outer_address))
        self.specs = self.remote.specs
        lc = self.config.learner
        self.h, self.batch, self.context = lc.inner_steps, lc.batch_size, self.config.model.context
        self.max_steps = lc.max_delta_steps()
        self.tokens = self.h * self.batch * self.context
        self.max_compute = self.max_steps * self.config.lease_timeout_s
        self.max_bytes = self.config.outer.max_delta_bytes
        self.last_seq = {self.a: 1, self.b: 0}  # after the fixture's one accepted delta

    def fingerprint(self) -> tuple:
        """What refused input must leave unchanged, from GetStatus (cheap: one per request).
        Learner entries with nothing accepted are left out: a refused delta of a registered
        learner may create its (empty) record, which counts refusals."""
        st_ = self.remote.status()
        learners = sorted(
            (m.learner_id, m.deltas_accepted, m.deltas_merged, m.tokens_merged, m.last_seq, m.tokens_accepted)
            for m in st_.learners
            if m.deltas_accepted or m.deltas_merged or m.tokens_accepted or m.last_seq
        )
        fragments = [(f.fragment, f.version, f.tokens_merged, dict(f.merged_by_learner)) for f in st_.fragments]
        return (st_.version, st_.outer_steps, st_.tokens_merged, st_.pending_deltas, st_.bytes_received, fragments, learners)


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    from support import TINY_RUN, wait_serving, wait_until

    from ddiloco.launcher.processes import Cluster

    cluster = Cluster(tmp_path_factory.mktemp("fuzz-outer"))
    cluster.start_coordinator([*TINY_RUN, "--learners", "2", "--max-seconds", "7200", "--run-id", RUN_ID])
    cluster.start_outer()
    wait_until(cluster.registered_outer, 120, "outer registration")
    wait_serving(cluster.outer_address)
    ids = register(cluster.coordinator_address, 2)
    s = System(cluster, ids)
    v0, _ = s.remote.global_state()
    assert s.remote.push(1, seed=0, base=v0).outcome == outer_pb2.PUSH_OUTCOME_ACCEPTED
    wait_until(lambda: s.remote.global_state()[0] > v0 and s.remote.status().pending_deltas == 0, 60, "the valid delta to merge")
    yield s
    cluster.stop_all()


# ---------------------------------------------------------------- PushDelta requests
HEADER_POISONS = ["run_id", "learner", "seq_nonpositive", "seq_repeat", "seq_jump", "inner_steps", "tokens",
                  "compute_seconds", "loss", "base_future", "fragment", "incarnation"]
STREAM_POISONS = ["truncate", "pad", "flip", "declared_bytes", "sha", "codec", "block_size", "spec_count", "spec_name",
                  "spec_shape", "spec_dtype", "not_zstd", "non_finite", "magnitude", "no_header", "header_repeated",
                  "empty_stream", "format", "compression", "offset"]
FORMS = [(1, "zstd"), (2, "none"), (2, "zstd")]  # (payload format, compression) of the valid base


@st.composite
def push_requests(draw, s: System, version: int):
    """(poisons, messages) of one PushDelta that no admission rule may accept."""
    if draw(st.integers(0, 19)) == 0:
        return ["wild"], draw(wild_push())
    block = draw(st.one_of(st.just(64), st.integers(1, MAX_BLOCK_SIZE // 2).map(lambda k: 2 * k)))
    fmt, compression = draw(st.sampled_from(FORMS))
    info, payload = encode_int8(s.specs, 1e-5, block, fmt=fmt, compression=compression)
    learner = draw(st.sampled_from(s.ids))
    header = outer_pb2.DeltaHeader(
        run_id=RUN_ID, learner_id=learner, base_version=version, tokens=s.tokens, inner_steps=s.h,
        seq=s.last_seq[learner] + draw(st.integers(1, 1024)), fragment=0,
        # any finite loss is one a window can have; a non-finite one is a poison of its own
        compute_seconds=draw(st.floats(0, s.h * 0.5)), loss=draw(st.floats(allow_nan=False, allow_infinity=False)),
        # each learner id registered once: its process is incarnation 1 (0: not stated)
        incarnation=draw(st.sampled_from([0, 1])),
    )
    poisons = draw(st.lists(st.sampled_from(HEADER_POISONS + STREAM_POISONS), min_size=1, max_size=3, unique=True))
    structure = None
    for p in poisons:
        if p == "run_id":
            header.run_id = draw(texts().filter(lambda t: t != RUN_ID))
        elif p == "learner":
            header.learner_id = draw(int32s().filter(lambda i: i not in s.ids))
        elif p == "seq_nonpositive":
            header.seq = draw(st.integers(-(1 << 63), 0))
        elif p == "seq_repeat":
            header.learner_id, header.seq = s.a, s.last_seq[s.a]
        elif p == "seq_jump":
            header.seq = draw(st.integers(max(s.last_seq.values()) + 1025, (1 << 63) - 1))
        elif p == "inner_steps":
            header.inner_steps = draw(st.one_of(st.integers(-(1 << 63), 0), st.integers(s.max_steps + 1, (1 << 63) - 1)))
        elif p == "tokens":
            # outside what admission allows (outer/admission.py): at least one token per step,
            # at most 16 x the run's step weight per step. Batches of a workload may weigh
            # differently, so a sum that is no whole number of batches is not a poison (the
            # former "not a whole batch per step" draw was accepted once the slow tier drew a
            # small one). Against the base H: a poisoned inner_steps is refused anyway.
            most = s.h * 16 * s.batch * s.context
            header.tokens = draw(
                st.one_of(
                    st.integers(-(1 << 63), 0),  # none, or negative
                    st.integers(1, s.h - 1),  # less than one token per step
                    st.integers(most + 1, (1 << 63) - 1),  # an inflated batch
                    st.just(most + 1),
                    st.just((1 << 63) - 1),
                )
            )
        elif p == "compute_seconds":
            header.compute_seconds = draw(
                st.one_of(
                    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
                    st.floats(max_value=-1e-300, allow_nan=False),
                    st.floats(min_value=s.max_compute * 1.001, allow_nan=False),
                )
            )
        elif p == "loss":
            header.loss = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
        elif p == "base_future":
            header.base_version = draw(st.integers(version + 1, (1 << 63) - 1))
        elif p == "fragment":
            header.fragment = draw(int32s().filter(lambda f: f != 0))
        elif p == "incarnation":  # a process the coordinator never registered, or no process at all
            header.incarnation = draw(st.one_of(st.integers(-(1 << 31), -1), st.integers(2, (1 << 31) - 1)))
        elif p == "truncate":
            payload = payload[: len(payload) - draw(st.integers(1, len(payload)))]
        elif p == "pad":
            payload = payload + draw(st.binary(min_size=1, max_size=4096))
        elif p == "flip":
            pos = draw(st.integers(0, len(payload) - 1))
            payload = payload[:pos] + bytes([payload[pos] ^ draw(st.integers(1, 255))]) + payload[pos + 1 :]
        elif p == "declared_bytes":
            info.payload_bytes = draw(int64s().filter(lambda n: n != len(payload)))
        elif p == "sha":
            if info.format == 2:
                info.xxh3_128 = draw(st.one_of(texts(60), st.binary(min_size=16, max_size=16).map(bytes.hex)).filter(
                    lambda h: h != codec.digest_of(payload, 2)))
            else:
                info.sha256 = draw(st.one_of(texts(100), st.binary(min_size=32, max_size=32).map(bytes.hex)).filter(
                    lambda h: h != hashlib.sha256(payload).hexdigest()))
        elif p == "format":
            info.format = draw(st.integers(3, UINT32_MAX))
        elif p == "offset":  # a resumption of an upload nothing is held for, or outside the payload
            header.offset = draw(st.one_of(st.integers(-(1 << 63), -1), st.integers(1, (1 << 63) - 1)))
        elif p == "compression":
            info.format = 2
            info.compression = draw(int32s().filter(lambda c: c not in PB_TO_COMPRESSION))
        elif p == "codec":
            info.codec = draw(int32s().filter(lambda c: c not in PB_TO_CODEC))
        elif p == "block_size":
            info.block_size = draw(st.one_of(st.integers(-(1 << 31), 1), st.integers(1, (1 << 30) - 1).map(lambda k: 2 * k + 1),
                                             st.integers(MAX_BLOCK_SIZE // 2 + 1, (1 << 30) - 1).map(lambda k: 2 * k)))
        elif p == "spec_count":
            if draw(st.booleans()) and len(info.tensors) > 1:
                del info.tensors[draw(st.integers(0, len(info.tensors) - 1))]
            else:
                info.tensors.add(name=draw(texts(40)), shape=draw(st.lists(st.integers(0, 64), max_size=3)), dtype="float32")
        elif p == "spec_name":
            i = draw(st.integers(0, len(info.tensors) - 1))
            info.tensors[i].name = draw(texts(80).filter(lambda n, old=info.tensors[i].name: n != old))
        elif p == "spec_shape":
            i = draw(st.integers(0, len(info.tensors) - 1))
            old = list(info.tensors[i].shape)
            new = draw(st.lists(int64s(), max_size=4).filter(lambda sh: sh != old))
            del info.tensors[i].shape[:]
            info.tensors[i].shape.extend(new)
        elif p == "spec_dtype":
            i = draw(st.integers(0, len(info.tensors) - 1))
            info.tensors[i].dtype = draw(texts(20).filter(lambda d: d != "float32"))
        elif p == "not_zstd":
            payload = draw(st.binary(min_size=1, max_size=8192))
            rehash(info, payload)
        elif p == "non_finite":
            n = sum(int(np.prod(sh, dtype=np.int64)) for _, sh in s.specs)
            info, payload = encode_fp32(
                s.specs, bad_at=draw(st.integers(0, n - 1)), bad=draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
            )
        elif p == "magnitude":
            info, payload = encode_int8(s.specs, draw(st.floats(10.0, 1e30)), block, q_value=127, fmt=fmt,
                                        compression=compression)
        elif p in ("no_header", "header_repeated", "empty_stream"):
            structure = p
    header.payload.CopyFrom(info)
    chunk = draw(st.integers(1024, 1 << 20))
    parts = [payload[i : i + chunk] for i in range(0, len(payload), chunk)] or [b""]
    messages = [outer_pb2.DeltaChunk(header=header, data=parts[0])] + [outer_pb2.DeltaChunk(data=p) for p in parts[1:]]
    if structure == "no_header":
        messages[0] = outer_pb2.DeltaChunk(data=parts[0])
    elif structure == "header_repeated":
        messages.insert(draw(st.integers(1, len(messages))), outer_pb2.DeltaChunk(header=header, data=b""))
    elif structure == "empty_stream":
        messages = []
    return poisons, messages


@st.composite
def wild_push(draw):
    """Every field at random (the digest never matches the random bytes)."""
    payload = draw(st.binary(max_size=4096))
    info = common_pb2.PayloadInfo(
        codec=draw(int32s()), block_size=draw(int32s()), payload_bytes=draw(int64s()), sha256=draw(texts(80)),
        format=draw(st.one_of(st.integers(0, 3), st.integers(0, UINT32_MAX))), compression=draw(int32s()),
        xxh3_128=draw(texts(40)),
        tensors=[
            common_pb2.TensorSpec(name=draw(texts(40)), shape=draw(st.lists(int64s(), max_size=4)), dtype=draw(texts(12)))
            for _ in range(draw(st.integers(0, 4)))
        ],
    )
    header = outer_pb2.DeltaHeader(
        run_id=draw(st.one_of(st.just(RUN_ID), texts())), learner_id=draw(int32s()), base_version=draw(int64s()),
        tokens=draw(int64s()), inner_steps=draw(int64s()), seq=draw(int64s()), payload=info, loss=draw(doubles()),
        fragment=draw(int32s()), compute_seconds=draw(doubles()), incarnation=draw(int32s()),
    )
    return [outer_pb2.DeltaChunk(header=header, data=payload)]


# ---------------------------------------------------------------- the other RPCs
def pull_requests(s: System):
    return st.builds(
        outer_pb2.PullGlobalRequest,
        run_id=st.one_of(st.just(RUN_ID), st.just(""), texts()),
        learner_id=st.one_of(st.sampled_from(s.ids), int32s()),
        have_version=int64s(),
        fragment=st.one_of(st.just(0), int32s()),
        # a valid pace is kept short (a paced download takes its span); 10^7 ms is beyond
        # any slot of this run, and is refused
        pace_ms=st.one_of(st.integers(0, 30), st.integers(10_000_000, UINT32_MAX)),
    )


def upload_offset_requests(s: System, version: int):
    """Any header: nothing is ever held here (no fuzzed stream breaks), so 0 or a refusal."""
    return st.builds(
        lambda run_id, learner, seq, offset, size, incarnation: outer_pb2.UploadOffsetRequest(header=outer_pb2.DeltaHeader(
            run_id=run_id, learner_id=learner, seq=seq, offset=offset, base_version=version,
            payload=common_pb2.PayloadInfo(payload_bytes=size), incarnation=incarnation)),
        st.one_of(st.just(RUN_ID), texts()), st.one_of(st.sampled_from(s.ids), int32s()), int64s(), int64s(), int64s(),
        st.one_of(st.sampled_from([0, 1]), int32s()),
    )


def read_requests():
    return st.builds(
        outer_pb2.ReadFragmentRequest,
        run_id=st.one_of(st.just(RUN_ID), st.just(""), texts()),
        fragment=st.one_of(st.just(0), int32s()),
    )


def status_requests(s: System):
    return st.builds(
        outer_pb2.StatusRequest,
        wait_newer_than=int64s(),
        # a valid wait is kept short: a long poll on a version that never comes is allowed to wait
        wait_ms=st.one_of(st.integers(0, 30), st.integers(10_001, UINT32_MAX)),
        # a learner reading its position names its process (incarnation 1 here), or any ids
        learner_id=st.one_of(st.sampled_from(s.ids), int32s()),
        incarnation=st.one_of(st.sampled_from([0, 1]), int32s()),
    )


def requests(s: System, version: int):
    return st.one_of(
        push_requests(s, version).map(lambda r: ("PushDelta", r)),
        push_requests(s, version).map(lambda r: ("PushDelta", r)),
        push_requests(s, version).map(lambda r: ("PushDelta", r)),
        pull_requests(s).map(lambda r: ("PullGlobal", r)),
        upload_offset_requests(s, version).map(lambda r: ("UploadOffset", r)),
        read_requests().map(lambda r: ("ReadFragment", r)),
        status_requests(s).map(lambda r: ("GetStatus", r)),
        st.integers(0, 9).map(lambda _: ("Finalize", outer_pb2.FinalizeRequest())),
        texts(60).map(lambda n: ("Health", health_pb2.HealthCheckRequest(service=n))),
    )


# ---------------------------------------------------------------- the test
@pytest.mark.parametrize("examples", SIZES)
def test_hostile_requests_get_precise_statuses_and_change_nothing(system, examples):
    from support import wait_serving

    s = system
    calls = Calls()
    before = s.fingerprint()
    version = before[0]
    params_before = s.remote.global_state()
    assert params_before[0] == version

    @fuzz_settings(examples)
    @given(request=requests(s, version))
    def one(request):
        rpc, req = request
        if rpc == "PushDelta":
            poisons, messages = req
            resp, code = calls.call(lambda: s.stub.PushDelta(iter(messages), timeout=30))
            assert code != grpc.StatusCode.OK, f"a poisoned delta ({poisons}) was accepted: {resp}"
        elif rpc == "PullGlobal":
            resp, code = calls.call(lambda: list(s.stub.PullGlobal(req, timeout=30)))
            if code == grpc.StatusCode.OK:
                assert req.learner_id in s.ids and req.fragment == 0 and req.run_id in ("", RUN_ID), req
                assert resp[0].header.version == version
        elif rpc == "UploadOffset":
            resp, code = calls.call(lambda: s.stub.UploadOffset(req, timeout=30))
            if code == grpc.StatusCode.OK:
                assert resp.offset == 0 and req.header.learner_id in s.ids and req.header.run_id == RUN_ID, (req, resp)
        elif rpc == "ReadFragment":
            resp, code = calls.call(lambda: list(s.stub.ReadFragment(req, timeout=30)))
            if code == grpc.StatusCode.OK:
                assert req.run_id == RUN_ID and req.fragment == 0, req
                assert resp[0].header.version == version and resp[0].header.base_version == -1
        elif rpc == "GetStatus":
            resp, code = calls.call(lambda: s.stub.GetStatus(req, timeout=30))
            # a status read that names a process: answered only for a registered id's own
            # (incarnation 1 here), within that learner's rate
            named = req.incarnation != 0
            answerable = req.wait_ms <= 10_000 and (not named or (req.incarnation == 1 and req.learner_id in s.ids))
            if not (named and code == grpc.StatusCode.RESOURCE_EXHAUSTED):
                assert (code == grpc.StatusCode.OK) == answerable, (req, code)
        elif rpc == "Finalize":
            _, code = calls.call(lambda: s.stub.Finalize(req, timeout=30))
            assert code == grpc.StatusCode.FAILED_PRECONDITION
        else:
            resp, code = calls.call(lambda: s.health.Check(req, timeout=10))
            if code == grpc.StatusCode.OK:
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
        assert s.fingerprint() == before, f"{rpc} changed the outer optimizer's state: {req}"
        if calls.sent % DIGEST_EVERY == 0:
            assert s.remote.global_state() == params_before, "the served parameters changed"

    one()
    assert calls.sent >= examples, calls.sent
    assert s.fingerprint() == before
    assert s.remote.global_state() == params_before, "the served parameters changed"
    wait_serving(s.cluster.outer_address, timeout=10)
    print(f"\nfuzz outer: {calls.sent} requests, statuses {dict(sorted(calls.codes.items()))}")


@pytest.mark.parametrize("block, refusal", [(MAX_BLOCK_SIZE, "AdamW steps"), ((1 << 31) - 2, "block size 2147483646")])
def test_a_delta_with_a_huge_block_size_is_refused_in_time_proportional_to_its_values(system, block, refusal):
    """A header's block size is the sender's: decoding used to pad every tensor to whole
    blocks, so block_size 2^31 - 2 made the outer optimizer allocate 8 GiB and compute for
    ~30 s per tensor before its magnitude check refused the delta; later the compiled
    decoder still sized its scratch by the block. The largest block a run may use is
    decoded (and refused here for its magnitude) in time and memory that follow the values;
    a larger one is refused from the header, naming the bound."""
    import time

    s = system
    before, params = s.fingerprint(), s.remote.global_state()
    info, payload = encode_int8(s.specs, 1e3, block, q_value=127, fmt=2, compression="none")
    header = outer_pb2.DeltaHeader(
        run_id=RUN_ID, learner_id=s.a, base_version=before[0], tokens=s.tokens, inner_steps=s.h, seq=s.last_seq[s.a] + 1,
        payload=info,
    )
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as exc:
        s.stub.PushDelta(iter([outer_pb2.DeltaChunk(header=header, data=payload)]), timeout=30)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and refusal in exc.value.details()
    assert time.monotonic() - t0 < 5
    assert (s.fingerprint(), s.remote.global_state()) == (before, params)
