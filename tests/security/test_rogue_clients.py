"""Attacks on a running system with mutual TLS on: a real coordinator and outer optimizer
(processes, TLS sockets, the certificates ``ddiloco run`` makes), and clients that try
what a rogue or compromised peer would. Each attempt is refused with its precise status,
and leaves the run as it was: membership, global version, parameters, pending deltas.

Refused at the TLS handshake (no handler runs; the client sees UNAVAILABLE, no
connection): plaintext, a certificate of another CA, an expired certificate. Refused per
call: PERMISSION_DENIED for a role or a learner id the certificate does not carry,
UNAUTHENTICATED for a revoked certificate, RESOURCE_EXHAUSTED past a rate limit,
INVALID_ARGUMENT for a stream with more messages than its payload needs."""

from __future__ import annotations

import datetime
import hashlib
import json
import secrets
import time

import grpc
import numpy as np
import pytest

from ddiloco.common import auth, codec
from ddiloco.common.certs import init_ca, issue, revoke, setup_run
from ddiloco.common.config import RunConfig
from ddiloco.common.rpc import channel
from ddiloco.common.security import Security
from ddiloco.common.wire import payload_info, stream_messages
from ddiloco.coordinator.signature import model_signature
from ddiloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, outer_pb2, outer_pb2_grpc

RUN = "rogue"
LEASE_S = 4.0
CALLS_PER_S = 20.0  # the outer optimizer's per-learner limit in this run (burst 40)
WINDOW_TOKENS = 5 * 4 * 64  # TINY_RUN: H = 5, batch 4, context 64


class Peer:
    """A client holding one certificate: stubs of both services, dialed as a real one dials."""

    def __init__(self, system, security: Security | None) -> None:
        self.security = security
        self.coordinator = coordinator_pb2_grpc.CoordinatorStub(channel(system.coordinator, security, "coordinator"))
        self.outer = outer_pb2_grpc.OuterOptimizerStub(channel(system.outer, security, "outer"))


class System:
    def __init__(self, cluster, tls) -> None:
        self.cluster, self.tls = cluster, tls
        self.coordinator, self.outer = cluster.coordinator_address, cluster.outer_address
        self.operator = Peer(self, Security.from_dir(tls / "operator"))
        self.learners = [Peer(self, Security.from_dir(tls / f"learner-{i}")) for i in range(4)]
        config = RunConfig.from_json(self.operator.coordinator.GetRunConfig(coordinator_pb2.GetRunConfigRequest(), timeout=10).config_json)
        self.signature = model_signature(config)
        self.tokens = {}
        self.seq = {i: 0 for i in range(4)}

    def register(self, i: int, requested: int = -1, peer: Peer | None = None):
        self.tokens.setdefault(i, secrets.token_hex(8))
        req = coordinator_pb2.RegisterRequest(address="x:1", requested_learner_id=requested,
                                              instance_token=self.tokens[i], model=self.signature)
        return (peer or self.learners[i]).coordinator.Register(req, timeout=10)

    def heartbeat(self, i: int, as_id: int | None = None):
        req = coordinator_pb2.HeartbeatRequest(run_id=RUN, learner_id=i if as_id is None else as_id, stats=common_pb2.LearnerStats(),
                                               instance_token=self.tokens.get(i, ""))
        return self.learners[i].coordinator.Heartbeat(req, timeout=10)

    def pull(self, i: int, as_id: int | None = None, peer: Peer | None = None):
        """The global fragment 0 as learner ``i`` reads it. The helpers read it as learner 1 for
        every delta and state check, which can outrun the run's per-learner limit (20 calls/s,
        burst 40) on a fast machine: like a real learner, a refusal for rate is waited out (one
        call's worth of refill) and retried; any other refusal is the caller's to see."""
        req = outer_pb2.PullGlobalRequest(run_id=RUN, learner_id=i if as_id is None else as_id, have_version=-1, fragment=0)
        for _ in range(int(CALLS_PER_S * 10)):
            try:
                chunks = list((peer or self.learners[i]).outer.PullGlobal(req, timeout=30))
                return chunks[0].header, b"".join(c.data for c in chunks)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                time.sleep(1.0 / CALLS_PER_S)
        raise AssertionError("PullGlobal stayed rate-limited for 10 s: the limiter does not refill")

    def delta(self, learner_id: int, tokens: int = WINDOW_TOKENS, seq: int | None = None):
        """(header, payload) of a delta a real learner could send for ``learner_id``."""
        header, payload = self.pull(1)
        from ddiloco.common.wire import decode_payload

        arrays = decode_payload(header.payload, payload)
        rng = np.random.default_rng(learner_id)
        enc = codec.encode([(n, rng.uniform(-1e-3, 1e-3, size=a.shape).astype(np.float32)) for n, a in arrays], "int8", 64)
        if seq is None:
            self.seq[learner_id] += 1
            seq = self.seq[learner_id]
        h = outer_pb2.DeltaHeader(run_id=RUN, learner_id=learner_id, base_version=header.version, tokens=tokens,
                                  inner_steps=5, seq=seq, payload=payload_info(enc))
        return h, enc.payload

    def push(self, peer: Peer, header, payload, chunk: int = 1 << 16):
        return peer.outer.PushDelta(stream_messages(outer_pb2.DeltaChunk, header, payload, chunk), timeout=30)

    def state(self) -> tuple:
        """What no refused call may change."""
        m = self.operator.coordinator.GetMembership(coordinator_pb2.GetMembershipRequest(), timeout=10)
        members = [(x.learner_id, x.left, x.incarnation, x.shard_index) for x in m.members]
        st = self.operator.outer.GetStatus(outer_pb2.StatusRequest(), timeout=10)
        header, payload = self.pull(1)
        return (m.state, m.outer_address, members, st.version, st.tokens_merged, st.pending_deltas,
                sorted((r.learner_id, r.last_seq) for r in st.learners), header.version, hashlib.sha256(payload).hexdigest())


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    from support import TINY_RUN, wait_until

    from ddiloco.launcher.processes import Cluster

    out = tmp_path_factory.mktemp("rogue")
    tls = out / "tls"
    setup_run(tls, 4)
    config = out / "limits.json"
    config.write_text(json.dumps({"outer": {"learner_calls_per_s": CALLS_PER_S}}))
    cluster = Cluster(out, tls=tls)
    cluster.start_coordinator(["--config", str(config), *TINY_RUN, "--learners", "4", "--max-seconds", "600",
                               "--run-id", RUN, "--lease-timeout", str(LEASE_S)])
    cluster.start_outer()
    operator = cluster.security
    try:
        wait_until(cluster.registered_outer, 120, "the outer optimizer to register")
        wait_until(lambda: _serving(cluster.outer_address, operator), 120, "the outer optimizer to serve")
        system = System(cluster, tls)
        for i in range(4):  # each asks for any id (-1) and is given the one its certificate names
            assert system.register(i).learner_id == i
        yield system
    finally:
        cluster.stop_all()


def _serving(address: str, security: Security) -> bool:
    from ddiloco.common.health import check

    return check(address, timeout=1.0, security=security)[0]


def settled(system) -> None:
    """No merge in flight: an accepted delta of an earlier test may still be pending."""
    from support import wait_until

    wait_until(lambda: system.operator.outer.GetStatus(outer_pb2.StatusRequest(), timeout=10).pending_deltas == 0,
               60, "pending deltas to merge")


def refused(system, fn, code: grpc.StatusCode, match: str = "") -> None:
    settled(system)
    before = system.state()
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.code() == code, f"{info.value.code()}: {info.value.details()}"
    assert match in (info.value.details() or ""), info.value.details()
    assert system.state() == before, "a refused call changed the run"


# ---------------------------------------------------------------- refused at the handshake
def test_a_plaintext_client_reaches_no_service(system):
    plain = Peer(system, None)
    refused(system, lambda: plain.coordinator.GetMembership(coordinator_pb2.GetMembershipRequest(), timeout=5),
            grpc.StatusCode.UNAVAILABLE)
    refused(system, lambda: system.register(0, peer=plain), grpc.StatusCode.UNAVAILABLE)
    refused(system, lambda: system.push(plain, *system.delta(0)), grpc.StatusCode.UNAVAILABLE)


def test_a_certificate_of_another_ca_reaches_no_service(system, tmp_path):
    init_ca(tmp_path)
    own = Security.from_dir(issue(tmp_path, "learner-0", "learner"))
    # the attacker trusts the run's CA (it is public), so only the servers' check stops it
    rogue = Peer(system, Security(own.tls_dir, None, own.identity, (system.tls / "ca.crt").read_bytes(), own.cert_pem, own.key_pem))
    refused(system, lambda: system.register(0, peer=rogue), grpc.StatusCode.UNAVAILABLE)
    refused(system, lambda: system.push(rogue, *system.delta(0)), grpc.StatusCode.UNAVAILABLE)


def test_an_expired_certificate_reaches_no_service(system):
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=10)
    folder = issue(system.tls, "learner-6", "learner", days=1, valid_from=past)
    expired = Peer(system, Security(folder, None, None, *(folder.joinpath(f).read_bytes() for f in ("ca.crt", "tls.crt", "tls.key"))))
    refused(system, lambda: system.register(6, peer=expired), grpc.StatusCode.UNAVAILABLE)


# ---------------------------------------------------------------- identity: a learner is its certificate
def test_a_learner_cannot_register_as_another(system):
    refused(system, lambda: system.register(0, requested=1), grpc.StatusCode.PERMISSION_DENIED, "acts only as learner 0")


def test_a_learner_cannot_renew_or_end_another_learners_lease(system):
    refused(system, lambda: system.heartbeat(0, as_id=1), grpc.StatusCode.PERMISSION_DENIED, "not as learner 1")
    leave = coordinator_pb2.LeaveRequest(run_id=RUN, learner_id=1, reason="hijack")
    refused(system, lambda: system.learners[0].coordinator.Leave(leave, timeout=10), grpc.StatusCode.PERMISSION_DENIED, "not as learner 1")


def test_a_learner_cannot_push_or_pull_as_another(system):
    header, payload = system.delta(1, seq=99)
    refused(system, lambda: system.push(system.learners[0], header, payload), grpc.StatusCode.PERMISSION_DENIED, "not as learner 1")
    refused(system, lambda: system.pull(0, as_id=1), grpc.StatusCode.PERMISSION_DENIED, "not as learner 1")


def test_a_learner_cannot_read_a_position_as_another_learners_process(system):
    """A status read that names a process moves the outer optimizer's fence for that id
    (outer/known_learners.py): only the id's own certificate may make it."""
    as_other = outer_pb2.StatusRequest(learner_id=1, incarnation=1)
    refused(system, lambda: system.learners[0].outer.GetStatus(as_other, timeout=10), grpc.StatusCode.PERMISSION_DENIED,
            "not as learner 1")
    assert system.learners[1].outer.GetStatus(as_other, timeout=10).ready  # the control: as itself, answered


def test_a_learners_own_delta_is_accepted(system):
    """The control for the refusals around it: the same client, as itself, is served."""
    resp = system.push(system.learners[0], *system.delta(0))
    assert resp.outcome == outer_pb2.PUSH_OUTCOME_ACCEPTED


def test_a_replayed_upload_is_refused(system):
    header, payload = system.delta(0)
    assert system.push(system.learners[0], header, payload).outcome == outer_pb2.PUSH_OUTCOME_ACCEPTED
    refused(system, lambda: system.push(system.learners[0], header, payload), grpc.StatusCode.ALREADY_EXISTS)


def test_a_header_claiming_absurd_tokens_is_refused(system):
    header, payload = system.delta(0, tokens=10**12)
    refused(system, lambda: system.push(system.learners[0], header, payload), grpc.StatusCode.INVALID_ARGUMENT, "tokens=")


# ---------------------------------------------------------------- roles
def test_a_learner_cannot_call_what_only_the_coordinator_or_outer_may(system):
    learner = system.learners[0]
    refused(system, lambda: learner.outer.Finalize(outer_pb2.FinalizeRequest(), timeout=10),
            grpc.StatusCode.PERMISSION_DENIED, "may not call Finalize")
    # a full fp32 fragment is for the outer shard that evaluates, not for learners
    read = outer_pb2.ReadFragmentRequest(run_id=RUN, fragment=0)
    refused(system, lambda: list(learner.outer.ReadFragment(read, timeout=10)),
            grpc.StatusCode.PERMISSION_DENIED, "may not call ReadFragment")
    announce = coordinator_pb2.RegisterServiceRequest(run_id=RUN, kind="outer", address="evil:1")
    refused(system, lambda: learner.coordinator.RegisterService(announce, timeout=10),
            grpc.StatusCode.PERMISSION_DENIED, "may not call RegisterService")


def test_an_operator_reads_but_cannot_train_or_register(system):
    op = system.operator
    assert op.outer.GetStatus(outer_pb2.StatusRequest(), timeout=10).ready
    refused(system, lambda: system.push(op, *system.delta(0, seq=99)), grpc.StatusCode.PERMISSION_DENIED, "may not call PushDelta")
    refused(system, lambda: system.pull(0, peer=op), grpc.StatusCode.PERMISSION_DENIED, "may not call PullGlobal")
    refused(system, lambda: system.register(0, peer=op), grpc.StatusCode.PERMISSION_DENIED, "may not call Register")


def test_the_outer_optimizers_certificate_cannot_register_a_learner(system):
    outer = Peer(system, Security.from_dir(system.tls / "outer"))
    refused(system, lambda: system.register(0, peer=outer), grpc.StatusCode.PERMISSION_DENIED, "may not call Register")


# ---------------------------------------------------------------- limits
def test_a_stream_with_more_messages_than_its_payload_needs_is_refused(system):
    header, payload = system.delta(0, seq=99)

    def flood():
        yield outer_pb2.DeltaChunk(header=header, data=bytes(payload[:10]))
        for _ in range(len(payload)):  # one message per byte, or none at all: many more than 4 KiB chunks
            yield outer_pb2.DeltaChunk(data=b"")

    refused(system, lambda: system.learners[0].outer.PushDelta(flood(), timeout=30),
            grpc.StatusCode.INVALID_ARGUMENT, "messages for its payload")


def test_a_learner_pushing_faster_than_its_limit_is_slowed_down(system):
    """Header-only pushes (the cheapest a caller can make) from learner 2, as fast as it can:
    past the burst the outer optimizer answers RESOURCE_EXHAUSTED, before reading a payload."""
    header, _ = system.delta(2, seq=99)
    codes = []
    for _ in range(int(CALLS_PER_S * 20)):
        try:
            system.learners[2].outer.PushDelta(iter([outer_pb2.DeltaChunk(header=header)]), timeout=10)
        except grpc.RpcError as exc:
            codes.append(exc.code())
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert "calls/s" in exc.details()
                break
    assert codes[-1] == grpc.StatusCode.RESOURCE_EXHAUSTED, codes[-5:]
    # the others are not slowed down by learner 2
    assert system.push(system.learners[0], *system.delta(0)).outcome == outer_pb2.PUSH_OUTCOME_ACCEPTED


# ---------------------------------------------------------------- revocation
def test_a_revoked_certificate_is_shut_out_within_one_lease(system):
    from support import wait_until

    system.heartbeat(3)
    assert system.push(system.learners[3], *system.delta(3)).outcome == outer_pb2.PUSH_OUTCOME_ACCEPTED
    revoke(system.tls, name="learner-3")
    revoked_at = time.monotonic()

    def heartbeat_refused():
        try:
            system.heartbeat(3)
        except grpc.RpcError as exc:
            return exc
        return None

    def pull_refused():
        try:
            system.pull(3)
        except grpc.RpcError as exc:
            return exc
        return None

    # each server re-reads the list on its own schedule, at most DENY_RELOAD_S apart
    exc = wait_until(heartbeat_refused, 2 * auth.DENY_RELOAD_S + 5, "the coordinator to reload its deny list")
    assert exc.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in exc.details()
    exc = wait_until(pull_refused, 2 * auth.DENY_RELOAD_S + 5, "the outer optimizer to reload its deny list")
    assert exc.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in exc.details()
    header, payload = system.delta(3)  # read as learner 1: learner 3 may not pull any more
    refused(system, lambda: system.push(system.learners[3], header, payload), grpc.StatusCode.UNAUTHENTICATED, "revoked")

    def dead():
        m = system.operator.coordinator.GetMembership(coordinator_pb2.GetMembershipRequest(), timeout=10)
        return not next(x for x in m.members if x.learner_id == 3).alive

    wait_until(dead, LEASE_S + 2 * auth.DENY_RELOAD_S + 5, "the revoked learner's lease to run out")
    assert time.monotonic() - revoked_at <= LEASE_S + 2 * auth.DENY_RELOAD_S + 5
    # a new certificate for the same id (a re-imaged machine) is let back in
    issue(system.tls, "learner-3", "learner")
    system.learners[3] = Peer(system, Security.from_dir(system.tls / "learner-3"))
    system.tokens.pop(3)
    assert system.register(3).learner_id == 3
