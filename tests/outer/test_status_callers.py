"""Who may name a learner in a status read, over mutual TLS against a real coordinator and
outer optimizer (the certificates ``ddiloco run`` makes).

Anyone of the run may read the outer optimizer's status. A learner process reading where it
resumes names itself (``StatusRequest.learner_id`` and ``incarnation``): that read is
rate-limited per learner and may make the outer optimizer ask the coordinator about the id.
Only a learner's certificate may name a learner (its own): the operator, the outer
optimizer's and the coordinator's certificates are PERMISSION_DENIED whatever id they name,
however often (they used to be limited per id they named, so varying it was never limited,
and each unknown id cost a call to the coordinator), and the learner's own limit is its
own."""

from __future__ import annotations

import json
import secrets

import grpc
import pytest

from ddiloco.common.certs import setup_run
from ddiloco.common.config import RunConfig
from ddiloco.common.rpc import channel
from ddiloco.common.security import Security
from ddiloco.coordinator.signature import model_signature
from ddiloco.v1 import coordinator_pb2, coordinator_pb2_grpc, outer_pb2, outer_pb2_grpc

RUN = "status-callers"
CALLS_PER_S = 2.0  # the outer optimizer's per-learner limit in this run: burst 4
BURST = 4


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    from support import TINY_RUN, wait_until

    from ddiloco.common.health import check
    from ddiloco.launcher.processes import Cluster

    out = tmp_path_factory.mktemp("status-callers")
    tls = out / "tls"
    setup_run(tls, 2)
    config = out / "limits.json"
    config.write_text(json.dumps({"outer": {"learner_calls_per_s": CALLS_PER_S}}))
    cluster = Cluster(out, tls=tls)
    cluster.start_coordinator(["--config", str(config), *TINY_RUN, "--learners", "2", "--max-seconds", "600", "--run-id", RUN])
    try:
        cluster.start_outer()
        wait_until(cluster.registered_outer, 120, "the outer optimizer to register")
        operator = Security.from_dir(tls / "operator")
        wait_until(lambda: check(cluster.outer_address, timeout=1.0, security=operator)[0], 120, "the outer optimizer to serve")
        yield cluster, tls
    finally:
        cluster.stop_all()


def _outer(cluster, tls, name: str):
    return outer_pb2_grpc.OuterOptimizerStub(channel(cluster.outer_address, Security.from_dir(tls / name), "outer"))


def _register(cluster, tls, name: str) -> coordinator_pb2.RegisterResponse:
    stub = coordinator_pb2_grpc.CoordinatorStub(channel(cluster.coordinator_address, Security.from_dir(tls / name), "coordinator"))
    config = RunConfig.from_json(stub.GetRunConfig(coordinator_pb2.GetRunConfigRequest(), timeout=10).config_json)
    return stub.Register(
        coordinator_pb2.RegisterRequest(address="x:1", requested_learner_id=-1, instance_token=secrets.token_hex(8),
                                        model=model_signature(config)),
        timeout=10,
    )


def test_only_a_learner_names_a_learner_in_a_status_read_and_its_limit_is_its_own(system):
    cluster, tls = system
    me = _register(cluster, tls, "learner-0")
    for name, role in (("operator", "operator"), ("outer", "outer"), ("coordinator", "coordinator")):
        stub = _outer(cluster, tls, name)
        assert stub.GetStatus(outer_pb2.StatusRequest(), timeout=10).ready  # reading is open to every role
        for i in range(3 * BURST):  # far past a learner's burst: refused for what it is, never for its rate
            lid = me.learner_id + i  # the registered learner first, then ids nobody holds
            with pytest.raises(grpc.RpcError) as info:
                stub.GetStatus(outer_pb2.StatusRequest(learner_id=lid, incarnation=me.incarnation), timeout=10)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, (info.value.code(), info.value.details())
            assert info.value.details() == (
                f"{role} {name!r} may read the status but not name a learner in it (learner_id={lid}, "
                f"incarnation={me.incarnation}): only a learner process names itself"
            )
        with pytest.raises(grpc.RpcError) as info:  # an id alone names a learner as well
            stub.GetStatus(outer_pb2.StatusRequest(learner_id=me.learner_id + 1), timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED

    # the learner reads where it resumes, with all of its own burst left, until its own limit
    mine = _outer(cluster, tls, "learner-0")
    naming = outer_pb2.StatusRequest(learner_id=me.learner_id, incarnation=me.incarnation)
    answered = 0
    with pytest.raises(grpc.RpcError) as info:
        for _ in range(100 * BURST):
            assert mine.GetStatus(naming, timeout=10).ready
            answered += 1
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (info.value.code(), info.value.details())
    assert f"GetStatus of learner {me.learner_id}:" in info.value.details()
    assert answered >= BURST
