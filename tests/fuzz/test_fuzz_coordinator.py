"""Fuzzing the coordinator over real sockets: every RPC with hostile field values.

A real coordinator runs as a process on 127.0.0.1 (TINY_RUN, M = 3, so learner ids are
[0, 6)), with a long lease so membership does not move on its own. An outer optimizer
address is announced and three learners are registered the way learners register (random
instance token, the run's model signature); learner 0 has reported some work.

Each example is one request, drawn by hypothesis (deterministic: derandomized):

* ``Register``: a valid registration plus one to three poisons, each of which alone makes
  it inadmissible: another (non-empty) run id, an instance token empty or over 128
  characters, a requested id outside [-1, 6) (any int32), an id held by a live learner
  under another token, a model signature that is missing, has a negative dimension, a
  digest that does not match its tensors, or is self-consistent but another model (any
  names, any int64 dimensions). Address and datacenter are any text.
* ``Heartbeat``: any run id, any learner id (registered or any int32), any statistics
  (every field from int64 / double extremes, NaN and infinities included), an instance
  token that is empty, a member's own or any text. These may be legitimate: an accepted one
  must be for a registered learner of this run, without a token or with its own, and must
  set exactly that learner's statistics to what was sent, nothing else.
* ``Leave``: like Heartbeat but always poisoned (another or empty run id, an id that is not
  a member, statistics that are negative, non-finite or beyond any learner's reach, e.g.
  tokens = 2^63 - 1, or the token of another process than the one holding the id), since
  an accepted Leave is a legitimate membership change.
* ``RegisterService``: another run id, a kind other than "outer", or an outer shard the run
  does not have (an accepted one would legitimately move the outer address).
* ``GetRunConfig``, ``GetMembership``; ``grpc.health.v1`` Check with any service name.

Asserted for every request: the status is OK or precise (never UNKNOWN, INTERNAL, a
deadline: see fuzz_helpers.PRECISE), no poisoned request is accepted, and after every
request the membership is exactly what it was (or, after an accepted Heartbeat, differs
only in that learner's statistics): the run state, the outer address, the member ids and
their count, each member's liveness, left flag, incarnation, shard, address, datacenter and
statistics, and the token total. At the end the coordinator answers SERVING.
"""

from __future__ import annotations

import hashlib
import pathlib
import secrets
import sys

import grpc
import pytest
from fuzz_helpers import SIZES, Calls, doubles, fuzz_settings, int32s, int64s, texts
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "coordinator"))

from coord_helpers import announce_outer, register, run_signature, start_coordinator  # noqa: E402

from ddiloco.common.rpc import channel  # noqa: E402
from ddiloco.coordinator.stats_rules import STATS_FIELDS  # noqa: E402
from ddiloco.v1 import common_pb2, coordinator_pb2  # noqa: E402

M = 3
MAX_IDS = 2 * M
DOUBLE_FIELDS = [f.name for f in common_pb2.LearnerStats.DESCRIPTOR.fields if f.type == f.TYPE_DOUBLE]
INT_FIELDS = [f for f in STATS_FIELDS if f not in DOUBLE_FIELDS]


def digest(named_shapes) -> str:
    """The signature digest, as a learner computes it (coordinator/signature.py)."""
    h = hashlib.sha256()
    for name, shape in named_shapes:
        h.update(f"{name}:{'x'.join(str(d) for d in shape)};".encode())
    return h.hexdigest()


class System:
    def __init__(self, cluster, stub) -> None:
        self.cluster, self.stub = cluster, stub
        self.run_id = stub.GetRunConfig(coordinator_pb2.GetRunConfigRequest(), timeout=5).run_id
        self.signature = run_signature(stub)
        self.health = health_pb2_grpc.HealthStub(channel(cluster.coordinator_address))
        self.ids: list[int] = []
        self.tokens: dict[int, str] = {}  # each registered learner's instance token

    def membership(self) -> coordinator_pb2.Membership:
        return self.stub.GetMembership(coordinator_pb2.GetMembershipRequest(), timeout=10)

    @staticmethod
    def view(m: coordinator_pb2.Membership) -> dict:
        """Everything refused input must leave unchanged (not ms_since_heartbeat, a clock)."""
        return {
            "state": m.state,
            "outer": m.outer_address,
            "count": len(m.members),
            "tokens": sum(x.stats.tokens for x in m.members),
            "members": {
                x.learner_id: (x.alive, x.left, x.incarnation, x.shard_index, x.address, x.datacenter,
                               x.stats.SerializeToString(deterministic=True))
                for x in m.members
            },
        }


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    cluster, stub = start_coordinator(tmp_path_factory.mktemp("fuzz-coordinator"), ["--lease-timeout", "7200", "--max-seconds", "7200"])
    s = System(cluster, stub)
    announce_outer(stub, s.run_id)
    for _ in range(M):
        token = secrets.token_hex(8)
        s.tokens[register(stub, run_id=s.run_id, token=token).learner_id] = token
    s.ids = sorted(s.tokens)
    tokens_per_step = 4 * 64  # TINY_RUN: batch 4 x context 64
    stub.Heartbeat(
        coordinator_pb2.HeartbeatRequest(
            run_id=s.run_id, learner_id=s.ids[0],
            stats=common_pb2.LearnerStats(tokens=10 * tokens_per_step, inner_steps=10, deltas_sent=2, deltas_acked=2),
            instance_token=s.tokens[s.ids[0]],
        ),
        timeout=5,
    )
    yield s
    cluster.stop_all()


# ---------------------------------------------------------------- strategies
def any_stats():
    """Any statistics: every field from its type's extremes, or left at zero."""
    fields = {n: st.one_of(st.just(0), st.integers(0, 10_000), int64s()) for n in INT_FIELDS}
    fields.update({n: st.one_of(st.just(0.0), doubles()) for n in DOUBLE_FIELDS})
    return st.fixed_dictionaries({}, optional=fields).map(lambda d: common_pb2.LearnerStats(**d))


@st.composite
def impossible_stats(draw):
    """Statistics no learner can report: one field negative, non-finite or beyond reach."""
    stats = draw(any_stats())
    name = draw(st.sampled_from(INT_FIELDS + DOUBLE_FIELDS))
    if name in DOUBLE_FIELDS:
        value = draw(st.one_of(st.sampled_from([float("nan"), float("inf"), float("-inf")]), st.floats(max_value=-1e-300)))
    else:
        # 2^62 and more: above every ceiling (tokens, bytes, versions) of a run capped at hours
        value = draw(st.one_of(st.integers(-(1 << 63), -1), st.integers(1 << 62, (1 << 63) - 1)))
    setattr(stats, name, value)
    return stats


@st.composite
def other_model(draw, s: System):
    kind = draw(st.sampled_from(["missing", "negative", "bad_digest", "other"]))
    shapes = draw(st.lists(st.tuples(texts(40), st.lists(st.integers(0, (1 << 63) - 1), max_size=4)), min_size=1, max_size=8))
    if kind == "missing":
        return kind, coordinator_pb2.ModelSignature(parameters=draw(int64s()), sha256=draw(texts(80)))
    if kind == "negative":
        i = draw(st.integers(0, len(shapes) - 1))
        shapes[i] = (shapes[i][0], shapes[i][1] + [draw(st.integers(-(1 << 63), -1))])
    tensors = [common_pb2.TensorSpec(name=n, shape=sh, dtype=draw(st.sampled_from(["float32", "", "x"]))) for n, sh in shapes]
    sha = digest(shapes)
    if kind == "bad_digest":
        sha = draw(texts(80).filter(lambda h: h != sha))
    sig = coordinator_pb2.ModelSignature(tensors=tensors, parameters=draw(int64s()), sha256=sha)
    if kind == "other" and sha == s.signature.sha256:
        sig.sha256 = "0" * 64  # the run's own model after all: make it a bad digest instead
    return kind, sig


REGISTER_POISONS = ["run_id", "token_empty", "token_long", "requested", "held", "model"]


@st.composite
def register_requests(draw, s: System):
    req = coordinator_pb2.RegisterRequest(
        run_id=draw(st.sampled_from(["", s.run_id])), address=draw(texts()), datacenter=draw(texts()),
        requested_learner_id=draw(st.one_of(st.just(-1), st.integers(0, MAX_IDS - 1))), device=draw(texts(40)),
        instance_token=secrets.token_hex(8), model=s.signature,
    )
    poisons = draw(st.lists(st.sampled_from(REGISTER_POISONS), min_size=1, max_size=3, unique=True))
    for p in poisons:
        if p == "run_id":
            req.run_id = draw(texts().filter(lambda r: r not in ("", s.run_id)))
        elif p == "token_empty":
            req.instance_token = ""
        elif p == "token_long":
            req.instance_token = draw(texts(400).filter(lambda t: len(t) > 128))
        elif p == "requested":
            req.requested_learner_id = draw(int32s().filter(lambda i: not -1 <= i < MAX_IDS))
        elif p == "held":
            req.requested_learner_id = draw(st.sampled_from(s.ids))  # live, under another token
        elif p == "model":
            _, sig = draw(other_model(s))
            req.model.CopyFrom(sig)
    if "held" in poisons and "token_empty" not in poisons and "token_long" not in poisons:
        req.instance_token = secrets.token_hex(8)
    return poisons, req


def heartbeat_requests(s: System):
    return st.builds(
        coordinator_pb2.HeartbeatRequest,
        run_id=st.one_of(st.just(s.run_id), texts()),
        learner_id=st.one_of(st.sampled_from(s.ids), int32s()),
        stats=any_stats(),
        # none (refused), a member's own (right for that member only), or any text
        instance_token=st.one_of(st.just(""), st.sampled_from([s.tokens[i] for i in s.ids]), texts()),
    )


@st.composite
def leave_requests(draw, s: System):
    req = coordinator_pb2.LeaveRequest(
        run_id=s.run_id, learner_id=draw(st.sampled_from(s.ids)), stats=draw(any_stats()), reason=draw(texts(300))
    )
    poison = draw(st.sampled_from(["run_id", "learner", "stats", "token"]))
    if poison == "run_id":
        req.run_id = draw(texts().filter(lambda r: r != s.run_id))
    elif poison == "learner":
        req.learner_id = draw(int32s().filter(lambda i: i not in s.ids))
    elif poison == "token":  # another process's (a superseded one's) or any text
        req.instance_token = draw(texts().filter(lambda t: t and t != s.tokens[req.learner_id]))
    else:
        req.stats.CopyFrom(draw(impossible_stats()))
    return poison, req


@st.composite
def register_service_requests(draw, s: System):
    req = coordinator_pb2.RegisterServiceRequest(run_id=s.run_id, kind="outer", address=draw(texts()))
    if draw(st.integers(0, 3)) == 0:
        # only the shard is wrong: the run has one outer shard, 0
        req.shard = draw(int32s().filter(lambda i: i != 0))
        return req
    if draw(st.booleans()):
        req.run_id = draw(texts().filter(lambda r: r != s.run_id))
    else:
        req.kind = draw(texts().filter(lambda k: k != "outer"))
    if draw(st.booleans()):
        req.run_id = draw(st.one_of(st.just(s.run_id), texts()))  # the kind alone is wrong now, or both
        if req.run_id == s.run_id and req.kind == "outer":
            req.kind = "inner"
    return req


def requests(s: System):
    return st.one_of(
        register_requests(s).map(lambda r: ("Register", r)),
        heartbeat_requests(s).map(lambda r: ("Heartbeat", r)),
        heartbeat_requests(s).map(lambda r: ("Heartbeat", r)),
        leave_requests(s).map(lambda r: ("Leave", r)),
        register_service_requests(s).map(lambda r: ("RegisterService", r)),
        st.just(("GetRunConfig", coordinator_pb2.GetRunConfigRequest())),
        st.just(("GetMembership", coordinator_pb2.GetMembershipRequest())),
        texts(60).map(lambda n: ("Health", health_pb2.HealthCheckRequest(service=n))),
    )


# ---------------------------------------------------------------- the test
@pytest.mark.parametrize("examples", SIZES)
def test_hostile_requests_get_precise_statuses_and_change_nothing(system, examples):
    from support import wait_serving

    s = system
    calls = Calls()
    state = {"view": s.view(s.membership()), "accepted_heartbeats": 0}
    ids_before, count_before = sorted(state["view"]["members"]), state["view"]["count"]

    @fuzz_settings(examples)
    @given(request=requests(s))
    def one(request):
        rpc, req = request
        before = state["view"]
        if rpc == "Register":
            poisons, r = req
            resp, code = calls.call(lambda: s.stub.Register(r, timeout=30))
            assert code != grpc.StatusCode.OK, f"a poisoned Register ({poisons}) was accepted: {resp}"
        elif rpc == "Heartbeat":
            _, code = calls.call(lambda: s.stub.Heartbeat(req, timeout=30))
        elif rpc == "Leave":
            _, code = calls.call(lambda: s.stub.Leave(req[1], timeout=30))
            assert code != grpc.StatusCode.OK, f"a poisoned Leave ({req[0]}) was accepted: {req[1]}"
        elif rpc == "RegisterService":
            _, code = calls.call(lambda: s.stub.RegisterService(req, timeout=30))
            assert code != grpc.StatusCode.OK, f"a wrong RegisterService was accepted: {req}"
        elif rpc == "GetRunConfig":
            resp, code = calls.call(lambda: s.stub.GetRunConfig(req, timeout=30))
            assert code == grpc.StatusCode.OK and resp.run_id == s.run_id
        elif rpc == "GetMembership":
            _, code = calls.call(lambda: s.stub.GetMembership(req, timeout=30))
            assert code == grpc.StatusCode.OK
        else:
            resp, code = calls.call(lambda: s.health.Check(req, timeout=10))
            if code == grpc.StatusCode.OK:
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
        after = s.view(s.membership())
        if rpc == "Heartbeat" and code == grpc.StatusCode.OK:
            # legitimate: a member of this run reported; only its statistics may change, to what it sent
            assert req.run_id == s.run_id and req.learner_id in s.ids, req
            assert req.instance_token in ("", s.tokens[req.learner_id]), req  # never another process's
            m = {x.learner_id: x for x in s.membership().members}[req.learner_id]
            assert m.stats == req.stats, (m.stats, req.stats)
            expected = dict(before["members"])
            expected[req.learner_id] = (*before["members"][req.learner_id][:6], after["members"][req.learner_id][6])
            assert after["members"] == expected
            assert {k: v for k, v in after.items() if k not in ("members", "tokens")} == {
                k: v for k, v in before.items() if k not in ("members", "tokens")
            }
            state["view"] = after
            state["accepted_heartbeats"] += 1
        else:
            assert after == before, f"{rpc} changed the membership: {req}"

    one()
    final = s.view(s.membership())
    assert calls.sent >= examples, calls.sent
    assert sorted(final["members"]) == ids_before and final["count"] == count_before
    assert final == state["view"]
    wait_serving(s.cluster.coordinator_address, timeout=10)
    print(
        f"\nfuzz coordinator: {calls.sent} requests ({state['accepted_heartbeats']} heartbeats accepted), "
        f"statuses {dict(sorted(calls.codes.items()))}"
    )


def test_a_self_consistent_signature_of_a_model_past_int64_is_refused_precisely(system):
    """Dimensions whose product passes 2^63 - 1 used to make the refusal message's parameter
    count overflow a ModelSignature: UNKNOWN "Value out of range" instead of the refusal."""
    s = system
    before = s.view(s.membership())
    shapes = [("w", [1 << 62, 1 << 62]), ("v", [(1 << 63) - 1] * 64)]
    sig = coordinator_pb2.ModelSignature(
        tensors=[common_pb2.TensorSpec(name=n, shape=sh, dtype="float32") for n, sh in shapes], sha256=digest(shapes)
    )
    req = coordinator_pb2.RegisterRequest(run_id=s.run_id, address="x:1", requested_learner_id=-1, instance_token="t", model=sig)
    with pytest.raises(grpc.RpcError) as exc:
        s.stub.Register(req, timeout=10)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION, exc.value.details()
    assert "model differs from the run's" in exc.value.details()
    assert s.view(s.membership()) == before
