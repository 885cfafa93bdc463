"""The coordinator over real sockets: ids and shards, leases, rejoin, health, reflection.

The two tests that leave nothing another could see (refusals of an unknown learner and of
another run, reflection) share one coordinator; the others each start their own, as they
count on a membership, outer registrations or leases of their own (the first, on an outer
optimizer not yet known)."""

from __future__ import annotations

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ddiloco.common.config import RunConfig
from ddiloco.common.rpc import channel
from ddiloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc


from coord_helpers import LONG_LEASE, coordinator, register, running_coordinator  # noqa: F401 - fixture


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    with running_coordinator(tmp_path_factory.mktemp("shared"), LONG_LEASE) as running:
        yield running


def test_learners_wait_until_the_outer_optimizer_is_known(coordinator):
    _, stub = coordinator
    with pytest.raises(grpc.RpcError) as info:
        register(stub)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "outer optimizer" in info.value.details()


def test_ids_and_shards_are_assigned_and_config_is_served(coordinator):
    _, stub = coordinator
    stub.RegisterService(coordinator_pb2.RegisterServiceRequest(run_id="run", kind="outer", address="127.0.0.1:9"), timeout=5)
    got = [register(stub) for _ in range(4)]
    assert [r.learner_id for r in got] == [0, 1, 2, 3]
    assert [r.shard_index for r in got] == [0, 1, 2, 0]  # shards wrap beyond M=3
    cfg = RunConfig.from_json(got[0].config_json)
    assert cfg.learners == 3 and cfg.model.d_model == 64
    assert got[0].outer_address == "127.0.0.1:9"
    m = stub.GetMembership(coordinator_pb2.GetMembershipRequest(), timeout=5)
    assert m.state == coordinator_pb2.RUN_STATE_RUNNING
    assert [x.alive for x in m.members] == [True] * 4


def test_a_silent_learner_loses_its_lease_and_its_id_goes_to_the_next_newcomer(coordinator):
    from support import wait_until

    _, stub = coordinator
    stub.RegisterService(coordinator_pb2.RegisterServiceRequest(run_id="run", kind="outer", address="127.0.0.1:9"), timeout=5)
    a, b = register(stub, token="process-a"), register(stub)

    def b_dead_while_a_beats():
        stub.Heartbeat(coordinator_pb2.HeartbeatRequest(run_id="run", learner_id=a.learner_id, stats=common_pb2.LearnerStats(tokens=256, inner_steps=1),
                                                        instance_token="process-a"), timeout=5)
        m = stub.GetMembership(coordinator_pb2.GetMembershipRequest(), timeout=5)
        alive = {x.learner_id: x.alive for x in m.members}
        return alive[a.learner_id] and not alive[b.learner_id]

    wait_until(b_dead_while_a_beats, 20, "learner b's lease to expire", interval=0.3)
    newcomer = register(stub)
    assert newcomer.learner_id == b.learner_id and newcomer.shard_index == b.shard_index
    again = register(stub, requested=a.learner_id, token="process-a")  # the same process rejoining keeps its id
    assert again.learner_id == a.learner_id
    m = stub.GetMembership(coordinator_pb2.GetMembershipRequest(), timeout=5)
    assert {x.learner_id: x.incarnation for x in m.members}[a.learner_id] == 1  # and its incarnation
    assert {x.learner_id: x.incarnation for x in m.members}[b.learner_id] == 2  # a new process is a new one


def test_unknown_learner_heartbeat_and_wrong_run_are_refused(shared):
    _, stub = shared
    with pytest.raises(grpc.RpcError) as info:
        stub.Heartbeat(coordinator_pb2.HeartbeatRequest(run_id="run", learner_id=42, instance_token="t"), timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    stub.RegisterService(coordinator_pb2.RegisterServiceRequest(run_id="run", kind="outer", address="127.0.0.1:9"), timeout=5)
    with pytest.raises(grpc.RpcError) as info:
        register(stub, run_id="other")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_reflection_lists_the_services(shared):
    cluster, _ = shared
    stub = reflection_pb2_grpc.ServerReflectionStub(channel(cluster.coordinator_address))
    resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
    names = {s.name for s in resp.list_services_response.service}
    assert {"ddiloco.v1.Coordinator", "grpc.health.v1.Health"} <= names


def test_heartbeats_count_outer_registrations_so_a_restart_at_the_same_address_shows(coordinator):
    """An outer optimizer restarted on a fixed port registers at the address it had: only the
    count of registrations, in every heartbeat answer, tells a learner it came back."""
    _, stub = coordinator
    outer = coordinator_pb2.RegisterServiceRequest(run_id="run", kind="outer", address="127.0.0.1:9")
    stub.RegisterService(outer, timeout=5)
    me = register(stub, token="me")

    def beat():
        return stub.Heartbeat(coordinator_pb2.HeartbeatRequest(run_id="run", learner_id=me.learner_id, instance_token="me"),
                              timeout=5)

    first = beat()
    assert (first.outer_address, first.outer_registrations) == ("127.0.0.1:9", 1)
    assert beat().outer_registrations == 1, "unchanged while the outer optimizer stays up"
    stub.RegisterService(outer, timeout=5)  # the restarted process, same address
    again = beat()
    assert (again.outer_address, again.outer_registrations) == ("127.0.0.1:9", 2)


def test_state_survives_a_coordinator_restart(coordinator):
    """Membership is persisted: a new coordinator process on the same run folder knows
    the learners and the outer optimizer."""
    from support import TINY_RUN, wait_serving

    cluster, stub = coordinator
    stub.RegisterService(coordinator_pb2.RegisterServiceRequest(run_id="run", kind="outer", address="127.0.0.1:9"), timeout=5)
    answers = [register(stub, token=f"process-{k}") for k in range(2)]
    ids = [a.learner_id for a in answers]
    instance = answers[0].run_instance
    assert len(instance) == 16 and answers[1].run_instance == instance
    cluster.stop_all()
    cluster.procs.clear()
    cluster.start_coordinator([*TINY_RUN, "--learners", "3", "--max-seconds", "600"])
    wait_serving(cluster.coordinator_address)
    stub2 = coordinator_pb2_grpc.CoordinatorStub(channel(cluster.coordinator_address))
    m = stub2.GetMembership(coordinator_pb2.GetMembershipRequest(), timeout=5)
    assert [x.learner_id for x in m.members] == ids
    assert m.outer_address == "127.0.0.1:9"
    assert m.state == coordinator_pb2.RUN_STATE_RUNNING
    beat = stub2.Heartbeat(coordinator_pb2.HeartbeatRequest(run_id="run", learner_id=ids[0], instance_token="process-0"),
                           timeout=5)
    assert beat.outer_registrations == 1, "the count of outer registrations is persisted too"
    # the same run: a learner restarted now takes back the AdamW state it kept (inner_state)
    assert register(stub2, token="process-2").run_instance == instance


def test_a_new_run_of_the_same_id_is_another_run_instance(tmp_path):
    """Runs share ids ("run" unless named): a learner's saved AdamW state is keyed by the
    run instance, which a coordinator draws when its run starts afresh."""
    from coord_helpers import announce_outer, running_coordinator

    instances = []
    for folder in ("first", "second"):
        with running_coordinator(tmp_path / folder) as (_, stub):
            announce_outer(stub)
            instances.append(register(stub).run_instance)
    assert instances[0] != instances[1] and all(len(i) == 16 for i in instances)


def test_the_cli_serves_on_the_fixed_port_it_is_given(tmp_path):
    """As in Compose and Swarm (--bind=0.0.0.0:50051): the service binds its port once. A
    second service built in the same process (a merge once left two) fails on a fixed port,
    never on the port 0 the other tests use."""
    import socket
    import subprocess
    import sys

    from support import check, wait_until

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddiloco", "coordinator", "--bind", f"127.0.0.1:{port}", "--learners", "1",
         "--model", "tiny", "--run-dir", str(tmp_path), "--insecure"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_until(lambda: proc.poll() is not None or check(f"127.0.0.1:{port}", timeout=1.0)[0], 60, "serving or exited")
        assert proc.poll() is None, f"the coordinator exited {proc.returncode} instead of serving: {proc.communicate()[0][-2000:]}"
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


def test_the_cli_refuses_to_serve_without_tls_unless_told_insecure(tmp_path):
    """Secure by default: neither --tls-dir nor --insecure is a one-line error, not plaintext."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco", "coordinator", "--bind", "127.0.0.1:0", "--model", "tiny"],
        capture_output=True, text=True, timeout=60, env={k: v for k, v in __import__("os").environ.items() if k != "DDILOCO_TLS_DIR"},
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("ddiloco coordinator: error: no --tls-dir")
